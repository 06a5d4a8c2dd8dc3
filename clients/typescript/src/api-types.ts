// Generated from Settle's /openapi.json by scripts/gen-types.mjs: do not edit by hand.
// `npm run gen-types -- http://127.0.0.1:7070/openapi.json` regenerates it.

export interface AbandonCleanup {
  /**
   * Why the cleanup is given up (1 to 500 characters), recorded in the action log.
   */
  reason: string;
}

export interface Account {
  /**
   * The balance in credits (minor units, signed 64-bit): the sum of the account's ledger entries.
   */
  balance: number;
  /**
   * When the account was created (RFC 3339 UTC time).
   */
  created_at: string;
  /**
   * The account's id.
   */
  id: string;
  /**
   * The most of the account's jobs that may run at once; null: no cap.
   */
  max_running?: number | null;
  /**
   * How far below zero charges may take the balance, in credits.
   */
  overdraft_limit: number;
}

export interface AccountPage {
  /**
   * Accounts in id order (a scoped token's own only).
   */
  accounts: Array<Account>;
  /**
   * Pass as `after` for the next page (the last account's id); null at the end.
   */
  next_after?: string | null;
}

export interface Action {
  /**
   * What was done: `job.requeue`, `job.abandon_cleanup`, …
   */
  action: string;
  /**
   * The token's name (or `cli`, `system`, `loopback`).
   */
  actor: string;
  /**
   * When (RFC 3339 UTC).
   */
  at: string;
  /**
   * What the action named (ids, amounts, reasons).
   */
  detail: unknown;
}

export interface Alert {
  /**
   * The threshold in credits.
   */
  below: number;
  /**
   * The alert's name, unique on the account.
   */
  id: string;
  /**
   * `above` (the balance is at or above `below`) or `below`.
   */
  side: string;
}

/**
 * An account's alerts, in threshold order.
 */
export interface AlertList {
  /**
   * The account's alerts, lowest threshold first (ties by id).
   */
  alerts: Array<Alert>;
}

export interface Allocation {
  /**
   * Credits of it given back since (refunds, releases go home).
   */
  given_back: number;
  /**
   * The grant that paid (`null`: the part no grant covered, debt).
   */
  grant_id?: string | null;
  /**
   * The item the part was for (`null`: the job as a whole).
   */
  item_id?: string | null;
  /**
   * `charge`, `reclaim`, `adjustment`, `settle_debt` or `opening`.
   */
  kind: string;
  /**
   * The grant's origin (`grant`, `opening`, …).
   */
  origin?: string | null;
  /**
   * Credits taken from the grant.
   */
  taken: number;
}

export interface Artifact {
  /**
   * The item the artifact belongs to.
   */
  item_id: string;
  /**
   * The job the artifact belongs to.
   */
  job_id: string;
  /**
   * The artifact's key, as the worker named it.
   */
  key: string;
  /**
   * Where the worker stores the object in the artifact store: its job's and item's own prefix,
   * `{job_id}/{item_id}/{key}` (an id `.` or `..` written `%2E`). Teardown deletes exactly this.
   */
  path: string;
}

export interface Attempt {
  /**
   * 1 for the first attempt, counting up.
   */
  attempt_no: number;
  /**
   * The failure's code, if it failed.
   */
  fail_code?: string | null;
  /**
   * When the attempt ended (RFC 3339 UTC time); null while open.
   */
  finished_at?: string | null;
  /**
   * The failure's or unknown outcome's message, up to 2,000 bytes.
   */
  message?: string | null;
  /**
   * When a success this attempt reported after it had ended otherwise (its lease expired, it
   * failed) recovered the job (RFC 3339 UTC time); null if none did.
   */
  recovered_at?: string | null;
  /**
   * `succeeded`, `failed`, `lease_expired`, `unknown`, `cancelled`, `superseded`, `released`; null
   * while open.
   */
  result?: string | null;
  /**
   * When the claim started the attempt (RFC 3339 UTC time).
   */
  started_at: string;
  /**
   * The worker that held the lease.
   */
  worker: string;
}

export interface Attempts {
  /**
   * Every attempt, oldest first.
   */
  attempts: Array<Attempt>;
}

export interface Audit {
  /**
   * Accounts checked.
   */
  accounts_checked: number;
  /**
   * Ledger entries checked.
   */
  entries_checked: number;
  /**
   * Items checked.
   */
  items_checked: number;
  /**
   * True when no invariant is violated.
   */
  ok: boolean;
  /**
   * Every violation found; empty when `ok`.
   */
  violations: Array<Violation>;
}

