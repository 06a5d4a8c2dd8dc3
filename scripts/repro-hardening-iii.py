"""Issue 41's reproductions, re-run from outside against a release binary:
python3 scripts/repro-hardening-iii.py target/release/settle
Prints each reproduction with the answer it gets now; needs nothing else running. The simulator's
broken guards (part 4) need a test build: `cargo nextest run -p settle-dst -E 'test(/broken_guards/)'`.
"""
import datetime, http.client, json, os, signal, socket, subprocess, sys, tempfile, time, urllib.request

BIN = os.path.abspath(sys.argv[1])


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start(args, cwd, env=None):
    port = free_port()
    e = dict(os.environ); e.pop("SETTLE_TOKENS", None); e.update(env or {})
    p = subprocess.Popen([BIN, *args, "--listen", f"127.0.0.1:{port}"], cwd=cwd, env=e,
                         stdout=subprocess.DEVNULL, stderr=open(f"{cwd}/err-{port}.log", "w"))
    for _ in range(400):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1); break
        except Exception:
            time.sleep(0.05)
    return p, port


def req(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=40)
    h = {"content-type": "application/json"}; h.update(headers or {})
    c.request(method, path, json.dumps(body) if body is not None else None, h)
    r = c.getresponse(); data = r.read(); c.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = data.decode(errors="replace")
    return r.status, parsed, data


def note(part, what, answer):
    print(f"[{part}] {what}: {answer}", flush=True)


d = tempfile.mkdtemp()
p, port = start(["serve", "--db", f"sqlite://{d}/s.db"], d)
R = lambda *a, **k: req(port, *a, **k)

# --- 1. the cash rule -------------------------------------------------------------------------
later = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).isoformat()
R("POST", "/v1/accounts", {"id": "acme", "overdraft_limit": 50})
R("POST", "/v1/accounts/acme/grants", {"id": "cash", "amount": 100})
R("POST", "/v1/accounts/acme/grants", {"id": "trial", "amount": 50, "expires_at": later, "priority": 90})
for j, c in [("j100", 100), ("j50", 50), ("j50b", 50)]:
    R("POST", "/v1/jobs", {"id": j, "account_id": "acme", "kind": "render", "cost": c})
claimed = R("POST", "/v1/claims", {"worker": "w", "limit": 3})[1]["jobs"]
tokens = {j["id"]: j["lease_token"] for j in claimed}
R("POST", "/v1/jobs/j50b/succeed", {"lease_token": tokens["j50b"]})
for j in ["j100", "j50"]:
    R("POST", f"/v1/jobs/{j}/cancel"); R("POST", f"/v1/jobs/{j}/fail", {"lease_token": tokens[j], "code": "CANCELLED"})
bal = R("GET", "/v1/accounts/acme")[1]["balance"]
st, body, _ = R("POST", "/v1/withdrawals", {"id": "w100", "account_id": "acme", "amount": 100, "destination": "DE89"})
st50, _, _ = R("POST", "/v1/withdrawals", {"id": "w50", "account_id": "acme", "amount": 50, "destination": "DE89"})
audit = R("GET", "/v1/audit")[1]
note(1, "cash 100, trial 50, debt 50 (balance %d): withdraw 100" % bal,
     f"{st} {body.get('error', {}).get('code') if isinstance(body, dict) else body}; withdraw 50: {st50}; audit ok={audit['ok']}")

# --- 2. release -----------------------------------------------------------------------------
R("POST", "/v1/jobs", {"id": "frames", "account_id": "acme", "kind": "gpu",
                        "items": [{"id": f"f{i}", "cost": 1} for i in range(4)], "max_attempts": 1})
