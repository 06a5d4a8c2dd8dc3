-- A job's ledger lines and allocations filed by its `job_seq`, as its events (0035) and logged
-- signals (0036) are (issue 43, decision 0039, docs/design/job-keys.md §10): the unique index
-- `ledger_entries_item_kind (job_id, item_id, kind)` and `allocations_item (job_id, item_id, id)`
-- took each charge, refund and part at the place its client's id sorts, a leaf of its own (about 14
-- and 9 of a commit's 82 pages in the spread story). Keyed by the job's number they go in near the
-- right edge, where the in-flight jobs are.
--
-- `ledger_entries_item_kind` is L4's guard, the database's own refusal of a second charge, refund or
-- reclaim of one item, so the number is made exact before it is trusted:
-- - Every line and part of a job that exists gets its number here (the ledger's UPDATE trigger
--   dropped for the statement and made again as 0016 left it; a line's hash does not cover the
--   column, so no hash changes). So the unique `ledger_entries_job_seq` guards every job's lines,
--   old and new. The old index, now partial, is left holding only lines that name a job that does
--   not exist (none Settle wrote; a hand-written orphan), which no new row can join.
-- - `ledger_entries_job_seq` and `allocations_job_seq`, the triggers, refuse a row whose `job_id`
--   and `job_seq` are not both NULL or both its job's. Jobs' `id` and `job_seq` are each unique and
--   never change, so a unique key on the number is one on the id, and no new row can enter the
--   partial old indexes.
-- Settle's INSERTs write the number from the job row the operation holds (`Line::job_seq`), which
-- the triggers check; the readers of a job's lines and parts read by it.
--
-- The two UPDATEs rewrite both tables once, in this migration's transaction (a death mid-way leaves
-- the old schema and the next open runs it again). Every row grows by a few bytes, so pages packed
-- full by appends split and both tables stay about a fifth larger until a VACUUM;
-- docs/operations/upgrade.md gives the time and the room it needs.
-- PostgreSQL has the columns for one schema and leaves them empty (0037 there).
ALTER TABLE ledger_entries ADD COLUMN job_seq INTEGER;
ALTER TABLE allocations ADD COLUMN job_seq INTEGER;

DROP TRIGGER ledger_entries_no_update;
UPDATE ledger_entries SET job_seq = (SELECT j.job_seq FROM jobs j WHERE j.id = ledger_entries.job_id)
    WHERE job_id IS NOT NULL;
CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;
UPDATE allocations SET job_seq = (SELECT j.job_seq FROM jobs j WHERE j.id = allocations.job_id)
    WHERE job_id IS NOT NULL;

DROP INDEX ledger_entries_item_kind;
CREATE UNIQUE INDEX ledger_entries_job_seq ON ledger_entries (job_seq, item_id, kind) WHERE job_seq IS NOT NULL;
CREATE UNIQUE INDEX ledger_entries_item_kind ON ledger_entries (job_id, item_id, kind)
    WHERE job_id IS NOT NULL AND job_seq IS NULL;
DROP INDEX allocations_item;
CREATE INDEX allocations_job_seq ON allocations (job_seq, item_id, id) WHERE job_seq IS NOT NULL;
CREATE INDEX allocations_item ON allocations (job_id, item_id, id) WHERE job_id IS NOT NULL AND job_seq IS NULL;

-- Each trigger reads the job by its id, the pages the operation has just read. A process of a
-- release before this migration, still writing after it (started with `--no-migrate`), names no
-- number and is refused, with a message that says so.
CREATE TRIGGER ledger_entries_job_seq BEFORE INSERT ON ledger_entries
    WHEN (NEW.job_id IS NULL) <> (NEW.job_seq IS NULL)
        OR (NEW.job_id IS NOT NULL AND NEW.job_seq IS NOT (SELECT job_seq FROM jobs WHERE id = NEW.job_id))
BEGIN
    SELECT RAISE(ABORT, 'ledger entry whose job_seq is not its job''s (or written by a Settle from before migration 0037)');
END;
CREATE TRIGGER allocations_job_seq BEFORE INSERT ON allocations
    WHEN (NEW.job_id IS NULL) <> (NEW.job_seq IS NULL)
        OR (NEW.job_id IS NOT NULL AND NEW.job_seq IS NOT (SELECT job_seq FROM jobs WHERE id = NEW.job_id))
BEGIN
    SELECT RAISE(ABORT, 'allocation whose job_seq is not its job''s (or written by a Settle from before migration 0037)');
END;

-- What the number's exactness rests on besides: a job's `id` and `job_seq`, and a part's, never
-- change. No statement of Settle's sets them; these refuse one that would (a hand edit moving a job's
-- later lines off its earlier ones, out of the unique index's sight). An `UPDATE OF` trigger is
-- compiled only into statements that set those columns, so Settle's updates pay nothing. (`INSERT
-- OR REPLACE INTO jobs` deletes a row and inserts another, firing no UPDATE trigger; a BEFORE INSERT
-- trigger refusing it cost every create about 17 k instructions, so it is left to the audit, which
-- names every line and part whose number no job has.)
--
-- A later migration that rebuilds `jobs` (a new table, the rows copied, the old dropped, the new
-- renamed) must drop the two triggers that read `jobs` (`ledger_entries_job_seq`,
-- `allocations_job_seq`) before the RENAME and create them again after, with `jobs_keys_fixed`; one
-- that rebuilds `allocations` drops its two with the table and must create them again.
CREATE TRIGGER jobs_keys_fixed BEFORE UPDATE OF id, job_seq ON jobs
    WHEN NEW.id IS NOT OLD.id OR NEW.job_seq IS NOT OLD.job_seq
BEGIN
    SELECT RAISE(ABORT, 'a job''s id and job_seq never change');
END;
CREATE TRIGGER allocations_keys_fixed BEFORE UPDATE OF job_id, job_seq ON allocations
    WHEN NEW.job_id IS NOT OLD.job_id OR NEW.job_seq IS NOT OLD.job_seq
BEGIN
    SELECT RAISE(ABORT, 'an allocation''s job_id and job_seq never change');
END;
