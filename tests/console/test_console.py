"""The operator console end to end in a real headless Chromium (issue 12): sign in, find a dead job
from the overview, read what happened to it and to its credits, requeue it; bulk-requeue by filter;
read-only client tokens; CSRF; the API reference; a phone-sized screen. Screenshots of the pages go
to $SETTLE_SCREENSHOTS (default target/console-screenshots; docs/console holds the committed ones)."""

import os
import re
from pathlib import Path

from conftest import ADMIN, CLIENT, ROOT
from playwright.sync_api import expect

SHOTS = Path(os.environ.get("SETTLE_SCREENSHOTS", ROOT / "target" / "console-screenshots"))


def shot(page, name, full_page=True):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full_page)


def sign_in(context, base, token):
    page = context.new_page()
    page.on("dialog", lambda d: d.accept())
    page.goto(base + "/console")
    expect(page).to_have_url(re.compile(r"/console/login$"))
    page.fill("#token", token)
    page.click("button[type=submit]")
    return page


def csrf_of(page):
    return page.locator("input[name=csrf]").first.get_attribute("value")


def test_a_wrong_token_cannot_sign_in(context, server):
    base, _ = server
    page = sign_in(context, base, "not-a-token-of-this-server")
    expect(page.get_by_role("alert")).to_contain_text("not valid")
    expect(page).to_have_url(re.compile(r"/console/login$"))
    page.goto(base + "/console/jobs")
    expect(page).to_have_url(re.compile(r"/console/login$"))


def test_an_admin_finds_a_dead_job_reads_where_its_credits_went_and_requeues_it(context, server):
    base, api = server
    api.account("acme", 1_000)
    api.dead_job("render-0042", "acme")
    page = sign_in(context, base, ADMIN)
    expect(page.locator("h1")).to_have_text("Overview")
    expect(page.locator(".who")).to_contain_text("ops-ana · admin")
    shot(page, "overview")
    # From the overview's dead letters to the job.
    page.click("a.tile[href='/console/jobs?state=dead']")
    expect(page.locator("h1")).to_have_text("Jobs")
    page.click("a[href='/console/jobs/render-0042']")
    expect(page.locator("h1")).to_contain_text("render-0042")
    expect(page.locator("h1 .badge")).to_have_text("dead")
    # The timeline: charged, claimed by the worker, failed TIMEOUT, refunded.
    timeline = page.locator("ol.timeline")
    expect(timeline).to_contain_text("30 credits charged")
    expect(timeline).to_contain_text("claimed by gpu-7")
    expect(timeline).to_contain_text("ended: failed TIMEOUT — no answer in 30 s")
    expect(timeline).to_contain_text("refund +20 (item frame-2)")
    # Its ledger entries: two charges and two refunds, each linked to the account's ledger.
    entries = page.locator("section:has(h2:text('Ledger entries')) tbody tr")
    expect(entries).to_have_count(4)
    expect(entries.nth(0)).to_contain_text("charge")
    expect(entries.nth(3)).to_contain_text("refund")
    expect(page.locator("section:has(h2:text('Events'))")).to_contain_text("job.dead")
    shot(page, "job")
    # Requeue it, and see it queued with the action on the job.
    page.click("button:text('Requeue')")
    expect(page.locator("h1 .badge")).to_have_text("queued")
    expect(page.locator("ol.timeline")).to_contain_text("operator ops-ana: job.requeue")
    # A requeue gives a fresh budget: the attempts count against it, not "2 of 1".
    expect(page.locator("section.facts dd").filter(has_text="counted")).to_have_text(
        "0 of 1 counted (1 in all; releases and requeues are not counted)"
    )
    assert api.job("render-0042")["state"] == "queued"
    # The account: why its balance is what it is.
    page.click("dd a[href='/console/accounts/acme']")
    expect(page.locator("h1")).to_contain_text("acme")
    page.click("a:text('check it')")
    expect(page.locator("strong.ok")).to_have_text("intact")
    expect(page.locator("tr#e1")).to_contain_text("grant")
    shot(page, "account")


