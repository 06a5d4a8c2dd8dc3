-- Worker answers (issue 20, docs/decisions/0019): what an attempt's worker reported that took
-- effect, so a re-sent report is told apart from a stale one. `reported` is that report
-- (`succeed`, `fail`, `unknown`; NULL when none did: the rescuer, a cancel, another attempt or an
-- operator closed it), `sent_code` the code sent with its `fail`, `expired_at` when the lease the
-- rescuer found lapsed ran out, `success_at` when this attempt's own success took effect (also an
-- earlier attempt's late one, and one a cancel won over). `decided_attempt` on an item is the
-- attempt whose item report moved it.
ALTER TABLE attempts ADD COLUMN reported text;
ALTER TABLE attempts ADD COLUMN sent_code text;
ALTER TABLE attempts ADD COLUMN expired_at bigint;
ALTER TABLE attempts ADD COLUMN success_at bigint;
ALTER TABLE items ADD COLUMN decided_attempt bigint;
