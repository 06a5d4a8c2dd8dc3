"""The commands of docs/operations/*.md, run as written (issue 42, part 6), as the README's are.

Every `sh` and `sql` block of every guide is claimed below, by name. A block that can run on any
machine is run: `settle` is the binary scripts/test built (on PATH), the guides' paths
(`/var/lib/settle`, `/backups`) are a temp folder's, their PostgreSQL URL a fresh database of the
test server, `sudo -u settle` is dropped. A block that administers the machine itself — `dpkg`,
`systemctl`, a container build — is claimed with the reason it is not run here and what runs it
instead (scripts/test-release, as root, installs the .deb and serves through it as the unit does).
A block no claim matches, or a claim that matches no block, fails `test_every_block_is_claimed_once`.

Run by scripts/test-guides (so by scripts/test), which builds the binaries and provides pytest.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ROOT / "docs" / "operations"
BIN = ROOT / "target" / "debug"


@dataclass(frozen=True)
class Block:
    guide: str
    lang: str
    text: str
    line: int


def blocks() -> list[Block]:
    out = []
    for guide in sorted(GUIDES.glob("*.md")):
        lines = guide.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
            if m:
                indent, lang, start = len(m[1]), m[2], i + 1
                body = []
                i += 1
                while not lines[i].strip().startswith("```"):
                    body.append(lines[i][indent:])
                    i += 1
                if lang in ("sh", "sql"):
                    out.append(Block(guide.name, lang, "\n".join(body) + "\n", start))
            i += 1
    return out


# guide → [(name, predicate, None to run it or why it is not run here)]
NOT_HERE_DEB = "installs a package as root: scripts/test-release does it (dpkg -i, serves as the unit does, upgrades, purges)"
NOT_HERE_SYSTEMD = "needs systemd as PID 1 (machines of this kind have none): scripts/test-release serves as the unit does and checks the unit with systemd-analyze where it exists"
CLAIMS: dict[str, tuple[str, object, str | None]] = {
    "backup": ("backup-and-restore.md", lambda t: t.startswith("settle backup"), None),
    "restore": ("backup-and-restore.md", lambda t: t.startswith("settle restore"), None),
    "raise_epoch": ("backup-and-restore.md", lambda t: "INSERT INTO store_epochs" in t, None),
    "copy": ("moving-engines.md", lambda t: t.startswith("settle copy"), None),
    "upgrade_sqlite": ("upgrade.md", lambda t: "dpkg -i" in t, NOT_HERE_DEB),
    "upgrade_postgres": ("upgrade.md", lambda t: "settle migrate" in t, None),
    "release": ("install.md", lambda t: "scripts/release" in t,
                "builds the release (~4 min) and installs as root: run by hand; the issue note gives its time"),
    "install_deb": ("install.md", lambda t: t.startswith("sudo dpkg -i"), NOT_HERE_DEB),
    "tarball": ("install.md", lambda t: t.startswith("tar xzf"), None),
    "clients": ("install.md", lambda t: t.startswith("pip install"), "installs the built wheel and npm tarball: scripts/test-release does"),
    "container": ("install.md", lambda t: "podman build" in t, "needs a container runtime and a registry: neither is on machines of this kind"),
    "tokens": ("systemd.md", lambda t: "openssl rand" in t, None),
    "systemctl": ("systemd.md", lambda t: "systemctl enable" in t, NOT_HERE_SYSTEMD),
}


def claimed(name: str) -> str:
    guide, matches, _ = CLAIMS[name]
    found = [b for b in blocks() if b.guide == guide and matches(b.text)]
    assert len(found) == 1, f"{guide}: claim {name!r} matches {len(found)} blocks"
    return found[0].text


def test_every_block_is_claimed_once() -> None:
    for b in blocks():
        names = [n for n, (g, matches, _) in CLAIMS.items() if g == b.guide and matches(b.text)]
        assert len(names) == 1, f"docs/operations/{b.guide}:{b.line} is claimed by {names}: give it a test here"
    for name in CLAIMS:
        claimed(name)


@pytest.fixture
def world(tmp_path: Path) -> dict[str, str]:
    """Where the guides' absolute paths land, and the environment their commands see."""
    (tmp_path / "var").mkdir()
    (tmp_path / "backups").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLE_")}
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return {"root": str(tmp_path), **{f"env:{k}": v for k, v in env.items()}}


def run(world: dict[str, str], text: str, **replace: str) -> str:
    root = world["root"]
    text = text.replace("/var/lib/settle", f"{root}/var").replace("/backups", f"{root}/backups")
    text = text.replace("sudo -u settle ", "")
    for old, new in replace.items():
        text = text.replace(old, new)
    env = {k[4:]: v for k, v in world.items() if k.startswith("env:")}
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"block failed ({p.returncode}):\n{text}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout + p.stderr


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "settle"), *args], capture_output=True, text=True, timeout=300)