/**
 * An account's auto top-up rule.
 */
export interface AutoTopUp {
  /**
   * The threshold a posting crosses downward to buy.
   */
  below: number;
  /**
   * Credits each top-up buys.
   */
  credits: number;
  /**
   * What its top-ups made this month are buying or bought.
   */
  credits_this_month: number;
  /**
   * The ISO 4217 code of the price.
   */
  currency: string;
  /**
   * Who the funding provider charges.
   */
  customer: string;
  /**
   * When the month's count starts again (RFC 3339).
   */
  month_resets_at: string;
  /**
   * The most credits bought in a UTC month.
   */
  monthly_credits_max: number;
  /**
   * What each costs, in minor units of `currency`.
   */
  price: number;
  /**
   * `active`, or `paused` after one of its top-ups died (put the rule again to turn it on).
   */
  state: string;
}

export interface Claim {
  /**
   * Claim only these kinds (each a job kind); all kinds but withdrawals when absent.
   */
  kinds?: Array<string> | null;
  /**
   * The worker's labels (at most 64): it is given only jobs whose every required label is
   * among them. None: only jobs that require none.
   */
  labels?: Array<string> | null;
  /**
   * How long the lease lasts without a heartbeat, in seconds: 1 to 3,600 (default per kind, else 30).
   */
  lease_seconds?: number | null;
  /**
   * At most this many jobs: 1 to 100, default 1.
   */
  limit?: number | null;
  /**
   * Long-poll: wait up to this many seconds (0 to 30, default 0) for a job to become due.
   */
  wait_seconds?: number | null;
  /**
   * The worker's name, 1-128 characters of `[A-Za-z0-9_.:@/-]`: kept in the attempt log.
   */
  worker: string;
}

export interface Claimed {
  /**
   * The claimed jobs; empty when nothing was due.
   */
  jobs: Array<ClaimedJob>;
}

export type ClaimedJob = Job & {
  /**
   * When the lease lapses without a heartbeat (RFC 3339 UTC time).
   */
  lease_expires_at: string;
  /**
   * The attempt's lease token: send it with every signal of this attempt.
   */
  lease_token: string;
};

export interface CreateAccount {
  /**
   * The account's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
   * idempotent.
   */
  id: string;
  /**
   * The most of the account's jobs that may run at once (0 to 10,000; absent or null: no cap). A
   * claim never takes a job that would put the account over it.
   */
  max_running?: number | null;
  /**
   * How far below zero charges may take the balance, in credits (minor units); 0 (the default) to 2^61.
   */
  overdraft_limit?: number | null;
}

export interface CreateAdjustment {
  /**
   * Credits to add (positive) or take away (negative), in minor units; not zero.
   */
  amount: number;
  /**
   * The adjustment's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
   * idempotent.
   */
  id: string;
  /**
   * Why (required): 1 to 2,000 bytes.
   */
  reason: string;
}

export interface CreateGrant {
  /**
   * Credits to add (minor units): greater than zero; the balance stays within ±2^61.
   */
  amount: number;
  /**
   * When what is left of the grant expires (RFC 3339, after now); absent: never. At that instant
   * the rest is taken by one `expire` entry, and credits given back to it later expire at once.
   */
  expires_at?: string | null;
  /**
   * The grant's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
   * idempotent.
   */
  id: string;
  /**
   * 0–100, default 50: charges take from the lowest priority first, then the soonest expiry
   * (never-expiring last), then the oldest grant.
   */
  priority?: number | null;
  /**
   * Why, for people reading the ledger: up to 2,000 bytes.
   */
  reason?: string | null;
}

