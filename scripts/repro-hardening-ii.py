"""Issue 19's reproductions, re-run from outside against a release binary: python3 scripts/repro-hardening-ii.py target/release/settle (prints each answer; needs nothing else running; item 14 is a unit test)."""
import http.client, json, os, socket, subprocess, sys, tempfile, time, urllib.request

BIN = os.path.abspath(sys.argv[1])
out = []

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def serve(args=(), env=None, config=None):
    d = tempfile.mkdtemp()
    port = free_port()
    cmd = [BIN, "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite://{d}/s.db", *args]
    if config:
        open(f"{d}/c.toml", "w").write(config); cmd += ["--config", f"{d}/c.toml"]
    e = dict(os.environ); e.pop("SETTLE_TOKENS", None); e.update(env or {})
    p = subprocess.Popen(cmd, cwd=d, env=e, stdout=subprocess.DEVNULL, stderr=open(f"{d}/err.log", "w"))
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1); break
        except Exception:
            time.sleep(0.05)
    return p, port, d

def req(port, method, path, body=None, headers=None, token=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    h = {"content-type": "application/json"}
    if token: h["authorization"] = f"Bearer {token}"
    h.update(headers or {})
    c.request(method, path, json.dumps(body) if body is not None else None, h)
    r = c.getresponse(); data = r.read(); c.close()
    return r.status, data, dict(r.getheaders())

def note(n, what, answer):
    out.append(f"{n}. {what}: {answer}")
    print(out[-1], flush=True)

def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) // 1024

# --- loopback server: items 1, 2, 3, 4, 6, 9, 11, 13, 15 ---------------------------------------
p, port, d = serve()
req(port, "POST", "/v1/accounts", {"id": "alice"}); req(port, "POST", "/v1/accounts/alice/grants", {"id": "g", "amount": 1000})
st, body, _ = req(port, "POST", "/v1/jobs", {"id": "J", "account_id": "alice", "kind": "render", "items": [{"id": "..", "cost": 10}, {"id": "b", "cost": 10}]})
st2, _, _ = req(port, "POST", "/v1/jobs", {"id": "..", "account_id": "alice", "kind": "render", "cost": 1})
req(port, "POST", "/v1/jobs", {"id": "J2", "account_id": "alice", "kind": "render", "items": [{"id": "a", "cost": 10}, {"id": "b", "cost": 10}]})
tok = json.loads(req(port, "POST", "/v1/claims", {"worker": "w"})[1])["jobs"][0]["lease_token"]
st3, _, _ = req(port, "POST", "/v1/jobs/J2/items/../succeed", {"lease_token": tok})
st4, _, _ = req(port, "POST", "/v1/jobs/J2/items/%2e%2e/succeed", {"lease_token": tok})
state = json.loads(req(port, "GET", "/v1/jobs/J2")[1])["state"]
note(1, "ids `.`/`..`", f"job with item `..` {st}, job `..` {st2}; raw POST items/../succeed {st3}, items/%2e%2e/succeed {st4}; J2 still {state}")
codes = [req(port, m, pth, b, {"host": f"attacker.example:{port}"})[0] for m, pth, b in [
    ("POST", "/v1/accounts", {"id": "mallory"}), ("POST", "/v1/accounts/alice/grants", {"id": "g2", "amount": 1000000}),
    ("POST", "/v1/withdrawals", {"id": "w", "account_id": "alice", "amount": 1, "destination": "attacker-wallet"})]]
