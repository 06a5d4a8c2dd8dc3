// The package against a real `settle serve` (SQLite by default; PostgreSQL with SETTLE_TS_TESTS_DB).
import assert from "node:assert/strict";
import { createServer, type IncomingMessage } from "node:http";
import { readFile } from "node:fs/promises";
import { after, before, test } from "node:test";
import {
  Forbidden,
  IdempotencyConflict,
  InsufficientCredits,
  InvalidRequest,
  InvalidId,
  NotFound,
  Settle,
  SignatureError,
  SpendLimitExceeded,
  Unauthorized,
  Unavailable,
  errorFor,
  parseExact,
  sign,
  verifyWebhook,
} from "../src/index.js";
import { ADMIN, CLIENT, HOOK_SECRET, serve, type Served } from "./server.js";
// @ts-expect-error: a plain ES module without types (the generator the package ships).
import { generate } from "../../scripts/gen-types.mjs";

interface Delivery {
  headers: IncomingMessage["headers"];
  body: Buffer;
}
const deliveries: Delivery[] = [];
const hooks = createServer((req, res) => {
  const chunks: Buffer[] = [];
  req.on("data", (c: Buffer) => chunks.push(c));
  req.on("end", () => {
    deliveries.push({ headers: req.headers, body: Buffer.concat(chunks) });
    res.writeHead(204).end();
  });
});
let server: Served;
let admin: Settle;

before(async () => {
  await new Promise<void>((ok) => hooks.listen(0, "127.0.0.1", ok));
  const port = (hooks.address() as { port: number }).port;
  server = await serve(`http://127.0.0.1:${port}/hook`);
  admin = new Settle({ baseUrl: server.base, token: ADMIN });
});

after(async () => {
  await server.stop();
  hooks.close();
});

test("a Node backend charges for a job in ten lines", async () => {
  // The README's example, as written there.
  const settle = new Settle({ baseUrl: server.base, token: ADMIN });
  await settle.createAccount("alice");
  await settle.grant("alice", { id: "welcome-alice", amount: 100 });
  const job = await settle.createJob({ id: "render-1", accountId: "alice", kind: "render", cost: 40 });
  assert.equal(job.state, "queued");
  assert.equal((await settle.account("alice")).balance, 60);
  // The same create again is a replay: the job as it is now, charged once.
  const again = await settle.createJob({ id: "render-1", accountId: "alice", kind: "render", cost: 40 });
  assert.equal(again.replayed, true);
  assert.equal(job.replayed, false);
  assert.equal((await settle.account("alice")).balance, 60);
  // A cancel of the queued job refunds it at once.
  assert.equal((await settle.cancel("render-1")).state, "cancelled");
  const kinds = [];
  for await (const e of settle.ledger("alice")) kinds.push(`${e.kind} ${e.amount}`);
  assert.deepEqual(kinds, ["grant 100", "charge -40", "refund 40"]);
  assert.equal((await settle.audit()).ok, true);
});

test("a job carries its priority and the labels a worker needs", async () => {
  await admin.createAccount("liney");
  await admin.grant("liney", { id: "welcome-liney", amount: 10 });
  const job = await admin.createJob({ id: "gpu-eu", accountId: "liney", kind: "render", cost: 1, priority: 7, requires: ["region:eu", "gpu:a100"] });
  assert.equal(job.priority, 7);
  assert.deepEqual(job.requires, ["gpu:a100", "region:eu"]);
  assert.equal((await admin.job("gpu-eu")).priority, 7);
  await assert.rejects(admin.createJob({ id: "gpu-bad", accountId: "liney", kind: "render", cost: 1, priority: 101 }), /priority/i);
});

test("an account's cap is set, changed and removed", async () => {
  const made = await admin.createAccount("cappy", undefined, 2);
  assert.equal(made.max_running, 2);
  assert.equal((await admin.updateAccount("cappy", { max_running: 1 })).max_running, 1);
  const kept = await admin.updateAccount("cappy", { overdraft_limit: 3 });
  assert.deepEqual([kept.overdraft_limit, kept.max_running], [3, 1]);
  assert.equal((await admin.updateAccount("cappy", { max_running: null })).max_running, null);
  await assert.rejects(admin.updateAccount("cappy", { max_running: 10001 }), /max_running/i);
});

