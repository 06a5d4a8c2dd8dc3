//! `settle audit`: the ledger invariants L1–L9 of the spec, recomputed from the rows.
//! Reads one consistent snapshot; sums in `i128`, so a corrupt row cannot overflow the checker.

use crate::audit_apart::{Apart, v};
use crate::audit_checkpoint::{self as checkpoint, Checkpoint, JobSum, JobSums, Mark, Record, Sealed};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::{AuditReport, AuditRun, CheckpointUse, Invariant, Violation};
use settle_core::Credits;
use settle_core::item::ItemState;
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

#[derive(Clone)]
struct Acc {
    balance: i64,
    /// The account's stored count of entries (its last `account_seq`).
    entries: i64,
    /// The last `account_seq` met in the ledger pass.
    position: i64,
    /// The `seq` of the entry at `position` (0: none): an account's entries number up with their positions.
    last_seq: i64,
    exposure: i64,
    refunded_cost: i128,
    held: i64,
    held_cost: i128,
    sum: i128,
    running: i128,
    prev: Hash32,
}

/// One item and its entries, as pass B streams them (entries in seq order once the item ends).
struct ItemGroup {
    job: String,
    item: String,
    cost: i64,
    /// A held item's hold (docs/decisions/0022).
    hold: Option<i64>,
    state: String,
    job_account: String,
    job_kind: String,
    /// seq, kind, amount, account.
    entries: Vec<(i64, EntryKind, i64, String)>,
}

/// The rows of one (job, item) key as pass B's stream brings them, in any order: the item (with its
/// job) once per entry, and its allocations. `None` until the item's own row comes.
#[derive(Default)]
struct Key {
    group: Option<ItemGroup>,
    /// What its allocations still hold (taken less given back); `None`: it has none.
    open: Option<i128>,
}

/// What the audit is doing, for a progress display: `done` of about `total` rows of `phase`.
#[derive(Debug, Clone, Copy)]
pub struct AuditProgress {
    pub phase: &'static str,
    pub done: u64,
    pub total: u64,
}

/// Rows between two progress calls.
const PROGRESS_EVERY: u64 = 100_000;

columns! {
    /// An account's stored figures.
    AccountRow { id, balance, exposure, held, entries = "last_account_seq" }
}

columns! {
    /// An account's balance and alert band beside one of its alerts (none: NULLs).
    AlertRow {
        account_id = "c.id", balance = "c.balance", alert_floor = "c.alert_floor", alert_ceiling = "c.alert_ceiling",
        alert_id = "a.alert_id", below = "a.below", side = "a.side",
    }
}

columns! {
    /// A top-up with its job and its grant, for L9.
    TopUpRow {
        id = "t.job_id", account_id = "t.account_id", credits = "t.credits", open = "t.open",
        provider_charge_id = "t.provider_charge_id", kind = "j.kind", state = "j.state",
        job_account = "j.account_id", granted = "g.amount", grant_account = "g.account_id",
    }
}

columns! {
    /// A top-up job without its row, or a bought grant without its charge.
    RowlessCol { id, account_id }
}

columns! {
    /// A spend limit with the spend of the period its row carries, and its account's flag.
    LimitRow {
        account_id = "c.id", spend_limited = "c.spend_limited", limit_no = "l.limit_no", period = "l.period",
        all_kinds = "l.all_kinds", period_start = "l.period_start", spent = "l.spent",
    }
}

columns! {
    /// A kind a spend limit names.
    LimitKindRow { account_id, limit_no, kind }
}

columns! {
    /// A spend line of an account with limits: its amount, date and job's kind.
    SpendLineRow { account_id = "e.account_id", amount = "e.amount", created_at = "e.created_at", kind = "j.kind" }
}

columns! {
    /// A job and item some ledger entry names.
    NamedItemRow { job_id = "e.job_id", item_id = "e.item_id" }
}

columns! {
    /// A ledger line or allocation filed under a job it is not: which (1 a line, 2 a part), its
    /// number or id, the job it names, the number it carries, and the job of that number (none: no
    /// such job, or no number).
    MisfiledMoneyRow { what, id, account_id, job_id, job_seq, owner }
}

columns! {
    /// An account's anchor: what the checkpoint proved of its line at its position, and that line now.
    AnchorRow {
        account_id = "c.account_id", position = "c.position", last_seq = "c.last_seq", hash = "c.hash",
        seq = "e.seq", kind = "e.kind", amount = "e.amount", balance_after = "e.balance_after", job_id = "e.job_id",
        item_id = "e.item_id", ref_id = "e.ref_id", reason = "e.reason", created_at = "e.created_at",
        prev_hash = "e.prev_hash", entry_hash = "e.hash",
    }
}

columns! {
    /// What pass A reads of each ledger entry.
    EntryRow {
        seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, created_at, prev_hash, hash, ref_id,
        reason, job_seq,
    }
}

columns! {
    /// What pass B reads: an item, its job, and one of its entries (none: `entry_seq` NULL), `src`
    /// 1; or what one of its allocations still holds (`entry_amount`), `src` 2 (the other columns
    /// NULL) — one stream, ordered by (job, item).
    ItemRow {
        job_id = "i.job_id", item_id = "i.item_id", src = "CAST(1 AS bigint)", cost = "i.cost", hold = "i.hold",
        state = "i.state", job_account = "j.account_id", job_kind = "j.kind",
        entry_seq = "e.seq", entry_kind = "e.kind", entry_amount = "e.amount", entry_account = "e.account_id",
        entry_job = "e.job_id", entry_position = "e.account_seq",
    }
}

columns! {
    /// A grant as L5 reads it.
    GrantRow { key, account_id, origin, source_id, amount, remaining, spent, expiry_key, expires_at, expired_at, expired_seq }
}

columns! {
    /// An allocation as L5 reads it.
    AllocationRow {
        id, account_id, grant_key, kind, account_seq, taken, given_back, settled, paid_part, owed, job_id, job_seq, created_at,
    }
}

columns! {
    /// An `expire` entry.
    ExpiryRow { account_id, ref_id, amount, account_seq }
}

columns! {
    /// An account's debt beside its balance, and its next expiry.
    DebtRow { id, balance, debt, next_expiry }
}

/// Every `expire` entry, in `seq` order. Each names its grant (`ref_id`): the references' partial
/// index finds them without reading the ledger (plan-tested).
pub(crate) static EXPIRIES: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM ledger_entries WHERE kind = 'expire' AND ref_id IS NOT NULL ORDER BY seq", ExpiryRow::LIST)
});

/// The allocations pass's statement: every part, or those whose ids are in `[from, to)`.
fn parts_sql(ids: Option<(i64, Option<i64>)>) -> std::borrow::Cow<'static, str> {
    static PARTS: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM allocations ORDER BY id", AllocationRow::LIST));
    let Some((from, to)) = ids else { return std::borrow::Cow::Borrowed(PARTS.as_str()) };
    // Integers, written into the statement: a copy takes no parameters.
    let below = to.map(|to| format!(" AND id < {to}")).unwrap_or_default();
    let list = AllocationRow::LIST;
    std::borrow::Cow::Owned(format!("SELECT {list} FROM allocations WHERE id >= {from}{below} ORDER BY id"))
}

/// One grant's figures as L5 adds them up.
#[derive(Default, Clone)]
#[cfg_attr(test, derive(Debug))]
struct GrantTally {
    account: String,
    source: String,
    amount: i64,
    remaining: i64,
    expiry_key: i64,
    expires_at: Option<i64>,
    live: bool,
    expired_seq: Option<i64>,
    consumed: i128,
    returned: i128,
    expired: i128,
    /// The last position that took from it.
    last_take: i64,
    /// Its own `expire` entries (not those of parts returned after it expired) and the last one's position.
    expire_entries: u32,
    expire_seq: Option<i64>,
}

/// Per debt part that says something of it is paid: its account, what it says is paid, what its
/// open settlements pay. A store's debt parts are mostly unpaid (an overdrawn account's charges):
/// those are not kept; a settlement that names one is kept aside (`Unmatched`) and its part looked
/// up by id after the pass.
type Settled = BTreeMap<i64, (String, i128, i128)>;

/// Settlements whose debt part was not in `Settled` when met: (settlement, part, its account, what
/// it pays).
pub(crate) type Unmatched = Vec<(i64, i64, String, i128)>;

/// A debt part (taken from no grant): what it still owes into its account's unpaid debt, and, when
/// it says something of it is paid, that beside its settlements (kept with its account, for the
/// settlements that name it: one of another account's is named).
fn debt_part(
    (unpaid, settled): (&mut BTreeMap<String, i128>, &mut Settled),
    account: &str,
    id: i64,
    open: i128,
    part_settled: i128,
) {
    match unpaid.get_mut(account) {
        Some(sum) => *sum += open - part_settled,
        None => _ = unpaid.insert(account.to_owned(), open - part_settled),
    }
    if part_settled != 0 {
        settled.entry(id).or_insert_with(|| (account.to_owned(), 0, 0)).1 += part_settled;
    }
}

/// A settlement (a grant's part that paid debt part `paid`): what it pays into the part's
/// settlements, judged against the part's account; set aside when the part was not kept.
fn settlement(
    (settled, unmatched, found): (&mut Settled, &mut Unmatched, &mut Vec<(String, String)>),
    id: i64,
    paid: i64,
    account: &str,
    pays: i128,
) {
    match settled.get_mut(&paid) {
        Some(part) => {
            part.2 += pays;
            if part.0 != account {
                found.push((account.to_owned(), format!("settlement {id} pays {}'s debt part {paid}", part.0)));
            }
        }
        None => unmatched.push((id, paid, account.to_owned(), pays)),
    }
}

columns! {
    /// A debt part named by a settlement: its account, and whether it is one (no grant).
    NamedPart { id, account_id, grant_key }
}

/// The parts `unmatched` settlements name, by id, in the audit's snapshot; then each settlement
/// judged as if its part had been kept: a part of another account is named, and what the part
/// says is paid (nothing, or it would have been kept) against what they pay. A part that is not a
/// debt part, or that does not exist, is judged as kept with its first settlement's account, as
/// the pass did before it kept only paid parts.
async fn match_settlements(
    db: &mut Db<'_>,
    unmatched: Unmatched,
    settled: &mut Settled,
    found: &mut Vec<(String, String)>,
) -> Result<(), StoreError> {
    static ONE: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM allocations WHERE id = $1", NamedPart::LIST));
    static MANY: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM allocations WHERE id = ANY($1)", NamedPart::LIST));
    // A clean store has such settlements where a settled debt was refunded back to nothing said
    // paid (each then pays nothing): looked up by a few thousand ids a statement on PostgreSQL,
    // one seek each on SQLite.
    let parts: BTreeSet<i64> = unmatched.iter().map(|u| u.1).filter(|p| !settled.contains_key(p)).collect();
    let mut rows = Vec::new();
    match db.engine() {
        Engine::Postgres => {
            let parts: Vec<i64> = parts.into_iter().collect();
            for chunk in parts.chunks(10_000) {
                rows.extend(db.all(&MANY, &[Value::I64s(chunk.to_vec())]).await?);
            }
        }
        Engine::Sqlite => {
            for part in parts {
                rows.extend(db.opt(&ONE, args![part]).await?);
            }
        }
    }
    let mut owners: BTreeMap<i64, String> = BTreeMap::new();
    for r in rows {
        if r.opt_i64(NamedPart::grant_key)?.is_none() {
            owners.insert(r.i64(NamedPart::id)?, r.text(NamedPart::account_id)?);
        }
    }
    for (id, part, account, pays) in unmatched {
        let owner = owners.get(&part).cloned();
        let entry = settled.entry(part).or_insert_with(|| (owner.unwrap_or_else(|| account.clone()), 0, 0));
        entry.2 += pays;
        if entry.0 != account {
            found.push((account, format!("settlement {id} pays {}'s debt part {part}", entry.0)));
        }
    }
    Ok(())
}

