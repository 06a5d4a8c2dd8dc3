-- The accounts that have a cap (`max_running`), found by one probe of an index that holds only them
-- (docs/design/fair-claims.md §11): a PostgreSQL claim takes several jobs of a line in one statement
-- only while no account has a cap, which that statement itself checks here, under the cap gate.
-- SQLite's claim does not read it; it is built on both engines so their schemas stay alike.
CREATE INDEX accounts_capped ON accounts (id) WHERE max_running IS NOT NULL;
