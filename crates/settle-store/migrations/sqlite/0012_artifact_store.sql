-- The artifact store an artifact was registered in (`file:///srv/artifacts`, `s3://bucket/prefix`),
-- so a teardown run by a process configured with another store (another working directory, a
-- changed --artifacts) refuses rather than "deletes" objects that are not there and ends the job
-- cancelled with its artifacts left behind. Rows registered before this have none: they are
-- deleted from the store configured where the teardown runs, as before.
ALTER TABLE artifacts ADD COLUMN store TEXT;