export interface CreateJob {
  /**
   * The account to charge.
   */
  account_id: string;
  /**
   * A single-item job (item `main`) of this price in credits, 0 or more. Exactly one of `cost`,
   * `hold` and `items`.
   */
  cost?: number | null;
  /**
   * A single-item job (item `main`) priced by what the work used: credits held (charged) on
   * creation, more than 0; the success says the price (at most the hold) and the rest is
   * released. Exactly one of `cost`, `hold` and `items`.
   */
  hold?: number | null;
  /**
   * The job's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
   * idempotent.
   */
  id: string;
  /**
   * The billable items, 1 to 1,000, each charged (or held) on creation. Exactly one of `cost`,
   * `hold` and `items`.
   */
  items?: Array<NewItem> | null;
  /**
   * What kind of work (1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`); workers claim by kind.
   */
  kind: string;
  /**
   * How many attempts before the job is dead: 1 to 100 (default per kind, else 5).
   */
  max_attempts?: number | null;
  /**
   * Not claimable before this time (RFC 3339 UTC time); default now.
   */
  not_before?: string | null;
  /**
   * Any JSON, up to 256 KiB, handed to the worker as is.
   */
  payload?: unknown;
  /**
   * 0 to 100, default 50: a lower number is claimed first. Within one priority, accounts take
   * turns.
   */
  priority?: number | null;
  /**
   * `failure` (default: refund at every failure, reclaim on a late success) or `final_failure` (refund
   * only when the job is dead).
   */
  refund_on?: string | null;
  /**
   * Labels a worker must have to claim it (`gpu:a100`, `region:eu`): at most 8, each 1-64
   * characters of `[A-Za-z0-9_.:/=-]`.
   */
  requires?: Array<string> | null;
}

export interface CreateTopUp {
  /**
   * The account the credits go to.
   */
  account_id: string;
  /**
   * Credits bought: 1 to 2^53.
   */
  credits: number;
  /**
   * An ISO 4217 code (either case; answered in capitals).
   */
  currency: string;
  /**
   * Who the funding provider charges: 1-256 printable ASCII characters, not starting or ending with a space.
   */
  customer: string;
  /**
   * The top-up's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`.
   * Makes the request idempotent; the credits, once paid, are granted under this id.
   */
  id: string;
  /**
   * What the customer pays, in minor units of `currency`: 0 to 2^53 (0 only with the admin role:
   * a free top-up gives credit away).
   */
  price: number;
}

export interface CreateWithdrawal {
  /**
   * The account paying out.
   */
  account_id: string;
  /**
   * Greater than zero; held (charged) at once, refunded only if the payout is definitively not made.
   */
  amount: number;
  /**
   * Where the payout goes: 1-256 printable ASCII characters, not starting or ending with a space.
   */
  destination: string;
  /**
   * The withdrawal's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
   * idempotent.
   */
  id: string;
}

export interface ErrorBody {
  /**
   * What went wrong: a stable code to branch on and a sentence for people.
   */
  error: ErrorDetail;
}

export interface ErrorDetail {
  /**
   * `invalid_request`, `unauthorized`, `forbidden`, `not_found`, `insufficient_credits`,
   * `idempotency_conflict`, `job_finished`, `outcome_unknown`, `lease_lost`, `invalid_transition`,
   * `payload_too_large`, `rate_limited`, `unavailable`, `internal`.
   */
  code: string;
  /**
   * With `lease_lost` on the worker routes: what became of the job and of the attempt whose
   * token the report carried — `{"state", "lease": "expired" | "ended" | "never_issued",
   * "attempt": {"attempt", "result", "reported", "finished_at", "expired_at"} | null}`.
   */
  details?: Record<string, unknown> | null;
  /**
   * A human sentence.
   */
  message: string;
}

/**
 * The schema of an event envelope. Answers serialize `settle_store::EventEnvelope` itself — the
 * same value, byte for byte, that a webhook delivery sends.
 */
export interface Event {
  /**
   * The account it is about.
   */
  account_id: string;
  /**
   * When the transition committed (RFC 3339 UTC time).
   */
  created_at: string;
  /**
   * The event's details (amounts in credits, codes, states), a JSON object.
   */
  data: unknown;
  /**
   * The store's epoch when the event was numbered: 1 for a new store, raised by one by each
   * restore from a backup (which numbers events again from where the backup stood). Receivers
   * deduplicate by (`epoch`, `seq`), never by `seq` alone.
   */
  epoch: number;
  /**
   * The job it is about; null for account events.
   */
  job_id?: string | null;
  /**
   * The event's position in the feed: increasing, gap-free, in commit order.
   */
  seq: number;
  /**
   * The event type, e.g. `job.queued`, `job.refunded`, `job.reclaimed`, `job.dead`, `account.granted`.
   */
  type: string;
}

export interface EventPage {
  /**
   * Events in `seq` order.
   */
  events: Array<Event>;
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
}

