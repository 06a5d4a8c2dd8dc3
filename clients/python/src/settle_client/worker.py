"""Workers: claim jobs of a kind (long-poll), heartbeat on a thread within the lease, report items
one by one, stop at the item boundary when a cancel arrives or the worker is stopped, and report
the outcome.

    def render(job: JobContext):
        for item in job.items_to_do():
            make_frame(job.payload, item["id"])
            if job.item_done(item["id"]) is Flow.STOP:  # a cancel, or the worker is stopping
                return Cancelled()
        return Succeeded({"frames": len(job.items)})

    Worker(Client(url, token), kind="render", handler=render).run(handle_signals=True)

A handler returns `Succeeded(result)`, `Failed(code, ...)`, `Unknown(message)`, `Cancelled()` or
`Released()` (or `None` for a plain success); an exception it raises is reported as a retryable
failure with code `WORKER_ERROR`.

`Worker.stop()` (also SIGTERM or SIGINT with `run(handle_signals=True)`; `AsyncWorker.stop()`)
stops claiming, and the job in hand stops after the item in progress: that item's report
(`item_done`/`item_failed`) answers `Flow.STOP` and `job.stopping` turns true — as a cancel is
learnt — and the handler's `Cancelled()` is then reported as a release (`Client.release`): the job
is queued again, due at once, this attempt closes `released` and does not count toward
`max_attempts`, no money moves; the items it reported stay as reported, and the next attempt's
`items_to_do()` leaves the delivered ones out. When a cancel was requested (`job.cancel_requested`),
`Cancelled()` is the failure `CANCELLED` as ever, and the job is cancelled. A handler that finished
its items and returns `Succeeded` is reported a success. A handler that reports no items has no
item boundary: it runs to its end and its outcome is reported as it says. A job a claim in flight
brought after `stop()` is released untouched. The heartbeat goes on until the report is answered.
A worker killed outright leaves its lease to lapse: the server rescues the job and the ledger stays
exact.

A worker rides out a server that is down or busy (connection errors, timeouts, `429`, `5xx`):
claims, heartbeats and reports are retried with capped exponential backoff and full jitter, one
log line when the outage starts and one when it ends. A report is re-sent as it was first sent, so
a report whose answer was lost is answered as a replay (decision 0019); a lease that ran out
meanwhile is answered `LeaseLost`, and the server has rescued the job. A refused token (`401`,
`403`) stops `run()` with `Unauthorized` or `Forbidden`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .client import AsyncClient, Client, Json
from .errors import Forbidden, InvalidTransition, LeaseLost, SettleError, Unauthorized
from .models import ItemState, JobState, RefundReason

log = logging.getLogger("settle_client.worker")

#: The longest wait between two tries while Settle does not answer.
BACKOFF_MAX_SECONDS = 10.0
#: How long a report is re-sent before the worker gives up on it (the lease lapses; the server
#: rescues the job).
REPORT_PATIENCE_SECONDS = 900.0


def _transient(e: BaseException) -> bool:
    """Whether trying again later may succeed: no answer at all, or the server said so."""
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, SettleError) and (e.status == 429 or e.status >= 500)


def _backoff(failures: int, retry_after: float | None = None) -> float:
    """Capped exponential backoff with full jitter (0.2 s · 2^n, at most 10 s), at least what the
    server asked for."""
    wait = random.uniform(0, min(BACKOFF_MAX_SECONDS, 0.2 * 2 ** min(failures, 16)))
    return max(wait, retry_after or 0.0)


class _Outage:
    """One log line when Settle stops answering and one when it answers again — not one per try."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._lock = threading.Lock()

    def failed(self, what: str, e: BaseException) -> None:
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()
                log.warning("Settle does not answer (%s: %s); retrying with backoff", what, e)

    def answered(self) -> None:
        with self._lock:
            if self._since is not None:
                log.warning("Settle answers again after %.1f s", time.monotonic() - self._since)
                self._since = None


def _labels(given: Sequence[str] | None) -> list[str]:
    """A worker's labels: as given, else from `SETTLE_WORKER_LABELS` (comma-separated)."""
    if given is not None:
        return list(given)
    return [label.strip() for label in os.environ.get("SETTLE_WORKER_LABELS", "").split(",") if label.strip()]


