-- Every admin action, with who did it (the token's name), written in the same transaction as the
-- action itself: support can say who requeued a job or adjusted a balance, and when.
CREATE TABLE actions (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         bigint NOT NULL,
    actor      text NOT NULL,
    action     text NOT NULL,
    job_id     text,
    account_id text,
    detail     text NOT NULL
);
CREATE INDEX actions_job ON actions (job_id, id);
CREATE INDEX actions_account ON actions (account_id, id);
