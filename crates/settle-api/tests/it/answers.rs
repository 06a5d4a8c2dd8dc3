//! Worker answers a worker can act on (issue 20, decision 0019): every signal route × {the current
//! token, the same report re-sent, an earlier attempt's token, a token never issued, no token as a
//! worker, no token as an admin}, over real HTTP, on both engines. From the answer alone a worker
//! knows whether its report took effect now, had already taken effect (a replay), or was refused
//! because its lease is gone — and what became of the job.

use crate::kit::*;
use serde_json::{Value, json};
use settle_api::{Role, Tokens};
use settle_core::clock::FakeClock;
use settle_core::ids::JobId;
use settle_core::{Clock, Timestamp};
use settle_store::Store;
use std::sync::Arc;

on_both_engines!(
    heartbeat_answers,
    fail_answers,
    unknown_answers,
    succeed_answers,
    item_succeed_answers,
    item_fail_answers,
    artifact_answers,
    a_report_after_a_lost_answer_is_a_replay_whatever_came_between,
    replays_survive_what_came_after,
);

const ADMIN: &str = "admin-token-0123456789";
const WORKER: &str = "worker-token-0123456789";
const NEVER: &str = "9b0c6a52-never-issued-token";

struct Fixture {
    s: Server,
    clock: Arc<FakeClock>,
    n: std::sync::atomic::AtomicU32,
}

/// A job with two attempts: the first's lease expired and was rescued, the second holds it now.
struct TwoAttempts {
    id: String,
    old: String,
    current: String,
}

impl Fixture {
    async fn new(e: Engine) -> Fixture {
        let mut tokens = Tokens::default();
        tokens.add_named(Role::Admin, ADMIN, "ops-alice").unwrap();
        tokens.add(Role::Worker, WORKER).unwrap();
        let clock = Arc::new(FakeClock::new(Timestamp::from_micros(1_800_000_000_000_000)));
        let c = clock.clone();
        let mut s = Server::with_options(e, tokens, move |o| o.clock = c).await;
        s.token = Some(ADMIN.into());
        s.account("acme", 1_000_000).await;
        Fixture { s, clock, n: 0.into() }
    }

    async fn worker(&self, path: &str, body: Value) -> Reply {
        self.s.send("POST", path, Some(body), Some(WORKER)).await
    }

    /// A fresh job of a kind of its own (so a claim finds only it), with items `i1` and `i2`.
    async fn job(&self) -> String {
        let n = self.n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let id = format!("j{n}");
        let body = json!({"id": id, "account_id": "acme", "kind": format!("k{n}"), "max_attempts": 5,
                          "items": [{"id": "i1", "cost": 10}, {"id": "i2", "cost": 20}]});
        let r = self.s.post("/v1/jobs", body).await;
        assert_eq!(r.status, 201, "{}", r.body);
        id
    }

    async fn claim(&self, id: &str) -> String {
        let kind = self.s.get(&format!("/v1/jobs/{id}")).await.body["kind"].as_str().unwrap().to_owned();
        let r = self.worker("/v1/claims", json!({"worker": "w1", "kinds": [kind], "lease_seconds": 30})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.body["jobs"][0]["id"], id, "{}", r.body);
        r.body["jobs"][0]["lease_token"].as_str().unwrap().to_owned()
    }

    /// Lets the current lease of every running job lapse, and rescues them.
    async fn expire(&self) {
        self.clock.advance_seconds(31);
        self.s.store_handle().rescue_expired_leases(100).await.unwrap();
    }

    async fn two_attempts(&self) -> TwoAttempts {
        let id = self.job().await;
        let old = self.claim(&id).await;
        self.expire().await;
        self.clock.advance_seconds(3_600); // past any backoff
        let current = self.claim(&id).await;
        assert_ne!(old, current);
        TwoAttempts { id, old, current }
    }

    async fn signals(&self, id: &str) -> usize {
        self.s.store_handle().signals(&JobId::parse(id).unwrap()).await.unwrap().len()
    }

    async fn state(&self, id: &str) -> String {
        self.s.get(&format!("/v1/jobs/{id}")).await.body["state"].as_str().unwrap().to_owned()
    }
}

fn applied(r: &Reply) {
    assert!(matches!(r.status, 200 | 201), "{} {}", r.status, r.body);
    assert!(!r.replayed, "an applied report is not a replay: {}", r.body);
}

