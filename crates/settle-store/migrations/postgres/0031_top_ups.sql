-- Top-ups (issue 45, docs/design/money-controls.md §4 and §11): a job of the reserved kind
-- `top_up` plus one row here. `open` is 1 from creation until the job's terminal state (written in
-- the same transaction as it); while it is, the top-up's `credits` are part of the account's
-- `held` (the grant a confirmed charge writes can never be refused by the balance's bound).
-- `sending_attempt` marks the attempt whose charge was started (committed before the request
-- leaves), as a withdrawal's does. `rule_generation` names the auto rule that made it (NULL: asked
-- for). A confirmed charge grants with origin `top_up`, id the top-up's.
--
-- `top_up` was a kind any platform could use until now: a store with jobs of that kind refuses
-- this migration (rename them first), rather than hand them to the funding processor.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM jobs WHERE kind = 'top_up') THEN
        RAISE EXCEPTION 'jobs of kind top_up exist: top_up is now reserved for top-ups (docs/upgrade.md, 0031)';
    END IF;
END $$;

CREATE TABLE top_ups (
    job_id             text PRIMARY KEY REFERENCES jobs (id),
    account_id         text NOT NULL REFERENCES accounts (id),
    credits            bigint NOT NULL CHECK (credits > 0 AND credits <= 9007199254740992),
    price              bigint NOT NULL CHECK (price >= 0 AND price <= 9007199254740992),
    currency           text NOT NULL CHECK (length(currency) = 3),
    customer           text NOT NULL,
    idempotency_key    text NOT NULL UNIQUE,
    provider_charge_id text,
    sending_attempt    bigint,
    rule_generation    bigint,
    open               bigint NOT NULL CHECK (open IN (0, 1)),
    created_at         bigint NOT NULL
);
-- An account's top-ups in flight (what the auto rule waits for).
CREATE INDEX top_ups_open ON top_ups (account_id) WHERE open = 1;

ALTER DOMAIN grant_origin DROP CONSTRAINT grant_origin_check;
ALTER DOMAIN grant_origin ADD CONSTRAINT grant_origin_check
    CHECK (VALUE IN ('grant', 'adjustment', 'opening', 'top_up')) NOT VALID;
