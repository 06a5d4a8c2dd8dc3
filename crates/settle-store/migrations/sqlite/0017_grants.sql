-- Expiring grants (issue 24, docs/decisions/0023): which source of credit paid for each movement.
--
-- `grants`: every source of credit — a grant, a positive adjustment, or the account's opening
-- balance from before this migration — with what it has left. `allocations`: one row per movement
-- and source it took from (no source: debt), with what was given back. `accounts.debt`: what the
-- balance owes that no grant holds; `accounts.next_expiry`: the soonest expiry of the account's
-- unexpired grants (i64::MAX when none), which every balance UPDATE checks against its clock.
-- `entries` is renamed so that a process of the previous release fails every posting loudly
-- instead of posting without touching the grants.
ALTER TABLE accounts RENAME COLUMN entries TO last_account_seq;

CREATE TABLE grants (
    key        INTEGER PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    origin     TEXT NOT NULL CHECK (origin IN ('grant', 'adjustment', 'opening')),
    source_id  TEXT NOT NULL,
    amount     INTEGER NOT NULL CHECK (amount >= 0),
    priority   INTEGER NOT NULL CHECK (priority BETWEEN 0 AND 100),
    expires_at INTEGER,
    expiry_key INTEGER NOT NULL,
    remaining  INTEGER NOT NULL CHECK (remaining >= 0),
    expired_at INTEGER,
    -- The account's last position when it expired (its `expire` entry's, when it had some left):
    -- nothing may take from it after that.
    expired_seq INTEGER,
    created_at INTEGER NOT NULL,
    CHECK ((expired_at IS NULL) = (expired_seq IS NULL)),
    CHECK (expiry_key = COALESCE(expires_at, 9223372036854775807)),
    CHECK (origin = 'grant' OR expires_at IS NULL)
) STRICT;
CREATE UNIQUE INDEX grants_source ON grants (origin, source_id);
-- The head of the burn-down order: a seek, never a scan of the account's grants.
CREATE INDEX grants_burn ON grants (account_id, priority, expiry_key, key) WHERE remaining > 0 AND expired_at IS NULL;
-- An account's unexpired grants by expiry: what is due, and the next expiry after it.
CREATE INDEX grants_due ON grants (account_id, expiry_key) WHERE expired_at IS NULL;

CREATE TABLE allocations (
    id          INTEGER PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts (id),
    grant_key   INTEGER REFERENCES grants (key),
    kind        TEXT NOT NULL CHECK (kind IN ('charge', 'reclaim', 'adjustment', 'settle_debt', 'opening')),
    job_id      TEXT,
    item_id     TEXT,
    ref_id      TEXT,
    account_seq INTEGER NOT NULL CHECK (account_seq >= 0),
    taken       INTEGER NOT NULL CHECK (taken > 0),
    given_back  INTEGER NOT NULL DEFAULT 0 CHECK (given_back >= 0),
    -- A part no grant covered (debt): how much of it later credit has paid.
    settled     INTEGER NOT NULL DEFAULT 0 CHECK (settled >= 0),
    -- A `settle_debt` part: the debt part it paid.
    paid_part   INTEGER REFERENCES allocations (id),
    created_at  INTEGER NOT NULL,
    CHECK (given_back + settled <= taken),
    CHECK ((kind = 'settle_debt') = (paid_part IS NOT NULL)),
    CHECK (kind <> 'settle_debt' OR grant_key IS NOT NULL),
    CHECK (settled = 0 OR grant_key IS NULL)
) STRICT;
CREATE INDEX allocations_item ON allocations (job_id, item_id, id) WHERE job_id IS NOT NULL;
-- Debt not yet paid, oldest first (what new credit pays), and the settlements of one debt part.
CREATE INDEX allocations_unpaid ON allocations (account_id, id) WHERE grant_key IS NULL AND taken > given_back + settled;
CREATE INDEX allocations_paid ON allocations (paid_part) WHERE paid_part IS NOT NULL;

ALTER TABLE accounts ADD COLUMN debt INTEGER NOT NULL DEFAULT 0 CHECK (debt >= 0);
ALTER TABLE accounts ADD COLUMN next_expiry INTEGER NOT NULL DEFAULT 9223372036854775807;
CREATE INDEX accounts_next_expiry ON accounts (next_expiry) WHERE next_expiry < 9223372036854775807;

-- What every account could still get back: a charged item's stake, a paid withdrawal's amount.
-- Each becomes an allocation of the account's opening grant, so a refund after the upgrade finds
-- its parts.
CREATE TEMP TABLE opening_parts AS
SELECT j.account_id AS account_id, i.job_id AS job_id, i.item_id AS item_id, i.ord AS ord, i.cost AS taken
  FROM items i JOIN jobs j ON j.id = i.job_id
 WHERE i.cost > 0
   AND (i.state = 'charged' OR (j.kind = 'withdrawal' AND i.state IN ('succeeded', 'reclaimed')));

INSERT INTO grants (account_id, origin, source_id, amount, priority, expires_at, expiry_key, remaining, created_at)
SELECT a.id, 'opening', a.id, MAX(a.balance, 0) + COALESCE(p.total, 0), 50, NULL, 9223372036854775807,
       MAX(a.balance, 0), a.created_at
  FROM accounts a
  LEFT JOIN (SELECT account_id, SUM(taken) AS total FROM opening_parts GROUP BY account_id) p ON p.account_id = a.id
 WHERE a.balance > 0 OR p.total > 0;

INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, account_seq, taken, created_at)
SELECT p.account_id, g.key, 'opening', p.job_id, p.item_id, 0, p.taken, g.created_at
  FROM opening_parts p JOIN grants g ON g.origin = 'opening' AND g.source_id = p.account_id
 ORDER BY p.account_id, p.job_id, p.ord;

-- A negative balance is debt no grant holds: one part for it, which later credit pays.
INSERT INTO allocations (account_id, grant_key, kind, account_seq, taken, created_at)
SELECT id, NULL, 'opening', 0, -balance, created_at FROM accounts WHERE balance < 0 ORDER BY id;
UPDATE accounts SET debt = -balance WHERE balance < 0;
DROP TABLE opening_parts;
