// Settle's HTTP API v1 for a platform's backend: one method per operation, typed answers, typed
// errors. No dependencies beyond Node >= 20's `fetch`.
import type {
  Account,
  AlertList,
  AutoTopUp,
  Audit,
  Event,
  EventPage,
  Grant,
  GrantList,
  Job,
  JobPage,
  LedgerEntry,
  LedgerPage,
  LimitList,
  NewLimit,
  TopUp,
  TopUpPage,
  Withdrawal,
  WithdrawalPage,
} from "./api-types.js";
import { InvalidId, SettleError, errorFor } from "./errors.js";
import { parseExact, stringifyExact } from "./json.js";

/** A create's answer: the resource, and whether it was a replay (the same id and body again:
 * `Idempotent-Replayed: true`, the resource as it is now). */
export type Created<T> = T & { replayed: boolean };

export interface ClientOptions {
  /** Settle's base URL, e.g. `http://127.0.0.1:7070`. */
  baseUrl: string;
  /** A bearer token (none in loopback mode; `undefined` as well, so `process.env.X` fits). */
  token?: string | undefined;
  /** Per-request timeout in milliseconds (default 40 s: longer than a 30 s long-poll). */
  timeoutMs?: number;
}

export interface NewJob {
  id: string;
  accountId: string;
  kind: string;
  /** A one-item job of this price (its item is `main`); or `hold`, or `items`. */
  cost?: number;
  /** A one-item job priced by what the work used: this much is held (charged) at create, the
   * worker's success says the price (at most the hold) and the rest is released. */
  hold?: number;
  /** Items and their prices (`cost`) or holds (`hold`), in order. */
  items?: Array<{ id: string; cost: number } | { id: string; hold: number }>;
  payload?: unknown;
  maxAttempts?: number;
  /** `failure` (default) or `final_failure`. */
  refundOn?: "failure" | "final_failure";
  /** RFC 3339: not claimed before then. */
  notBefore?: string;
  /** 0 to 100 (default 50): a lower number is claimed first; accounts take turns within one. */
  priority?: number;
  /** Labels a worker must have to claim it (`gpu:a100`), at most 8. */
  requires?: string[];
}

export interface JobFilter {
  state?: string;
  kind?: string;
  accountId?: string;
  failCode?: string;
}

const ID = /^[A-Za-z0-9_.:-]{1,128}$/;

/** An id as one URL path segment, refused unless it follows the API's id rule (URL clients remove
 * `.` and `..` segments, so `items/../succeed` would reach another route). */
function seg(what: string, id: string): string {
  if (typeof id !== "string" || !ID.test(id) || id === "." || id === "..") {
    throw new InvalidId(`the ${what} ${JSON.stringify(id)} is not an id: 1-128 characters of [A-Za-z0-9_.:-], and not '.' or '..'`);
  }
  return id;
}

function query(params: Record<string, string | number | undefined>): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined) q.set(k, String(v));
  const s = q.toString();
  return s ? `?${s}` : "";
}

export class Settle {
  readonly #base: string;
  readonly #token: string | undefined;
  readonly #timeoutMs: number;

  constructor(options: ClientOptions) {
    this.#base = options.baseUrl.replace(/\/+$/, "");
    this.#token = options.token;
    this.#timeoutMs = options.timeoutMs ?? 40_000;
  }