def _retrying(call: Callable[[], Any], what: str, outage: _Outage, patience: float = REPORT_PATIENCE_SECONDS) -> Any:
    """`call()` until it answers (or fails for good): a report re-sent as it was first sent."""
    deadline, failures = time.monotonic() + patience, 0
    while True:
        try:
            answer = call()
        except Exception as e:
            if not _transient(e) or time.monotonic() >= deadline:
                raise
            outage.failed(what, e)
            failures += 1
            time.sleep(_backoff(failures, getattr(e, "retry_after", None)))
            continue
        outage.answered()
        return answer


def _claim_failed(outage: _Outage, failures: int, e: Exception) -> float:
    """What a failed claim means: stop (a refused token, or an error that is not Settle's answer),
    or how long to wait before the next claim."""
    if isinstance(e, (Unauthorized, Forbidden)):
        log.error("Settle refused the worker's token (%s): stopping", e)
        raise e
    if _transient(e):
        outage.failed("claim", e)
    elif isinstance(e, SettleError):
        log.warning("claim failed: %s", e)
    else:
        raise e
    return _backoff(failures, getattr(e, "retry_after", None))


async def _aretrying(call: Callable[[], Awaitable[Any]], what: str, outage: _Outage, patience: float = REPORT_PATIENCE_SECONDS) -> Any:
    deadline, failures = time.monotonic() + patience, 0
    while True:
        try:
            answer = await call()
        except Exception as e:
            if not _transient(e) or time.monotonic() >= deadline:
                raise
            outage.failed(what, e)
            failures += 1
            await asyncio.sleep(_backoff(failures, getattr(e, "retry_after", None)))
            continue
        outage.answered()
        return answer


class Flow(enum.Enum):
    """Whether to go on with the next item."""

    CONTINUE = "continue"
    #: A cancel was requested, the lease is gone, or the worker is stopping (`stop()`, SIGTERM):
    #: stop at this item boundary (`Cancelled()`).
    STOP = "stop"


@dataclass
class Succeeded:
    """Done. For a held job, `cost` is what the work used (its `main` item's price, at most the
    hold) or `costs` each held item's by id; the rest of each hold is released."""

    result: Any = None
    cost: int | None = None
    costs: dict[str, int] | None = None


@dataclass
class Failed:
    code: str
    message: str | None = None
    retryable: bool | None = None
    retry_after_ms: int | None = None


@dataclass
class Unknown:
    """The work may or may not have happened (a timeout after sending): never retried blindly."""

    message: str = "outcome unknown"


@dataclass
class Cancelled:
    """Stopped at an item boundary (`Flow.STOP`). Reported as the failure `CANCELLED` when a cancel
    was requested; when the worker itself is stopping and no cancel was heard, as a release
    (`Released`)."""


@dataclass
class Released:
    """Hand the job back (a worker that must stop): it is queued again, due at once; this attempt
    closes `released` and does not count toward `max_attempts`; no money moves, and the items
    reported stay as reported. If a cancel was requested meanwhile, the server tears the job down
    instead."""


Outcome = Succeeded | Failed | Unknown | Cancelled | Released


def _to_do(item: Json) -> bool:
    """Whether an item's work is still to do: it is charged, or an earlier attempt's failure
    refunded it (`job_failed`) — this attempt's success reclaims it, so its work must be done."""
    state = item["state"]
    return state == ItemState.CHARGED or (state == ItemState.REFUNDED and item.get("refund_reason") == RefundReason.JOB_FAILED)


class _JobView:
    """The claimed job as a handler reads it (shared by the sync and asyncio contexts)."""

    job: Json

    @property
    def id(self) -> str:
        return self.job["id"]

    @property
    def lease_token(self) -> str:
        return self.job["lease_token"]

    @property
    def attempt(self) -> int:
        return self.job["attempt"]

    @property
    def payload(self) -> Any:
        return self.job.get("payload")

    @property
    def items(self) -> list[Json]:
        return self.job["items"]

    def items_to_do(self) -> list[Json]:
        """The items whose work is still to do: charged ones, and those an earlier failed attempt
        refunded (this attempt's success charges them again)."""
        return [i for i in self.items if _to_do(i)]

    def _boundary(self, item: str, done: set[str], draining: bool, cancel: bool) -> Flow:
        """Where the handler stands once `item` is reported: stop after a cancel or a lost lease;
        when the worker is stopping, stop unless every item is now reported (a job whose work is
        all done is finished, not released to wait for a worker that may never come)."""
        done.add(item)
        if cancel:
            return Flow.STOP
        if draining and any(i["id"] not in done for i in self.items_to_do()):
            return Flow.STOP
        return Flow.CONTINUE