export interface Fail {
  /**
   * Why it failed: 1-64 characters of `A-Z0-9_` (e.g. `TIMEOUT`, `OOM`); the failures summary groups by
   * it.
   */
  code: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  /**
   * Details for people, up to 2,000 bytes.
   */
  message?: string | null;
  /**
   * Overrides the backoff for this retry, in milliseconds (e.g. a 429's Retry-After), capped at
   * the kind's longest backoff (default 600,000).
   */
  retry_after_ms?: number | null;
  /**
   * Whether another attempt may succeed (default true); false ends the job `dead` at once.
   */
  retryable?: boolean | null;
}

export interface FailureCount {
  /**
   * The jobs' last fail code.
   */
  code: string;
  /**
   * How many jobs.
   */
  count: number;
  /**
   * `dead`, `unknown` or `retrying`.
   */
  state: string;
}

export interface FailureSummary {
  /**
   * One row per fail code and state, most jobs first.
   */
  by_code: Array<FailureCount>;
}

/**
 * A source of an account's credit: a grant, a positive adjustment, or the balance the account had
 * before grants were tracked (`origin` `opening`, its id the account's).
 */
export interface Grant {
  /**
   * Credits it gave.
   */
  amount: number;
  /**
   * RFC 3339.
   */
  created_at: string;
  /**
   * RFC 3339; null: never expires.
   */
  expires_at?: string | null;
  /**
   * The grant's (or adjustment's) id.
   */
  id: string;
  /**
   * `grant`, `adjustment` or `opening`.
   */
  origin: string;
  /**
   * 0–100, lower spent first.
   */
  priority: number;
  /**
   * Credits it has left to spend (0 once expired).
   */
  remaining: number;
  /**
   * `active`, `used` (nothing left) or `expired` (from its expiry instant on).
   */
  state: string;
}

export interface GrantList {
  /**
   * In the order they were made.
   */
  grants: Array<Grant>;
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
}

export interface Health {
  /**
   * `ok`.
   */
  status: string;
}

export interface Heartbeat {
  /**
   * A cancel was requested: stop at the item boundary and report.
   */
  cancel_requested: boolean;
  /**
   * The lease's new expiry (RFC 3339 UTC time).
   */
  lease_expires_at: string;
}

export interface Item {
  /**
   * The item's price in credits (minor units); null for a held item until a success prices it.
   */
  cost?: number | null;
  /**
   * What a held item holds (was charged at creation); null for a fixed-price item.
   */
  hold?: number | null;
  /**
   * The item's id within its job.
   */
  id: string;
  /**
   * Whether a refund of this item was taken back by a late success.
   */
  is_reclaimed: boolean;
  /**
   * Whether the item's charge is refunded now (its net is 0).
   */
  is_refunded: boolean;
  /**
   * Why it was refunded: `job_failed`, `item_failed` or `cancelled`; null if never refunded.
   */
  refund_reason?: string | null;
  /**
   * `charged`, `succeeded`, `refunded`, `reclaimed`, `cancelled`, or `returned` (a withdrawal paid out
   * and sent back).
   */
  state: string;
}

export interface ItemFail {
  /**
   * Why the item failed: 1-64 characters of `A-Z0-9_`.
   */
  code: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  /**
   * Details for people, up to 2,000 bytes.
   */
  message?: string | null;
}

export interface ItemReport {
  /**
   * A cancel was requested: stop at this item boundary.
   */
  cancel_requested: boolean;
  /**
   * The item as it is now.
   */
  item: Item;
}

export interface ItemSucceed {
  /**
   * A held item's price: what the work used, `0 ≤ cost ≤ hold`. Required for a held item; for a
   * fixed item, if given, its cost.
   */
  cost?: number | null;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
}

