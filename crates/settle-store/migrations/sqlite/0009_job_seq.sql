-- PostgreSQL's migration 0009 moves job sequence numbers to a sequence (docs/decisions/0013).
-- SQLite has one writer, for which the `counters` row costs nothing: nothing changes here; the
-- file keeps both engines' migration numbers in step.
SELECT 1;
