-- Numbering without a global row (issue 22, docs/decisions/0021): the same columns and tables as
-- PostgreSQL's 0015. SQLite's single writer still numbers `seq` and events at once, in the order it
-- commits, so `outbox_pending` stays empty here.
ALTER TABLE accounts ADD COLUMN entries INTEGER NOT NULL DEFAULT 0 CHECK (entries >= 0);
UPDATE accounts SET entries = (SELECT COUNT(*) FROM ledger_entries e WHERE e.account_id = accounts.id);

-- Existing entries were chained in `seq` order per account: that order is their `account_seq`.
-- SQLite cannot add a NOT NULL column without a default, so the default is 0 and an insert without a
-- position (a process of the previous release) is refused by a trigger instead.
ALTER TABLE ledger_entries ADD COLUMN account_seq INTEGER NOT NULL DEFAULT 0;
DROP TRIGGER ledger_entries_no_update;
UPDATE ledger_entries SET account_seq = r.n
  FROM (SELECT seq, row_number() OVER (PARTITION BY account_id ORDER BY seq) AS n FROM ledger_entries) AS r
 WHERE ledger_entries.seq = r.seq;
CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;
CREATE TRIGGER ledger_entries_account_seq BEFORE INSERT ON ledger_entries WHEN NEW.account_seq < 1
BEGIN
    SELECT RAISE(ABORT, 'ledger entry without its account_seq');
END;
CREATE UNIQUE INDEX ledger_entries_account_seq ON ledger_entries (account_id, account_seq);

CREATE TABLE outbox_pending (
    stamp      INTEGER NOT NULL,
    pos        INTEGER NOT NULL,
    type       TEXT NOT NULL,
    job_id     TEXT,
    account_id TEXT NOT NULL,
    data       TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (stamp, pos)
) STRICT;
