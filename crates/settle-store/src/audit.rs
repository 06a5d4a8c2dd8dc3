//! `settle audit`: the ledger invariants L1–L4 of the spec, recomputed from the rows.
//! Reads one consistent snapshot; sums in `i128`, so a corrupt row cannot overflow the checker.

use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::{AuditReport, Violation};
use settle_core::Credits;
use settle_core::item::ItemState;
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};
use std::collections::{BTreeMap, HashMap};

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

#[derive(Default)]
struct ItemLedger {
    /// Every entry of the item, in seq order: kind, amount, account.
    entries: Vec<(EntryKind, i64, String)>,
    sum: i128,
    charges: u32,
    refunds: u32,
    reclaims: u32,
    returns: u32,
    refund_seq: Option<i64>,
    reclaim_before_refund: bool,
}

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

pub(crate) async fn audit(db: &mut Db<'_>) -> Result<AuditReport, StoreError> {
    let mut violations = Vec::new();
    let mut accounts: BTreeMap<String, Acc> = BTreeMap::new();
    for r in db.all("SELECT id, balance, exposure, held FROM accounts ORDER BY id", args![]).await? {
        let (balance, exposure, held) = (r.i64(1)?, r.i64(2)?, r.i64(3)?);
        accounts.insert(
            r.text(0)?,
            Acc { balance, exposure, refunded_cost: 0, held, held_cost: 0, sum: 0, running: 0, prev: GENESIS_HASH },
        );
    }
    let mut items: HashMap<(String, String), ItemLedger> = HashMap::new();
    let rows = db
        .all(
            "SELECT seq, account_id, kind, amount, balance_after, job_id, item_id, created_at, prev_hash, hash, \
             ref_id, reason FROM ledger_entries ORDER BY seq",
            args![],
        )
        .await?;
    let mut expected_seq = 1i64;
    for r in &rows {
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
            violations.push(v("L2", Some(&account_id), None, None, format!("entry {seq} has unknown kind {kind_s}")));
            continue;
        };
        let Some(acc) = accounts.get_mut(&account_id) else {
            violations.push(v("L1", Some(&account_id), None, None, format!("entry {seq} names a missing account")));
            continue;
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
        if let (Some(job), Some(item)) = (&job_id, &item_id) {
            let il = items.entry((job.clone(), item.clone())).or_default();
            il.entries.push((kind, amount, account_id.clone()));
            il.sum += i128::from(amount);
            match kind {
                EntryKind::Charge => il.charges += 1,
                EntryKind::Refund => {
                    il.refunds += 1;
                    il.refund_seq.get_or_insert(seq);
                }
                EntryKind::Reclaim => {
                    il.reclaims += 1;
                    if il.refund_seq.is_none() {
                        il.reclaim_before_refund = true;
                    }
                }
                EntryKind::PayoutReturn => il.returns += 1,
                EntryKind::Grant | EntryKind::Adjustment => {}
            }
        }
    }
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
    let item_rows = db
        .all(
            "SELECT i.job_id, i.item_id, i.cost, i.state, j.account_id, j.kind FROM items i JOIN jobs j ON j.id = i.job_id \
             ORDER BY i.job_id, i.ord",
            args![],
        )
        .await?;
    let items_checked = item_rows.len() as u64;
    for r in &item_rows {
        let (job, item, cost, state_s) = (r.text(0)?, r.text(1)?, r.i64(2)?, r.text(3)?);
        let il = items.remove(&(job.clone(), item.clone())).unwrap_or_default();
        let Some(state) = ItemState::parse(&state_s) else {
            violations.push(v("L3", None, Some(&job), Some(&item), format!("unknown item state {state_s}")));
            continue;
        };
        let net = state.net(Credits::new(cost)).map(|c| i128::from(c.get())).unwrap_or(i128::MIN);
        if il.sum != net {
            violations.push(v(
                "L3",
                None,
                Some(&job),
                Some(&item),
                format!("entries sum to {} but state {state_s} nets {net}", il.sum),
            ));
        }
        if il.charges > 1 || il.refunds > 1 || il.reclaims > 1 || il.returns > 1 {
            violations.push(v(
                "L4",
                None,
                Some(&job),
                Some(&item),
                format!(
                    "{} charges, {} refunds, {} reclaims, {} payout returns",
                    il.charges, il.refunds, il.reclaims, il.returns
                ),
            ));
        }
        if il.reclaim_before_refund {
            violations.push(v("L4", None, Some(&job), Some(&item), "a reclaim without an earlier refund".to_owned()));
        }
        // The exact entries each state requires, each for exactly ±cost, on the job's account.
        let expected: &[EntryKind] = match state {
            ItemState::Charged | ItemState::Succeeded => &[EntryKind::Charge],
            ItemState::Refunded | ItemState::Cancelled => &[EntryKind::Charge, EntryKind::Refund],
            ItemState::Reclaimed => &[EntryKind::Charge, EntryKind::Refund, EntryKind::Reclaim],
            // A payout returned after it was paid: credited back once, after the charge (or after a
            // refund reclaimed when the payout turned out to have executed late).
            ItemState::Returned if il.refunds > 0 => {
                &[EntryKind::Charge, EntryKind::Refund, EntryKind::Reclaim, EntryKind::PayoutReturn]
            }
            ItemState::Returned => &[EntryKind::Charge, EntryKind::PayoutReturn],
        };
        let kinds: Vec<EntryKind> = il.entries.iter().map(|e| e.0).collect();
        if kinds != expected {
            violations.push(v("L3", None, Some(&job), Some(&item), format!("state {state_s} has entries {kinds:?}")));
        }
        let job_account = r.text(4)?;
        let returnable = r.text(5)? == settle_core::job::WITHDRAWAL_KIND;
        if let Some(acc) = accounts.get_mut(&job_account) {
            if state == ItemState::Refunded {
                acc.refunded_cost += i128::from(cost);
            }
            if state.is_held(returnable) {
                acc.held_cost += i128::from(cost);
            }
        }
        for (kind, amount, account) in &il.entries {
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
    for ((job, item), _) in items {
        violations.push(v(
            "L3",
            None,
            Some(&job),
            Some(&item),
            "ledger entries name an item that does not exist".to_owned(),
        ));
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
    for r in db.all("SELECT seq FROM outbox ORDER BY seq", args![]).await? {
        let seq = r.i64(0)?;
        if seq != expected {
            violations.push(v("SEQ", None, None, None, format!("outbox seq {seq} follows {}", expected - 1)));
        }
        expected = seq + 1;
    }
    Ok(AuditReport {
        accounts_checked: accounts.len() as u64,
        items_checked,
        entries_checked: rows.len() as u64,
        violations,
    })
}
