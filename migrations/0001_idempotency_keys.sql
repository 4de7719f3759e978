-- The ledger of idempotent operations: one row per (tenant, endpoint, key).
CREATE TABLE idempotency_keys (
    tenant_id        text        NOT NULL,
    endpoint         text        NOT NULL,
    key              text        NOT NULL,
    -- sha256 of method, concrete path and query, and canonical body.
    request_hash     bytea       NOT NULL CHECK (length(request_hash) = 32),
    status           text        NOT NULL CHECK (status IN ('in_progress', 'completed')),
    -- Fencing token of the attempt that owns the row; every write names it.
    attempt          uuid        NOT NULL,
    -- While in progress: until when the owning attempt is protected.
    locked_until     timestamptz,
    response_status  integer,
    -- [[name, value], ...]; values are bytes mapped one-to-one onto U+0000..U+00FF.
    response_headers jsonb,
    response_body    bytea,
    -- W3C traceparent of the first execution, so retries can link to its trace.
    trace_context    text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, endpoint, key),
    CHECK (status = 'in_progress' OR (response_status IS NOT NULL AND response_body IS NOT NULL))
);

-- The reconciler's scan: in-progress rows whose lease ran out.
CREATE INDEX idempotency_keys_lease_idx
    ON idempotency_keys (locked_until)
    WHERE status = 'in_progress';

-- The purge's scan: rows past their expiry, oldest first.
CREATE INDEX idempotency_keys_expires_idx
    ON idempotency_keys (expires_at);
