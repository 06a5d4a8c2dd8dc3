-- A ledger line's `prev_hash` is the hash of its account's line before it, by position: the line at
-- `account_seq - 1` (the writers read the head exactly so, `ledger::CHAIN_HEAD`), or the genesis
-- hash for the first. This trigger refuses any other, in place of the unique index on
-- `(account_id, prev_hash)` (issue 43, decision 0037):
--
-- - A fork is still refused. Two lines after one line would sit at one position, which
--   `ledger_entries_account_seq` (unique) refuses; a line after a hash that is not its
--   predecessor's is refused here. (This holds as long as no two lines share a hash, which every
--   line Settle writes satisfies — a hash covers its `seq`. A line forged with another's hash is
--   named by the audit's L2, as before.)
-- - More is refused than before: a line linked to a hash that is no predecessor's (a stale or
--   foreign head), which the index let in unless another line already followed that hash.
-- - What it costs: a seek in `ledger_entries_account_seq` and a read of the row it finds — the
--   account's last line, the pages the writer has just read for the head — where the index took an
--   entry at a random place inside the account's range: about one written page in eight of a
--   commit, and most of the writer's page reads (docs/performance.md).
--
-- `account_seq < 1` is left to `ledger_entries_account_seq`'s trigger (0015), whose message says
-- what is wrong. A later migration that rebuilds `ledger_entries` (as 0016 did) drops this trigger
-- with the table, and must create it again.
--
-- PostgreSQL keeps the index: dropping it there changed nothing measurable, and a row trigger would
-- cost a function call per line.
DROP INDEX ledger_entries_chain;
CREATE TRIGGER ledger_entries_chain BEFORE INSERT ON ledger_entries
    WHEN NEW.account_seq >= 1 AND NEW.prev_hash IS NOT (CASE WHEN NEW.account_seq = 1 THEN zeroblob(32)
        ELSE (SELECT hash FROM ledger_entries WHERE account_id = NEW.account_id AND account_seq = NEW.account_seq - 1) END)
BEGIN
    SELECT RAISE(ABORT, 'ledger entry whose prev_hash is not the hash of its account''s entry before it');
END;
