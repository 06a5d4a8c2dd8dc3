#!/usr/bin/env python3
"""A Settle worker in Python, on the `settle-client` package (`pip install ./clients/python`).

It renders the frames of `render` jobs one item at a time: the package claims with a long-poll,
heartbeats on a thread within the lease, stops at the item boundary when a cancel arrives and
reports the outcome. A job's payload can ask it to misbehave, as the Rust example worker's can:

    {"sleep_ms": 20, "fail": "NODE_DOWN", "fail_attempts": 1, "fail_item": "frame-2", "unknown": true}

Usage: worker.py URL NAME [--token TOKEN] [--exit-when-idle]
"""

from __future__ import annotations

import sys
import threading
import time

from settle_client import Cancelled, Client, Failed, Flow, JobContext, Succeeded, Unknown, Worker


def render(job: JobContext):
    p = job.payload or {}
    sleep = p.get("sleep_ms", 10) / 1000.0
    if p.get("fail") and job.attempt <= p.get("fail_attempts", sys.maxsize):
        time.sleep(sleep)
        return Failed(p["fail"], "asked to fail", retry_after_ms=50)
    if p.get("unknown") and job.attempt == 1:
        return Unknown("the render farm did not answer")
    done = 0
    for item in job.items_to_do():
        if job.stopping:  # a cancel, or this worker is stopping (SIGTERM): the job is released
            return Cancelled()
        time.sleep(sleep)
        if p.get("fail_item") == item["id"]:
            flow = job.item_failed(item["id"], "BAD_FRAME", "the frame could not be rendered")
        else:
            flow = job.item_done(item["id"])
            done += 1
        if flow is Flow.STOP:
            return Cancelled()
    return Succeeded({"frames": done, "worker": "python"})


def idle(client: Client) -> bool:
    """No job is queued, running or cancelling."""
    return not any(next(client.jobs(state=state, limit=1), None) for state in ("queued", "running", "cancelling"))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    url, name = argv[0], argv[1]
    token = argv[argv.index("--token") + 1] if "--token" in argv else None
    client = Client(url, token)
    worker = Worker(client, kind="render", handler=render, name=name, wait_seconds=1)
    if "--exit-when-idle" not in argv:
        worker.run(handle_signals=True)
        return 0
    ran: list[int] = []
    runner = threading.Thread(target=lambda: ran.append(worker.run()), name="worker")
    runner.start()
    quiet = 0
    while quiet < 3:
        time.sleep(0.3)
        quiet = quiet + 1 if idle(client) else 0
    worker.stop()
    runner.join()
    print(f"{name}: done, {ran[0]} jobs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
