// Replays: a small set of keys, completed once in setup(), then retried over and over.
// Every answer must be the stored 201 with Idempotent-Replayed: true.
import http from 'k6/http';
import { check } from 'k6';
import { BASE_URL, RUN, token, headers, paymentBody, summary, options as scenario, constantVus } from './lib/common.js';

const KEYS = Number(__ENV.KEYS || 20);

export const options = scenario('replays', constantVus(50), {
  http_req_failed: ['rate<0.001'],
  checks: ['rate>0.999'],
});

export function setup() {
  const tok = token('k6-replays');
  for (let i = 0; i < KEYS; i++) {
    const r = http.post(`${BASE_URL}/payments`, paymentBody(`order-${i}`, 100 + i), {
      headers: headers(tok, `replay-${RUN}-${i}`),
    });
    if (r.status !== 201) throw new Error(`setup: ${r.status} ${r.body}`);
  }
  return { tok };
}

export default function (data) {
  const i = Math.floor(Math.random() * KEYS);
  const r = http.post(`${BASE_URL}/payments`, paymentBody(`order-${i}`, 100 + i), {
    headers: headers(data.tok, `replay-${RUN}-${i}`),
  });
  check(r, {
    'replayed 201': (res) => res.status === 201 && res.headers['Idempotent-Replayed'] === 'true',
  });
}

export const handleSummary = summary('replays');
