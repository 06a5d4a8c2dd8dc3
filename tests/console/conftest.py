"""A real `settle serve` (SQLite, a temp dir, tokens) and a real headless Chromium for the console's
end-to-end tests. Started once per test session; every test seeds what it needs over the HTTP API."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from settle_serve import ROOT as _ROOT, free_port, settle_serve  # noqa: E402 (the shared helper, beside this suite)
ADMIN = "console-e2e-admin-token"
CLIENT = "console-e2e-client-token"
CHROMIUM = os.environ.get("SETTLE_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Api:
    """The HTTP API, to seed data as a platform would."""

    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, body=None, token: str = ADMIN):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def account(self, account_id: str, credits: int):
        assert self.call("POST", "/v1/accounts", {"id": account_id})[0] in (200, 201)
        status, _ = self.call("POST", f"/v1/accounts/{account_id}/grants", {"id": f"g-{account_id}", "amount": credits})
        assert status in (200, 201)

    def dead_job(self, job_id: str, account_id: str, kind: str = "render"):
        """A job that was charged, ran once, failed TIMEOUT and died (its items refunded). The claim
        takes the oldest due job of `kind`: give each test a kind of its own."""
        items = [{"id": "frame-1", "cost": 10}, {"id": "frame-2", "cost": 20}]
        status, job = self.call(
            "POST", "/v1/jobs", {"id": job_id, "account_id": account_id, "kind": kind, "items": items, "max_attempts": 1}
        )
        assert status == 201, job
        status, claimed = self.call("POST", "/v1/claims", {"worker": "gpu-7", "kinds": [kind]})
        assert status == 200 and claimed["jobs"], claimed
        token = claimed["jobs"][0]["lease_token"]
        status, job = self.call(
            "POST",
            f"/v1/jobs/{job_id}/fail",
            {"lease_token": token, "code": "TIMEOUT", "message": "no answer in 30 s", "retryable": False},
        )
        assert status == 200 and job["state"] == "dead", job

    def job(self, job_id: str):
        return self.call("GET", f"/v1/jobs/{job_id}")[1]

    def settled_withdrawal(self, withdrawal_id: str, account_id: str, amount: int, destination: str):
        """A withdrawal, once the payout processor and the reconciler have settled it."""
        body = {"id": withdrawal_id, "account_id": account_id, "amount": amount, "destination": destination}
        status, w = self.call("POST", "/v1/withdrawals", body)
        assert status == 201, w
        deadline = time.monotonic() + 60
        while w["state"] not in ("succeeded", "dead"):
            assert time.monotonic() < deadline, f"{withdrawal_id} still {w['state']} after 60 s"
            time.sleep(0.2)
            w = self.call("GET", f"/v1/withdrawals/{withdrawal_id}")[1]
        return w


@pytest.fixture(scope="session")
def server():
    env = {"SETTLE_TOKENS": f"admin:ops-ana={ADMIN},client:support-sam={CLIENT}"}
    with tempfile.TemporaryDirectory(prefix="settle-console-e2e-") as work, settle_serve(Path(work), [], env) as base:
        yield base, Api(base)


@pytest.fixture(scope="session")
def payout_server():
    """A `settle serve` paying out through `settle provider-sim` that loses every answer after it
    paid (so each payout is `unknown` until the reconciler asks; refused addresses are answered),
    the reconciler on a half-second pace."""
    binary = os.environ.get("SETTLE_BIN", str(_ROOT / "target" / "debug" / "settle"))
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="settle-console-payouts-") as work, contextlib.ExitStack() as stack:
        sim_log = open(Path(work) / "sim.log", "w")
        stack.callback(sim_log.close)
        sim = subprocess.Popen(
            [binary, "provider-sim", "--listen", f"127.0.0.1:{port}", "--lose-answer", "1"], stdout=sim_log, stderr=sim_log
        )
        stack.callback(lambda: (sim.terminate(), sim.wait(timeout=30)))
        env = {
            "SETTLE_TOKENS": f"admin:ops-ana={ADMIN},client:support-sam={CLIENT}",
            "SETTLE_PROVIDER_URL": f"http://127.0.0.1:{port}",
            "SETTLE_LOOPS_RECONCILE_EVERY_MS": "500",
        }
        base = stack.enter_context(settle_serve(Path(work), [], env))
        yield base, Api(base)


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def context(browser, server):
    """A fresh browser profile that refuses, and records, every request to another origin."""
    yield from _guarded_context(browser, server[0])


@pytest.fixture
def payout_context(browser, payout_server):
    """As `context`, for the server that pays out."""
    yield from _guarded_context(browser, payout_server[0])


def _guarded_context(browser, base):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    outside = []

    def guard(route):
        if route.request.url.startswith(base) or route.request.url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    ctx.route("**/*", guard)
    ctx.outside_requests = outside
    yield ctx
    ctx.close()
    assert not outside, f"pages asked another origin for: {outside}"
