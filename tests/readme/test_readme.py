"""Every code block of README.md, run as written (issue 20): the shell blocks against the `settle
serve` they start, the Python blocks in the tests' venv, the TypeScript blocks compiled by the
package's own `tsc --strict` and run by Node, the webhook configuration served and its event body
compared with what Settle sends. `CLAIMS` names every block; a block no claim matches (a new one)
or a claim that matches none (a block rewritten) fails `test_every_block_is_claimed_once`.

Two liberties, both in `localize` and the `cargo` shim: the README's addresses (127.0.0.1:7070,
:7071, :8080) become free ports, so a run never collides with a Settle already running on this
machine; and `cargo run --release -- ARGS` runs the binary scripts/test built (`SETTLE_BIN`, the
debug build of the same code) rather than a second, release build.

Run by scripts/test-readme (so by scripts/test), which provides the venv, the TypeScript package's
build, moto and a PostgreSQL database.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SETTLE_BIN = Path(os.environ.get("SETTLE_BIN", ROOT / "target" / "debug" / "settle"))
TS_PACKAGE = ROOT / "clients" / "typescript"


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based


def readme_blocks() -> list[Block]:
    """The fenced blocks of README.md, indentation (of a block inside a list) removed."""
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^( *)```(\S*)\s*$", lines[i])
        if m:
            indent, lang, start = len(m[1]), m[2], i + 1
            assert lang, f"README.md:{start}: a code block without a language"
            body = []
            i += 1
            while not re.match(r"^ *```\s*$", lines[i]):
                body.append(lines[i][indent:])
                i += 1
            blocks.append(Block(lang, "\n".join(body) + "\n", start))
        i += 1
    return blocks


# Every README block, by name: (language, a predicate on its text). Each matches exactly one block.
CLAIMS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "serve": ("sh", lambda t: t == "cargo run --release -- serve\n"),
    "test": ("sh", lambda t: t == "scripts/test\n"),
    "first_session": ("sh", lambda t: "/v1/accounts/alice/grants" in t),
    "held_session": ("sh", lambda t: '"hold":100' in t),
    "grants_session": ("sh", lambda t: "dave-trial" in t),
    "payouts_serve": ("sh", lambda t: "provider-sim" in t),
    "payouts_session": ("sh", lambda t: "/v1/withdrawals -H" in t),
    "top_ups_session": ("sh", lambda t: "/v1/top-ups -H" in t),
    "auto_top_up_session": ("sh", lambda t: "/auto-top-up -H" in t),
    "python_worker": ("python", lambda t: "Worker(" in t),
    "python_webhook": ("python", lambda t: "HTTPServer" in t),
    "ts_charge": ("ts", lambda t: "createJob" in t),
    "ts_webhook": ("ts", lambda t: "createServer" in t),
    "s3": ("sh", lambda t: "--artifacts s3://" in t),
    "postgres": ("sh", lambda t: "-- demo --db" in t),
    "webhook_config": ("toml", lambda t: "[[webhooks]]" in t),
    "event_body": ("json", lambda t: '"seq"' in t),
    "refund_on_recipe": ("sh", lambda t: "erin-pack" in t),
    "lines_session": ("sh", lambda t: "fay-pack" in t),
    "alerts_session": ("sh", lambda t: "gil-pack" in t),
    "limits_session": ("sh", lambda t: "hal-pack" in t),
    "card_recipe": ("python", lambda t: "on_payment_succeeded" in t),
}


def block(name: str) -> str:
    lang, matches = CLAIMS[name]
    found = [b for b in readme_blocks() if b.lang == lang and matches(b.text)]
    assert len(found) == 1, f"README block {name!r}: {len(found)} blocks match"
    return found[0].text


def test_every_block_is_claimed_once() -> None:
    for b in readme_blocks():
        names = [n for n, (lang, matches) in CLAIMS.items() if b.lang == lang and matches(b.text)]
        assert len(names) == 1, f"README.md:{b.line} ({b.lang}) is claimed by {names}: give it a test here"
    for name in CLAIMS:
        block(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Env:
    """The README's world for one test: its directory, its ports, the environment its blocks see."""

    cwd: Path
    api: int
    provider: int
    hook: int
    funding: int
    vars: dict[str, str]

    @property
    def s(self) -> str:
        return f"http://127.0.0.1:{self.api}"

    def localize(self, text: str) -> str:
        for readme_port, port in ((7070, self.api), (7071, self.provider), (7072, self.funding), (8080, self.hook)):
            text = text.replace(f"127.0.0.1:{readme_port}", f"127.0.0.1:{port}")
            text = text.replace(f"{readme_port}, \"127.0.0.1\"", f"{port}, \"127.0.0.1\"")  # listen(8080, "127.0.0.1")
            text = text.replace(f"(\"127.0.0.1\", {readme_port})", f"(\"127.0.0.1\", {port})")  # HTTPServer(("127.0.0.1", 8080)…
        return text


