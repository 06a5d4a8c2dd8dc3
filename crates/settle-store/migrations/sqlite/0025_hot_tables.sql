-- The hot tables, first measured change (issue 43 item 3): the same columns and indexes as
-- PostgreSQL's 0025. SQLite has no HOT updates, but the burn-down index keyed on `spent` no longer
-- changes with every take either. SQLite cannot add a CHECK that names another column to an existing
-- table: the writers keep `spent` and `owed` and the audit checks them (L5).
ALTER TABLE grants ADD COLUMN spent INTEGER NOT NULL DEFAULT 0;
UPDATE grants SET spent = 1 WHERE remaining = 0;
DROP INDEX grants_burn;
CREATE INDEX grants_burn ON grants (account_id, priority, expiry_key, key) WHERE spent = 0 AND expired_at IS NULL;

ALTER TABLE allocations ADD COLUMN owed INTEGER NOT NULL DEFAULT 0;
UPDATE allocations SET owed = 1 WHERE grant_key IS NULL AND taken > given_back + settled;
DROP INDEX allocations_unpaid;
CREATE INDEX allocations_unpaid ON allocations (account_id, id) WHERE owed = 1;

DROP INDEX ledger_entries_ref;
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id) WHERE ref_id IS NOT NULL;

DROP INDEX ledger_entries_account;