test("balance alerts fire once per crossing", async () => {
  await admin.createAccount("alerty");
  await admin.grant("alerty", { id: "g-alerty", amount: 1000 });
  const from = (await admin.events(0, { limit: 1000 })).next_after ?? 0;
  const set = await admin.setAlerts("alerty", [{ id: "low", below: 500 }]);
  assert.deepEqual(set, { alerts: [{ id: "low", below: 500, side: "above" }] });
  for (let n = 0; n < 4; n++) await admin.createJob({ id: `alerty-${n}`, accountId: "alerty", kind: "render", cost: 200 });
  await admin.grant("alerty", { id: "top-alerty", amount: 500 });
  const seen = (await admin.events(from, { limit: 1000 })).events
    .filter((e) => e.account_id === "alerty" && e.type.startsWith("account.balance_"))
    .map((e) => `${e.type} ${(e.data as { balance_after: number }).balance_after}`);
  assert.deepEqual(seen, ["account.balance_low 400", "account.balance_recovered 700"]);
  assert.equal((await admin.alerts("alerty")).alerts[0]?.side, "above");
  await assert.rejects(admin.setAlerts("alerty", [{ id: "zero", below: 0 }]), /below/);
});

test("a spend limit refuses a create past it, and writes nothing", async () => {
  await admin.createAccount("limity");
  await admin.grant("limity", { id: "g-limity", amount: 1000 });
  const set = await admin.setLimits("limity", [{ period: "day", amount: 100, kinds: ["render"] }]);
  assert.deepEqual(set.limits.map((l) => `${l.period} ${l.amount} ${l.kinds.join(",")} ${l.spent}`), ["day 100 render 0"]);
  await admin.createJob({ id: "limity-1", accountId: "limity", kind: "render", cost: 70 });
  await assert.rejects(admin.createJob({ id: "limity-2", accountId: "limity", kind: "render", cost: 31 }), (e: unknown) => {
    assert.ok(e instanceof SpendLimitExceeded);
    assert.equal(e.status, 402);
    assert.deepEqual([e.details?.spent, e.details?.remaining, e.details?.needed], [70, 30, 31]);
    return true;
  });
  await assert.rejects(admin.job("limity-2"), NotFound);
  await admin.createJob({ id: "limity-2", accountId: "limity", kind: "render", cost: 30 });
  assert.equal((await admin.limits("limity")).limits[0]?.spent, 100);
  await assert.rejects(admin.setLimits("limity", [{ period: "week", amount: 5 }]), InvalidRequest);
});

test("a top-up is granted once its charge is confirmed; a declined card is not", async () => {
  await admin.createAccount("buyer");
  const t = await admin.createTopUp({ id: "buy-1", accountId: "buyer", credits: 500, price: 499, currency: "eur", customer: "cus_b" });
  assert.deepEqual([t.kind, t.credits, t.currency, t.grant_id, t.replayed], ["top_up", 500, "EUR", null, false]);
  await admin.createTopUp({ id: "buy-2", accountId: "buyer", credits: 300, price: 299, currency: "EUR", customer: "declined-b" });
  const deadline = Date.now() + 20_000;
  let states: Record<string, string> = {};
  while (Date.now() < deadline) {
    states = {};
    for await (const x of admin.topUps({ accountId: "buyer" })) states[x.id] = x.state;
    if (states["buy-1"] === "succeeded" && states["buy-2"] === "dead") break;
    await new Promise((r) => setTimeout(r, 100));
  }
  const paid = await admin.topUp("buy-1");
  assert.deepEqual([paid.state, paid.grant_id], ["succeeded", "buy-1"]);
  assert.ok(paid.provider_charge_id);
  const declined = await admin.topUp("buy-2");
  assert.deepEqual([declined.state, declined.last_error?.code, declined.grant_id], ["dead", "CARD_DECLINED", null]);
  assert.equal((await admin.account("buyer")).balance, 500);
  await assert.rejects(
    admin.createTopUp({ id: "buy-3", accountId: "buyer", credits: 5, price: 1, currency: "XXX", customer: "c" }),
    InvalidRequest,
  );
});

