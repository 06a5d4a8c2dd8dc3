// Errors that carry the API's error code (`{"error": {"code", "message", "details"?}}`).

/** An answer of the API that is not a success: its status, error `code`, message and details. */
export class SettleError extends Error {
  readonly status: number;
  readonly code: string;
  /** Seconds the server asked to wait (`Retry-After`), on 429 and 503. */
  readonly retryAfter: number | undefined;
  /** The error body's `details`, when it has them (`lease_lost`). */
  readonly details: Record<string, unknown> | undefined;

  constructor(status: number, code: string, message: string, retryAfter?: number, details?: Record<string, unknown>) {
    super(`${status} ${code}: ${message}`);
    this.name = new.target.name;
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
    this.details = details;
  }
}

/** 400: the request is malformed; nothing was written. */
export class InvalidRequest extends SettleError {}
/** 401: the token is missing or unknown. */
export class Unauthorized extends SettleError {}
/** 403: the token's role or scope does not allow this. */
export class Forbidden extends SettleError {}
/** 404. */
export class NotFound extends SettleError {}
/** 402: the balance (with its overdraft; a withdrawal: without) cannot cover it; nothing was written. */
export class InsufficientCredits extends SettleError {}
/** 402: a spend limit of the account would be passed; `details` say which (`period`, `amount`,
 * `kinds`) and how far (`spent`, `remaining`, `needed`); nothing was written. */
export class SpendLimitExceeded extends SettleError {}
/** 409: the id was used before with another body (or another account's). */
export class IdempotencyConflict extends SettleError {}
/** 409: the job already ended. */
export class JobFinished extends SettleError {}
/** 409: the job's outcome is unknown until reconciled. */
export class OutcomeUnknown extends SettleError {}
/** 409: a worker report refused because its lease is gone; `details` say what became of the job. */
export class LeaseLost extends SettleError {}
/** 409: the job is in a state this request cannot move. */
export class InvalidTransition extends SettleError {}
/** 413: the body is larger than 1 MiB. */
export class PayloadTooLarge extends SettleError {}
/** 429 or 503: retry after `retryAfter` seconds. */
export class Unavailable extends SettleError {}

/** An id that cannot be one URL path segment (`.`, `..`, outside the id alphabet): nothing was sent. */
export class InvalidId extends Error {
  constructor(message: string) {
    super(message);
    this.name = "InvalidId";
  }
}

const BY_CODE: Record<string, typeof SettleError> = {
  invalid_request: InvalidRequest,
  unauthorized: Unauthorized,
  forbidden: Forbidden,
  not_found: NotFound,
  insufficient_credits: InsufficientCredits,
  spend_limit_exceeded: SpendLimitExceeded,
  idempotency_conflict: IdempotencyConflict,
  job_finished: JobFinished,
  outcome_unknown: OutcomeUnknown,
  lease_lost: LeaseLost,
  invalid_transition: InvalidTransition,
  payload_too_large: PayloadTooLarge,
  rate_limited: Unavailable,
  unavailable: Unavailable,
};

/** The typed error for an answer's status, body and `Retry-After`. */
export function errorFor(status: number, body: unknown, retryAfter: string | null): SettleError {
  let code = "internal";
  let message = `HTTP ${status}`;
  let details: Record<string, unknown> | undefined;
  const error = (body as { error?: unknown } | null)?.error;
  if (error && typeof error === "object") {
    const e = error as { code?: unknown; message?: unknown; details?: unknown };
    if (typeof e.code === "string") code = e.code;
    if (typeof e.message === "string") message = e.message;
    if (e.details && typeof e.details === "object") details = e.details as Record<string, unknown>;
  }
  const wait = retryAfter === null ? undefined : Number(retryAfter);
  if (code === "internal" && (status === 429 || status === 502 || status === 503 || status === 504)) {
    code = "unavailable"; // a proxy's or load balancer's answer, without Settle's body
  }
  const Kind = Object.hasOwn(BY_CODE, code) ? (BY_CODE[code] as typeof SettleError) : SettleError;
  return new Kind(status, code, message, Number.isFinite(wait) ? wait : undefined, details);
}