def psql(url: str, sql: str, *vars: str) -> str:
    args = ["psql", url, "-v", "ON_ERROR_STOP=1", "-At", *[a for v in vars for a in ("-v", v)]]
    p = subprocess.run(args, input=sql, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def pg_url() -> str:
    """A fresh, empty database on the test PostgreSQL server (started if none answers; scripts/test
    stops it at the end)."""
    p = subprocess.run([str(BIN / "settle-test-database")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("postgres"), p.stderr
    return p.stdout.strip()


def test_backup_then_restore(world: dict[str, str]) -> None:
    store = f"sqlite://{world['root']}/var/settle.db"
    assert settle("demo", "--db", store).returncode == 0
    out = run(world, claimed("backup"))
    made = list(Path(world["root"], "backups").glob("settle-*.db"))
    assert len(made) == 1, out
    # The restore names the backup by its time: the one just taken goes by that name.
    named = re.search(r"/backups/(settle-\d{8}T\d{6}\.db)", claimed("restore"))[1]
    made[0].rename(Path(world["root"], "backups", named))
    out = run(world, claimed("restore"))
    assert "epoch 2" in out, out
    assert list(Path(world["root"], "var").glob("settle.db.replaced-*")), "the replaced store is kept aside"
    assert settle("audit", "--db", store).returncode == 0


def test_raising_the_epoch_after_a_postgresql_restore() -> None:
    url = pg_url()
    assert settle("demo", "--db", url).returncode == 0
    before = psql(url, "SELECT MAX(epoch) FROM store_epochs;").strip()
    psql(url, claimed("raise_epoch"), "highest_epoch_receivers_saw=3")
    epoch, first = psql(url, "SELECT epoch, first_seq FROM store_epochs ORDER BY epoch DESC LIMIT 1;").strip().split("|")
    top = psql(url, "SELECT value FROM counters WHERE name = 'outbox';").strip()
    assert (before, epoch, first) == ("1", "4", str(int(top) + 1)), (before, epoch, first, top)
    assert settle("audit", "--db", url).returncode == 0


def test_moving_an_embedded_store_to_postgresql(world: dict[str, str]) -> None:
    store = f"sqlite://{world['root']}/var/settle.db"
    assert settle("demo", "--db", store).returncode == 0
    url = pg_url()
    out = run(world, claimed("copy"), **{"postgres://settle@db.internal/settle": url})
    assert "audit" in out.lower(), out
    ledger = psql(url, "SELECT COUNT(*) FROM ledger_entries;").strip()
    assert int(ledger) > 0


def until_answers(url: str, what: str, token: str | None = None) -> None:
    """Waits (200 tries, each up to 1 s) until `url` answers 2xx."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for _ in range(200):
        try:
            if urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=1).status < 300:
                return
        except (OSError, urllib.error.URLError):
            # Refused while it starts, or accepted and not yet answered within the second (a
            # loaded machine: TimeoutError is an OSError): asked again until the deadline.
            pass
        time.sleep(0.05)
    raise AssertionError(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_upgrading_processes_on_postgresql(world: dict[str, str]) -> None:
    url = pg_url()
    port = free_port()
    text = claimed("upgrade_postgres")
    # The last line serves until stopped: it runs in the background while the test asks it.
    *steps, serve = [line for line in text.splitlines() if line and not line.startswith("#")]
    out = run(world, "\n".join(steps) + "\n", **{"postgres://settle@db.internal/settle": url})
    assert "applied" in out or "up to date" in out, out
    serve = serve.replace("postgres://settle@db.internal/settle", url) + f" --listen 127.0.0.1:{port}"
    env = {k[4:]: v for k, v in world.items() if k.startswith("env:")}
    p = subprocess.Popen(["bash", "-c", f"exec {serve}"], cwd=world["root"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until_answers(f"http://127.0.0.1:{port}/readyz", "settle serve --no-migrate did not come up after settle migrate")
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_the_tarball_serves(world: dict[str, str]) -> None:
    """What the tarball holds is the binary itself: the block runs it from a folder of that name."""
    folder = Path(world["root"], "settle-V-x86_64-linux-gnu")
    folder.mkdir()
    shutil.copy(BIN / "settle", folder / "settle")
    text = claimed("tarball")
    lines = [line for line in text.splitlines() if not line.startswith("tar ")]
    port = free_port()
    serve = "\n".join(lines) + f" --listen 127.0.0.1:{port}"
    env = {k[4:]: v for k, v in world.items() if k.startswith("env:")}
    p = subprocess.Popen(["bash", "-c", serve], cwd=world["root"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until_answers(f"http://127.0.0.1:{port}/healthz", "the unpacked settle did not serve")
        assert (folder / "settle.db").exists(), "the store is in the unpacked folder"
    finally:
        subprocess.run(["pkill", "-f", f"127.0.0.1:{port}"])
        p.wait(timeout=30)


def test_the_tokens_file_the_unit_reads(world: dict[str, str]) -> None:
    """The tokens block writes a file `settle serve` accepts: 0640, one admin token of 48 hex digits."""
    etc = Path(world["root"], "etc")
    etc.mkdir()
    group = subprocess.run(["id", "-gn"], capture_output=True, text=True).stdout.strip()
    run(world, claimed("tokens").replace("sudo ", "").replace("-o root -g settle", f"-g {group}"), **{"/etc/settle": str(etc)})
    tokens = etc / "tokens"
    assert oct(tokens.stat().st_mode & 0o777) == "0o640"
    role, token, name = tokens.read_text().split()
    assert (role, len(token), name) == ("admin", 48, "ops")
    port = free_port()
    env = {k[4:]: v for k, v in world.items() if k.startswith("env:")}
    p = subprocess.Popen([str(BIN / "settle"), "serve", "--db", f"sqlite://{world['root']}/t.db", "--tokens", str(tokens),
                          "--listen", f"127.0.0.1:{port}"], cwd=world["root"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until_answers(f"http://127.0.0.1:{port}/v1/accounts", "settle serve did not take the tokens file", token)
    finally:
        p.terminate()
        p.wait(timeout=30)
