// Mixed traffic from several tenants: mostly new keys, some retries of earlier keys,
// some reuses of a key with a different payload (which must be refused).
import http from 'k6/http';
import { check } from 'k6';
import exec from 'k6/execution';
import { BASE_URL, RUN, token, headers, paymentBody, summary, options as scenario, arrivalRate } from './lib/common.js';

const TENANTS = ['acme', 'globex', 'initech', 'umbrella', 'hooli'];

export const options = scenario('mixed', arrivalRate(), {
  // The reuses are sent expecting their 409, so a failure here is a real one.
  http_req_failed: ['rate<0.01'],
  checks: ['rate>0.99'],
});

export function setup() {
  return { toks: TENANTS.map((t) => token(`k6-${t}`)) };
}

// Keys this VU has completed: [tenant index, key, amount].
const done = [];
const REFUSED = http.expectedStatuses(409);

export default function (data) {
  const roll = Math.random();
  if (roll < 0.15 && done.length > 0) {
    const [t, key, amount] = done[Math.floor(Math.random() * done.length)];
    const r = http.post(`${BASE_URL}/payments`, paymentBody(key, amount), { headers: headers(data.toks[t], key) });
    check(r, { 'retry replayed': (res) => res.status === 201 && res.headers['Idempotent-Replayed'] === 'true' });
  } else if (roll < 0.2 && done.length > 0) {
    const [t, key, amount] = done[Math.floor(Math.random() * done.length)];
    const r = http.post(`${BASE_URL}/payments`, paymentBody(key, amount + 1), {
      headers: headers(data.toks[t], key),
      responseCallback: REFUSED,
    });
    check(r, { 'reuse refused': (res) => res.status === 409 && String(res.json('type')).endsWith('idempotency-key-reused') });
  } else {
    const t = exec.scenario.iterationInTest % TENANTS.length;
    const key = `mixed-${RUN}-${exec.scenario.iterationInTest}`;
    const amount = 100 + (exec.scenario.iterationInTest % 50);
    const r = http.post(`${BASE_URL}/payments`, paymentBody(key, amount), { headers: headers(data.toks[t], key) });
    if (check(r, { 'new key executed': (res) => res.status === 201 })) done.push([t, key, amount]);
  }
}

export const handleSummary = summary('mixed');
