-- Refunds that a later success may still reclaim (Σ cost of the account's refunded items).
-- Charges and debits keep balance − exposure ≥ −BALANCE_MAX, so no reclaim can ever overflow.
ALTER TABLE accounts ADD COLUMN exposure bigint NOT NULL DEFAULT 0 CHECK (exposure >= 0);
