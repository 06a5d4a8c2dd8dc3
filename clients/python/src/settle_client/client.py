"""The HTTP API v1, one method per operation (`Client`, and `AsyncClient` for asyncio).

Every answer is the API's JSON as a dict. A create that was a replay (`Idempotent-Replayed: true`:
the same id and body again) answers the resource as it is now, with `"replayed": True` added.
A worker's report (`succeed`, `fail`, `unknown`, the item reports, `register_artifact`) answers
`Applied` (it took effect now) or `Replayed` (it had already taken effect: the same report re-sent),
both dicts; a refused one raises `LeaseLost`, whose `details` say what became of the job.
Errors raise `SettleError` subclasses carrying the API's error `code`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx

from .errors import InvalidId, error_for

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


def _job_body(
    id: str,
    account_id: str,
    kind: str,
    cost: int | None,
    items: Sequence[tuple[str, int]] | None,
    payload: Any,
    max_attempts: int | None,
    refund_on: str | None,
    not_before: str | None,
) -> Json:
    if (cost is None) == (items is None):
        raise ValueError("a job has exactly one of cost and items")
    body: Json = {"id": id, "account_id": account_id, "kind": kind}
    if cost is not None:
        body["cost"] = cost
    else:
        body["items"] = [{"id": item_id, "cost": item_cost} for item_id, item_cost in items or ()]
    for name, value in (("payload", payload), ("max_attempts", max_attempts), ("refund_on", refund_on), ("not_before", not_before)):
        if value is not None:
            body[name] = value
    return body


def _fail_body(lease_token: str, code: str, message: str | None, retryable: bool | None, retry_after_ms: int | None) -> Json:
    body: Json = {"lease_token": lease_token, "code": code}
    if message is not None:
        body["message"] = message
    if retryable is not None:
        body["retryable"] = retryable
    if retry_after_ms is not None:
        body["retry_after_ms"] = retry_after_ms
    return body


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

    def _get(self, path: str, **params: Any) -> Json:
        return _body(self._http.get(path, params={k: v for k, v in params.items() if v is not None}))

    def _post(self, path: str, body: Json | None = None) -> Json:
        return _body(self._http.post(path, json=body if body is not None else {}))

    # ----- accounts -----
    def create_account(self, id: str, overdraft_limit: int | None = None) -> Json:
        body: Json = {"id": id}
        if overdraft_limit is not None:
            body["overdraft_limit"] = overdraft_limit
        return self._post("/v1/accounts", body)

    def account(self, id: str) -> Json:
        return self._get(f"/v1/accounts/{_seg(id)}")

    def grant(self, account_id: str, id: str, amount: int, reason: str | None = None) -> Json:
        body: Json = {"id": id, "amount": amount}
        if reason is not None:
            body["reason"] = reason
        return self._post(f"/v1/accounts/{_seg(account_id)}/grants", body)

    def adjust(self, account_id: str, id: str, amount: int, reason: str) -> Json:
        return self._post(f"/v1/accounts/{_seg(account_id)}/adjustments", {"id": id, "amount": amount, "reason": reason})

    def ledger(self, account_id: str, after: int = 0, limit: int | None = None) -> Json:
        return self._get(f"/v1/accounts/{_seg(account_id)}/ledger", after=after, limit=limit)

    # ----- jobs -----
    def create_job(
        self,
        id: str,
        account_id: str,
        kind: str,
        *,
        cost: int | None = None,
        items: Sequence[tuple[str, int]] | None = None,
        payload: Any = None,
        max_attempts: int | None = None,
        refund_on: str | None = None,
        not_before: str | None = None,
    ) -> Json:
        return self._post("/v1/jobs", _job_body(id, account_id, kind, cost, items, payload, max_attempts, refund_on, not_before))

    def job(self, id: str) -> Json:
        return self._get(f"/v1/jobs/{_seg(id)}")

    def jobs(self, **filters: Any) -> Iterator[Json]:
        """Every job matching `state`, `kind`, `account_id`, `fail_code`, page after page."""
        after = 0
        while True:
            page = self._get("/v1/jobs", after=after, **filters)
            yield from page["jobs"]
            if page.get("next_after") is None:
                return
            after = page["next_after"]

    def attempts(self, id: str) -> list[Json]:
        return self._get(f"/v1/jobs/{_seg(id)}/attempts")["attempts"]

    def cancel(self, id: str) -> Json:
        return self._post(f"/v1/jobs/{_seg(id)}/cancel")

    def requeue(self, id: str) -> Json:
        return self._post(f"/v1/jobs/{_seg(id)}/requeue")

    # ----- withdrawals -----
    def create_withdrawal(self, id: str, account_id: str, amount: int, destination: str) -> Json:
        return self._post("/v1/withdrawals", {"id": id, "account_id": account_id, "amount": amount, "destination": destination})

    def withdrawal(self, id: str) -> Json:
        return self._get(f"/v1/withdrawals/{_seg(id)}")

    # ----- events -----
    def events(self, after: int = 0, limit: int | None = None, wait_seconds: int | None = None) -> Json:
        return self._get("/v1/events", after=after, limit=limit, wait_seconds=wait_seconds)

    def iter_events(self, after: int = 0, wait_seconds: int = 30) -> Iterator[Json]:
        """Every event after `after`, in order, forever: long-polls when caught up."""
        while True:
            page = self.events(after=after, wait_seconds=wait_seconds)
            for event in page["events"]:
                after = event["seq"]
                yield event

    # ----- the worker protocol -----
    def claim(
        self, worker: str, kinds: Sequence[str] | None = None, limit: int = 1, lease_seconds: int | None = None, wait_seconds: int = 0
    ) -> list[Json]:
        body: Json = {"worker": worker, "limit": limit, "wait_seconds": wait_seconds}
        if kinds is not None:
            body["kinds"] = list(kinds)
        if lease_seconds is not None:
            body["lease_seconds"] = lease_seconds
        return self._post("/v1/claims", body)["jobs"]

    def heartbeat(self, id: str, lease_token: str) -> Json:
        return self._post(f"/v1/jobs/{_seg(id)}/heartbeat", {"lease_token": lease_token})

    def succeed(self, id: str, lease_token: str | None = None, result: Any = None) -> Applied | Replayed:
        body: Json = {}
        if lease_token is not None:
            body["lease_token"] = lease_token
        if result is not None:
            body["result"] = result
        return _reported(self._post(f"/v1/jobs/{_seg(id)}/succeed", body))

    def fail(
        self, id: str, lease_token: str, code: str, message: str | None = None, retryable: bool | None = None, retry_after_ms: int | None = None
    ) -> Applied | Replayed:
        return _reported(self._post(f"/v1/jobs/{_seg(id)}/fail", _fail_body(lease_token, code, message, retryable, retry_after_ms)))

    def unknown(self, id: str, lease_token: str, message: str | None = None) -> Applied | Replayed:
        body: Json = {"lease_token": lease_token}
        if message is not None:
            body["message"] = message
        return _reported(self._post(f"/v1/jobs/{_seg(id)}/unknown", body))

    def item_succeed(self, id: str, item: str, lease_token: str) -> Applied | Replayed:
        return _reported(self._post(f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/succeed", {"lease_token": lease_token}))

    def item_fail(self, id: str, item: str, lease_token: str, code: str, message: str | None = None) -> Applied | Replayed:
        body: Json = {"lease_token": lease_token, "code": code}
        if message is not None:
            body["message"] = message
        return _reported(self._post(f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/fail", body))

    def register_artifact(self, id: str, item: str, lease_token: str, key: str) -> Applied | Replayed:
        """Registers `key`; the answer's `path` is where to store the object (the job's own prefix)."""
        return _reported(self._post(f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/artifacts", {"lease_token": lease_token, "key": key}))


class AsyncClient:
    """The same API for asyncio (the worker protocol and the reads a worker needs)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 40.0):
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _get(self, path: str, **params: Any) -> Json:
        return _body(await self._http.get(path, params={k: v for k, v in params.items() if v is not None}))

    async def _post(self, path: str, body: Json | None = None) -> Json:
        return _body(await self._http.post(path, json=body if body is not None else {}))

    async def job(self, id: str) -> Json:
        return await self._get(f"/v1/jobs/{_seg(id)}")

    async def create_job(self, id: str, account_id: str, kind: str, **kw: Any) -> Json:
        return await self._post(
            "/v1/jobs",
            _job_body(id, account_id, kind, kw.get("cost"), kw.get("items"), kw.get("payload"), kw.get("max_attempts"), kw.get("refund_on"), kw.get("not_before")),
        )

    async def events(self, after: int = 0, limit: int | None = None, wait_seconds: int | None = None) -> Json:
        return await self._get("/v1/events", after=after, limit=limit, wait_seconds=wait_seconds)

    async def iter_events(self, after: int = 0, wait_seconds: int = 30) -> AsyncIterator[Json]:
        while True:
            page = await self.events(after=after, wait_seconds=wait_seconds)
            for event in page["events"]:
                after = event["seq"]
                yield event

    async def claim(
        self, worker: str, kinds: Sequence[str] | None = None, limit: int = 1, lease_seconds: int | None = None, wait_seconds: int = 0
    ) -> list[Json]:
        body: Json = {"worker": worker, "limit": limit, "wait_seconds": wait_seconds}
        if kinds is not None:
            body["kinds"] = list(kinds)
        if lease_seconds is not None:
            body["lease_seconds"] = lease_seconds
        return (await self._post("/v1/claims", body))["jobs"]

    async def heartbeat(self, id: str, lease_token: str) -> Json:
        return await self._post(f"/v1/jobs/{_seg(id)}/heartbeat", {"lease_token": lease_token})

    async def succeed(self, id: str, lease_token: str | None = None, result: Any = None) -> Applied | Replayed:
        body: Json = {}
        if lease_token is not None:
            body["lease_token"] = lease_token
        if result is not None:
            body["result"] = result
        return _reported(await self._post(f"/v1/jobs/{_seg(id)}/succeed", body))

    async def fail(
        self, id: str, lease_token: str, code: str, message: str | None = None, retryable: bool | None = None, retry_after_ms: int | None = None
    ) -> Applied | Replayed:
        return _reported(await self._post(f"/v1/jobs/{_seg(id)}/fail", _fail_body(lease_token, code, message, retryable, retry_after_ms)))

    async def unknown(self, id: str, lease_token: str, message: str | None = None) -> Applied | Replayed:
        body: Json = {"lease_token": lease_token}
        if message is not None:
            body["message"] = message
        return _reported(await self._post(f"/v1/jobs/{_seg(id)}/unknown", body))

    async def item_succeed(self, id: str, item: str, lease_token: str) -> Applied | Replayed:
        return _reported(await self._post(f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/succeed", {"lease_token": lease_token}))

    async def item_fail(self, id: str, item: str, lease_token: str, code: str, message: str | None = None) -> Applied | Replayed:
        body: Json = {"lease_token": lease_token, "code": code}
        if message is not None:
            body["message"] = message
        return _reported(await self._post(f"/v1/jobs/{_seg(id)}/items/{_seg(item)}/fail", body))