@pytest.fixture
def env(tmp_path: Path) -> Env:
    assert SETTLE_BIN.exists(), f"{SETTLE_BIN} is missing: build it first (cargo build)"
    shims = tmp_path / "bin"
    shims.mkdir()
    cargo = shims / "cargo"
    cargo.write_text(
        "#!/usr/bin/env bash\n"
        "# The README's `cargo run --release -- ARGS`, on the binary scripts/test built.\n"
        'if [ "$1 $2 $3" = "run --release --" ]; then shift 3; exec "$SETTLE_BIN" "$@"; fi\n'
        'echo "README test: no shim for cargo $*" >&2; exit 2\n'
    )
    cargo.chmod(0o755)
    cwd = tmp_path / "work"
    cwd.mkdir()
    e = Env(cwd, free_port(), free_port(), free_port(), free_port(), {})
    e.vars = {
        "PATH": f"{shims}:{os.environ['PATH']}",
        "SETTLE_BIN": str(SETTLE_BIN),
        "SETTLE_LISTEN": f"127.0.0.1:{e.api}",
    }
    return e


def run_sh(env: Env, text: str, timeout: float = 300, **extra: str) -> str:
    """Runs a shell block to its end (bash, stopping at the first failing command); its stdout."""
    p = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", env.localize(text)],
        cwd=env.cwd,
        env=dict(os.environ, **env.vars, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"block failed ({p.returncode}):\n{text}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


class Background:
    """A block that serves (a server in the README's "another terminal"): its own process group,
    its output in a file, stopped with SIGTERM (SIGKILL after 30 s) at the end."""

    def __init__(self, env: Env, argv: list[str], name: str, **extra: str) -> None:
        self.log = env.cwd.parent / f"{name}.log"
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(
            argv,
            cwd=env.cwd,
            env=dict(os.environ, **env.vars, **extra),
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, what: Callable[[], bool], timeout: float = 30, why: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}):\n{self.output()}"
            assert time.monotonic() < deadline, f"{why or 'not ready'} after {timeout} s:\n{self.output()}"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the block left behind (`… &`)
        self.out.close()
        return self.proc.returncode


@contextlib.contextmanager
def background(env: Env, argv: list[str], name: str, **extra: str) -> Iterator[Background]:
    b = Background(env, argv, name, **extra)
    try:
        yield b
    finally:
        b.stop()


def sh_background(env: Env, text: str, name: str, **extra: str) -> contextlib.AbstractContextManager[Background]:
    return background(env, ["bash", "-euo", "pipefail", "-c", env.localize(text)], name, **extra)


def http(method: str, url: str, body: object | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, json.loads(raw) if raw.startswith(b"{") else {}


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1)
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@contextlib.contextmanager
def readme_serve(env: Env, *args: str, **extra: str) -> Iterator[Background]:
    """The README's first block, `cargo run --release -- serve` (with ARGS after it)."""
    text = block("serve").rstrip("\n") + "".join(f" {a}" for a in args)
    with sh_background(env, text, "serve", **extra) as serve:
        serve.wait_for(lambda: answers(env.s + "/healthz"), why="settle serve did not answer")
        yield serve


