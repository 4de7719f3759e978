-- (m) A simpler, hand-written form of the Postgres work of one embedded-mode request with a
-- new key (idem-embedded, docs/embedded-mode.md): an insert-only claim, the demo's insert and
-- a plain completion update in one transaction with its lock wait, one commit. Not case
-- (k)'s own statements (its claim also reads a live row and returns the record, its
-- completion locks its row first): the same round trips with less work in each.
\set n random(1, 9000000000000000000)
BEGIN;
SET LOCAL lock_timeout = '5000ms';
WITH claimed AS (INSERT INTO idempotency_keys AS k (tenant_id, endpoint, key, request_hash, status, attempt, locked_until, trace_context, created_at, expires_at) VALUES ('pgbench-m', 'POST /payments', 'pg-' || :client_id::text || '-' || :n::text, decode(md5(:n::text) || md5(:n::text), 'hex'), 'in_progress', md5(:n::text)::uuid, now() + 30000 * interval '1 millisecond', NULL, now(), now() + 86400000 * interval '1 millisecond') ON CONFLICT (tenant_id, endpoint, key) DO UPDATE SET status = 'in_progress' WHERE k.expires_at <= now() RETURNING 1) SELECT EXISTS (SELECT 1 FROM claimed) AS claimed, k.request_hash, k.status, k.attempt FROM (SELECT 1) AS one LEFT JOIN idempotency_keys AS k ON k.tenant_id = 'pgbench-m' AND k.endpoint = 'POST /payments' AND k.key = 'pg-' || :client_id::text || '-' || :n::text;
INSERT INTO demo_payments (id, tenant_id, idempotency_key, order_id, amount_uah) VALUES (gen_random_uuid(), 'pgbench-m', 'pg-' || :client_id::text || '-' || :n::text, 'order-1', 100);
UPDATE idempotency_keys SET status = 'completed', response_status = 201, response_headers = '[["content-type","application/json"],["location","/payments/x"]]'::jsonb, response_body = '\x7b7d'::bytea, completed_at = now(), locked_until = NULL, expires_at = now() + 86400000 * interval '1 millisecond' WHERE tenant_id = 'pgbench-m' AND endpoint = 'POST /payments' AND key = 'pg-' || :client_id::text || '-' || :n::text AND attempt = md5(:n::text)::uuid;
COMMIT;