impl GrantTally {
    /// L5's last clause: nothing is taken by a posting stamped at or after the grant's `expires_at`
    /// — every posting expires what is due first (the clock guard on the balance UPDATE), so such a
    /// take spent credit already dead.
    fn late_take(&self, taken: i128, at: i64, job: Option<&str>) -> Option<String> {
        let expires_at = self.expires_at.filter(|e| at >= *e)?;
        Some(format!(
            "grant {}: {taken} taken by a posting at {at} µs, at or after its expiry at {expires_at} µs (job {})",
            self.source,
            job.unwrap_or_default()
        ))
    }
}

/// L5's tallies: every grant's, every debt part's, every account's unpaid debt; and what is wrong,
/// by account.
#[derive(Default)]
#[cfg_attr(test, derive(Debug))]
pub(crate) struct L5 {
    grants: BTreeMap<i64, GrantTally>,
    /// A grant (origin `grant`) by its id, for its `expire` entries.
    by_source: BTreeMap<String, i64>,
    unpaid: BTreeMap<String, i128>,
    settled: Settled,
    found: Vec<(String, String)>,
    /// Parts that name a job (the items pass should meet each once), and parts that carry a job's
    /// number but name none: what tells the audit to look for misfiled parts (`money_filed`).
    pub(crate) job_parts: u64,
    pub(crate) stray_numbers: u64,
    /// Parts that carry a job's number.
    pub(crate) numbered_parts: u64,
    /// From a checkpoint: parts naming a job after their account's position in it, and their jobs;
    /// parts after it that carry a job's number.
    pub(crate) job_parts_after: u64,
    pub(crate) parts_after_jobs: BTreeSet<String>,
    pub(crate) numbered_parts_after: u64,
    /// Takes stamped at or after their grant's expiry (the first 100), reported after the expiries.
    late: Vec<(String, String)>,
}

impl L5 {
    async fn load(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static GRANTS: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM grants ORDER BY key", GrantRow::LIST));
        for r in &db.all(&GRANTS, args![]).await? {
            use GrantRow as C;
            let key = r.i64(C::key)?;
            if r.text(C::origin)? == settle_core::ledger::GrantOrigin::Grant.as_str() {
                self.by_source.insert(r.text(C::source_id)?, key);
            }
            // `spent` is the burn-down index's predicate (migration 0025): a grant marked spent
            // with something left would never be charged again; one marked live with nothing left
            // would be read by every charge.
            let (remaining, spent) = (r.i64(C::remaining)?, r.i64(C::spent)?);
            if spent != i64::from(remaining == 0) {
                let account = r.text(C::account_id)?;
                self.found.push((account, format!("grant {key} has {remaining} left but is marked spent = {spent}")));
            }
            let tally = GrantTally {
                account: r.text(C::account_id)?,
                source: r.text(C::source_id)?,
                amount: r.i64(C::amount)?,
                remaining: r.i64(C::remaining)?,
                expiry_key: r.i64(C::expiry_key)?,
                expires_at: r.opt_i64(C::expires_at)?,
                live: r.opt_i64(C::expired_at)?.is_none(),
                expired_seq: r.opt_i64(C::expired_seq)?,
                ..GrantTally::default()
            };
            self.grants.insert(key, tally);
        }
        Ok(())
    }

    /// Every allocation: into its grant's consumed and returned, its debt part's unpaid rest, or
    /// the settlements of the debt part it paid.
    /// `positions`: from a checkpoint, each account's position in it — the parts after it, and their
    /// jobs, are counted apart (pass B checks those jobs again, and should meet those parts).
    pub(crate) async fn parts(
        &mut self,
        db: &mut Db<'_>,
        positions: Option<&BTreeMap<String, i64>>,
    ) -> Result<(), StoreError> {
        let unmatched = self.parts_in(db, positions, None).await?;
        self.settle(db, unmatched).await
    }

    /// The parts whose ids are in `[from, to)` (`None`: every part; `to` `None`: to the last), in
    /// id order, into these tallies; returns the settlements whose debt part it did not keep, for
    /// [`L5::settle`] once every range is in.
    pub(crate) async fn parts_in(
        &mut self,
        db: &mut Db<'_>,
        positions: Option<&BTreeMap<String, i64>>,
        ids: Option<(i64, Option<i64>)>,
    ) -> Result<Unmatched, StoreError> {
        let sql = parts_sql(ids);
        let L5 {
            grants,
            unpaid,
            settled,
            found,
            job_parts,
            stray_numbers,
            numbered_parts,
            job_parts_after,
            parts_after_jobs,
            numbered_parts_after,
            late,
            ..
        } = self;
        let mut unmatched = Unmatched::new();
        db.each_copied(sql, |r| {
            use AllocationRow as C;
            let (job, numbered) = (r.opt_str(C::job_id)?, r.opt_i64(C::job_seq)?.is_some());
            match (job, numbered) {
                (Some(_), _) => *job_parts += 1,
                (None, true) => *stray_numbers += 1,
                (None, false) => {}
            }
            if let Some(positions) = positions
                && r.i64(C::account_seq)? > positions.get(r.str(C::account_id)?).copied().unwrap_or(0)
            {
                *numbered_parts_after += u64::from(numbered);
                if let Some(job) = job {
                    *job_parts_after += 1;
                    if !parts_after_jobs.contains(job) {
                        parts_after_jobs.insert(job.to_owned());
                    }
                }
            }
            if numbered {
                *numbered_parts += 1;
            }
            let (taken, given_back) = (i128::from(r.i64(C::taken)?), i128::from(r.i64(C::given_back)?));
            let account = r.str(C::account_id)?;
            // `owed` is the unpaid-debt index's predicate (migration 0025): a debt part with
            // something unpaid that says otherwise would never be settled.
            let owes = r.opt_i64(C::grant_key)?.is_none() && taken > given_back + i128::from(r.i64(C::settled)?);
            if r.i64(C::owed)? != i64::from(owes) {
                let id = r.i64(C::id)?;
                found.push((
                    account.to_owned(),
                    format!("allocation {id} is marked owed = {} but owes {owes}", r.i64(C::owed)?),
                ));
            }
            let Some(key) = r.opt_i64(C::grant_key)? else {
                let part_settled = i128::from(r.i64(C::settled)?);
                debt_part((unpaid, settled), account, r.i64(C::id)?, taken - given_back, part_settled);
                return Ok(());
            };
            let id = r.i64(C::id)?;
            let Some(g) = grants.get_mut(&key) else {
                found.push((account.to_owned(), format!("allocation {id} of a grant {key} that does not exist")));
                return Ok(());
            };
            if g.account != account {
                found.push((
                    account.to_owned(),
                    format!("allocation {id} takes from {}'s grant {}", g.account, g.source),
                ));
            }
            g.consumed += taken;
            g.returned += given_back;
            if matches!(r.str(C::kind)?, "charge" | "reclaim" | "adjustment") {
                g.last_take = g.last_take.max(r.i64(C::account_seq)?);
                if late.len() < 100
                    && let Some(message) = g.late_take(taken, r.i64(C::created_at)?, r.opt_str(C::job_id)?)
                {
                    late.push((account.to_owned(), message));
                }
            }
            if let Some(paid) = r.opt_i64(C::paid_part)? {
                settlement((settled, &mut unmatched, found), id, paid, account, taken - given_back);
            }
            Ok(())
        })
        .await?;
        Ok(unmatched)
    }

    /// The settlements the ranges set aside, judged against their debt parts (once every range is in).
    pub(crate) async fn settle(&mut self, db: &mut Db<'_>, unmatched: Unmatched) -> Result<(), StoreError> {
        match_settlements(db, unmatched, &mut self.settled, &mut self.found).await
    }

    /// A tally for another range of the parts, read apart: the grants as loaded, nothing counted.
    pub(crate) fn fork(&self) -> L5 {
        L5 { grants: self.grants.clone(), by_source: self.by_source.clone(), ..L5::default() }
    }

    /// `other`'s tallies, of the range of parts after this one's, taken into these: each part is in
    /// one range, so each debt part's settlements entry is in one tally. Findings: this range's,
    /// then the other's, each in id order; a settlement whose debt part is in the other range is
    /// judged by [`L5::settle`] after both (its finding, if any, last).
    pub(crate) fn merge(&mut self, other: L5) {
        for (key, theirs) in other.grants {
            if let Some(g) = self.grants.get_mut(&key) {
                g.consumed += theirs.consumed;
                g.returned += theirs.returned;
                g.last_take = g.last_take.max(theirs.last_take);
            }
        }
        for (account, sum) in other.unpaid {
            *self.unpaid.entry(account).or_insert(0) += sum;
        }
        for (id, (account, says, pays)) in other.settled {
            let part = self.settled.entry(id).or_insert_with(|| (account, 0, 0));
            part.1 += says;
            part.2 += pays;
        }
        self.found.extend(other.found);
        self.job_parts += other.job_parts;
        self.stray_numbers += other.stray_numbers;
        self.numbered_parts += other.numbered_parts;
        self.job_parts_after += other.job_parts_after;
        self.parts_after_jobs.extend(other.parts_after_jobs);
        self.numbered_parts_after += other.numbered_parts_after;
        self.late.extend(other.late);
        self.late.truncate(100);
    }

    /// Every `expire` entry, into its grant's expired (the pass's own, `{grant}`, and the parts
    /// returned after, `{grant}#{n}`).
    async fn expiries(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        let L5 { grants, by_source, found, .. } = self;
        db.each(&EXPIRIES, args![], |r| {
            let refs = r.str(ExpiryRow::ref_id)?;
            let (source, own) = match refs.split_once('#') {
                Some((source, _)) => (source, false),
                None => (refs, true),
            };
            match by_source.get(source).and_then(|k| grants.get_mut(k)) {
                Some(g) => {
                    g.expired -= i128::from(r.i64(ExpiryRow::amount)?);
                    if own {
                        g.expire_entries += 1;
                        g.expire_seq = Some(r.i64(ExpiryRow::account_seq)?);
                    }
                }
                None => found.push((r.text(ExpiryRow::account_id)?, format!("an expire entry of {refs}, no grant's"))),
            }
            Ok(())
        })
        .await?;
        Ok(())
    }

    /// L5's last clause, as the allocations pass found it: the takes after their grant's expiry.
    fn takes_after_expiry(&mut self) {
        let late = std::mem::take(&mut self.late);
        self.found.extend(late);
    }

    fn judge_grants(&mut self) {
        for g in self.grants.values() {
            let (amount, remaining) = (i128::from(g.amount), i128::from(g.remaining));
            let mut say = |m: String| self.found.push((g.account.clone(), format!("grant {}: {m}", g.source)));
            if amount + g.returned != g.consumed + g.expired + remaining {
                say(format!(
                    "amount {amount} + returned {} ≠ consumed {} + expired {} + remaining {remaining}",
                    g.returned, g.consumed, g.expired
                ));
            }
            if !g.live && remaining != 0 {
                say(format!("expired with {remaining} left"));
            }
            if g.expire_entries > 1 {
                say(format!("{} expire entries of its own", g.expire_entries));
            }
            if g.expire_entries == 1 && g.expire_seq != g.expired_seq {
                say(format!("expired at position {:?}, its expire entry at {:?}", g.expired_seq, g.expire_seq));
            }
            if let Some(at) = g.expired_seq
                && g.last_take > at
            {
                say(format!("taken from at position {} after it expired at {at}", g.last_take));
            }
        }
        for (part, (account, says, paid)) in &self.settled {
            if says != paid {
                self.found
                    .push((account.clone(), format!("debt part {part} says {says} paid, its settlements {paid}")));
            }
        }
    }

