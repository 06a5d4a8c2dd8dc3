//! Credits: integer minor units. Every operation is checked; an overflow is an error, never a wrap.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Credits(i64);

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("credit arithmetic overflow")]
    Overflow,
}

impl Credits {
    pub const ZERO: Credits = Credits(0);

    pub const fn new(minor_units: i64) -> Credits {
        Credits(minor_units)
    }
    pub const fn get(self) -> i64 {
        self.0
    }
    pub fn checked_add(self, other: Credits) -> Result<Credits, MoneyError> {
        self.0.checked_add(other.0).map(Credits).ok_or(MoneyError::Overflow)
    }
    pub fn checked_sub(self, other: Credits) -> Result<Credits, MoneyError> {
        self.0.checked_sub(other.0).map(Credits).ok_or(MoneyError::Overflow)
    }
    pub fn checked_neg(self) -> Result<Credits, MoneyError> {
        self.0.checked_neg().map(Credits).ok_or(MoneyError::Overflow)
    }
    /// Sum of many amounts; `Err` as soon as a partial sum leaves `i64`.
    pub fn checked_sum<I: IntoIterator<Item = Credits>>(items: I) -> Result<Credits, MoneyError> {
        items.into_iter().try_fold(Credits::ZERO, |acc, c| acc.checked_add(c))
    }
    pub const fn is_positive(self) -> bool {
        self.0 > 0
    }
    pub const fn is_negative(self) -> bool {
        self.0 < 0
    }
}

impl fmt::Display for Credits {
    /// As the `i64` it is, width and sign flags included (`{:>+8}`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_is_an_error() {
        assert_eq!(Credits::new(i64::MAX).checked_add(Credits::new(1)), Err(MoneyError::Overflow));
        assert_eq!(Credits::new(i64::MIN).checked_sub(Credits::new(1)), Err(MoneyError::Overflow));
        assert_eq!(Credits::new(i64::MIN).checked_neg(), Err(MoneyError::Overflow));
        assert_eq!(
            Credits::checked_sum([Credits::new(i64::MAX), Credits::new(1), Credits::new(-5)]),
            Err(MoneyError::Overflow)
        );
        assert_eq!(Credits::checked_sum([Credits::new(2), Credits::new(3)]), Ok(Credits::new(5)));
    }

    #[test]
    fn sign_and_display() {
        for (n, positive, negative) in [(-1, false, true), (0, false, false), (1, true, false)] {
            let c = Credits::new(n);
            assert_eq!((c.get(), c.is_positive(), c.is_negative()), (n, positive, negative));
        }
        assert_eq!(Credits::new(-42).to_string(), "-42");
        assert_eq!(Credits::new(i64::MAX).to_string(), "9223372036854775807");
    }
}
