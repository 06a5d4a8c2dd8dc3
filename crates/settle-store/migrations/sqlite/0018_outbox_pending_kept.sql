-- PostgreSQL's migration 0018 keeps autovacuum from truncating `outbox_pending`; SQLite has no such
-- table (its events are numbered at once) and no autovacuum truncation lock: nothing changes here.
-- The migration exists so both engines' logs hold the same versions.
SELECT 1;
