"""The API's answers, typed (docs/api.md): each a `TypedDict` — at run time the JSON dict itself —
and the closed sets of states as `str` enums, so `item["state"] == ItemState.CHARGED` holds and a
state the API adds later still reads as a plain string."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypedDict


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    UNKNOWN = "unknown"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"
    RETURNED = "returned"  # a withdrawal paid out and sent back


class ItemState(str, Enum):
    CHARGED = "charged"
    SUCCEEDED = "succeeded"
    REFUNDED = "refunded"
    RECLAIMED = "reclaimed"
    CANCELLED = "cancelled"
    RETURNED = "returned"


class RefundReason(str, Enum):
    JOB_FAILED = "job_failed"
    ITEM_FAILED = "item_failed"
    CANCELLED = "cancelled"


class _Replayable(TypedDict, total=False):
    replayed: bool  # present (True) when a create or report was a replay


class Account(_Replayable):
    id: str
    balance: int
    overdraft_limit: int
    max_running: int | None  # the most of its jobs that may run at once; None: no cap
    created_at: str


class LedgerEntry(_Replayable):
    seq: int  # unique; increases within an account in commit order (gaps allowed)
    account_seq: int  # 1, 2, 3, ... per account, gap-free: the entry's place in the hash chain
    account_id: str
    kind: str  # grant, charge, refund, reclaim, adjustment, payout_return, release, expire
    amount: int
    balance_after: int
    job_id: str | None
    item_id: str | None
    id: str | None
    reason: str | None
    created_at: str
    hash: str


class Alert(TypedDict):
    id: str
    below: int  # the threshold in credits
    side: str  # above (the balance is at or above `below`) or below


class AlertList(TypedDict):
    alerts: list[Alert]  # lowest threshold first


class NewLimit(TypedDict, total=False):
    period: str  # day or month (UTC); required
    amount: int  # the most the period may spend through creates; required
    kinds: list[str]  # the job kinds it counts; absent or empty: every kind but withdrawal


class SpendLimit(TypedDict):
    period: str  # day or month (UTC)
    amount: int
    kinds: list[str]  # empty: every kind but withdrawal
    spent: int  # the current period's net spend (negative when refunds of earlier charges came back)
    resets_at: str  # when the next period starts


class LimitList(TypedDict):
    limits: list[SpendLimit]  # in the order put


class LedgerPage(TypedDict):
    entries: list[LedgerEntry]
    next_after: int | None


class Grant(TypedDict):
    id: str
    origin: str  # grant, adjustment, or opening (the balance from before grants were tracked)
    amount: int
    remaining: int  # 0 once expired
    expires_at: str | None  # RFC 3339; None: never
    priority: int  # 0-100, lower spent first
    state: str  # active, used, expired
    created_at: str


class GrantPage(TypedDict):
    grants: list[Grant]
    next_after: int | None


class Item(TypedDict):
    id: str
    cost: int | None  # None for a held item until a success prices it
    hold: int | None  # a held item's hold; None for a fixed price
    state: str  # an ItemState
    is_refunded: bool
    is_reclaimed: bool
    refund_reason: str | None  # a RefundReason


class LastError(TypedDict):
    code: str
    message: str | None


class Job(_Replayable):
    id: str
    account_id: str
    kind: str
    state: str  # a JobState
    cost: int | None  # None while a held item is unpriced
    hold: int | None  # the sum of its holds; None when it has none
    net: int
    attempt: int
    max_attempts: int
    refund_on: str
    cancel_requested: bool
    not_before: str
    priority: int  # 0 to 100: a lower number is claimed first
    requires: list[str]  # the labels a worker must have to claim it
    lease_expires_at: str | None
    last_error: LastError | None
    items: list[Item]
    payload: Any
    result: Any
    created_at: str
    updated_at: str


class ClaimedJob(Job):
    lease_token: str


class Withdrawal(Job):
    destination: str
    amount: int
    idempotency_key: str
    provider_txid: str | None


class TopUp(Job):
    credits: int
    price: int
    currency: str
    customer: str
    idempotency_key: str
    provider_charge_id: str | None
    grant_id: str | None
    rule: bool


class AutoTopUp(TypedDict):
    below: int
    credits: int
    price: int
    currency: str
    customer: str
    monthly_credits_max: int
    state: str
    credits_this_month: int
    month_resets_at: str


class Attempt(TypedDict):
    attempt_no: int
    worker: str
    started_at: str
    finished_at: str | None
    result: str | None
    fail_code: str | None
    message: str | None


class Heartbeat(TypedDict):
    lease_expires_at: str
    cancel_requested: bool


class JobBrief(_Replayable):
    """A job as `report` answers it (decision 0041): what a worker acts on; `job()` has the rest."""

    id: str
    state: str
    attempt: int
    max_attempts: int
    cancel_requested: bool
    not_before: str
    net: int
    last_error: LastError | None
    updated_at: str


class Report(TypedDict, total=False):
    """One report of `report`: `job_id`, `outcome` (`succeed`, `fail`, `release`, `unknown`,
    `heartbeat`), `lease_token`, and that route's other fields (`result`, `cost`, `costs`, `code`,
    `message`, `retryable`, `retry_after_ms`)."""

    job_id: str
    outcome: str
    lease_token: str
    result: Any
    cost: int
    costs: dict[str, int]
    code: str
    message: str
    retryable: bool
    retry_after_ms: int


class ItemReport(_Replayable):
    item: Item
    cancel_requested: bool


class Artifact(_Replayable):
    path: str  # {job_id}/{item_id}/{key} in the artifact store


class FailureCount(TypedDict):
    code: str
    state: str  # dead, unknown or retrying
    count: int


class Audit(TypedDict):
    ok: bool
    accounts_checked: int
    items_checked: int
    violations: list[dict[str, Any]]


class Event(TypedDict):
    seq: int
    epoch: int  # 1, raised by each restore: deduplicate by (epoch, seq)
    type: str
    job_id: str | None
    account_id: str | None
    data: Any
    created_at: str


class EventPage(TypedDict):
    events: list[Event]
    next_after: int | None