    async fn judge_accounts(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static DEBTS: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM accounts ORDER BY id", DebtRow::LIST));
        let mut live: BTreeMap<&str, i128> = BTreeMap::new();
        let mut soonest: BTreeMap<&str, i64> = BTreeMap::new();
        for g in self.grants.values().filter(|g| g.live) {
            *live.entry(&g.account).or_default() += i128::from(g.remaining);
            let next = soonest.entry(&g.account).or_insert(i64::MAX);
            *next = (*next).min(g.expiry_key);
        }
        let mut found = Vec::new();
        for r in &db.all(&DEBTS, args![]).await? {
            let account = r.text(DebtRow::id)?;
            let (debt, balance) = (i128::from(r.i64(DebtRow::debt)?), i128::from(r.i64(DebtRow::balance)?));
            let live = live.get(account.as_str()).copied().unwrap_or(0);
            if live - debt != balance {
                found.push((
                    account.clone(),
                    format!("live grants hold {live}, debt {debt}, but the balance is {balance}"),
                ));
            }
            let owed = self.unpaid.get(&account).copied().unwrap_or(0);
            if owed != debt {
                found.push((account.clone(), format!("debt {debt} but its unpaid debt parts are {owed}")));
            }
            // The clock guard waits for this: a next expiry later than a live grant's would let a
            // posting count dead credit.
            let (stored, want) =
                (r.i64(DebtRow::next_expiry)?, soonest.get(account.as_str()).copied().unwrap_or(i64::MAX));
            if stored != want {
                found
                    .push((account, format!("next expiry {stored} but its soonest unexpired grant expires at {want}")));
            }
        }
        self.found.extend(found);
        Ok(())
    }
}

/// The audit's state between passes: each account's stored figures beside what the rows add up
/// to, and what is wrong so far.
pub(crate) struct Audit<'p> {
    accounts: BTreeMap<String, Acc>,
    violations: Vec<Violation>,
    /// L5's tallies, its grants loaded at the start; its allocations pass may run apart.
    pub(crate) l5: L5,
    /// Pass B's L5 findings (items whose open parts disagree with their state), reported after L5's others.
    l5_items: Vec<Violation>,
    /// Pass B's items checked and entries met.
    items_counted: Counted,
    /// Pass B's parts met, and lines and parts met under a job they do not name.
    parts_met: Counted,
    /// Pass A's lines that pass B cannot meet though they name a job or carry a number: a number on
    /// a line naming no job, a job's line naming no item.
    stray_lines: u64,
    /// Pass A's lines that carry a job's number (PostgreSQL's writers leave it NULL).
    numbered: u64,
    progress: &'p (dyn Fn(AuditProgress) + Send + Sync),
    /// Ledger rows, for the progress display.
    total: u64,
    /// The store's checkpoint, when the audit was asked to start from it or to record one.
    against: Option<Against>,
    /// Pass B's item lines and job parts met after their account's checkpoint position.
    met_after: Counted,
    /// Pass B's jobs' sums, for a checkpoint to record.
    job_sums: Vec<JobSum>,
    /// Jobs pass B met.
    jobs_met: u64,
}

/// What an audit asked to start from the store's checkpoint, or to record one, found of it.
pub(crate) struct Against {
    run: AuditRun,
    /// The checkpoint row's generation (`None`: none): what a new checkpoint replaces.
    base: Option<i64>,
    /// Where the store stands in the audit's snapshot.
    now: Mark,
    /// The checkpoint it starts from.
    from: Option<Checkpoint>,
    /// Asked to start from one, why it starts from the first entry.
    not_used: Option<String>,
    /// From a checkpoint: every job a line, part or event after it names (pass B checks these).
    touched: BTreeSet<String>,
    /// From a checkpoint: whether pass B reads only the touched jobs (not when they are many).
    touched_only: bool,
}

impl Against {
    /// The store's checkpoint, read in the audit's snapshot.
    pub(crate) async fn find(db: &mut Db<'_>, run: AuditRun) -> Result<Against, StoreError> {
        let found = checkpoint::find(db).await?;
        let (from, not_used) = match (run.from_checkpoint, found.usable) {
            (true, Ok(from)) => (Some(from), None),
            (true, Err(why)) => (None, Some(why)),
            (false, _) => (None, None),
        };
        Ok(Against {
            run,
            base: found.base,
            now: found.now,
            from,
            not_used,
            touched: BTreeSet::new(),
            touched_only: false,
        })
    }
}

/// Pass B's jobs checked from a checkpoint only while they are at most this share of all jobs
/// (1 / N), or this few: each is read by a statement of its own, dearer per job than the ranges of a
/// full pass (`settle bench --scale 200000`: 2,000 touched jobs of 22,000 read in 0.14 s, where the
/// full pass took 0.45).
const TOUCHED_SHARE: i64 = 4;
const TOUCHED_FEW: i64 = 1024;

/// The whole audit in streaming passes over one snapshot, memory bounded by the number of
/// accounts (not entries or items): the ledger in `seq` order (L1 sums, L2 running balances and
/// hash chains, each account's positions 1, 2, 3, … in `seq` order); every item joined with its entries in key order (L3, L4, the
/// held and exposure totals); entries of missing items; withdrawals; the outbox numbers (gap-free up
/// to the counter; events still waiting for theirs are not counted). From a checkpoint (decision
/// 0040), each account's lines after it, and the jobs touched since. Returns the report, and the
/// checkpoint to record when asked and the audit is clean.
/// `progress` is called every 100 000 rows.
pub(crate) async fn audit(
    db: &mut Db<'_>,
    run: AuditRun,
    progress: &(dyn Fn(AuditProgress) + Send + Sync),
) -> Result<(AuditReport, Option<Record>), StoreError> {
    if db.engine() == Engine::Postgres {
        // Its statements are few and long, estimated at costs that start the JIT compiler, whose
        // work costs more than it saves here: 2.20 → 1.85 s for the full audit of 202,016 entries,
        // 0.85 → 0.57 s from a checkpoint (measured). For this read's transaction only.
        db.exec("SET LOCAL jit = off", args![]).await?;
    }
    let against = match run {
        AuditRun { from_checkpoint: false, record: false } => None,
        _ => Some(Against::find(db, run).await?),
    };
    let mut audit = Audit::start(db, progress, against).await?;
    let ledger = audit.ledger_pass(db).await?;
    let positions = audit.positions();
    audit.l5.parts(db, positions.as_deref()).await?;
    let ranges = audit.ranges(db, 1).await?;
    let items = audit.items_pass(ranges);
    items.run(db).await?;
    audit.absorb(items.finished()?);
    audit.finish(db, ledger, None).await
}

/// What a pass read: rows, and how many of them name an item (or met one).
pub(crate) type Counted = (u64, u64);