test("an auto top-up rule buys when a charge crosses it", async () => {
  await admin.createAccount("ruled");
  await admin.grant("ruled", { id: "g-ruled", amount: 1000 });
  const rule = await admin.setAutoTopUp("ruled", { below: 500, credits: 1000, price: 999, currency: "usd", customer: "cus_r", monthlyCreditsMax: 5000 });
  assert.deepEqual([rule.state, rule.currency, rule.credits_this_month], ["active", "USD", 0]);
  await admin.createJob({ id: "ruled-1", accountId: "ruled", kind: "render", cost: 600 });
  const deadline = Date.now() + 20_000;
  while (Date.now() < deadline && (await admin.account("ruled")).balance !== 1400) await new Promise((r) => setTimeout(r, 100));
  assert.equal((await admin.account("ruled")).balance, 1400);
  assert.equal((await admin.autoTopUp("ruled")).credits_this_month, 1000);
  await admin.deleteAutoTopUp("ruled");
  await assert.rejects(admin.autoTopUp("ruled"), NotFound);
});

test("a held job is charged its hold, and a cancel refunds the hold", async () => {
  await admin.createAccount("heldy");
  await admin.grant("heldy", { id: "welcome-heldy", amount: 100 });
  const job = await admin.createJob({ id: "gpu-1", accountId: "heldy", kind: "render", hold: 60 });
  assert.equal(job.hold, 60);
  assert.equal(job.cost, null, "priced only by the worker's success");
  assert.equal(job.items[0]?.cost, null);
  assert.equal((await admin.account("heldy")).balance, 40);
  const mixed = await admin.createJob({ id: "gpu-2", accountId: "heldy", kind: "render", items: [{ id: "a", cost: 5 }, { id: "b", hold: 10 }] });
  assert.equal(mixed.hold, 10);
  assert.equal((await admin.cancel("gpu-1")).state, "cancelled");
  assert.equal((await admin.account("heldy")).balance, 85);
});

test("a trial grant is spent first and listed with what it has left", async () => {
  await admin.createAccount("trialy");
  await admin.grant("trialy", { id: "pack-trialy", amount: 100 });
  const expires = new Date(Date.now() + 3_600_000).toISOString();
  await admin.grant("trialy", { id: "trial-trialy", amount: 50, expires_at: expires, priority: 10 });
  await admin.createJob({ id: "clip-t", accountId: "trialy", kind: "render", cost: 30 });
  const grants = [];
  for await (const g of admin.grants("trialy")) grants.push(`${g.id} ${g.remaining}/${g.amount} ${g.state} p${g.priority}`);
  assert.deepEqual(grants, ["pack-trialy 100/100 active p50", "trial-trialy 20/50 active p10"]);
  await assert.rejects(admin.grant("trialy", { id: "late", amount: 5, expires_at: "2001-01-01T00:00:00Z" }), /future/);
});

test("errors are typed and carry the API code; bad ids are never sent", async () => {
  await admin.createAccount("bob");
  await admin.grant("bob", { id: "welcome-bob", amount: 10 });
  await assert.rejects(admin.createJob({ id: "big", accountId: "bob", kind: "render", cost: 1_000 }), (e: unknown) => {
    assert.ok(e instanceof InsufficientCredits);
    assert.equal(e.status, 402);
    assert.equal(e.code, "insufficient_credits");
    return true;
  });
  await admin.createJob({ id: "small", accountId: "bob", kind: "render", cost: 5 });
  await assert.rejects(admin.createJob({ id: "small", accountId: "bob", kind: "render", cost: 6 }), IdempotencyConflict);
  await assert.rejects(admin.account("nobody"), NotFound);
  await assert.rejects(admin.job(".."), InvalidId);
  await assert.rejects(new Settle({ baseUrl: server.base, token: "not-a-token-0123456789" }).account("bob"), Unauthorized);
  await assert.rejects(new Settle({ baseUrl: server.base, token: CLIENT }).createAccount("eve"), Forbidden);
  assert.equal((await admin.account("bob")).balance, 5, "nothing was written by the refused requests");
});

test("withdrawals are held from the balance and listed", async () => {
  await admin.createAccount("carol", 1_000);
  await admin.grant("carol", { id: "welcome-carol", amount: 50 });
  // Never on the overdraft.
  await assert.rejects(admin.createWithdrawal({ id: "w-big", accountId: "carol", amount: 60, destination: "iban-1" }), InsufficientCredits);
  const w = await admin.createWithdrawal({ id: "w-1", accountId: "carol", amount: 20, destination: "iban-1" });
  assert.equal(w.replayed, false);
  assert.equal(w.amount, 20);
  assert.equal((await admin.account("carol")).balance, 30);
  const listed = [];
  for await (const x of admin.withdrawals({ accountId: "carol" })) listed.push(x.id);
  assert.deepEqual(listed, ["w-1"]);
  assert.equal((await admin.withdrawal("w-1")).destination, "iban-1");
});

