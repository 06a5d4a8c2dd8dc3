//! Ledger entry kinds and the per-account hash chain:
//! `hash = sha256(prev_hash ‖ canonical(entry))`, genesis `prev_hash` = 32 zero bytes.

use sha2::{Digest, Sha256};

crate::names! {
    /// A ledger entry's kind; grants, refunds and payout returns credit, charges and reclaims debit,
    /// an adjustment either way.
    pub EntryKind {
        Grant = "grant",
        Charge = "charge",
        Refund = "refund",
        Reclaim = "reclaim",
        Adjustment = "adjustment",
        /// A payout the receiving side sent back: the withdrawn amount credited again (+).
        PayoutReturn = "payout_return",
        /// The part of a held item's hold its price did not use, credited back when the first
        /// success prices it (+).
        Release = "release",
        /// What an expired grant had left, taken when it expires; or a part given back to a grant
        /// that had already expired, expiring at once (−). Names its grant in `ref_id`.
        Expire = "expire",
    }
}

crate::names! {
    /// Where a grant (a source of an account's credit, spent in burn-down order) comes from
    /// (docs/decisions/0023).
    pub GrantOrigin {
        /// `POST /v1/accounts/{id}/grants`.
        Grant = "grant",
        /// A positive adjustment.
        Adjustment = "adjustment",
        /// What an account held when grants were introduced (migration 0017).
        Opening = "opening",
        /// Credit bought through the funding provider (`POST /v1/top-ups`, the auto rule): written
        /// only by a confirmed charge, never expiring; its id is the top-up's.
        TopUp = "top_up",
    }
}

crate::names! {
    /// Why credit left a grant (an allocation: which grant paid which debit), or, for a debt part,
    /// what went unpaid.
    pub AllocationKind {
        Charge = "charge",
        Reclaim = "reclaim",
        Adjustment = "adjustment",
        /// A grant paying an account's debt.
        SettleDebt = "settle_debt",
        /// Debt an account carried when grants were introduced (migration 0017).
        Opening = "opening",
    }
}

impl AllocationKind {
    /// What a debit line takes from the grants as.
    pub const fn of_debit(kind: EntryKind) -> AllocationKind {
        match kind {
            EntryKind::Charge => AllocationKind::Charge,
            EntryKind::Reclaim => AllocationKind::Reclaim,
            _ => AllocationKind::Adjustment,
        }
    }
}

pub type Hash32 = [u8; 32];
pub const GENESIS_HASH: Hash32 = [0; 32];

/// The fields of an entry that the chain covers.
#[derive(Debug, Clone, Copy)]
pub struct EntryFields<'a> {
    pub seq: i64,
    pub account_id: &'a str,
    pub kind: EntryKind,
    pub amount: i64,
    pub balance_after: i64,
    pub job_id: Option<&'a str>,
    pub item_id: Option<&'a str>,
    /// A grant's or adjustment's id.
    pub ref_id: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub created_at: i64,
}

fn put_str(h: &mut Sha256, s: Option<&str>) {
    match s {
        None => h.update([0u8]),
        Some(s) => {
            h.update([1u8]);
            h.update((s.len() as u64).to_be_bytes());
            h.update(s.as_bytes());
        }
    }
}

/// The chain step. Every field is length-prefixed or fixed-width, so no two entries encode alike.
pub fn chain_hash(prev: &Hash32, e: &EntryFields<'_>) -> Hash32 {
    let mut h = Sha256::new();
    h.update(b"settle.ledger.v1");
    h.update(prev);
    h.update(e.seq.to_be_bytes());
    put_str(&mut h, Some(e.account_id));
    put_str(&mut h, Some(e.kind.as_str()));
    h.update(e.amount.to_be_bytes());
    h.update(e.balance_after.to_be_bytes());
    put_str(&mut h, e.job_id);
    put_str(&mut h, e.item_id);
    put_str(&mut h, e.ref_id);
    put_str(&mut h, e.reason);
    h.update(e.created_at.to_be_bytes());
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_field_change_changes_the_hash() {
        let e = EntryFields {
            seq: 1,
            account_id: "a",
            kind: EntryKind::Charge,
            amount: -40,
            balance_after: 60,
            job_id: Some("j"),
            item_id: Some("main"),
            ref_id: None,
            reason: None,
            created_at: 7,
        };
        let h = chain_hash(&GENESIS_HASH, &e);
        assert_ne!(h, chain_hash(&GENESIS_HASH, &EntryFields { amount: -41, ..e }));
        assert_ne!(h, chain_hash(&GENESIS_HASH, &EntryFields { job_id: None, ..e }));
        assert_ne!(h, chain_hash(&GENESIS_HASH, &EntryFields { item_id: Some("mai"), job_id: Some("jn"), ..e }));
        assert_ne!(h, chain_hash(&h, &e));
        assert_ne!(h, chain_hash(&GENESIS_HASH, &EntryFields { reason: Some("x"), ..e }));
        assert_eq!(h, chain_hash(&GENESIS_HASH, &e));
    }

    #[test]
    fn entry_kind_names_are_the_storage_format() {
        let names: Vec<&str> = EntryKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names, ["grant", "charge", "refund", "reclaim", "adjustment", "payout_return", "release", "expire"]);
        for k in EntryKind::ALL {
            assert_eq!(EntryKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(EntryKind::parse("payout"), None);
    }
}