impl<'p> Audit<'p> {
    /// The audit's start: every account's stored figures, and every grant; from a checkpoint, each
    /// account's lines to its position as the checkpoint proved them.
    pub(crate) async fn start(
        db: &mut Db<'_>,
        progress: &'p (dyn Fn(AuditProgress) + Send + Sync),
        against: Option<Against>,
    ) -> Result<Audit<'p>, StoreError> {
        let mut audit = Audit {
            accounts: BTreeMap::new(),
            violations: Vec::new(),
            l5: L5::default(),
            l5_items: Vec::new(),
            items_counted: (0, 0),
            parts_met: (0, 0),
            stray_lines: 0,
            numbered: 0,
            progress,
            total: 0,
            against,
            met_after: (0, 0),
            job_sums: Vec::new(),
            jobs_met: 0,
        };
        audit.load_accounts(db).await?;
        audit.l5.load(db).await?;
        Ok(audit)
    }

    /// The checkpoint the audit starts from.
    fn from(&self) -> Option<&Checkpoint> {
        self.against.as_ref().and_then(|a| a.from.as_ref())
    }

    /// Whether the audit starts from a checkpoint: pass B's jobs are then known only after pass A
    /// and the allocations pass.
    pub(crate) fn starts_from_checkpoint(&self) -> bool {
        self.from().is_some()
    }

    /// From a checkpoint: the last event number it proved.
    pub(crate) fn events_proved(&self) -> Option<i64> {
        self.from().map(|from| from.mark.last_event_seq)
    }

    /// From a checkpoint: each account's position in it (absent: 0), to tell the rows after it.
    pub(crate) fn positions(&self) -> Option<Arc<BTreeMap<String, i64>>> {
        let from = self.from()?;
        Some(Arc::new(from.accounts.iter().map(|(id, s)| (id.clone(), s.position)).collect()))
    }

    /// Pass A and L1 over its sums. Returns the entries read and how many name an item.
    pub(crate) async fn ledger_pass(&mut self, db: &mut Db<'_>) -> Result<Counted, StoreError> {
        let counted = match self.from().is_some() {
            false => self.ledger(db).await?,
            true => self.ledger_after(db).await?,
        };
        self.balances();
        Ok(counted)
    }

    /// Pass B's jobs: from a checkpoint, the jobs touched since when they are few (each a range of
    /// its own; the sums of the others taken from the checkpoint); else every job, in `split`
    /// ranges of about as many jobs each. After pass A and the allocations pass.
    pub(crate) async fn ranges(&mut self, db: &mut Db<'_>, split: u64) -> Result<Vec<JobRange>, StoreError> {
        let Some(against) = self.against.as_mut() else { return job_ranges(db, split).await };
        let Some(from) = against.from.as_ref() else { return job_ranges(db, split).await };
        against.touched.extend(std::mem::take(&mut self.l5.parts_after_jobs));
        checkpoint::touched_by_events(db, from.mark.last_event_seq, &mut against.touched).await?;
        let jobs = db.one("SELECT COUNT(*) AS n FROM jobs", args![]).await?.i64(CountRow::n)?;
        if against.touched.len() as i64 > (jobs / TOUCHED_SHARE).max(TOUCHED_FEW) {
            return job_ranges(db, split).await;
        }
        against.touched_only = true;
        // Every job's sums as the checkpoint summed them, less the touched jobs' then: pass B adds
        // theirs now.
        for (id, sealed) in &from.accounts {
            if let Some(acc) = self.accounts.get_mut(id) {
                acc.refunded_cost += i128::from(sealed.refunded);
                acc.held_cost += i128::from(sealed.held);
            }
        }
        for (account, refunded, held) in checkpoint::sealed_jobs(db, &against.touched).await? {
            if let Some(acc) = self.accounts.get_mut(&account) {
                acc.refunded_cost -= i128::from(refunded);
                acc.held_cost -= i128::from(held);
            }
        }
        let touched: Vec<String> = against.touched.iter().cloned().collect();
        Ok(touched.chunks(TOUCHED_PER_RANGE).map(|jobs| JobRange::Jobs(jobs.to_vec())).collect())
    }

    /// Pass B over these ranges of jobs, to run apart from pass A (on other connections of the same
    /// snapshot, any number at once): it knows the accounts as loaded.
    pub(crate) fn items_pass(&self, ranges: Vec<JobRange>) -> ItemsPass<'p> {
        let done = Mutex::new(ranges.iter().map(|_| None).collect());
        let collect = self.against.as_ref().is_some_and(|a| a.run.record || a.touched_only);
        ItemsPass {
            known: self.accounts.keys().cloned().collect(),
            ranges,
            next: AtomicUsize::new(0),
            done,
            rows: AtomicU64::new(0),
            progress: self.progress,
            total: self.total,
            positions: self.positions(),
            collect,
        }
    }

    /// Pass B's totals and findings, range by range in key order, taken into the audit (after pass A's).
    pub(crate) fn absorb(&mut self, parts: Vec<ItemsPart>) {
        for part in parts {
            for (id, (refunded, held)) in part.owed {
                if let Some(acc) = self.accounts.get_mut(&id) {
                    acc.refunded_cost += refunded;
                    acc.held_cost += held;
                }
            }
            self.violations.extend(part.violations);
            self.l5_items.extend(part.l5);
            self.items_counted.0 += part.items;
            self.items_counted.1 += part.joined;
            self.parts_met.0 += part.parts;
            self.parts_met.1 += part.misfiled;
            self.met_after.0 += part.lines_after;
            self.met_after.1 += part.parts_after;
            self.job_sums.extend(part.jobs.into_iter().filter(|j| j.refunded != 0 || j.held != 0));
            self.jobs_met += part.jobs_met;
        }
    }

    /// What follows both passes: the held and exposure totals, entries of missing items,
    /// withdrawals, the rest of L5 and the outbox. Returns the report, and the checkpoint to record
    /// when asked and nothing is wrong.
    /// `apart`: the checks of [`Apart`] when they ran beside the passes (else they run here).
    pub(crate) async fn finish(
        mut self,
        db: &mut Db<'_>,
        (entries_checked, item_entries): Counted,
        apart: Option<Apart>,
    ) -> Result<(AuditReport, Option<Record>), StoreError> {
        let (items_checked, joined_entries) = self.items_counted;
        // What the items hold, as a checkpoint records it: before the open top-ups are added.
        let record = self.record();
        self.top_ups(db).await?;
        self.holds();
        // From a checkpoint pass A reads only the lines after it: pass B's lines after it are what
        // it must have met, and the allocations pass's parts after it.
        let (met, parts_met, job_parts) = match self.from().is_some() {
            false => (joined_entries, self.parts_met.0, self.l5.job_parts),
            true => (self.met_after.0, self.met_after.1, self.l5.job_parts_after),
        };
        // Entries of items that do not exist: only looked for when pass B met fewer than pass A counted.
        if met != item_entries {
            self.orphans(db).await?;
        }
        // Lines and parts filed under a job they do not name (migration 0037). On SQLite, which
        // files them by number, only looked for when pass B met one under another job, or met
        // fewer than there are (a number of no job, or none), or pass A met one pass B cannot. On
        // PostgreSQL, whose pass reads them by the id, looked for whenever a number was met at all
        // (its writers leave them NULL: a copy from SQLite, or a hand edit).
        let misfiled = self.parts_met.1;
        let looked_over = parts_met == job_parts
            && misfiled == 0
            && self.l5.stray_numbers == 0
            && self.stray_lines == 0
            && met == item_entries;
        // From a checkpoint, only the rows after it (those before were looked over by then).
        let numbered_parts = match self.from().is_some() {
            false => self.l5.numbered_parts,
            true => self.l5.numbered_parts_after,
        };
        let look = match db.engine() {
            Engine::Sqlite => !looked_over,
            Engine::Postgres => self.numbered + numbered_parts > 0,
        };
        if look {
            self.money_filed(db).await?;
        }
        let apart = match apart {
            Some(apart) => apart,
            None => Apart::run(db, self.events_proved()).await?,
        };
        self.violations.extend(apart.withdrawals);
        self.grants(db).await?;
        self.alerts(db).await?;
        self.spend_limits(db).await?;
        self.violations.extend(apart.feed);
        self.chained_count();
        let checkpoint = self.checkpoint_use();
        let Audit { accounts, violations, .. } = self;
        let clean = violations.is_empty();
        let report = AuditReport {
            accounts_checked: accounts.len() as u64,
            items_checked,
            entries_checked,
            violations,
            checkpoint,
        };
        Ok((report, record.filter(|_| clean)))
    }

    /// What the report says of the checkpoint: started from, or why not; jobs checked; entries covered.
    fn checkpoint_use(&self) -> CheckpointUse {
        let Some(against) = &self.against else { return CheckpointUse::default() };
        CheckpointUse {
            from: against.from.as_ref().map(Checkpoint::mark),
            not_used: against.not_used.clone(),
            jobs_checked: self.jobs_met,
            entries_covered: against.now.entries.max(0) as u64,
            recorded: None,
            retired: None,
        }
    }

    /// From a checkpoint: every ledger row is in some account's chain (pass A reads the chains, so
    /// a line of no account would go unseen).
    fn chained_count(&mut self) {
        let Some(against) = &self.against else { return };
        if against.from.is_none() {
            return;
        }
        let chained: i64 = self.accounts.values().map(|a| a.position).sum();
        if chained != against.now.entries {
            let message = format!("the ledger holds {} entries, the accounts' chains {chained}", against.now.entries);
            self.push(Invariant::L1, None, None, None, message);
        }
    }

    /// The checkpoint this audit would record (asked to, and what it summed fits the columns).
    fn record(&mut self) -> Option<Record> {
        let against = self.against.as_ref().filter(|a| a.run.record)?;
        let mut accounts = Vec::with_capacity(self.accounts.len());
        for (id, acc) in &self.accounts {
            let sealed = Sealed {
                position: acc.position,
                sum: i64::try_from(acc.sum).ok()?,
                hash: acc.prev,
                last_seq: acc.last_seq,
                refunded: i64::try_from(acc.refunded_cost).ok()?,
                held: i64::try_from(acc.held_cost).ok()?,
            };
            accounts.push((id.clone(), sealed));
        }
        let sums = std::mem::take(&mut self.job_sums);
        let jobs = match against.touched_only {
            true => JobSums::Touched { touched: against.touched.iter().cloned().collect(), now: sums },
            false => JobSums::All(sums),
        };
        Some(Record { base: against.base, now: against.now, accounts, jobs })
    }

    fn push(
        &mut self,
        invariant: Invariant,
        account: Option<&str>,
        job: Option<&str>,
        item: Option<&str>,
        message: String,
    ) {
        self.violations.push(v(invariant, account, job, item, message));
    }

    async fn load_accounts(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static ACCOUNTS: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM accounts ORDER BY id", AccountRow::LIST));
        for r in db.all(&ACCOUNTS, args![]).await? {
            use AccountRow as C;
            let (balance, exposure, held) = (r.i64(C::balance)?, r.i64(C::exposure)?, r.i64(C::held)?);
            let entries = r.i64(C::entries)?;
            self.total += entries.max(0) as u64;
            let acc = Acc {
                balance,
                entries,
                position: 0,
                last_seq: 0,
                exposure,
                refunded_cost: 0,
                held,
                held_cost: 0,
                sum: 0,
                running: 0,
                prev: GENESIS_HASH,
            };
            self.accounts.insert(r.text(C::id)?, acc);
        }
        self.resume();
        Ok(())
    }

    /// From a checkpoint: each account's chain taken up where the checkpoint left it — its
    /// position, the sum and running balance to it, that line's hash and `seq`.
    fn resume(&mut self) {
        let Some(from) = self.against.as_ref().and_then(|a| a.from.as_ref()) else { return };
        let mut gone = Vec::new();
        for (id, sealed) in &from.accounts {
            let Some(acc) = self.accounts.get_mut(id) else {
                gone.push(id.clone());
                continue;
            };
            acc.position = sealed.position;
            acc.last_seq = sealed.last_seq;
            acc.sum = i128::from(sealed.sum);
            acc.running = i128::from(sealed.sum);
            acc.prev = sealed.hash;
        }
        for id in gone {
            self.push(Invariant::L1, Some(&id), None, None, "an account of the checkpoint no longer exists".to_owned());
        }
    }

    /// Pass A: the ledger in seq order. Returns the entries read and how many name an item.
    async fn ledger(&mut self, db: &mut Db<'_>) -> Result<(u64, u64), StoreError> {
        static SQL: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM ledger_entries ORDER BY seq", EntryRow::LIST));
        let (mut item_entries, mut done) = (0u64, 0u64);
        let sql = std::borrow::Cow::Borrowed(SQL.as_str());
        let read = db.each_copied(sql, |r| self.line(r, &mut done, &mut item_entries).map(|_| ())).await?;
        Ok((read, item_entries))
    }

    /// Pass A from a checkpoint: each account's anchor (its line at the checkpoint's position, as
    /// the checkpoint proved it), then its lines after it in position order — every line committed
    /// since the checkpoint's snapshot (positions are taken under the account's row lock, held to
    /// COMMIT: a snapshot sees each account's positions 1..n). The jobs they name are touched.
    async fn ledger_after(&mut self, db: &mut Db<'_>) -> Result<(u64, u64), StoreError> {
        static SQL: LazyLock<[String; 2]> =
            LazyLock::new(|| [ledger_after_sql(Engine::Sqlite), ledger_after_sql(Engine::Postgres)]);
        let sql = match db.engine() {
            Engine::Sqlite => &SQL[0],
            Engine::Postgres => &SQL[1],
        };
        self.anchors(db).await?;
        let (mut item_entries, mut done) = (0u64, 0u64);
        let mut touched = BTreeSet::new();
        let read = db
            .each(sql, args![], |r| {
                if let Some(job) = self.line(r, &mut done, &mut item_entries)?
                    && !touched.contains(job)
                {
                    touched.insert(job.to_owned());
                }
                Ok(())
            })
            .await?;
        if let Some(against) = self.against.as_mut() {
            against.touched.extend(touched);
        }
        Ok((read, item_entries))
    }

    /// Each account's line at its checkpoint position is the one the checkpoint proved: its `seq`
    /// and hash (the chain from it is checked from the checkpoint's hash; a rewritten anchor would
    /// otherwise pass).
    async fn anchors(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM audit_checkpoint_accounts c LEFT JOIN ledger_entries e \
                 ON e.account_id = c.account_id AND e.account_seq = c.position WHERE c.position > 0 ORDER BY c.account_id",
                AnchorRow::LIST
            )
        });
        let mut found = Vec::new();
        for r in db.all(&SQL, args![]).await? {
            use AnchorRow as C;
            let (account, position) = (r.text(C::account_id)?, r.i64(C::position)?);
            let (want_seq, want_hash) = (r.i64(C::last_seq)?, r.blob(C::hash)?);
            let Some(seq) = r.opt_i64(C::seq)? else {
                found
                    .push((account, format!("the entry at position {position}, which the checkpoint proved, is gone")));
                continue;
            };
            // The line as it is now hashes to what the checkpoint proved: its fields, from its link.
            let kind = r.text(C::kind)?;
            let (job, item, ref_id, reason) =
                (r.opt_text(C::job_id)?, r.opt_text(C::item_id)?, r.opt_text(C::ref_id)?, r.opt_text(C::reason)?);
            let prev = Hash32::try_from(r.blob(C::prev_hash)?.as_slice()).unwrap_or(GENESIS_HASH);
            let computed = EntryKind::parse(&kind).map(|kind| {
                let fields = EntryFields {
                    seq,
                    account_id: &account,
                    kind,
                    amount: r.i64(C::amount)?,
                    balance_after: r.i64(C::balance_after)?,
                    job_id: job.as_deref(),
                    item_id: item.as_deref(),
                    ref_id: ref_id.as_deref(),
                    reason: reason.as_deref(),
                    created_at: r.i64(C::created_at)?,
                };
                Ok::<_, StoreError>(chain_hash(&prev, &fields))
            });
            let computed = computed.transpose()?;
            let stored = r.blob(C::entry_hash)?;
            if seq == want_seq && stored == want_hash && computed.is_some_and(|h| h.as_slice() == want_hash) {
                continue;
            }
            found.push((
                account,
                format!("entry {seq} at position {position} is not the one the checkpoint proved (entry {want_seq})"),
            ));
        }
        for (account, message) in found {
            self.push(Invariant::L2, Some(&account), None, None, message);
        }
        Ok(())
    }

    /// One line of pass A: its account's chain, and what pass B should meet of it. Returns the job
    /// it names.
    fn line<'r>(
        &mut self,
        r: &'r crate::db::Cells<'_>,
        done: &mut u64,
        item_entries: &mut u64,
    ) -> Result<Option<&'r str>, StoreError> {
        *done += 1;
        if done.is_multiple_of(PROGRESS_EVERY) {
            (self.progress)(AuditProgress { phase: "ledger", done: *done, total: self.total });
        }
        self.entry(r)?;
        // Counted whatever `entry` found wrong with the line, as pass B meets it so.
        let (job, item) = (r.opt_str(EntryRow::job_id)?, r.opt_str(EntryRow::item_id)?.is_some());
        let numbered = r.opt_i64(EntryRow::job_seq)?.is_some();
        if job.is_some() && item {
            *item_entries += 1;
        }
        // A number on a line naming no job, or a job's line naming no item: pass B meets
        // neither (Settle writes neither).
        if (numbered && job.is_none()) || (job.is_some() && !item) {
            self.stray_lines += 1;
        }
        if numbered {
            self.numbered += 1;
        }
        Ok(job)
    }

    /// One ledger entry against its account's running sum and hash chain.
    fn entry(&mut self, r: &crate::db::Cells<'_>) -> Result<(), StoreError> {
        use EntryRow as C;
        // Borrowed from the row: nothing is copied per column of the million rows of a pass.
        let (seq, account_id, kind_s) = (r.i64(C::seq)?, r.str(C::account_id)?, r.str(C::kind)?);
        let (amount, balance_after, created_at) = (r.i64(C::amount)?, r.i64(C::balance_after)?, r.i64(C::created_at)?);
        let (job, item) = (r.opt_str(C::job_id)?, r.opt_str(C::item_id)?);
        let (ref_id, reason) = (r.opt_str(C::ref_id)?, r.opt_str(C::reason)?);
        let (prev_hash, hash) = (r.bytes(C::prev_hash)?, r.bytes(C::hash)?);
        let account_seq = r.i64(C::account_seq)?;
        let Some(acc) = self.accounts.get_mut(account_id) else {
            self.push(Invariant::L1, Some(account_id), None, None, format!("entry {seq} names a missing account"));
            return Ok(());
        };
        // In `seq` order, an account's entries are its chain positions 1, 2, 3, …: a gap is a
        // missing entry, a step back an entry numbered out of commit order. (From a checkpoint,
        // read in position order: a `seq` not above the one before is that step back.)
        let (position, last_seq) = (acc.position, acc.last_seq);
        acc.position = account_seq;
        acc.last_seq = seq;
        if account_seq != position + 1 {
            let message = format!("entry {seq}: account_seq {account_seq} follows {position}");
            self.push(Invariant::Seq, Some(account_id), job, item, message);
        } else if seq <= last_seq {
            let message = format!("entry {seq} at account_seq {account_seq} follows entry {last_seq}");
            self.push(Invariant::Seq, Some(account_id), job, item, message);
        }
        let Some(kind) = EntryKind::parse(kind_s) else {
            self.push(Invariant::L2, Some(account_id), None, None, format!("entry {seq} has unknown kind {kind_s}"));
            return Ok(());
        };
        let acc = self.accounts.get_mut(account_id).expect("found above");
        acc.sum += i128::from(amount);
        acc.running += i128::from(amount);
        let running = acc.running;
        if running != i128::from(balance_after) {
            acc.running = i128::from(balance_after);
        }
        let fields = EntryFields {
            seq,
            account_id,
            kind,
            amount,
            balance_after,
            job_id: job,
            item_id: item,
            ref_id,
            reason,
            created_at,
        };
        let computed = chain_hash(&acc.prev, &fields);
        let chained = prev_hash == acc.prev.as_slice() && hash == computed.as_slice();
        acc.prev = hash.try_into().unwrap_or(computed);
        if running != i128::from(balance_after) {
            let message = format!("entry {seq}: balance_after {balance_after} but the running sum is {running}");
            self.push(Invariant::L2, Some(account_id), job, item, message);
        }
        if !chained {
            self.push(Invariant::L2, Some(account_id), job, item, format!("entry {seq}: hash chain does not verify"));
        }
        Ok(())
    }

    /// L1: every balance is the sum of its entries.
    fn balances(&mut self) {
        let wrong: Vec<(String, String)> = (self.accounts.iter())
            .filter(|(_, acc)| acc.sum != i128::from(acc.balance))
            .map(|(id, acc)| (id.clone(), format!("balance {} but entries sum to {}", acc.balance, acc.sum)))
            .collect();
        for (id, message) in wrong {
            self.push(Invariant::L1, Some(&id), None, None, message);
        }
        let miscounted: Vec<(String, String)> = (self.accounts.iter())
            .filter(|(_, acc)| acc.entries != acc.position)
            .map(|(id, acc)| {
                (id.clone(), format!("counts {} entries but its chain ends at {}", acc.entries, acc.position))
            })
            .collect();
        for (id, message) in miscounted {
            self.push(Invariant::Seq, Some(&id), None, None, message);
        }
    }

    /// L1 over what the items say each account holds: `held`, the largest balance, `exposure`.
    fn holds(&mut self) {
        let mut found = Vec::new();
        for (id, acc) in &self.accounts {
            if acc.held_cost != i128::from(acc.held) {
                let message =
                    format!("held {} but the items that may still be credited back cost {}", acc.held, acc.held_cost);
                found.push((id.clone(), message));
            }
            if i128::from(acc.balance) + i128::from(acc.held) > i128::from(settle_core::limits::BALANCE_MAX) {
                found.push((
                    id.clone(),
                    format!("balance {} plus held {} exceeds the largest balance", acc.balance, acc.held),
                ));
            }
            if acc.refunded_cost != i128::from(acc.exposure) {
                found.push((
                    id.clone(),
                    format!("exposure {} but refunded items cost {}", acc.exposure, acc.refunded_cost),
                ));
            }
        }
        for (id, message) in found {
            self.push(Invariant::L1, Some(&id), None, None, message);
        }
    }

    /// L3: ledger entries that name an item that does not exist.
    async fn orphans(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT DISTINCT {} FROM ledger_entries e WHERE e.job_id IS NOT NULL \
                 AND NOT EXISTS (SELECT 1 FROM items i WHERE i.job_id = e.job_id AND i.item_id = e.item_id) \
                 ORDER BY e.job_id, e.item_id",
                NamedItemRow::LIST
            )
        });
        for r in &db.all(&SQL, args![]).await? {
            let (job, item) = (r.text(NamedItemRow::job_id)?, r.text(NamedItemRow::item_id)?);
            self.push(
                Invariant::L3,
                None,
                Some(&job),
                Some(&item),
                "ledger entries name an item that does not exist".to_owned(),
            );
        }
        Ok(())
    }

    /// L7: each alert on the side of its threshold its account's balance is on, and each account's
    /// band (`alert_floor`, `alert_ceiling`) what its alerts' sides give — else a crossing was
    /// missed, or would fire twice.
    async fn alerts(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM accounts c LEFT JOIN (SELECT account_id, alert_id, below, side FROM account_alerts \
                 UNION ALL SELECT account_id, 'auto-top-up' AS alert_id, below, side FROM auto_top_ups) a \
                 ON a.account_id = c.id \
                 WHERE a.account_id IS NOT NULL OR c.alert_floor IS NOT NULL OR c.alert_ceiling IS NOT NULL \
                 ORDER BY c.id, a.below, a.alert_id",
                AlertRow::LIST
            )
        });
        let rows = db.all(&SQL, args![]).await?;
        let mut at = 0;
        while at < rows.len() {
            use AlertRow as C;
            let account = rows[at].text(C::account_id)?;
            let (balance, floor, ceiling) =
                (rows[at].i64(C::balance)?, rows[at].opt_i64(C::alert_floor)?, rows[at].opt_i64(C::alert_ceiling)?);
            let (mut want_floor, mut want_ceiling) = (None::<i64>, None::<i64>);
            while at < rows.len() && rows[at].text(C::account_id)? == account {
                if let (Some(id), Some(below), Some(side)) =
                    (rows[at].opt_text(C::alert_id)?, rows[at].opt_i64(C::below)?, rows[at].opt_text(C::side)?)
                {
                    let right = if balance >= below { "above" } else { "below" };
                    if side != right {
                        let message =
                            format!("alert {id} (below {below}) is on the {side} side of a balance of {balance}");
                        self.push(Invariant::L7, Some(&account), None, None, message);
                    }
                    if side == "above" {
                        want_floor = want_floor.max(Some(below));
                    } else {
                        want_ceiling = Some(want_ceiling.map_or(below, |c| c.min(below)));
                    }
                }
                at += 1;
            }
            if (floor, ceiling) != (want_floor, want_ceiling) {
                let message = format!(
                    "the alert band is {floor:?}..{ceiling:?}, but the alerts' sides give {want_floor:?}..{want_ceiling:?}"
                );
                self.push(Invariant::L7, Some(&account), None, None, message);
            }
        }
        Ok(())
    }

    /// L9: each top-up against its job, its reservation and its grant; the open ones' credits are
    /// part of what their accounts hold (L1's `held`).
    async fn top_ups(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        static ROWS: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM top_ups t LEFT JOIN jobs j ON j.id = t.job_id \
                 LEFT JOIN grants g ON g.origin = 'top_up' AND g.source_id = t.job_id ORDER BY t.job_id",
                TopUpRow::LIST
            )
        });
        static ROWLESS: &str = "SELECT j.id AS id, j.account_id AS account_id FROM jobs j WHERE j.kind = 'top_up' \
             AND NOT EXISTS (SELECT 1 FROM top_ups t WHERE t.job_id = j.id) \
             UNION ALL SELECT g.source_id AS id, g.account_id AS account_id FROM grants g WHERE g.origin = 'top_up' \
             AND NOT EXISTS (SELECT 1 FROM top_ups t WHERE t.job_id = g.source_id AND t.provider_charge_id IS NOT NULL)";
        for r in &db.all(&ROWS, args![]).await? {
            use TopUpRow as C;
            let (id, account) = (r.text(C::id)?, r.text(C::account_id)?);
            let credits = r.i64(C::credits)?;
            let state = r.opt_text(C::state)?;
            let charged = r.opt_text(C::provider_charge_id)?.is_some();
            let mut problems = Vec::new();
            if r.opt_text(C::kind)?.as_deref() != Some(settle_core::job::TOP_UP_KIND)
                || r.opt_text(C::job_account)?.as_deref() != Some(account.as_str())
            {
                problems.push("its job is missing, of another kind or of another account".to_owned());
            }
            let in_flight = matches!(state.as_deref(), Some("queued" | "running" | "unknown" | "cancelling"));
            let open = r.i64(C::open)? == 1;
            if open != (in_flight && !charged) {
                problems.push(format!(
                    "open = {open} but its job is {} and its charge {}",
                    state.as_deref().unwrap_or("missing"),
                    if charged { "confirmed" } else { "not known" }
                ));
            }
            if state.as_deref() == Some("succeeded") && !charged {
                problems.push("succeeded without a confirmed charge".to_owned());
            }
            let granted = (r.opt_i64(C::granted)?, r.opt_text(C::grant_account)?);
            match (charged, granted) {
                (true, (Some(amount), Some(to))) if amount == credits && to == account => {}
                (false, (None, _)) => {}
                (true, (amount, _)) => {
                    problems.push(format!("a confirmed charge of {credits} credits granted {amount:?}"))
                }
                (false, _) => problems.push("a grant without a confirmed charge".to_owned()),
            }
            if open && let Some(acc) = self.accounts.get_mut(&account) {
                acc.held_cost += i128::from(credits);
            }
            for problem in problems {
                self.push(Invariant::L9, Some(&account), Some(&id), None, format!("top-up {id}: {problem}"));
            }
        }
        for r in &db.all(ROWLESS, args![]).await? {
            use RowlessCol as C;
            let (id, account) = (r.text(C::id)?, r.text(C::account_id)?);
            let message = format!("{id}: a top-up job without its row, or a bought grant without its confirmed charge");
            self.push(Invariant::L9, Some(&account), Some(&id), None, message);
        }
        // Each auto top-up rule's month count is what its month's rule top-ups are buying or bought.
        for (account, stored, counted) in crate::ops::auto_top_ups::audit_counts(db).await? {
            if stored != counted {
                let message = format!("the auto top-up rule counts {stored} credits this month, its top-ups {counted}");
                self.push(Invariant::L9, Some(&account), None, None, message);
            }
        }
        Ok(())
    }

    /// L8: an account is marked `spend_limited` exactly when it has limits, and each limit's `spent`
    /// is what the ledger's job lines of the kinds it covers, dated in its row's period, add up to —
    /// else a posting was not counted, or counted twice, and the next check would judge wrongly.
    async fn spend_limits(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        use settle_core::spend::{self, Period};
        static LIMITS: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM accounts c LEFT JOIN spend_limits l ON l.account_id = c.id \
                 WHERE l.account_id IS NOT NULL OR c.spend_limited <> 0 ORDER BY c.id, l.limit_no",
                LimitRow::LIST
            )
        });
        static KINDS: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM spend_limit_kinds", LimitKindRow::LIST));
        static LINES: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT {} FROM ledger_entries e JOIN jobs j ON j.id = e.job_id \
                 WHERE e.account_id IN (SELECT account_id FROM spend_limits) \
                 AND e.kind IN ('charge', 'refund', 'reclaim', 'release', 'payout_return')",
                SpendLineRow::LIST
            )
        });
        let limits = db.all(&LIMITS, args![]).await?;
        if limits.is_empty() {
            return Ok(());
        }
        let mut kinds: BTreeMap<(String, i64), Vec<String>> = BTreeMap::new();
        for r in &db.all(&KINDS, args![]).await? {
            use LimitKindRow as C;
            kinds.entry((r.text(C::account_id)?, r.i64(C::limit_no)?)).or_default().push(r.text(C::kind)?);
        }
        let mut lines: BTreeMap<String, Vec<(i64, i64, String)>> = BTreeMap::new();
        for r in &db.all(&LINES, args![]).await? {
            use SpendLineRow as C;
            let at = (r.i64(C::amount)?, r.i64(C::created_at)?, r.text(C::kind)?);
            lines.entry(r.text(C::account_id)?).or_default().push(at);
        }
        for r in &limits {
            use LimitRow as C;
            let account = r.text(C::account_id)?;
            let Some(no) = r.opt_i64(C::limit_no)? else {
                self.push(Invariant::L8, Some(&account), None, None, "marked spend_limited without limits".to_owned());
                continue;
            };
            if r.i64(C::spend_limited)? != 1 {
                self.push(Invariant::L8, Some(&account), None, None, "has spend limits, not marked".to_owned());
            }
            let text = r.opt_text(C::period)?.unwrap_or_default();
            let period = Period::parse(&text)
                .ok_or_else(|| StoreError::internal(format!("a spend limit of an unknown period: {text}")))?;
            let start = r.opt_i64(C::period_start)?.unwrap_or_default();
            let end = period.next(settle_core::Timestamp::from_micros(start)).micros();
            let named = match r.opt_i64(C::all_kinds)? {
                Some(1) => Vec::new(),
                _ => kinds.get(&(account.clone(), no)).cloned().unwrap_or_default(),
            };
            let net: i128 = lines
                .get(&account)
                .into_iter()
                .flatten()
                .filter(|(_, at, kind)| (start..end).contains(at) && spend::covers(&named, kind))
                .map(|(amount, _, _)| i128::from(*amount))
                .sum();
            let spent = r.opt_i64(C::spent)?.unwrap_or_default();
            if i128::from(spent) != -net {
                let message = format!(
                    "spend limit {no} ({text} from {}) records {spent} spent, but its period's ledger lines say {}",
                    settle_core::Timestamp::from_micros(start).rfc3339(),
                    -net
                );
                self.push(Invariant::L8, Some(&account), None, None, message);
            }
        }
        Ok(())
    }

    /// L5 (docs/decisions/0023): per grant, what it gave and got back (its allocations) and what
    /// expired (its `expire` entries) account for its amount and what it has left, and nothing was
    /// taken from it after it expired; per debt part, what paid it is its open settlements; per
    /// account, the live grants' remaining less the debt is the balance, and the debt is its unpaid
    /// debt parts.
    async fn grants(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        let mut l5 = std::mem::take(&mut self.l5);
        l5.expiries(db).await?;
        l5.takes_after_expiry();
        l5.judge_grants();
        l5.judge_accounts(db).await?;
        for (account, message) in l5.found {
            self.push(Invariant::L5, Some(&account), None, None, message);
        }
        let items = std::mem::take(&mut self.l5_items);
        self.violations.extend(items);
        Ok(())
    }

    /// Every ledger line and allocation that carries a number names the job of that number
    /// (migration 0037); on SQLite, which files them by it, every one of a job that exists carries
    /// it (PostgreSQL's writers leave it NULL). Joined to `jobs` by the number, which follows the
    /// ledger's order, and on SQLite the rows without one (the partial indexes on the id: few) by
    /// their id. The first 100 that do not are named.
    async fn money_filed(&mut self, db: &mut Db<'_>) -> Result<(), StoreError> {
        fn sql(lite: bool) -> String {
            let arms = |t: &str, table: &str, id: &str, what: i64| {
                let numbered = format!(
                    "SELECT CAST({what} AS bigint) AS what, {t}.{id} AS id, {t}.account_id, {t}.job_id, {t}.job_seq, j.id AS owner \
                     FROM {table} {t} LEFT JOIN jobs j ON j.job_seq = {t}.job_seq \
                     WHERE {t}.job_seq IS NOT NULL AND ({t}.job_id IS NULL OR {t}.job_id IS DISTINCT FROM j.id)"
                );
                if !lite {
                    return numbered;
                }
                format!(
                    "{numbered} UNION ALL SELECT {what}, {t}.{id}, {t}.account_id, {t}.job_id, NULL, NULL \
                     FROM {table} {t} JOIN jobs j ON j.id = {t}.job_id WHERE {t}.job_id IS NOT NULL AND {t}.job_seq IS NULL"
                )
            };
            format!(
                "SELECT {} FROM ({} UNION ALL {}) m ORDER BY what, id LIMIT 100",
                MisfiledMoneyRow::LIST,
                arms("e", "ledger_entries", "seq", 1),
                arms("a", "allocations", "id", 2),
            )
        }
        static LITE: LazyLock<String> = LazyLock::new(|| sql(true));
        static PG: LazyLock<String> = LazyLock::new(|| sql(false));
        let sql = if db.engine() == Engine::Sqlite { &*LITE } else { &*PG };
        for r in db.all(sql, args![]).await? {
            use MisfiledMoneyRow as C;
            let row = match r.i64(C::what)? {
                1 => format!("ledger entry {}", r.i64(C::id)?),
                _ => format!("allocation {}", r.i64(C::id)?),
            };
            let job = r.opt_text(C::job_id)?;
            let message = match (&job, r.opt_i64(C::job_seq)?, r.opt_text(C::owner)?) {
                (None, Some(n), _) => format!("{row} names no job but carries job_seq {n}"),
                (Some(id), Some(n), None) => format!("{row} names job {id} but carries job_seq {n}, which no job has"),
                (Some(id), Some(n), Some(owner)) => {
                    format!("{row} names job {id} but carries job_seq {n}, job {owner}'s")
                }
                (Some(id), None, _) => format!("{row} names job {id} but carries no job_seq"),
                (None, None, _) => format!("{row} is filed under a job it is not"),
            };
            let account = r.text(C::account_id)?;
            self.push(Invariant::Seq, Some(&account), job.as_deref(), None, message);
        }
        Ok(())
    }
}

