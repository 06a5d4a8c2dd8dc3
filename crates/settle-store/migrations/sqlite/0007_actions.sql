-- Every admin action, with who did it (the token's name), written in the same transaction as the
-- action itself: support can say who requeued a job or adjusted a balance, and when.
CREATE TABLE actions (
    id         INTEGER PRIMARY KEY,
    at         INTEGER NOT NULL,
    actor      TEXT NOT NULL,
    action     TEXT NOT NULL,
    job_id     TEXT,
    account_id TEXT,
    detail     TEXT NOT NULL
) STRICT;
CREATE INDEX actions_job ON actions (job_id, id);
CREATE INDEX actions_account ON actions (account_id, id);
