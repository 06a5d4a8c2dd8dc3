-- PostgreSQL's migration 0026 moves single-column CHECKs into domains, which PostgreSQL plans once
-- per connection instead of once per statement. SQLite has no domains, and compiles a table's
-- CHECKs into each prepared statement once: nothing changes here. The migration exists so both
-- engines' logs hold the same versions.
SELECT 1;
