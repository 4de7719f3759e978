// New keys: every request a new operation, at a constant arrival rate. Each must
// execute (201, not replayed).
import http from 'k6/http';
import { check } from 'k6';
import exec from 'k6/execution';
import { BASE_URL, RUN, token, headers, paymentBody, summary, options as scenario, arrivalRate } from './lib/common.js';

export const options = scenario('new_keys', arrivalRate(), {
  http_req_failed: ['rate<0.01'],
  checks: ['rate>0.99'],
  http_req_duration: ['p(99)<1000'],
});

export function setup() {
  return { tok: token('k6-new-keys') };
}

export default function (data) {
  const n = exec.scenario.iterationInTest;
  const r = http.post(`${BASE_URL}/payments`, paymentBody(`order-${n}`, 100), {
    headers: headers(data.tok, `new-${RUN}-${n}`),
  });
  check(r, { 'executed 201': (res) => res.status === 201 && !res.headers['Idempotent-Replayed'] });
}

export const handleSummary = summary('new-keys');
