-- The hot tables, first measured change (issue 43 item 3, docs/design/hot-tables.md).
--
-- grants: the burn-down index's predicate named `remaining`, so every take and every give-back was
-- an update PostgreSQL could not make HOT: a new entry in each of the table's four indexes, and the
-- burn-down index of a busy account full of dead entries its next charge had to step over. The
-- predicate now names `spent` (1 when nothing remains), which changes only when a grant is used up
-- or comes back to life; a take that leaves something is a HOT update when its page has room.
ALTER TABLE grants ADD COLUMN spent bigint NOT NULL DEFAULT 0;
UPDATE grants SET spent = 1 WHERE remaining = 0;
ALTER TABLE grants ADD CONSTRAINT grants_spent_check CHECK (spent = CASE WHEN remaining = 0 THEN 1 ELSE 0 END);
DROP INDEX grants_burn;
CREATE INDEX grants_burn ON grants (account_id, priority, expiry_key, key) WHERE spent = 0 AND expired_at IS NULL;
-- Room on each page for the next version of a row (HOT needs it on the same page).
ALTER TABLE grants SET (fillfactor = 85);

-- allocations: likewise, the unpaid-debt index's predicate named `given_back` and `settled`, so
-- every give-back of a refund was a non-HOT update. The predicate now names `owed` (1 for a debt part
-- with something unpaid), which only a debt part's settlement or give-back changes.
ALTER TABLE allocations ADD COLUMN owed bigint NOT NULL DEFAULT 0;
UPDATE allocations SET owed = 1 WHERE grant_key IS NULL AND taken > given_back + settled;
ALTER TABLE allocations ADD CONSTRAINT allocations_owed_check
    CHECK (owed = CASE WHEN grant_key IS NULL AND taken > given_back + settled THEN 1 ELSE 0 END);
DROP INDEX allocations_unpaid;
CREATE INDEX allocations_unpaid ON allocations (account_id, id) WHERE owed = 1;
ALTER TABLE allocations SET (fillfactor = 90);

-- ledger_entries: grant and adjustment idempotency needs (kind, ref_id) unique where a reference is
-- given; a job's lines have none, and each paid for an entry in the index all the same.
DROP INDEX ledger_entries_ref;
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id) WHERE ref_id IS NOT NULL;

-- ledger_entries: an account's pages read by position (`account_seq`, whose unique index exists
-- anyway: an account's `seq` rises with its positions), so (account_id, seq) served nothing else
-- and cost an entry per line.
DROP INDEX ledger_entries_account;