@dataclass
class JobContext(_JobView):
    """What a handler sees of its job, and how it reports items."""

    client: Client
    job: Json
    _cancel: threading.Event = field(default_factory=threading.Event)
    _lost: threading.Event = field(default_factory=threading.Event)
    _outage: _Outage = field(default_factory=_Outage)
    #: The worker's own stop (`Worker.stop()`): set, the job is handed back at the next boundary.
    _draining: threading.Event = field(default_factory=threading.Event)
    #: The items this attempt reported.
    _done: set[str] = field(default_factory=set)

    @property
    def cancel_requested(self) -> bool:
        """A cancel of this job was requested (or its lease is gone): the job is not to be finished."""
        return self._cancel.is_set() or self._lost.is_set()

    @property
    def stopping(self) -> bool:
        """Stop at the next item boundary: a cancel was requested, the lease is gone, or the worker
        is stopping (`Worker.stop()`, SIGTERM). `Cancelled()` then reports what fits: the failure
        `CANCELLED` after a cancel, a release when only the worker is stopping."""
        return self.cancel_requested or self._draining.is_set()

    def _flow(self, answer: Json, item: str) -> Flow:
        if answer.get("cancel_requested"):
            self._cancel.set()
        return self._boundary(item, self._done, self._draining.is_set(), self.cancel_requested)

    def item_done(self, item: str, cost: int | None = None) -> Flow:
        """Reports `item` delivered; `cost` is a held item's price (what its work used)."""
        try:
            call = lambda: self.client.item_succeed(self.id, item, self.lease_token, cost)  # noqa: E731
            return self._flow(_retrying(call, "item report", self._outage), item)
        except LeaseLost:
            self._lost.set()
            return Flow.STOP
        except InvalidTransition as e:
            return self._decided(item, e)

    def item_failed(self, item: str, code: str, message: str | None = None) -> Flow:
        try:
            call = lambda: self.client.item_fail(self.id, item, self.lease_token, code, message)  # noqa: E731
            return self._flow(_retrying(call, "item report", self._outage), item)
        except LeaseLost:
            self._lost.set()
            return Flow.STOP
        except InvalidTransition as e:
            return self._decided(item, e)

    def _decided(self, item: str, e: InvalidTransition) -> Flow:
        """An item report the item's state contradicts (an earlier attempt delivered it, a cancel
        ended it): nothing changed; the job goes on."""
        log.warning("report of item %s of %s changed nothing: %s", item, self.id, e)
        return self._boundary(item, self._done, self._draining.is_set(), self.cancel_requested)

    def register_artifact(self, item: str, key: str) -> str:
        """Registers `key` for `item`; returns the path to store the object at (the job's prefix).
        Raises `LeaseLost` when the lease is gone (the job is then lost to this worker: stop)."""
        try:
            call = lambda: self.client.register_artifact(self.id, item, self.lease_token, key)  # noqa: E731
            return _retrying(call, "artifact registration", self._outage)["path"]
        except LeaseLost:
            self._lost.set()
            raise


Handler = Callable[[JobContext], "Outcome | None"]


def _check(outcome: Outcome | None) -> None:
    if not isinstance(outcome, (type(None), Succeeded, Failed, Unknown, Cancelled, Released)):
        raise TypeError(f"a handler returns Succeeded, Failed, Unknown, Cancelled, Released or None, not {outcome!r}")


def _settled(outcome: Outcome | None, cancel: bool, draining: bool) -> Outcome | None:
    """What to report: a handler's `Cancelled()` is a release when the worker is stopping and no
    cancel was requested (the job goes back to the queue), the failure `CANCELLED` otherwise."""
    if isinstance(outcome, Cancelled) and draining and not cancel:
        return Released()
    return outcome


def _skip_report(id: str, outcome: Outcome | None, lost: bool) -> bool:
    """After the lease was lost only a success is reported (accepted from any attempt): a lost
    lease is not a cancel, and a failure or an unknown outcome would be refused — the job is the
    rescuer's now."""
    if not lost or isinstance(outcome, (Succeeded, type(None))):
        return False
    if isinstance(outcome, Unknown):
        # The rescuer retried the job meanwhile: the external effect may happen twice.
        log.error("lease of %s lost with its outcome unknown: the job was rescued and may run again", id)
    else:
        log.warning("lease of %s lost; the job is rescued by the server, nothing to report", id)
    return True


