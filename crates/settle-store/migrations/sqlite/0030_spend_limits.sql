-- Spend limits (issue 45): PostgreSQL's 0030, the same column and tables
-- (docs/design/money-controls.md §3).
ALTER TABLE accounts ADD COLUMN spend_limited INTEGER NOT NULL DEFAULT 0 CHECK (spend_limited IN (0, 1));

CREATE TABLE spend_limits (
    account_id TEXT NOT NULL REFERENCES accounts (id),
    limit_no INTEGER NOT NULL CHECK (limit_no >= 0),
    period TEXT NOT NULL CHECK (period IN ('day', 'month')),
    amount INTEGER NOT NULL CHECK (amount > 0 AND amount <= 2305843009213693952),
    all_kinds INTEGER NOT NULL CHECK (all_kinds IN (0, 1)),
    period_start INTEGER NOT NULL,
    spent INTEGER NOT NULL,
    PRIMARY KEY (account_id, limit_no)
) STRICT;

CREATE TABLE spend_limit_kinds (
    account_id TEXT NOT NULL,
    limit_no INTEGER NOT NULL,
    kind TEXT NOT NULL,
    PRIMARY KEY (account_id, limit_no, kind),
    FOREIGN KEY (account_id, limit_no) REFERENCES spend_limits (account_id, limit_no)
) STRICT;
