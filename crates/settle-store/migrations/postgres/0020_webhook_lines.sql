-- Webhook lines (issue 41): a delivery's `order_key` was its job's id, or `account:` and its
-- account's id for an account's own events — and a job may be named `account:acme`, which put it in
-- the account's line. Keys now start with their kind and a space (`job …`, `account …`), which no id
-- holds. Deliveries not yet delivered are re-keyed from their outbox event, so each line keeps its
-- order across the upgrade; delivered ones are never looked at again (the head-of-line check reads
-- only undelivered rows).
UPDATE webhook_deliveries
SET order_key = (
    SELECT CASE WHEN o.job_id IS NULL THEN 'account ' || o.account_id ELSE 'job ' || o.job_id END
    FROM outbox o WHERE o.seq = webhook_deliveries.event_seq
)
WHERE state <> 'delivered' AND EXISTS (SELECT 1 FROM outbox o WHERE o.seq = webhook_deliveries.event_seq);
