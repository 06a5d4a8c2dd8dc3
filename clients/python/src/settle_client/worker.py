"""Workers: claim jobs of a kind (long-poll), heartbeat on a thread within the lease, report items
one by one, stop at the item boundary when a cancel arrives, and report the outcome.

    def render(job: JobContext):
        for item in job.items_to_do():
            make_frame(job.payload, item["id"])
            if job.item_done(item["id"]) is Flow.STOP:
                return Cancelled()
        return Succeeded({"frames": len(job.items)})

    Worker(Client(url, token), kind="render", handler=render).run()

A handler returns `Succeeded(result)`, `Failed(code, ...)`, `Unknown(message)` or `Cancelled()`
(or `None` for a plain success); an exception it raises is reported as a retryable failure with
code `WORKER_ERROR`. `Worker.stop()` (also on SIGTERM with `run(handle_signals=True)`) stops
claiming; a job in hand finishes its item and reports — it is never dropped. A worker killed
outright leaves its lease to lapse: the server rescues the job and the ledger stays exact.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .client import AsyncClient, Client, Json
from .errors import LeaseLost, SettleError

log = logging.getLogger("settle_client.worker")


class Flow(enum.Enum):
    """Whether to go on with the next item."""

    CONTINUE = "continue"
    #: A cancel was requested (or the lease is gone): stop at this item boundary.
    STOP = "stop"


@dataclass
class Succeeded:
    result: Any = None


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
    """Stopped at an item boundary because a cancel was requested (reported as `CANCELLED`)."""


Outcome = Succeeded | Failed | Unknown | Cancelled


def _to_do(item: Json) -> bool:
    """Whether an item's work is still to do: it is charged, or an earlier attempt's failure
    refunded it (`job_failed`) — this attempt's success reclaims it, so its work must be done."""
    return item["state"] == "charged" or (item["state"] == "refunded" and item.get("refund_reason") == "job_failed")


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


@dataclass
class JobContext(_JobView):
    """What a handler sees of its job, and how it reports items."""

    client: Client
    job: Json
    _cancel: threading.Event = field(default_factory=threading.Event)
    _lost: threading.Event = field(default_factory=threading.Event)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set() or self._lost.is_set()

    def _flow(self, answer: Json) -> Flow:
        if answer.get("cancel_requested"):
            self._cancel.set()
        return Flow.STOP if self.cancel_requested else Flow.CONTINUE

    def item_done(self, item: str) -> Flow:
        try:
            return self._flow(self.client.item_succeed(self.id, item, self.lease_token))
        except LeaseLost:
            self._lost.set()
            return Flow.STOP

    def item_failed(self, item: str, code: str, message: str | None = None) -> Flow:
        try:
            return self._flow(self.client.item_fail(self.id, item, self.lease_token, code, message))
        except LeaseLost:
            self._lost.set()
            return Flow.STOP

    def register_artifact(self, item: str, key: str) -> str:
        """Registers `key` for `item`; returns the path to store the object at (the job's prefix).
        Raises `LeaseLost` when the lease is gone (the job is then lost to this worker: stop)."""
        try:
            return self.client.register_artifact(self.id, item, self.lease_token, key)["path"]
        except LeaseLost:
            self._lost.set()
            raise


Handler = Callable[[JobContext], "Outcome | None"]


def _check(outcome: Outcome | None) -> None:
    if not isinstance(outcome, (type(None), Succeeded, Failed, Unknown, Cancelled)):
        raise TypeError(f"a handler returns Succeeded, Failed, Unknown, Cancelled or None, not {outcome!r}")


def _skip_report(id: str, outcome: Outcome | None, lost: bool) -> bool:
    """A handler that stopped because the lease was lost has nothing to report: the lease is not a
    cancel, and the job is the rescuer's now. (A success is still sent: accepted from any attempt.)"""
    if lost and isinstance(outcome, Cancelled):
        log.warning("lease of %s lost; the job is rescued by the server, nothing to report", id)
        return True
    return False


def _reported(id: str, outcome: Outcome | None, answer: Json) -> None:
    if getattr(answer, "replayed", False):
        log.debug("report of %s had already taken effect (a replay)", id)
    if isinstance(outcome, (Succeeded, type(None))) and answer.get("state") in ("cancelling", "cancelled"):
        log.warning("%s: a cancel won over this success; its items were refunded", id)


def _refused(id: str, outcome: Outcome | None, e: LeaseLost) -> None:
    if isinstance(outcome, Unknown):
        # The rescuer retried the job meanwhile: the external effect may happen twice.
        log.error("unknown outcome of %s refused (%s): the job was rescued and may run again", id, e)
    else:
        log.warning("report of %s refused: %s", id, e)


