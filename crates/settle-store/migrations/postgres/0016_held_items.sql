-- Held items (issue 23, docs/decisions/0022): an item may be made with a hold instead of a cost.
-- `cost` stays the amount at stake (the hold until the first success prices the item, then its
-- price); `hold` is NULL for a fixed-price item.
--
-- The ledger's kinds gain `release` (what a held item's price did not use, credited back) and
-- `expire` (what an expired grant had left, issue 24: it names its grant). The new CHECKs are added
-- NOT VALID: every existing row passed the narrower ones they replace, so validating them would
-- only scan the whole ledger under this migration's exclusive lock to find nothing; new rows are
-- checked all the same. The ALTERs take their tables' exclusive locks for an instant; waiting for
-- them at most 5 s keeps writers from queueing behind this migration for long (it fails and the
-- next start tries again).
SET LOCAL lock_timeout = '5s';

ALTER TABLE items ADD COLUMN hold bigint;
ALTER TABLE items ADD CONSTRAINT items_hold_check CHECK (hold IS NULL OR (hold > 0 AND cost <= hold)) NOT VALID;

ALTER TABLE ledger_entries
    DROP CONSTRAINT ledger_entries_kind_check,
    ADD CONSTRAINT ledger_entries_kind_check CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment',
        'payout_return', 'release', 'expire')) NOT VALID,
    DROP CONSTRAINT ledger_entries_ref_check,
    ADD CONSTRAINT ledger_entries_ref_check CHECK ((kind IN ('grant', 'adjustment', 'expire')) = (ref_id IS NOT NULL))
        NOT VALID,
    DROP CONSTRAINT ledger_entries_job_check,
    ADD CONSTRAINT ledger_entries_job_check CHECK ((kind IN ('charge', 'refund', 'reclaim', 'payout_return', 'release'))
        = (job_id IS NOT NULL AND item_id IS NOT NULL)) NOT VALID;
