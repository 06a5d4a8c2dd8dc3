-- The claim a multi-tenant queue needs, stage 2: caps (issue 44): PostgreSQL's 0028, the same
-- columns and indexes (docs/design/fair-claims.md §9).
ALTER TABLE accounts ADD COLUMN max_running INTEGER CHECK (max_running >= 0 AND max_running <= 10000);
ALTER TABLE jobs ADD COLUMN parked INTEGER NOT NULL DEFAULT 0;

CREATE INDEX jobs_running_account ON jobs (account_id) WHERE state = 'running' AND kind <> 'withdrawal';
CREATE INDEX jobs_running_kind ON jobs (kind) WHERE state = 'running' AND kind <> 'withdrawal';
CREATE INDEX jobs_parked ON jobs (account_id, priority, not_before, job_seq)
    WHERE state = 'queued' AND parked = 1;
-- The previous release's `jobs_waiting` stays for its processes during a rolling upgrade.
CREATE INDEX jobs_waiting_unparked ON jobs (not_before, job_seq)
    WHERE state = 'queued' AND turn IS NULL AND parked = 0 AND kind <> 'withdrawal';
