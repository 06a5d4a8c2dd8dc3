"""Errors that carry the API's error code (api-v1: `{"error": {"code", "message"}}`)."""

from __future__ import annotations


class SettleError(Exception):
    """An answer of the API that is not a success: `status`, the error `code` and its message."""

    def __init__(
        self, status: int, code: str, message: str, retry_after: float | None = None, details: dict | None = None
    ):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        #: Seconds the server asked to wait (`Retry-After`), on 429 and 503.
        self.retry_after = retry_after
        #: The error body's `details`, when it has them (`lease_lost`).
        self.details = details or {}


class InvalidId(ValueError):
    """An id that cannot be a URL path segment (`.`, `..`, or outside the id alphabet); nothing was sent."""


class InsufficientCredits(SettleError):
    """402: the balance (with its overdraft) cannot cover the charge; nothing was written."""


class IdempotencyConflict(SettleError):
    """409: the id was used before with another body."""


class LeaseLost(SettleError):
    """409: the report was refused because its lease is gone; nothing changed.

    `details` say what became of the job: `state` (the job's state now), `lease` (`expired`: the
    lease ran out and the job was rescued, `attempt["expired_at"]` says when; `ended`: the attempt
    ended another way; `never_issued`: no attempt of this job ever held the token) and `attempt`
    (how the token's attempt ended, or None).
    """

    @property
    def state(self) -> str | None:
        return self.details.get("state")

    @property
    def lease(self) -> str | None:
        return self.details.get("lease")

    @property
    def attempt(self) -> dict | None:
        return self.details.get("attempt")


class JobFinished(SettleError):
    """409: the job already ended."""


class InvalidTransition(SettleError):
    """409: the job (or the item) is in a state this request cannot move: an item report that
    contradicts what the item already is (a failure of a delivered item), a requeue of a job that
    is not dead."""


class NotFound(SettleError):
    """404."""


class Unauthorized(SettleError):
    """401: the token is missing or unknown."""


class Forbidden(SettleError):
    """403: the token's role (or scope) does not allow this."""


class Unavailable(SettleError):
    """503 or 429: retry after `retry_after` seconds."""


_BY_CODE: dict[str, type[SettleError]] = {
    "insufficient_credits": InsufficientCredits,
    "idempotency_conflict": IdempotencyConflict,
    "lease_lost": LeaseLost,
    "job_finished": JobFinished,
    "invalid_transition": InvalidTransition,
    "not_found": NotFound,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "unavailable": Unavailable,
    "rate_limited": Unavailable,
}


def error_for(status: int, body: object, retry_after: str | None) -> SettleError:
    """The typed error for an answer's status and body."""
    code, message, details = "internal", f"HTTP {status}", None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code", code))
        message = str(body["error"].get("message", message))
        if isinstance(body["error"].get("details"), dict):
            details = body["error"]["details"]
    wait = None
    if retry_after is not None:
        try:
            wait = float(retry_after)
        except ValueError:
            wait = None
    return _BY_CODE.get(code, SettleError)(status, code, message, wait, details)
