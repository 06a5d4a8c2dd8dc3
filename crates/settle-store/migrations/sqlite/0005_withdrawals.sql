-- no-transaction
-- Withdrawals (docs/design/payouts.md): the withdrawals table, and the states and entry kind a
-- returned payout needs: job and item state `returned`, ledger kind `payout_return`.
-- SQLite cannot change a CHECK constraint in place, so jobs, items and ledger_entries are rebuilt
-- (https://www.sqlite.org/lang_altertable.html, "other kinds of table schema changes"): foreign keys
-- off around one transaction, every row copied as is, indexes and triggers made again, and the
-- foreign keys checked before the commit. Ledger rows are copied, never changed: their hashes hold.
-- Re-runnable: sqlx records a no-transaction migration after it, so a crash in between runs it again
-- (the rebuild starts over from the tables as they are; the new table is created if missing).
PRAGMA foreign_keys = OFF;
BEGIN IMMEDIATE;

CREATE TABLE jobs_v5 (
    id                 TEXT PRIMARY KEY,
    job_seq            INTEGER NOT NULL UNIQUE,
    account_id         TEXT NOT NULL REFERENCES accounts (id),
    kind               TEXT NOT NULL,
    state              TEXT NOT NULL CHECK (state IN ('queued', 'running', 'unknown', 'cancelling', 'succeeded', 'dead', 'cancelled', 'returned')),
    cost               INTEGER NOT NULL CHECK (cost >= 0),
    attempt            INTEGER NOT NULL,
    budget_base        INTEGER NOT NULL,
    max_attempts       INTEGER NOT NULL CHECK (max_attempts >= 1),
    refund_on          TEXT NOT NULL CHECK (refund_on IN ('failure', 'final_failure')),
    cancel_requested   INTEGER NOT NULL CHECK (cancel_requested IN (0, 1)),
    not_before         INTEGER NOT NULL,
    lease_token        TEXT,
    lease_expires_at   INTEGER,
    lease_worker       TEXT,
    lease_seconds      INTEGER NOT NULL,
    last_error_code    TEXT,
    last_error_message TEXT,
    unknown_since      INTEGER,
    payload            TEXT NOT NULL,
    request_hash       BLOB NOT NULL,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    result             TEXT
) STRICT;
INSERT INTO jobs_v5 (id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, refund_on,
    cancel_requested, not_before, lease_token, lease_expires_at, lease_worker, lease_seconds, last_error_code,
    last_error_message, unknown_since, payload, request_hash, created_at, updated_at, result)
SELECT id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, refund_on,
    cancel_requested, not_before, lease_token, lease_expires_at, lease_worker, lease_seconds, last_error_code,
    last_error_message, unknown_since, payload, request_hash, created_at, updated_at, result FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_v5 RENAME TO jobs;
CREATE INDEX jobs_due ON jobs (state, not_before, job_seq);
CREATE INDEX jobs_account ON jobs (account_id, job_seq);

CREATE TABLE items_v5 (
    job_id        TEXT NOT NULL REFERENCES jobs (id),
    item_id       TEXT NOT NULL,
    ord           INTEGER NOT NULL,
    cost          INTEGER NOT NULL CHECK (cost >= 0),
    state         TEXT NOT NULL CHECK (state IN ('charged', 'succeeded', 'refunded', 'reclaimed', 'cancelled', 'returned')),
    refund_reason TEXT CHECK (refund_reason IN ('job_failed', 'item_failed', 'cancelled')),
    PRIMARY KEY (job_id, item_id)
) STRICT;
INSERT INTO items_v5 (job_id, item_id, ord, cost, state, refund_reason)
SELECT job_id, item_id, ord, cost, state, refund_reason FROM items;
DROP TABLE items;
ALTER TABLE items_v5 RENAME TO items;

CREATE TABLE ledger_entries_v5 (
    seq           INTEGER PRIMARY KEY,
    account_id    TEXT NOT NULL REFERENCES accounts (id),
    kind          TEXT NOT NULL CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment', 'payout_return')),
    amount        INTEGER NOT NULL,
    balance_after INTEGER NOT NULL,
    job_id        TEXT,
    item_id       TEXT,
    ref_id        TEXT,
    reason        TEXT,
    request_hash  BLOB,
    created_at    INTEGER NOT NULL,
    prev_hash     BLOB NOT NULL,
    hash          BLOB NOT NULL,
    CHECK ((kind IN ('grant', 'adjustment')) = (ref_id IS NOT NULL)),
    CHECK ((kind IN ('charge', 'refund', 'reclaim', 'payout_return')) = (job_id IS NOT NULL AND item_id IS NOT NULL))
) STRICT;
INSERT INTO ledger_entries_v5 (seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason,
    request_hash, created_at, prev_hash, hash)
SELECT seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason,
    request_hash, created_at, prev_hash, hash FROM ledger_entries;
DROP TABLE ledger_entries;
ALTER TABLE ledger_entries_v5 RENAME TO ledger_entries;
CREATE UNIQUE INDEX ledger_entries_item_kind ON ledger_entries (job_id, item_id, kind);
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id);
CREATE INDEX ledger_entries_account ON ledger_entries (account_id, seq);
CREATE UNIQUE INDEX ledger_entries_chain ON ledger_entries (account_id, prev_hash);
CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;
CREATE TRIGGER ledger_entries_no_delete BEFORE DELETE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;

-- One row per withdrawal job. The idempotency key is made once, at creation, and reused by every
-- attempt; the provider's txid is kept once known.
CREATE TABLE IF NOT EXISTS withdrawals (
    job_id          TEXT PRIMARY KEY REFERENCES jobs (id),
    destination     TEXT NOT NULL,
    amount          INTEGER NOT NULL CHECK (amount > 0),
    idempotency_key TEXT NOT NULL UNIQUE,
    provider_txid   TEXT,
    returned_at     INTEGER,
    -- The attempt whose send was started (committed before the request leaves): an expired lease
    -- of that attempt is `unknown`; of any other, nothing was sent and the attempt is retried.
    sending_attempt INTEGER,
    created_at      INTEGER NOT NULL
) STRICT;

-- The copy kept every reference: with foreign keys off, nothing else would say so. A violation
-- fails this CHECK and the migration with it, before the commit.
CREATE TEMP TABLE migration_0005_check (violations INTEGER NOT NULL CHECK (violations = 0));
INSERT INTO migration_0005_check SELECT COUNT(*) FROM pragma_foreign_key_check;
DROP TABLE temp.migration_0005_check;
COMMIT;
PRAGMA foreign_keys = ON;