export interface Job {
  /**
   * The account charged.
   */
  account_id: string;
  /**
   * How many attempts have started (0 before the first claim).
   */
  attempt: number;
  /**
   * A cancel was requested while the job was running; its worker stops at the next item boundary.
   */
  cancel_requested: boolean;
  /**
   * The sum of its items' prices, in credits (minor units); null while a held item is unpriced.
   */
  cost?: number | null;
  /**
   * When the job was created (RFC 3339 UTC time).
   */
  created_at: string;
  /**
   * The sum of its held items' holds; null when it has none.
   */
  hold?: number | null;
  /**
   * The job's id.
   */
  id: string;
  /**
   * The job's items, in the order they were given.
   */
  items: Array<Item>;
  /**
   * The kind of work.
   */
  kind: string;
  last_error?: LastError | null;
  /**
   * Attempts allowed before the job is dead (1 to 100); a requeue gives a fresh budget.
   */
  max_attempts: number;
  /**
   * The sum of the job's ledger entries, in credits (≤ 0): what the job costs the account now.
   */
  net: number;
  /**
   * Not claimable before this time (RFC 3339 UTC time); a retry's backoff moves it.
   */
  not_before: string;
  /**
   * The JSON given at creation.
   */
  payload: unknown;
  /**
   * 0 to 100: a lower number is claimed first.
   */
  priority: number;
  /**
   * `failure` or `final_failure`.
   */
  refund_on: string;
  /**
   * The labels a worker must have to claim it, sorted.
   */
  requires: Array<string>;
  /**
   * What the worker's success carried (any JSON); null before success.
   */
  result?: unknown;
  /**
   * `queued`, `running`, `unknown`, `cancelling`, `succeeded`, `dead`, `cancelled`, and for withdrawals
   * `returned`.
   */
  state: string;
  /**
   * When the job last changed (RFC 3339 UTC time).
   */
  updated_at: string;
}

/**
 * A job in brief: what a worker acts on after a report (`GET /v1/jobs/{id}` has the rest).
 */
export interface JobBrief {
  /**
   * How many attempts have started.
   */
  attempt: number;
  /**
   * A cancel was requested: stop at the item boundary.
   */
  cancel_requested: boolean;
  /**
   * The job's id.
   */
  id: string;
  last_error?: LastError | null;
  /**
   * Attempts allowed before the job is dead.
   */
  max_attempts: number;
  /**
   * The sum of the job's ledger entries (≤ 0).
   */
  net: number;
  /**
   * Not claimable before this time (RFC 3339 UTC time): a retry's backoff.
   */
  not_before: string;
  /**
   * As the job's `state`.
   */
  state: string;
  /**
   * When the job last changed (RFC 3339 UTC time).
   */
  updated_at: string;
}

/**
 * What paid for a job, what operators did to it and the signals that changed nothing: the parts
 * of a job's story the attempt log does not hold (the console's job page, as JSON).
 */
export interface JobHistory {
  /**
   * Operators' actions on the job, oldest first.
   */
  actions: Array<Action>;
  /**
   * Which grant paid which part, and what of it went back (decision 0023).
   */
  allocations: Array<Allocation>;
  /**
   * Worker signals that changed nothing (stale, repeats) and late successes that recovered it.
   */
  signals: Array<SignalRecord>;
}

export interface JobPage {
  /**
   * Jobs in creation order.
   */
  jobs: Array<Job>;
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
}

export interface LastError {
  /**
   * The fail code of the last failure (`A-Z0-9_`, 1-64 characters), e.g. `TIMEOUT`, `LEASE_EXPIRED`.
   */
  code: string;
  /**
   * The failure's message, up to 2,000 bytes.
   */
  message?: string | null;
}

export interface LeaseOnly {
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
}

export interface LedgerEntry {
  /**
   * The account the entry belongs to.
   */
  account_id: string;
  /**
   * The entry's place in its account: 1, 2, 3, … without gaps, the order of its hash chain.
   */
  account_seq: number;
  /**
   * Signed credits (minor units): charges, reclaims and expiries negative; grants, refunds,
   * releases and returns positive.
   */
  amount: number;
  /**
   * The account's balance right after this entry, in credits.
   */
  balance_after: number;
  /**
   * When the entry was written (RFC 3339 UTC time).
   */
  created_at: string;
  /**
   * Hex SHA-256 of this entry chained to the account's previous entry (64 hex digits).
   */
  hash: string;
  /**
   * The grant's or adjustment's id; an expiry's grant (`{grant}#{account_seq}` for a part given
   * back after the grant expired); null for job entries.
   */
  id?: string | null;
  /**
   * The job's item the entry moves; null for grants, adjustments and expiries.
   */
  item_id?: string | null;
  /**
   * The job the entry charges, refunds or reclaims; null for grants, adjustments and expiries.
   */
  job_id?: string | null;
  /**
   * `grant`, `adjustment`, `charge`, `refund`, `reclaim`, `payout_return`, `release` (what a held
   * item's price did not use) or `expire` (what an expired grant had left, or a part given back to
   * it after it expired).
   */
  kind: string;
  /**
   * Why: the grant's or adjustment's reason, or a refund's reason (`job_failed`, `item_failed`,
   * `cancelled`).
   */
  reason?: string | null;
  /**
   * The entry's number: unique, and increasing within its account in commit order (gaps
   * allowed; no order across accounts). The ledger's `after` cursor.
   */
  seq: number;
}

