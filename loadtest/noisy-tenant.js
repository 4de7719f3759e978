// A noisy tenant beside a calm one (docs/tenants.md): the calm tenant pays with new keys at
// CALM_RATE a second (300 unless set); with NOISY=1, another tenant sends NOISY_RATE a
// second (1000 unless set: ten times the rate its [tenants.<id>] entry allows in
// loadtest/bench) at the same time. The calm tenant's answers must all be 201 whatever the
// other does; the bench compares its p99 with and without the noise.
import http from 'k6/http';
import { check } from 'k6';
import exec from 'k6/execution';
import { Trend, Counter } from 'k6/metrics';
import { BASE_URL, RUN, token, headers, paymentBody } from './lib/common.js';

const CALM = __ENV.CALM_TENANT || 'k6-calm';
const NOISY = __ENV.NOISY_TENANT || 'k6-noisy';
const duration = __ENV.DURATION || '10s';
const calmLatency = new Trend('calm_duration', true);
const calmAnswers = new Counter('calm_answers');
const noisyAnswers = new Counter('noisy_answers');
const noisyLimited = new Counter('noisy_limited');

const arrival = (rate, exec) => ({
  executor: 'constant-arrival-rate', rate, timeUnit: '1s', duration, exec,
  preAllocatedVUs: Math.max(20, Math.ceil(rate / 10)),
});
// ROLE=calm or ROLE=noise runs that half alone (loadtest/bench runs the noise from a k6
// process of its own, so the calm tenant's client never waits behind the noisy one's).
const role = __ENV.ROLE || '';
const scenarios = {};
if (role !== 'noise') scenarios.calm = arrival(Number(__ENV.CALM_RATE || 300), 'calm');
if (role === 'noise' || (role === '' && __ENV.NOISY === '1')) {
  scenarios.noisy = arrival(Number(__ENV.NOISY_RATE || 1000), 'noisy');
}

export const options = {
  scenarios,
  thresholds: role === 'noise' ? {} : { 'checks{scenario:calm}': ['rate>0.999'] },
  summaryTrendStats: ['med', 'p(99)', 'max'],
};

export function setup() {
  return { calm: token(CALM), noisy: token(NOISY) };
}

export function calm(data) {
  const n = exec.scenario.iterationInTest;
  const r = http.post(`${BASE_URL}/payments`, paymentBody(`calm-${n}`, 100), {
    headers: headers(data.calm, `calm-${RUN}-${n}`),
  });
  calmLatency.add(r.timings.duration);
  calmAnswers.add(1);
  check(r, { 'calm: executed 201': (res) => res.status === 201 });
}

export function noisy(data) {
  // The control (NOISE_TARGET=healthz): as many requests, each answered without a token,
  // a quota or the ledger, to tell what the noise costs the machine from what the quota does.
  if (__ENV.NOISE_TARGET === 'healthz') {
    http.get(`${BASE_URL}/healthz`);
    noisyAnswers.add(1);
    return;
  }
  const n = exec.scenario.iterationInTest;
  const r = http.post(`${BASE_URL}/payments`, paymentBody(`noisy-${n}`, 100), {
    headers: headers(data.noisy, `noisy-${RUN}-${n}`),
  });
  noisyAnswers.add(1);
  if (r.status === 429) noisyLimited.add(1);
}

export function handleSummary(data) {
  const m = data.metrics;
  const calmD = m.calm_duration ? m.calm_duration.values : {};
  const checks = m.checks ? m.checks.values : {};
  const out = {
    calm_p50_ms: calmD.med || 0,
    calm_p99_ms: calmD['p(99)'] || 0,
    calm_ok_rate: checks.rate === undefined ? 0 : checks.rate,
    calm_requests: m.calm_answers ? m.calm_answers.values.count : 0,
    noisy_requests: m.noisy_answers ? m.noisy_answers.values.count : 0,
    noisy_limited: m.noisy_limited ? m.noisy_limited.values.count : 0,
  };
  const line = `noisy-tenant (${role || 'both'}, noise ${__ENV.NOISY === '1' || role === 'noise' ? 'on' : 'off'}): calm p99 ${out.calm_p99_ms.toFixed(2)} ms, ` +
    `calm ok ${(out.calm_ok_rate * 100).toFixed(2)}%, noisy ${out.noisy_requests} sent, ${out.noisy_limited} limited\n`;
  const files = { stdout: line };
  if (__ENV.SUMMARY) files[__ENV.SUMMARY] = JSON.stringify(out);
  return files;
}
