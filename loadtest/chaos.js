// Clients that retry the way real ones do, for loadtest/chaos. One key per logical
// payment, retried with the same key and body on a timeout, 409, 502, 503 or 504 (with
// jittered backoff) until an answer is final or DEADLINE_MS has passed; every tenth
// payment is sent twice at once first, as a double click. Every answer becomes one JSON
// line of the console output (run k6 with --log-format=raw --console-output=FILE),
// which the harness audits against Postgres.
import http from 'k6/http';
import crypto from 'k6/crypto';
import { sleep } from 'k6';
import { BASE_URL, RUN, token, headers, paymentBody, options as scenario, constantVus } from './lib/common.js';

const DEADLINE_MS = Number(__ENV.DEADLINE_MS || 20000);
const TIMEOUT = __ENV.REQUEST_TIMEOUT || '3s';
const RETRY_ON = new Set([0, 409, 502, 503, 504]);
const TENANTS = ['chaos-a', 'chaos-b'];

export const options = scenario('clients', {
  ...constantVus(12),
  // an operation under way when the load stops still retries to its end
  gracefulStop: `${Math.ceil(DEADLINE_MS / 1000) + 5}s`,
});

export function setup() {
  return { tokens: TENANTS.map(token) };
}

export default function (data) {
  const tenant = __VU % TENANTS.length;
  const key = `chaos-${RUN}-${__VU}-${__ITER}`;
  const body = paymentBody(`order-${__VU}-${__ITER}`, 100 + (__ITER % 7));
  const request = ['POST', `${BASE_URL}/payments`, body, {
    headers: headers(data.tokens[tenant], key, { 'X-Demo-Delay-Ms': '20' }),
    timeout: TIMEOUT,
  }];
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    const sent = Date.now();
    const answers = attempt === 1 && __ITER % 10 === 0 ? http.batch([request, request]) : [http.request(...request)];
    let final = false;
    for (const r of answers) {
      record(r, { key, tenant: TENANTS[tenant], body, t: sent, attempt });
      final = final || !RETRY_ON.has(r.status);
    }
    if (final) return;
    if (Date.now() - started > DEADLINE_MS) {
      console.log(JSON.stringify({ key, tenant: TENANTS[tenant], gave_up: true }));
      return;
    }
    sleep(Math.min(0.1 * 2 ** (attempt - 1), 1) * (0.5 + Math.random() / 2));
  }
}

function record(r, line) {
  line.status = r.status;
  line.ms = Math.round(r.timings.duration);
  const type = r.headers['Content-Type'] || '';
  if (type.startsWith('application/problem+json')) {
    try {
      line.problem = String(r.json('type')).split('/').pop();
    } catch (_) {
      line.problem = 'unparsable';
    }
  } else if (r.status >= 500) {
    line.content_type = type;
  }
  if (r.status >= 200 && r.status < 300) line.sha = crypto.sha256(r.body || '', 'hex');
  else delete line.body;
  if (r.headers['Idempotent-Replayed'] === 'true') line.replayed = true;
  console.log(JSON.stringify(line));
}