def poll(what: Callable[[], object], timeout: float = 60, why: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, why or "timed out"
        time.sleep(0.2)


def test_the_test_command_is_what_ci_runs() -> None:
    # `scripts/test` is run as written by .ci/run itself (running it from inside itself would recurse).
    assert block("test").strip() in (ROOT / ".ci" / "run").read_text().splitlines()


def test_first_session_then_payouts(env: Env) -> None:
    with readme_serve(env) as serve:
        assert f"the console is at http://127.0.0.1:{env.api}/console" in serve.output()
        out = run_sh(env, block("first_session"))
        assert '"kind":"reclaim"' in out and '"ok":true' in out, out
        assert http("GET", env.s + "/v1/accounts/alice")[1]["balance"] == 60
        entries = http("GET", env.s + "/v1/accounts/alice/ledger")[1]["entries"]
        assert [e["kind"] for e in entries] == ["grant", "charge", "refund", "reclaim"]
        assert [e["balance_after"] for e in entries] == [100, 60, 100, 60]
        setup = "".join(line + "\n" for line in block("first_session").splitlines() if re.match(r"^[SJ]=", line))
        out = run_sh(env, setup + block("held_session"))
        assert '"code":"cost_required"' in out, out
        assert http("GET", env.s + "/v1/accounts/bob")[1]["balance"] == 163
        entries = http("GET", env.s + "/v1/accounts/bob/ledger")[1]["entries"]
        assert [(e["kind"], e["amount"]) for e in entries] == [("grant", 200), ("charge", -100), ("release", 63)]
        assert http("GET", env.s + "/v1/jobs/render-2")[1]["cost"] == 37
        out = run_sh(env, setup + block("grants_session"))
        grants = http("GET", env.s + "/v1/accounts/dave/grants")[1]["grants"]
        shown = [(g["id"], g["remaining"], g["amount"], g["state"]) for g in grants]
        assert shown == [("dave-pack", 200, 200, "active"), ("dave-trial", 70, 100, "active")], out
        assert grants[1]["expires_at"] and grants[1]["priority"] == 10, grants
        assert http("GET", env.s + "/v1/accounts/dave")[1]["balance"] == 270
        out = run_sh(env, setup + block("lines_session"))
        assert '"jobs":[]' in out, out
        for job, worker in [("fay-urgent", "cpu-1"), ("fay-a100", "gpu-eu-1")]:
            assert http("GET", f"{env.s}/v1/jobs/{job}")[1]["state"] == "succeeded", out
            assert http("GET", f"{env.s}/v1/jobs/{job}/attempts")[1]["attempts"][0]["worker"] == worker, out
        assert http("GET", env.s + "/v1/accounts/fay")[1]["max_running"] == 1, out
        states = [http("GET", f"{env.s}/v1/jobs/{job}")[1]["state"] for job in ("fay-1", "fay-2")]
        assert states == ["running", "queued"], (states, out)
        out = run_sh(env, setup + block("alerts_session"))
        fired = re.findall(r'"type":"account\.balance_low"', out)
        assert len(fired) == 1 and '"balance_after":40' in out, out
        assert http("GET", env.s + "/v1/accounts/gil/alerts")[1]["alerts"] == [{"id": "low", "below": 50, "side": "below"}]
        out = run_sh(env, setup + block("limits_session"))
        assert '"code":"spend_limit_exceeded"' in out and '"remaining":20' in out, out
        assert http("GET", env.s + "/v1/jobs/hal-2")[0] == 404, out
        limits = http("GET", env.s + "/v1/accounts/hal/limits")[1]["limits"]
        assert [(l["period"], l["spent"], l["amount"], l["kinds"]) for l in limits] == [("day", 30, 50, ["render"])], out

    # The payouts step restarts settle serve on the same ./settle.db, pointed at the simulator.
    setup = "".join(line + "\n" for line in block("first_session").splitlines() if re.match(r"^[SJ]=", line))
    with sh_background(env, block("payouts_serve"), "payouts-serve") as serve:
        funding = f"http://127.0.0.1:{env.funding}"
        serve.wait_for(
            lambda: answers(env.s + "/healthz")
            and answers(f"http://127.0.0.1:{env.provider}/v1/executed")
            and answers(funding + "/v1/executed")
        )
        run_sh(env, setup + block("payouts_session"))

        def state(id: str) -> dict | None:
            w = http("GET", f"{env.s}/v1/withdrawals/{id}")[1]
            return w if w["state"] in ("succeeded", "dead") else None

        one = poll(lambda: state("payout-1"), 120, "payout-1 never settled")
        two = poll(lambda: state("payout-2"), 120, "payout-2 never settled")
        assert one["state"] == "succeeded" and one["provider_txid"], one
        assert (two["state"], two["last_error"]["code"]) == ("dead", "INVALID_ADDRESS"), two
        executed = http("GET", f"http://127.0.0.1:{env.provider}/v1/executed")[1]["transfers"]
        assert [(t["key"], t["sends_after_executed"]) for t in executed] == [(one["idempotency_key"], 0)]
        assert http("GET", env.s + "/v1/accounts/alice")[1]["balance"] == 35  # 60 − 25; payout-2's hold refunded
        assert http("GET", env.s + "/v1/audit")[1]["ok"] is True

        # Top-ups through the funding simulator (losing half its answers), on the same server.
        run_sh(env, setup + block("top_ups_session"))

        def bought(id: str) -> dict | None:
            t = http("GET", f"{env.s}/v1/top-ups/{id}")[1]
            return t if t["state"] in ("succeeded", "dead") else None

        paid = poll(lambda: bought("buy-1"), 120, "buy-1 never settled")
        declined = poll(lambda: bought("buy-2"), 120, "buy-2 never settled")
        assert (paid["state"], paid["grant_id"]) == ("succeeded", "buy-1") and paid["provider_charge_id"], paid
        assert (declined["state"], declined["last_error"]["code"], declined["grant_id"]) == ("dead", "CARD_DECLINED", None)
        charges = http("GET", funding + "/v1/executed")[1]["transfers"]
        assert [(t["key"], t["sends_after_executed"]) for t in charges] == [(paid["idempotency_key"], 0)]
        assert http("GET", env.s + "/v1/accounts/alice")[1]["balance"] == 535  # 35 + the 500 bought
        run_sh(env, setup + block("auto_top_up_session"))

        # The rule bought once when render-9 took the balance from 535 under 500: 435 + 500.
        def ruled() -> dict | None:
            ts = [t for t in http("GET", f"{env.s}/v1/top-ups?account_id=alice")[1]["top_ups"] if t["rule"]]
            return ts[0] if len(ts) == 1 and ts[0]["state"] == "succeeded" else None

        rule_top_up = poll(ruled, 120, "the rule's top-up never settled")
        assert rule_top_up["credits"] == 500, rule_top_up
        assert http("GET", env.s + "/v1/accounts/alice")[1]["balance"] == 935  # 35 + 500 − 100 + 500
        assert http("GET", env.s + "/v1/accounts/alice/auto-top-up")[1]["credits_this_month"] == 500
        assert http("GET", env.s + "/v1/audit")[1]["ok"] is True


def test_python_worker(env: Env) -> None:
    worker_py = env.cwd / "worker.py"
    worker_py.write_text(env.localize(block("python_worker")))
    with readme_serve(env):
        assert http("POST", env.s + "/v1/accounts", {"id": "alice"})[0] == 201
        assert http("POST", env.s + "/v1/accounts/alice/grants", {"id": "welcome", "amount": 100})[0] == 201
        items = [{"id": f"frame-{n}", "cost": 10} for n in range(3)]
        job = {"id": "render-1", "account_id": "alice", "kind": "render", "items": items, "payload": {"scene": "intro"}}
        assert http("POST", env.s + "/v1/jobs", job)[0] == 201
        with background(env, [sys.executable, str(worker_py)], "worker") as worker:

            def done() -> dict | None:
                assert worker.proc.poll() is None, f"the worker exited:\n{worker.output()}"
                j = http("GET", env.s + "/v1/jobs/render-1")[1]
                return j if j["state"] == "succeeded" else None

            job_after = poll(done, 60, "the README's worker did not finish render-1")
            assert job_after["result"] == {"frames": 3}
            assert [i["state"] for i in job_after["items"]] == ["succeeded"] * 3
            assert http("GET", env.s + "/v1/accounts/alice")[1]["balance"] == 70
            # SIGTERM stops it after the job in hand (run(handle_signals=True)).
            assert worker.stop() == 0, worker.output()


@pytest.fixture(scope="module")
def ts_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway Node project with the package installed from its directory, as the README says,
    compiled with the package's own TypeScript in the strictest settings it uses itself."""
    project = tmp_path_factory.mktemp("ts-project")
    (project / "package.json").write_text(json.dumps({"name": "readme", "private": True, "type": "module"}))
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", str(TS_PACKAGE)], cwd=project, check=True)
    (project / "tsconfig.json").write_text(
        json.dumps(
            {
                "compilerOptions": {
                    "target": "ES2022",
                    "module": "NodeNext",
                    "moduleResolution": "NodeNext",
                    "strict": True,
                    "noUncheckedIndexedAccess": True,
                    "exactOptionalPropertyTypes": True,
                    "outDir": "out",
                    "typeRoots": [str(TS_PACKAGE / "node_modules" / "@types")],
                    "types": ["node"],
                },
                "include": ["src"],
            }
        )
    )
    return project


def compile_ts(project: Path, env: Env, name: str) -> Path:
    src = project / "src"
    src.mkdir(exist_ok=True)
    (src / f"{name}.ts").write_text(env.localize(block(name)))
    tsc = subprocess.run(
        [str(TS_PACKAGE / "node_modules" / ".bin" / "tsc"), "-p", "."], cwd=project, capture_output=True, text=True
    )
    assert tsc.returncode == 0, f"tsc:\n{tsc.stdout}{tsc.stderr}"
    return project / "out" / f"{name}.js"


def test_typescript_charge(env: Env, ts_project: Path) -> None:
    script = compile_ts(ts_project, env, "ts_charge")
    with readme_serve(env):
        node = lambda: subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=60)  # noqa: E731
        first, again = node(), node()
        assert (first.returncode, first.stdout) == (0, "queued false\n"), first.stderr
        assert (again.returncode, again.stdout) == (0, "queued true\n"), again.stderr
        assert http("GET", env.s + "/v1/accounts/alice")[1]["balance"] == 60


