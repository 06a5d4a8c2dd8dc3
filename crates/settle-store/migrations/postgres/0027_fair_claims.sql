-- The claim a multi-tenant queue needs, stage 1 (issue 44, docs/design/fair-claims.md §4):
-- a job's priority and required labels, and its turn in its line.
--
-- A line is (priority, kind, requires); a queued job is lined when it has a turn, waiting (not due
-- yet, or back from a claim) when `turn` is NULL. The claim takes the lowest (turn, job_seq) of a
-- line; a job's turn is derived from the jobs lined now (its line's front, its account's last turn
-- there), so nothing else holds state. Jobs already queued are lined below.
--
-- The columns take constant defaults, so PostgreSQL adds them without rewriting the table — but
-- not a column whose domain has a CHECK (PostgreSQL then rewrites every row to test the default):
-- the domain takes its CHECK after the column, NOT VALID (the only stored value is the default).
-- The indexes are built in the migration's transaction: writes to `jobs` wait while each reads the
-- table once.

CREATE DOMAIN job_priority AS bigint;

ALTER TABLE jobs
    ADD COLUMN priority job_priority NOT NULL DEFAULT 50,
    ADD COLUMN requires text NOT NULL DEFAULT '',
    ADD COLUMN turn bigint;

ALTER DOMAIN job_priority ADD CONSTRAINT job_priority_check CHECK (VALUE >= 0 AND VALUE <= 100) NOT VALID;

CREATE INDEX jobs_line ON jobs (priority, kind, requires, turn, job_seq)
    WHERE state = 'queued' AND turn IS NOT NULL;
CREATE INDEX jobs_line_account ON jobs (priority, kind, requires, account_id, turn)
    WHERE state = 'queued' AND turn IS NOT NULL;
CREATE INDEX jobs_waiting ON jobs (not_before, job_seq)
    WHERE state = 'queued' AND turn IS NULL AND kind <> 'withdrawal';

-- The jobs queued and due now take their turns as a line-up would give them from empty lines: each
-- account's in its own order, the first of every account first (only queued rows are written).
-- Those not due yet wait for a line-up.
UPDATE jobs SET turn = r.k - 1
FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY kind, account_id ORDER BY not_before, job_seq) AS k
      FROM jobs WHERE state = 'queued' AND kind <> 'withdrawal' AND not_before <= CAST(extract(epoch FROM clock_timestamp()) * 1000000 AS bigint)) AS r
WHERE jobs.id = r.id;

-- The label sets workers claimed with lately (one row per set, `last_seen` written at most once a
-- minute per process): the console says when a job requires labels no worker has shown.
CREATE TABLE worker_labels (
    labels    text PRIMARY KEY,
    last_seen bigint NOT NULL
);
