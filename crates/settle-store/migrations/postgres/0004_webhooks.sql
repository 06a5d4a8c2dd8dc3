-- Webhook delivery (docs/design/webhooks.md).
CREATE TABLE webhook_cursors (
    endpoint_id text PRIMARY KEY,
    last_seq    bigint NOT NULL
);

CREATE TABLE webhook_deliveries (
    endpoint_id      text NOT NULL,
    event_seq        bigint NOT NULL REFERENCES outbox (seq),
    order_key        text NOT NULL,
    state            text NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts         bigint NOT NULL,
    next_attempt_at  bigint NOT NULL,
    lease_token      text,
    lease_expires_at bigint,
    last_status      bigint,
    last_error       text,
    delivered_at     bigint,
    created_at       bigint NOT NULL,
    updated_at       bigint NOT NULL,
    PRIMARY KEY (endpoint_id, event_seq)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (endpoint_id, state, next_attempt_at);
-- Head-of-line checks look only at deliveries not yet delivered.
CREATE INDEX webhook_deliveries_key ON webhook_deliveries (endpoint_id, order_key, event_seq) WHERE state <> 'delivered';
