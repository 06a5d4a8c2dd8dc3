-- Job sequence numbers come from a sequence, no longer from the `counters` row that every create
-- held until its commit (docs/decisions/0013): `job_seq` orders claims and pages job lists and
-- needs no gap-free numbering. It starts 2^32 past the counter, so a process still running the
-- previous version (numbering from the counter) cannot collide with one running this one.
CREATE SEQUENCE job_seq_numbers AS bigint;
SELECT setval('job_seq_numbers', (SELECT value FROM counters WHERE name = 'job') + 4294967296);
