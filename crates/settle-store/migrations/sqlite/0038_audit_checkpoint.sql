-- The audit's checkpoint (issue 43, decision 0040, docs/design/audit-checkpoints.md): what the
-- newest clean audit proved, so `settle audit --from-checkpoint` starts from it instead of from
-- the first entry. Written only by an audit that found nothing wrong, in one transaction; each
-- store's own (`settle copy` does not carry it); not used under another epoch or schema version.
-- Nothing on the write path reads or writes these tables. An audit that finds something retires
-- the checkpoint: the row stays, `retired`, its generation raised (a generation is never used
-- twice, so an audit built on a checkpoint before the retirement cannot record over it).
CREATE TABLE audit_checkpoint (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    generation     INTEGER NOT NULL CHECK (generation >= 1),
    epoch          INTEGER NOT NULL,
    schema_version INTEGER NOT NULL,
    taken_at       INTEGER NOT NULL,
    last_event_seq INTEGER NOT NULL CHECK (last_event_seq >= 0),
    entries        INTEGER NOT NULL CHECK (entries >= 0),
    retired        INTEGER NOT NULL DEFAULT 0 CHECK (retired = 0 OR retired = 1)
) STRICT;
-- Per account, as of the checkpoint: its last position, the sum of its lines to it, that line's
-- hash and seq, and what its items then held (exposure, and the items' part of held).
CREATE TABLE audit_checkpoint_accounts (
    account_id TEXT PRIMARY KEY,
    position   INTEGER NOT NULL CHECK (position >= 0),
    sum        INTEGER NOT NULL,
    hash       BLOB NOT NULL,
    last_seq   INTEGER NOT NULL,
    refunded   INTEGER NOT NULL,
    held       INTEGER NOT NULL
) STRICT;
-- Per job whose items then counted towards those sums (zero rows are not kept).
CREATE TABLE audit_checkpoint_jobs (
    job_id     TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    refunded   INTEGER NOT NULL,
    held       INTEGER NOT NULL
) STRICT;