def receiver_argv(name: str, env: Env, ts_project: Path | None) -> list[str]:
    if name == "python_webhook":
        path = env.cwd / "hooks.py"
        path.write_text(env.localize(block(name)))
        return [sys.executable, str(path)]
    assert ts_project is not None
    return ["node", str(compile_ts(ts_project, env, name))]


@pytest.mark.parametrize("receiver", ["python_webhook", "ts_webhook"])
def test_webhook_receiver_with_the_configuration(env: Env, receiver: str, request: pytest.FixtureRequest) -> None:
    config = env.localize(block("webhook_config"))
    secret = re.search(r'^secret = "([^"]+)"', config, re.M)[1]
    (env.cwd / "settle.toml").write_text(config)
    ts_project = request.getfixturevalue("ts_project") if receiver == "ts_webhook" else None
    argv = receiver_argv(receiver, env, ts_project)
    with background(env, argv, "receiver", SETTLE_WEBHOOK_SECRET=secret) as hooks:
        hook_url = f"http://127.0.0.1:{env.hook}/settle"
        hooks.wait_for(lambda: answers(hook_url))
        # It verifies the exact bytes: a body signed with the secret is taken, the same body altered
        # after signing is refused, and so is a signature that is not the secret's.
        from settle_client import sign

        body = b'{"seq":9999,"type":"account.granted","job_id":null,"account_id":"x","data":{"amount":100}}'
        signed = sign(secret, body, int(time.time()))
        for payload, signature, expected in (
            (body, signed, 204),
            (body.replace(b"100", b"900"), signed, 400),
            (body, "t=1,v1=" + "0" * 64, 400),
        ):
            req = urllib.request.Request(hook_url, data=payload, method="POST", headers={"Settle-Signature": signature})
            try:
                status = urllib.request.urlopen(req, timeout=5).status
            except urllib.error.HTTPError as err:
                status = err.code
            assert status == expected, (payload, signature)
        hooks.wait_for(lambda: "9999 account.granted" in hooks.output(), why="the signed body was not handled")
        with readme_serve(env, "--config", "settle.toml"):
            assert http("POST", env.s + "/v1/accounts", {"id": "alice"})[0] == 201
            assert http("POST", env.s + "/v1/accounts/alice/grants", {"id": "welcome", "amount": 100})[0] == 201
            events = http("GET", env.s + "/v1/events")[1]["events"]
            granted = next(e for e in events if e["type"] == "account.granted")
            line = f"{granted['seq']} account.granted"
            hooks.wait_for(lambda: line in hooks.output(), why="Settle's delivery did not reach the receiver")
    assert "900" not in hooks.output(), "an altered body was handled"
    # The README's event body is the envelope Settle sends, field for field.
    shown = json.loads(block("event_body"))
    assert (shown.keys(), shown["type"], shown["data"].keys()) == (granted.keys(), granted["type"], granted["data"].keys())