export interface LedgerPage {
  /**
   * Entries in `seq` order.
   */
  entries: Array<LedgerEntry>;
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
}

/**
 * An account's spend limits, in the order they were put.
 */
export interface LimitList {
  /**
   * The account's limits.
   */
  limits: Array<SpendLimit>;
}

export interface NewAlert {
  /**
   * The threshold in credits, 1 to 2^61: `account.balance_low` when a posting takes the balance
   * from at or above it to under it, `account.balance_recovered` back.
   */
  below: number;
  /**
   * The alert's name, unique on the account (the id charset, 1–128 characters).
   */
  id: string;
}

export interface NewItem {
  /**
   * The item's price in credits (minor units), 0 or more; charged when the job is created.
   * Exactly one of `cost` and `hold`.
   */
  cost?: number | null;
  /**
   * For an item priced by what the work used: credits held (charged) when the job is created,
   * more than 0. The first success prices the item (`0 ≤ cost ≤ hold`) and releases the rest.
   * Exactly one of `cost` and `hold`.
   */
  hold?: number | null;
  /**
   * The item's id, unique within the job: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`.
   */
  id: string;
}

export interface NewLimit {
  /**
   * The most the period's spend may reach through creates, in credits, 1 to 2^61.
   */
  amount: number;
  /**
   * The job kinds it counts (at most 16, unique); absent or empty: every kind but
   * `withdrawal`, which counts only when named.
   */
  kinds?: Array<string>;
  /**
   * `day` (a UTC day) or `month` (a UTC calendar month).
   */
  period: string;
}

/**
 * `PUT /v1/accounts/{id}/alerts`: the account's whole set of alerts.
 */
export interface PutAlerts {
  /**
   * At most 16; an empty list removes them all.
   */
  alerts: Array<NewAlert>;
}

/**
 * An account's auto top-up rule to put.
 */
export interface PutAutoTopUp {
  /**
   * A posting that takes the balance from at or above this to under it buys `credits`: 1 to 2^61.
   */
  below: number;
  /**
   * Credits each top-up buys: 1 to 2^53.
   */
  credits: number;
  /**
   * An ISO 4217 code.
   */
  currency: string;
  /**
   * Who the funding provider charges.
   */
  customer: string;
  /**
   * The most credits the rule buys in a UTC month (at least `credits`): counted when a top-up is
   * made, given back when one dies or is cancelled.
   */
  monthly_credits_max: number;
  /**
   * What each costs the customer, in minor units of `currency` (0 only with the admin role).
   */
  price: number;
}

/**
 * `PUT /v1/accounts/{id}/limits`: the account's whole set of spend limits.
 */
export interface PutLimits {
  /**
   * At most 16; an empty list removes them all.
   */
  limits: Array<NewLimit>;
}

export interface RegisterArtifact {
  /**
   * The artifact's key in the artifact store: a relative path of 1-512 characters of
   * `[A-Za-z0-9_.:/-]` without `.`, `..` or empty segments.
   */
  key: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
}

/**
 * One signal: the body of its single route (`/v1/jobs/{id}/succeed`, `fail`, `release`,
 * `unknown`, `heartbeat`), with the job's id and the `outcome` that names the route.
 */
export type Report = {
  /**
   * The price of a held job's `main` item (`0 ≤ cost ≤ hold`); not with `costs`.
   */
  cost?: number | null;
  /**
   * The prices of the held items this success decides, by item id.
   */
  costs?: Record<string, unknown> | null;
  /**
   * The job reported on.
   */
  job_id: string;
  /**
   * The token of any attempt of this job.
   */
  lease_token: string;
  outcome: string;
  /**
   * Any JSON the job produced, kept with the job.
   */
  result?: unknown;
} | {
  /**
   * Why it failed: 1-64 characters of `A-Z0-9_`.
   */
  code: string;
  /**
   * The job reported on.
   */
  job_id: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  /**
   * Details for people, up to 2,000 bytes.
   */
  message?: string | null;
  outcome: string;
  /**
   * Overrides the backoff for this retry, in milliseconds.
   */
  retry_after_ms?: number | null;
  /**
   * Whether another attempt may succeed (default true).
   */
  retryable?: boolean | null;
} | {
  /**
   * The job reported on.
   */
  job_id: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  outcome: string;
} | {
  /**
   * The job reported on.
   */
  job_id: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  /**
   * What is known, up to 2,000 bytes.
   */
  message?: string | null;
  outcome: string;
} | {
  /**
   * The job reported on.
   */
  job_id: string;
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  outcome: string;
};

