//! Accounts as they are read: the balance, the ledger page by page or filtered, the holds and
//! exposure beside the entries, and the hash chain verified from the rows.

use super::{next_after, page_limit};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, EntryCol, entry_from_row, name};
use settle_core::ids::AccountId;
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};
use settle_core::{Credits, Timestamp};
use std::sync::LazyLock;

pub(crate) async fn account(db: &mut Db<'_>, id: &AccountId) -> Result<Account, StoreError> {
    let row = db
        .opt(&ops::SELECT_ACCOUNT, args![id.as_str()])
        .await?
        .ok_or_else(|| StoreError::not_found("account", id.as_str()))?;
    ops::account_from_row(&row)
}

/// A page of the accounts `scope` sees, in id order after `after` (`""`: from the first). The cursor
/// is the last id of the page (accounts carry no number).
pub(crate) async fn accounts(
    db: &mut Db<'_>,
    scope: &settle_core::scope::Scope,
    after: &str,
    limit: u32,
) -> Result<AccountPage, StoreError> {
    let limit = page_limit(limit);
    let mut a: Vec<crate::db::Value> = vec![after.into()];
    // An account's own rows: only the scope's accounts apply (kinds are a job's).
    let accounts_only = settle_core::scope::Scope { accounts: scope.accounts.clone(), kinds: None };
    let only = super::filter::scope_sql(&accounts_only, &mut a, "id", super::filter::Kinds::Column("kind"));
    a.push(crate::db::Value::I64(limit));
    let sql =
        format!("SELECT {} FROM accounts WHERE id > $1{only} ORDER BY id LIMIT ${}", ops::AccountCol::LIST, a.len());
    let rows = db.all_built(sql, &a).await?;
    let accounts = rows.iter().map(ops::account_from_row).collect::<Result<Vec<_>, _>>()?;
    let next_after =
        if accounts.len() as i64 == limit { accounts.last().map(|a| a.id.as_str().to_owned()) } else { None };
    Ok(AccountPage { rows: accounts, next_after })
}

// By position (`account_seq`): an account's `seq` rises with its positions, so position order is
// `seq` order, and the unique (account_id, account_seq) index serves the page (no index on
// (account_id, seq) is kept for it: migration 0025). `seq > $3` keeps the page exactly "after seq".
static LEDGER_PAGE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM ledger_entries WHERE account_id = $1 AND account_seq > $2 AND seq > $3 \
         ORDER BY account_seq LIMIT $4",
        EntryCol::LIST
    )
});

columns! {
    /// An entry's place in its account.
    PlaceCol { account_seq }
}

columns! {
    /// The entry at a place.
    NumberCol { seq }
}

columns! {
    /// The account's last place.
    LastPlaceCol { last = "last_account_seq" }
}

static OWN_PLACE: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM ledger_entries WHERE seq = $1 AND account_id = $2", PlaceCol::LIST));
static NUMBER_AT: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM ledger_entries WHERE account_id = $1 AND account_seq = $2", NumberCol::LIST)
});
static LAST_PLACE: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", LastPlaceCol::LIST));

/// Where a page of an account's entries "after `after`" (a `seq`) begins: the account's last
/// position whose `seq` is at most `after`. An account's `seq` rises with its positions (decision
/// 0021 §1; the audit checks it), so a cursor that is one of its own entries — every `next_after`
/// this API gives — is found at once, and any other number by bisection over the positions.
async fn position_after(db: &mut Db<'_>, account: &str, after: i64) -> Result<i64, StoreError> {
    if after <= 0 {
        return Ok(0);
    }
    if let Some(r) = db.opt(&OWN_PLACE, args![after, account]).await? {
        return r.i64(PlaceCol::account_seq);
    }
    let last = db.one(&LAST_PLACE, args![account]).await?;
    let (mut low, mut high) = (0, last.i64(LastPlaceCol::last)?);
    while low < high {
        let mid = low + (high - low + 1) / 2;
        let seq = match db.opt(&NUMBER_AT, args![account, mid]).await? {
            Some(r) => r.i64(NumberCol::seq)?,
            // Counted by the account row but not visible yet: past every entry this page can see.
            None => i64::MAX,
        };
        if seq <= after { low = mid } else { high = mid - 1 }
    }
    Ok(low)
}

pub(crate) async fn ledger(db: &mut Db<'_>, id: &AccountId, page: Page) -> Result<Paged<LedgerEntry>, StoreError> {
    account(db, id).await?;
    let limit = page_limit(page.limit);
    let from = position_after(db, id.as_str(), page.after).await?;
    let rows = db.all(&LEDGER_PAGE, args![id.as_str(), from, page.after, limit]).await?;
    let entries = rows.iter().map(entry_from_row::<EntryCol>).collect::<Result<Vec<_>, _>>()?;
    let next = next_after(&entries, limit, |e| e.seq);
    Ok(Paged { rows: entries, next_after: next })
}

columns! {
    /// What an account may still credit back (`held`), what a later success may reclaim, and how
    /// many entries its ledger holds (its last `account_seq`).
    HoldsCol { held, exposure, entries = "last_account_seq", debt }
}

