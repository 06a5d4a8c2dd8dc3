"""The client and workers against a real `settle serve` (issue 13)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import ADMIN, HOOK_SECRET, ROOT, WORKER

from settle_client import (
    Applied,
    AsyncClient,
    AsyncWorker,
    Cancelled,
    Client,
    Failed,
    Flow,
    IdempotencyConflict,
    InsufficientCredits,
    InvalidId,
    ItemState,
    JobState,
    LeaseLost,
    Released,
    Replayed,
    SettleError,
    SignatureError,
    Succeeded,
    Worker,
    verify_webhook,
)


def account(admin: Client, id: str, credits: int) -> None:
    admin.create_account(id)
    admin.grant(id, f"g-{id}", credits)


def test_errors_carry_the_api_code_and_replays_are_surfaced(admin):
    account(admin, "errs", 100)
    first = admin.create_job("errs-1", "errs", "render", cost=40)
    assert first["state"] == "queued" and "replayed" not in first
    again = admin.create_job("errs-1", "errs", "render", cost=40)
    assert again["replayed"] is True and again["id"] == "errs-1"
    with pytest.raises(IdempotencyConflict) as e:
        admin.create_job("errs-1", "errs", "render", cost=41)
    assert (e.value.status, e.value.code) == (409, "idempotency_conflict")
    with pytest.raises(InsufficientCredits) as e:
        admin.create_job("errs-2", "errs", "render", cost=1_000)
    assert e.value.code == "insufficient_credits"
    assert admin.account("errs")["balance"] == 60, "nothing was written for the refused job"
    with pytest.raises(ValueError):
        admin.create_job("errs-3", "errs", "render")


def test_dot_ids_are_refused_by_the_server_and_never_sent_by_the_client(admin, worker_client):
    """Issue 19, item 1: httpx (like every URL client) removes `..` segments, so an item `..` would
    have addressed the job's own `succeed`. The server refuses such ids; the client never sends one."""
    account(admin, "dots", 100)
    for bad in ([("..", 10), ("b", 10)], [(".", 10)]):
        with pytest.raises(SettleError) as e:
            admin.create_job("dots-1", "dots", "render", items=bad)
        assert (e.value.status, e.value.code) == (400, "invalid_request")
    for bad_id in ("..", "."):
        with pytest.raises(SettleError) as e:
            admin.create_job(bad_id, "dots", "render", cost=10)
        assert (e.value.status, e.value.code) == (400, "invalid_request")
    assert admin.account("dots")["balance"] == 100, "nothing was written"
    admin.create_job("dots-2", "dots", "dots", items=[("a", 10), ("b", 10)])
    claimed = worker_client.claim("py-dots", kinds=["dots"])
    assert [j["id"] for j in claimed] == ["dots-2"]
    token = claimed[0]["lease_token"]
    for item in ("..", ".", "a/b", ""):
        with pytest.raises(InvalidId):
            worker_client.item_succeed("dots-2", item, token)
    job = admin.job("dots-2")
    assert job["state"] == "running" and [i["state"] for i in job["items"]] == ["charged", "charged"], job


def test_reports_answer_applied_replayed_or_lease_lost(admin, worker_client):
    """Issue 20, item 1 (decision 0019): a worker tells from the answer alone whether its report took
    effect now, had already taken effect, or was refused — and what became of the job."""
    account(admin, "answers", 100)
    admin.create_job("answers-1", "answers", "answers", items=[("a", 10), ("b", 10)])
    (job,) = worker_client.claim("py-answers", kinds=["answers"])
    token = job["lease_token"]
    first = worker_client.item_succeed("answers-1", "a", token)
    assert isinstance(first, Applied) and not first.replayed and first["item"]["state"] == "succeeded"
    again = worker_client.item_succeed("answers-1", "a", token)
    assert isinstance(again, Replayed) and again.replayed
    with pytest.raises(LeaseLost) as e:
        worker_client.fail("answers-1", "a-token-never-issued", "TIMEOUT")
    assert (e.value.status, e.value.lease, e.value.state, e.value.attempt) == (409, "never_issued", "running", None)
    with pytest.raises(SettleError) as e:
        worker_client.succeed("answers-1")  # without a token: an operator's act
    assert (e.value.status, e.value.code) == (403, "forbidden")
    done = worker_client.succeed("answers-1", token)
    assert isinstance(done, Applied) and done["state"] == "succeeded"
    assert isinstance(worker_client.succeed("answers-1", token), Replayed)
    with pytest.raises(LeaseLost) as e:
        worker_client.heartbeat("answers-1", token)
    assert e.value.lease == "ended" and e.value.attempt["result"] == "succeeded" and e.value.state == "succeeded"
    assert admin.account("answers")["balance"] == 80


def test_many_reports_in_one_request_answer_as_their_single_calls(admin, worker_client):
    """Decision 0041: `report` sends a worker's reports at once; each is its own transition and
    comes back in order as its single call would answer — refusals returned, not raised."""
    account(admin, "batched", 100)
    for i in range(3):
        admin.create_job(f"batched-{i}", "batched", "batched", cost=10)
    claimed = {j["id"]: j["lease_token"] for j in worker_client.claim("py-batch", kinds=["batched"], limit=3)}
    reports = [
        {"job_id": "batched-0", "outcome": "succeed", "lease_token": claimed["batched-0"], "result": {"ok": 1}},
        {"job_id": "batched-1", "outcome": "fail", "lease_token": claimed["batched-1"], "code": "OOM", "retryable": False},
        {"job_id": "batched-2", "outcome": "heartbeat", "lease_token": claimed["batched-2"]},
        {"job_id": "batched-2", "outcome": "fail", "lease_token": "never-issued", "code": "OOM"},
    ]
    with pytest.raises(SettleError) as whole:
        worker_client.report(reports)  # batched-2 twice: refused whole, nothing written
    assert (whole.value.status, whole.value.code) == (400, "invalid_request")
    assert admin.job("batched-0")["state"] == JobState.RUNNING
    reports[3]["job_id"] = "batched-missing"
    done, failed, beat, missing = worker_client.report(reports)
    assert isinstance(done, Applied) and done["state"] == JobState.SUCCEEDED
    assert isinstance(failed, Applied) and (failed["state"], failed["net"]) == (JobState.DEAD, 0)
    assert beat["cancel_requested"] is False and "lease_expires_at" in beat
    assert isinstance(missing, SettleError) and (missing.status, missing.code) == (404, "not_found")
    again = worker_client.report(reports[:2])
    assert all(isinstance(r, Replayed) for r in again)
    assert admin.account("batched")["balance"] == 80


