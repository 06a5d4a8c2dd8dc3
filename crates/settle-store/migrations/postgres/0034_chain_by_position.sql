-- SQLite's 0034 replaces the unique index on `(account_id, prev_hash)` by a trigger that refuses a
-- ledger line whose `prev_hash` is not its predecessor's hash (decision 0037). PostgreSQL keeps the
-- index: dropping it changed nothing measurable here, and a row trigger would cost a function call
-- per line. The version is kept so both engines' migrations stay in step.
SELECT 1;
