-- Each event written once (issue 43, docs/design/batch-plan.md §4a, decision 0031): the same tables
-- as PostgreSQL's 0024. SQLite's single writer numbers as it commits: a writer batch's stamp is its
-- first event number, negated, and its `stamp_numbers` row is written beside its counters, so
-- `stamps_pending` stays empty here (it is PostgreSQL's; kept so both stores hold the same tables,
-- for `settle copy`), and `outbox_pending`, always empty here, goes.
CREATE TABLE events (
    stamp      INTEGER NOT NULL,
    pos        INTEGER NOT NULL CHECK (pos >= 1),
    type       TEXT NOT NULL,
    job_id     TEXT,
    account_id TEXT NOT NULL,
    data       TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (stamp, pos)
) STRICT, WITHOUT ROWID;
CREATE INDEX events_job ON events (job_id, stamp, pos);

CREATE TABLE stamp_numbers (
    stamp     INTEGER PRIMARY KEY,
    first_seq INTEGER NOT NULL CHECK (first_seq >= 1),
    last_seq  INTEGER NOT NULL UNIQUE,
    CHECK (last_seq >= first_seq)
) STRICT;

CREATE TABLE stamps_pending (
    stamp  INTEGER PRIMARY KEY,
    events INTEGER NOT NULL CHECK (events >= 1),
    wakes  INTEGER NOT NULL CHECK (wakes IN (0, 1))
) STRICT;

-- The numbered events, a stamp per run of at most 1,000 consecutive numbers (negative, as on
-- PostgreSQL), `pos` the place in the run.
INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at)
SELECT -f.first, o.seq - f.first + 1, o.type, o.job_id, o.account_id, o.data, o.created_at
  FROM outbox o
  JOIN (SELECT seq, MIN(seq) OVER (PARTITION BY run, (seq - run) / 1000) AS first
          FROM (SELECT seq, seq - row_number() OVER (ORDER BY seq) AS run FROM outbox)) AS f ON f.seq = o.seq;
INSERT INTO stamp_numbers (stamp, first_seq, last_seq)
SELECT stamp, -stamp, -stamp + COUNT(*) - 1 FROM events GROUP BY stamp;

-- `webhook_deliveries.event_seq` referred to `outbox`: the table is rebuilt without that foreign key
-- (the audit checks every delivery's event is numbered).
CREATE TABLE webhook_deliveries_new (
    endpoint_id      TEXT NOT NULL,
    event_seq        INTEGER NOT NULL,
    order_key        TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts         INTEGER NOT NULL,
    next_attempt_at  INTEGER NOT NULL,
    lease_token      TEXT,
    lease_expires_at INTEGER,
    last_status      INTEGER,
    last_error       TEXT,
    delivered_at     INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (endpoint_id, event_seq)
) STRICT;
INSERT INTO webhook_deliveries_new SELECT endpoint_id, event_seq, order_key, state, attempts, next_attempt_at,
    lease_token, lease_expires_at, last_status, last_error, delivered_at, created_at, updated_at FROM webhook_deliveries;
DROP TABLE webhook_deliveries;
ALTER TABLE webhook_deliveries_new RENAME TO webhook_deliveries;
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (endpoint_id, state, next_attempt_at);
CREATE INDEX webhook_deliveries_key ON webhook_deliveries (endpoint_id, order_key, event_seq) WHERE state <> 'delivered';
DROP TABLE outbox;
DROP TABLE outbox_pending;