def test_a_worker_stops_at_the_item_boundary_when_a_cancel_arrives(admin, worker_client):
    """Seed 003: a batch cancelled mid-way; delivered items stay charged, the rest are refunded."""
    account(admin, "batch", 1_000)
    items = [(f"f{i}", 10) for i in range(6)]
    admin.create_job("batch-1", "batch", "batch", items=items)
    two_done, go_on = threading.Event(), threading.Event()
    seen: list[str] = []

    def handler(job):
        for item in job.items_to_do():
            seen.append(item["id"])
            flow = job.item_done(item["id"])
            if len(seen) == 2:
                two_done.set()
                go_on.wait(10)
            if flow is Flow.STOP:
                return Cancelled()
        return Succeeded()

    w = Worker(worker_client, kind="batch", handler=handler, name="py-batch", wait_seconds=1)
    t = threading.Thread(target=w.run, kwargs={"max_jobs": 1})
    t.start()
    assert two_done.wait(20)
    assert admin.cancel("batch-1")["cancel_requested"] is True
    go_on.set()
    t.join(30)
    assert not t.is_alive()
    job = admin.job("batch-1")
    deadline = time.time() + 10
    while job["state"] != "cancelled" and time.time() < deadline:
        time.sleep(0.1)
        job = admin.job("batch-1")
    assert job["state"] == "cancelled"
    assert seen == ["f0", "f1", "f2"], "the third item's report saw the cancel: it stopped there"
    states = [i["state"] for i in job["items"]]
    assert states[:3] == ["succeeded"] * 3 and set(states[3:]) == {"cancelled"}, states
    assert admin.account("batch")["balance"] == 1_000 - 30, "three delivered items stay charged"