/// Pass A from a checkpoint: each account's lines after its position there, in position order.
/// CROSS JOIN: SQLite keeps the accounts in the outer loop (without it, and with no statistics, it
/// walks the whole ledger's index for the order). Plan-tested.
pub(crate) fn ledger_after_sql(engine: Engine) -> String {
    let after = match engine {
        // SQLite, which has no statistics: the accounts outside (`CROSS JOIN` keeps the order).
        Engine::Sqlite => {
            "SELECT e.* FROM accounts a LEFT JOIN audit_checkpoint_accounts c ON c.account_id = a.id \
             CROSS JOIN ledger_entries e WHERE e.account_id = a.id AND e.account_seq > COALESCE(c.position, 0)"
        }
        // PostgreSQL: one range of `ledger_entries_account_seq` per account, whatever the
        // estimates (its ORDER BY keeps the subquery from being flattened into a join that an
        // account table's stale statistics, or a position it cannot see, turn into a scan of the
        // whole ledger: 0.95 s for 2,016 lines of 202,016, measured).
        Engine::Postgres => {
            "SELECT e.* FROM accounts a LEFT JOIN audit_checkpoint_accounts c ON c.account_id = a.id \
             CROSS JOIN LATERAL (SELECT * FROM ledger_entries l WHERE l.account_id = a.id \
             AND l.account_seq > COALESCE(c.position, 0) ORDER BY l.account_seq) e"
        }
    };
    format!("SELECT {} FROM ({after}) x ORDER BY account_id, account_seq", EntryRow::LIST)
}

