// Shared helpers for the k6 scripts: HS256 tokens minted inside k6, request helpers,
// and a JSON summary written by handleSummary (remote jslib imports do not work offline).
import crypto from 'k6/crypto';
import encoding from 'k6/encoding';

export const BASE_URL = __ENV.BASE_URL || 'http://127.0.0.1:8080';
export const SECRET = __ENV.JWT_SECRET || 'dev-secret-change-me';
// Names this run's keys apart from earlier runs' against the same database.
export const RUN = __ENV.RUN_ID || `${Date.now()}`;

const b64 = (obj) => encoding.b64encode(JSON.stringify(obj), 'rawurl');

// An HS256 token for `tenant`, valid for an hour.
export function token(tenant) {
  const now = Math.floor(Date.now() / 1000);
  const head = b64({ alg: 'HS256', typ: 'JWT' });
  const body = b64({ tenant_id: tenant, sub: `k6:${tenant}`, iat: now, exp: now + 3600 });
  const sig = crypto.hmac('sha256', SECRET, `${head}.${body}`, 'base64rawurl');
  return `${head}.${body}.${sig}`;
}

export function headers(tok, key, extra) {
  return Object.assign(
    { Authorization: `Bearer ${tok}`, 'Idempotency-Key': key, 'Content-Type': 'application/json' },
    extra || {},
  );
}

export function paymentBody(order, amount) {
  return JSON.stringify({ orderId: order, amountUah: amount });
}

// k6 `options` with one scenario, `name`, lasting DURATION (10s unless set).
export function options(name, scenario, thresholds) {
  return {
    scenarios: { [name]: Object.assign({ duration: __ENV.DURATION || '10s' }, scenario) },
    thresholds: thresholds || {},
    summaryTrendStats: ['med', 'p(90)', 'p(99)', 'max'],
  };
}

// A scenario that starts RATE iterations a second (200 unless set), whatever the answers'
// latency, with VUS virtual users (50 unless set) ready for them.
export function arrivalRate() {
  return {
    executor: 'constant-arrival-rate',
    rate: Number(__ENV.RATE || 200),
    timeUnit: '1s',
    preAllocatedVUs: Number(__ENV.VUS || 50),
  };
}

// A scenario of VUS virtual users (`vus` unless set), each iterating as fast as it is answered.
export function constantVus(vus) {
  return { executor: 'constant-vus', vus: Number(__ENV.VUS || vus) };
}

// Writes the end-of-test summary as JSON to SUMMARY (default: stdout only) and prints
// a short human line.
export function summary(name) {
  return (data) => {
    const m = data.metrics;
    const d = m.http_req_duration ? m.http_req_duration.values : {};
    const reqs = m.http_reqs ? m.http_reqs.values : {};
    const failed = m.http_req_failed ? m.http_req_failed.values.rate : 0;
    const line = `${name}: ${(reqs.rate || 0).toFixed(0)} req/s, p50 ${(d.med || 0).toFixed(2)} ms, ` +
      `p99 ${(d['p(99)'] || 0).toFixed(2)} ms, failed ${(failed * 100).toFixed(2)}%\n`;
    const out = { stdout: line };
    if (__ENV.SUMMARY) {
      out[__ENV.SUMMARY] = JSON.stringify({
        script: name,
        requests: reqs.count || 0,
        rps: reqs.rate || 0,
        p50_ms: d.med || 0,
        p90_ms: d['p(90)'] || 0,
        p99_ms: d['p(99)'] || 0,
        failed_rate: failed,
        thresholds: Object.fromEntries(
          Object.entries(m).filter(([, v]) => v.thresholds).map(([k, v]) => [k, v.thresholds]),
        ),
      }, null, 2);
    }
    return out;
  };
}
