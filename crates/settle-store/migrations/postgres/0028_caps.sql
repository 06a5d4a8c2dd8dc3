-- The claim a multi-tenant queue needs, stage 2: caps (issue 44, docs/design/fair-claims.md §9).
--
-- `accounts.max_running` (NULL: no cap) is read by every worker claim with the account row locked
-- FOR KEY SHARE (a PATCH of it locks the row FOR UPDATE). A claim that finds an account at its cap
-- parks its lined jobs of that line (`parked = 1`: queued, neither lined nor waiting); the unpark
-- pass brings them back when the account is below its cap again. The running jobs of an account
-- are counted from `jobs_running_account` (at most `max_running` entries read).
--
-- Both columns are added without rewriting a table (no default on one, a constant on the other;
-- the domain takes its CHECK after the column, NOT VALID, as in 0027). The line-up reads
-- `jobs_waiting_unparked`; `jobs_waiting` stays for the previous release's processes during a
-- rolling upgrade (their queries match its predicate) and goes in a later release. Running
-- withdrawals never count toward a cap. The indexes are built in the migration's transaction:
-- writes to `jobs` wait while each reads the table once.

CREATE DOMAIN account_max_running AS bigint;
ALTER TABLE accounts ADD COLUMN max_running account_max_running;
ALTER DOMAIN account_max_running ADD CONSTRAINT account_max_running_check
    CHECK (VALUE >= 0 AND VALUE <= 10000) NOT VALID;

ALTER TABLE jobs ADD COLUMN parked bigint NOT NULL DEFAULT 0;

CREATE INDEX jobs_running_account ON jobs (account_id) WHERE state = 'running' AND kind <> 'withdrawal';
CREATE INDEX jobs_running_kind ON jobs (kind) WHERE state = 'running' AND kind <> 'withdrawal';
CREATE INDEX jobs_parked ON jobs (account_id, priority, not_before, job_seq)
    WHERE state = 'queued' AND parked = 1;
CREATE INDEX jobs_waiting_unparked ON jobs (not_before, job_seq)
    WHERE state = 'queued' AND turn IS NULL AND parked = 0 AND kind <> 'withdrawal';
