-- Withdrawals (docs/design/payouts.md): the withdrawals table, and the states and entry kind a
-- returned payout needs: job and item state `returned`, ledger kind `payout_return`.
-- The CHECK constraints that list states and kinds are replaced by named ones (their generated
-- names are found in the catalog rather than guessed).
DO $$
DECLARE c record;
BEGIN
    FOR c IN
        SELECT conname, conrelid::regclass AS tbl FROM pg_constraint
        WHERE contype = 'c'
          AND conrelid IN ('jobs'::regclass, 'items'::regclass, 'ledger_entries'::regclass)
          AND (pg_get_constraintdef(oid) LIKE '%state%' OR pg_get_constraintdef(oid) LIKE '%kind%')
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', c.tbl, c.conname);
    END LOOP;
END
$$;

ALTER TABLE jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('queued', 'running', 'unknown', 'cancelling', 'succeeded', 'dead', 'cancelled', 'returned'));
ALTER TABLE items ADD CONSTRAINT items_state_check
    CHECK (state IN ('charged', 'succeeded', 'refunded', 'reclaimed', 'cancelled', 'returned'));
ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_kind_check
    CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment', 'payout_return'));
ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_ref_check
    CHECK ((kind IN ('grant', 'adjustment')) = (ref_id IS NOT NULL));
ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_job_check
    CHECK ((kind IN ('charge', 'refund', 'reclaim', 'payout_return')) = (job_id IS NOT NULL AND item_id IS NOT NULL));

-- One row per withdrawal job. The idempotency key is made once, at creation, and reused by every
-- attempt; the provider's txid is kept once known.
CREATE TABLE withdrawals (
    job_id          text PRIMARY KEY REFERENCES jobs (id),
    destination     text NOT NULL,
    amount          bigint NOT NULL CHECK (amount > 0),
    idempotency_key text NOT NULL UNIQUE,
    provider_txid   text,
    returned_at     bigint,
    -- The attempt whose send was started (committed before the request leaves): an expired lease
    -- of that attempt is `unknown`; of any other, nothing was sent and the attempt is retried.
    sending_attempt bigint,
    created_at      bigint NOT NULL
);
