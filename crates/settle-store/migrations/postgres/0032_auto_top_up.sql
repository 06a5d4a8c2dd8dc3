-- The auto top-up rule (issue 45, docs/design/money-controls.md §4, §11.3, §11.8): at most one per
-- account. `side` is where the balance stands against `below` (one more threshold of the account's
-- alert band); a posting that takes it from `above` to `below` makes a top-up in the same
-- transaction, after the operation's last posting, when the rule is `active`, no top-up of the
-- account is open and the month's count allows. `generation` grows with every PUT, so a top-up of
-- an earlier rule pauses nothing; `credits_this_month` is what the rule's top-ups created since
-- `month_start` are buying or bought (open, or charged).
CREATE TABLE auto_top_ups (
    account_id          text PRIMARY KEY REFERENCES accounts (id),
    below               bigint NOT NULL CHECK (below > 0 AND below <= 2305843009213693952),
    credits             bigint NOT NULL CHECK (credits > 0 AND credits <= 9007199254740992),
    price               bigint NOT NULL CHECK (price >= 0 AND price <= 9007199254740992),
    currency            text NOT NULL CHECK (length(currency) = 3),
    customer            text NOT NULL,
    monthly_credits_max bigint NOT NULL CHECK (monthly_credits_max >= credits AND monthly_credits_max <= 2305843009213693952),
    state               text NOT NULL CHECK (state IN ('active', 'paused')),
    side                text NOT NULL CHECK (side IN ('above', 'below')),
    generation          bigint NOT NULL CHECK (generation >= 1),
    month_start         bigint NOT NULL,
    credits_this_month  bigint NOT NULL CHECK (credits_this_month >= 0),
    updated_at          bigint NOT NULL
);
-- The backstop of "one rule top-up in flight per account".
CREATE UNIQUE INDEX top_ups_one_open_rule ON top_ups (account_id) WHERE open = 1 AND rule_generation IS NOT NULL;
-- The rule's top-ups of an account by creation: its month's count and its last generation.
CREATE INDEX top_ups_rule ON top_ups (account_id, created_at) WHERE rule_generation IS NOT NULL;
