-- A job's ledger lines and allocations filed by its `job_seq` on SQLite (issue 43, decision 0039,
-- docs/design/job-keys.md §10): there the two indexes keyed by the client's id took a leaf a line,
-- and each commit wrote them back. PostgreSQL pays per index entry, not per page, so it keeps
-- `ledger_entries_item_kind` and `allocations_item` on the id — its guard (L4) and its readers' —
-- and has the columns for one schema: its writers leave them NULL, `settle copy` fills them.
--
-- Downtime: none to speak of. Each ADD COLUMN (nullable, no default) rewrites nothing; it takes its
-- table's ACCESS EXCLUSIVE lock until the migration commits, which is at once.
SET LOCAL lock_timeout = '60s';

ALTER TABLE ledger_entries ADD COLUMN job_seq bigint;
ALTER TABLE allocations ADD COLUMN job_seq bigint;
