-- A circuit breaker per webhook endpoint, shared by every process that delivers it
-- (docs/design/webhooks.md, "Circuit breaker").
CREATE TABLE webhook_breakers (
    endpoint_id      text PRIMARY KEY,
    state            text NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    failures         bigint NOT NULL,
    opens            bigint NOT NULL,
    probe_at         bigint,
    probe_seq        bigint,
    probe_token      text,
    probe_expires_at bigint,
    changed_at       bigint NOT NULL
);
