-- Numbering without a global row (issue 22, docs/decisions/0021).
--
-- Ledger: each account numbers its own entries (`account_seq`, 1, 2, 3, … gap-free: the chain
-- position) from `accounts.entries`, bumped by the balance UPDATE every posting makes anyway; `seq`
-- comes from a plain sequence taken at flush (unique, increasing within an account in commit order;
-- gaps allowed). Events: written to `outbox_pending` with one stamp per transaction, and numbered
-- into `outbox` after they commit by a sequencer, the only one that takes the `outbox` counter.
--
-- Downtime: this migration holds `accounts` and `ledger_entries` while it backfills, in proportion
-- to the ledger. It waits at most a minute for those locks and fails rather than queue every
-- statement behind it for longer; once it has them, its statements run as long as the backfill
-- takes (the store's statement timeout, meant for transitions, would cancel it on a large ledger
-- on every start).
SET LOCAL lock_timeout = '60s';
SET LOCAL statement_timeout = 0;

ALTER TABLE accounts ADD COLUMN entries bigint NOT NULL DEFAULT 0 CHECK (entries >= 0);
UPDATE accounts a SET entries = c.n
  FROM (SELECT account_id, COUNT(*) AS n FROM ledger_entries GROUP BY account_id) c
 WHERE a.id = c.account_id;

-- Existing entries were chained in `seq` order per account: that order is their `account_seq`, so
-- every chain verifies unchanged. The append-only trigger is off for this one backfill.
ALTER TABLE ledger_entries ADD COLUMN account_seq bigint;
ALTER TABLE ledger_entries DISABLE TRIGGER ledger_entries_no_update;
UPDATE ledger_entries e SET account_seq = r.n
  FROM (SELECT seq, row_number() OVER (PARTITION BY account_id ORDER BY seq) AS n FROM ledger_entries) r
 WHERE e.seq = r.seq;
ALTER TABLE ledger_entries ENABLE TRIGGER ledger_entries_no_update;
-- No default: a process of the previous release inserting an entry without it fails loudly.
ALTER TABLE ledger_entries ALTER COLUMN account_seq SET NOT NULL;
ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_account_seq_check CHECK (account_seq >= 1);
CREATE UNIQUE INDEX ledger_entries_account_seq ON ledger_entries (account_id, account_seq);

-- CACHE 1 (the default): values are handed out in increasing order across sessions, which is what
-- makes `seq` increase within an account in commit order.
CREATE SEQUENCE ledger_seq_numbers AS bigint CACHE 1;
SELECT setval('ledger_seq_numbers', GREATEST(c.value, m.value, 1), GREATEST(c.value, m.value) > 0)
  FROM counters c, (SELECT COALESCE(MAX(seq), 0) AS value FROM ledger_entries) m
 WHERE c.name = 'ledger';

-- Events a transaction committed, waiting for their numbers: one stamp per writing transaction
-- (taken by its last statement), `pos` the event's place in it. A sequencer pass moves whole stamps
-- into `outbox`, numbered in (stamp, pos) order. Rows live here for milliseconds, so vacuum runs at a
-- fixed threshold rather than a fraction of a table that is nearly always empty.
CREATE TABLE outbox_pending (
    stamp      bigint NOT NULL,
    pos        bigint NOT NULL,
    type       text NOT NULL,
    job_id     text,
    account_id text NOT NULL,
    data       text NOT NULL,
    created_at bigint NOT NULL,
    PRIMARY KEY (stamp, pos)
);
ALTER TABLE outbox_pending SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
CREATE SEQUENCE outbox_stamps AS bigint CACHE 1;