@contextlib.contextmanager
def moto(env: Env) -> Iterator[str]:
    port = free_port()
    server = Path(sys.executable).parent / "moto_server"
    with background(env, [str(server), "-H", "127.0.0.1", "-p", str(port)], "moto") as m:
        endpoint = f"http://127.0.0.1:{port}"
        m.wait_for(lambda: answers(endpoint + "/moto-api/data.json"), why="moto did not answer")
        yield endpoint


def test_s3_artifacts(env: Env) -> None:
    with moto(env) as endpoint:
        assert urllib.request.urlopen(urllib.request.Request(endpoint + "/render-outputs", method="PUT")).status == 200
        aws = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "eu-west-1",
            "AWS_ENDPOINT_URL": endpoint,
        }
        with sh_background(env, block("s3"), "serve-s3", **aws) as serve:
            serve.wait_for(lambda: answers(env.s + "/healthz"), why="settle serve on S3 did not start")
            assert http("POST", env.s + "/v1/accounts", {"id": "alice"})[0] == 201
            assert http("POST", env.s + "/v1/accounts/alice/grants", {"id": "welcome", "amount": 100})[0] == 201
            job = {"id": "render-1", "account_id": "alice", "kind": "render", "items": [{"id": "f1", "cost": 10}]}
            assert http("POST", env.s + "/v1/jobs", job)[0] == 201
            token = http("POST", env.s + "/v1/claims", {"worker": "gpu-7"})[1]["jobs"][0]["lease_token"]
            status, art = http("POST", env.s + "/v1/jobs/render-1/items/f1/artifacts", {"lease_token": token, "key": "frame.png"})
            assert status == 201, art
            # The worker writes the object where the answer says, then the job is cancelled under it.
            obj = f"{endpoint}/render-outputs/settle/{art['path']}"
            assert urllib.request.urlopen(urllib.request.Request(obj, data=b"png", method="PUT")).status == 200
            assert http("POST", env.s + "/v1/jobs/render-1/cancel")[0] == 202
            assert http("POST", env.s + "/v1/jobs/render-1/fail", {"lease_token": token, "code": "CANCELLED"})[0] == 200
            poll(lambda: http("GET", env.s + "/v1/jobs/render-1")[1]["state"] == "cancelled", 60, "never cancelled")
            assert not answers_200(obj), "teardown left the undelivered item's artifact in S3"


