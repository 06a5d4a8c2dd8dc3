-- The store's epoch (semantics §5, issue 42, decision 0029): a restored store numbers its events
-- again from where its backup stood, so receivers deduplicate by (epoch, seq). Each epoch begins at
-- an event number; an event's epoch is the last one begun at or before its seq. Events the backup
-- held keep the epoch they were sent with; only events numbered after a restore carry the new one.
-- Kept as ranges rather than a column on every event: the write path does not change.
CREATE TABLE store_epochs (
    epoch      INTEGER PRIMARY KEY,
    first_seq  INTEGER NOT NULL,
    started_at INTEGER NOT NULL,
    reason     TEXT NOT NULL
) STRICT;
INSERT INTO store_epochs (epoch, first_seq, started_at, reason) VALUES (1, 1, 0, 'created');