columns! {
    /// What an account's charged items cost, still undecided.
    PendingCol { pending = "CAST(COALESCE(SUM(i.cost), 0) AS bigint)" }
}

pub(crate) async fn account_detail(db: &mut Db<'_>, id: &str) -> Result<AccountDetail, StoreError> {
    static HOLDS: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", HoldsCol::LIST));
    static PENDING: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM items i JOIN jobs j ON j.id = i.job_id WHERE j.account_id = $1 AND i.state = 'charged'",
            PendingCol::LIST
        )
    });
    let row = db.opt(&ops::SELECT_ACCOUNT, args![id]).await?.ok_or_else(|| StoreError::not_found("account", id))?;
    let account = ops::account_from_row(&row)?;
    let holds = db.one(&HOLDS, args![id]).await?;
    let entries = holds.i64(HoldsCol::entries)?;
    let pending = db.one(&PENDING, args![id]).await?.i64(PendingCol::pending)?;
    let (held, exposure) = (holds.i64(HoldsCol::held)?, holds.i64(HoldsCol::exposure)?);
    let debt = holds.i64(HoldsCol::debt)?;
    Ok(AccountDetail { account, held, exposure, pending, entries, debt })
}

columns! {
    /// An entry as the hash chain covers it (the account is the one asked for), with the hashes.
    ChainCol { seq, account_seq, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, prev_hash, hash }
}

/// The account's chain recomputed from genesis in `account_seq` order, as the audit does for every
/// account: the first entry whose hash, predecessor or position (1, 2, 3, …) is wrong.
pub(crate) async fn verify_chain(db: &mut Db<'_>, id: &str) -> Result<Option<i64>, StoreError> {
    static CHAIN: LazyLock<String> = LazyLock::new(|| {
        format!("SELECT {} FROM ledger_entries WHERE account_id = $1 ORDER BY account_seq", ChainCol::LIST)
    });
    db.opt("SELECT id FROM accounts WHERE id = $1", args![id])
        .await?
        .ok_or_else(|| StoreError::not_found("account", id))?;
    let (mut prev, mut chain_break, mut position): (Hash32, Option<i64>, i64) = (GENESIS_HASH, None, 0);
    db.each(&CHAIN, args![id], |r| {
        use ChainCol as C;
        let seq = r.i64(C::seq)?;
        let account_seq = r.i64(C::account_seq)?;
        if chain_break.is_none() && account_seq != position + 1 {
            chain_break = Some(seq);
        }
        position = account_seq;
        let kind = name(EntryKind::parse, "entry kind", r.text(C::kind)?)?;
        let (job_id, item_id) = (r.opt_text(C::job_id)?, r.opt_text(C::item_id)?);
        let (ref_id, reason) = (r.opt_text(C::ref_id)?, r.opt_text(C::reason)?);
        let fields = EntryFields {
            seq,
            account_id: id,
            kind,
            amount: r.i64(C::amount)?,
            balance_after: r.i64(C::balance_after)?,
            job_id: job_id.as_deref(),
            item_id: item_id.as_deref(),
            ref_id: ref_id.as_deref(),
            reason: reason.as_deref(),
            created_at: r.i64(C::created_at)?,
        };
        let (stored_prev, stored) = (r.bytes(C::prev_hash)?, r.bytes(C::hash)?);
        let computed = chain_hash(&prev, &fields);
        if chain_break.is_none() && (stored_prev != prev.as_slice() || stored != computed.as_slice()) {
            chain_break = Some(seq);
        }
        prev = stored.try_into().unwrap_or(computed);
        Ok(())
    })
    .await?;
    Ok(chain_break)
}

/// One page of an account's entries, optionally of one kind and from a time on, in `seq` order.
pub(crate) async fn entries(
    db: &mut Db<'_>,
    account: &str,
    kind: Option<EntryKind>,
    since: Option<Timestamp>,
    page: Page,
) -> Result<Paged<LedgerEntry>, StoreError> {
    db.opt("SELECT id FROM accounts WHERE id = $1", args![account])
        .await?
        .ok_or_else(|| StoreError::not_found("account", account))?;
    let limit = i64::from(page.limit.clamp(1, settle_core::limits::PAGE_LIMIT_MAX));
    let from = position_after(db, account, page.after).await?;
    let rows = db
        .all_built(
            format!(
                "SELECT {} FROM ledger_entries WHERE account_id = $1 AND account_seq > $6 AND seq > $2 \
                 AND (CAST($3 AS TEXT) IS NULL OR kind = $3) AND created_at >= $4 ORDER BY account_seq LIMIT $5",
                EntryCol::LIST
            ),
            args![account, page.after, kind.map(|k| k.as_str()), since.map_or(i64::MIN, |t| t.micros()), limit, from],
        )
        .await?;
    let entries = rows.iter().map(entry_from_row::<EntryCol>).collect::<Result<Vec<_>, _>>()?;
    let next = if entries.len() as i64 == limit { entries.last().map(|e| e.seq) } else { None };
    Ok(Paged { rows: entries, next_after: next })
}

