-- Held items (issue 23, docs/decisions/0022): an item may be made with a hold instead of a cost.
-- `cost` stays the amount at stake (the hold until the first success prices the item, then its
-- price); `hold` is NULL for a fixed-price item.
ALTER TABLE items ADD COLUMN hold INTEGER CHECK (hold IS NULL OR (hold > 0 AND cost <= hold));

-- The ledger's kinds gain `release` (what a held item's price did not use, credited back) and
-- `expire` (what an expired grant had left, issue 24: it names its grant). SQLite cannot change a
-- CHECK in place: the table is rebuilt as 0005 did, rows copied as they are (numbers, positions and
-- hashes unchanged), then its indexes and triggers made again, as 0015 left them (`account_seq`
-- last, refused below 1 by its trigger). No table references `ledger_entries`, so the rebuild needs
-- no foreign-key pause. It holds the database for the whole copy and needs room for a second copy
-- of the ledger while it runs.
CREATE TABLE ledger_entries_v16 (
    seq           INTEGER PRIMARY KEY,
    account_id    TEXT NOT NULL REFERENCES accounts (id),
    kind          TEXT NOT NULL CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment', 'payout_return',
                                                'release', 'expire')),
    amount        INTEGER NOT NULL,
    balance_after INTEGER NOT NULL,
    job_id        TEXT,
    item_id       TEXT,
    ref_id        TEXT,
    reason        TEXT,
    request_hash  BLOB,
    created_at    INTEGER NOT NULL,
    prev_hash     BLOB NOT NULL,
    hash          BLOB NOT NULL,
    account_seq   INTEGER NOT NULL DEFAULT 0,
    CHECK ((kind IN ('grant', 'adjustment', 'expire')) = (ref_id IS NOT NULL)),
    CHECK ((kind IN ('charge', 'refund', 'reclaim', 'payout_return', 'release')) = (job_id IS NOT NULL AND item_id IS NOT NULL))
) STRICT;
INSERT INTO ledger_entries_v16 (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id,
    reason, request_hash, created_at, prev_hash, hash)
SELECT seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id,
    reason, request_hash, created_at, prev_hash, hash FROM ledger_entries;
DROP TABLE ledger_entries;
ALTER TABLE ledger_entries_v16 RENAME TO ledger_entries;
CREATE UNIQUE INDEX ledger_entries_item_kind ON ledger_entries (job_id, item_id, kind);
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id);
CREATE INDEX ledger_entries_account ON ledger_entries (account_id, seq);
CREATE UNIQUE INDEX ledger_entries_chain ON ledger_entries (account_id, prev_hash);
CREATE UNIQUE INDEX ledger_entries_account_seq ON ledger_entries (account_id, account_seq);
CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;
CREATE TRIGGER ledger_entries_no_delete BEFORE DELETE ON ledger_entries
BEGIN
    SELECT RAISE(ABORT, 'ledger_entries is append-only');
END;
CREATE TRIGGER ledger_entries_account_seq BEFORE INSERT ON ledger_entries WHEN NEW.account_seq < 1
BEGIN
    SELECT RAISE(ABORT, 'ledger entry without its account_seq');
END;
