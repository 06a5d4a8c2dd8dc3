-- What a later transition may still credit back to each account (docs/decisions/0003): the cost of
-- its charged items, and of its paid withdrawals (a return). Grants and positive adjustments keep
-- balance + held ≤ BALANCE_MAX, so no refund or return can ever overflow.
ALTER TABLE accounts ADD COLUMN held INTEGER NOT NULL DEFAULT 0 CHECK (held >= 0);
UPDATE accounts SET held = (
    SELECT COALESCE(SUM(i.cost), 0) FROM items i JOIN jobs j ON j.id = i.job_id
    WHERE j.account_id = accounts.id
      AND (i.state = 'charged' OR (j.kind = 'withdrawal' AND i.state IN ('succeeded', 'reclaimed')))
);