fn replayed(r: &Reply) {
    assert_eq!((r.status, r.replayed), (200, true), "{}", r.body);
}

/// `409 lease_lost` with its details: the job's state, and how the token's attempt ended.
fn lease_lost<'a>(r: &'a Reply, lease: &str) -> &'a Value {
    assert_eq!((r.status, code(r)), (409, "lease_lost"), "{}", r.body);
    let d = &r.body["error"]["details"];
    assert_eq!(d["lease"], lease, "{}", r.body);
    assert!(d["state"].is_string(), "{}", r.body);
    d
}

/// An earlier attempt's token after the rescuer closed it: the lease expired, and when.
fn expired_attempt_one(d: &Value) {
    assert_eq!(d["attempt"]["attempt"], 1, "{d}");
    assert_eq!(d["attempt"]["result"], "lease_expired", "{d}");
    let at = d["attempt"]["expired_at"].as_str().expect("expired_at");
    assert!(at.starts_with("2027-01-15T08:00:30"), "{at}"); // claimed at T0 with a 30 s lease
}

/// A token no attempt of the job held: refused, and nothing is written (not even the signal log).
async fn never_issued(f: &Fixture, id: &str, path: &str, body: Value) {
    let before = f.signals(id).await;
    let r = f.worker(path, body).await;
    let d = lease_lost(&r, "never_issued");
    assert!(d["attempt"].is_null(), "{d}");
    assert_eq!(f.signals(id).await, before, "a never-issued token wrote to the signal log");
}

/// Without a token, every route but `succeed` is `400` for every role.
async fn tokenless_is_400(f: &Fixture, path: &str, body: Value) {
    for token in [WORKER, ADMIN] {
        let r = f.s.send("POST", path, Some(body.clone()), Some(token)).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{token}: {}", r.body);
    }
}

async fn heartbeat_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let j = f.two_attempts().await;
    let path = format!("/v1/jobs/{}/heartbeat", j.id);
    // The current token renews, and so does the same heartbeat re-sent (nothing to replay).
    for _ in 0..2 {
        let r = f.worker(&path, json!({"lease_token": j.current})).await;
        applied(&r);
        assert_eq!(r.body["cancel_requested"], false);
    }
    // The first attempt's token: its lease expired (when, and what became of the job).
    let before = f.signals(&j.id).await;
    let r = f.worker(&path, json!({"lease_token": j.old})).await;
    let d = lease_lost(&r, "expired");
    expired_attempt_one(d);
    assert_eq!(d["state"], "running");
    assert_eq!(f.signals(&j.id).await, before + 1, "a stale heartbeat is logged");
    never_issued(&f, &j.id, &path, json!({"lease_token": NEVER})).await;
    tokenless_is_400(&f, &path, json!({})).await;
    // After the current lease expires too, its own heartbeat says so, and the job's new state.
    f.expire().await;
    let r = f.worker(&path, json!({"lease_token": j.current})).await;
    let d = lease_lost(&r, "expired");
    assert_eq!((d["state"].as_str(), d["attempt"]["attempt"].as_u64()), (Some("queued"), Some(2)), "{d}");
}

async fn fail_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let j = f.two_attempts().await;
    let path = format!("/v1/jobs/{}/fail", j.id);
    let fail = |t: &str, code: &str| json!({"lease_token": t, "code": code, "message": "render crashed"});
    // An earlier attempt's token while the current one runs: refused, the job untouched.
    let r = f.worker(&path, fail(&j.old, "TIMEOUT")).await;
    expired_attempt_one(lease_lost(&r, "expired"));
    assert_eq!(f.state(&j.id).await, "running");
    never_issued(&f, &j.id, &path, fail(NEVER, "TIMEOUT")).await;
    tokenless_is_400(&f, &path, json!({"code": "TIMEOUT"})).await;
    // The current token: applied (a retry is scheduled and the items refunded).
    let r = f.worker(&path, fail(&j.current, "TIMEOUT")).await;
    applied(&r);
    assert_eq!(r.body["state"], "queued");
    let balance = f.s.balance("acme").await;
    // The same report re-sent (its answer was lost): a replay, the job as it is, nothing refunded twice.
    let r = f.worker(&path, fail(&j.current, "TIMEOUT")).await;
    replayed(&r);
    assert_eq!((r.body["state"].as_str(), r.body["attempt"].as_u64()), (Some("queued"), Some(2)));
    assert_eq!(f.s.balance("acme").await, balance);
    // Re-sent with another code: not the same report.
    let r = f.worker(&path, fail(&j.current, "OOM")).await;
    assert_eq!((r.status, code(&r)), (409, "idempotency_conflict"), "{}", r.body);
    // The first attempt's failure now: still refused (the rescuer ended it, not its worker).
    let r = f.worker(&path, fail(&j.old, "TIMEOUT")).await;
    lease_lost(&r, "expired");

    // A failure while a cancel is pending tears the job down; its re-send is a replay too.
    let id = f.job().await;
    let t = f.claim(&id).await;
    assert_eq!(f.s.post_empty(&format!("/v1/jobs/{id}/cancel")).await.status, 202);
    let p = format!("/v1/jobs/{id}/fail");
    let r = f.worker(&p, fail(&t, "TIMEOUT")).await;
    applied(&r);
    assert_eq!(f.state(&id).await, "cancelled");
    replayed(&f.worker(&p, fail(&t, "TIMEOUT")).await);
}