/// What pass B reads at a time: a range of job ids, `[from, to)` (`to` `None`: to the end); or,
/// from a checkpoint, some of the touched jobs, in key order (PostgreSQL reads them in one
/// statement, SQLite one job at a time).
pub(crate) enum JobRange {
    Span { from: String, to: Option<String> },
    Jobs(Vec<String>),
}

/// Touched jobs per range of pass B from a checkpoint.
const TOUCHED_PER_RANGE: usize = 256;

columns! {
    /// A job's id, in key order.
    JobIdRow { id }
}

columns! {
    /// A count.
    CountRow { n }
}

/// Pass B's jobs cut into up to `n` ranges of about as many jobs each, in key order.
pub(crate) async fn job_ranges(db: &mut Db<'_>, n: u64) -> Result<Vec<JobRange>, StoreError> {
    // One range is every job: `''` sorts before any id.
    if n <= 1 {
        return Ok(vec![JobRange::Span { from: String::new(), to: None }]);
    }
    let jobs = db.one("SELECT COUNT(*) AS n FROM jobs", args![]).await?.i64(CountRow::n)?;
    let step = (jobs.max(0) as u64).div_ceil(n.max(1)).max(1);
    let mut starts = vec![String::new()];
    let mut at = 0u64;
    db.each("SELECT id FROM jobs ORDER BY id", args![], |r| {
        if at > 0 && at.is_multiple_of(step) {
            starts.push(r.text(JobIdRow::id)?);
        }
        at += 1;
        Ok(())
    })
    .await?;
    let ends = starts.iter().skip(1).cloned().map(Some).chain([None]);
    Ok(starts.iter().cloned().zip(ends).map(|(from, to)| JobRange::Span { from, to }).collect())
}

/// Pass B, cut into ranges of jobs that any number of connections of one snapshot take in turn;
/// each range's findings are kept apart, to be taken in key order.
pub(crate) struct ItemsPass<'p> {
    known: BTreeSet<String>,
    ranges: Vec<JobRange>,
    next: AtomicUsize,
    done: Mutex<Vec<Option<ItemsPart>>>,
    rows: AtomicU64,
    progress: &'p (dyn Fn(AuditProgress) + Send + Sync),
    total: u64,
    /// From a checkpoint: each account's position in it, to count the rows after it.
    positions: Option<Arc<BTreeMap<String, i64>>>,
    /// Whether each job's sums are kept (for a checkpoint).
    collect: bool,
}

/// What pass B found in one range of jobs.
#[derive(Default)]
pub(crate) struct ItemsPart {
    /// Per account: the cost of its refunded items (its exposure), and of the items that may
    /// still be credited back (its held).
    owed: BTreeMap<String, (i128, i128)>,
    violations: Vec<Violation>,
    /// Items whose open parts disagree with their state (L5).
    l5: Vec<Violation>,
    items: u64,
    joined: u64,
    /// Parts met (each under the job it was filed by), and lines or parts met under a job they do
    /// not name (SQLite files them by number: migration 0037).
    parts: u64,
    misfiled: u64,
    /// From a checkpoint: item lines and job parts met after their account's position in it.
    lines_after: u64,
    parts_after: u64,
    /// Jobs met.
    jobs_met: u64,
    /// Each job's sums, when kept: every job met, in key order (the last one may still grow).
    jobs: Vec<JobSum>,
    collect: bool,
}

impl ItemsPart {
    /// One job's items counted towards its account (kept, when kept, under the job).
    fn job_owes(&mut self, job: &str, account: &str, refunded: i128, held: i128) {
        if !self.collect {
            return;
        }
        let (Ok(refunded), Ok(held)) = (i64::try_from(refunded), i64::try_from(held)) else { return };
        match self.jobs.last_mut() {
            Some(last) if last.job == job => {
                last.refunded = last.refunded.saturating_add(refunded);
                last.held = last.held.saturating_add(held);
                return;
            }
            // A job whose items count nothing is not kept (a checkpoint keeps none).
            Some(last) if last.refunded == 0 && last.held == 0 => *last = JobSum::new(job, account),
            _ => self.jobs.push(JobSum::new(job, account)),
        }
        self.job_owes(job, account, i128::from(refunded), i128::from(held));
    }