/**
 * What the report's single route would have answered: its status, and its body — the job (in
 * brief), the heartbeat, or the error.
 */
export interface ReportResult {
  error?: ErrorDetail | null;
  heartbeat?: Heartbeat | null;
  job?: JobBrief | null;
  /**
   * The report's job.
   */
  job_id: string;
  /**
   * With 200: the report had already taken effect (the single route's `Idempotent-Replayed:
   * true`); nothing changed.
   */
  replayed?: boolean | null;
  /**
   * The status its single route would have answered: 200, or the error's (404, 409, 422, 503, …).
   */
  status: number;
}

export interface ReportResults {
  /**
   * One result per report, in the request's order.
   */
  results: Array<ReportResult>;
}

/**
 * `POST /v1/reports`: many worker signals in one request, each its own guarded transition with
 * its own answer (docs/design/reports.md).
 */
export interface Reports {
  /**
   * 1 to 100 reports, each on another job.
   */
  reports: Array<Report>;
}

export interface RequeuedDeliveries {
  /**
   * How many dead deliveries were put back in line; call again while it is 1000.
   */
  requeued: number;
}

/**
 * An operator's resolution of an `unknown` withdrawal, confirmed by means outside Settle.
 */
export interface ResolveWithdrawal {
  /**
   * `sent`: the transfer left (the withdrawal succeeds with `provider_txid`); `not_sent`: it did
   * not (the withdrawal ends `dead` with code `CONFIRMED_NOT_SENT` and its hold refunded).
   */
  outcome: string;
  /**
   * The provider's transaction id; required with `sent`, refused with `not_sent`.
   */
  provider_txid?: string | null;
  /**
   * How the outcome was confirmed (a statement, a ticket): kept in the action log.
   */
  reason: string;
}

export interface SignalRecord {
  /**
   * The attempt whose lease token it carried (`null`: none matched).
   */
  attempt_no?: number | null;
  /**
   * What came of it: `stale` (not the current attempt's lease), `noop` (a repeat) or `recovered` (a late success took a refund back).
   */
  effect: string;
  /**
   * A failure's code.
   */
  fail_code?: string | null;
  /**
   * A failure's message.
   */
  message?: string | null;
  /**
   * When it arrived (RFC 3339 UTC).
   */
  received_at: string;
  /**
   * `succeed`, `fail`, `unknown`, `heartbeat`, …
   */
  signal: string;
}

export interface SpendLimit {
  /**
   * The most the period's spend may reach through creates.
   */
  amount: number;
  /**
   * The job kinds it counts; empty: every kind but `withdrawal`.
   */
  kinds: Array<string>;
  /**
   * `day` or `month` (UTC).
   */
  period: string;
  /**
   * When the next period starts (RFC 3339, UTC).
   */
  resets_at: string;
  /**
   * What the current period spent: charges, holds and reclaims posted in it, less the refunds,
   * releases and payout returns posted in it (negative when refunds of an earlier period's
   * charges came back in it).
   */
  spent: number;
}

export interface Succeed {
  /**
   * The price of a held job's `main` item: what the work used, `0 ≤ cost ≤ hold`. Required when
   * this success delivers or reclaims a held item; not with `costs`.
   */
  cost?: number | null;
  /**
   * The prices of the held items this success decides, by item id (`0 ≤ cost ≤ hold` each).
   */
  costs?: Record<string, unknown> | null;
  /**
   * The attempt's lease token; optional, since a success is accepted from any attempt.
   */
  lease_token?: string | null;
  /**
   * Any JSON the job produced, kept with the job.
   */
  result?: unknown;
}

/**
 * A top-up: its job (kind `top_up`, `refund_on = final_failure`, nothing charged to the account)
 * and the charge's own fields.
 */
