-- no-transaction
-- The in-progress rows of each tenant, in key order: a listing of a tenant's in-progress
-- or held keys reads these alone, not every completed key the tenant has
-- (libs/postgres/src/ledger/operator.rs). Built without blocking writes; IF NOT EXISTS
-- lets an interrupted build be run again (drop an INVALID index first).
CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_in_progress_idx
    ON idempotency_keys (tenant_id, endpoint, key) WHERE status = 'in_progress';