    fn owe(&mut self, known: &BTreeSet<String>, account: &str, refunded: i128, held: i128) {
        let owed = match self.owed.get_mut(account) {
            Some(owed) => owed,
            None if known.contains(account) => self.owed.entry(account.to_owned()).or_default(),
            None => return,
        };
        owed.0 += refunded;
        owed.1 += held;
    }

    /// One (job, item) key's rows, ended: its item against its entries (L3, L4) and its open
    /// parts (L5). Allocations of an item that does not exist are judged by L5's grant sums.
    fn close(&mut self, key: Key, known: &BTreeSet<String>) {
        let Some(group) = key.group else { return };
        self.items += 1;
        if let Some(state) = ItemState::parse(&group.state) {
            self.open_parts(&group, state, key.open);
        }
        check_item(group, self, known);
    }

    /// Every item's open parts are what it still costs its account (what a refund would give back):
    /// its stake while it is held, charged or delivered; nothing once refunded, cancelled or
    /// returned. Items decided before grants were tracked have no parts and are not judged.
    fn open_parts(&mut self, group: &ItemGroup, state: ItemState, open: Option<i128>) {
        let returnable = state.is_held(group.job_kind == settle_core::job::WITHDRAWAL_KIND);
        let Some(open) = open.or(returnable.then_some(0)) else { return };
        let want = state.net(Credits::new(group.cost)).map(|n| -i128::from(n.get())).unwrap_or(i128::MIN);
        if open != want {
            let what = format!("its open parts hold {open}, its state {} costs {want}", state.as_str());
            self.l5.push(v(Invariant::L5, None, Some(&group.job), Some(&group.item), what));
        }
    }
}

/// Which jobs one statement of the items pass reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Jobs {
    /// From `$1`, below `$2`.
    Bounded,
    /// From `$1` to the end.
    Open,
    /// The job `$1`.
    One,
    /// The jobs in the array `$1` (PostgreSQL).
    Many,
}

/// The items pass's statement over some jobs: each item with its job and entries, and what each
/// of its allocations still holds, merged in `(job_id, item_id)` order.
pub(crate) fn items_pass_sql(jobs: Jobs, engine: Engine) -> String {
    // PostgreSQL carries an equality across a join but not a range or a list: without the range
    // said of the lines too, each range of a full audit read (and hashed) the whole ledger — 16
    // ranges of a million lines, 1.0-1.7 s each where the one range of the whole took 6.3 s — and
    // without the jobs' own condition each statement of touched jobs read every job (12 of its
    // 40 ms at 100,000 jobs). Measured.
    let lines = match jobs {
        Jobs::Bounded => " AND e.job_id >= $1 AND e.job_id < $2",
        Jobs::Open => " AND e.job_id >= $1",
        Jobs::One | Jobs::Many => "",
    };
    let (items, parts, jobs) = match jobs {
        Jobs::Bounded => {
            ("i.job_id >= $1 AND i.job_id < $2", "a.job_id >= $1 AND a.job_id < $2", "j.id >= $1 AND j.id < $2")
        }
        Jobs::Open => ("i.job_id >= $1", "a.job_id >= $1", "j.id >= $1"),
        Jobs::One => ("i.job_id = $1", "a.job_id = $1", "j.id = $1"),
        Jobs::Many => ("i.job_id = ANY($1)", "a.job_id = ANY($1)", "j.id = ANY($1)"),
    };

    let part = "a.item_id, 2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, a.taken - a.given_back, a.account_id, a.job_id, a.account_seq";
    match engine {
        Engine::Postgres => format!(
            "SELECT {} FROM items i JOIN jobs j ON j.id = i.job_id \
                 LEFT JOIN ledger_entries e ON e.job_id = i.job_id AND e.item_id = i.item_id{lines} \
                 WHERE {items} AND {jobs} \
                 UNION ALL SELECT a.job_id, {part} FROM allocations a WHERE {parts} \
                 ORDER BY 1, 2",
            ItemRow::LIST
        ),
        // SQLite files a job's lines and parts by its number (migration 0037): each item's
        // lines found by its job's, each job's parts by its number as the range's jobs are
        // walked by id, and the parts that carry none (naming no job that exists) by id.
        Engine::Sqlite => format!(
            "SELECT {} FROM items i JOIN jobs j ON j.id = i.job_id \
                 LEFT JOIN ledger_entries e ON e.job_seq = j.job_seq AND e.item_id = i.item_id \
                 WHERE {items} \
                 UNION ALL SELECT j.id, {part} FROM jobs j JOIN allocations a ON a.job_seq = j.job_seq \
                 WHERE {jobs} \
                 UNION ALL SELECT a.job_id, {unnumbered} FROM allocations a \
                 WHERE {parts} AND a.job_seq IS NULL \
                 ORDER BY 1, 2",
            ItemRow::LIST,
            // A part without a number is met as one misfiled (its `job_id` not given), so
            // the audit looks for it by name: on SQLite only a part naming no job may lack it.
            unnumbered = "a.item_id, 2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, a.taken - a.given_back, a.account_id, NULL, a.account_seq",
        ),
    }
}

impl ItemsPass<'_> {
    /// Takes ranges in turn until none is left.
    pub(crate) async fn run(&self, db: &mut Db<'_>) -> Result<(), StoreError> {
        loop {
            let at = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(range) = self.ranges.get(at) else { return Ok(()) };
            let part = self.range(db, range).await?;
            self.done.lock().unwrap_or_else(|e| e.into_inner())[at] = Some(part);
        }
    }

    /// Every range's findings, in key order.
    pub(crate) fn finished(self) -> Result<Vec<ItemsPart>, StoreError> {
        let done = self.done.into_inner().unwrap_or_else(|e| e.into_inner());
        done.into_iter()
            .map(|p| p.ok_or_else(|| StoreError::internal("a range of the items pass did not run")))
            .collect()
    }

    /// Each item with its job and entries, and what its allocations still hold, in key order (the
    /// items' primary key, the entries' (job, item, kind) index, the allocations' (job, item)
    /// index, merged): one item in memory at a time.
    async fn range(&self, db: &mut Db<'_>, range: &JobRange) -> Result<ItemsPart, StoreError> {
        static SQL: LazyLock<[String; 6]> = LazyLock::new(|| {
            [Jobs::Bounded, Jobs::Open, Jobs::One]
                .map(|jobs| [items_pass_sql(jobs, Engine::Sqlite), items_pass_sql(jobs, Engine::Postgres)])
                .as_flattened()
                .to_owned()
                .try_into()
                .expect("six statements")
        });
        static MANY: LazyLock<String> = LazyLock::new(|| items_pass_sql(Jobs::Many, Engine::Postgres));
        let at = if db.engine() == Engine::Sqlite { 0 } else { 1 };
        let (bounded, open, one) = (&SQL[at], &SQL[2 + at], &SQL[4 + at]);
        let mut part = ItemsPart { collect: self.collect, ..ItemsPart::default() };
        let (mut job, mut item, mut key) = (String::new(), String::new(), Key::default());
        // After its account's checkpoint position (from a checkpoint; else never counted).
        let after = |account: Option<&str>, position: Option<i64>| match (&self.positions, account, position) {
            (Some(positions), Some(account), Some(position)) => position > positions.get(account).copied().unwrap_or(0),
            _ => false,
        };
        let mut step = |r: &crate::db::Cells<'_>| {
            use ItemRow as C;
            let rows = self.rows.fetch_add(1, Ordering::Relaxed) + 1;
            if rows.is_multiple_of(PROGRESS_EVERY) {
                (self.progress)(AuditProgress { phase: "items", done: rows, total: self.total });
            }
            let (row_job, row_item) = (r.str(C::job_id)?, r.str(C::item_id)?);
            if row_job != job || row_item != item {
                part.close(std::mem::take(&mut key), &self.known);
                if row_job != job {
                    part.jobs_met += 1;
                }
                job.replace_range(.., row_job);
                item.replace_range(.., row_item);
            }
            if r.i64(C::src)? == 2 {
                part.parts += 1;
                if r.opt_str(C::entry_job)? != Some(job.as_str()) {
                    part.misfiled += 1;
                }
                if after(r.opt_str(C::entry_account)?, r.opt_i64(C::entry_position)?) {
                    part.parts_after += 1;
                }
                key.open = Some(key.open.unwrap_or(0) + i128::from(r.i64(C::entry_amount)?));
                return Ok(());
            }
            if key.group.is_none() {
                key.group = Some(ItemGroup {
                    job: job.clone(),
                    item: item.clone(),
                    cost: r.i64(C::cost)?,
                    hold: r.opt_i64(C::hold)?,
                    state: r.text(C::state)?,
                    job_account: r.text(C::job_account)?,
                    job_kind: r.text(C::job_kind)?,
                    entries: Vec::new(),
                });
            }
            if let Some(seq) = r.opt_i64(C::entry_seq)? {
                part.joined += 1;
                if r.opt_str(C::entry_job)? != Some(job.as_str()) {
                    part.misfiled += 1;
                }
                if after(r.opt_str(C::entry_account)?, r.opt_i64(C::entry_position)?) {
                    part.lines_after += 1;
                }
                let (kind, account) = (r.str(C::entry_kind)?, r.str(C::entry_account)?);
                // Entries pass A could not place (unknown kind, missing account) are reported there.
                if let Some(kind) = EntryKind::parse(kind)
                    && self.known.contains(account)
                    && let Some(group) = key.group.as_mut()
                {
                    group.entries.push((seq, kind, r.i64(C::entry_amount)?, account.to_owned()));
                }
            }
            Ok(())
        };
        match range {
            JobRange::Span { from, to: Some(to) } => {
                db.each(bounded, args![from.as_str(), to.as_str()], &mut step).await?
            }
            JobRange::Span { from, to: None } => db.each(open, args![from.as_str()], &mut step).await?,
            JobRange::Jobs(ids) if db.engine() == Engine::Postgres => {
                db.each(&MANY, &[crate::db::Value::Texts(ids.clone())], &mut step).await?
            }
            JobRange::Jobs(ids) => {
                let mut n = 0;
                for id in ids {
                    n += db.each(one, args![id.as_str()], &mut step).await?;
                }
                n
            }
        };
        part.close(key, &self.known);
        Ok(part)
    }
}

/// How an item's entries add up.
#[derive(Default)]
struct Tally {
    sum: i128,
    charges: u32,
    refunds: u32,
    reclaims: u32,
    returns: u32,
    releases: u32,
    reclaim_before_refund: bool,
}

fn tally(entries: &[(i64, EntryKind, i64, String)]) -> Tally {
    let mut t = Tally::default();
    for (_, kind, amount, _) in entries {
        t.sum += i128::from(*amount);
        match kind {
            EntryKind::Charge => t.charges += 1,
            EntryKind::Refund => t.refunds += 1,
            EntryKind::Reclaim => {
                t.reclaim_before_refund |= t.refunds == 0;
                t.reclaims += 1;
            }
            EntryKind::PayoutReturn => t.returns += 1,
            EntryKind::Release => t.releases += 1,
            EntryKind::Grant | EntryKind::Adjustment | EntryKind::Expire => {}
        }
    }
    t
}

/// The exact entries each item state requires, in order. A held item priced below its hold
/// (`released`) was succeeded from `charged` with its release.
fn expected_kinds(state: ItemState, refunds: u32, released: bool) -> &'static [EntryKind] {
    match state {
        ItemState::Succeeded if released => &[EntryKind::Charge, EntryKind::Release],
        ItemState::Charged | ItemState::Succeeded => &[EntryKind::Charge],
        ItemState::Refunded | ItemState::Cancelled => &[EntryKind::Charge, EntryKind::Refund],
        ItemState::Reclaimed => &[EntryKind::Charge, EntryKind::Refund, EntryKind::Reclaim],
        // A payout returned after it was paid: credited back once, after the charge (or after a
        // refund reclaimed when the payout turned out to have executed late).
        ItemState::Returned if refunds > 0 => {
            &[EntryKind::Charge, EntryKind::Refund, EntryKind::Reclaim, EntryKind::PayoutReturn]
        }
        ItemState::Returned => &[EntryKind::Charge, EntryKind::PayoutReturn],
    }
}