export type TopUp = Job & {
  /**
   * Credits bought; granted once the charge is confirmed.
   */
  credits: number;
  /**
   * The ISO 4217 code of the price, in capitals.
   */
  currency: string;
  /**
   * Who the funding provider charges.
   */
  customer: string;
  /**
   * The grant the confirmed charge wrote (the top-up's id), once written.
   */
  grant_id?: string | null;
  /**
   * Made once at creation; every attempt looks up and charges with it.
   */
  idempotency_key: string;
  /**
   * In minor units of `currency`.
   */
  price: number;
  /**
   * The funding provider's id of the charge, once confirmed.
   */
  provider_charge_id?: string | null;
  /**
   * Made by the account's auto top-up rule.
   */
  rule: boolean;
};

export interface TopUpPage {
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
  /**
   * Top-ups in creation order.
   */
  top_ups: Array<TopUp>;
}

export interface Unknown {
  /**
   * The lease token the claim answered.
   */
  lease_token: string;
  /**
   * What is known, up to 2,000 bytes.
   */
  message?: string | null;
}

/**
 * `PATCH /v1/accounts/{id}`: each field given is set, the others kept.
 */
export interface UpdateAccount {
  /**
   * The account's cap on running jobs, 0 to 10,000; `null` removes the cap. Lowered below what
   * runs now, running jobs finish and nothing new starts until the account is below it.
   */
  max_running?: number | null;
  /**
   * How far below zero charges may take the balance, in credits; 0 to 2^61. Lowering it below
   * what the balance already owes refuses further charges; it moves no credits.
   */
  overdraft_limit?: number | null;
}

export interface Violation {
  /**
   * The account where it was found, if any.
   */
  account_id?: string | null;
  /**
   * `L1` … `L4` (semantics.md), or `SEQ` (a gap in the ledger's numbering).
   */
  invariant: string;
  /**
   * The item where it was found, if any.
   */
  item_id?: string | null;
  /**
   * The job where it was found, if any.
   */
  job_id?: string | null;
  /**
   * What does not hold, with the numbers.
   */
  message: string;
}

/**
 * A webhook endpoint's circuit breaker (docs/design/webhooks.md).
 */
export interface WebhookBreaker {
  /**
   * `closed` (sending), `open` (paused until `next_probe_at`) or `half_open` (one probe in flight).
   */
  breaker: string;
  /**
   * The webhook endpoint's id.
   */
  endpoint_id: string;
  /**
   * Consecutive failed sends while closed.
   */
  failures: number;
  /**
   * When an open breaker lets its next probe through (RFC 3339).
   */
  next_probe_at?: string | null;
  /**
   * Consecutive openings without a delivered send between them; each doubles the pause.
   */
  opens: number;
}

export interface WebhookDelivery {
  /**
   * Sends tried so far.
   */
  attempts: number;
  /**
   * When the receiver answered 2xx (RFC 3339 UTC time).
   */
  delivered_at?: string | null;
  /**
   * The webhook endpoint's id (from the configuration).
   */
  endpoint_id: string;
  /**
   * The event delivered, the same envelope as the event feed.
   */
  event: Event;
  /**
   * Why the last send failed, if it did.
   */
  last_error?: string | null;
  /**
   * The HTTP status of the last send, if one was answered.
   */
  last_status?: number | null;
  /**
   * When the next send is due (RFC 3339 UTC time).
   */
  next_attempt_at: string;
  /**
   * `pending`, `delivered` or `dead`.
   */
  state: string;
}

export interface WebhookDeliveryPage {
  /**
   * Deliveries in event order.
   */
  deliveries: Array<WebhookDelivery>;
  /**
   * Every endpoint's circuit breaker (all endpoints, whatever the page's filter).
   */
  endpoints: Array<WebhookBreaker>;
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
}

/**
 * A withdrawal: its job (kind `withdrawal`, `refund_on = final_failure`) and the payout's own fields.
 */
export type Withdrawal = Job & {
  /**
   * Credits paid out (minor units), greater than zero.
   */
  amount: number;
  /**
   * Where the payout goes.
   */
  destination: string;
  /**
   * Made once at creation; every attempt looks up and sends with it.
   */
  idempotency_key: string;
  /**
   * The provider's id of the transfer, once known.
   */
  provider_txid?: string | null;
  /**
   * When the payout was recorded as returned.
   */
  returned_at?: string | null;
};

export interface WithdrawalPage {
  /**
   * Pass as `after` for the next page; null at the end.
   */
  next_after?: number | null;
  /**
   * Withdrawals in creation order.
   */
  withdrawals: Array<Withdrawal>;
}
