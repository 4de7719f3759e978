// Storms: bursts of concurrent identical requests, as a flaky mobile network produces.
// All VUs share one key per time window, so each window is one operation hit many
// times at once: every answer is the one 201 (executed or replayed) or 409 in progress.
import http from 'k6/http';
import { check } from 'k6';
import { Counter } from 'k6/metrics';
import { BASE_URL, RUN, token, headers, paymentBody, summary, options as scenario, constantVus } from './lib/common.js';

const WINDOW_MS = Number(__ENV.WINDOW_MS || 500);
const conflicts = new Counter('storm_in_progress');
const replays = new Counter('storm_replays');
const ANSWERED = http.expectedStatuses(201, 409);

export const options = scenario('storm', constantVus(20), {
  checks: ['rate>0.999'],
  http_req_failed: ['rate<0.01'], // 409 in progress is expected (see below)
});

export function setup() {
  return { tok: token('k6-storm') };
}

export default function (data) {
  const window = Math.floor(Date.now() / WINDOW_MS);
  const r = http.post(`${BASE_URL}/payments`, paymentBody(`order-${window}`, 100), {
    headers: headers(data.tok, `storm-${RUN}-${window}`, { 'X-Demo-Delay-Ms': '50' }),
    responseCallback: ANSWERED,
  });
  if (r.status === 409) conflicts.add(1);
  if (r.headers['Idempotent-Replayed'] === 'true') replays.add(1);
  check(r, {
    '201 or 409 in progress': (res) =>
      res.status === 201 ||
      (res.status === 409 && String(res.json('type')).endsWith('idempotency-key-in-progress')),
  });
}

export const handleSummary = summary('storm');
