-- Spend limits (issue 45, docs/design/money-controls.md §3): an account's limits per UTC day or
-- month, each carrying the spend of one period (`period_start`, `spent`: the net of the period's
-- postings of the kinds it covers; rolled forward by the period's first posting), the kinds it is
-- for when it names some (`all_kinds = 0`), and on the account whether it has any — returned by
-- every guarded balance UPDATE, so an account without limits never reads them. The flag's default
-- is a constant: no table is rewritten.

ALTER TABLE accounts ADD COLUMN spend_limited bigint NOT NULL DEFAULT 0 CHECK (spend_limited IN (0, 1));

CREATE TABLE spend_limits (
    account_id text NOT NULL REFERENCES accounts (id),
    limit_no bigint NOT NULL CHECK (limit_no >= 0),
    period text NOT NULL CHECK (period IN ('day', 'month')),
    amount bigint NOT NULL CHECK (amount > 0 AND amount <= 2305843009213693952),
    all_kinds bigint NOT NULL CHECK (all_kinds IN (0, 1)),
    period_start bigint NOT NULL,
    spent bigint NOT NULL,
    PRIMARY KEY (account_id, limit_no)
);

CREATE TABLE spend_limit_kinds (
    account_id text NOT NULL,
    limit_no bigint NOT NULL,
    kind text NOT NULL,
    PRIMARY KEY (account_id, limit_no, kind),
    FOREIGN KEY (account_id, limit_no) REFERENCES spend_limits (account_id, limit_no)
);
