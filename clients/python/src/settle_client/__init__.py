"""Settle from Python: the HTTP API v1 client and workers.

- `Client` / `AsyncClient`: accounts, grants, jobs, withdrawals, events, and the worker protocol.
- `Worker` / `AsyncWorker`: claim, heartbeat, report items one by one, stop at the item boundary
  on cancel (or on `stop()`/SIGTERM, then release the job), report the outcome.
- `verify_webhook`: check a webhook delivery's `Settle-Signature`.
- Errors carry the API's error `code` (`SettleError` and its subclasses).
- Answers are typed (`Job`, `Account`, `LedgerEntry`, … — `TypedDict`s, so the JSON dicts
  themselves), states are `str` enums (`JobState`, `ItemState`, `RefundReason`).
"""

from .client import Applied, AsyncClient, Client, Replayed
from .errors import (
    Forbidden,
    IdempotencyConflict,
    InsufficientCredits,
    InvalidId,
    InvalidTransition,
    JobFinished,
    LeaseLost,
    NotFound,
    SettleError,
    Unauthorized,
    Unavailable,
)
from .models import (
    Account,
    Artifact,
    Attempt,
    Audit,
    ClaimedJob,
    Event,
    EventPage,
    FailureCount,
    Heartbeat,
    Item,
    ItemReport,
    ItemState,
    Job,
    JobState,
    LedgerEntry,
    Grant,
    GrantPage,
    LedgerPage,
    RefundReason,
    Withdrawal,
)
from .webhooks import SignatureError, sign, verify_webhook
from .worker import (
    AsyncJobContext,
    AsyncWorker,
    Cancelled,
    Failed,
    Flow,
    JobContext,
    Released,
    Succeeded,
    Unknown,
    Worker,
)

__all__ = [
    "Account",
    "Applied",
    "Artifact",
    "Attempt",
    "Audit",
    "ClaimedJob",
    "Event",
    "EventPage",
    "FailureCount",
    "Heartbeat",
    "Item",
    "ItemReport",
    "ItemState",
    "Job",
    "JobState",
    "LedgerEntry",
    "Grant",
    "GrantPage",
    "LedgerPage",
    "RefundReason",
    "Withdrawal",
    "AsyncClient",
    "AsyncJobContext",
    "AsyncWorker",
    "Cancelled",
    "Client",
    "Failed",
    "Flow",
    "Forbidden",
    "IdempotencyConflict",
    "InsufficientCredits",
    "InvalidId",
    "InvalidTransition",
    "JobContext",
    "JobFinished",
    "LeaseLost",
    "NotFound",
    "Released",
    "Replayed",
    "SettleError",
    "SignatureError",
    "Succeeded",
    "Unauthorized",
    "Unavailable",
    "Unknown",
    "Worker",
    "sign",
    "verify_webhook",
]
