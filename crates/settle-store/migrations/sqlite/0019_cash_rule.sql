-- The cash rule (semantics §1, L6): each withdrawal records, from the transaction that made it, what
-- the account's never-expiring grants had left and what it owed once the withdrawal was taken, so
-- the audit can tell that no withdrawal left the account owing what it drew on the overdraft.
-- NULL for withdrawals made before this migration (nothing recorded them): the audit does not judge
-- those (decision 0028).
ALTER TABLE withdrawals ADD COLUMN cash_after INTEGER;
ALTER TABLE withdrawals ADD COLUMN debt_after INTEGER;
