-- A job's logged signals found by its `job_seq`, as its events are since 0035 (issue 43, decision
-- 0038): the same column and indexes as SQLite's 0036, where the gain is. `signals.job_seq` is
-- written by the INSERT from the job's row; `signals_job_seq` finds the signals that have it,
-- `signals_job`, now partial, those logged before this migration and by processes of 0.1.0 (their
-- INSERT names its columns and leaves the number out; a job's signal list reads both).
--
-- Downtime (docs/operations/upgrade.md): ADD COLUMN (nothing rewritten) and DROP INDEX take
-- `signals`' ACCESS EXCLUSIVE lock to the end, so every statement that names `signals` waits while
-- the two indexes are built, a read of `signals` each — every success (its statement names the
-- table whether or not it logs), every logged signal, every job page — and one that waits longer
-- than the store's lock timeout (10 s by default) fails; `signals` is small beside `events` (only
-- signals that changed nothing and late successes are logged). Processes of 0.1.0 count and list a
-- job's signals by `job_id` alone, which the partial `signals_job` cannot serve: they scan
-- `signals`, each logged signal under its job's row lock.
SET LOCAL lock_timeout = '60s';
SET LOCAL statement_timeout = 0;

ALTER TABLE signals ADD COLUMN job_seq bigint;
DROP INDEX signals_job;
CREATE INDEX signals_job_seq ON signals (job_seq, id) WHERE job_seq IS NOT NULL;
CREATE INDEX signals_job ON signals (job_id, id) WHERE job_seq IS NULL;
