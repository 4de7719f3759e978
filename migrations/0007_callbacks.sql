-- Settlement callbacks (docs/http-api.md, "Told when it settles"): a key whose client was
-- not given the final answer is told to its tenant's `callback_url` once it settles.
--
-- `callback` marks a row whose client was answered 202 (`Prefer: respond-async`): its
-- completion or release by the gateway writes a callback. A settlement by the reconciler
-- or an operator writes one whatever the mark, for a tenant with a `callback_url`: its
-- client was answered 504, 503 or 409 while it was held.
ALTER TABLE idempotency_keys ADD COLUMN callback boolean NOT NULL DEFAULT false;

-- The outbox: one row per settled attempt, written in the settlement's own statement, so
-- a settlement is never committed without its callback. Delivered at least once by one
-- sender at a time (a lease on `next_at`, fenced by `deliveries`), retried with backoff
-- for 72 hours. A delivered row is kept a day, so that a completion repeated after a lost
-- reply cannot write it again; then purged with expired keys. Never a body or a request.
CREATE TABLE callbacks (
    tenant_id       text        NOT NULL,
    attempt         uuid        NOT NULL,
    endpoint        text        NOT NULL,
    key             text        NOT NULL,
    state           text        NOT NULL CHECK (state IN ('completed', 'not_executed')),
    response_status int4,
    trace_context   text,
    settled_at      timestamptz NOT NULL DEFAULT now(),
    deliveries      int4        NOT NULL DEFAULT 0,
    next_at         timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    last_error      text,
    PRIMARY KEY (tenant_id, attempt)
);
-- The sender's queue: only rows still to deliver.
CREATE INDEX callbacks_due_idx ON callbacks (next_at) WHERE finished_at IS NULL;
CREATE INDEX callbacks_finished_idx ON callbacks (finished_at) WHERE finished_at IS NOT NULL;
