//! `settle audit`: the ledger invariants L1–L4 of the spec, recomputed from the rows.
//! Reads one consistent snapshot; sums in `i128`, so a corrupt row cannot overflow the checker.

use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::{AuditReport, Violation};
use settle_core::Credits;
use settle_core::item::ItemState;
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};
use std::collections::BTreeMap;

struct Acc {
    balance: i64,
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
    state: String,
    job_account: String,
    job_kind: String,
    /// seq, kind, amount, account.
    entries: Vec<(i64, EntryKind, i64, String)>,
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

fn v(
    invariant: &'static str,
    account: Option<&str>,
    job: Option<&str>,
    item: Option<&str>,
    message: String,
) -> Violation {
    Violation {
        invariant,
        account_id: account.map(str::to_owned),
        job_id: job.map(str::to_owned),
        item_id: item.map(str::to_owned),
        message,
    }
}

/// The whole audit in three streaming passes over one snapshot, memory bounded by the number of
/// accounts (not entries or items): the ledger in `seq` order (L1 sums, L2 running balances and
/// hash chains, gap-free numbers); every item joined with its entries in key order (L3, L4, the
/// held and exposure totals); the outbox numbers. `progress` is called every 100 000 rows.
pub(crate) async fn audit(
    db: &mut Db<'_>,
    progress: &(dyn Fn(AuditProgress) + Send + Sync),
) -> Result<AuditReport, StoreError> {
    let mut violations = Vec::new();
    let mut accounts: BTreeMap<String, Acc> = BTreeMap::new();
    for r in db.all("SELECT id, balance, exposure, held FROM accounts ORDER BY id", args![]).await? {
        let (balance, exposure, held) = (r.i64(1)?, r.i64(2)?, r.i64(3)?);
        accounts.insert(
            r.text(0)?,
            Acc { balance, exposure, refunded_cost: 0, held, held_cost: 0, sum: 0, running: 0, prev: GENESIS_HASH },
        );
    }
    let total = db.one("SELECT COALESCE(MAX(seq), 0) FROM ledger_entries", args![]).await?.i64(0)?.max(0) as u64;

    // Pass A: the ledger in seq order.
    let mut expected_seq = 1i64;
    let mut item_entries: u64 = 0;
    let mut done: u64 = 0;
    let entries_checked = db
        .each(
            "SELECT seq, account_id, kind, amount, balance_after, job_id, item_id, created_at, prev_hash, hash, \
             ref_id, reason FROM ledger_entries ORDER BY seq",
            args![],
            |r| {
                done += 1;
                if done.is_multiple_of(PROGRESS_EVERY) {
                    progress(AuditProgress { phase: "ledger", done, total });
                }
                let (seq, account_id, kind_s, amount, balance_after) =
                    (r.i64(0)?, r.text(1)?, r.text(2)?, r.i64(3)?, r.i64(4)?);
                let (job_id, item_id, created_at) = (r.opt_text(5)?, r.opt_text(6)?, r.i64(7)?);
                let (prev_hash, hash) = (r.blob(8)?, r.blob(9)?);
                let (ref_id, reason) = (r.opt_text(10)?, r.opt_text(11)?);
                if seq != expected_seq {
                    violations.push(v(
                        "SEQ",
                        Some(&account_id),
                        None,
                        None,
                        format!("ledger seq {seq} follows {}", expected_seq - 1),
                    ));
                }
                expected_seq = seq + 1;
                let Some(kind) = EntryKind::parse(&kind_s) else {
                    violations.push(v(
                        "L2",
                        Some(&account_id),
                        None,
                        None,
                        format!("entry {seq} has unknown kind {kind_s}"),
                    ));
                    return Ok(());
                };
                let Some(acc) = accounts.get_mut(&account_id) else {
                    violations.push(v(
                        "L1",
                        Some(&account_id),
                        None,
                        None,
                        format!("entry {seq} names a missing account"),
                    ));
                    return Ok(());
                };
                acc.sum += i128::from(amount);
                acc.running += i128::from(amount);
                if acc.running != i128::from(balance_after) {
                    violations.push(v(
                        "L2",
                        Some(&account_id),
                        job_id.as_deref(),
                        item_id.as_deref(),
                        format!("entry {seq}: balance_after {balance_after} but the running sum is {}", acc.running),
                    ));
                    acc.running = i128::from(balance_after);
                }
                let fields = EntryFields {
                    seq,
                    account_id: &account_id,
                    kind,
                    amount,
                    balance_after,
                    job_id: job_id.as_deref(),
                    item_id: item_id.as_deref(),
                    ref_id: ref_id.as_deref(),
                    reason: reason.as_deref(),
                    created_at,
                };
                let computed = chain_hash(&acc.prev, &fields);
                if prev_hash.as_slice() != acc.prev.as_slice() || hash.as_slice() != computed.as_slice() {
                    violations.push(v(
                        "L2",
                        Some(&account_id),
                        job_id.as_deref(),
                        item_id.as_deref(),
                        format!("entry {seq}: hash chain does not verify"),
                    ));
                }
                acc.prev = hash.as_slice().try_into().unwrap_or(computed);
                if job_id.is_some() && item_id.is_some() {
                    item_entries += 1;
                }
                Ok(())
            },
        )
        .await?;
    for (id, acc) in &accounts {
        if acc.sum != i128::from(acc.balance) {
            violations.push(v(
                "L1",
                Some(id),
                None,
                None,
                format!("balance {} but entries sum to {}", acc.balance, acc.sum),
            ));
        }
    }

    // Pass B: each item with its entries, in key order (the items' primary key, then the
    // entries' (job, item, kind) index): one item in memory at a time.
    let mut current: Option<ItemGroup> = None;
    let mut items_checked: u64 = 0;
    let mut joined_entries: u64 = 0;
    let mut rows_seen: u64 = 0;
    db.each(
        "SELECT i.job_id, i.item_id, i.cost, i.state, j.account_id, j.kind, e.seq, e.kind, e.amount, e.account_id \
         FROM items i JOIN jobs j ON j.id = i.job_id \
         LEFT JOIN ledger_entries e ON e.job_id = i.job_id AND e.item_id = i.item_id \
         ORDER BY i.job_id, i.item_id",
        args![],
        |r| {
            rows_seen += 1;
            if rows_seen.is_multiple_of(PROGRESS_EVERY) {
                progress(AuditProgress { phase: "items", done: rows_seen, total });
            }
            let (job, item) = (r.text(0)?, r.text(1)?);
            let same = current.as_ref().is_some_and(|g| g.job == job && g.item == item);
            if !same {
                if let Some(done) = current.take() {
                    items_checked += 1;
                    check_item(done, &mut accounts, &mut violations);
                }
                current = Some(ItemGroup {
                    job,
                    item,
                    cost: r.i64(2)?,
                    state: r.text(3)?,
                    job_account: r.text(4)?,
                    job_kind: r.text(5)?,
                    entries: Vec::new(),
                });
            }
            if let Some(seq) = r.opt_i64(6)? {
                joined_entries += 1;
                let kind_s = r.text(7)?;
                let account = r.text(9)?;
                // Entries pass A could not place (unknown kind, missing account) are reported there.
                if let Some(kind) = EntryKind::parse(&kind_s)
                    && accounts.contains_key(&account)
                    && let Some(group) = current.as_mut()
                {
                    group.entries.push((seq, kind, r.i64(8)?, account));
                }
            }
            Ok(())
        },
    )
    .await?;
    if let Some(done) = current.take() {
        items_checked += 1;
        check_item(done, &mut accounts, &mut violations);
    }
    for (id, acc) in &accounts {
        if acc.held_cost != i128::from(acc.held) {
            violations.push(v(
                "L1",
                Some(id),
                None,
                None,
                format!("held {} but the items that may still be credited back cost {}", acc.held, acc.held_cost),
            ));
        }
        if i128::from(acc.balance) + i128::from(acc.held) > i128::from(settle_core::limits::BALANCE_MAX) {
            violations.push(v(
                "L1",
                Some(id),
                None,
                None,
                format!("balance {} plus held {} exceeds the largest balance", acc.balance, acc.held),
            ));
        }
        if acc.refunded_cost != i128::from(acc.exposure) {
            violations.push(v(
                "L1",
                Some(id),
                None,
                None,
                format!("exposure {} but refunded items cost {}", acc.exposure, acc.refunded_cost),
            ));
        }
    }
    // Entries of items that do not exist: only looked for when pass B met fewer entries than
    // pass A counted.
    if joined_entries != item_entries {
        let orphans = db
            .all(
                "SELECT DISTINCT e.job_id, e.item_id FROM ledger_entries e WHERE e.job_id IS NOT NULL \
                 AND NOT EXISTS (SELECT 1 FROM items i WHERE i.job_id = e.job_id AND i.item_id = e.item_id) \
                 ORDER BY e.job_id, e.item_id",
                args![],
            )
            .await?;
        for r in &orphans {
            let (job, item) = (r.text(0)?, r.text(1)?);
            violations.push(v(
                "L3",
                None,
                Some(&job),
                Some(&item),
                "ledger entries name an item that does not exist".to_owned(),
            ));
        }
    }
    // Withdrawals: one row per withdrawal job, holding exactly the job's cost; `returned` exactly
    // when the return was recorded.
    let withdrawal_rows = db
        .all(
            "SELECT j.id, j.kind, j.state, j.cost, w.amount, w.returned_at, \
                    (SELECT COUNT(*) FROM items i WHERE i.job_id = j.id AND i.state <> 'returned') \
             FROM jobs j LEFT JOIN withdrawals w ON w.job_id = j.id \
             WHERE j.kind = 'withdrawal' OR w.job_id IS NOT NULL ORDER BY j.id",
            args![],
        )
        .await?;
    for r in &withdrawal_rows {
        let (job, kind, state, cost) = (r.text(0)?, r.text(1)?, r.text(2)?, r.i64(3)?);
        let (amount, returned_at, not_returned) = (r.opt_i64(4)?, r.opt_i64(5)?, r.i64(6)?);
        let problem = if kind != settle_core::job::WITHDRAWAL_KIND || amount.is_none() {
            Some("a withdrawal row and a withdrawal job come together".to_owned())
        } else if amount != Some(cost) {
            Some(format!("withdrawal amount {amount:?} but the job holds {cost}"))
        } else if (state == "returned") != returned_at.is_some() {
            Some(format!("state {state} but returned_at {returned_at:?}"))
        } else if state == "returned" && not_returned > 0 {
            Some(format!("returned, but {not_returned} item(s) were not credited back"))
        } else {
            None
        };
        if let Some(message) = problem {
            violations.push(v("L3", None, Some(&job), None, message));
        }
    }
    let mut expected = 1i64;
    db.each("SELECT seq FROM outbox ORDER BY seq", args![], |r| {
        let seq = r.i64(0)?;
        if seq != expected {
            violations.push(v("SEQ", None, None, None, format!("outbox seq {seq} follows {}", expected - 1)));
        }
        expected = seq + 1;
        Ok(())
    })
    .await?;
    Ok(AuditReport { accounts_checked: accounts.len() as u64, items_checked, entries_checked, violations })
}

/// L3 and L4 for one item and its entries; adds what it may still credit back or reclaim to its
/// account's totals.
fn check_item(mut group: ItemGroup, accounts: &mut BTreeMap<String, Acc>, violations: &mut Vec<Violation>) {
    group.entries.sort_by_key(|e| e.0);
    let ItemGroup { job, item, cost, state: state_s, job_account, job_kind, entries } = group;
    let Some(state) = ItemState::parse(&state_s) else {
        violations.push(v("L3", None, Some(&job), Some(&item), format!("unknown item state {state_s}")));
        return;
    };
    let (mut sum, mut charges, mut refunds, mut reclaims, mut returns) = (0i128, 0u32, 0u32, 0u32, 0u32);
    let mut refunded_before = false;
    let mut reclaim_before_refund = false;
    for (_, kind, amount, _) in &entries {
        sum += i128::from(*amount);
        match kind {
            EntryKind::Charge => charges += 1,
            EntryKind::Refund => {
                refunds += 1;
                refunded_before = true;
            }
            EntryKind::Reclaim => {
                reclaims += 1;
                if !refunded_before {
                    reclaim_before_refund = true;
                }
            }
            EntryKind::PayoutReturn => returns += 1,
            EntryKind::Grant | EntryKind::Adjustment => {}
        }
    }
    let net = state.net(Credits::new(cost)).map(|c| i128::from(c.get())).unwrap_or(i128::MIN);
    if sum != net {
        violations.push(v(
            "L3",
            None,
            Some(&job),
            Some(&item),
            format!("entries sum to {sum} but state {state_s} nets {net}"),
        ));
    }
    if charges > 1 || refunds > 1 || reclaims > 1 || returns > 1 {
        violations.push(v(
            "L4",
            None,
            Some(&job),
            Some(&item),
            format!("{charges} charges, {refunds} refunds, {reclaims} reclaims, {returns} payout returns"),
        ));
    }
    if reclaim_before_refund {
        violations.push(v("L4", None, Some(&job), Some(&item), "a reclaim without an earlier refund".to_owned()));
    }
    // The exact entries each state requires, each for exactly ±cost, on the job's account.
    let expected: &[EntryKind] = match state {
        ItemState::Charged | ItemState::Succeeded => &[EntryKind::Charge],
        ItemState::Refunded | ItemState::Cancelled => &[EntryKind::Charge, EntryKind::Refund],
        ItemState::Reclaimed => &[EntryKind::Charge, EntryKind::Refund, EntryKind::Reclaim],
        // A payout returned after it was paid: credited back once, after the charge (or after a
        // refund reclaimed when the payout turned out to have executed late).
        ItemState::Returned if refunds > 0 => {
            &[EntryKind::Charge, EntryKind::Refund, EntryKind::Reclaim, EntryKind::PayoutReturn]
        }
        ItemState::Returned => &[EntryKind::Charge, EntryKind::PayoutReturn],
    };
    let kinds: Vec<EntryKind> = entries.iter().map(|e| e.1).collect();
    if kinds != expected {
        violations.push(v("L3", None, Some(&job), Some(&item), format!("state {state_s} has entries {kinds:?}")));
    }
    let returnable = job_kind == settle_core::job::WITHDRAWAL_KIND;
    if let Some(acc) = accounts.get_mut(&job_account) {
        if state == ItemState::Refunded {
            acc.refunded_cost += i128::from(cost);
        }
        if state.is_held(returnable) {
            acc.held_cost += i128::from(cost);
        }
    }
    for (_, kind, amount, account) in &entries {
        let want = match kind {
            EntryKind::Refund | EntryKind::PayoutReturn => i128::from(cost),
            _ => -i128::from(cost),
        };
        if i128::from(*amount) != want {
            violations.push(v(
                "L3",
                Some(account),
                Some(&job),
                Some(&item),
                format!("{kind:?} of {amount} for an item of cost {cost}"),
            ));
        }
        if *account != job_account {
            violations.push(v(
                "L3",
                Some(account),
                Some(&job),
                Some(&item),
                format!("{kind:?} posted to {account}, not the job's account {job_account}"),
            ));
        }
    }
}
