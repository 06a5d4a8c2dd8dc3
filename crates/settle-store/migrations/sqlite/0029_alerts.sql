-- Balance alerts (issue 45): PostgreSQL's 0029, the same columns and table
-- (docs/design/money-controls.md §2).
ALTER TABLE accounts ADD COLUMN alert_floor INTEGER;
ALTER TABLE accounts ADD COLUMN alert_ceiling INTEGER;

CREATE TABLE account_alerts (
    account_id TEXT NOT NULL REFERENCES accounts (id),
    alert_id TEXT NOT NULL,
    below INTEGER NOT NULL CHECK (below > 0 AND below <= 2305843009213693952),
    side TEXT NOT NULL CHECK (side IN ('above', 'below')),
    PRIMARY KEY (account_id, alert_id)
) STRICT;
