"""`settle serve` for the Python test suites (the console's browser tests, the Python client's
tests): on a free loopback port, its output in a log file, started once `/healthz` answers, and
stopped (SIGTERM, then SIGKILL after 30 s) when the block ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def settle_serve(workdir: Path, args: list[str], env: dict[str, str]) -> Iterator[str]:
    """Runs `settle serve ARGS` in `workdir` with `env` added to the environment; yields its base
    URL. The binary is `SETTLE_BIN`, else `target/debug/settle`."""
    binary = Path(os.environ.get("SETTLE_BIN", ROOT / "target" / "debug" / "settle"))
    assert binary.exists(), f"{binary} is missing: build it first (cargo build)"
    port = free_port()
    log_path = workdir / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(binary), "serve", "--listen", f"127.0.0.1:{port}", *args],
            cwd=workdir,
            env=dict(os.environ, **env),
            stdout=log,
            stderr=log,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(400):
                try:
                    urllib.request.urlopen(base + "/healthz", timeout=1)
                    break
                except OSError:
                    if proc.poll() is not None:
                        break
                    time.sleep(0.05)
            else:
                raise RuntimeError("settle serve did not answer within 20 s: " + log_path.read_text())
            if proc.poll() is not None:
                raise RuntimeError("settle serve exited: " + log_path.read_text())
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def settle_funding_sim(workdir: Path) -> Iterator[str]:
    """Runs `settle funding-sim` (the funding provider simulator, `funding-v1`) on a free loopback
    port; yields its base URL. Customers starting with `declined` are declined."""
    binary = Path(os.environ.get("SETTLE_BIN", ROOT / "target" / "debug" / "settle"))
    port = free_port()
    with open(workdir / "funding-sim.log", "w") as log:
        proc = subprocess.Popen(
            [str(binary), "funding-sim", "--listen", f"127.0.0.1:{port}"], cwd=workdir, stdout=log, stderr=log
        )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(400):
                try:
                    urllib.request.urlopen(base + "/v1/executed", timeout=1)
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise RuntimeError("settle funding-sim exited: " + (workdir / "funding-sim.log").read_text())
                    time.sleep(0.05)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)