def answers_200(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=5).status == 200
    except urllib.error.HTTPError:
        return False


def test_postgres_demo_and_audit(env: Env) -> None:
    url = os.environ.get("SETTLE_README_TESTS_DB")
    assert url, "SETTLE_README_TESTS_DB (an empty PostgreSQL database) is set by scripts/test-readme"
    out = run_sh(env, block("postgres"), timeout=600, SETTLE_DATABASE_URL=url)
    # The demo's stories ran on PostgreSQL (its last line the totals), and the audit found them clean.
    assert re.search(r"^audit: clean \(\d+ accounts, \d+ items, \d+ ledger entries checked; L1-L9 hold\)$", out, re.M), out
    assert "payout" in out, out


def test_recipes(env: Env) -> None:
    """Issue 42, part 10: choosing refund_on (a bounce and a debt with `failure`, a held charge with
    `final_failure`) and a card processor's payment granted once however often it is delivered."""
    with readme_serve(env):
        out = run_sh(env, block("refund_on_recipe"))
        for said in ("erin after a retryable failure: 100", "erin after the late success: -60", "fran after a retryable failure: 40"):
            assert said in out, out
        entries = http("GET", env.s + "/v1/accounts/erin/ledger")[1]["entries"]
        assert [(e["kind"], e["amount"]) for e in entries] == [("grant", 100), ("charge", -60), ("refund", 60), ("charge", -100), ("reclaim", -60)]
        path = env.cwd / "payments.py"
        path.write_text(env.localize(block("card_recipe")))
        for _ in range(2):  # the whole handler twice: the processor's re-delivery, or a re-run after a crash
            p = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
            assert p.returncode == 0 and "gina: 1000" in p.stdout, p.stdout + p.stderr
        entries = http("GET", env.s + "/v1/accounts/gina/ledger")[1]["entries"]
        assert [(e["kind"], e["amount"]) for e in entries] == [("grant", 1000)]