def test_a_worker_killed_mid_job_loses_its_lease_and_the_job_is_retried_exactly(server, admin, worker_client):
    base, _ = server
    account(admin, "killed", 100)
    admin.create_job("killed-1", "killed", "gpu", cost=25, max_attempts=3)
    script = textwrap.dedent(
        f"""
        import time
        from settle_client import Client, Worker
        def handler(job):
            print("started", flush=True)
            time.sleep(60)
        Worker(Client({base!r}, token={WORKER!r}), kind="gpu", handler=handler, name="doomed", lease_seconds=2).run(max_jobs=1)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # The lease lapses, the rescuer puts the job back; a second worker finishes it.
    ran = Worker(worker_client, kind="gpu", handler=lambda job: Succeeded({"by": "second"}), name="second", wait_seconds=1)
    assert ran.run(max_jobs=1) == 1
    job = admin.job("killed-1")
    assert (job["state"], job["attempt"], job["result"]) == ("succeeded", 2, {"by": "second"})
    attempts = admin.attempts("killed-1")
    assert [a["result"] for a in attempts] == ["lease_expired", "succeeded"]
    assert admin.account("killed")["balance"] == 75, "charged once, whatever the retries"


def test_a_failure_is_retried_and_an_exception_is_a_retryable_failure(admin, worker_client):
    account(admin, "flaky", 100)
    admin.create_job("flaky-1", "flaky", "flaky", cost=10, max_attempts=3)
    calls = []

    def handler(job):
        calls.append(job.id)
        if len(calls) == 1:
            raise RuntimeError("GPU fell over")
        if len(calls) == 2:
            return Failed("NODE_DOWN", "node went away")
        return Succeeded()

    Worker(worker_client, kind="flaky", handler=handler, name="py-flaky", wait_seconds=2).run(max_jobs=3)
    attempts = admin.attempts("flaky-1")
    assert [(a["result"], a["fail_code"]) for a in attempts] == [("failed", "WORKER_ERROR"), ("failed", "NODE_DOWN"), ("succeeded", None)]
    assert admin.account("flaky")["balance"] == 90


def test_a_retry_redoes_the_items_a_failed_attempt_refunded(admin, worker_client):
    """The job's failure refunds its undelivered items (`job_failed`); the next attempt's success
    charges them again, so `items_to_do` hands them to the handler once more."""
    account(admin, "redo", 100)
    admin.create_job("redo-1", "redo", "redo", items=[("r0", 10), ("r1", 10), ("r2", 10)], max_attempts=2)
    seen: list[tuple[int, list[str]]] = []

    def handler(job):
        todo = [i["id"] for i in job.items_to_do()]
        seen.append((job.attempt, todo))
        if job.attempt == 1:
            assert job.item_done(todo[0]) is Flow.CONTINUE
            return Failed("NODE_DOWN", "node went away", retry_after_ms=10)
        for item in todo:
            assert job.item_done(item) is Flow.CONTINUE
        return Succeeded({"frames": len(todo)})

    Worker(worker_client, kind="redo", handler=handler, name="py-redo", wait_seconds=2).run(max_jobs=2)
    assert seen[0] == (1, ["r0", "r1", "r2"])
    job = admin.job("redo-1")
    assert job["state"] == "succeeded", job
    assert seen[1][0] == 2 and seen[1][1] == ["r1", "r2"], f"the refunded items are worked again: {seen}"
    assert [i["state"] for i in job["items"]] == ["succeeded", "reclaimed", "reclaimed"], job["items"]
    assert admin.account("redo")["balance"] == 70, "each item charged once in the end"


def test_priority_and_labels_choose_what_a_worker_claims(admin, worker_client):
    """Issue 44: a lower priority number is claimed first, and a job requiring labels goes only to a
    worker that has them all."""
    account(admin, "lines", 100)
    admin.create_job("lines-late", "lines", "lines", cost=1, priority=90)
    admin.create_job("lines-gpu", "lines", "lines", cost=1, requires=["region:eu", "gpu:a100"])
    made = admin.create_job("lines-soon", "lines", "lines", cost=1, priority=5)
    assert (made["priority"], made["requires"]) == (5, [])
    assert admin.job("lines-gpu")["requires"] == ["gpu:a100", "region:eu"]
    claimed = [worker_client.claim("py-lines", kinds=["lines"])[0]["id"] for _ in range(2)]
    assert claimed == ["lines-soon", "lines-late"]
    assert worker_client.claim("py-lines", kinds=["lines"], labels=["gpu:a100"]) == []
    (gpu,) = worker_client.claim("py-lines", kinds=["lines"], labels=["gpu:a100", "region:eu", "x"])
    assert gpu["id"] == "lines-gpu"
    with pytest.raises(SettleError) as e:
        admin.create_job("lines-bad", "lines", "lines", cost=1, priority=101)
    assert e.value.code == "invalid_request"


def test_an_account_cap_bounds_what_runs(admin, worker_client):
    """Issue 44: an account's `max_running` is set at creation, changed and removed by
    `update_account`; a claim never takes a job over it."""
    made = admin.create_account("capped", max_running=1)
    assert made["max_running"] == 1
    admin.grant("capped", "g-capped", 10)
    for n in range(3):
        admin.create_job(f"capped-{n}", "capped", "capped", cost=1)
    assert len(worker_client.claim("py-capped", kinds=["capped"], limit=5)) == 1
    assert worker_client.claim("py-capped", kinds=["capped"], limit=5) == []
    assert admin.update_account("capped", max_running=2)["max_running"] == 2
    assert len(worker_client.claim("py-capped", kinds=["capped"], limit=5)) == 1
    kept = admin.update_account("capped", overdraft_limit=5)
    assert (kept["overdraft_limit"], kept["max_running"]) == (5, 2), "a field not given is kept"
    assert admin.update_account("capped", max_running=None)["max_running"] is None
    assert len(worker_client.claim("py-capped", kinds=["capped"], limit=5)) == 1
    with pytest.raises(SettleError) as e:
        admin.update_account("capped", max_running=-1)
    assert e.value.code == "invalid_request"


def test_balance_alerts_fire_once_per_crossing(admin):
    """Issue 45: alerts are set and read; a posting under the threshold fires one
    `account.balance_low`, more postings below fire nothing, a grant back fires one
    `account.balance_recovered`."""
    admin.create_account("alerted")
    admin.grant("alerted", "g-alerted", 1000)
    after = admin.events(limit=1000)["next_after"]
    assert admin.set_alerts("alerted", [("low", 500)]) == {"alerts": [{"id": "low", "below": 500, "side": "above"}]}
    for n in range(4):
        admin.create_job(f"alerted-{n}", "alerted", "alerts", cost=200)
    admin.grant("alerted", "top-alerted", 500)
    seen = [
        (e["type"], e["data"]["balance_after"])
        for e in admin.events(after=after, limit=1000)["events"]
        if e["account_id"] == "alerted" and e["type"].startswith("account.balance_")
    ]
    assert seen == [("account.balance_low", 400), ("account.balance_recovered", 700)]
    assert admin.alerts("alerted")["alerts"][0]["side"] == "above"
    with pytest.raises(SettleError) as e:
        admin.set_alerts("alerted", [("zero", 0)])
    assert e.value.code == "invalid_request"


def test_a_spend_limit_refuses_a_create_past_it(admin):
    """Issue 45: a day limit is set and read; a create past it is `402 spend_limit_exceeded` with
    the limit, its spend and what is left, and writes nothing; one that fits passes."""
    admin.create_account("limited")
    admin.grant("limited", "g-limited", 1000)
    stored = admin.set_limits("limited", [{"period": "day", "amount": 100, "kinds": ["render"]}])
    assert [(l["period"], l["amount"], l["kinds"], l["spent"]) for l in stored["limits"]] == [("day", 100, ["render"], 0)]
    admin.create_job("limited-1", "limited", "render", cost=70)
    with pytest.raises(SettleError) as e:
        admin.create_job("limited-2", "limited", "render", cost=31)
    assert (e.value.status, e.value.code) == (402, "spend_limit_exceeded")
    assert (e.value.details["spent"], e.value.details["remaining"], e.value.details["needed"]) == (70, 30, 31)
    with pytest.raises(SettleError) as missing:
        admin.job("limited-2")
    assert missing.value.status == 404
    admin.create_job("limited-2", "limited", "render", cost=30)
    admin.create_job("limited-3", "limited", "transcribe", cost=500)
    assert admin.limits("limited")["limits"][0]["spent"] == 100
    with pytest.raises(SettleError) as bad:
        admin.set_limits("limited", [{"period": "week", "amount": 5}])
    assert bad.value.code == "invalid_request"


def test_a_top_up_is_granted_once_its_charge_is_confirmed(admin):
    """Issue 45: a top-up charges nothing to the account; the funding processor charges the
    customer through the funding provider and only the confirmed charge grants the credits. A
    declined card ends the top-up without a grant."""
    admin.create_account("buyer")
    t = admin.create_top_up("buy-1", "buyer", 500, 499, "eur", "cus_buyer")
    assert (t["kind"], t["credits"], t["currency"], t["grant_id"]) == ("top_up", 500, "EUR", None)
    again = admin.create_top_up("buy-1", "buyer", 500, 499, "EUR", "cus_buyer")
    assert again["idempotency_key"] == t["idempotency_key"]
    admin.create_top_up("buy-2", "buyer", 300, 299, "EUR", "declined-buyer")
    deadline = time.time() + 20
    while time.time() < deadline:
        states = {x["id"]: x["state"] for x in admin.top_ups(account_id="buyer")}
        if states == {"buy-1": "succeeded", "buy-2": "dead"}:
            break
        time.sleep(0.1)
    paid = admin.top_up("buy-1")
    assert (paid["state"], paid["grant_id"]) == ("succeeded", "buy-1") and paid["provider_charge_id"]
    declined = admin.top_up("buy-2")
    assert (declined["state"], declined["last_error"]["code"], declined["grant_id"]) == ("dead", "CARD_DECLINED", None)
    assert admin.account("buyer")["balance"] == 500
    with pytest.raises(SettleError) as bad:
        admin.create_top_up("buy-3", "buyer", 5, 1, "XXX", "cus_buyer")
    assert bad.value.code == "invalid_request"


def test_an_auto_top_up_rule_buys_when_a_charge_crosses_it(admin):
    """Issue 45: the rule buys when a posting takes the balance under `below`, once per crossing;
    a rule whose top-up is declined pauses instead of charging again."""
    account(admin, "ruled", 1000)
    rule = admin.set_auto_top_up("ruled", 500, 1000, 999, "usd", "cus_ruled", 5000)
    assert (rule["state"], rule["currency"], rule["credits_this_month"]) == ("active", "USD", 0)
    admin.create_job("ruled-1", "ruled", "render", cost=600)
    deadline = time.time() + 20
    while time.time() < deadline and admin.account("ruled")["balance"] != 1400:
        time.sleep(0.1)
    assert admin.account("ruled")["balance"] == 1400
    assert [t["rule"] for t in admin.top_ups(account_id="ruled")] == [True]
    assert admin.auto_top_up("ruled")["credits_this_month"] == 1000
    admin.delete_auto_top_up("ruled")
    with pytest.raises(SettleError) as gone:
        admin.auto_top_up("ruled")
    assert gone.value.status == 404


def test_a_trial_grant_is_spent_first_and_listed(admin):
    admin.create_account("trialp")
    admin.grant("trialp", "pack-trialp", 100)
    soon = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).isoformat()
    admin.grant("trialp", "trial-trialp", 50, expires_at=soon, priority=10)
    admin.create_job("trialp-1", "trialp", "render", cost=30)
    grants = admin.grants("trialp")["grants"]
    shown = [(g["id"], g["remaining"], g["state"], g["priority"]) for g in grants]
    assert shown == [("pack-trialp", 100, "active", 50), ("trial-trialp", 20, "active", 10)]
    with pytest.raises(SettleError) as e:
        admin.grant("trialp", "late", 5, expires_at="2001-01-01T00:00:00Z")
    assert e.value.code == "invalid_request"


def test_a_real_webhook_delivery_verifies(admin, hooks):
    account(admin, "hooked", 100)
    headers, body = hooks.wait_for(lambda e: e["type"] == "account.granted" and e["account_id"] == "hooked")
    verify_webhook(HOOK_SECRET, headers, body)
    with pytest.raises(SignatureError):
        verify_webhook(HOOK_SECRET, headers, body + b" ")
    with pytest.raises(SignatureError):
        verify_webhook("another-secret-of-16+", headers, body)
    with pytest.raises(SignatureError):
        verify_webhook(HOOK_SECRET, headers, body, now=time.time() + 3_600)
    with pytest.raises(SignatureError):
        verify_webhook(HOOK_SECRET, {}, body)


def test_events_iterate_in_order(admin):
    account(admin, "evts", 100)
    seqs = []
    for event in admin.iter_events(after=0, wait_seconds=1):
        seqs.append(event["seq"])
        if event["type"] == "account.granted" and event["account_id"] == "evts":
            break
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))


async def test_the_asyncio_worker(server, admin):
    base, work = server
    account(admin, "aio", 100)
    admin.create_job("aio-1", "aio", "aio", items=[("a", 5), ("b", 5)])

    async def handler(job):
        for item in job.items_to_do():
            # Each frame stored where its registration says (the job's own prefix).
            path = work / "artifacts" / await job.register_artifact(item["id"], "frame.png")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"png")
            if await job.item_done(item["id"]) is Flow.STOP:
                return Cancelled()
        return Succeeded({"async": True})

    async with AsyncClient(base, token=WORKER) as c:
        assert await AsyncWorker(c, kind="aio", handler=handler, name="py-aio", wait_seconds=1).run(max_jobs=1) == 1
    job = admin.job("aio-1")
    assert (job["state"], job["result"]) == (JobState.SUCCEEDED, {"async": True})
    assert [i["state"] for i in job["items"]] == [ItemState.SUCCEEDED, ItemState.SUCCEEDED]
    assert admin.account("aio")["balance"] == 90
    frames = sorted(p.relative_to(work / "artifacts").as_posix() for p in (work / "artifacts").glob("aio-1/*/*"))
    assert frames == ["aio-1/a/frame.png", "aio-1/b/frame.png"]


def test_the_asyncio_client_has_every_method_of_the_blocking_one():
    import inspect

    def methods(cls):
        return {
            name: list(inspect.signature(f).parameters)
            for name, f in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")
        }

    sync, aio = methods(Client), methods(AsyncClient)
    sync.pop("close")
    aio.pop("aclose")
    assert len(sync) >= 24 and sync == aio
    for name in aio:
        f = getattr(AsyncClient, name)
        assert inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f), name


async def test_the_asyncio_client_does_what_the_platform_side_needs(server):
    base, _ = server
    async with AsyncClient(base, token=ADMIN) as c:
        assert (await c.create_account("aplat"))["balance"] == 0
        assert (await c.grant("aplat", "g-aplat", 100, reason="welcome"))["balance_after"] == 100
        assert (await c.grant("aplat", "g-aplat", 100, reason="welcome"))["replayed"] is True
        assert (await c.adjust("aplat", "adj-aplat", -10, "goodwill back"))["balance_after"] == 90
        await c.create_job("aplat-1", "aplat", "aplat", cost=30)
        await c.create_job("aplat-2", "aplat", "aplat", items=[("x", 5), ("y", 5)])
        assert sorted([j["id"] async for j in c.jobs(account_id="aplat")]) == ["aplat-1", "aplat-2"]
        assert (await c.cancel("aplat-1"))["state"] == JobState.CANCELLED
        assert await c.attempts("aplat-1") == []
        with pytest.raises(SettleError) as e:
            await c.requeue("aplat-2")  # only a dead job
        assert e.value.code == "invalid_transition"
        w = await c.create_withdrawal("aplat-w", "aplat", 20, "DE89370400440532013000")
        assert (w["state"], (await c.withdrawal("aplat-w"))["amount"]) == (JobState.QUEUED, 20)
        kinds = [e["kind"] for e in (await c.ledger("aplat"))["entries"]]
        assert kinds == ["grant", "adjustment", "charge", "charge", "charge", "refund", "charge"], kinds
        assert (await c.audit())["ok"] is True
        # The whole server's failures by code (other tests' too): the summary's shape.
        assert all(set(f) == {"code", "state", "count"} for f in await c.failures())

        assert (await c.account("aplat"))["balance"] == 90 - 10 - 20


# ----- workers that ride out a restart (issue 20, item 2) ------------------------------------------


class _Serve:
    """A `settle serve` this test kills outright (SIGKILL) and starts again on the same port and
    database."""

    def __init__(self, workdir, env):
        from settle_serve import ROOT, free_port

        self.binary = os.environ.get("SETTLE_BIN", str(ROOT / "target" / "debug" / "settle"))
        self.workdir, self.env, self.port = workdir, env, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None
        (workdir / "settle.toml").write_text(
            '[defaults]\nretryable_codes = ["TIMEOUT"]\nbackoff_ms_base = 100\nbackoff_ms_max = 200\n'
            "[loops]\nrescue_every_ms = 200\nsweep_every_ms = 200\n"
        )

    def start(self):
        import urllib.request

        log = open(self.workdir / "serve.log", "a")
        self.proc = subprocess.Popen(
            [self.binary, "serve", "--listen", f"127.0.0.1:{self.port}", "--config", str(self.workdir / "settle.toml")],
            cwd=self.workdir,
            env=dict(os.environ, **self.env),
            stdout=log,
            stderr=log,
        )
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.base + "/healthz", timeout=1)
                return
            except OSError:
                assert self.proc.poll() is None, (self.workdir / "serve.log").read_text()
                time.sleep(0.05)
        raise RuntimeError("settle serve did not start: " + (self.workdir / "serve.log").read_text())

    def kill(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def restartable(tmp_path):
    from conftest import ADMIN

    env = {
        "SETTLE_TOKENS": f"admin:py-admin={ADMIN},worker:py-worker={WORKER}",
        "SETTLE_DATABASE_URL": os.environ.get("SETTLE_PYTHON_TESTS_DB", "sqlite://" + str(tmp_path / "settle.db")),
    }
    s = _Serve(tmp_path, env)
    s.start()
    yield s
    if s.proc.poll() is None:
        s.proc.terminate()
        s.proc.wait(30)


def _jobs_for_the_restart(admin, prefix: str, n: int) -> None:
    account(admin, prefix, 10_000)
    for j in range(n):
        admin.create_job(f"{prefix}-{j}", prefix, prefix, items=[("a", 10), ("b", 20)])


def _wait_done(admin, prefix: str, n: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        jobs = [admin.job(f"{prefix}-{j}") for j in range(n)]
        if all(j["state"] == "succeeded" for j in jobs):
            return jobs
        time.sleep(0.2)
    raise AssertionError([(j["id"], j["state"]) for j in jobs])


def _exactly_once(admin, prefix: str, n: int) -> None:
    """Every job succeeded once: each item charged once, every refund taken back, the balance the
    sum of its entries, and the audit clean."""
    entries = []
    after = 0
    while True:
        page = admin.ledger(prefix, after=after)
        entries += page["entries"]
        if page.get("next_after") is None:
            break
        after = page["next_after"]
    charges = [e for e in entries if e["kind"] == "charge"]
    assert len(charges) == 2 * n, len(charges)
    assert len({(e["job_id"], e["item_id"]) for e in charges}) == 2 * n
    refunds = sum(1 for e in entries if e["kind"] == "refund")
    reclaims = sum(1 for e in entries if e["kind"] == "reclaim")
    assert refunds == reclaims, (refunds, reclaims)
    assert admin.account(prefix)["balance"] == 10_000 - 30 * n
    audit = admin.audit()
    assert audit["ok"] is True, audit


def test_a_worker_rides_out_a_restart_longer_than_its_lease(restartable, caplog):
    from conftest import ADMIN

    s = restartable
    n = 6
    with Client(s.base, token=ADMIN) as admin:
        _jobs_for_the_restart(admin, "restart-sync", n)
        one_done = threading.Event()

        def handler(job):
            for item in job.items_to_do():
                time.sleep(0.15)
                if job.item_done(item["id"]) is Flow.STOP:
                    return Cancelled()
            one_done.set()
            return Succeeded()

        with Client(s.base, token=WORKER, timeout=5.0) as wc:
            w = Worker(wc, kind="restart-sync", handler=handler, name="py-restart", lease_seconds=2, wait_seconds=1)
            caplog.set_level("WARNING", logger="settle_client.worker")
            t = threading.Thread(target=w.run)
            t.start()
            assert one_done.wait(20)
            s.kill()
            time.sleep(4)  # down for longer than the 2 s lease
            s.start()
            _wait_done(admin, "restart-sync", n)
            w.stop()
            t.join(30)
            assert not t.is_alive()
        _exactly_once(admin, "restart-sync", n)
    outage_lines = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert 1 <= len(outage_lines) <= 3, [r.getMessage() for r in caplog.records]
    assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_the_asyncio_worker_rides_out_a_restart_longer_than_its_lease(restartable):
    import asyncio

    from conftest import ADMIN

    s = restartable
    n = 4
    with Client(s.base, token=ADMIN) as admin:
        _jobs_for_the_restart(admin, "restart-async", n)
        one_done = asyncio.Event()

        async def handler(job):
            for item in job.items_to_do():
                await asyncio.sleep(0.15)
                if await job.item_done(item["id"]) is Flow.STOP:
                    return Cancelled()
            one_done.set()
            return Succeeded()

        async with AsyncClient(s.base, token=WORKER, timeout=5.0) as wc:
            w = AsyncWorker(wc, kind="restart-async", handler=handler, name="py-restart-async", wait_seconds=1, lease_seconds=2)
            task = asyncio.create_task(w.run())
            await asyncio.wait_for(one_done.wait(), 20)
            await asyncio.to_thread(s.kill)
            await asyncio.sleep(4)
            await asyncio.to_thread(s.start)
            for _ in range(300):
                if all(admin.job(f"restart-async-{j}")["state"] == "succeeded" for j in range(n)):
                    break
                await asyncio.sleep(0.2)
            w.stop()
            await asyncio.wait_for(task, 30)
        _exactly_once(admin, "restart-async", n)


def test_a_worker_with_a_refused_token_stops_with_a_clear_error(server):
    from settle_client import Unauthorized

    base, _ = server
    with Client(base, token="not-a-token-of-this-server") as c:
        w = Worker(c, kind="any", handler=lambda job: None, wait_seconds=1)
        raised: list[BaseException] = []

        def run():
            try:
                w.run()
            except BaseException as e:  # noqa: BLE001 (what run() stopped with)
                raised.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        w.stop()
        assert not t.is_alive() and len(raised) == 1 and isinstance(raised[0], Unauthorized), raised


def test_a_worker_prices_held_jobs_by_what_the_work_used(admin, worker_client):
    """Held items (issue 23): the hold is charged at create; the handler reports what the work
    used, per job (`Succeeded(cost=…)`) or per item (`item_done(item, cost=…)`), and the rest of
    each hold is released."""
    account(admin, "metered", 1_000)
    job = admin.create_job("gpu-1", "metered", "gpu", hold=100, payload={"seconds": 37})
    assert (job["hold"], job["cost"], job["items"][0]["cost"]) == (100, None, None)
    admin.create_job("frames-1", "metered", "gpu", items=[{"id": "f0", "hold": 10}, ("f1", 4)], payload={"seconds": 6})
    assert admin.account("metered")["balance"] == 1_000 - 114

    def handler(job):
        seconds = job.payload["seconds"]
        if len(job.items) == 1:
            return Succeeded({"seconds": seconds}, cost=seconds)
        for item in job.items_to_do():
            held = item["hold"] is not None
            assert job.item_done(item["id"], cost=seconds if held else None) is Flow.CONTINUE
        return Succeeded()

    Worker(worker_client, kind="gpu", handler=handler, name="py-gpu", wait_seconds=1).run(max_jobs=2)
    gpu, frames = admin.job("gpu-1"), admin.job("frames-1")
    assert (gpu["state"], gpu["cost"], gpu["net"]) == (JobState.SUCCEEDED, 37, -37)
    assert (frames["state"], frames["cost"], frames["net"]) == (JobState.SUCCEEDED, 10, -10)
    kinds = [(e["kind"], e["amount"]) for e in admin.ledger("metered")["entries"] if e["job_id"] == "gpu-1"]
    assert kinds == [("charge", -100), ("release", 63)]
    assert admin.account("metered")["balance"] == 1_000 - 47
    with pytest.raises(SettleError) as refused:
        admin.create_job("gpu-bad", "metered", "gpu", hold=0)
    assert refused.value.status == 400


def test_a_held_job_that_timed_out_recovers_at_its_reported_cost(admin, worker_client):
    """The seed's story, priced: the lease lapses, the rescuer refunds the hold, and the late
    success reclaims what the work used — never the whole hold, never twice."""
    account(admin, "late", 1_000)
    admin.create_job("late-1", "late", "late", hold=100, max_attempts=3)
    [claimed] = worker_client.claim("py-slow", kinds=["late"], lease_seconds=1)
    deadline = time.time() + 20
    while admin.job("late-1")["net"] != 0:
        assert time.time() < deadline, "the rescuer did not refund the hold"
        time.sleep(0.1)
    with pytest.raises(SettleError) as missing:
        worker_client.succeed("late-1", claimed["lease_token"])
    assert (missing.value.status, missing.value.code) == (422, "cost_required")
    answer = worker_client.succeed("late-1", claimed["lease_token"], cost=41)
    assert isinstance(answer, Applied)
    job = admin.job("late-1")
    assert (job["state"], job["cost"], job["net"]) == (JobState.SUCCEEDED, 41, -41)
    assert admin.account("late")["balance"] == 959
    assert admin.audit()["ok"]


async def test_the_asyncio_worker_prices_held_items(server, admin):
    base, _ = server
    account(admin, "aio-held", 100)
    admin.create_job("aio-held-1", "aio-held", "aio-held", items=[{"id": "a", "hold": 30}, {"id": "b", "hold": 30}])

    async def handler(job):
        assert await job.item_done("a", cost=12) is Flow.CONTINUE
        return Succeeded(costs={"b": 30})

    async with AsyncClient(base, token=WORKER) as c:
        assert await AsyncWorker(c, kind="aio-held", handler=handler, name="py-aio-held", wait_seconds=1).run(max_jobs=1) == 1
    job = admin.job("aio-held-1")
    assert (job["state"], job["cost"], job["net"]) == (JobState.SUCCEEDED, 42, -42)
    assert admin.account("aio-held")["balance"] == 58


# ----- a worker that must stop releases its job (semantics §3 "Release") -------------------------


def _due(job: dict) -> bool:
    not_before = datetime.datetime.fromisoformat(job["not_before"].replace("Z", "+00:00"))
    return not_before <= datetime.datetime.now(datetime.timezone.utc)


def _assert_released(admin: Client, account_id: str, job_id: str, done: list[str], n: int, cost: int) -> None:
    """The job is queued again and due, its one attempt closed `released`, the items reported
    delivered and the rest still charged: nothing refunded, nothing charged twice."""
    job = admin.job(job_id)
    assert (job["state"], job["attempt"], job["cancel_requested"]) == (JobState.QUEUED, 1, False), job
    assert _due(job), job["not_before"]
    assert [i["state"] for i in job["items"]] == ["succeeded"] * len(done) + ["charged"] * (n - len(done)), job["items"]
    assert [(a["result"], a["fail_code"]) for a in admin.attempts(job_id)] == [("released", None)]
    entries = [e["kind"] for e in admin.ledger(account_id)["entries"] if e["job_id"] == job_id]
    assert entries == ["charge"] * n, entries
    assert job["net"] == -n * cost


def test_a_stopped_worker_releases_its_job_after_the_item_in_hand(admin, worker_client):
    """stop() during the first of four items: that item finishes and is reported, its report answers
    STOP, and the job is handed back — not run to its end (the user's report: SIGTERM two seconds
    into a four-frame job ran all four). The released attempt does not count toward max_attempts."""
    account(admin, "drain", 1_000)
    admin.create_job("drain-1", "drain", "drain", items=[(f"f{i}", 10) for i in range(4)], max_attempts=2)
    in_first = threading.Event()
    done: list[str] = []
    seen: list[tuple[bool, bool]] = []

    def handler(job):
        for item in job.items_to_do():
            in_first.set()
            time.sleep(0.5)  # the frame
            flow = job.item_done(item["id"])
            done.append(item["id"])
            if flow is Flow.STOP:
                seen.append((job.stopping, job.cancel_requested))
                return Cancelled()
        return Succeeded()

    w = Worker(worker_client, kind="drain", handler=handler, name="py-drain", wait_seconds=1)
    t = threading.Thread(target=w.run)
    t.start()
    assert in_first.wait(20)
    w.stop()
    t.join(30)
    assert not t.is_alive()
    assert 1 <= len(done) <= 2, done
    assert seen == [(True, False)], "the worker's own stop, not a cancel"
    _assert_released(admin, "drain", "drain-1", done, 4, 10)
    assert admin.account("drain")["balance"] == 960, "still charged, no refund"

    # The release did not use the budget: with max_attempts=2, the next attempt's failure is retried,
    # not dead, and the attempt after it finishes the items the released one left.
    runs: list[tuple[int, list[str]]] = []

    def second(job):
        todo = [i["id"] for i in job.items_to_do()]
        runs.append((job.attempt, todo))
        if job.attempt == 2:
            return Failed("NODE_DOWN", "node went away", retry_after_ms=10)
        for item in todo:
            assert job.item_done(item) is Flow.CONTINUE
        return Succeeded()

    w2 = Worker(worker_client, kind="drain", handler=second, name="py-drain-2", wait_seconds=2)
    assert w2.run(max_jobs=1) == 1
    job = admin.job("drain-1")
    assert job["state"] == JobState.QUEUED and job["last_error"]["code"] == "NODE_DOWN", job
    assert w2.run(max_jobs=1) == 1
    rest = [f"f{i}" for i in range(len(done), 4)]
    assert runs == [(2, rest), (3, rest)], runs
    job = admin.job("drain-1")
    assert job["state"] == JobState.SUCCEEDED, job
    assert [a["result"] for a in admin.attempts("drain-1")] == ["released", "failed", "succeeded"]
    assert admin.account("drain")["balance"] == 960, "each item charged once in the end"
    assert admin.audit()["ok"] is True


def test_sigterm_releases_the_job_after_the_item_in_hand(server, admin):
    """The user's case as it happens: a worker process with run(handle_signals=True) gets SIGTERM
    during the first of four frames; it finishes that frame, releases the job and exits."""
    base, _ = server
    account(admin, "preempt", 100)
    admin.create_job("preempt-1", "preempt", "preempt", items=[(f"frame-{i}", 10) for i in range(4)])
    script = textwrap.dedent(
        f"""
        import time
        from settle_client import Cancelled, Client, Flow, Succeeded, Worker
        def render(job):
            for item in job.items_to_do():
                print("frame", item["id"], flush=True)
                time.sleep(1.0)
                if job.item_done(item["id"]) is Flow.STOP:
                    print("stopping", job.stopping, job.cancel_requested, flush=True)
                    return Cancelled()
            return Succeeded()
        w = Worker(Client({base!r}, token={WORKER!r}), kind="preempt", handler=render, name="preemptible", wait_seconds=1)
        print("ran", w.run(handle_signals=True), flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "frame frame-0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stdout.read().splitlines() == ["stopping True False", "ran 1"]
    _assert_released(admin, "preempt", "preempt-1", ["frame-0"], 4, 10)
    assert admin.account("preempt")["balance"] == 60


async def test_a_stopped_asyncio_worker_releases_its_job_after_the_item_in_hand(server, admin):
    import asyncio

    base, _ = server
    account(admin, "adrain", 1_000)
    admin.create_job("adrain-1", "adrain", "adrain", items=[(f"f{i}", 10) for i in range(4)])
    in_first = asyncio.Event()
    done: list[str] = []
    seen: list[tuple[bool, bool]] = []

    async def handler(job):
        for item in job.items_to_do():
            in_first.set()
            await asyncio.sleep(0.5)  # the frame
            flow = await job.item_done(item["id"])
            done.append(item["id"])
            if flow is Flow.STOP:
                seen.append((job.stopping, job.cancel_requested))
                return Cancelled()
        return Succeeded()

    async with AsyncClient(base, token=WORKER) as c:
        w = AsyncWorker(c, kind="adrain", handler=handler, name="py-adrain", wait_seconds=1)
        task = asyncio.create_task(w.run())
        await asyncio.wait_for(in_first.wait(), 20)
        w.stop()
        assert await asyncio.wait_for(task, 30) == 1
    assert 1 <= len(done) <= 2, done
    assert seen == [(True, False)]
    _assert_released(admin, "adrain", "adrain-1", done, 4, 10)
    assert admin.account("adrain")["balance"] == 960


def test_a_handler_may_release_its_job_itself(admin, worker_client):
    """`Released()`: the job goes back to the queue; with max_attempts=1 the next attempt still runs
    and succeeds (the released one did not count)."""
    account(admin, "handback", 100)
    admin.create_job("handback-1", "handback", "handback", items=[("a", 10), ("b", 10)], max_attempts=1)

    def handler(job):
        if job.attempt == 1:
            assert job.item_done("a") is Flow.CONTINUE and not job.stopping
            return Released()
        assert [i["id"] for i in job.items_to_do()] == ["b"]
        assert job.item_done("b") is Flow.CONTINUE
        return Succeeded()

    assert Worker(worker_client, kind="handback", handler=handler, name="py-handback", wait_seconds=1).run(max_jobs=2) == 2
    job = admin.job("handback-1")
    assert (job["state"], job["attempt"], job["net"]) == (JobState.SUCCEEDED, 2, -20), job
    assert [a["result"] for a in admin.attempts("handback-1")] == ["released", "succeeded"]
    assert admin.account("handback")["balance"] == 80


def test_a_stopping_worker_still_reports_a_requested_cancel(admin, worker_client):
    """A cancel requested while the worker is also stopping: `Cancelled()` is the failure
    `CANCELLED` as ever — the job is cancelled and its undelivered items refunded, not put back."""
    account(admin, "stopcancel", 1_000)
    admin.create_job("stopcancel-1", "stopcancel", "stopcancel", items=[(f"f{i}", 10) for i in range(4)])
    one_done, go_on = threading.Event(), threading.Event()
    seen: list[tuple[str, bool, bool]] = []

    def handler(job):
        for item in job.items_to_do():
            if item["id"] == "f1":
                one_done.set()
                go_on.wait(10)
            if job.item_done(item["id"]) is Flow.STOP:
                seen.append((item["id"], job.stopping, job.cancel_requested))
                return Cancelled()
        return Succeeded()

    w = Worker(worker_client, kind="stopcancel", handler=handler, name="py-stopcancel", wait_seconds=1)
    t = threading.Thread(target=w.run)
    t.start()
    assert one_done.wait(20)
    assert admin.cancel("stopcancel-1")["cancel_requested"] is True
    w.stop()
    go_on.set()
    t.join(30)
    assert not t.is_alive()
    assert seen == [("f1", True, True)], seen
    job = admin.job("stopcancel-1")
    deadline = time.time() + 10
    while job["state"] != JobState.CANCELLED and time.time() < deadline:
        time.sleep(0.1)
        job = admin.job("stopcancel-1")
    assert job["state"] == JobState.CANCELLED, job
    assert [i["state"] for i in job["items"]] == ["succeeded", "succeeded", "cancelled", "cancelled"]
    [attempt] = admin.attempts("stopcancel-1")
    assert attempt["result"] != "released" and attempt["fail_code"] == "CANCELLED", attempt
    assert admin.account("stopcancel")["balance"] == 1_000 - 20


def test_release_answers_applied_replayed_or_lease_lost(admin, worker_client, hooks):
    """`Client.release` reads its answer as the other reports do (decision 0019): applied, a replay
    when re-sent, `LeaseLost` with a stale token."""
    account(admin, "handed", 100)
    admin.create_job("handed-1", "handed", "handed", items=[("a", 10), ("b", 10)])
    (job,) = worker_client.claim("py-handed", kinds=["handed"])
    token = job["lease_token"]
    assert isinstance(worker_client.item_succeed("handed-1", "a", token), Applied)
    first = worker_client.release("handed-1", token)
    assert isinstance(first, Applied) and not first.replayed
    assert (first["state"], first["attempt"], [i["state"] for i in first["items"]]) == ("queued", 1, ["succeeded", "charged"])
    again = worker_client.release("handed-1", token)
    assert isinstance(again, Replayed) and again.replayed and again["state"] == "queued"
    with pytest.raises(LeaseLost) as e:
        worker_client.release("handed-1", "a-token-never-issued")
    assert (e.value.status, e.value.code, e.value.lease, e.value.state) == (409, "lease_lost", "never_issued", "queued")
    # The next attempt succeeds: a release with its token is refused now (its attempt ended another
    # way), and the first attempt's re-sent release is still a replay.
    (job2,) = worker_client.claim("py-handed", kinds=["handed"])
    assert (job2["attempt"], [i["id"] for i in job2["items"] if i["state"] == "charged"]) == (2, ["b"])
    assert isinstance(worker_client.succeed("handed-1", job2["lease_token"]), Applied)
    with pytest.raises(LeaseLost) as e:
        worker_client.release("handed-1", job2["lease_token"])
    assert (e.value.lease, e.value.state, e.value.attempt["result"]) == ("ended", "succeeded", "succeeded")
    assert isinstance(worker_client.release("handed-1", token), Replayed)
    assert [a["result"] for a in admin.attempts("handed-1")] == ["released", "succeeded"]
    assert admin.account("handed")["balance"] == 80
    hooks.wait_for(lambda e: e["type"] == "job.released" and e.get("job_id") == "handed-1")


def test_iter_events_goes_on_after_a_restore(tmp_path):
    """A store restored from a backup numbers events again under a new epoch: a consumer whose
    cursor is past its last event is answered `cursor_ahead`, and `iter_events` goes on from where
    the new epoch begins (deduplicate by (epoch, seq))."""
    from settle_serve import settle_serve

    binary = os.environ.get("SETTLE_BIN", str(ROOT / "target" / "debug" / "settle"))
    db = f"sqlite://{tmp_path / 'settle.db'}"
    env = {"SETTLE_TOKENS": f"admin:ops={ADMIN}", "SETTLE_DATABASE_URL": db}
    with settle_serve(tmp_path, [], env) as base:
        with Client(base, token=ADMIN) as c:
            c.create_account("acme")
            c.grant("acme", "g1", 10)
            subprocess.run([binary, "backup", "--db", db, "--to", str(tmp_path / "b.db")], check=True)
            for i in range(3):
                c.grant("acme", f"later-{i}", 1)
            cursor = c.events(after=0, limit=1000)["events"][-1]["seq"]
    restored = subprocess.run(
        [binary, "restore", "--from", str(tmp_path / "b.db"), "--db", db, "--replace"], capture_output=True, text=True
    )
    assert restored.returncode == 0, restored.stdout + restored.stderr
    with settle_serve(tmp_path, [], env) as base:
        with Client(base, token=ADMIN) as c:
            with pytest.raises(SettleError) as ahead:
                c.events(after=cursor)
            assert ahead.value.code == "cursor_ahead"
            assert ahead.value.details["epoch"] == 2
            c.grant("acme", "after-restore", 5)
            for event in c.iter_events(after=cursor, wait_seconds=1):
                if event["type"] == "account.granted":
                    assert event["epoch"] == 2 and event["data"]["id"] == "after-restore", event
                    assert event["seq"] == ahead.value.details["restart_after"] + 1
                    break
