//! The operator console over real HTTP, on both engines: sign-in, sessions, CSRF, read-only
//! tokens, the pages, and the actions (one job and the whole filtered set) with their action log.
//! The browser end-to-end test (`tests/console/`) drives the same pages in Chromium.

use crate::kit::*;
use serde_json::json;
use settle_api::{Role, Tokens};
use settle_store::Store;

on_both_engines!(
    signing_in_takes_a_known_admin_or_client_token,
    an_admin_requeues_a_dead_job_and_the_action_is_on_the_job,
    every_post_needs_the_sessions_csrf_token,
    a_client_token_reads_but_cannot_act,
    bulk_requeue_acts_on_every_job_the_filter_matches,
    the_pages_show_where_the_credits_went,
    a_held_item_shows_its_hold_price_and_release,
    a_job_shows_its_priority_and_labels_and_the_list_filters_by_priority,
    an_account_at_its_cap_says_why_its_job_waits,
    the_account_page_shows_its_alerts_and_their_sides,
    the_account_page_shows_its_spend_limits,
    top_ups_show_their_charge_grant_and_rule,
    a_signed_out_or_rotated_session_is_no_session,
    cross_site_posts_and_foreign_hosts_are_refused,
    a_sign_out_holds_in_every_process_and_after_a_restart,
);

const ADMIN: &str = "admin-token-for-console-tests";
const CLIENT: &str = "client-token-for-console-tests";
const WORKER: &str = "worker-token-for-console-tests";

async fn server(e: Engine) -> Server {
    let mut tokens = Tokens::default();
    tokens.add_named(Role::Admin, ADMIN, "ops-ana").unwrap();
    tokens.add_named(Role::Client, CLIENT, "support-sam").unwrap();
    tokens.add_named(Role::Worker, WORKER, "gpu-fleet").unwrap();
    let mut s = Server::with_tokens(e, tokens).await;
    s.token = Some(ADMIN.to_owned());
    s
}