def _report(client: Client, job: Json, outcome: Outcome | None) -> Json:
    id, token = job["id"], job["lease_token"]
    match outcome:
        case None:
            return client.succeed(id, token)
        case Succeeded(result=result):
            return client.succeed(id, token, result)
        case Failed(code=code, message=message, retryable=retryable, retry_after_ms=retry_after_ms):
            return client.fail(id, token, code, message, retryable, retry_after_ms)
        case Unknown(message=message):
            return client.unknown(id, token, message)
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
    ):
        self.client, self.kind, self.handler, self.name = client, kind, handler, name
        self.lease_seconds, self.wait_seconds = lease_seconds, wait_seconds
        self._stop = threading.Event()

    def stop(self) -> None:
        """Stops claiming; the job in hand finishes and reports."""
        self._stop.set()

    def run(self, handle_signals: bool = False, max_jobs: int | None = None) -> int:
        """Runs until `stop()` (or SIGTERM/SIGINT with `handle_signals`), or `max_jobs` jobs.
        Returns how many jobs it ran."""
        if handle_signals:
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, lambda *_: self.stop())
        ran = 0
        while not self._stop.is_set() and (max_jobs is None or ran < max_jobs):
            try:
                jobs = self.client.claim(self.name, [self.kind], 1, self.lease_seconds, self.wait_seconds)
            except SettleError as e:
                log.warning("claim failed: %s", e)
                self._stop.wait(e.retry_after or 1.0)
                continue
            for job in jobs:
                self.run_one(job)
                ran += 1
        return ran

    def run_one(self, job: Json) -> None:
        """Runs one claimed job: heartbeats on a thread at a third of the lease, the handler, then
        the outcome. A report that fails leaves the lease to lapse (the server rescues the job)."""
        ctx = JobContext(self.client, job)
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
                except SettleError as e:
                    log.warning("heartbeat of %s failed: %s", ctx.id, e)

        beater = threading.Thread(target=beat, name=f"heartbeat-{ctx.id}", daemon=True)
        beater.start()
        try:
            outcome = self.handler(ctx)
            _check(outcome)
        except Exception as e:  # the handler's own failure: retryable, with its message
            log.exception("handler failed on %s", ctx.id)
            outcome = Failed("WORKER_ERROR", f"{type(e).__name__}: {e}"[:2000], retryable=True)
        finally:
            beating.set()
            beater.join()
        if _skip_report(ctx.id, outcome, ctx._lost.is_set()):
            return
        try:
            _reported(ctx.id, outcome, _report(self.client, job, outcome))
        except LeaseLost as e:
            _refused(ctx.id, outcome, e)
        except SettleError as e:
            log.warning("could not report %s (%s); the lease will lapse and the job be rescued", ctx.id, e)


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

    @property
    def cancel_requested(self) -> bool:
        return self._cancel or self._lost

    async def item_done(self, item: str) -> Flow:
        try:
            answer = await self.client.item_succeed(self.id, item, self.lease_token)
        except LeaseLost:
            self._lost = True
            return Flow.STOP
        self._cancel = self._cancel or bool(answer.get("cancel_requested"))
        return Flow.STOP if self.cancel_requested else Flow.CONTINUE

    async def item_failed(self, item: str, code: str, message: str | None = None) -> Flow:
        try:
            answer = await self.client.item_fail(self.id, item, self.lease_token, code, message)
        except LeaseLost:
            self._lost = True
            return Flow.STOP
        self._cancel = self._cancel or bool(answer.get("cancel_requested"))
        return Flow.STOP if self.cancel_requested else Flow.CONTINUE


AsyncHandler = Callable[[AsyncJobContext], Awaitable["Outcome | None"]]


class AsyncWorker:
    """`Worker` for asyncio: the heartbeat is a task beside the handler."""

    def __init__(self, client: AsyncClient, kind: str, handler: AsyncHandler, name: str = "python-worker", wait_seconds: int = 5):
        self.client, self.kind, self.handler, self.name, self.wait_seconds = client, kind, handler, name, wait_seconds
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, max_jobs: int | None = None) -> int:
        ran = 0
        while not self._stop.is_set() and (max_jobs is None or ran < max_jobs):
            try:
                jobs = await self.client.claim(self.name, [self.kind], 1, None, self.wait_seconds)
            except SettleError as e:
                log.warning("claim failed: %s", e)
                await asyncio.sleep(e.retry_after or 1.0)
                continue
            for job in jobs:
                await self.run_one(job)
                ran += 1
        return ran

    async def run_one(self, job: Json) -> None:
        ctx = AsyncJobContext(self.client, job, _cancel=bool(job.get("cancel_requested")))
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
                except SettleError as e:
                    log.warning("heartbeat of %s failed: %s", ctx.id, e)

        beater = asyncio.create_task(beat())
        try:
            outcome = await self.handler(ctx)
            _check(outcome)
        except Exception as e:
            log.exception("handler failed on %s", ctx.id)
            outcome = Failed("WORKER_ERROR", f"{type(e).__name__}: {e}"[:2000], retryable=True)
        finally:
            beater.cancel()
        id, token = job["id"], job["lease_token"]
        if _skip_report(id, outcome, ctx._lost):
            return
        try:
            match outcome:
                case None:
                    answer = await self.client.succeed(id, token)
                case Succeeded(result=result):
                    answer = await self.client.succeed(id, token, result)
                case Failed(code=code, message=message, retryable=retryable, retry_after_ms=retry_after_ms):
                    answer = await self.client.fail(id, token, code, message, retryable, retry_after_ms)
                case Unknown(message=message):
                    answer = await self.client.unknown(id, token, message)
                case _:
                    answer = await self.client.fail(id, token, "CANCELLED", "stopped at an item boundary", retryable=False)
            _reported(id, outcome, answer)
        except LeaseLost as e:
            _refused(id, outcome, e)
        except SettleError as e:
            log.warning("could not report %s (%s); the lease will lapse and the job be rescued", id, e)