def _reported(id: str, outcome: Outcome | None, answer: Json) -> None:
    if getattr(answer, "replayed", False):
        log.debug("report of %s had already taken effect (a replay)", id)
    torn_down = answer.get("state") in (JobState.CANCELLING, JobState.CANCELLED)
    if isinstance(outcome, (Succeeded, type(None))) and torn_down:
        log.warning("%s: a cancel won over this success; its items were refunded", id)
    elif isinstance(outcome, Released):
        log.info("%s %s", id, "cancelled: a cancel was requested before the release" if torn_down else "released: queued again")


def _refused(id: str, outcome: Outcome | None, e: LeaseLost) -> None:
    if isinstance(outcome, Unknown):
        # The rescuer retried the job meanwhile: the external effect may happen twice.
        log.error("unknown outcome of %s refused (%s): the job was rescued and may run again", id, e)
    else:
        log.warning("report of %s refused: %s", id, e)


def _report(client: Client, id: str, token: str, outcome: Outcome | None) -> Json:
    match outcome:
        case None:
            return client.succeed(id, token)
        case Succeeded(result=result, cost=cost, costs=costs):
            return client.succeed(id, token, result, cost, costs)
        case Failed(code=code, message=message, retryable=retryable, retry_after_ms=retry_after_ms):
            return client.fail(id, token, code, message, retryable, retry_after_ms)
        case Unknown(message=message):
            return client.unknown(id, token, message)
        case Released():
            return client.release(id, token)
        case _:
            return client.fail(id, token, "CANCELLED", "stopped at an item boundary", retryable=False)


class Worker:
    """Claims jobs of `kind` and runs `handler` on each, one at a time."""

    def __init__(
        self,
        client: Client,
        kind: str,
        handler: Handler,
        name: str = "python-worker",
        lease_seconds: int | None = None,
        wait_seconds: int = 5,
        labels: Sequence[str] | None = None,
    ):
        """`labels`: what this worker has (`gpu:a100`, `region:eu`); it is given only jobs whose
        every required label is among them. None: the `SETTLE_WORKER_LABELS` environment variable
        (comma-separated), else no labels."""
        self.client, self.kind, self.handler, self.name = client, kind, handler, name
        self.lease_seconds, self.wait_seconds = lease_seconds, wait_seconds
        self.labels = _labels(labels)
        self._stop = threading.Event()
        self._outage = _Outage()

    def stop(self) -> None:
        """Stops claiming; the job in hand stops after the item in progress (its report answers
        `Flow.STOP`, `job.stopping` is true), reports it and is released: queued again, due at
        once, the attempt not counted. A handler that reports no items runs to its end. Safe to
        call from another thread or a signal handler."""
        self._stop.set()

    def run(self, handle_signals: bool = False, max_jobs: int | None = None) -> int:
        """Runs until `stop()` (or SIGTERM/SIGINT with `handle_signals`), or `max_jobs` jobs.
        Returns how many jobs it ran (a job a claim brought after `stop()` is released untouched,
        not run)."""
        if handle_signals:
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, lambda *_: self.stop())
        ran, failures = 0, 0
        while not self._stop.is_set() and (max_jobs is None or ran < max_jobs):
            try:
                jobs = self.client.claim(self.name, [self.kind], 1, self.lease_seconds, self.wait_seconds, self.labels)
            except Exception as e:
                failures += 1
                self._stop.wait(_claim_failed(self._outage, failures, e))
                continue
            self._outage.answered()
            failures = 0
            for job in jobs:
                if self._stop.is_set():  # a claim in flight when stop() came: hand the job back
                    self._send(job["id"], job["lease_token"], Released())
                    continue
                self.run_one(job)
                ran += 1
        return ran

    def run_one(self, job: Json) -> None:
        """Runs one claimed job: heartbeats on a thread at a third of the lease, the handler, then
        the outcome (the heartbeat goes on until it is answered). A report that fails leaves the
        lease to lapse (the server rescues the job)."""
        ctx = JobContext(self.client, job, _outage=self._outage, _draining=self._stop)
        if job.get("cancel_requested"):
            ctx._cancel.set()
        beating = threading.Event()
        every = max(0.2, _lease_seconds(job) / 3)

        def beat() -> None:
            while not beating.wait(every):
                try:
                    if self.client.heartbeat(ctx.id, ctx.lease_token).get("cancel_requested"):
                        ctx._cancel.set()
                except LeaseLost:
                    ctx._lost.set()
                    return
                except Exception as e:  # noqa: BLE001 (the beat goes on while the lease may last)
                    if _transient(e):
                        self._outage.failed("heartbeat", e)
                    else:
                        log.warning("heartbeat of %s failed: %s", ctx.id, e)
                else:
                    self._outage.answered()

        beater = threading.Thread(target=beat, name=f"heartbeat-{ctx.id}", daemon=True)
        beater.start()
        try:
            try:
                outcome = self.handler(ctx)
                _check(outcome)
            except Exception as e:  # the handler's own failure: retryable, with its message
                log.exception("handler failed on %s", ctx.id)
                outcome = Failed("WORKER_ERROR", f"{type(e).__name__}: {e}"[:2000], retryable=True)
            outcome = _settled(outcome, ctx._cancel.is_set(), ctx._draining.is_set())
            if not _skip_report(ctx.id, outcome, ctx._lost.is_set()):
                self._send(ctx.id, ctx.lease_token, outcome)
        finally:
            beating.set()
            beater.join()

    def _send(self, id: str, token: str, outcome: Outcome | None) -> None:
        """Reports `outcome`, re-sent as first sent while Settle does not answer."""
        try:
            _reported(id, outcome, _retrying(lambda: _report(self.client, id, token, outcome), "report", self._outage))
        except LeaseLost as e:
            _refused(id, outcome, e)
        except (SettleError, httpx.TransportError) as e:
            log.warning("could not report %s (%s); the lease will lapse and the job be rescued", id, e)


