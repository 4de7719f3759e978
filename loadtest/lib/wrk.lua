-- wrk driver for loadtest/bench. Environment:
--   MODE   = new | replay | direct | static | healthz | peer
--   TOKEN  = bearer token (idemgate modes); KEYS = replay key count; RUN = run id
local mode = os.getenv("MODE") or "new"
local token = os.getenv("TOKEN") or ""
local keys = tonumber(os.getenv("KEYS") or "20")
local run = os.getenv("RUN") or "run"
local body = '{"orderId": "order-1", "amountUah": 100}'
local threads = {}
local counter = 0
-- `id` is set per thread by setup() (a global: thread:set writes globals), so keys
-- from different threads never collide.
id = 0

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function request()
  counter = counter + 1
  local h = { ["Content-Type"] = "application/json" }
  if mode == "new" then
    h["Authorization"] = "Bearer " .. token
    h["Idempotency-Key"] = string.format("bench-%s-%d-%d", run, id, counter)
  elseif mode == "replay" then
    h["Authorization"] = "Bearer " .. token
    h["Idempotency-Key"] = string.format("replay-%s-%d", run, counter % keys)
  elseif mode == "direct" then
    h["X-Tenant-Id"] = "bench"
    h["Idempotency-Key"] = string.format("direct-%s-%d-%d", run, id, counter)
  elseif mode == "healthz" then
    return wrk.format("GET", "/healthz")
  elseif mode == "peer" then
    -- idempotent-proxy-server: the upstream named by its URL_PAYMENTS variable, the key in
    -- Idempotency-Key, the tenant header passed on to the demo as in `direct`.
    h["X-Tenant-Id"] = "bench"
    h["Idempotency-Key"] = string.format("peer-%s-%d-%d", run, id, counter)
    return wrk.format("POST", "/URL_PAYMENTS", h, body)
  end
  return wrk.format("POST", "/payments", h, body)
end

function done(summary, latency, requests)
  local non2xx = summary.errors.status
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout + non2xx))
end
