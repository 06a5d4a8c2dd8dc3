-- The claim a multi-tenant queue needs, stage 1 (issue 44): PostgreSQL's 0027, the same columns and
-- indexes; jobs already queued are lined below.
--
-- First the schema is read again from its text: migration 0026 edited the tables' text in place,
-- and a connection that ran it still holds the tables as parsed before, where ALTER TABLE ADD
-- COLUMN would splice the new column at the old text's offsets ("near \"sult\": syntax error"
-- inside `result`). RESET makes this connection parse the schema afresh.
PRAGMA writable_schema = RESET;
ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 50 CHECK (priority >= 0 AND priority <= 100);
ALTER TABLE jobs ADD COLUMN requires TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN turn INTEGER;

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
      FROM jobs WHERE state = 'queued' AND kind <> 'withdrawal' AND not_before <= CAST(strftime('%s', 'now') AS INTEGER) * 1000000) AS r
WHERE jobs.id = r.id;

-- The label sets workers claimed with lately (one row per set, `last_seen` written at most once a
-- minute per process): the console says when a job requires labels no worker has shown.
CREATE TABLE worker_labels (
    labels    TEXT PRIMARY KEY,
    last_seen INTEGER NOT NULL
);