def _lease_seconds(job: Json) -> float:
    """The lease's length as the claim answered it (expiry − now), 30 s if it cannot be read."""
    import datetime as dt

    try:
        expires = dt.datetime.fromisoformat(job["lease_expires_at"].replace("Z", "+00:00"))
        return max(1.0, (expires - dt.datetime.now(dt.timezone.utc)).total_seconds())
    except (KeyError, ValueError):
        return 30.0


# ----- asyncio ---------------------------------------------------------------------------------


@dataclass
class AsyncJobContext(_JobView):
    """`JobContext` for asyncio handlers."""

    client: AsyncClient
    job: Json
    _cancel: bool = False
    _lost: bool = False
    _outage: _Outage = field(default_factory=_Outage)
    #: The worker's own stop (`AsyncWorker.stop()`): set, the job is handed back at the next boundary.
    _draining: asyncio.Event = field(default_factory=asyncio.Event)
    #: The items this attempt reported.
    _done: set[str] = field(default_factory=set)

    @property
    def cancel_requested(self) -> bool:
        """A cancel of this job was requested (or its lease is gone): the job is not to be finished."""
        return self._cancel or self._lost

    @property
    def stopping(self) -> bool:
        """Stop at the next item boundary: a cancel was requested, the lease is gone, or the worker
        is stopping (`AsyncWorker.stop()`). `Cancelled()` then reports what fits: the failure
        `CANCELLED` after a cancel, a release when only the worker is stopping."""
        return self.cancel_requested or self._draining.is_set()

    async def item_done(self, item: str, cost: int | None = None) -> Flow:
        """Reports `item` delivered; `cost` is a held item's price (what its work used)."""
        try:
            call = lambda: self.client.item_succeed(self.id, item, self.lease_token, cost)  # noqa: E731
            answer = await _aretrying(call, "item report", self._outage)
        except LeaseLost:
            self._lost = True
            return Flow.STOP
        except InvalidTransition as e:
            log.warning("report of item %s of %s changed nothing: %s", item, self.id, e)
            return self._boundary(item, self._done, self._draining.is_set(), self.cancel_requested)
        self._cancel = self._cancel or bool(answer.get("cancel_requested"))
        return self._boundary(item, self._done, self._draining.is_set(), self.cancel_requested)

    async def item_failed(self, item: str, code: str, message: str | None = None) -> Flow:
        try:
            call = lambda: self.client.item_fail(self.id, item, self.lease_token, code, message)  # noqa: E731
            answer = await _aretrying(call, "item report", self._outage)
        except LeaseLost:
            self._lost = True
            return Flow.STOP
        except InvalidTransition as e:
            log.warning("report of item %s of %s changed nothing: %s", item, self.id, e)
            return self._boundary(item, self._done, self._draining.is_set(), self.cancel_requested)
        self._cancel = self._cancel or bool(answer.get("cancel_requested"))
        return self._boundary(item, self._done, self._draining.is_set(), self.cancel_requested)

    async def register_artifact(self, item: str, key: str) -> str:
        """Registers `key` for `item`; returns the path to store the object at (the job's prefix).
        Raises `LeaseLost` when the lease is gone (the job is then lost to this worker: stop)."""
        try:
            call = lambda: self.client.register_artifact(self.id, item, self.lease_token, key)  # noqa: E731
            return (await _aretrying(call, "artifact registration", self._outage))["path"]
        except LeaseLost:
            self._lost = True
            raise


