-- (m) Embedded mode's Postgres work for one new key (case k), sent by pgbench: the
-- statements idem-embedded and payments-demo send, one per line, with pgbench's
-- values for their parameters (prepared, like sqlx; BEGIN and its lock wait are one
-- simple query in case k, two statements here). Generated from the statements by
-- payments-demo's test the_benchs_case_m_sends_embedded_modes_statements: do not edit.
\set n random(1, 9000000000000000000)
BEGIN;
SET LOCAL lock_timeout = '20ms';
INSERT INTO idempotency_keys AS k (tenant_id, endpoint, key, request_hash, status, attempt, locked_until, trace_context, created_at, expires_at) VALUES ('pgbench-m', 'POST /payments', 'pg-' || :client_id::text || '-' || :n::text, decode(md5(:n::text) || md5(:n::text), 'hex'), 'in_progress', md5(:n::text)::uuid, now() + 5000::float8 * interval '1 millisecond', NULL, now(), now() + 86400000::float8 * interval '1 millisecond') ON CONFLICT (tenant_id, endpoint, key) DO NOTHING RETURNING set_config('lock_timeout', '5000ms', true) AS lock_timeout_after;
INSERT INTO demo_payments (id, tenant_id, idempotency_key, idempotency_attempt, order_id, amount_uah) VALUES (gen_random_uuid(), 'pgbench-m', 'pg-' || :client_id::text || '-' || :n::text, md5(:n::text), 'order-1', 100);
UPDATE idempotency_keys AS k SET status = 'completed', response_status = 201, response_headers = '[["content-type","application/json"],["location","/payments/x"]]'::jsonb, response_body = '\x7b7d'::bytea, response_omitted = false, completed_at = now(), locked_until = NULL, held_since = NULL, expires_at = now() + 86400000::float8 * interval '1 millisecond' WHERE k.tenant_id = 'pgbench-m' AND k.endpoint = 'POST /payments' AND k.key = 'pg-' || :client_id::text || '-' || :n::text AND k.attempt = md5(:n::text)::uuid RETURNING (extract(epoch from k.expires_at) * 1000000)::int8;
COMMIT;