form = req(port, "POST", "/v1/jobs/J2/cancel", None, {"origin": "http://attacker.example", "content-type": "application/x-www-form-urlencoded"})[0]
note(2, "loopback mode, Host attacker.example", f"create account / grant / withdrawal {codes}; a cross-site form POST to 127.0.0.1 {form}")
c3 = [req(port, "GET", "/console", None, {"host": f"{h}:{port}"})[0] for h in ["127.attacker.example", "127.0.0.1.nip.io"]]
note(3, "console Host 127.attacker.example, 127.0.0.1.nip.io", f"{c3}")
st, body, _ = req(port, "POST", "/v1/accounts", {"id": "od", "overdraft_limit": 500})
st, body, _ = req(port, "POST", "/v1/withdrawals", {"id": "w-od", "account_id": "od", "amount": 500, "destination": "x"})
note(6, "withdraw 500 on balance 0 with overdraft 500", f"{st} {json.loads(body)['error']['code']}")
req(port, "POST", "/v1/accounts", {"id": "fat"})
payload = {"blob": "p" * (256 * 1024 - 64)}
items = [{"id": f"item-{i:04}", "cost": 0} for i in range(1000)]
for n in range(150):
    s, b, _ = req(port, "POST", "/v1/jobs", {"id": f"fat-{n:03}", "account_id": "fat", "kind": "fat", "items": items, "payload": payload})
    assert s == 201, b
before = rss(p.pid)
st, body, _ = req(port, "GET", "/v1/jobs?limit=1000")
page = json.loads(body)
import threading
peak = [before]
def watch():
    while not done[0]:
        peak[0] = max(peak[0], rss(p.pid)); time.sleep(0.01)
done = [False]; t = threading.Thread(target=watch); t.start()
ths = [threading.Thread(target=lambda: req(port, "GET", "/v1/jobs?limit=1000&account_id=fat")) for _ in range(5)]
[x.start() for x in ths]; [x.join() for x in ths]
done[0] = True; t.join()
note(4, "150 jobs x 1,000 items x 256 KiB, GET /v1/jobs?limit=1000", f"{len(body)/1e6:.2f} MB, {len(page['jobs'])} jobs, next_after {page['next_after']}; RSS {before} MB before, {peak[0]} MB peak under 5 at once")
req(port, "POST", "/v1/jobs", {"id": "S", "account_id": "alice", "kind": "stale", "cost": 1})
t1 = json.loads(req(port, "POST", "/v1/claims", {"worker": "w", "kinds": ["stale"]})[1])["jobs"][0]["lease_token"]
req(port, "POST", "/v1/jobs/S/fail", {"lease_token": t1, "code": "TIMEOUT"})
for _ in range(5000):
    req(port, "POST", "/v1/jobs/S/fail", {"lease_token": t1, "code": "TIMEOUT"})
st, html, _ = req(port, "GET", "/console/jobs/S")
note(9, "5,000 stale fails, console job page", f"{st}, {len(html)/1e3:.1f} KB")
t0 = time.time()
for _ in range(200):
    req(port, "GET", "/metrics")
el = (time.time() - t0) / 200 * 1000
m = req(port, "GET", "/metrics")[1].decode()
reads = [l for l in m.splitlines() if l.startswith("settle_metrics_store_reads_total")]
note(11, "/metrics x200 at 150 k entries", f"{el:.1f} ms a scrape on average; store aggregates read {reads[0].split()[-1] if reads else '?'} times")
p.terminate(); p.wait()