AsyncHandler = Callable[[AsyncJobContext], Awaitable["Outcome | None"]]


class AsyncWorker:
    """`Worker` for asyncio: the heartbeat is a task beside the handler."""

    def __init__(
        self,
        client: AsyncClient,
        kind: str,
        handler: AsyncHandler,
        name: str = "python-worker",
        wait_seconds: int = 5,
        lease_seconds: int | None = None,
        labels: Sequence[str] | None = None,
    ):
        self.client, self.kind, self.handler, self.name, self.wait_seconds = client, kind, handler, name, wait_seconds
        self.labels = _labels(labels)
        self.lease_seconds = lease_seconds
        self._stop = asyncio.Event()
        self._outage = _Outage()

    def stop(self) -> None:
        """Stops claiming; the job in hand stops after the item in progress and is released, as
        `Worker.stop()` says. Call it on the event loop's thread (for SIGTERM:
        `loop.add_signal_handler(signal.SIGTERM, worker.stop)`)."""
        self._stop.set()

    async def run(self, max_jobs: int | None = None) -> int:
        """Runs until `stop()`, or `max_jobs` jobs. Returns how many jobs it ran."""
        ran, failures = 0, 0
        while not self._stop.is_set() and (max_jobs is None or ran < max_jobs):
            try:
                jobs = await self.client.claim(self.name, [self.kind], 1, self.lease_seconds, self.wait_seconds, self.labels)
            except Exception as e:
                failures += 1
                await asyncio.sleep(_claim_failed(self._outage, failures, e))
                continue
            self._outage.answered()
            failures = 0
            for job in jobs:
                if self._stop.is_set():  # a claim in flight when stop() came: hand the job back
                    await self._send(job["id"], job["lease_token"], Released())
                    continue
                await self.run_one(job)
                ran += 1
        return ran

    async def run_one(self, job: Json) -> None:
        cancel = bool(job.get("cancel_requested"))
        ctx = AsyncJobContext(self.client, job, _cancel=cancel, _outage=self._outage, _draining=self._stop)
        every = max(0.2, _lease_seconds(job) / 3)

        async def beat() -> None:
            while True:
                await asyncio.sleep(every)
                try:
                    if (await self.client.heartbeat(ctx.id, ctx.lease_token)).get("cancel_requested"):
                        ctx._cancel = True
                except LeaseLost:
                    ctx._lost = True
                    return
                except Exception as e:  # noqa: BLE001 (the beat goes on while the lease may last)
                    if _transient(e):
                        self._outage.failed("heartbeat", e)
                    else:
                        log.warning("heartbeat of %s failed: %s", ctx.id, e)
                else:
                    self._outage.answered()

        beater = asyncio.create_task(beat())
        try:
            try:
                outcome = await self.handler(ctx)
                _check(outcome)
            except Exception as e:
                log.exception("handler failed on %s", ctx.id)
                outcome = Failed("WORKER_ERROR", f"{type(e).__name__}: {e}"[:2000], retryable=True)
            outcome = _settled(outcome, ctx._cancel, ctx._draining.is_set())
            if not _skip_report(ctx.id, outcome, ctx._lost):
                await self._send(ctx.id, ctx.lease_token, outcome)
        finally:
            beater.cancel()

    async def _send(self, id: str, token: str, outcome: Outcome | None) -> None:
        """Reports `outcome`, re-sent as first sent while Settle does not answer."""

        async def send() -> Json:
            match outcome:
                case None:
                    return await self.client.succeed(id, token)
                case Succeeded(result=result, cost=cost, costs=costs):
                    return await self.client.succeed(id, token, result, cost, costs)
                case Failed(code=code, message=message, retryable=retryable, retry_after_ms=retry_after_ms):
                    return await self.client.fail(id, token, code, message, retryable, retry_after_ms)
                case Unknown(message=message):
                    return await self.client.unknown(id, token, message)
                case Released():
                    return await self.client.release(id, token)
                case _:
                    return await self.client.fail(id, token, "CANCELLED", "stopped at an item boundary", retryable=False)

        try:
            _reported(id, outcome, await _aretrying(send, "report", self._outage))
        except LeaseLost as e:
            _refused(id, outcome, e)
        except (SettleError, httpx.TransportError) as e:
            log.warning("could not report %s (%s); the lease will lapse and the job be rescued", id, e)