async fn unknown_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let j = f.two_attempts().await;
    let path = format!("/v1/jobs/{}/unknown", j.id);
    let body = |t: &str| json!({"lease_token": t, "message": "no answer from the GPU host"});
    expired_attempt_one(lease_lost(&f.worker(&path, body(&j.old)).await, "expired"));
    never_issued(&f, &j.id, &path, body(NEVER)).await;
    tokenless_is_400(&f, &path, json!({})).await;
    let r = f.worker(&path, body(&j.current)).await;
    applied(&r);
    assert_eq!(r.body["state"], "unknown");
    let r = f.worker(&path, body(&j.current)).await;
    replayed(&r);
    assert_eq!(r.body["state"], "unknown");
    // Its failure after its own `unknown` is another report: refused, with how the attempt ended.
    let r = f.worker(&format!("/v1/jobs/{}/fail", j.id), json!({"lease_token": j.current, "code": "X"})).await;
    let d = lease_lost(&r, "ended");
    assert_eq!(
        (d["attempt"]["result"].as_str(), d["attempt"]["reported"].as_str()),
        (Some("unknown"), Some("unknown"))
    );
}

async fn succeed_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let path = |id: &str| format!("/v1/jobs/{id}/succeed");

    // A token no attempt ever held: refused and nothing written — on a job never claimed too.
    let fresh = f.job().await;
    never_issued(&f, &fresh, &path(&fresh), json!({"lease_token": NEVER})).await;
    assert_eq!(f.state(&fresh).await, "queued");
    let j = f.two_attempts().await;
    never_issued(&f, &j.id, &path(&j.id), json!({"lease_token": NEVER})).await;
    assert_eq!(f.state(&j.id).await, "running");

    // Without a token: a worker may not (an operator's act), an admin may, recorded with its actor.
    let r = f.s.send("POST", &path(&fresh), Some(json!({})), Some(WORKER)).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"), "{}", r.body);
    assert_eq!(f.state(&fresh).await, "queued");
    let r = f.s.send("POST", &path(&fresh), Some(json!({})), Some(ADMIN)).await;
    applied(&r);
    assert_eq!(r.body["state"], "succeeded");
    let acts = f.s.store_handle().operators().actions(Some(&JobId::parse(&fresh).unwrap()), None).await.unwrap();
    assert!(
        acts.iter().any(|a| a.action == settle_store::ActionKind::JobSucceed && a.actor == "ops-alice"),
        "{acts:?}"
    );
    replayed(&f.s.send("POST", &path(&fresh), Some(json!({})), Some(ADMIN)).await);

    // An earlier attempt's token while another runs: the work exists, the success is applied.
    let r = f.worker(&path(&j.id), json!({"lease_token": j.old})).await;
    applied(&r);
    assert_eq!(r.body["state"], "succeeded");
    let balance = f.s.balance("acme").await;
    // Re-sent, or sent by the current attempt: replays (the money moved once).
    replayed(&f.worker(&path(&j.id), json!({"lease_token": j.old})).await);
    replayed(&f.worker(&path(&j.id), json!({"lease_token": j.current})).await);
    assert_eq!(f.s.balance("acme").await, balance);

    // The current token: applied; re-sent: a replay.
    let id = f.job().await;
    let t = f.claim(&id).await;
    applied(&f.worker(&path(&id), json!({"lease_token": t})).await);
    replayed(&f.worker(&path(&id), json!({"lease_token": t})).await);

    // When a cancel wins the race: the answer says `cancelling`, its re-send is a replay, and
    // another attempt's success on the cancelled job is refused (it changed nothing).
    let j = f.two_attempts().await;
    assert_eq!(f.s.post_empty(&format!("/v1/jobs/{}/cancel", j.id)).await.status, 202);
    let r = f.worker(&path(&j.id), json!({"lease_token": j.current})).await;
    applied(&r);
    assert!(matches!(r.body["state"].as_str(), Some("cancelling" | "cancelled")), "{}", r.body);
    assert_eq!(f.state(&j.id).await, "cancelled");
    replayed(&f.worker(&path(&j.id), json!({"lease_token": j.current})).await);
    let d = lease_lost(&f.worker(&path(&j.id), json!({"lease_token": j.old})).await, "expired").clone();
    assert_eq!(d["state"], "cancelled");
    let r = f.s.send("POST", &path(&j.id), Some(json!({})), Some(ADMIN)).await;
    assert_eq!((r.status, code(&r)), (409, "job_finished"), "{}", r.body);
}

