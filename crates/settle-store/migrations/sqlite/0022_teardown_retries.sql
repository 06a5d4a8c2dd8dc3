-- Teardown retries (issue 41, decision 0028 §6): a cancelling job whose artifact cleanup failed is
-- tried again after a capped backoff, not every second; the last error is kept for the operator, who
-- may finish the teardown without the cleanup (`job.abandon_cleanup`, recorded in the action log).
CREATE TABLE teardown_retries (
    job_id     TEXT PRIMARY KEY REFERENCES jobs (id),
    failures   INTEGER NOT NULL,
    retry_at   INTEGER NOT NULL,
    last_error TEXT NOT NULL,
    failed_at  INTEGER NOT NULL
) STRICT;