/// A browser's view: cookies kept, redirects not followed (so they can be checked).
fn browser() -> reqwest::Client {
    reqwest::Client::builder().cookie_store(true).redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

/// A client that keeps no cookies (they are set by hand) and follows no redirects.
fn plain() -> reqwest::Client {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

async fn sign_in(s: &Server, token: &str) -> (reqwest::Client, u16) {
    let b = browser();
    let r = b.post(format!("{}/console/login", s.base)).form(&[("token", token)]).send().await.unwrap();
    (b, r.status().as_u16())
}

async fn page(b: &reqwest::Client, s: &Server, path: &str) -> (u16, String) {
    let r = b.get(format!("{}{path}", s.base)).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn csrf_of(html: &str) -> String {
    hidden(html, "csrf")
}

/// The value of the page's first hidden field `name`.
fn hidden(html: &str, name: &str) -> String {
    let marker = format!(r#"name="{name}" value=""#);
    let at = html.find(&marker).unwrap_or_else(|| panic!("the page has no field {name}"));
    html[at + marker.len()..].split('"').next().unwrap().to_owned()
}

async fn post(b: &reqwest::Client, s: &Server, path: &str, form: &[(&str, &str)]) -> (u16, String) {
    let r = b.post(format!("{}{path}", s.base)).form(form).send().await.unwrap();
    let status = r.status().as_u16();
    let location = r.headers().get("location").map(|l| l.to_str().unwrap().to_owned());
    (status, location.unwrap_or(r.text().await.unwrap()))
}

/// A job that ran once and died with TIMEOUT (its items refunded).
async fn dead_job(s: &Server, id: &str, account: &str) {
    let r = s
        .post(
            "/v1/jobs",
            json!({"id": id, "account_id": account, "kind": "render", "items": [{"id": "a", "cost": 10}, {"id": "b", "cost": 20}], "max_attempts": 1}),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let claimed = s.post("/v1/claims", json!({"worker": "gpu-1", "kinds": ["render"]})).await;
    let token = claimed.body["jobs"][0]["lease_token"].as_str().unwrap().to_owned();
    let r = s
        .post(&format!("/v1/jobs/{id}/fail"), json!({"lease_token": token, "code": "TIMEOUT", "retryable": false}))
        .await;
    assert_eq!(r.body["state"], "dead");
}

async fn signing_in_takes_a_known_admin_or_client_token(e: Engine) {
    let s = server(e).await;
    // Without a session every page sends you to sign in.
    let (status, _) = page(&browser(), &s, "/console").await;
    assert_eq!(status, 303);
    for (token, expected) in [("wrong", 401), (WORKER, 401), ("", 401), (ADMIN, 303), (CLIENT, 303)] {
        let (b, status) = sign_in(&s, token).await;
        assert_eq!(status, expected, "sign in with {token:?}");
        let (status, html) = page(&b, &s, "/console").await;
        if expected == 303 {
            assert_eq!(status, 200);
            assert!(html.contains("Overview"));
        } else {
            assert_eq!(status, 303, "no session after a refused sign-in");
        }
    }
    // The cookie is HttpOnly, SameSite=Strict, scoped to the console.
    let r = browser().post(format!("{}/console/login", s.base)).form(&[("token", ADMIN)]).send().await.unwrap();
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict") && cookie.contains("Path=/console"),
        "{cookie}"
    );
    assert!(!cookie.contains(ADMIN), "the token itself is never stored in the cookie");
    // A forged cookie (the role edited) is no session.
    let forged = cookie.split(';').next().unwrap().replacen("|admin|", "|client|", 1);
    let r = plain().get(format!("{}/console", s.base)).header("cookie", forged).send().await.unwrap();
    assert_eq!(r.status(), 303);
    // Signing out ends the session.
    let (b, _) = sign_in(&s, ADMIN).await;
    let (_, html) = page(&b, &s, "/console").await;
    let (status, _) = post(&b, &s, "/console/logout", &[("csrf", &csrf_of(&html))]).await;
    assert_eq!(status, 303);
    assert_eq!(page(&b, &s, "/console").await.0, 303);
}

async fn an_admin_requeues_a_dead_job_and_the_action_is_on_the_job(e: Engine) {
    let s = server(e).await;
    s.account("acme", 100).await;
    dead_job(&s, "j1", "acme").await;
    let (b, _) = sign_in(&s, ADMIN).await;
    let (status, html) = page(&b, &s, "/console/jobs/j1").await;
    assert_eq!(status, 200);
    assert!(html.contains(r#"action="/console/jobs/j1/requeue""#), "a dead job offers a requeue");
    let (status, location) = post(&b, &s, "/console/jobs/j1/requeue", &[("csrf", &csrf_of(&html))]).await;
    assert_eq!((status, location.as_str()), (303, "/console/jobs/j1"));
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "queued");
    let (_, html) = page(&b, &s, "/console/jobs/j1").await;
    assert!(html.contains("operator <strong>ops-ana</strong>: job.requeue"), "the action is shown on the job");
    // Issue 20: attempts count against the fresh budget, not "2 of 1".
    assert!(html.contains("0 of 1 counted (1 in all; releases and requeues are not counted)"), "{html}");
    // Cancel, from the console, is recorded too; the queued job's items are refunded at once.
    let (status, _) = post(&b, &s, "/console/jobs/j1/cancel", &[("csrf", &csrf_of(&html))]).await;
    assert_eq!(status, 303);
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "cancelled");
    assert_eq!(s.balance("acme").await, 100);
    let (_, html) = page(&b, &s, "/console/jobs/j1").await;
    assert!(html.contains("operator <strong>ops-ana</strong>: job.cancel"), "{html}");
    // The audit, run from the console, shows its result and is recorded too.
    let (status, html) = post(&b, &s, "/console/audit", &[("csrf", &csrf_of(&html))]).await;
    assert_eq!(status, 200);
    assert!(html.contains("Clean."), "{html}");
    let actions = s.store_handle().operators().actions(None, None).await.unwrap();
    assert!(actions.iter().any(|a| a.action == settle_store::ActionKind::LedgerAudit
        && a.actor == "ops-ana"
        && a.detail.contains(r#""ok":true"#)));
    // Issue 20: a dead withdrawal offers no requeue (its hold was refunded; a new one is made).
    let r =
        s.post("/v1/withdrawals", json!({"id": "wd1", "account_id": "acme", "amount": 5, "destination": "bad"})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let store = s.store_handle();
    let claimed = store.payouts().claim_payouts(&settle_core::ids::WorkerName::parse("p").unwrap(), 10).await.unwrap();
    let signal = settle_store::FailSignal {
        lease_token: claimed[0].lease_token.clone(),
        code: settle_core::ids::FailCode::parse("INVALID_ADDRESS").unwrap(),
        message: None,
        retryable: Some(false),
        retry_after_ms: None,
    };
    store.payouts().payout_failed(&settle_core::ids::JobId::parse("wd1").unwrap(), signal).await.unwrap();
    assert_eq!(s.get("/v1/withdrawals/wd1").await.body["state"], "dead");
    let (_, html) = page(&b, &s, "/console/jobs/wd1").await;
    assert!(!html.contains(r#"action="/console/jobs/wd1/requeue""#), "{html}");
    // …and is no dead letter on the overview: it has a tile of its own.
    let (_, overview) = page(&b, &s, "/console").await;
    assert!(overview.contains(r#"<span class="n">0</span><span>dead letters"#), "{overview}");
    assert!(overview.contains(r#"<span class="n">1</span><span>dead withdrawals (refunded)"#), "{overview}");
    // Issue 20: a withdrawal's page names its destination, idempotency key and provider txid; a
    // paid withdrawal is not "charged to work not decided yet" on the account page.
    assert!(html.contains("<code>bad</code>") && html.contains("idempotency key"), "{html}");
    let r = s
        .post("/v1/withdrawals", json!({"id": "wd2", "account_id": "acme", "amount": 7, "destination": "iban-1"}))
        .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let claimed = store.payouts().claim_payouts(&settle_core::ids::WorkerName::parse("p").unwrap(), 10).await.unwrap();
    let (_, html) = page(&b, &s, "/console/accounts/acme").await;
    assert!(html.contains(r#"<span class="n">7</span><span>charged to work not decided yet"#), "{html}");
    let wd2 = settle_core::ids::JobId::parse("wd2").unwrap();
    store.payouts().payout_succeeded(&wd2, Some(&claimed[0].lease_token), "tx-42", false).await.unwrap();
    let (_, html) = page(&b, &s, "/console/jobs/wd2").await;
    assert!(html.contains("<code>iban-1</code>") && html.contains("<code>tx-42</code>"), "{html}");
    let (_, html) = page(&b, &s, "/console/accounts/acme").await;
    assert!(html.contains(r#"<span class="n">0</span><span>charged to work not decided yet"#), "{html}");
    // Issue 20: the failures link on the overview keeps the state, so a bulk action fits.
    let (_, html) = page(&b, &s, "/console").await;
    assert!(html.contains("/console/jobs?fail_code=INVALID_ADDRESS&amp;state=dead"), "{html}");
}

async fn every_post_needs_the_sessions_csrf_token(e: Engine) {
    let s = server(e).await;
    s.account("acme", 100).await;
    dead_job(&s, "j1", "acme").await;
    let (b, _) = sign_in(&s, ADMIN).await;
    let (_, html) = page(&b, &s, "/console/jobs/j1").await;
    let good = csrf_of(&html);
    // Another session's token is not this session's.
    let (other, _) = sign_in(&s, ADMIN).await;
    let (_, other_html) = page(&other, &s, "/console").await;
    let theirs = csrf_of(&other_html);
    assert_ne!(good, theirs);
    for form in [
        vec![],
        vec![("csrf", "")],
        vec![("csrf", theirs.as_str())],
        vec![("csrf", "0123456789abcdef0123456789abcdef")],
    ] {
        let (status, _) = post(&b, &s, "/console/jobs/j1/requeue", &form).await;
        assert_eq!(status, 403, "{form:?}");
    }
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "dead", "nothing was done");
    assert!(
        s.store_handle()
            .operators()
            .actions(None, None)
            .await
            .unwrap()
            .iter()
            .all(|a| a.action != settle_store::ActionKind::JobRequeue)
    );
    let (status, _) = post(&b, &s, "/console/jobs/j1/requeue", &[("csrf", &good)]).await;
    assert_eq!(status, 303);
}

async fn a_client_token_reads_but_cannot_act(e: Engine) {
    let s = server(e).await;
    s.account("acme", 100).await;
    dead_job(&s, "j1", "acme").await;
    let (b, status) = sign_in(&s, CLIENT).await;
    assert_eq!(status, 303);
    for path in ["/console", "/console/jobs?state=dead", "/console/jobs/j1", "/console/accounts/acme"] {
        let (status, html) = page(&b, &s, path).await;
        assert_eq!(status, 200, "{path}");
        assert!(
            !html.contains("/requeue\"") && !html.contains("/cancel\"") && !html.contains("/console/bulk"),
            "{path} offers no action"
        );
        assert!(!html.contains("/console/audit"), "{path}");
    }
    // A forged POST with the client's own valid CSRF token is still refused.
    let (_, html) = page(&b, &s, "/console").await;
    let csrf = csrf_of(&html);
    for path in ["/console/jobs/j1/requeue", "/console/jobs/j1/cancel", "/console/audit"] {
        assert_eq!(post(&b, &s, path, &[("csrf", &csrf)]).await.0, 403, "{path}");
    }
    let bulk =
        [("csrf", csrf.as_str()), ("action", "requeue"), ("filter", "state=dead"), ("expected", "1"), ("until", "999")];
    assert_eq!(post(&b, &s, "/console/bulk", &bulk).await.0, 403);
    assert_eq!(page(&b, &s, "/console/bulk?action=requeue&state=dead").await.0, 403);
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "dead");
}

async fn bulk_requeue_acts_on_every_job_the_filter_matches(e: Engine) {
    let s = server(e).await;
    s.account("acme", 1_000).await;
    s.account("other", 1_000).await;
    // More dead jobs than one page of the list shows.
    for i in 0..3 {
        dead_job(&s, &format!("acme-{i}"), "acme").await;
    }
    dead_job(&s, "other-0", "other").await;
    let (b, _) = sign_in(&s, ADMIN).await;
    // The confirmation says how many jobs and credits.
    let (status, html) = page(&b, &s, "/console/bulk?action=requeue&state=dead&account=acme").await;
    assert_eq!(status, 200);
    assert!(html.contains("<strong>3 jobs</strong>") && html.contains("<strong>90 credits</strong>"), "{html}");
    let (csrf, expected, until) = (csrf_of(&html), hidden(&html, "expected"), hidden(&html, "until"));
    assert_eq!(expected, "3");
    // Requeue needs dead jobs: a filter without the state is refused.
    let refused = [
        ("csrf", csrf.as_str()),
        ("action", "requeue"),
        ("filter", "account=acme"),
        ("expected", "3"),
        ("until", &until),
    ];
    assert_eq!(post(&b, &s, "/console/bulk", &refused).await.0, 400);
    // A form with a field missing is answered with a console page, not plain text.
    let torn = [("csrf", csrf.as_str()), ("action", "requeue"), ("filter", "state=dead")];
    let (status, html) = post(&b, &s, "/console/bulk", &torn).await;
    assert_eq!(status, 400);
    assert!(
        html.contains("<html") && html.contains("The form could not be read") && html.contains("expected"),
        "{html}"
    );
    let torn =
        [("csrf", csrf.as_str()), ("action", "requeue"), ("filter", "state=dead"), ("expected", "x"), ("until", "1")];
    assert_eq!(post(&b, &s, "/console/bulk", &torn).await.0, 400);
    // A job that dies after the confirmation is not in what was confirmed.
    dead_job(&s, "acme-late", "acme").await;
    // More than confirmed now match (a wider filter than the confirmation's): refused, nothing done.
    let wider = [
        ("csrf", csrf.as_str()),
        ("action", "requeue"),
        ("filter", "state=dead"),
        ("expected", "3"),
        ("until", "999999999999"),
    ];
    assert_eq!(post(&b, &s, "/console/bulk", &wider).await.0, 409);
    assert_eq!(s.get("/v1/jobs/acme-0").await.body["state"], "dead");
    let form = [
        ("csrf", csrf.as_str()),
        ("action", "requeue"),
        ("filter", "state=dead&account=acme"),
        ("expected", &expected),
        ("until", &until),
    ];
    let (status, html) = post(&b, &s, "/console/bulk", &form).await;
    assert_eq!(status, 200);
    assert!(html.contains("<strong>3</strong> jobs requeued"), "{html}");
    for i in 0..3 {
        assert_eq!(s.get(&format!("/v1/jobs/acme-{i}")).await.body["state"], "queued");
    }
    assert_eq!(s.get("/v1/jobs/other-0").await.body["state"], "dead", "outside the filter: untouched");
    assert_eq!(s.get("/v1/jobs/acme-late").await.body["state"], "dead", "created after the confirmation: untouched");
    let actions = s.store_handle().operators().actions(None, None).await.unwrap();
    assert_eq!(
        actions.iter().filter(|a| a.action == settle_store::ActionKind::JobRequeue && a.actor == "ops-ana").count(),
        3
    );
}

async fn the_pages_show_where_the_credits_went(e: Engine) {
    let s = server(e).await;
    s.account("acme", 100).await;
    dead_job(&s, "j1", "acme").await;
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console").await;
    assert!(html.contains("dead letters") && html.contains("TIMEOUT"), "overview: dead letters and failures by code");
    // Six events so far (account created and granted; job queued, claimed, refunded, dead).
    assert!(
        html.contains(r#"aria-label="6 transitions in the last hour""#),
        "overview: the per-minute chart counts them"
    );
    let (_, html) = page(&b, &s, "/console/jobs/j1").await;
    for what in ["attempt 1 claimed by <strong>gpu-1</strong>", "job.refunded", "job_failed", "<code>TIMEOUT</code>"] {
        assert!(html.contains(what), "job page shows {what}");
    }
    // Issue 24: which grant paid, and what went back to it.
    assert!(html.contains("<h2>Paid by</h2>"), "{html}");
    assert!(html.contains("grant <code>g-acme</code>"), "{html}");
    let (_, html) = page(&b, &s, "/console/accounts/acme").await;
    assert!(html.contains("<h2>Grants</h2>") && html.contains("<code>g-acme</code>"), "{html}");
    assert!(html.contains("?chain=true\">check it</a>"), "the chain is checked on demand");
    let (_, checked) = page(&b, &s, "/console/accounts/acme?chain=true").await;
    assert!(checked.contains("<strong class=\"ok\">intact</strong>"), "the chain is checked");
    assert!(html.contains(r#"<a href="/console/jobs/j1">j1</a>"#), "entries link to their job");
    let (_, html) = page(&b, &s, "/console/accounts/acme?kind=refund").await;
    assert!(html.contains("<td>refund</td>") && !html.contains("<td>charge</td>"), "filtered by kind");
    let (status, _) = page(&b, &s, "/console/accounts/nobody").await;
    assert_eq!(status, 404);
    let (status, _) = page(&b, &s, "/console/jobs?state=nonsense").await;
    assert_eq!(status, 400);
    let (_, html) = page(&b, &s, "/console/jobs?prefix=j").await;
    assert!(html.contains("1 jobs match"), "{html}");
    // No page asks another origin for anything.
    for path in ["/console", "/console/jobs/j1", "/console/accounts/acme", "/docs"] {
        let (_, html) = page(&b, &s, path).await;
        assert!(!html.contains("src=\"http") && !html.contains("href=\"http"), "{path} loads from elsewhere");
    }
}

async fn a_held_item_shows_its_hold_price_and_release(e: Engine) {
    let s = server(e).await;
    s.account("gpu", 500).await;
    let body = serde_json::json!({"id": "render-h", "account_id": "gpu", "kind": "render",
        "items": [{"id": "f1", "hold": 100}, {"id": "f2", "hold": 50}, {"id": "f3", "cost": 5}]});
    assert_eq!(s.post("/v1/jobs", body).await.status, 201);
    let r = s.send("POST", "/v1/claims", Some(serde_json::json!({"worker": "gpu-1"})), Some(WORKER)).await;
    let token = r.body["jobs"][0]["lease_token"].as_str().unwrap().to_owned();
    let priced = serde_json::json!({"lease_token": token, "cost": 37});
    assert_eq!(s.send("POST", "/v1/jobs/render-h/items/f1/succeed", Some(priced), Some(WORKER)).await.status, 200);
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console/jobs/render-h").await;
    let row =
        |item: &str| html.split(&format!("<td>{item}</td>")).nth(1).unwrap().split("</tr>").next().unwrap().to_owned();
    let f1 = row("f1");
    assert!(f1.contains(">100<") && f1.contains(">37<") && f1.contains(">63<"), "hold, price, release: {f1}");
    assert!(row("f2").contains("not priced"), "{}", row("f2"));
    assert!(row("f3").contains("fixed"), "{}", row("f3"));
    let (_, html) = page(&b, &s, "/console/accounts/gpu").await;
    assert!(html.contains("the unused rest of a hold") && html.contains(", priced at 37"), "the release explained");
    assert!(html.contains("a hold: 63 released at"), "the charge paired with its release");
}

async fn a_job_shows_its_priority_and_labels_and_the_list_filters_by_priority(e: Engine) {
    let s = server(e).await;
    s.account("gpu", 500).await;
    let urgent = serde_json::json!({"id": "urgent", "account_id": "gpu", "kind": "render", "cost": 1,
        "priority": 5, "requires": ["region:eu", "gpu:a100"]});
    assert_eq!(s.post("/v1/jobs", urgent).await.status, 201);
    let plain = serde_json::json!({"id": "plain", "account_id": "gpu", "kind": "render", "cost": 1});
    assert_eq!(s.post("/v1/jobs", plain).await.status, 201);
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console/jobs/urgent").await;
    assert!(html.contains("<dt>priority</dt><dd>5"), "{html}");
    assert!(html.contains("<code>gpu:a100</code> <code>region:eu</code>"), "{html}");
    // No worker has shown those labels: the page says why it waits; once one claims with them
    // (and finds it), it no longer does.
    assert!(html.contains("Waiting: no worker with these labels"), "{html}");
    let (_, html) = page(&b, &s, "/console/jobs/plain").await;
    assert!(html.contains("<dt>priority</dt><dd>50") && html.contains("no labels"), "{html}");
    assert!(!html.contains("Waiting: no worker"), "{html}");
    let (_, html) = page(&b, &s, "/console/jobs?priority=5").await;
    assert!(html.contains("1 jobs match") && html.contains("urgent") && !html.contains(">plain<"), "{html}");
    let (status, _) = page(&b, &s, "/console/jobs?priority=101").await;
    assert_eq!(status, 400);
    let listed = s.send("GET", "/v1/jobs?priority=50", None, Some(CLIENT)).await;
    let ids: Vec<&str> = listed.body["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["plain"]);
    // A worker with only one of the two labels: still waiting. One with both takes it.
    let gpu_only = serde_json::json!({"worker": "w-gpu", "kinds": ["render"], "labels": ["gpu:a100"]});
    let r = s.send("POST", "/v1/claims", Some(gpu_only), Some(WORKER)).await;
    assert_eq!(r.body["jobs"][0]["id"], "plain", "{}", r.body);
    let (_, html) = page(&b, &s, "/console/jobs/urgent").await;
    assert!(html.contains("Waiting: no worker with these labels"), "{html}");
    let both = serde_json::json!({"worker": "w-eu", "kinds": ["other"], "labels": ["gpu:a100", "region:eu"]});
    let r = s.send("POST", "/v1/claims", Some(both), Some(WORKER)).await;
    assert_eq!(r.body["jobs"].as_array().unwrap().len(), 0, "{}", r.body);
    let (_, html) = page(&b, &s, "/console/jobs/urgent").await;
    assert!(!html.contains("Waiting: no worker"), "a worker with both labels has been seen: {html}");
}

/// Balance alerts on the account page (issue 45): each with its threshold and the side the
/// balance is on, the one crossed marked below.
async fn the_account_page_shows_its_alerts_and_their_sides(e: Engine) {
    let s = server(e).await;
    s.account("alerted", 1_000).await;
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console/accounts/alerted").await;
    assert!(html.contains("Balance alerts") && html.contains("/alerts sets them"), "{html}");
    let set = serde_json::json!({"alerts": [{"id": "low-water", "below": 500}, {"id": "empty", "below": 10}]});
    assert_eq!(s.send("PUT", "/v1/accounts/alerted/alerts", Some(set), Some(CLIENT)).await.status, 200);
    s.job("spend", "alerted", 600).await;
    let (_, html) = page(&b, &s, "/console/accounts/alerted").await;
    let at = html.find("low-water").expect("the alert is listed");
    assert!(html[at..].find("below").is_some_and(|i| i < 200), "low-water is marked below: {html}");
    assert!(html.contains("empty"), "{html}");
}

/// Spend limits on the account page (issue 45): each with its period, what it spent, its amount,
/// its kinds and when it resets; a limit reached is marked.
async fn the_account_page_shows_its_spend_limits(e: Engine) {
    let s = server(e).await;
    s.account("limited", 1_000).await;
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console/accounts/limited").await;
    assert!(html.contains("Spend limits") && html.contains("/limits sets them"), "{html}");
    let set = serde_json::json!({"limits": [{"period": "day", "amount": 300, "kinds": ["render"]}, {"period": "month", "amount": 900}]});
    assert_eq!(s.send("PUT", "/v1/accounts/limited/limits", Some(set), Some(CLIENT)).await.status, 200);
    s.job("spend", "limited", 300).await;
    let (_, html) = page(&b, &s, "/console/accounts/limited").await;
    let at = html.find("UTC day").expect("the day limit is listed");
    assert!(html[at..].find("class=\"error\"").is_some_and(|i| i < 120), "the day limit is marked reached: {html}");
    assert!(html.contains("<code>render</code>") && html.contains("every kind but withdrawal"), "{html}");
    assert!(html.contains("UTC month"), "{html}");
}

/// Issue 45: the top-ups page lists each top-up with its state, charge and grant; a top-up's job page
/// names what it buys and what the provider confirmed; the account page shows its rule, paused when
/// a rule top-up died.
async fn top_ups_show_their_charge_grant_and_rule(e: Engine) {
    let s = server(e).await;
    s.account("buyer", 1_000).await;
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console/accounts/buyer").await;
    assert!(html.contains("Auto top-up") && html.contains("/auto-top-up sets one"), "{html}");
    let t = serde_json::json!({"id": "tu1", "account_id": "buyer", "credits": 500, "price": 499, "currency": "EUR", "customer": "cus_b"});
    assert_eq!(s.post("/v1/top-ups", t).await.status, 201);
    let rule = serde_json::json!({"below": 600, "credits": 300, "price": 299, "currency": "EUR", "customer": "cus_b", "monthly_credits_max": 900});
    assert_eq!(s.send("PUT", "/v1/accounts/buyer/auto-top-up", Some(rule), Some(CLIENT)).await.status, 200);
    let store = s.store_handle();
    let worker = settle_core::ids::WorkerName::parse("funding").unwrap();
    let claimed = store.funding().claim_top_ups(&worker, 10).await.unwrap();
    let tu1 = settle_core::ids::JobId::parse("tu1").unwrap();
    store.funding().top_up_succeeded(&tu1, Some(&claimed[0].lease_token), "ch_42").await.unwrap();
    // 1500 → 800: no crossing; → 500: the rule buys, and its charge is declined: the rule pauses
    s.job("spend-1", "buyer", 700).await;
    s.job("spend-2", "buyer", 300).await;
    let claimed = store.funding().claim_top_ups(&worker, 10).await.unwrap();
    assert_eq!(claimed.len(), 1, "the rule's top-up");
    let signal = settle_store::FailSignal {
        lease_token: claimed[0].lease_token.clone(),
        code: settle_core::ids::FailCode::parse("CARD_DECLINED").unwrap(),
        message: Some("declined".into()),
        retryable: Some(false),
        retry_after_ms: None,
    };
    store.funding().top_up_failed(&claimed[0].job.id, signal).await.unwrap();
    let (_, html) = page(&b, &s, "/console/top-ups").await;
    assert!(html.contains("/console/jobs/tu1") && html.contains("<code>ch_42</code>"), "{html}");
    assert!(html.contains("CARD_DECLINED"), "the rule's declined top-up is listed: {html}");
    let (_, html) = page(&b, &s, "/console/jobs/tu1").await;
    assert!(
        html.contains("<code>cus_b</code>")
            && html.contains("<code>ch_42</code>")
            && html.contains("500 credits for 499 EUR"),
        "{html}"
    );
    let (_, html) = page(&b, &s, "/console/accounts/buyer").await;
    let at = html.find("Auto top-up").expect("the rule's card");
    // paused, and the dead top-up's 300 given back to the month
    assert!(html[at..].contains("paused") && html[at..].contains("<dd>0 of 900 credits"), "{html}");
}

/// Caps over HTTP and in the console: a PATCH caps the account, the claim stops at the cap, the
/// account page shows it and the waiting job says why it waits.
async fn an_account_at_its_cap_says_why_its_job_waits(e: Engine) {
    let s = server(e).await;
    let made =
        s.send("POST", "/v1/accounts", Some(serde_json::json!({"id": "gpu", "max_running": 1})), Some(ADMIN)).await;
    assert_eq!((made.status, &made.body["max_running"]), (201, &serde_json::json!(1)), "{}", made.body);
    let grant = serde_json::json!({"id": "g-gpu", "amount": 100});
    assert_eq!(s.send("POST", "/v1/accounts/gpu/grants", Some(grant), Some(ADMIN)).await.status, 201);
    for id in ["first", "second"] {
        let job = serde_json::json!({"id": id, "account_id": "gpu", "kind": "render", "cost": 1});
        assert_eq!(s.post("/v1/jobs", job).await.status, 201);
    }
    let r = s.send("POST", "/v1/claims", Some(serde_json::json!({"worker": "w", "limit": 5})), Some(WORKER)).await;
    assert_eq!(r.body["jobs"].as_array().unwrap().len(), 1, "one at a time: {}", r.body);
    let (b, _) = sign_in(&s, CLIENT).await;
    let (_, html) = page(&b, &s, "/console/jobs/second").await;
    assert!(html.contains("1 of at most 1 running") && html.contains("Waiting: its account is at its cap"), "{html}");
    let (_, html) = page(&b, &s, "/console/accounts/gpu").await;
    assert!(html.contains("jobs at most running at once"), "{html}");
    // Bad caps: refused, nothing changed; a client may not change caps; null removes the cap.
    for bad in [
        serde_json::json!({"max_running": -1}),
        serde_json::json!({"max_running": 10001}),
        serde_json::json!({"cap": 2}),
    ] {
        let r = s.send("PATCH", "/v1/accounts/gpu", Some(bad), Some(ADMIN)).await;
        assert_eq!(r.status, 400, "{}", r.body);
    }
    let r = s.send("PATCH", "/v1/accounts/gpu", Some(serde_json::json!({"max_running": 5})), Some(CLIENT)).await;
    assert_eq!(r.status, 403);
    let r = s.send("PATCH", "/v1/accounts/nobody", Some(serde_json::json!({"max_running": 5})), Some(ADMIN)).await;
    assert_eq!(r.status, 404);
    let r = s.send("PATCH", "/v1/accounts/gpu", Some(serde_json::json!({"max_running": null})), Some(ADMIN)).await;
    assert_eq!((r.status, &r.body["max_running"]), (200, &serde_json::Value::Null), "{}", r.body);
    assert_eq!(r.body["overdraft_limit"], 0, "the other field kept");
    let r = s.send("POST", "/v1/claims", Some(serde_json::json!({"worker": "w", "limit": 5})), Some(WORKER)).await;
    assert_eq!(r.body["jobs"][0]["id"], "second", "no cap: the waiting job starts: {}", r.body);
}

async fn a_signed_out_or_rotated_session_is_no_session(e: Engine) {
    let s = server(e).await;
    let (b, _) = sign_in(&s, ADMIN).await;
    let r = browser().post(format!("{}/console/login", s.base)).form(&[("token", ADMIN)]).send().await.unwrap();
    let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let with_cookie = |c: &str| {
        let c = c.to_owned();
        let base = s.base.clone();
        async move { plain().get(format!("{base}/console")).header("cookie", c).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(with_cookie(&cookie).await, 200);
    // A stray cookie of the same name sent first does not shadow the valid one.
    assert_eq!(with_cookie(&format!("settle_console=junk; {cookie}")).await, 200);
    // Signing out in one browser ends that session, and a copy of its cookie with it.
    let copied = with_cookie(&cookie);
    let client = plain();
    let html =
        client.get(format!("{}/console", s.base)).header("cookie", &cookie).send().await.unwrap().text().await.unwrap();
    let out = client
        .post(format!("{}/console/logout", s.base))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf_of(&html))])
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), 303);
    assert_eq!(copied.await, 303, "the signed-out session's cookie no longer opens the console");
    // The other browser's session is its own.
    assert_eq!(page(&b, &s, "/console").await.0, 200);
}

/// Issue 41: with `SETTLE_CONSOLE_SECRET` every process accepts the others' sessions — so a sign-out
/// must hold in all of them, and after a restart (it lived in one process's memory).
async fn a_sign_out_holds_in_every_process_and_after_a_restart(e: Engine) {
    const SECRET: &str = "a-console-secret-of-at-least-32-characters";
    let s = server(e).await;
    let tokens = || {
        let mut t = Tokens::default();
        t.add_named(Role::Admin, ADMIN, "ops-ana").unwrap();
        t
    };
    let process = || async {
        let store = s.store_handle() as std::sync::Arc<dyn Store>;
        let limits = settle_api::HttpLimits::default();
        let app = settle_api::Application::build_full("127.0.0.1:0", store, tokens(), limits, Some(SECRET), false)
            .await
            .unwrap();
        let base = format!("http://{}", app.local_addr());
        tokio::spawn(app.run_until(std::future::pending()));
        base
    };
    let (a, b) = (process().await, process().await);
    let r = browser().post(format!("{a}/console/login")).form(&[("token", ADMIN)]).send().await.unwrap();
    let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let status = |base: String, c: String| async move {
        plain().get(format!("{base}/console")).header("cookie", c).send().await.unwrap().status().as_u16()
    };
    assert_eq!(status(b.clone(), cookie.clone()).await, 200, "the other process accepts the session");
    let html =
        plain().get(format!("{a}/console")).header("cookie", &cookie).send().await.unwrap().text().await.unwrap();
    let out = plain()
        .post(format!("{a}/console/logout"))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf_of(&html))])
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), 303);
    assert_eq!(status(a.clone(), cookie.clone()).await, 303, "signed out where it signed out");
    assert_eq!(status(b, cookie.clone()).await, 303, "and in the other process");
    let restarted = process().await;
    assert_eq!(status(restarted, cookie).await, 303, "and after a restart");
}

async fn cross_site_posts_and_foreign_hosts_are_refused(e: Engine) {
    let s = server(e).await;
    s.account("acme", 100).await;
    dead_job(&s, "j1", "acme").await;
    let (b, _) = sign_in(&s, ADMIN).await;
    let (_, html) = page(&b, &s, "/console/jobs/j1").await;
    let csrf = csrf_of(&html);
    let url = format!("{}/console/jobs/j1/requeue", s.base);
    for (header, value) in
        [("origin", "https://evil.example"), ("sec-fetch-site", "cross-site"), ("sec-fetch-site", "same-site")]
    {
        let r = b.post(&url).header(header, value).form(&[("csrf", csrf.as_str())]).send().await.unwrap();
        assert_eq!(r.status(), 403, "{header}: {value}");
    }
    // Sign-in from another site is refused too (no login CSRF).
    let r = browser()
        .post(format!("{}/console/login", s.base))
        .header("origin", "https://evil.example")
        .form(&[("token", ADMIN)])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "dead");
    let origin = s.base.clone();
    let r = b
        .post(&url)
        .header("origin", origin)
        .header("sec-fetch-site", "same-origin")
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303, "this console's own page may post");
    // Without tokens (loopback mode) the console answers a loopback Host only.
    let open = Server::start(e).await;
    let client = plain();
    let r = client.get(format!("{}/console", open.base)).send().await.unwrap();
    assert_eq!(r.status(), 200, "loopback mode: the console is open on loopback");
    let r = client.get(format!("{}/console", open.base)).header("host", "rebound.evil.example").send().await.unwrap();
    assert_eq!(r.status(), 403, "a DNS-rebound name is not served the open console");
}
