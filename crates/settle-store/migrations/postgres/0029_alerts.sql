-- Balance alerts (issue 45, docs/design/money-controls.md §2): an account's named thresholds, each
-- with the side of it the balance is on, and on the account the band those sides give
-- (`alert_floor`: the largest threshold the balance is at or above; `alert_ceiling`: the smallest
-- it is below; NULL: none). Every guarded balance UPDATE returns the band; only a posting that
-- leaves it reads `account_alerts`. No table is rewritten (nullable columns without a default).

ALTER TABLE accounts ADD COLUMN alert_floor bigint;
ALTER TABLE accounts ADD COLUMN alert_ceiling bigint;

CREATE TABLE account_alerts (
    account_id text NOT NULL REFERENCES accounts (id),
    alert_id text NOT NULL,
    below bigint NOT NULL CHECK (below > 0 AND below <= 2305843009213693952),
    side text NOT NULL CHECK (side IN ('above', 'below')),
    PRIMARY KEY (account_id, alert_id)
);
