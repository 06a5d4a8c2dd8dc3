-- `outbox_pending` is emptied by the event sequencer all day, so autovacuum would truncate it again
-- and again, each time under an ACCESS EXCLUSIVE lock (replayed on every standby). A write batch
-- takes the table's lock in its last statement before COMMIT while it still runs under the batch's
-- short lock timeout (docs/design/fewer-statements.md): the truncation would break the batch and
-- send its operations to run alone. The table keeps its empty pages instead; they are reused.
ALTER TABLE outbox_pending SET (vacuum_truncate = off);
