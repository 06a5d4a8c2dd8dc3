-- wrk script for scripts/bench-http: the seed-000 story on repeat, one connection per wrk thread
-- (run wrk with -t N -c N), so each thread's requests and answers alternate strictly.
--   create a job (charge) -> claim it (claim) -> fail it TIMEOUT, not retryable (refund)
--   -> the late success with the same lease token (reclaim)
-- Each 2xx answer of those four is one guarded transition. Accounts bench-1..bench-N must exist
-- with enough credit; BENCH_RUN (an env var) keeps job ids unique across runs on one database.
-- BENCH_ACCOUNT=bench-1 puts every thread's jobs on that one account (a big customer's batch).
-- BENCH_STORY=roundtrip plays the queue's round trip instead: create -> claim -> succeed.
-- BENCH_MIX=1 (with the round trip) spreads the jobs over the 64 accounts and three priorities
-- (10, 50, 90 in turn): the multi-tenant queue's claim (issue 44) beside the plain one.
-- BENCH_BATCH=K (with the round trip) is a worker that takes K at a time: K creates, one claim of
-- limit K, then the successes of what it claimed in one POST /v1/reports (decision 0041), or with
-- BENCH_SINGLE=1 one succeed request each (the claim's batching without the report's).

local threads = {}
local counter = 0

function setup(thread)
  counter = counter + 1
  thread:set("tid", counter)
  table.insert(threads, thread)
end

local step, n, job, token = 0, 0, nil, nil
transitions, errors, empty = 0, 0, 0
local run = os.getenv("BENCH_RUN") or "0"
local one_account = os.getenv("BENCH_ACCOUNT")
local roundtrip = os.getenv("BENCH_STORY") == "roundtrip"
local mix = os.getenv("BENCH_MIX") == "1"
local batch = tonumber(os.getenv("BENCH_BATCH") or "1")
local single = os.getenv("BENCH_SINGLE") == "1"
local created, held = 0, {}
local priorities = { 10, 50, 90 }
jobs_done = 0
local headers = { ["Content-Type"] = "application/json" }

function request()
  if step == 0 then
    n = n + 1
    local account = one_account or string.format("bench-%d", tid)
    local extra = ""
    if mix then
      account = string.format("bench-%d", (tid * 7 + n) % 64 + 1)
      extra = string.format(',"priority":%d', priorities[n % 3 + 1])
    end
    local body = string.format(
      '{"id":"r%s-t%d-%d","account_id":"%s","kind":"render","cost":10,"max_attempts":1%s}', run, tid, n, account, extra)
    return wrk.format("POST", "/v1/jobs", headers, body)
  elseif step == 1 then
    return wrk.format("POST", "/v1/claims", headers,
      string.format('{"worker":"w%d","kinds":["render"],"limit":%d,"lease_seconds":600}', tid, batch))
  elseif step == 4 then
    local parts = {}
    for i, h in ipairs(held) do
      parts[i] = string.format('{"job_id":"%s","outcome":"succeed","lease_token":"%s"}', h[1], h[2])
    end
    return wrk.format("POST", "/v1/reports", headers, '{"reports":[' .. table.concat(parts, ",") .. ']}')
  elseif step == 5 then
    local h = held[#held]
    return wrk.format("POST", "/v1/jobs/" .. h[1] .. "/succeed", headers, '{"lease_token":"' .. h[2] .. '"}')
  elseif step == 2 then
    return wrk.format("POST", "/v1/jobs/" .. job .. "/fail", headers,
      '{"lease_token":"' .. token .. '","code":"TIMEOUT","retryable":false}')
  else
    return wrk.format("POST", "/v1/jobs/" .. job .. "/succeed", headers, '{"lease_token":"' .. token .. '"}')
  end
end

function response(status, hdrs, body)
  if status < 200 or status > 299 then
    errors = errors + 1
    if errors <= 3 then io.stderr:write("bench-http: " .. status .. " " .. body .. "\n") end
    step = 0
    return
  end
  if step == 0 then
    transitions = transitions + 1
    created = created + 1
    if created >= batch then
      created = 0
      step = 1
    end
  elseif step == 1 and batch > 1 then
    -- Job ids start with "r"; item ids ("main") and account ids do not follow a quote-id-quote.
    held = {}
    local tokens = {}
    for t in string.gmatch(body, '"lease_token":"([^"]+)"') do table.insert(tokens, t) end
    local i = 0
    for id in string.gmatch(body, '"id":"(r[^"]+)"') do
      i = i + 1
      table.insert(held, { id, tokens[i] })
    end
    transitions = transitions + #held
    if #held == 0 then
      empty = empty + 1
      step = 0
    else
      step = single and 5 or 4
    end
  elseif step == 4 then
    for _ in string.gmatch(body, '"status":200') do
      transitions = transitions + 1
      jobs_done = jobs_done + 1
    end
    step = 0
  elseif step == 5 then
    transitions = transitions + 1
    jobs_done = jobs_done + 1
    table.remove(held)
    if #held == 0 then step = 0 end
  elseif step == 1 then
    job = string.match(body, '"id":"([^"]+)"')
    token = string.match(body, '"lease_token":"([^"]+)"')
    if job and token then
      transitions = transitions + 1
      step = roundtrip and 3 or 2
    else
      empty = empty + 1
      step = 0
    end
  elseif step == 2 then
    transitions = transitions + 1
    step = 3
  else
    transitions = transitions + 1
    jobs_done = jobs_done + 1
    step = 0
  end
end

function done(summary, latency, requests)
  local t, e, m, j = 0, 0, 0, 0
  for _, thread in ipairs(threads) do
    t = t + thread:get("transitions")
    e = e + thread:get("errors")
    m = m + thread:get("empty")
    j = j + thread:get("jobs_done")
  end
  local secs = summary.duration / 1e6
  io.write(string.format("RESULT transitions=%d seconds=%.3f rate=%.1f p50_ms=%.2f p99_ms=%.2f errors=%d empty_claims=%d requests=%d jobs_per_s=%.1f\n",
    t, secs, t / secs, latency:percentile(50) / 1000, latency:percentile(99) / 1000, e, m, summary.requests, j / secs))
end