def test_bulk_requeue_takes_every_job_the_filter_matches(context, server):
    base, api = server
    api.account("bulkco", 1_000)
    for i in range(3):
        api.dead_job(f"bulk-{i}", "bulkco", kind="transcribe")
    api.account("bystander", 1_000)
    api.dead_job("bystander-0", "bystander", kind="transcribe")
    page = sign_in(context, base, ADMIN)
    page.goto(base + "/console/jobs?state=dead&kind=transcribe&account=bulkco")
    expect(page.locator("p.muted").first).to_contain_text("3 jobs match")
    page.click("a.button:text('Requeue all 3 matching')")
    # The confirmation says how many jobs and credits it will touch.
    expect(page.locator("section.card")).to_contain_text("3 jobs")
    expect(page.locator("section.card")).to_contain_text("90 credits")
    page.click("button:text('Requeue 3 jobs')")
    expect(page.locator("section.card")).to_contain_text("3 jobs requeued")
    for i in range(3):
        assert api.job(f"bulk-{i}")["state"] == "queued"
    assert api.job("bystander-0")["state"] == "dead", "outside the filter"


def test_a_client_token_sees_but_cannot_act(context, server):
    base, api = server
    api.account("viewco", 1_000)
    api.dead_job("view-1", "viewco", kind="preview")
    page = sign_in(context, base, CLIENT)
    expect(page.locator(".who")).to_contain_text("support-sam · client")
    page.goto(base + "/console/jobs/view-1")
    expect(page.locator("h1")).to_contain_text("view-1")
    expect(page.locator("button:text('Requeue')")).to_have_count(0)
    expect(page.locator("button:text('Cancel')")).to_have_count(0)
    page.goto(base + "/console/jobs?state=dead")
    expect(page.locator("a:text('Requeue all')")).to_have_count(0)
    # A forged POST, with this session's own CSRF token, is refused.
    forged = page.request.post(base + "/console/jobs/view-1/requeue", form={"csrf": csrf_of(page)}, max_redirects=0)
    assert forged.status == 403
    assert api.job("view-1")["state"] == "dead"


def test_a_post_without_the_csrf_token_is_refused(context, server):
    base, api = server
    api.account("csrfco", 1_000)
    api.dead_job("csrf-1", "csrfco", kind="thumbnail")
    page = sign_in(context, base, ADMIN)
    for form in ({}, {"csrf": ""}, {"csrf": "0" * 32}):
        r = page.request.post(base + "/console/jobs/csrf-1/requeue", form=form, max_redirects=0)
        assert r.status == 403, form
    assert api.job("csrf-1")["state"] == "dead"


def test_the_api_reference_renders(context, server):
    base, _ = server
    page = context.new_page()
    page.goto(base + "/docs")
    # Redoc renders the operations' summaries from /openapi.json.
    expect(page.get_by_role("heading", name="Create a job and charge it")).to_be_visible(timeout=30_000)
    expect(page.get_by_role("heading", name="Requeue a dead job")).to_be_attached()
    shot(page, "docs", full_page=False)


def test_the_pages_fit_a_phone(browser, server):
    base, api = server
    api.account("phoneco", 1_000)
    api.dead_job("phone-1", "phoneco", kind="upscale")
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    try:
        page = sign_in(ctx, base, ADMIN)
        for path, name in (
            ("/console", "overview-phone"),
            ("/console/jobs/phone-1", "job-phone"),
            ("/console/accounts/phoneco", "account-phone"),
        ):
            page.goto(base + path)
            # Nothing wider than the screen: tables scroll inside their own box.
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{path} is {width}px wide on a 390-px screen"
            if name == "account-phone":
                # The ledger's amount and balance show without scrolling its box sideways.
                for header in ("amount", "balance after"):
                    box = page.get_by_role("columnheader", name=header, exact=True).last.bounding_box()
                    assert box and box["x"] + box["width"] <= 390, f"{header}: {box}"
                # Issue 41: the grants table showed less than what a grant can still pay; what is
                # left and its state show without scrolling its box sideways.
                for header in ("left", "state"):
                    box = page.get_by_role("columnheader", name=header, exact=True).first.bounding_box()
                    assert box and box["x"] + box["width"] <= 390, f"grants {header}: {box}"
            shot(page, name)
    finally:
        ctx.close()


