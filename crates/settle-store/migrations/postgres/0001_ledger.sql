-- Settle schema v1 (PostgreSQL). The same tables, columns and constraints as the SQLite schema;
-- every integer is bigint (an overflow raises 22003), times are epoch microseconds from the
-- injected clock, never now().

CREATE TABLE counters (
    name  text PRIMARY KEY,
    value bigint NOT NULL
);
INSERT INTO counters (name, value) VALUES ('ledger', 0), ('outbox', 0), ('job', 0);

CREATE TABLE accounts (
    id              text PRIMARY KEY,
    balance         bigint NOT NULL,
    overdraft_limit bigint NOT NULL CHECK (overdraft_limit >= 0),
    created_at      bigint NOT NULL,
    request_hash    bytea NOT NULL
);

CREATE TABLE ledger_entries (
    seq           bigint PRIMARY KEY,
    account_id    text NOT NULL REFERENCES accounts (id),
    kind          text NOT NULL CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment')),
    amount        bigint NOT NULL,
    balance_after bigint NOT NULL,
    job_id        text,
    item_id       text,
    ref_id        text,
    reason        text,
    request_hash  bytea,
    created_at    bigint NOT NULL,
    prev_hash     bytea NOT NULL,
    hash          bytea NOT NULL,
    CHECK ((kind IN ('grant', 'adjustment')) = (ref_id IS NOT NULL)),
    CHECK ((kind IN ('charge', 'refund', 'reclaim')) = (job_id IS NOT NULL AND item_id IS NOT NULL))
);
CREATE UNIQUE INDEX ledger_entries_item_kind ON ledger_entries (job_id, item_id, kind);
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id);
CREATE INDEX ledger_entries_account ON ledger_entries (account_id, seq);
CREATE UNIQUE INDEX ledger_entries_chain ON ledger_entries (account_id, prev_hash);

-- Append-only, enforced by the database itself (TRUNCATE too, which skips row triggers).
CREATE FUNCTION ledger_entries_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger_entries is append-only';
END
$$;
CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION ledger_entries_append_only();
CREATE TRIGGER ledger_entries_no_delete BEFORE DELETE ON ledger_entries
    FOR EACH ROW EXECUTE FUNCTION ledger_entries_append_only();
CREATE TRIGGER ledger_entries_no_truncate BEFORE TRUNCATE ON ledger_entries
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_entries_append_only();

CREATE TABLE jobs (
    id                 text PRIMARY KEY,
    job_seq            bigint NOT NULL UNIQUE,
    account_id         text NOT NULL REFERENCES accounts (id),
    kind               text NOT NULL,
    state              text NOT NULL CHECK (state IN ('queued', 'running', 'unknown', 'cancelling', 'succeeded', 'dead', 'cancelled')),
    cost               bigint NOT NULL CHECK (cost >= 0),
    attempt            bigint NOT NULL,
    budget_base        bigint NOT NULL,
    max_attempts       bigint NOT NULL CHECK (max_attempts >= 1),
    refund_on          text NOT NULL CHECK (refund_on IN ('failure', 'final_failure')),
    cancel_requested   bigint NOT NULL CHECK (cancel_requested IN (0, 1)),
    not_before         bigint NOT NULL,
    lease_token        text,
    lease_expires_at   bigint,
    lease_worker       text,
    lease_seconds      bigint NOT NULL,
    last_error_code    text,
    last_error_message text,
    unknown_since      bigint,
    payload            text NOT NULL,
    request_hash       bytea NOT NULL,
    created_at         bigint NOT NULL,
    updated_at         bigint NOT NULL
);
CREATE INDEX jobs_due ON jobs (state, not_before, job_seq);
CREATE INDEX jobs_account ON jobs (account_id, job_seq);

CREATE TABLE items (
    job_id        text NOT NULL REFERENCES jobs (id),
    item_id       text NOT NULL,
    ord           bigint NOT NULL,
    cost          bigint NOT NULL CHECK (cost >= 0),
    state         text NOT NULL CHECK (state IN ('charged', 'succeeded', 'refunded', 'reclaimed', 'cancelled')),
    refund_reason text CHECK (refund_reason IN ('job_failed', 'item_failed', 'cancelled')),
    PRIMARY KEY (job_id, item_id)
);

CREATE TABLE attempts (
    job_id      text NOT NULL REFERENCES jobs (id),
    attempt_no  bigint NOT NULL,
    worker      text NOT NULL,
    lease_token text NOT NULL,
    started_at  bigint NOT NULL,
    finished_at bigint,
    result      text,
    fail_code   text,
    message     text,
    PRIMARY KEY (job_id, attempt_no)
);

CREATE TABLE signals (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id      text NOT NULL,
    attempt_no  bigint,
    signal      text NOT NULL,
    fail_code   text,
    message     text,
    effect      text NOT NULL,
    received_at bigint NOT NULL
);
CREATE INDEX signals_job ON signals (job_id, id);

CREATE TABLE artifacts (
    job_id     text NOT NULL REFERENCES jobs (id),
    item_id    text NOT NULL,
    key        text NOT NULL,
    created_at bigint NOT NULL,
    PRIMARY KEY (job_id, item_id, key)
);

CREATE TABLE outbox (
    seq        bigint PRIMARY KEY,
    type       text NOT NULL,
    job_id     text,
    account_id text NOT NULL,
    data       text NOT NULL,
    created_at bigint NOT NULL
);
