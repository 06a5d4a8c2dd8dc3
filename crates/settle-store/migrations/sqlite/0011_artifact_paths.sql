-- An artifact is stored under its job's and item's own prefix (`{job_id}/{item_id}/{key}`), so
-- cancelling one job can never delete another job's object of the same key. `path` is where the
-- object is, as registered; rows registered before this keep their key as their path.
ALTER TABLE artifacts ADD COLUMN path TEXT;
UPDATE artifacts SET path = key;
