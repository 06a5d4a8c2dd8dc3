-- Teardown retries (issue 41, decision 0028 §6): a cancelling job whose artifact cleanup failed is
-- tried again after a capped backoff, not every second; the last error is kept for the operator, who
-- may finish the teardown without the cleanup (`job.abandon_cleanup`, recorded in the action log).
CREATE TABLE teardown_retries (
    job_id     text PRIMARY KEY REFERENCES jobs (id),
    failures   bigint NOT NULL,
    retry_at   bigint NOT NULL,
    last_error text NOT NULL,
    failed_at  bigint NOT NULL
);