  async #call<T>(
    method: string,
    path: string,
    body?: unknown,
    extra: { waitMs?: number; signal?: AbortSignal | undefined } = {},
  ): Promise<{ value: T; replayed: boolean }> {
    const headers: Record<string, string> = { accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (this.#token) headers.authorization = `Bearer ${this.#token}`;
    // A long-poll may wait its whole `wait_seconds` before answering.
    const timeout = AbortSignal.timeout(this.#timeoutMs + (extra.waitMs ?? 0));
    const signal = extra.signal ? AbortSignal.any([timeout, extra.signal]) : timeout;
    const init: RequestInit = { method, headers, signal };
    if (body !== undefined) init.body = stringifyExact(body);
    const r = await fetch(this.#base + path, init);
    const text = await r.text();
    if (!r.ok) {
      let parsed: unknown = {};
      try {
        parsed = text ? JSON.parse(text) : {};
      } catch {
        // not Settle's answer (a proxy's page): the status decides
      }
      throw errorFor(r.status, parsed, r.headers.get("retry-after"));
    }
    const parsed = text ? parseExact(text) : {};
    return { value: parsed as T, replayed: r.headers.get("idempotent-replayed") === "true" };
  }

  async #create<T>(path: string, body: unknown): Promise<Created<T>> {
    const { value, replayed } = await this.#call<T>("POST", path, body);
    return Object.assign(value as object, { replayed }) as Created<T>;
  }

  async #get<T>(path: string): Promise<T> {
    return (await this.#call<T>("GET", path)).value;
  }

  // ----- accounts and ledgers -----

  /** `maxRunning`: the most of the account's jobs that may run at once (no cap when absent). */
  async createAccount(id: string, overdraftLimit?: number, maxRunning?: number): Promise<Created<Account>> {
    return this.#create("/v1/accounts", {
      id,
      ...(overdraftLimit === undefined ? {} : { overdraft_limit: overdraftLimit }),
      ...(maxRunning === undefined ? {} : { max_running: maxRunning }),
    });
  }

  /** Sets what is given and keeps the rest: `max_running: null` removes the account's cap. */
  async updateAccount(id: string, changes: { overdraft_limit?: number; max_running?: number | null }): Promise<Account> {
    return (await this.#call<Account>("PATCH", `/v1/accounts/${seg("account id", id)}`, changes)).value;
  }

  async account(id: string): Promise<Account> {
    return this.#get(`/v1/accounts/${seg("account id", id)}`);
  }

  /** Replaces the account's balance alerts (at most 16; `[]` removes them). Each fires
   * `account.balance_low` once when a posting takes the balance under `below`, and
   * `account.balance_recovered` once when one takes it back; setting them fires nothing. */
  async setAlerts(accountId: string, alerts: { id: string; below: number }[]): Promise<AlertList> {
    return (await this.#call<AlertList>("PUT", `/v1/accounts/${seg("account id", accountId)}/alerts`, { alerts })).value;
  }

  async alerts(accountId: string): Promise<AlertList> {
    return this.#get(`/v1/accounts/${seg("account id", accountId)}/alerts`);
  }

  /** Replaces the account's spend limits (at most 16; `[]` removes them): each bounds what a UTC
   * `day` or `month` may spend through creates on its `kinds` (none: every kind but withdrawal).
   * A create past one is refused with `SpendLimitExceeded`, having written nothing. */
  async setLimits(accountId: string, limits: NewLimit[]): Promise<LimitList> {
    return (await this.#call<LimitList>("PUT", `/v1/accounts/${seg("account id", accountId)}/limits`, { limits })).value;
  }

  async limits(accountId: string): Promise<LimitList> {
    return this.#get(`/v1/accounts/${seg("account id", accountId)}/limits`);
  }

  /** Credits an account; grant ids are unique across all accounts. `expires_at` (RFC 3339, in the
   * future): what is left then expires; `priority` (0-100, default 50): charges take from the
   * lowest first, then the soonest expiry, then the oldest grant. */
  async grant(
    accountId: string,
    grant: { id: string; amount: number; reason?: string; expires_at?: string; priority?: number },
  ): Promise<Created<LedgerEntry>> {
    return this.#create(`/v1/accounts/${seg("account id", accountId)}/grants`, grant);
  }

  /** One page of an account's grants in the order they were made, after `after`. */
  async grantsPage(accountId: string, after = 0, limit?: number): Promise<GrantList> {
    return this.#get(`/v1/accounts/${seg("account id", accountId)}/grants${query({ after, limit })}`);
  }

  /** Every grant of an account — what each has left, its priority, its expiry — page by page. */
  async *grants(accountId: string, after = 0): AsyncGenerator<Grant> {
    let cursor: number | null | undefined = after;
    while (cursor !== null && cursor !== undefined) {
      const page: GrantList = await this.grantsPage(accountId, cursor);
      yield* page.grants;
      cursor = page.next_after;
    }
  }

  /** An admin's signed correction, with its reason. */
  async adjust(accountId: string, adjustment: { id: string; amount: number; reason: string }): Promise<Created<LedgerEntry>> {
    return this.#create(`/v1/accounts/${seg("account id", accountId)}/adjustments`, adjustment);
  }

  /** One page of an account's entries in `seq` order, after `after`. */
  async ledgerPage(accountId: string, after = 0, limit?: number): Promise<LedgerPage> {
    return this.#get(`/v1/accounts/${seg("account id", accountId)}/ledger${query({ after, limit })}`);
  }

  /** Every entry of an account, page by page. */
  async *ledger(accountId: string, after = 0): AsyncGenerator<LedgerEntry> {
    let cursor: number | null | undefined = after;
    while (cursor !== null && cursor !== undefined) {
      const page: LedgerPage = await this.ledgerPage(accountId, cursor);
      yield* page.entries;
      cursor = page.next_after;
    }
  }

  // ----- jobs -----

  /** Creates a job and charges every item up front (`402` writes nothing). Idempotent by id. */
  async createJob(job: NewJob): Promise<Created<Job>> {
    const body: Record<string, unknown> = { id: job.id, account_id: job.accountId, kind: job.kind };
    if (job.cost !== undefined) body.cost = job.cost;
    if (job.hold !== undefined) body.hold = job.hold;
    if (job.items !== undefined) body.items = job.items;
    if (job.payload !== undefined) body.payload = job.payload;
    if (job.maxAttempts !== undefined) body.max_attempts = job.maxAttempts;
    if (job.refundOn !== undefined) body.refund_on = job.refundOn;
    if (job.notBefore !== undefined) body.not_before = job.notBefore;
    if (job.priority !== undefined) body.priority = job.priority;
    if (job.requires !== undefined) body.requires = job.requires;
    return this.#create("/v1/jobs", body);
  }

  async job(id: string): Promise<Job> {
    return this.#get(`/v1/jobs/${seg("job id", id)}`);
  }

  /** Every job the filter matches, page by page. */
  async *jobs(filter: JobFilter = {}): AsyncGenerator<Job> {
    let after: number | null | undefined = 0;
    while (after !== null && after !== undefined) {
      const q = query({ state: filter.state, kind: filter.kind, account_id: filter.accountId, fail_code: filter.failCode, after });
      const page: JobPage = await this.#get(`/v1/jobs${q}`);
      yield* page.jobs;
      after = page.next_after;
    }
  }

  /** A queued job is cancelled at once (refunded); a running one gets a cancel request. */
  async cancel(id: string): Promise<Job> {
    return (await this.#call<Job>("POST", `/v1/jobs/${seg("job id", id)}/cancel`)).value;
  }

  /** Puts a dead job back in line with a fresh attempt budget (admin). */
  async requeue(id: string): Promise<Job> {
    return (await this.#call<Job>("POST", `/v1/jobs/${seg("job id", id)}/requeue`)).value;
  }

  // ----- withdrawals -----

  /** Holds `amount` (from the balance, never the overdraft) and pays it out through the provider. */
  async createWithdrawal(w: { id: string; accountId: string; amount: number; destination: string }): Promise<Created<Withdrawal>> {
    return this.#create("/v1/withdrawals", { id: w.id, account_id: w.accountId, amount: w.amount, destination: w.destination });
  }

  async withdrawal(id: string): Promise<Withdrawal> {
    return this.#get(`/v1/withdrawals/${seg("withdrawal id", id)}`);
  }

  async *withdrawals(filter: { state?: string; accountId?: string } = {}): AsyncGenerator<Withdrawal> {
    let after: number | null | undefined = 0;
    while (after !== null && after !== undefined) {
      const page: WithdrawalPage = await this.#get(`/v1/withdrawals${query({ state: filter.state, account_id: filter.accountId, after })}`);
      yield* page.withdrawals;
      after = page.next_after;
    }
  }

  // ----- top-ups -----

  /** Buys `credits` for `price` minor units of `currency`, charged to the funding provider's
   * `customer`. Nothing is charged to the account; the credits are granted (under the top-up's id)
   * once the provider confirms the charge. Idempotent by `id`. */
  async createTopUp(t: {
    id: string;
    accountId: string;
    credits: number;
    price: number;
    currency: string;
    customer: string;
  }): Promise<Created<TopUp>> {
    return this.#create("/v1/top-ups", {
      id: t.id,
      account_id: t.accountId,
      credits: t.credits,
      price: t.price,
      currency: t.currency,
      customer: t.customer,
    });
  }

  async topUp(id: string): Promise<TopUp> {
    return this.#get(`/v1/top-ups/${seg("top-up id", id)}`);
  }

  async *topUps(filter: { state?: string; accountId?: string } = {}): AsyncGenerator<TopUp> {
    let after: number | null | undefined = 0;
    while (after !== null && after !== undefined) {
      const page: TopUpPage = await this.#get(`/v1/top-ups${query({ state: filter.state, account_id: filter.accountId, after })}`);
      yield* page.top_ups;
      after = page.next_after;
    }
  }

  /** The account's one auto top-up rule: a posting that takes the balance under `below` buys
   * `credits`, unless a top-up is in flight or the month's count would pass `monthlyCreditsMax`.
   * Putting it turns a paused rule on again; it fires nothing by itself. */
  async setAutoTopUp(
    accountId: string,
    rule: { below: number; credits: number; price: number; currency: string; customer: string; monthlyCreditsMax: number },
  ): Promise<AutoTopUp> {
    const body = {
      below: rule.below,
      credits: rule.credits,
      price: rule.price,
      currency: rule.currency,
      customer: rule.customer,
      monthly_credits_max: rule.monthlyCreditsMax,
    };
    return (await this.#call<AutoTopUp>("PUT", `/v1/accounts/${seg("account id", accountId)}/auto-top-up`, body)).value;
  }

  async autoTopUp(accountId: string): Promise<AutoTopUp> {
    return this.#get(`/v1/accounts/${seg("account id", accountId)}/auto-top-up`);
  }

  /** Removes the rule (a top-up it made goes on). */
  async deleteAutoTopUp(accountId: string): Promise<void> {
    await this.#call<unknown>("DELETE", `/v1/accounts/${seg("account id", accountId)}/auto-top-up`);
  }

  // ----- events and audit -----

  /** One page of the event feed after `after`; with `waitSeconds`, a long-poll for the next. */
  async events(after = 0, options: { limit?: number; waitSeconds?: number; signal?: AbortSignal } = {}): Promise<EventPage> {
    const path = `/v1/events${query({ after, limit: options.limit, wait_seconds: options.waitSeconds })}`;
    const extra = { waitMs: (options.waitSeconds ?? 0) * 1000, signal: options.signal };
    return (await this.#call<EventPage>("GET", path, undefined, extra)).value;
  }

  /** The event feed from `after` on, for ever, long-polling for what comes next (stop with
   * `break`, or with `signal`). After a restore (a cursor past the store's last event) it goes on
   * from where the new epoch begins. */
  async *iterEvents(after = 0, options: { waitSeconds?: number; signal?: AbortSignal } = {}): AsyncGenerator<Event> {
    let cursor = after;
    const signal = options.signal;
    while (!signal?.aborted) {
      let page: EventPage;
      try {
        page = await this.events(cursor, { waitSeconds: options.waitSeconds ?? 30, ...(signal ? { signal } : {}) });
      } catch (e) {
        if (signal?.aborted) return;
        // The store was restored from a backup: go on from where its new epoch begins (receivers
        // deduplicate by (epoch, seq)).
        if (e instanceof SettleError && e.code === "cursor_ahead" && typeof e.details?.restart_after === "number") {
          cursor = e.details.restart_after;
          continue;
        }
        throw e;
      }
      for (const e of page.events) {
        cursor = e.seq;
        yield e;
      }
      // An empty page answered at once (no wait, or the token's long-polls are all taken): pause
      // rather than ask again at once.
      if (page.events.length === 0) await new Promise((r) => setTimeout(r, 500));
    }
  }

  /** The ledger invariants L1–L6 over one snapshot (admin). */
  async audit(): Promise<Audit> {
    return this.#get("/v1/audit");
  }
}
