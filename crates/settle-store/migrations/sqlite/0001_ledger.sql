-- Settle schema v1 (SQLite). Every table is STRICT: an integer overflow (promoted to REAL)
-- is refused instead of stored. Times are epoch microseconds from the injected clock.

CREATE TABLE counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) STRICT;
INSERT INTO counters (name, value) VALUES ('ledger', 0), ('outbox', 0), ('job', 0);

CREATE TABLE accounts (
    id              TEXT PRIMARY KEY,
    balance         INTEGER NOT NULL,
    overdraft_limit INTEGER NOT NULL CHECK (overdraft_limit >= 0),
    created_at      INTEGER NOT NULL,
    request_hash    BLOB NOT NULL
) STRICT;

CREATE TABLE ledger_entries (
    seq           INTEGER PRIMARY KEY,
    account_id    TEXT NOT NULL REFERENCES accounts (id),
    kind          TEXT NOT NULL CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment')),
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
    -- Grants and adjustments carry their id; job entries carry their job and item.
    CHECK ((kind IN ('grant', 'adjustment')) = (ref_id IS NOT NULL)),
    CHECK ((kind IN ('charge', 'refund', 'reclaim')) = (job_id IS NOT NULL AND item_id IS NOT NULL))
) STRICT;
-- L4 in the database: at most one charge, refund and reclaim per item (NULLs are distinct).
CREATE UNIQUE INDEX ledger_entries_item_kind ON ledger_entries (job_id, item_id, kind);
-- Grants and adjustments are created by id.
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id);
CREATE INDEX ledger_entries_account ON ledger_entries (account_id, seq);
-- A fork of an account's hash chain (two entries on one predecessor) aborts loudly.
CREATE UNIQUE INDEX ledger_entries_chain ON ledger_entries (account_id, prev_hash);

-- Append-only, enforced by the database itself.
CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;
CREATE TRIGGER ledger_entries_no_delete BEFORE DELETE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;

CREATE TABLE jobs (
    id                 TEXT PRIMARY KEY,
    job_seq            INTEGER NOT NULL UNIQUE,
    account_id         TEXT NOT NULL REFERENCES accounts (id),
    kind               TEXT NOT NULL,
    state              TEXT NOT NULL CHECK (state IN ('queued', 'running', 'unknown', 'cancelling', 'succeeded', 'dead', 'cancelled')),
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
    updated_at         INTEGER NOT NULL
) STRICT;
CREATE INDEX jobs_due ON jobs (state, not_before, job_seq);
CREATE INDEX jobs_account ON jobs (account_id, job_seq);

CREATE TABLE items (
    job_id        TEXT NOT NULL REFERENCES jobs (id),
    item_id       TEXT NOT NULL,
    ord           INTEGER NOT NULL,
    cost          INTEGER NOT NULL CHECK (cost >= 0),
    state         TEXT NOT NULL CHECK (state IN ('charged', 'succeeded', 'refunded', 'reclaimed', 'cancelled')),
    refund_reason TEXT CHECK (refund_reason IN ('job_failed', 'item_failed', 'cancelled')),
    PRIMARY KEY (job_id, item_id)
) STRICT;

CREATE TABLE attempts (
    job_id      TEXT NOT NULL REFERENCES jobs (id),
    attempt_no  INTEGER NOT NULL,
    worker      TEXT NOT NULL,
    lease_token TEXT NOT NULL,
    started_at  INTEGER NOT NULL,
    finished_at INTEGER,
    result      TEXT,
    fail_code   TEXT,
    message     TEXT,
    PRIMARY KEY (job_id, attempt_no)
) STRICT;

-- Signals that changed nothing (a stale token, a duplicate): the attempt log's footnotes.
CREATE TABLE signals (
    id          INTEGER PRIMARY KEY,
    job_id      TEXT NOT NULL,
    attempt_no  INTEGER,
    signal      TEXT NOT NULL,
    fail_code   TEXT,
    message     TEXT,
    effect      TEXT NOT NULL,
    received_at INTEGER NOT NULL
) STRICT;
CREATE INDEX signals_job ON signals (job_id, id);

CREATE TABLE artifacts (
    job_id     TEXT NOT NULL REFERENCES jobs (id),
    item_id    TEXT NOT NULL,
    key        TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (job_id, item_id, key)
) STRICT;

CREATE TABLE outbox (
    seq        INTEGER PRIMARY KEY,
    type       TEXT NOT NULL,
    job_id     TEXT,
    account_id TEXT NOT NULL,
    data       TEXT NOT NULL,
    created_at INTEGER NOT NULL
) STRICT;
