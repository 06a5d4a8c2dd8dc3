-- A circuit breaker per webhook endpoint, shared by every process that delivers it
-- (docs/design/webhooks.md, "Circuit breaker").
CREATE TABLE webhook_breakers (
    endpoint_id      TEXT PRIMARY KEY,
    state            TEXT NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    failures         INTEGER NOT NULL,
    opens            INTEGER NOT NULL,
    probe_at         INTEGER,
    probe_seq        INTEGER,
    probe_token      TEXT,
    probe_expires_at INTEGER,
    changed_at       INTEGER NOT NULL
) STRICT;