async fn item_succeed_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let id = f.job().await;
    let first = f.claim(&id).await;
    let path = |item: &str| format!("/v1/jobs/{id}/items/{item}/succeed");
    tokenless_is_400(&f, &path("i1"), json!({})).await;
    // The current token: applied; re-sent: a replay.
    let r = f.worker(&path("i1"), json!({"lease_token": first})).await;
    applied(&r);
    assert_eq!(r.body["item"]["state"], "succeeded");
    replayed(&f.worker(&path("i1"), json!({"lease_token": first})).await);
    never_issued(&f, &id, &path("i2"), json!({"lease_token": NEVER})).await;
    // The lease expires and a second attempt claims: the first attempt's re-send of the item it
    // decided is a replay; its report of another item is refused.
    f.expire().await;
    f.clock.advance_seconds(3_600);
    let second = f.claim(&id).await;
    replayed(&f.worker(&path("i1"), json!({"lease_token": first})).await);
    expired_attempt_one(lease_lost(&f.worker(&path("i2"), json!({"lease_token": first})).await, "expired"));
    // The current attempt: an item an earlier attempt delivered holds already (a replay).
    replayed(&f.worker(&path("i1"), json!({"lease_token": second})).await);
    applied(&f.worker(&path("i2"), json!({"lease_token": second})).await);
}

async fn item_fail_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let id = f.job().await;
    let first = f.claim(&id).await;
    let path = |item: &str| format!("/v1/jobs/{id}/items/{item}/fail");
    let body = |t: &str| json!({"lease_token": t, "code": "BAD_FRAME", "message": "frame 12 corrupt"});
    tokenless_is_400(&f, &path("i1"), json!({"code": "BAD_FRAME"})).await;
    let r = f.worker(&path("i1"), body(&first)).await;
    applied(&r);
    assert_eq!(r.body["item"]["state"], "refunded");
    let balance = f.s.balance("acme").await;
    replayed(&f.worker(&path("i1"), body(&first)).await);
    assert_eq!(f.s.balance("acme").await, balance, "a replay refunds nothing");
    never_issued(&f, &id, &path("i2"), body(NEVER)).await;
    // A failure of a delivered item contradicts it.
    applied(&f.worker(&format!("/v1/jobs/{id}/items/i2/succeed"), json!({"lease_token": first})).await);
    let r = f.worker(&path("i2"), body(&first)).await;
    assert_eq!((r.status, code(&r)), (409, "invalid_transition"), "{}", r.body);
    f.expire().await;
    f.clock.advance_seconds(3_600);
    let _second = f.claim(&id).await;
    replayed(&f.worker(&path("i1"), body(&first)).await);
    expired_attempt_one(lease_lost(&f.worker(&path("i2"), body(&first)).await, "expired"));
}

