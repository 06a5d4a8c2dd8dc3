-- A job's events found by its `job_seq`, not by the client's id (issue 43, docs/design/job-keys.md
-- §8, decision 0038): the same column and indexes as SQLite's 0035, where the gain is (a job
-- event's index entry near the right edge, not at the place its client's id sorts). Here it keeps
-- the schema one (tests/it/schema.rs) and costs one `jobs` lookup per event in the flush.
--
-- - `events.job_seq` is written by every INSERT of an event from its job's row, in the same
--   statement: no caller passes it. An account's event has none.
-- - `events_job_seq` finds the events that have it; `events_job`, now partial, those written before
--   this migration and by processes of 0.1.0 through 0024's functions, which now write it too.
--
-- Downtime (docs/operations/upgrade.md): ADD COLUMN (no default: nothing rewritten) and DROP INDEX
-- take `events`' ACCESS EXCLUSIVE lock, held to the end, so readers and writers of events (every
-- transition's last statement, the feeds, webhooks) wait while the two indexes are built, a read
-- of `events` each; a write that waits longer than the store's lock timeout (10 s by default)
-- fails, and so does one queued behind the migration while it waits up to 60 s for its lock. The
-- lock is taken first, so the builds never wait on a writer that waits on them (as in 0033).
-- Processes of 0.1.0 read a job's history through the `outbox` view by `job_id`, which no index now
-- serves: it scans `events`.
SET LOCAL lock_timeout = '60s';
SET LOCAL statement_timeout = 0;

ALTER TABLE events ADD COLUMN job_seq bigint;
DROP INDEX events_job;
CREATE INDEX events_job_seq ON events (job_seq, stamp, pos) WHERE job_seq IS NOT NULL;
CREATE INDEX events_job ON events (job_id, stamp, pos) WHERE job_id IS NOT NULL AND job_seq IS NULL;

-- 0.1.0's writers and passes, routed by 0024, derive the number as this release's writers do.
CREATE OR REPLACE FUNCTION outbox_numbered_by_an_old_pass() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (stamp, pos, type, job_id, job_seq, account_id, data, created_at)
    VALUES (-NEW.seq, 1, NEW.type, NEW.job_id, (SELECT j.job_seq FROM jobs j WHERE j.id = NEW.job_id),
            NEW.account_id, NEW.data, NEW.created_at);
    INSERT INTO stamp_numbers (stamp, first_seq, last_seq) VALUES (-NEW.seq, NEW.seq, NEW.seq);
    RETURN NEW;
END
$$;
CREATE OR REPLACE FUNCTION outbox_pending_queued_by_an_old_writer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (stamp, pos, type, job_id, job_seq, account_id, data, created_at)
    VALUES (NEW.stamp, NEW.pos, NEW.type, NEW.job_id, (SELECT j.job_seq FROM jobs j WHERE j.id = NEW.job_id),
            NEW.account_id, NEW.data, NEW.created_at);
    INSERT INTO stamps_pending (stamp, events, wakes)
    VALUES (NEW.stamp, 1, CASE WHEN NEW.type IN ('job.queued', 'job.retry_scheduled', 'job.requeued',
                                                 'job.released') THEN 1 ELSE 0 END)
    ON CONFLICT (stamp) DO UPDATE SET events = stamps_pending.events + 1,
                                      wakes = GREATEST(stamps_pending.wakes, EXCLUDED.wakes);
    RETURN NEW;
END
$$;
