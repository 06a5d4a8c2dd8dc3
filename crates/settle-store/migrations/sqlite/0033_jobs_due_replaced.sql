-- `jobs_due (state, not_before, job_seq)` moved an entry on every state change of every job (three
-- per job that succeeds first time), and the hot paths no longer read it: claims of work read the
-- lines (0027), the caps the running jobs (0028). Its readers take two partial indexes instead,
-- each entered only by the jobs that are looked up by state (issue 43, docs/design/hot-tables.md,
-- decision 0036):
--
-- - `jobs_open`: the jobs people and passes look for by state — dead letters, payouts whose outcome
--   is unknown, teardowns to resume, and jobs waiting to retry after a failure. A job that succeeds
--   at its first attempt never enters it. The predicate's first three arms are, word for word, the
--   failure summary's condition (SQLite matches a partial index by the expression's text).
-- - `jobs_rail`: withdrawals and top-ups, by kind and state, in creation order: the processors'
--   claims, their reconcile passes, the rescuer's running withdrawals, the rails' lists.
--
-- Predicates are written with OR: SQLite proves `state = 'dead'` implies an OR of which it is an
-- arm, never an IN list. Each index reads `jobs` once while writers wait.
DROP INDEX jobs_due;
-- 0028 kept 0027's `jobs_waiting` for processes that knew lines but not caps; no release ever had
-- them (0027, 0028 and this one are in one release), and no statement reads it.
DROP INDEX jobs_waiting;
CREATE INDEX jobs_open ON jobs (state, job_seq)
    WHERE state = 'dead' OR state = 'unknown' OR (state = 'queued' AND last_error_code IS NOT NULL) OR state = 'cancelling';
CREATE INDEX jobs_rail ON jobs (kind, state, job_seq) WHERE kind = 'withdrawal' OR kind = 'top_up';