def test_withdrawals_and_pending_work_add_up(payout_context, payout_server):
    """Issue 20's console fixes: dead withdrawals are not dead letters and have no requeue; a
    withdrawal's page shows where the money went and under which key; a payout the reconciler
    settled is not listed as a signal that changed nothing; the account counts as undecided only the
    work not decided yet; the failures link lands on the state whose bulk action fits."""
    base, api = payout_server
    api.account("payco", 1_000)
    paid = api.settled_withdrawal("w-paid", "payco", 100, "DE89370400440532013000")
    refused = api.settled_withdrawal("w-refused", "payco", 50, "invalid-account")
    assert (paid["state"], refused["state"]) == ("succeeded", "dead")
    api.dead_job("render-dead", "payco")  # 30 credits, refunded
    assert api.call("POST", "/v1/jobs", {"id": "render-next", "account_id": "payco", "kind": "render", "cost": 30})[0] == 201

    page = sign_in(payout_context, base, ADMIN)
    tiles = page.locator("section.tiles")
    # One dead letter (the render); the refused withdrawal has a tile of its own.
    expect(tiles.locator("a.tile[href='/console/jobs?state=dead']")).to_contain_text("1dead letters")
    dead_withdrawals = tiles.locator("a.tile[href='/console/jobs?state=dead&kind=withdrawal']")
    expect(dead_withdrawals).to_contain_text("1dead withdrawals (refunded)")
    # Failures by code: each link carries the state, so the jobs page offers the action that fits.
    failures = page.locator("section:has(h2:text('Failures by code'))")
    expect(failures.locator("a[href='/console/jobs?fail_code=TIMEOUT&state=dead']")).to_have_count(1)
    failures.locator("a[href='/console/jobs?fail_code=INVALID_ADDRESS&state=dead']").click()
    expect(page.locator("p.muted").first).to_contain_text("1 jobs match")
    expect(page.locator("a.button:text('Requeue all')")).to_have_count(0)
    expect(page.locator("div.bulk")).to_contain_text("never requeued")
    page.goto(base + "/console/jobs?fail_code=TIMEOUT&state=dead")
    expect(page.locator("a.button:text('Requeue all 1 matching')")).to_have_count(1)

    # Each withdrawal's page: where the money went (or was to go), the provider's txid, the key.
    for w, txid in ((refused, "not known yet"), (paid, paid["provider_txid"])):
        page.goto(f"{base}/console/jobs/{w['id']}")
        expect(page.locator("h1 .badge")).to_have_text(w["state"])
        for fact in (w["destination"], txid, w["idempotency_key"]):
            expect(page.locator("section.facts")).to_contain_text(fact)
        # A dead withdrawal is not requeued (its hold was refunded).
        expect(page.locator("button:text('Requeue')")).to_have_count(0)
    # The paid one was settled by the reconciler (every answer was lost), which is not a worker's signal.
    attempts = page.locator("section:has(h2:text('Attempts')) tbody tr")
    expect(attempts.first).to_contain_text("unknown")
    signals = page.locator("section:has(h2:text('Signals outside the attempts')) tbody")
    expect(signals).to_have_text("None.")

    # The account: 1000 − 100 paid − 30 queued; only the queued render is undecided.
    page.goto(base + "/console/accounts/payco")
    expect(page.locator("section.tiles")).to_contain_text("870")
    pending = page.locator("div.tile:has-text('charged to work not decided yet')")
    expect(pending.locator("span.n")).to_have_text("30")
    shot(page, "account-withdrawals")
