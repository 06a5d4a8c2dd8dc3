-- A job's logged signals found by its `job_seq`, as its events are since 0035 (issue 43, decision
-- 0038): `signals_job (job_id, id)` took each logged signal at the place its client's id sorts, a
-- leaf of its own (4.6 of a commit's 89 pages in the spread story, where every late success is
-- logged). `signals.job_seq` is written by the INSERT from the job's row; `signals_job_seq` finds
-- the signals that have it, `signals_job`, now partial, those logged before this migration.
-- Nothing is backfilled or rewritten; the two indexes read the table once each.
ALTER TABLE signals ADD COLUMN job_seq INTEGER;
DROP INDEX signals_job;
CREATE INDEX signals_job_seq ON signals (job_seq, id) WHERE job_seq IS NOT NULL;
CREATE INDEX signals_job ON signals (job_id, id) WHERE job_seq IS NULL;
