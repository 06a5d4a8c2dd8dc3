-- A job's events found by its `job_seq`, not by the client's id (issue 43, docs/design/job-keys.md
-- §8, decision 0038). `events_job (job_id, stamp, pos)` took each job event at the place its
-- client's id sorts: a leaf of its own for nearly every event, the largest index a commit wrote
-- (18 of its 99 pages, docs/performance.md). A job's number is given in creation order and the jobs
-- in flight are mostly recent ones, so keyed by it a commit's events go into a few leaves.
--
-- - `events.job_seq` is written by every INSERT of an event from its job's row, in the same
--   statement (`(SELECT job_seq FROM jobs WHERE id = …)`): no caller passes it, so Settle never
--   writes one that is not its `job_id`'s (the audit checks it). An account's event has none.
-- - `events_job_seq` finds the events that have it; `events_job`, now partial, those written before
--   this migration (no `job_seq`, nothing backfilled: no row is rewritten).
-- - Adding a nullable column without a default rewrites nothing. The two indexes are built from the
--   events kept, a read of the table each; the partial `events_job` is as large as the old one was
--   and is written through the WAL once: a moment on a small store, in proportion to its events on
--   a large one (docs/operations/upgrade.md).
ALTER TABLE events ADD COLUMN job_seq INTEGER;
DROP INDEX events_job;
CREATE INDEX events_job_seq ON events (job_seq, stamp, pos) WHERE job_seq IS NOT NULL;
CREATE INDEX events_job ON events (job_id, stamp, pos) WHERE job_id IS NOT NULL AND job_seq IS NULL;
