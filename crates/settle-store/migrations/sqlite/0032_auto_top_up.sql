-- The auto top-up rule (issue 45): PostgreSQL's 0032, the same table and index
-- (docs/design/money-controls.md §4, §11.3, §11.8).
CREATE TABLE auto_top_ups (
    account_id          TEXT PRIMARY KEY REFERENCES accounts (id),
    below               INTEGER NOT NULL CHECK (below > 0 AND below <= 2305843009213693952),
    credits             INTEGER NOT NULL CHECK (credits > 0 AND credits <= 9007199254740992),
    price               INTEGER NOT NULL CHECK (price >= 0 AND price <= 9007199254740992),
    currency            TEXT NOT NULL CHECK (length(currency) = 3),
    customer            TEXT NOT NULL,
    monthly_credits_max INTEGER NOT NULL CHECK (monthly_credits_max >= credits AND monthly_credits_max <= 2305843009213693952),
    state               TEXT NOT NULL CHECK (state = 'active' OR state = 'paused'),
    side                TEXT NOT NULL CHECK (side = 'above' OR side = 'below'),
    generation          INTEGER NOT NULL CHECK (generation >= 1),
    month_start         INTEGER NOT NULL,
    credits_this_month  INTEGER NOT NULL CHECK (credits_this_month >= 0),
    updated_at          INTEGER NOT NULL
) STRICT;
-- The backstop of "one rule top-up in flight per account".
CREATE UNIQUE INDEX top_ups_one_open_rule ON top_ups (account_id) WHERE open = 1 AND rule_generation IS NOT NULL;
-- The rule's top-ups of an account by creation: its month's count and its last generation.
CREATE INDEX top_ups_rule ON top_ups (account_id, created_at) WHERE rule_generation IS NOT NULL;
