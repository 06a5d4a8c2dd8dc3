-- Top-ups (issue 45): PostgreSQL's 0031, the same table and grant origin
-- (docs/design/money-controls.md §4 and §11).
--
-- A store with jobs of kind `top_up` (a kind any platform could use until now) refuses this
-- migration: the count must be 0 to enter this table.
CREATE TABLE settle_0031_jobs_of_kind_top_up_must_be_renamed (n INTEGER NOT NULL CHECK (n = 0));
INSERT INTO settle_0031_jobs_of_kind_top_up_must_be_renamed SELECT count(*) FROM jobs WHERE kind = 'top_up';
DROP TABLE settle_0031_jobs_of_kind_top_up_must_be_renamed;

CREATE TABLE top_ups (
    job_id             TEXT PRIMARY KEY REFERENCES jobs (id),
    account_id         TEXT NOT NULL REFERENCES accounts (id),
    credits            INTEGER NOT NULL CHECK (credits > 0 AND credits <= 9007199254740992),
    price              INTEGER NOT NULL CHECK (price >= 0 AND price <= 9007199254740992),
    currency           TEXT NOT NULL CHECK (length(currency) = 3),
    customer           TEXT NOT NULL,
    idempotency_key    TEXT NOT NULL UNIQUE,
    provider_charge_id TEXT,
    sending_attempt    INTEGER,
    rule_generation    INTEGER,
    open               INTEGER NOT NULL CHECK (open = 0 OR open = 1),
    created_at         INTEGER NOT NULL
) STRICT;
CREATE INDEX top_ups_open ON top_ups (account_id) WHERE open = 1;

-- The grant origin's CHECK widened in place, as 0026 changed it (its text, not the rows).
PRAGMA writable_schema = ON;
UPDATE sqlite_schema SET sql = replace(sql,
    'CHECK (origin = ''grant'' OR origin = ''adjustment'' OR origin = ''opening'')',
    'CHECK (origin = ''grant'' OR origin = ''adjustment'' OR origin = ''opening'' OR origin = ''top_up'')')
WHERE type = 'table' AND name = 'grants';
PRAGMA writable_schema = OFF;

CREATE TABLE settle_schema_reread (x INTEGER);
DROP TABLE settle_schema_reread;
