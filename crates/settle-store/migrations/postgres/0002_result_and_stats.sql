-- What a worker's success carried (JSON text), kept on the job.
ALTER TABLE jobs ADD COLUMN result text;
