#!/usr/bin/env python3
"""A Settle worker in plain Python (standard library only), speaking the HTTP API v1.

It claims jobs with a long-poll, reports each item, stops at the next item boundary when a cancel is
requested (acknowledging with fail/CANCELLED), heartbeats between items, and reports the job's
success. The protocol is language-neutral: this is all a worker needs.

Usage: worker.py URL NAME [--token TOKEN] [--exit-when-idle]
"""

import json
import sys
import time
import urllib.error
import urllib.request


class Settle:
    def __init__(self, base, token=None):
        self.base = base.rstrip("/")
        self.token = token

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("content-type", "application/json")
        if self.token:
            req.add_header("authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def post(self, path, body):
        return self.call("POST", path, body)


class LeaseLost(Exception):
    pass


def work(settle, job):
    """Render the job's frames; returns what to report."""
    token = job["lease_token"]
    jid = job["id"]
    sleep = (job.get("payload") or {}).get("sleep_ms", 10) / 1000.0
    done = 0
    for item in job["items"]:
        # Do what is still charged, and what an earlier failed attempt of the job got refunded:
        # the job's success will reclaim it, so the work must be done.
        redo = item["state"] == "refunded" and item.get("refund_reason") == "job_failed"
        if item["state"] != "charged" and not redo:
            continue
        time.sleep(sleep)
        status, body = settle.post(f"/v1/jobs/{jid}/items/{item['id']}/succeed", {"lease_token": token})
        if status == 409:
            raise LeaseLost(jid)
        done += 1
        if body.get("cancel_requested"):
            return ("fail", {"lease_token": token, "code": "CANCELLED", "message": "stopped at an item boundary"})
        status, hb = settle.post(f"/v1/jobs/{jid}/heartbeat", {"lease_token": token})
        if status == 409:
            raise LeaseLost(jid)
        if hb.get("cancel_requested"):
            return ("fail", {"lease_token": token, "code": "CANCELLED", "message": "stopped at an item boundary"})
    return ("succeed", {"lease_token": token, "result": {"frames": done, "worker": "python"}})


def idle(settle):
    for state in ("queued", "running", "cancelling"):
        status, body = settle.call("GET", f"/v1/jobs?state={state}&limit=1")
        if status != 200 or body["jobs"]:
            return False
    return True


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    url, name = argv[0], argv[1]
    token = argv[argv.index("--token") + 1] if "--token" in argv else None
    exit_when_idle = "--exit-when-idle" in argv
    settle = Settle(url, token)
    quiet = 0
    handled = 0
    while True:
        status, body = settle.post("/v1/claims", {"worker": name, "limit": 2, "wait_seconds": 1})
        if status != 200:
            print(f"claim failed: {status} {body}", file=sys.stderr)
            time.sleep(0.5)
            continue
        for job in body["jobs"]:
            try:
                verb, report = work(settle, job)
            except LeaseLost:
                continue
            settle.post(f"/v1/jobs/{job['id']}/{verb}", report)
            handled += 1
        if body["jobs"]:
            quiet = 0
        elif exit_when_idle:
            quiet = quiet + 1 if idle(settle) else 0
            if quiet >= 3:
                print(f"{name}: done, {handled} jobs")
                return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
