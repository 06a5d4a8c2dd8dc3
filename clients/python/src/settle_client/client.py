"""The HTTP API v1, one method per operation (`Client`, and `AsyncClient` for asyncio).

Every answer is the API's JSON as a dict. A create that was a replay (`Idempotent-Replayed: true`:
the same id and body again) answers the resource as it is now, with `"replayed": True` added.
A worker's report (`succeed`, `fail`, `unknown`, `release`, the item reports,
`register_artifact`) answers `Applied` (it took effect now) or `Replayed` (it had already taken
effect: the same report re-sent), both dicts; a refused one raises `LeaseLost`, whose `details` say
what became of the job.
Errors raise `SettleError` subclasses carrying the API's error `code`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .errors import InvalidId, SettleError, error_for
from .models import (
    Account,
    AlertList,
    LimitList,
    NewLimit,
    Attempt,
    Audit,
    ClaimedJob,
    EventPage,
    FailureCount,
    GrantPage,
    Heartbeat,
    Job,
    JobBrief,
    LedgerEntry,
    Report,
    LedgerPage,
    AutoTopUp,
    TopUp,
    Withdrawal,
)

_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


def _seg(value: str) -> str:
    """An id as one URL path segment, refused unless it follows the API's id rule.

    URL clients (httpx among them) remove `.` and `..` segments, so `items/../succeed` would be sent
    as the job's own `succeed`. Settle refuses such ids when they are created; meeting one here is
    the caller's mistake, and nothing is sent.
    """
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= 128
        or not set(value) <= _ID_CHARS
        or value in (".", "..")
    ):
        raise InvalidId(f"{value!r} is not an id: 1-128 characters of [A-Za-z0-9_.:-], and not '.' or '..'")
    return value

Json = dict[str, Any]


def _body(response: httpx.Response) -> Json:
    try:
        body = response.json() if response.content else {}
    except ValueError:
        body = {}
    if response.status_code >= 400:
        raise error_for(response.status_code, body, response.headers.get("retry-after"))
    if isinstance(body, dict) and response.headers.get("idempotent-replayed") == "true":
        body["replayed"] = True
    return body


class Applied(dict):
    """A worker's report that took effect now: the resource as it is after."""

    replayed = False


class Replayed(dict):
    """A worker's report that had already taken effect (the same report re-sent after its answer
    was lost): the resource as it is now; nothing changed."""

    replayed = True


def _reported(body: Json) -> Applied | Replayed:
    return Replayed(body) if body.get("replayed") else Applied(body)


def _report_results(body: Json) -> list[Any]:
    """Each report's answer as its single route's call would give it, in order: `Applied` or
    `Replayed` (the job in brief), a `Heartbeat`, or the `SettleError` it would have raised."""
    out: list[Any] = []
    for r in body["results"]:
        if r["status"] != 200:
            out.append(error_for(r["status"], {"error": r["error"]}, "1" if r["status"] == 503 else None))
        elif "heartbeat" in r:
            out.append(r["heartbeat"])
        else:
            out.append(_reported(r["job"] | {"replayed": bool(r.get("replayed"))}))
    return out


@dataclass(frozen=True)
class _Req:
    """One operation's request and how its answer is read: built once here, sent by `Client`
    (blocking) or `AsyncClient` (awaited), so the two cannot drift apart."""

    method: str
    path: str
    body: Json | None = None
    params: dict[str, Any] = field(default_factory=dict)
    then: Callable[[Json], Any] = lambda body: body


KEEP: Any = object()
"""`update_account`'s default for a field it leaves as it is (`None` means "remove")."""


def _drop_none(**fields: Any) -> Json:
    return {k: v for k, v in fields.items() if v is not None}


