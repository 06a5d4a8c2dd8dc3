-- Each event written once (issue 43, docs/design/batch-plan.md §4a, decision 0031).
--
-- A transaction's events go into `events` under its stamp, with one `stamps_pending` row for the
-- transaction; the sequencer numbers stamps (`stamp_numbers`: a stamp holds first_seq ..= last_seq,
-- its events at pos 1, 2, …), not events. Before: each event was written to `outbox_pending`,
-- deleted from it and written again to `outbox`.
--
-- A rolling upgrade (docs/operations/upgrade.md): processes of the previous release may still run.
-- Their writers insert into `outbox_pending`, now a view whose INSTEAD OF trigger stores their
-- events in `events` and their stamp in `stamps_pending`, so only this release's passes number, in
-- one stamp order (an old pass finds nothing pending); their readers read `outbox`, now a view over
-- the numbered events (right, and slow: no index serves a number computed over a join).
--
-- Downtime: the copy of the numbered events holds the event sequencer (the `outbox` counter row)
-- for as long as it runs, in proportion to the events kept: feeds of processes of the previous
-- release wait meanwhile; writers go on until the brief lock on `outbox_pending` at the end.
SET LOCAL lock_timeout = '60s';
SET LOCAL statement_timeout = 0;

-- No pass numbers anything while the events move (every pass locks this row first).
SELECT value FROM counters WHERE name = 'outbox' FOR UPDATE;

CREATE TABLE events (
    stamp      bigint NOT NULL,
    pos        bigint NOT NULL CHECK (pos >= 1),
    type       text NOT NULL,
    job_id     text,
    account_id text NOT NULL,
    data       text NOT NULL,
    created_at bigint NOT NULL,
    PRIMARY KEY (stamp, pos)
);
-- A job's events (its history, the console's job page).
CREATE INDEX events_job ON events (job_id, stamp, pos);

CREATE TABLE stamp_numbers (
    stamp     bigint PRIMARY KEY,
    first_seq bigint NOT NULL CHECK (first_seq >= 1),
    last_seq  bigint NOT NULL UNIQUE,
    CHECK (last_seq >= first_seq)
);

-- Committed stamps waiting for their numbers: one row per transaction that wrote events. `wakes`:
-- one of its events makes work due (the pass wakes claimers in other processes).
CREATE TABLE stamps_pending (
    stamp  bigint PRIMARY KEY,
    events bigint NOT NULL CHECK (events >= 1),
    wakes  bigint NOT NULL CHECK (wakes IN (0, 1))
);
-- Emptied by the sequencer all day: vacuum at a fixed threshold, and never truncated (a truncation's
-- ACCESS EXCLUSIVE lock would break the write batches that insert here under their short lock
-- timeout, as migration 0018 says of `outbox_pending`).
ALTER TABLE stamps_pending SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    vacuum_truncate = off);

-- The numbered events, a stamp per run of at most 1,000 consecutive numbers (negative: no
-- `outbox_stamps` value meets one), `pos` the place in the run: a page reads whole stamps, so a
-- stamp stays small.
WITH runs AS (SELECT seq, seq - row_number() OVER (ORDER BY seq) AS run FROM outbox),
     firsts AS (SELECT seq, MIN(seq) OVER (PARTITION BY run, (seq - run) / 1000) AS first FROM runs)
INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at)
SELECT -f.first, o.seq - f.first + 1, o.type, o.job_id, o.account_id, o.data, o.created_at
  FROM outbox o JOIN firsts f ON f.seq = o.seq;
INSERT INTO stamp_numbers (stamp, first_seq, last_seq)
SELECT stamp, -stamp, -stamp + COUNT(*) - 1 FROM events GROUP BY stamp;

ALTER TABLE webhook_deliveries DROP CONSTRAINT webhook_deliveries_event_seq_fkey;
DROP TABLE outbox;

-- For processes of the previous release only: their readers, and their passes' INSERT (which
-- finds nothing to number, below).
CREATE VIEW outbox AS
SELECT n.first_seq + e.pos - 1 AS seq, e.type, e.job_id, e.account_id, e.data, e.created_at
  FROM events e JOIN stamp_numbers n ON n.stamp = e.stamp;
CREATE FUNCTION outbox_numbered_by_an_old_pass() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at)
    VALUES (-NEW.seq, 1, NEW.type, NEW.job_id, NEW.account_id, NEW.data, NEW.created_at);
    INSERT INTO stamp_numbers (stamp, first_seq, last_seq) VALUES (-NEW.seq, NEW.seq, NEW.seq);
    RETURN NEW;
END
$$;
CREATE TRIGGER outbox_numbered_by_an_old_pass INSTEAD OF INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_numbered_by_an_old_pass();

-- Events queued by processes of the previous release and not yet numbered join this release's
-- pending stamps; then the queue becomes a view. Its lock waits for an old writer's transaction
-- that has inserted but not committed, so none is lost between the copy and the DROP.
LOCK TABLE outbox_pending IN ACCESS EXCLUSIVE MODE;
INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at)
SELECT stamp, pos, type, job_id, account_id, data, created_at FROM outbox_pending;
INSERT INTO stamps_pending (stamp, events, wakes)
SELECT stamp, COUNT(*), MAX(CASE WHEN type IN ('job.queued', 'job.retry_scheduled', 'job.requeued', 'job.released')
                                 THEN 1 ELSE 0 END)
  FROM outbox_pending GROUP BY stamp;
DROP TABLE outbox_pending;
-- Always empty: an old pass's DELETE through it deletes nothing (a simple view is updatable).
CREATE VIEW outbox_pending AS
SELECT stamp, pos, type, job_id, account_id, data, created_at FROM events WHERE false;
CREATE FUNCTION outbox_pending_queued_by_an_old_writer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at)
    VALUES (NEW.stamp, NEW.pos, NEW.type, NEW.job_id, NEW.account_id, NEW.data, NEW.created_at);
    INSERT INTO stamps_pending (stamp, events, wakes)
    VALUES (NEW.stamp, 1, CASE WHEN NEW.type IN ('job.queued', 'job.retry_scheduled', 'job.requeued',
                                                 'job.released') THEN 1 ELSE 0 END)
    ON CONFLICT (stamp) DO UPDATE SET events = stamps_pending.events + 1,
                                      wakes = GREATEST(stamps_pending.wakes, EXCLUDED.wakes);
    RETURN NEW;
END
$$;
CREATE TRIGGER outbox_pending_queued_by_an_old_writer INSTEAD OF INSERT ON outbox_pending
    FOR EACH ROW EXECUTE FUNCTION outbox_pending_queued_by_an_old_writer();
