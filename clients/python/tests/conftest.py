"""A real `settle serve` (SQLite in a temp dir, tokens, a webhook endpoint pointing at a receiver in
this process, fast rescue loops) for the client's tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ADMIN = "python-tests-admin-token"
WORKER = "python-tests-worker-token"
HOOK_SECRET = "python-tests-webhook-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ReadmeHooks:
    """The top README's webhook receiver, run as written there: the events it handled."""

    url: str
    handled: list[dict]


@pytest.fixture(scope="session")
def readme_hooks():
    """Runs the README's receiver (its `Hooks` class, with `SECRET` and `handle` supplied) on a
    free port instead of 8080: the README's example is what the tests check."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```python\n(import json\nfrom http\.server .*?)\nHTTPServer\(.*?```", text, re.S)
    assert found, "the README's Python webhook receiver is missing"
    got = ReadmeHooks()
    got.handled = []
    namespace = {"SECRET": HOOK_SECRET, "handle": got.handled.append}
    exec(found.group(1), namespace)  # noqa: S102 (our own README)
    receiver = namespace["Hooks"]
    receiver.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    got.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield got
    server.shutdown()


@pytest.fixture(scope="session")
def server(hooks, readme_hooks):
    binary = Path(os.environ.get("SETTLE_BIN", ROOT / "target" / "debug" / "settle"))
    assert binary.exists(), f"{binary} is missing: build it first (cargo build)"
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

[[webhooks]]
id = "readme"
url = "{readme_hooks.url}"
secret = "{HOOK_SECRET}"
start_from = "beginning"
"""
    )
    port = free_port()
    env = dict(
        os.environ,
        SETTLE_TOKENS=f"admin:py-admin={ADMIN},worker:py-worker={WORKER}",
        SETTLE_DATABASE_URL=os.environ.get("SETTLE_PYTHON_TESTS_DB", "sqlite://" + str(Path(work.name) / "settle.db")),
    )
    log = open(Path(work.name) / "serve.log", "w")
    proc = subprocess.Popen(
        [str(binary), "serve", "--listen", f"127.0.0.1:{port}", "--config", str(config), "--artifacts", str(Path(work.name) / "artifacts")],
        cwd=work.name,
        env=env,
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(base + "/healthz", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError((Path(work.name) / "serve.log").read_text())
    yield base, Path(work.name)
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
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