class _ops:
    """Every operation of the API both clients offer, as the request it sends (docs/api.md)."""

    @staticmethod
    def create_account(id: str, overdraft_limit: int | None, max_running: int | None) -> _Req:
        return _Req("POST", "/v1/accounts", _drop_none(id=id, overdraft_limit=overdraft_limit, max_running=max_running))

    @staticmethod
    def update_account(id: str, overdraft_limit: int | None, max_running: Any) -> _Req:
        body = _drop_none(overdraft_limit=overdraft_limit)
        if max_running is not KEEP:
            body["max_running"] = max_running
        return _Req("PATCH", f"/v1/accounts/{_seg(id)}", body)

    @staticmethod
    def set_alerts(account_id: str, alerts: Sequence[tuple[str, int]]) -> _Req:
        body = {"alerts": [{"id": id, "below": below} for id, below in alerts]}
        return _Req("PUT", f"/v1/accounts/{_seg(account_id)}/alerts", body)

    @staticmethod
    def alerts(account_id: str) -> _Req:
        return _Req("GET", f"/v1/accounts/{_seg(account_id)}/alerts")

    @staticmethod
    def set_limits(account_id: str, limits: Sequence[NewLimit]) -> _Req:
        return _Req("PUT", f"/v1/accounts/{_seg(account_id)}/limits", {"limits": list(limits)})

    @staticmethod
    def limits(account_id: str) -> _Req:
        return _Req("GET", f"/v1/accounts/{_seg(account_id)}/limits")

    @staticmethod
    def set_auto_top_up(
        account_id: str, below: int, credits: int, price: int, currency: str, customer: str, monthly_credits_max: int
    ) -> _Req:
        rule = {
            "below": below,
            "credits": credits,
            "price": price,
            "currency": currency,
            "customer": customer,
            "monthly_credits_max": monthly_credits_max,
        }
        return _Req("PUT", f"/v1/accounts/{_seg(account_id)}/auto-top-up", rule)

    @staticmethod
    def auto_top_up(account_id: str) -> _Req:
        return _Req("GET", f"/v1/accounts/{_seg(account_id)}/auto-top-up")

    @staticmethod
    def delete_auto_top_up(account_id: str) -> _Req:
        return _Req("DELETE", f"/v1/accounts/{_seg(account_id)}/auto-top-up", then=lambda body: None)

    @staticmethod
    def account(id: str) -> _Req:
        return _Req("GET", f"/v1/accounts/{_seg(id)}")

    @staticmethod
    def grant(
        account_id: str, id: str, amount: int, reason: str | None, expires_at: str | None, priority: int | None
    ) -> _Req:
        body = _drop_none(id=id, amount=amount, reason=reason, expires_at=expires_at, priority=priority)
        return _Req("POST", f"/v1/accounts/{_seg(account_id)}/grants", body)

    @staticmethod
    def grants(account_id: str, after: int, limit: int | None) -> _Req:
        return _Req("GET", f"/v1/accounts/{_seg(account_id)}/grants", params=_drop_none(after=after, limit=limit))

    @staticmethod
    def adjust(account_id: str, id: str, amount: int, reason: str) -> _Req:
        return _Req("POST", f"/v1/accounts/{_seg(account_id)}/adjustments", {"id": id, "amount": amount, "reason": reason})

    @staticmethod
    def ledger(account_id: str, after: int, limit: int | None) -> _Req:
        return _Req("GET", f"/v1/accounts/{_seg(account_id)}/ledger", params=_drop_none(after=after, limit=limit))

    @staticmethod
    def create_job(
        id: str,
        account_id: str,
        kind: str,
        cost: int | None,
        hold: int | None,
        items: Sequence[tuple[str, int] | Json] | None,
        payload: Any,
        max_attempts: int | None,
        refund_on: str | None,
        not_before: str | None,
        priority: int | None = None,
        requires: Sequence[str] | None = None,
    ) -> _Req:
        if sum(x is not None for x in (cost, hold, items)) != 1:
            raise ValueError("a job has exactly one of cost, hold and items")
        body: Json = {"id": id, "account_id": account_id, "kind": kind}
        if cost is not None:
            body["cost"] = cost
        elif hold is not None:
            body["hold"] = hold
        else:
            # (id, cost) for a fixed price, or {"id": …, "hold": …} for a held item.
            body["items"] = [dict(i) if isinstance(i, dict) else {"id": i[0], "cost": i[1]} for i in items or ()]
        body |= _drop_none(
            payload=payload,
            max_attempts=max_attempts,
            refund_on=refund_on,
            not_before=not_before,
            priority=priority,
            requires=None if requires is None else list(requires),
        )
        return _Req("POST", "/v1/jobs", body)

    @staticmethod
    def job(id: str) -> _Req:
        return _Req("GET", f"/v1/jobs/{_seg(id)}")

    @staticmethod
    def jobs_page(after: int, filters: dict[str, Any]) -> _Req:
        return _Req("GET", "/v1/jobs", params=_drop_none(after=after, **filters))

    @staticmethod
    def attempts(id: str) -> _Req:
        return _Req("GET", f"/v1/jobs/{_seg(id)}/attempts", then=lambda body: body["attempts"])

    @staticmethod
    def cancel(id: str) -> _Req:
        return _Req("POST", f"/v1/jobs/{_seg(id)}/cancel")

    @staticmethod
    def requeue(id: str) -> _Req:
        return _Req("POST", f"/v1/jobs/{_seg(id)}/requeue")

    @staticmethod
    def create_withdrawal(id: str, account_id: str, amount: int, destination: str) -> _Req:
        return _Req("POST", "/v1/withdrawals", {"id": id, "account_id": account_id, "amount": amount, "destination": destination})

    @staticmethod
    def withdrawal(id: str) -> _Req:
        return _Req("GET", f"/v1/withdrawals/{_seg(id)}")

    @staticmethod
    def create_top_up(id: str, account_id: str, credits: int, price: int, currency: str, customer: str) -> _Req:
        body = {"id": id, "account_id": account_id, "credits": credits, "price": price, "currency": currency, "customer": customer}
        return _Req("POST", "/v1/top-ups", body)

    @staticmethod
    def top_up(id: str) -> _Req:
        return _Req("GET", f"/v1/top-ups/{_seg(id)}")

    @staticmethod
    def top_ups(account_id: str | None = None, state: str | None = None) -> _Req:
        query = {k: v for k, v in (("account_id", account_id), ("state", state)) if v is not None}
        return _Req("GET", "/v1/top-ups", params=query, then=lambda body: body["top_ups"])

    @staticmethod
    def failures() -> _Req:
        return _Req("GET", "/v1/failures/summary", then=lambda body: body["by_code"])

    @staticmethod
    def audit() -> _Req:
        return _Req("GET", "/v1/audit")

    @staticmethod
    def events(after: int, limit: int | None, wait_seconds: int | None) -> _Req:
        return _Req("GET", "/v1/events", params=_drop_none(after=after, limit=limit, wait_seconds=wait_seconds))

    @staticmethod
    def claim(
        worker: str,
        kinds: Sequence[str] | None,
        limit: int,
        lease_seconds: int | None,
        wait_seconds: int,
        labels: Sequence[str] | None = None,
    ) -> _Req:
        body = {"worker": worker, "limit": limit, "wait_seconds": wait_seconds}
        body |= _drop_none(
            kinds=None if kinds is None else list(kinds),
            lease_seconds=lease_seconds,
            labels=None if labels is None else list(labels),
        )
        return _Req("POST", "/v1/claims", body, then=lambda body: body["jobs"])

    @staticmethod
    def heartbeat(id: str, lease_token: str) -> _Req:
        return _Req("POST", f"/v1/jobs/{_seg(id)}/heartbeat", {"lease_token": lease_token})

    # The reports: each answers Applied or Replayed.
    @staticmethod
    def succeed(id: str, lease_token: str | None, result: Any, cost: int | None = None, costs: dict[str, int] | None = None) -> _Req:
        body = _drop_none(lease_token=lease_token, result=result, cost=cost, costs=costs)
        return _Req("POST", f"/v1/jobs/{_seg(id)}/succeed", body, then=_reported)

    @staticmethod
    def fail(id: str, lease_token: str, code: str, message: str | None, retryable: bool | None, retry_after_ms: int | None) -> _Req:
        body = {"lease_token": lease_token, "code": code} | _drop_none(
            message=message, retryable=retryable, retry_after_ms=retry_after_ms
        )
        return _Req("POST", f"/v1/jobs/{_seg(id)}/fail", body, then=_reported)

    @staticmethod
    def unknown(id: str, lease_token: str, message: str | None) -> _Req:
        body = {"lease_token": lease_token} | _drop_none(message=message)
        return _Req("POST", f"/v1/jobs/{_seg(id)}/unknown", body, then=_reported)

    @staticmethod
    def release(id: str, lease_token: str) -> _Req:
        return _Req("POST", f"/v1/jobs/{_seg(id)}/release", {"lease_token": lease_token}, then=_reported)

    @staticmethod
    def report(reports: Sequence[Report]) -> _Req:
        for r in reports:
            _seg(r["job_id"])
        return _Req("POST", "/v1/reports", {"reports": [dict(r) for r in reports]}, then=_report_results)

    @staticmethod
    def item_succeed(id: str, item: str, lease_token: str, cost: int | None = None) -> _Req:
        body = {"lease_token": lease_token} | _drop_none(cost=cost)
        return _Req("POST", f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/succeed", body, then=_reported)

    @staticmethod
    def item_fail(id: str, item: str, lease_token: str, code: str, message: str | None) -> _Req:
        body = {"lease_token": lease_token, "code": code} | _drop_none(message=message)
        return _Req("POST", f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/fail", body, then=_reported)

    @staticmethod
    def register_artifact(id: str, item: str, lease_token: str, key: str) -> _Req:
        body = {"lease_token": lease_token, "key": key}
        return _Req("POST", f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/artifacts", body, then=_reported)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}



class Client:
    """A synchronous client. `token` is a bearer token of the role the calls need (admin, client
    or worker); without tokens configured the server takes none on loopback."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 40.0, http: httpx.Client | None = None):
        self._http = http or httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, req: _Req) -> Any:
        body = {} if req.body is None and req.method == "POST" else req.body
        return req.then(_body(self._http.request(req.method, req.path, params=req.params, json=body)))

    # ----- accounts -----
    def create_account(self, id: str, overdraft_limit: int | None = None, max_running: int | None = None) -> Account:
        """`max_running`: the most of the account's jobs that may run at once (no cap when absent)."""
        return self._send(_ops.create_account(id, overdraft_limit, max_running))

    def update_account(self, id: str, overdraft_limit: int | None = None, max_running: Any = KEEP) -> Account:
        """Sets what is given: `max_running=None` removes the cap; leaving it out keeps it."""
        return self._send(_ops.update_account(id, overdraft_limit, max_running))

    def account(self, id: str) -> Account:
        return self._send(_ops.account(id))

    def set_alerts(self, account_id: str, alerts: Sequence[tuple[str, int]]) -> AlertList:
        """Replaces the account's balance alerts with `(id, below)` pairs (at most 16; empty removes
        them). Each fires `account.balance_low` once when a posting takes the balance under `below`,
        `account.balance_recovered` once when one takes it back; setting them fires nothing."""
        return self._send(_ops.set_alerts(account_id, alerts))

    def alerts(self, account_id: str) -> AlertList:
        return self._send(_ops.alerts(account_id))

    def set_limits(self, account_id: str, limits: Sequence[NewLimit]) -> LimitList:
        """Replaces the account's spend limits (at most 16; empty removes them): each bounds what a
        UTC `day` or `month` may spend through creates on its `kinds` (none: every kind but
        withdrawal). A create past one raises `SettleError` with code `spend_limit_exceeded` and
        `details` {period, amount, spent, remaining, kinds, needed}, having written nothing."""
        return self._send(_ops.set_limits(account_id, limits))

    def limits(self, account_id: str) -> LimitList:
        return self._send(_ops.limits(account_id))

    def grant(
        self,
        account_id: str,
        id: str,
        amount: int,
        reason: str | None = None,
        *,
        expires_at: str | None = None,
        priority: int | None = None,
    ) -> LedgerEntry:
        """Credits an account. ``expires_at`` (RFC 3339, in the future): what is left then expires;
        ``priority`` (0-100, default 50): charges take from the lowest first."""
        return self._send(_ops.grant(account_id, id, amount, reason, expires_at, priority))

    def grants(self, account_id: str, after: int = 0, limit: int | None = None) -> GrantPage:
        """The account's grants in the order they were made, each with what it has left."""
        return self._send(_ops.grants(account_id, after, limit))

    def adjust(self, account_id: str, id: str, amount: int, reason: str) -> LedgerEntry:
        return self._send(_ops.adjust(account_id, id, amount, reason))

    def ledger(self, account_id: str, after: int = 0, limit: int | None = None) -> LedgerPage:
        return self._send(_ops.ledger(account_id, after, limit))

    # ----- jobs -----
    def create_job(
        self,
        id: str,
        account_id: str,
        kind: str,
        *,
        cost: int | None = None,
        hold: int | None = None,
        items: Sequence[tuple[str, int] | Json] | None = None,
        payload: Any = None,
        max_attempts: int | None = None,
        refund_on: str | None = None,
        not_before: str | None = None,
        priority: int | None = None,
        requires: Sequence[str] | None = None,
    ) -> Job:
        """`priority`: 0 to 100 (default 50), lower claimed first; `requires`: labels a worker must have."""
        return self._send(
            _ops.create_job(id, account_id, kind, cost, hold, items, payload, max_attempts, refund_on, not_before, priority, requires)
        )

    def job(self, id: str) -> Job:
        return self._send(_ops.job(id))

    def jobs(self, **filters: Any) -> Iterator[Job]:
        """Every job matching `state`, `kind`, `account_id`, `fail_code`, page after page."""
        after = 0
        while True:
            page = self._send(_ops.jobs_page(after, filters))
            yield from page["jobs"]
            if page.get("next_after") is None:
                return
            after = page["next_after"]

    def attempts(self, id: str) -> list[Attempt]:
        return self._send(_ops.attempts(id))

    def cancel(self, id: str) -> Job:
        return self._send(_ops.cancel(id))

    def requeue(self, id: str) -> Job:
        return self._send(_ops.requeue(id))

    # ----- withdrawals -----
    def create_withdrawal(self, id: str, account_id: str, amount: int, destination: str) -> Withdrawal:
        return self._send(_ops.create_withdrawal(id, account_id, amount, destination))

    def withdrawal(self, id: str) -> Withdrawal:
        return self._send(_ops.withdrawal(id))

    # ----- top-ups -----
    def create_top_up(self, id: str, account_id: str, credits: int, price: int, currency: str, customer: str) -> TopUp:
        """Buys `credits` for `price` minor units of `currency`, charged to the funding provider's
        `customer`. Nothing is charged to the account; the credits are granted when the charge is
        confirmed. Idempotent by `id`."""
        return self._send(_ops.create_top_up(id, account_id, credits, price, currency, customer))

    def top_up(self, id: str) -> TopUp:
        return self._send(_ops.top_up(id))

    def top_ups(self, account_id: str | None = None, state: str | None = None) -> list[TopUp]:
        """The first page of top-ups, in creation order."""
        return self._send(_ops.top_ups(account_id, state))

    def set_auto_top_up(
        self, account_id: str, below: int, credits: int, price: int, currency: str, customer: str, monthly_credits_max: int
    ) -> AutoTopUp:
        """The account's one auto top-up rule: a posting that takes the balance under `below` buys
        `credits`, unless a top-up is in flight or the month's count would pass
        `monthly_credits_max`. Putting it turns a paused rule on again; it fires nothing by itself."""
        return self._send(_ops.set_auto_top_up(account_id, below, credits, price, currency, customer, monthly_credits_max))

    def auto_top_up(self, account_id: str) -> AutoTopUp:
        return self._send(_ops.auto_top_up(account_id))

    def delete_auto_top_up(self, account_id: str) -> None:
        self._send(_ops.delete_auto_top_up(account_id))

    # ----- operations -----
    def failures(self) -> list[FailureCount]:
        """Jobs now dead, unknown or waiting to retry, by their last fail code and state."""
        return self._send(_ops.failures())

    def audit(self) -> Audit:
        """The invariants L1-L6 checked over the whole ledger (admin)."""
        return self._send(_ops.audit())

    # ----- events -----
    def events(self, after: int = 0, limit: int | None = None, wait_seconds: int | None = None) -> EventPage:
        return self._send(_ops.events(after, limit, wait_seconds))

    def iter_events(self, after: int = 0, wait_seconds: int = 30) -> Iterator[Json]:
        """Every event after `after`, in order, forever: long-polls when caught up. After the store
        was restored from a backup (a cursor past its last event), it goes on from where the new
        epoch begins: deduplicate by (`epoch`, `seq`)."""
        while True:
            try:
                page = self.events(after=after, wait_seconds=wait_seconds)
            except SettleError as e:
                if e.code != "cursor_ahead":
                    raise
                after = int(e.details["restart_after"])
                continue
            for event in page["events"]:
                after = event["seq"]
                yield event

    # ----- the worker protocol -----
    def claim(
        self, worker: str, kinds: Sequence[str] | None = None, limit: int = 1, lease_seconds: int | None = None, wait_seconds: int = 0,
        labels: Sequence[str] | None = None,
    ) -> list[ClaimedJob]:
        return self._send(_ops.claim(worker, kinds, limit, lease_seconds, wait_seconds, labels))

    def heartbeat(self, id: str, lease_token: str) -> Heartbeat:
        return self._send(_ops.heartbeat(id, lease_token))

    def succeed(
        self, id: str, lease_token: str | None = None, result: Any = None, cost: int | None = None, costs: dict[str, int] | None = None
    ) -> Applied | Replayed:
        """`cost` prices a held job's `main` item, `costs` each held item by id (what the work used,
        at most the hold): required for every held item this success decides."""
        return self._send(_ops.succeed(id, lease_token, result, cost, costs))

    def fail(
        self, id: str, lease_token: str, code: str, message: str | None = None, retryable: bool | None = None, retry_after_ms: int | None = None
    ) -> Applied | Replayed:
        return self._send(_ops.fail(id, lease_token, code, message, retryable, retry_after_ms))

    def unknown(self, id: str, lease_token: str, message: str | None = None) -> Applied | Replayed:
        return self._send(_ops.unknown(id, lease_token, message))

    def release(self, id: str, lease_token: str) -> Applied | Replayed:
        """Hands the job back at an item boundary (a worker that must stop): it is queued again, due
        at once; this attempt closes `released` and does not count toward `max_attempts`; no money
        moves. When a cancel was requested the job is torn down instead (`cancelling`/`cancelled`)."""
        return self._send(_ops.release(id, lease_token))

    def report(self, reports: Sequence[Report]) -> list[Applied | Replayed | Heartbeat | SettleError]:
        """Many reports in one request (`POST /v1/reports`, 1 to 100, each on another job): each its
        own transition, answered in order with what its single call would give — `Applied` or
        `Replayed` (the job in brief: `JobBrief`), a `Heartbeat`, or the `SettleError` that call
        would have raised, returned, not raised. A `503` among them may yet take effect: send it
        again. A request refused whole (`400`, nothing written) raises."""
        return self._send(_ops.report(reports))

    def item_succeed(self, id: str, item: str, lease_token: str, cost: int | None = None) -> Applied | Replayed:
        """`cost` is a held item's price (required then, at most its hold)."""
        return self._send(_ops.item_succeed(id, item, lease_token, cost))

    def item_fail(self, id: str, item: str, lease_token: str, code: str, message: str | None = None) -> Applied | Replayed:
        return self._send(_ops.item_fail(id, item, lease_token, code, message))

    def register_artifact(self, id: str, item: str, lease_token: str, key: str) -> Applied | Replayed:
        """Registers `key`; the answer's `path` is where to store the object (the job's own prefix)."""
        return self._send(_ops.register_artifact(id, item, lease_token, key))


class AsyncClient:
    """`Client` for asyncio: the same operations, each awaited (a test holds the two to one set)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 40.0, http: httpx.AsyncClient | None = None):
        self._http = http or httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, req: _Req) -> Any:
        body = {} if req.body is None and req.method == "POST" else req.body
        return req.then(_body(await self._http.request(req.method, req.path, params=req.params, json=body)))

    # ----- accounts -----
    async def create_account(
        self, id: str, overdraft_limit: int | None = None, max_running: int | None = None
    ) -> Account:
        return await self._send(_ops.create_account(id, overdraft_limit, max_running))

    async def update_account(self, id: str, overdraft_limit: int | None = None, max_running: Any = KEEP) -> Account:
        return await self._send(_ops.update_account(id, overdraft_limit, max_running))

    async def account(self, id: str) -> Account:
        return await self._send(_ops.account(id))

    async def set_alerts(self, account_id: str, alerts: Sequence[tuple[str, int]]) -> AlertList:
        return await self._send(_ops.set_alerts(account_id, alerts))

    async def alerts(self, account_id: str) -> AlertList:
        return await self._send(_ops.alerts(account_id))

    async def set_limits(self, account_id: str, limits: Sequence[NewLimit]) -> LimitList:
        return await self._send(_ops.set_limits(account_id, limits))

    async def limits(self, account_id: str) -> LimitList:
        return await self._send(_ops.limits(account_id))

    async def grant(
        self,
        account_id: str,
        id: str,
        amount: int,
        reason: str | None = None,
        *,
        expires_at: str | None = None,
        priority: int | None = None,
    ) -> LedgerEntry:
        """Credits an account. ``expires_at`` (RFC 3339, in the future): what is left then expires;
        ``priority`` (0-100, default 50): charges take from the lowest first."""
        return await self._send(_ops.grant(account_id, id, amount, reason, expires_at, priority))

    async def grants(self, account_id: str, after: int = 0, limit: int | None = None) -> GrantPage:
        """The account's grants in the order they were made, each with what it has left."""
        return await self._send(_ops.grants(account_id, after, limit))

    async def adjust(self, account_id: str, id: str, amount: int, reason: str) -> LedgerEntry:
        return await self._send(_ops.adjust(account_id, id, amount, reason))

    async def ledger(self, account_id: str, after: int = 0, limit: int | None = None) -> LedgerPage:
        return await self._send(_ops.ledger(account_id, after, limit))

    # ----- jobs -----
    async def create_job(
        self,
        id: str,
        account_id: str,
        kind: str,
        *,
        cost: int | None = None,
        hold: int | None = None,
        items: Sequence[tuple[str, int] | Json] | None = None,
        payload: Any = None,
        max_attempts: int | None = None,
        refund_on: str | None = None,
        not_before: str | None = None,
        priority: int | None = None,
        requires: Sequence[str] | None = None,
    ) -> Job:
        """`priority`: 0 to 100 (default 50), lower claimed first; `requires`: labels a worker must have."""
        return await self._send(
            _ops.create_job(id, account_id, kind, cost, hold, items, payload, max_attempts, refund_on, not_before, priority, requires)
        )

    async def job(self, id: str) -> Job:
        return await self._send(_ops.job(id))

    async def jobs(self, **filters: Any) -> AsyncIterator[Job]:
        """Every job matching `state`, `kind`, `account_id`, `fail_code`, page after page."""
        after = 0
        while True:
            page = await self._send(_ops.jobs_page(after, filters))
            for job in page["jobs"]:
                yield job
            if page.get("next_after") is None:
                return
            after = page["next_after"]

    async def attempts(self, id: str) -> list[Attempt]:
        return await self._send(_ops.attempts(id))

    async def cancel(self, id: str) -> Job:
        return await self._send(_ops.cancel(id))

    async def requeue(self, id: str) -> Job:
        return await self._send(_ops.requeue(id))

    # ----- withdrawals -----
    async def create_withdrawal(self, id: str, account_id: str, amount: int, destination: str) -> Withdrawal:
        return await self._send(_ops.create_withdrawal(id, account_id, amount, destination))

    async def withdrawal(self, id: str) -> Withdrawal:
        return await self._send(_ops.withdrawal(id))

    # ----- top-ups -----
    async def create_top_up(self, id: str, account_id: str, credits: int, price: int, currency: str, customer: str) -> TopUp:
        return await self._send(_ops.create_top_up(id, account_id, credits, price, currency, customer))

    async def top_up(self, id: str) -> TopUp:
        return await self._send(_ops.top_up(id))

    async def top_ups(self, account_id: str | None = None, state: str | None = None) -> list[TopUp]:
        return await self._send(_ops.top_ups(account_id, state))

    async def set_auto_top_up(
        self, account_id: str, below: int, credits: int, price: int, currency: str, customer: str, monthly_credits_max: int
    ) -> AutoTopUp:
        return await self._send(
            _ops.set_auto_top_up(account_id, below, credits, price, currency, customer, monthly_credits_max)
        )

    async def auto_top_up(self, account_id: str) -> AutoTopUp:
        return await self._send(_ops.auto_top_up(account_id))

    async def delete_auto_top_up(self, account_id: str) -> None:
        await self._send(_ops.delete_auto_top_up(account_id))

    # ----- operations -----
    async def failures(self) -> list[FailureCount]:
        """Jobs now dead, unknown or waiting to retry, by their last fail code and state."""
        return await self._send(_ops.failures())

    async def audit(self) -> Audit:
        """The invariants L1-L6 checked over the whole ledger (admin)."""
        return await self._send(_ops.audit())

    # ----- events -----
    async def events(self, after: int = 0, limit: int | None = None, wait_seconds: int | None = None) -> EventPage:
        return await self._send(_ops.events(after, limit, wait_seconds))

    async def iter_events(self, after: int = 0, wait_seconds: int = 30) -> AsyncIterator[Json]:
        """Every event after `after`, in order, forever: long-polls when caught up. After the store
        was restored from a backup (a cursor past its last event), it goes on from where the new
        epoch begins: deduplicate by (`epoch`, `seq`)."""
        while True:
            try:
                page = await self.events(after=after, wait_seconds=wait_seconds)
            except SettleError as e:
                if e.code != "cursor_ahead":
                    raise
                after = int(e.details["restart_after"])
                continue
            for event in page["events"]:
                after = event["seq"]
                yield event

    # ----- the worker protocol -----
    async def claim(
        self, worker: str, kinds: Sequence[str] | None = None, limit: int = 1, lease_seconds: int | None = None, wait_seconds: int = 0,
        labels: Sequence[str] | None = None,
    ) -> list[ClaimedJob]:
        return await self._send(_ops.claim(worker, kinds, limit, lease_seconds, wait_seconds, labels))

    async def heartbeat(self, id: str, lease_token: str) -> Heartbeat:
        return await self._send(_ops.heartbeat(id, lease_token))

    async def succeed(
        self, id: str, lease_token: str | None = None, result: Any = None, cost: int | None = None, costs: dict[str, int] | None = None
    ) -> Applied | Replayed:
        """`cost` prices a held job's `main` item, `costs` each held item by id (what the work used,
        at most the hold): required for every held item this success decides."""
        return await self._send(_ops.succeed(id, lease_token, result, cost, costs))

    async def fail(
        self, id: str, lease_token: str, code: str, message: str | None = None, retryable: bool | None = None, retry_after_ms: int | None = None
    ) -> Applied | Replayed:
        return await self._send(_ops.fail(id, lease_token, code, message, retryable, retry_after_ms))

    async def unknown(self, id: str, lease_token: str, message: str | None = None) -> Applied | Replayed:
        return await self._send(_ops.unknown(id, lease_token, message))

    async def release(self, id: str, lease_token: str) -> Applied | Replayed:
        """Hands the job back at an item boundary (a worker that must stop): it is queued again, due
        at once; this attempt closes `released` and does not count toward `max_attempts`; no money
        moves. When a cancel was requested the job is torn down instead (`cancelling`/`cancelled`)."""
        return await self._send(_ops.release(id, lease_token))

    async def report(self, reports: Sequence[Report]) -> list[Applied | Replayed | Heartbeat | SettleError]:
        return await self._send(_ops.report(reports))

    async def item_succeed(self, id: str, item: str, lease_token: str, cost: int | None = None) -> Applied | Replayed:
        """`cost` is a held item's price (required then, at most its hold)."""
        return await self._send(_ops.item_succeed(id, item, lease_token, cost))

    async def item_fail(self, id: str, item: str, lease_token: str, code: str, message: str | None = None) -> Applied | Replayed:
        return await self._send(_ops.item_fail(id, item, lease_token, code, message))

    async def register_artifact(self, id: str, item: str, lease_token: str, key: str) -> Applied | Replayed:
        """Registers `key`; the answer's `path` is where to store the object (the job's own prefix)."""
        return await self._send(_ops.register_artifact(id, item, lease_token, key))