# --- tokens: items 7, 8, 13, 12, 10, 15 ------------------------------------------------------------
cfg = "[http]\nrequests_per_second_per_token = 1.0\nburst_per_token = 10.0\nmax_connections = 20\nmax_connections_per_peer = 5\nheader_read_timeout_ms = 30000\n"
ADMIN = "admin-token-0123456789abcdef"
p, port, d = serve(env={"SETTLE_TOKENS": f"admin:ops={ADMIN}"}, config=cfg)
codes = [req(port, "GET", "/v1/jobs", token=f"wrong-{i:020}")[0] for i in range(30)]
st = req(port, "POST", "/console/login", None, {"content-type": "application/x-www-form-urlencoded"})
c = http.client.HTTPConnection("127.0.0.1", port); c.request("POST", "/console/login", f"token={ADMIN}", {"content-type": "application/x-www-form-urlencoded"}); r = c.getresponse(); r.read()
cookie = r.getheader("set-cookie").split(";")[0]
lp = req(port, "GET", "/console/login")[0]
note(7, "30 bad-token requests, then the operator signs in", f"{codes.count(429)} of 30 answered 429; sign-in page {lp}, sign-in {r.status}")
held = []
for _ in range(20):
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n"); held.append(s)
s2 = socket.socket(); s2.bind(("127.0.0.2", 0)); s2.connect(("127.0.0.1", port))
s2.sendall(f"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN}\r\nConnection: close\r\n\r\n".encode())
s2.settimeout(10); ans = s2.recv(64).decode(errors="replace").split("\r\n")[0]
note(8, "20 half-sent heads from one peer, max_connections 20 (per peer 5)", f"the admin from another address: {ans}")
[s.close() for s in held]; time.sleep(1.5)
c = http.client.HTTPConnection("127.0.0.1", port); c.request("GET", "/console", headers={"cookie": cookie}); r = c.getresponse(); html = r.read().decode()
csrf = html.split('name="csrf" value="')[1].split('"')[0]
c = http.client.HTTPConnection("127.0.0.1", port); c.request("POST", "/console/audit", f"csrf={csrf}", {"cookie": cookie, "origin": f"https://127.0.0.1:{port}", "content-type": "application/x-www-form-urlencoded"}); o = c.getresponse().status
note(13, "console: Origin https://127.0.0.1:PORT on http, X-Frame-Options", f"POST {o}; X-Frame-Options {r.getheader('x-frame-options')}")
p.terminate(); p.wait()
d = tempfile.mkdtemp(); open(f"{d}/tokens", "w").write("# all removed\n"); os.chmod(f"{d}/tokens", 0o600)
r = subprocess.run([BIN, "serve", "--listen", "0.0.0.0:0", "--db", f"sqlite://{d}/x.db", "--tokens", f"{d}/tokens"], cwd=d, capture_output=True, text=True, timeout=30)
note(12, "a --tokens file with no token", f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1]}")
r = subprocess.run([BIN, "serve", "--listen", "127.0.0.1:0", "--db", "postgres://settle:s3cret-pw@127.0.0.1:1/settle?connect_timeout=1"], cwd=d, capture_output=True, text=True, timeout=60)
note(10, "the database password", f"exit {r.returncode}, 's3cret-pw' in output: {'s3cret-pw' in r.stdout + r.stderr}; {r.stderr.strip().splitlines()[-1][:140]}")
cfg = '[[webhooks]]\nid = "meta"\nurl = "http://169.254.169.254/latest/meta-data/"\nsecret = "0123456789abcdef0123"\n'
open(f"{d}/w.toml", "w").write(cfg)
r = subprocess.run([BIN, "serve", "--listen", "127.0.0.1:0", "--db", f"sqlite://{d}/y.db", "--config", f"{d}/w.toml"], cwd=d, capture_output=True, text=True, timeout=30)
note(15, "a webhook at 169.254.169.254", f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1][:160]}")
# item 5: a webhook whose URL carries credentials, to a closed port
cfg = f'[[webhooks]]\nid = "ops"\nurl = "http://hook:hook-secret-42@127.0.0.1:{free_port()}/hook"\nsecret = "0123456789abcdef0123"\nstart_from = "beginning"\n'
p, port, d2 = serve(config=cfg)
req(port, "POST", "/v1/accounts", {"id": "a"})
last = None
for _ in range(100):
    rows = json.loads(req(port, "GET", "/v1/webhooks/deliveries?endpoint=ops")[1])["deliveries"]
    if rows and rows[0].get("last_error"): last = rows[0]["last_error"]; break
    time.sleep(0.1)
note(5, "webhook URL with credentials, send failed", f"last_error {last!r}; 'hook-secret-42' in it: {'hook-secret-42' in (last or '')}")
p.terminate(); p.wait()
print("\nin the issue's order:")
print("\n".join(sorted(out, key=lambda l: int(l.split(".")[0]))))
