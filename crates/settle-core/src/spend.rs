//! Spend limits (spec §4a): what a posting spends, the UTC periods a limit counts in, and whether a
//! new charge fits — pure, so the store decides from the rows it holds and the simulator checks the
//! same rule against the ledger.

use crate::clock::Timestamp;
use crate::ledger::EntryKind;
use time::{Date, Month, OffsetDateTime, Time};

crate::names! {
    /// The period a spend limit counts in: a UTC day, a UTC calendar month.
    pub Period {
        Day = "day",
        Month = "month",
    }
}

impl Period {
    /// The start of the period `t` is in.
    pub fn start(self, t: Timestamp) -> Timestamp {
        let date = date_of(t);
        let first = match self {
            Period::Day => date,
            Period::Month => date.replace_day(1).expect("every month has a first day"),
        };
        at_midnight(first)
    }

    /// The start of the period after the one `t` is in: when a limit's spend starts again.
    pub fn next(self, t: Timestamp) -> Timestamp {
        let date = date_of(t);
        let next = match self {
            Period::Day => date.next_day(),
            Period::Month => {
                let (year, month) = match date.month() {
                    Month::December => (date.year() + 1, Month::January),
                    m => (date.year(), m.next()),
                };
                Date::from_calendar_date(year, month, 1).ok()
            }
        };
        next.map_or(Timestamp::from_micros(i64::MAX), at_midnight)
    }
}

fn date_of(t: Timestamp) -> Date {
    let nanos = i128::from(t.micros()) * 1_000;
    OffsetDateTime::from_unix_timestamp_nanos(nanos).map_or(Date::MIN, |dt| dt.date())
}

fn at_midnight(date: Date) -> Timestamp {
    let nanos = date.with_time(Time::MIDNIGHT).assume_utc().unix_timestamp_nanos() / 1_000;
    Timestamp::from_micros(i64::try_from(nanos).unwrap_or(i64::MAX))
}

/// Whether a ledger line of this kind is spend: every line that belongs to a job (charges, holds,
/// reclaims take; refunds, releases, payout returns give back). Grants, adjustments and expiries are
/// not.
pub const fn counts(kind: EntryKind) -> bool {
    matches!(
        kind,
        EntryKind::Charge | EntryKind::Refund | EntryKind::Reclaim | EntryKind::Release | EntryKind::PayoutReturn
    )
}

/// What a posting's lines (`(kind, amount)`, amounts signed as in the ledger) spend: the negated sum
/// of its spend lines. `None` on overflow.
pub fn of_lines(lines: impl IntoIterator<Item = (EntryKind, i64)>) -> Option<i64> {
    let mut sum = 0_i64;
    for (kind, amount) in lines {
        if counts(kind) {
            sum = sum.checked_add(amount)?;
        }
    }
    sum.checked_neg()
}

/// Whether a limit on `kinds` (empty: every kind but withdrawals, which count only when named)
/// covers a job of `kind`.
pub fn covers(kinds: &[String], kind: &str) -> bool {
    if kinds.is_empty() { kind != crate::job::WITHDRAWAL_KIND } else { kinds.iter().any(|k| k == kind) }
}

/// A limit as a charge meets it: how much it allows, and the period's spend so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub amount: i64,
    pub spent: i64,
}

impl Room {
    /// What is left before the limit (never negative).
    pub fn remaining(self) -> i64 {
        (i128::from(self.amount) - i128::from(self.spent)).clamp(0, i128::from(i64::MAX)) as i64
    }

    /// Whether spending `x` more keeps the period within the limit. Nothing (`x ≤ 0`) always fits:
    /// a free job is never refused.
    pub fn fits(self, x: i64) -> bool {
        x <= 0 || i128::from(self.spent) + i128::from(x) <= i128::from(self.amount)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        Timestamp::parse_rfc3339(s).expect("a test instant")
    }

    #[test]
    fn periods_are_utc_days_and_calendar_months() {
        let t = at("2026-02-28T23:59:59.999999Z");
        assert_eq!(Period::Day.start(t), at("2026-02-28T00:00:00Z"));
        assert_eq!(Period::Day.next(t), at("2026-03-01T00:00:00Z"));
        assert_eq!(Period::Month.start(t), at("2026-02-01T00:00:00Z"));
        assert_eq!(Period::Month.next(t), at("2026-03-01T00:00:00Z"));
        let leap = at("2028-02-29T12:00:00Z");
        assert_eq!(Period::Day.next(leap), at("2028-03-01T00:00:00Z"));
        let december = at("2026-12-31T23:00:00Z");
        assert_eq!(Period::Month.next(december), at("2027-01-01T00:00:00Z"));
        assert_eq!(Period::Month.start(december), at("2026-12-01T00:00:00Z"));
        // The boundary belongs to the period it starts.
        let midnight = at("2026-03-01T00:00:00Z");
        assert_eq!(Period::Day.start(midnight), midnight);
        assert_eq!(Period::Month.start(midnight), midnight);
    }

    #[test]
    fn a_posting_spends_its_job_lines_net() {
        let lines = [
            (EntryKind::Charge, -70),
            (EntryKind::Refund, 20),
            (EntryKind::Reclaim, -5),
            (EntryKind::Release, 10),
            (EntryKind::Grant, 1_000),
            (EntryKind::Expire, -3),
        ];
        assert_eq!(of_lines(lines), Some(45));
        assert_eq!(of_lines([(EntryKind::Refund, 30)]), Some(-30));
        assert_eq!(of_lines([(EntryKind::Charge, i64::MIN)]), None);
    }

    #[test]
    fn no_kinds_cover_all_work_but_withdrawals() {
        assert!(covers(&[], "render"));
        assert!(!covers(&[], "withdrawal"));
        let named = ["withdrawal".to_owned()];
        assert!(covers(&named, "withdrawal"));
        assert!(!covers(&named, "render"));
    }

    #[test]
    fn a_charge_fits_up_to_the_limit_and_nothing_always_fits() {
        let room = Room { amount: 100, spent: 60 };
        assert!(room.fits(40));
        assert!(!room.fits(41));
        assert_eq!(room.remaining(), 40);
        let over = Room { amount: 100, spent: 130 };
        assert!(over.fits(0));
        assert!(!over.fits(1));
        assert_eq!(over.remaining(), 0);
        let refunded = Room { amount: 100, spent: -50 };
        assert!(refunded.fits(150));
        assert_eq!(refunded.remaining(), 150);
        assert!(!Room { amount: i64::MAX, spent: i64::MAX }.fits(i64::MAX));
    }
}