test("the event feed long-polls for what comes next", async () => {
  const start = (await admin.events(0, { limit: 1000 })).events.at(-1)?.seq ?? 0;
  const controller = new AbortController();
  const seen: string[] = [];
  const reading = (async () => {
    for await (const e of admin.iterEvents(start, { waitSeconds: 5, signal: controller.signal })) {
      seen.push(e.type);
      if (e.type === "account.granted") {
        controller.abort();
        break;
      }
    }
  })();
  await new Promise((r) => setTimeout(r, 200));
  await admin.createAccount("dave");
  await admin.grant("dave", { id: "welcome-dave", amount: 1 });
  await reading;
  assert.ok(seen.includes("account.granted"), seen.join(","));
});

test("webhook deliveries verify; a forged or stale one does not", async () => {
  for (let i = 0; i < 100 && deliveries.length === 0; i++) await new Promise((r) => setTimeout(r, 100));
  const d = deliveries[0];
  assert.ok(d, "settle serve delivered an event");
  verifyWebhook(HOOK_SECRET, d.headers as Record<string, string>, d.body);
  const event = JSON.parse(d.body.toString("utf8")) as { seq: number; type: string };
  assert.equal(typeof event.seq, "number");
  assert.throws(() => verifyWebhook("another-secret-0123456", d.headers as Record<string, string>, d.body), SignatureError);
  const tampered = Buffer.from(d.body.toString("utf8").replace('"seq":', '"seq": '));
  assert.throws(() => verifyWebhook(HOOK_SECRET, d.headers as Record<string, string>, tampered), SignatureError);
  const body = '{"seq":1}';
  const old = sign(HOOK_SECRET, body, Math.floor(Date.now() / 1000) - 3_600);
  assert.throws(() => verifyWebhook(HOOK_SECRET, { "settle-signature": old }, body), SignatureError);
  const fresh = new Headers({ "Settle-Signature": sign(HOOK_SECRET, body, Math.floor(Date.now() / 1000)) });
  verifyWebhook(HOOK_SECRET, fresh, body);
  // A tolerance or clock that is not a number never turns the timestamp check off.
  const ancient = { "settle-signature": sign(HOOK_SECRET, body, 1) };
  assert.throws(() => verifyWebhook(HOOK_SECRET, ancient, body, { toleranceSeconds: Number.NaN }), SignatureError);
  assert.throws(() => verifyWebhook(HOOK_SECRET, ancient, body, { now: Number.NaN }), SignatureError);
});

test("credits beyond 2^53 are refused, never rounded", async () => {
  assert.throws(() => parseExact('{"balance": 9007199254740993}'), RangeError);
  assert.deepEqual(parseExact('{"id": "9007199254740993", "n": 9007199254740991}'), { id: "9007199254740993", n: 9007199254740991 });
  // Free-form JSON (a payload) is not credits: parsed as JSON.parse does, the page not refused.
  const job = await admin.createJob({ id: "big-payload", accountId: "dave", kind: "render", cost: 1, payload: { frame: 1 } });
  assert.equal(job.state, "queued");
  assert.doesNotThrow(() => parseExact('{"payload": {"frame": 1152921504606846976}, "cost": 1}'));
  await assert.rejects(admin.grant("dave", { id: "huge", amount: 2 ** 60 }), RangeError);
  // A balance the server holds exactly but a JavaScript number cannot: refused on reading.
  await admin.createAccount("erin");
  const r = await fetch(`${server.base}/v1/accounts/erin/grants`, {
    method: "POST",
    headers: { authorization: `Bearer ${ADMIN}`, "content-type": "application/json" },
    body: '{"id": "huge-erin", "amount": 1152921504606846976}',
  });
  assert.equal(r.status, 201);
  await assert.rejects(admin.account("erin"), RangeError);
});

test("an answer that is not Settle's (a proxy's page) keeps its status", () => {
  const e = errorFor(502, {}, "2");
  assert.ok(e instanceof Unavailable);
  assert.equal(e.retryAfter, 2);
  assert.equal(errorFor(409, { error: { code: "constructor", message: "m" } }, null).code, "constructor");
});

test("the package's types are what /openapi.json says", async () => {
  const doc = await (await fetch(`${server.base}/openapi.json`)).json();
  const committed = await readFile(new URL("../../src/api-types.ts", import.meta.url), "utf8");
  assert.equal(generate(doc), committed, "src/api-types.ts drifted from /openapi.json: run npm run gen-types");
});
