-- Webhook delivery (docs/design/webhooks.md).
CREATE TABLE webhook_cursors (
    endpoint_id TEXT PRIMARY KEY,
    last_seq    INTEGER NOT NULL
) STRICT;

CREATE TABLE webhook_deliveries (
    endpoint_id      TEXT NOT NULL,
    event_seq        INTEGER NOT NULL REFERENCES outbox (seq),
    order_key        TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts         INTEGER NOT NULL,
    next_attempt_at  INTEGER NOT NULL,
    lease_token      TEXT,
    lease_expires_at INTEGER,
    last_status      INTEGER,
    last_error       TEXT,
    delivered_at     INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (endpoint_id, event_seq)
) STRICT;
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (endpoint_id, state, next_attempt_at);
-- Head-of-line checks look only at deliveries not yet delivered.
CREATE INDEX webhook_deliveries_key ON webhook_deliveries (endpoint_id, order_key, event_seq) WHERE state <> 'delivered';