columns! {
    /// A source of an account's credit, as listed.
    GrantCol { key, source_id, origin, amount, remaining, priority, expires_at, expired_at, created_at }
}

/// An account's grants in the order they were made, page by page (`after`: a grant's key).
pub(crate) async fn grants(
    db: &mut Db<'_>,
    id: &AccountId,
    now: Timestamp,
    page: Page,
) -> Result<Paged<Grant>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!("SELECT {} FROM grants WHERE account_id = $1 AND key > $2 ORDER BY key LIMIT $3", GrantCol::LIST)
    });
    account(db, id).await?;
    let limit = page_limit(page.limit);
    let rows = db.all(&SQL, args![id.as_str(), page.after, limit]).await?;
    let mut keyed = Vec::with_capacity(rows.len());
    for r in &rows {
        let expires_at = r.opt_i64(GrantCol::expires_at)?.map(Timestamp::from_micros);
        let expired_at = r.opt_i64(GrantCol::expired_at)?.map(Timestamp::from_micros);
        let remaining = Credits::new(r.i64(GrantCol::remaining)?);
        let state = if expired_at.is_some() || expires_at.is_some_and(|at| at <= now) {
            GrantState::Expired
        } else if remaining == Credits::ZERO {
            GrantState::Used
        } else {
            GrantState::Active
        };
        let grant = Grant {
            id: r.text(GrantCol::source_id)?,
            origin: r.text(GrantCol::origin)?,
            amount: Credits::new(r.i64(GrantCol::amount)?),
            // What a grant past its instant still holds is no longer the account's to spend.
            remaining: if state == GrantState::Expired { Credits::ZERO } else { remaining },
            priority: r.i64(GrantCol::priority)?,
            expires_at,
            expired_at,
            state,
            created_at: Timestamp::from_micros(r.i64(GrantCol::created_at)?),
        };
        keyed.push((r.i64(GrantCol::key)?, grant));
    }
    let next = next_after(&keyed, limit, |(k, _)| *k);
    Ok(Paged { rows: keyed.into_iter().map(|(_, g)| g).collect(), next_after: next })
}

columns! {
    /// A part of a movement and the source that paid it.
    AllocationCol {
        grant_id = "g.source_id", origin = "g.origin", kind = "a.kind", job_id = "a.job_id",
        item_id = "a.item_id", taken = "a.taken", given_back = "a.given_back",
    }
}

fn job_allocations_sql(job: &str) -> String {
    format!(
        "SELECT {} FROM allocations a LEFT JOIN grants g ON g.key = a.grant_key WHERE {job} ORDER BY a.id",
        AllocationCol::LIST
    )
}
static JOB_ALLOCATIONS: LazyLock<String> = LazyLock::new(|| job_allocations_sql("a.job_id = $1"));
/// SQLite's: parts are filed by their job's number (migration 0037).
pub(crate) static JOB_ALLOCATIONS_LITE: LazyLock<String> =
    LazyLock::new(|| job_allocations_sql("a.job_seq = (SELECT job_seq FROM jobs WHERE id = $1)"));

/// Which sources of credit paid for a job's items, in the order they were taken.
pub(crate) async fn job_allocations(db: &mut Db<'_>, job: &str) -> Result<Vec<Allocation>, StoreError> {
    let sql = if db.engine() == crate::db::Engine::Sqlite { &*JOB_ALLOCATIONS_LITE } else { &*JOB_ALLOCATIONS };
    let rows = db.all(sql, args![job]).await?;
    rows.iter()
        .map(|r| {
            Ok(Allocation {
                grant_id: r.opt_text(AllocationCol::grant_id)?,
                origin: r.opt_text(AllocationCol::origin)?,
                kind: r.text(AllocationCol::kind)?,
                job_id: r.opt_text(AllocationCol::job_id)?,
                item_id: r.opt_text(AllocationCol::item_id)?,
                taken: Credits::new(r.i64(AllocationCol::taken)?),
                given_back: Credits::new(r.i64(AllocationCol::given_back)?),
            })
        })
        .collect()
}

columns! {
    /// An account with a grant due.
    DueAccountCol { id, next_expiry }
}

/// Accounts with a grant due at `now`, soonest first: `(next_expiry, id)`.
pub(crate) async fn accounts_due(db: &mut Db<'_>, now: Timestamp, limit: u32) -> Result<Vec<String>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        // The literal bound lets SQLite use the partial index of accounts with a grant to expire.
        format!(
            "SELECT {} FROM accounts WHERE next_expiry <= $1 AND next_expiry < 9223372036854775807 \
             ORDER BY next_expiry LIMIT $2",
            DueAccountCol::LIST
        )
    });
    let rows = db.all(&SQL, args![now.micros(), page_limit(limit)]).await?;
    rows.iter().map(|r| r.text(DueAccountCol::id)).collect()
}

/// Whether the console session of `nonce` was signed out (`ops::sign_out`).
pub(crate) async fn signed_out(db: &mut Db<'_>, nonce: &str) -> Result<bool, StoreError> {
    Ok(db.opt("SELECT 1 FROM console_signouts WHERE nonce = $1", args![nonce]).await?.is_some())
}
