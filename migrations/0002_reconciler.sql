-- The reconciler's bookkeeping: how many times it has probed a stuck row, for backoff.
ALTER TABLE idempotency_keys ADD COLUMN probe_attempts integer NOT NULL DEFAULT 0;
