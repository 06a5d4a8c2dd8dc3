-- The console's job page shows a job's events: read them by job, not by scanning the outbox.
CREATE INDEX outbox_job ON outbox (job_id, seq);