t = R("POST", "/v1/claims", {"worker": "preempted", "kinds": ["gpu"]})[1]["jobs"][0]["lease_token"]
R("POST", "/v1/jobs/frames/items/f0/succeed", {"lease_token": t})
st, job, _ = R("POST", "/v1/jobs/frames/release", {"lease_token": t})
again = R("POST", "/v1/jobs/frames/release", {"lease_token": t})
stale = R("POST", "/v1/jobs/frames/release", {"lease_token": "not-a-token"})[0]
att = R("GET", "/v1/jobs/frames/attempts")[1]["attempts"]
note(2, "release after one of four frames", f"{st} {job['state']} (attempt results {[a['result'] for a in att]}); "
     f"re-sent {again[0]}; a token never issued {stale}")
# The Python worker on SIGTERM, two seconds into a four-frame job (1 s a frame).
worker = f"""
import sys, time; sys.path.insert(0, {os.path.abspath('clients/python/src')!r})
from settle_client import Client, Worker, Flow, Cancelled, Succeeded
def h(job):
    for item in job.items_to_do():
        time.sleep(1.0)
        if job.item_done(item["id"]) is Flow.STOP: return Cancelled()
    return Succeeded()
Worker(Client('http://127.0.0.1:{port}'), kind='py', handler=h, wait_seconds=1).run(handle_signals=True)
"""
R("POST", "/v1/jobs", {"id": "py4", "account_id": "acme", "kind": "py", "items": [{"id": f"f{i}", "cost": 1} for i in range(4)]})
# The package's own venv (scripts/test-python makes it), else this interpreter.
py = "target/python-venv/bin/python" if os.path.exists("target/python-venv/bin/python") else sys.executable
w = subprocess.Popen([py, "-c", worker], stderr=subprocess.DEVNULL)
time.sleep(2.2); t0 = time.time(); w.send_signal(signal.SIGTERM); rc = w.wait(timeout=30)
j = R("GET", "/v1/jobs/py4")[1]
note(2, "Python worker SIGTERM 2 s into four 1-s frames",
     f"exit {rc} after {time.time() - t0:.1f} s; job {j['state']}, items {[i['state'] for i in j['items']]}")

# --- 3. paper cuts ----------------------------------------------------------------------------
pipe = subprocess.run(f"{BIN} ledger acme --db sqlite://{d}/s.db | head -1 >/dev/null; echo ${{PIPESTATUS[0]}}",
                      shell=True, executable="/bin/bash", capture_output=True, text=True)
note(3, "settle ledger acme | head -1", f"exit {pipe.stdout.strip()}, stderr {pipe.stderr.strip()!r}")
e = tempfile.mkdtemp()
r = subprocess.run([BIN, "serve", "--listen", "0.0.0.0:0"], cwd=e, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "SETTLE_TOKENS"})
note(3, "serve --listen 0.0.0.0 without tokens", f"exit {r.returncode}, files left {os.listdir(e)}")
r = subprocess.run([BIN, "serve", "--listen", f"127.0.0.1:{port}"], cwd=e, capture_output=True, text=True)
note(3, "serve on a taken port", f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1]!r}")
r = subprocess.run([BIN, "config"], cwd=e, capture_output=True, text=True, env={**os.environ, "SETTLE_KIND_RENDER_LEASE_SECONDS": "120"})
note(3, "SETTLE_KIND_RENDER_LEASE_SECONDS=120, no [kinds.render]", f"exit {r.returncode}: {r.stderr.strip()[:110]!r}")
st, body, raw = R("GET", "/v1/accounts")
ended = raw.endswith(b"\n")
note(3, "GET /v1/accounts", f"{st} {[a['id'] for a in body['accounts']]}; body ends with a newline: {ended}")
R("POST", "/v1/jobs", {"id": "held", "account_id": "acme", "kind": "x", "hold": 10})
ev = [x for x in R("GET", "/v1/events?limit=1000")[1]["events"] if x["job_id"] == "held"][0]["data"]
note(3, "a held job's job.queued", ev)

