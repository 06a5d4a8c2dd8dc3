-- A job's logged signals found by its `job_seq`, as its events are since 0035 (issue 43, decision
-- 0038): the same column and indexes as SQLite's 0036, where the gain is. `signals.job_seq` is
-- written by the INSERT from the job's row; `signals_job_seq` finds the signals that have it,
-- `signals_job`, now partial, those logged before this migration and by processes of 0.1.0 (their
-- INSERT names its columns and leaves the number out; a job's signal list reads both).
--
-- Downtime (docs/operations/upgrade.md): ADD COLUMN (nothing rewritten) and DROP INDEX take
-- `signals`' ACCESS EXCLUSIVE lock to the end, so a signal logged meanwhile waits while the two
-- indexes are built, a read of `signals` each (a table of the signals that changed nothing: small
-- beside `events`).
SET LOCAL lock_timeout = '60s';
SET LOCAL statement_timeout = 0;

ALTER TABLE signals ADD COLUMN job_seq bigint;
DROP INDEX signals_job;
CREATE INDEX signals_job_seq ON signals (job_seq, id) WHERE job_seq IS NOT NULL;
CREATE INDEX signals_job ON signals (job_id, id) WHERE job_seq IS NULL;
