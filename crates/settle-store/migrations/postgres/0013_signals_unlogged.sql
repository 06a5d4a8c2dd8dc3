-- The signal log keeps the first SIGNALS_LOGGED_MAX signals of a job that changed nothing (stale
-- tokens, duplicates); past that it counts them here instead of growing without bound (a worker
-- looping on a stale token must not fill the disk or the console's job page).
ALTER TABLE jobs ADD COLUMN signals_unlogged bigint NOT NULL DEFAULT 0;