# --- 5. webhook lines, the event cursor, artifacts, console sign-out --------------------------
R("POST", "/v1/accounts", {"id": "mallory"}); R("POST", "/v1/accounts/mallory/grants", {"id": "gm", "amount": 10})
st, _, _ = R("POST", "/v1/jobs", {"id": "account:acme", "account_id": "mallory", "kind": "x", "cost": 1})
note(5, "a job named account:acme", f"{st} (its webhook line is `job account:acme`, acme's is `account acme`: they never meet)")
R("POST", "/v1/jobs", {"id": "art", "account_id": "acme", "kind": "art", "cost": 1})
t = R("POST", "/v1/claims", {"worker": "w", "kinds": ["art"]})[1]["jobs"][0]["lease_token"]
R("POST", "/v1/jobs/art/cancel")
st, body, _ = R("POST", "/v1/jobs/art/items/main/artifacts", {"lease_token": t, "key": "late.png"})
note(5, "artifact registered after a cancel request", f"{st} {body['error']['code']}")
# A key used as a directory (`frames/0001.png` under the key `frames`): the teardown deletes it
# whole and the cancel answers 200; a cleanup that cannot succeed has an operator's way out.
R("POST", "/v1/jobs", {"id": "dirkey", "account_id": "acme", "kind": "dk", "cost": 1})
t = R("POST", "/v1/claims", {"worker": "w", "kinds": ["dk"]})[1]["jobs"][0]["lease_token"]
path = R("POST", "/v1/jobs/dirkey/items/main/artifacts", {"lease_token": t, "key": "frames"})[1]["path"]
frames = os.path.join(d, "settle-artifacts", path)
os.makedirs(os.path.join(frames, "sub"))
for f in ["0001.png", "sub/0002.png"]:
    open(os.path.join(frames, f), "wb").write(b"x")
R("POST", "/v1/jobs/dirkey/cancel")
st, job, _ = R("POST", "/v1/jobs/dirkey/fail", {"lease_token": t, "code": "CANCELLED"})
note(5, "teardown of a key used as a directory", f"{st} {job['state']}; the folder is gone: {not os.path.exists(frames)}")
R("POST", "/v1/jobs", {"id": "stuck", "account_id": "acme", "kind": "dk", "cost": 1})
t = R("POST", "/v1/claims", {"worker": "w", "kinds": ["dk"]})[1]["jobs"][0]["lease_token"]
path = R("POST", "/v1/jobs/stuck/items/main/artifacts", {"lease_token": t, "key": "out"})[1]["path"]
locked = os.path.join(d, "settle-artifacts", os.path.dirname(path))
os.makedirs(locked); open(os.path.join(d, "settle-artifacts", path), "wb").write(b"x")
os.chmod(locked, 0o555)  # the file cannot be deleted (as root, chattr would be needed: see below)
import shutil, subprocess
immutable = shutil.which("chattr") and subprocess.run(["chattr", "+i", os.path.join(d, "settle-artifacts", path)]).returncode == 0
R("POST", "/v1/jobs/stuck/cancel")
st, job, _ = R("POST", "/v1/jobs/stuck/fail", {"lease_token": t, "code": "CANCELLED"})
st2, again, _ = R("POST", "/v1/jobs/stuck/cancel")
st3, done, _ = R("POST", "/v1/jobs/stuck/abandon-cleanup", {"reason": "the file is immutable"})
left = [e["data"].get("artifacts_left") for e in R("GET", "/v1/events?limit=1000")[1]["events"]
        if e["job_id"] == "stuck" and e["type"] == "job.cancelled"]
note(5, "a cleanup that cannot succeed (immutable file: %s)" % bool(immutable),
     f"{st} {job['state']}; cancel again {st2} {again['state']}; abandon-cleanup {st3} {done['state']}, artifacts_left {left}")
if immutable:
    subprocess.run(["chattr", "-i", os.path.join(d, "settle-artifacts", path)])
os.chmod(locked, 0o755)
p.terminate(); p.wait()
print("done")