async fn artifact_answers(e: Engine) {
    let f = Fixture::new(e).await;
    let j = f.two_attempts().await;
    let path = format!("/v1/jobs/{}/items/i1/artifacts", j.id);
    let r = f.worker(&path, json!({"lease_token": j.current, "key": "out.mp4"})).await;
    assert_eq!((r.status, r.replayed), (201, false), "{}", r.body);
    replayed(&f.worker(&path, json!({"lease_token": j.current, "key": "out.mp4"})).await);
    // A worker that lost its lease may not write artifacts, not even ones registered before.
    let r = f.worker(&path, json!({"lease_token": j.old, "key": "out.mp4"})).await;
    expired_attempt_one(lease_lost(&r, "expired"));
    never_issued(&f, &j.id, &path, json!({"lease_token": NEVER, "key": "other.mp4"})).await;
    tokenless_is_400(&f, &path, json!({"key": "out.mp4"})).await;
}

/// Whatever a worker's report was first answered, its re-send gets the same class of answer:
/// applied or replayed first → replayed after; refused first → refused after.
async fn a_report_after_a_lost_answer_is_a_replay_whatever_came_between(e: Engine) {
    let f = Fixture::new(e).await;
    // A success, then the rescuer, a cancel and the teardown sweeper run: still a replay.
    let id = f.job().await;
    let t = f.claim(&id).await;
    applied(&f.worker(&format!("/v1/jobs/{id}/items/i1/succeed"), json!({"lease_token": t})).await);
    applied(&f.worker(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": t})).await);
    f.expire().await;
    f.s.store_handle().resume_teardowns(100).await.unwrap();
    replayed(&f.worker(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": t})).await);
    replayed(&f.worker(&format!("/v1/jobs/{id}/items/i1/succeed"), json!({"lease_token": t})).await);
    // A refusal stays a refusal once the job moved on.
    let j = f.two_attempts().await;
    let p = format!("/v1/jobs/{}/fail", j.id);
    let body = json!({"lease_token": j.old, "code": "TIMEOUT"});
    lease_lost(&f.worker(&p, body.clone()).await, "expired");
    applied(&f.worker(&p, json!({"lease_token": j.current, "code": "TIMEOUT"})).await);
    lease_lost(&f.worker(&p, body).await, "expired");
    assert!(f.clock.now() > Timestamp::from_micros(1_800_000_000_000_000));
}

/// The review's sequences (decision 0019): an attempt's late success keeps its earlier failure's
/// re-send a replay; an item replay given while the lease was held stays one after it is gone.
async fn replays_survive_what_came_after(e: Engine) {
    let f = Fixture::new(e).await;
    // fail(t1) applied, then t1's late success reclaims: fail(t1) re-sent is still a replay.
    let id = f.job().await;
    let t1 = f.claim(&id).await;
    let fail = json!({"lease_token": t1, "code": "TIMEOUT"});
    applied(&f.worker(&format!("/v1/jobs/{id}/fail"), fail.clone()).await);
    applied(&f.worker(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": t1})).await);
    replayed(&f.worker(&format!("/v1/jobs/{id}/fail"), fail).await);
    // unknown(t) then its success from `unknown`: unknown(t) re-sent is still a replay.
    let id = f.job().await;
    let t = f.claim(&id).await;
    applied(&f.worker(&format!("/v1/jobs/{id}/unknown"), json!({"lease_token": t})).await);
    applied(&f.worker(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": t})).await);
    replayed(&f.worker(&format!("/v1/jobs/{id}/unknown"), json!({"lease_token": t})).await);
    // Attempt 1 delivers i1; attempt 2 re-reports it (a replay) and succeeds the job: attempt 2's
    // item report re-sent is still a replay.
    let id = f.job().await;
    let first = f.claim(&id).await;
    applied(&f.worker(&format!("/v1/jobs/{id}/items/i1/succeed"), json!({"lease_token": first})).await);
    f.expire().await;
    f.clock.advance_seconds(3_600);
    let second = f.claim(&id).await;
    let item = format!("/v1/jobs/{id}/items/i1/succeed");
    replayed(&f.worker(&item, json!({"lease_token": second})).await);
    applied(&f.worker(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": second})).await);
    replayed(&f.worker(&item, json!({"lease_token": second})).await);
    // A token no attempt held on a cancelling job resumes nothing (writes nothing at all).
    let id = f.job().await;
    let t = f.claim(&id).await;
    assert_eq!(f.s.post_empty(&format!("/v1/jobs/{id}/cancel")).await.status, 202);
    f.expire().await; // the rescuer begins the teardown
    let r = f.worker(&format!("/v1/jobs/{id}/fail"), json!({"lease_token": NEVER, "code": "TIMEOUT"})).await;
    lease_lost(&r, "never_issued");
    let _ = t;
}
