"""A real `settle serve` (SQLite in a temp dir, tokens, a webhook endpoint pointing at a receiver in
this process, fast rescue loops) for the client's tests."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from settle_serve import settle_funding_sim, settle_serve  # noqa: E402 (the helper the repository's Python suites share)

ADMIN = "python-tests-admin-token"
WORKER = "python-tests-worker-token"
HOOK_SECRET = "python-tests-webhook-secret"


class Hooks:
    """What the webhook receiver got: (headers, body) per delivery."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.lock = threading.Lock()

    def wait_for(self, predicate, timeout: float = 20.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                for headers, body in self.received:
                    if predicate(json.loads(body)):
                        return headers, body
            time.sleep(0.05)
        raise AssertionError("no such webhook delivery")


@pytest.fixture(scope="session")
def hooks():
    got = Hooks()

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server API)
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            with got.lock:
                got.received.append((dict(self.headers.items()), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    got.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield got
    server.shutdown()


@pytest.fixture(scope="session")
def server(hooks):
    work = tempfile.TemporaryDirectory(prefix="settle-python-tests-")
    config = Path(work.name) / "settle.toml"
    config.write_text(
        f"""
[defaults]
retryable_codes = ["NODE_DOWN", "TIMEOUT", "WORKER_ERROR"]
backoff_ms_base = 100
backoff_ms_max = 200

[loops]
rescue_every_ms = 200
sweep_every_ms = 200

[[webhooks]]
id = "tests"
url = "{hooks.url}"
secret = "{HOOK_SECRET}"
start_from = "beginning"
"""
    )
    env = {
        "SETTLE_TOKENS": f"admin:py-admin={ADMIN},worker:py-worker={WORKER}",
        "SETTLE_DATABASE_URL": os.environ.get("SETTLE_PYTHON_TESTS_DB", "sqlite://" + str(Path(work.name) / "settle.db")),
    }
    args = ["--config", str(config), "--artifacts", str(Path(work.name) / "artifacts")]
    with settle_funding_sim(Path(work.name)) as funding:
        env["SETTLE_FUNDING_URL"] = funding
        with settle_serve(Path(work.name), args, env) as base:
            yield base, Path(work.name)
    work.cleanup()


@pytest.fixture
def admin(server):
    from settle_client import Client

    base, _ = server
    with Client(base, token=ADMIN) as c:
        yield c


@pytest.fixture
def worker_client(server):
    from settle_client import Client

    base, _ = server
    with Client(base, token=WORKER) as c:
        yield c
