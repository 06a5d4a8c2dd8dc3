-- `jobs_due (state, not_before, job_seq)` took an entry on every state change of every job (`state`
-- is in its key: a state change is never a HOT update, and a non-HOT update enters every index of
-- the table whose predicate the new row meets), and the hot paths no longer read it: claims of work
-- read the lines (0027), the caps the running jobs (0028). Its readers take two partial indexes
-- instead, each entered only by the jobs that are looked up by state (issue 43,
-- docs/design/hot-tables.md, decision 0036) — SQLite's 0033, the same indexes:
--
-- - `jobs_open`: dead letters, payouts whose outcome is unknown, teardowns to resume, and jobs
--   waiting to retry after a failure. A job that succeeds at its first attempt never enters it.
-- - `jobs_rail`: withdrawals and top-ups, by kind and state, in creation order: the processors'
--   claims, their reconcile passes, the rescuer's running withdrawals, the rails' lists.
--
-- Statements that read them name the state as a literal: a generic plan with the state as a
-- parameter cannot use a partial index whose predicate is on the state.
--
-- The drops come first: DROP INDEX takes `jobs`' ACCESS EXCLUSIVE lock, and taking it after the
-- builds' SHARE lock would wait on the writers that wait on the builds (a deadlock). Readers and
-- writers of `jobs` wait while the two indexes are built.
DROP INDEX jobs_due;
-- 0028 kept 0027's `jobs_waiting` for processes that knew lines but not caps; no release ever had
-- them (0027, 0028 and this one are in one release), and no statement reads it.
DROP INDEX jobs_waiting;
CREATE INDEX jobs_open ON jobs (state, job_seq)
    WHERE state = 'dead' OR state = 'unknown' OR (state = 'queued' AND last_error_code IS NOT NULL) OR state = 'cancelling';
CREATE INDEX jobs_rail ON jobs (kind, state, job_seq) WHERE kind = 'withdrawal' OR kind = 'top_up';