/// L3 and L4 for one item and its entries; adds what it may still credit back or reclaim to its
/// account's totals.
fn check_item(mut group: ItemGroup, part: &mut ItemsPart, known: &BTreeSet<String>) {
    group.entries.sort_by_key(|e| e.0);
    let ItemGroup { job, item, cost, hold, state: state_s, job_account, job_kind, entries } = group;
    let violations = &mut part.violations;
    let mut found = |invariant, account: Option<&str>, message| {
        violations.push(v(invariant, account, Some(&job), Some(&item), message));
    };
    let Some(state) = ItemState::parse(&state_s) else {
        found(Invariant::L3, None, format!("unknown item state {state_s}"));
        return;
    };
    let t = tally(&entries);
    let net = state.net(Credits::new(cost)).map(|c| i128::from(c.get())).unwrap_or(i128::MIN);
    if t.sum != net {
        found(Invariant::L3, None, format!("entries sum to {} but state {state_s} nets {net}", t.sum));
    }
    if t.charges > 1 || t.refunds > 1 || t.reclaims > 1 || t.returns > 1 || t.releases > 1 {
        let (c, r, rc, pr, rl) = (t.charges, t.refunds, t.reclaims, t.returns, t.releases);
        found(
            Invariant::L4,
            None,
            format!("{c} charges, {r} refunds, {rc} reclaims, {pr} payout returns, {rl} releases"),
        );
    }
    if t.reclaim_before_refund {
        found(Invariant::L4, None, "a reclaim without an earlier refund".to_owned());
    }
    if t.releases > 0 && (hold.is_none() || t.refunds > 0) {
        found(Invariant::L4, None, "a release not made from charged on a held item".to_owned());
    }
    if let Some(hold) = hold {
        // Priced (delivered) items cost at most their hold; the others are still at their hold.
        let priced = matches!(state, ItemState::Succeeded | ItemState::Reclaimed);
        if !(0..=hold).contains(&cost) || (!priced && cost != hold) {
            found(Invariant::L3, None, format!("state {state_s} with cost {cost} and hold {hold}"));
        }
        if state == ItemState::Returned || job_kind == settle_core::job::WITHDRAWAL_KIND {
            found(Invariant::L3, None, "a held item in a withdrawal".to_owned());
        }
    }
    let released = hold.is_some_and(|h| cost < h) && state == ItemState::Succeeded;
    let kinds: Vec<EntryKind> = entries.iter().map(|e| e.1).collect();
    if kinds != expected_kinds(state, t.refunds, released) {
        found(Invariant::L3, None, format!("state {state_s} has entries {kinds:?}"));
    }
    // A held item's charge and refund move its hold, its reclaim its price, its release the
    // difference; a fixed item's entries all move its cost.
    let taken = i128::from(hold.unwrap_or(cost));
    for (_, kind, amount, account) in &entries {
        let want = match kind {
            EntryKind::Refund => taken,
            EntryKind::Charge => -taken,
            EntryKind::Release => taken - i128::from(cost),
            EntryKind::PayoutReturn => i128::from(cost),
            _ => -i128::from(cost),
        };
        if i128::from(*amount) != want {
            found(Invariant::L3, Some(account), format!("{kind:?} of {amount} for an item of cost {cost}"));
        }
        if *account != job_account {
            found(
                Invariant::L3,
                Some(account),
                format!("{kind:?} posted to {account}, not the job's account {job_account}"),
            );
        }
    }
    let refunded = if state == ItemState::Refunded { i128::from(cost) } else { 0 };
    let held = if state.is_held(job_kind == settle_core::job::WITHDRAWAL_KIND) { i128::from(cost) } else { 0 };
    part.owe(known, &job_account, refunded, held);
    part.job_owes(&job, &job_account, refunded, held);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NewAccount, NewGrant, NewItem, NewJob, Price};
    use crate::store::Store;
    use settle_core::ids::{AccountId, ItemId, JobId, JobKind, RefId};
    use settle_core::{Clock, FakeClock, Timestamp};

    fn job(id: &str, account: &str, costs: &[i64]) -> NewJob {
        NewJob {
            id: JobId::parse(id).unwrap(),
            account_id: AccountId::parse(account).unwrap(),
            kind: JobKind::parse("render").unwrap(),
            items: costs
                .iter()
                .enumerate()
                .map(|(i, c)| NewItem {
                    id: ItemId::parse(&format!("i{i}")).unwrap(),
                    price: Price::Cost(Credits::new(*c)),
                })
                .collect(),
            payload: serde_json::Value::Null,
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
        }
    }

    fn grant(id: &str, amount: i64, expires_at: Option<Timestamp>) -> NewGrant {
        NewGrant {
            id: RefId::parse(id).unwrap(),
            amount: Credits::new(amount),
            reason: None,
            expires_at,
            priority: None,
        }
    }

    /// L5's tallies as they are judged: its findings in any order (a settlement whose debt part
    /// is in the other range is judged after both ranges, so it comes last).
    fn judged(mut l5: L5) -> String {
        l5.found.sort();
        format!("{l5:#?}")
    }

    /// A store of grants taken from, given back, expired; debt parts, settled by later grants, then
    /// refunded: the allocations pass cut in two at every id (as the PostgreSQL audit cuts it, the
    /// later range read apart and merged; ranges are read by `COPY`, PostgreSQL's only) tallies exactly what one pass over them does, with and
    /// without a checkpoint's positions.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_the_allocations_cut_anywhere_tally_as_one_pass() {
        use sqlx::ConnectOptions;
        use std::str::FromStr;
        let url = settle_testkit::fresh_database().await;
        let clock = Arc::new(FakeClock::new(Timestamp::from_micros(1_800_000_000_000_000)));
        let options = crate::StoreOptions { clock: clock.clone(), ..crate::StoreOptions::default() };
        let store = crate::SqlStore::open(&url, options).await.unwrap();
        let actor = crate::SYSTEM_ACTOR;
        for (id, overdraft) in [("a", 100), ("b", 0)] {
            let account = NewAccount {
                id: AccountId::parse(id).unwrap(),
                overdraft_limit: Credits::new(overdraft),
                max_running: None,
            };
            store.create_account(account, actor).await.unwrap();
        }
        let (a, b) = (AccountId::parse("a").unwrap(), AccountId::parse("b").unwrap());
        let soon = Timestamp::from_micros(clock.now().micros() + 3_600_000_000);
        store.grant(&a, grant("g1", 20, Some(soon)), actor).await.unwrap();
        store.grant(&a, grant("g2", 10, None), actor).await.unwrap();
        store.grant(&b, grant("h1", 50, None), actor).await.unwrap();
        for (id, account, costs) in
            [("j1", "a", &[15][..]), ("j2", "a", &[10, 10]), ("j3", "a", &[30]), ("k1", "b", &[20])]
        {
            store.create_job(job(id, account, costs)).await.unwrap();
        }
        store.cancel(&JobId::parse("j1").unwrap(), None).await.unwrap();
        // Pays the debt of j2 and most of j3's: settlements.
        store.grant(&a, grant("g3", 25, None), actor).await.unwrap();
        // A settled debt refunded: its settlements then pay nothing.
        store.cancel(&JobId::parse("j3").unwrap(), None).await.unwrap();
        store.create_job(job("j4", "a", &[8, 40])).await.unwrap();
        clock.advance_seconds(7_200);
        store.expire_grants(10).await.unwrap();
        store.grant(&a, grant("g4", 60, None), actor).await.unwrap();
        store.cancel(&JobId::parse("k1").unwrap(), None).await.unwrap();
        let report = store.audit(None).await.unwrap();
        assert!(report.ok(), "{report:#?}");
        store.close().await;

        let mut c = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        let db = &mut Db::pg(&mut c);
        columns! {
            Counted { settlements = "COUNT(paid_part)", parts = "COUNT(*)" }
        }
        columns! {
            PartId { id }
        }
        static COUNTED: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM allocations", Counted::LIST));
        static IDS: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM allocations ORDER BY id", PartId::LIST));
        let (settlements, parts) = {
            let r = db.one(&COUNTED, args![]).await.unwrap();
            (r.i64(Counted::settlements).unwrap(), r.i64(Counted::parts).unwrap())
        };
        assert!(
            settlements >= 2 && parts >= 10,
            "the story makes settlements ({settlements}) among its parts ({parts})"
        );
        let ids: Vec<i64> = db.all(&IDS, args![]).await.unwrap().iter().map(|r| r.i64(PartId::id).unwrap()).collect();
        let clean = cuts_agree(db, &ids).await;
        assert!(!clean.contains("found: [\n        ("), "a clean store: {clean}");
        // Then findings in the pass, spread over the ids: takes after their grant expired, owed
        // marks turned, a debt part that says less paid than its settlements pay.
        let expired = soon.micros() + 1;
        let tampering = format!(
            "UPDATE allocations SET created_at = {expired} WHERE grant_key = (SELECT key FROM grants WHERE source_id = 'g1'); \
             ALTER TABLE allocations DROP CONSTRAINT allocations_owed_check; \
             UPDATE allocations SET owed = 1 - owed WHERE id % 3 = 0; \
             UPDATE allocations SET settled = settled - 1 WHERE id = (SELECT MAX(id) FROM allocations WHERE settled > 0)"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(tampering)).execute(&mut c).await.unwrap();
        let db = &mut Db::pg(&mut c);
        let tampered = cuts_agree(db, &ids).await;
        for says in ["at or after its expiry", "is marked owed"] {
            assert!(tampered.contains(says), "{says}: {tampered}");
        }
    }

    /// The allocations pass in one, then cut at every id from the first to one past the last, and
    /// at every two such ids, with and without a checkpoint's positions: every cut tallies what the
    /// one pass does. Returns the one pass's tallies.
    async fn cuts_agree(db: &mut Db<'_>, ids: &[i64]) -> String {
        let checkpoint: BTreeMap<String, i64> = [("a".to_owned(), 4), ("b".to_owned(), 1)].into();
        let mut tallies = String::new();
        for positions in [None, Some(&checkpoint)] {
            let mut one = L5::default();
            one.load(db).await.unwrap();
            one.parts(db, positions).await.unwrap();
            let one = judged(one);
            let end = ids[ids.len() - 1] + 1;
            for cut in ids[0]..=end {
                let mut earlier = L5::default();
                earlier.load(db).await.unwrap();
                let mut later = earlier.fork();
                let mut unmatched = earlier.parts_in(db, positions, Some((ids[0], Some(cut)))).await.unwrap();
                unmatched.extend(later.parts_in(db, positions, Some((cut, None))).await.unwrap());
                earlier.merge(later);
                earlier.settle(db, unmatched).await.unwrap();
                assert_eq!(judged(earlier), one, "cut at {cut}, positions {positions:?}");
            }
            // In three, as the audit's ranges are merged: each tally into the one before it.
            for (cut, then) in (ids[0]..=end).flat_map(|c| (c..=end).map(move |d| (c, d))) {
                let mut earlier = L5::default();
                earlier.load(db).await.unwrap();
                let (mut middle, mut later) = (earlier.fork(), earlier.fork());
                let mut unmatched = earlier.parts_in(db, positions, Some((ids[0], Some(cut)))).await.unwrap();
                unmatched.extend(middle.parts_in(db, positions, Some((cut, Some(then)))).await.unwrap());
                unmatched.extend(later.parts_in(db, positions, Some((then, None))).await.unwrap());
                earlier.merge(middle);
                earlier.merge(later);
                earlier.settle(db, unmatched).await.unwrap();
                assert_eq!(judged(earlier), one, "cut at {cut} and {then}, positions {positions:?}");
            }
            tallies = one;
        }
        tallies
    }
}
