//! `settle provider-sim` and `settle funding-sim`: a payout provider speaking `provider-v1` and a
//! funding provider speaking `funding-v1` (`../shared/spec/api-v1.md`) — one simulator, two
//! protocols (`Protocol`: their paths, fields and codes) — the counterparty of Settle's demo and
//! tests. It is not Settle: it keeps its transfers in memory,
//! exactly once per idempotency key, and misbehaves on purpose, the way real providers do:
//!
//! - a share of sends is **executed and then answered with a cut connection**;
//! - a share of sends **hangs past the caller's timeout** (half of them executed first);
//! - **node-down periods** (`NODE_DOWN` to sends: the payout node is down, the provider's records
//!   still answer lookups), **rate limiting** (`RATE_LIMITED`
//!   with `Retry-After`), a **finite float** (`INSUFFICIENT`), **refused destinations**
//!   (`INVALID_ADDRESS`), and executed payouts that are **returned** later (`"status": "returned"`).
//!
//! As a funding provider it charges customers instead: `PROCESSOR_DOWN` periods, `RATE_LIMITED`,
//! a finite balance (`INSUFFICIENT_FUNDS`), declined cards (`CARD_DECLINED`, customers starting
//! with the refused prefix) and customers without a card (`NO_PAYMENT_METHOD`, starting with
//! `nocard`); charges are never returned.
//!
//! Besides the protocol it answers `GET /v1/executed` (every executed transfer, with how many sends
//! named its key) and `GET /v1/log` (every request in arrival order with its fate), so tests can
//! check that Settle never sends a key twice and always looks a key up after a lost answer.

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use settle_core::backoff::SplitMix64;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What differs between the protocols the simulator speaks: paths, fields and codes.
#[derive(Debug)]
pub struct Protocol {
    pub name: &'static str,
    /// `/v1/{collection}` sends, `/v1/{collection}/{key}` looks up.
    pub collection: &'static str,
    /// The field of the provider's id in answers, and its prefix.
    pub id_field: &'static str,
    pub id_prefix: &'static str,
    /// Who the money goes to or comes from.
    pub party: &'static str,
    /// Whether a send names a currency, and whether it may be of nothing (a free top-up).
    pub currency: bool,
    pub zero: bool,
    /// The codes: the system down, the money short, the party refused, the party without a means.
    pub down: &'static str,
    pub short: &'static str,
    pub refused: &'static str,
    pub no_means: Option<&'static str>,
    /// Whether executed ones may come back (payouts returned by the receiving side).
    pub returns: bool,
}

/// `provider-v1`: payouts.
pub const PROVIDER_V1: Protocol = Protocol {
    name: "provider-v1",
    collection: "transactions",
    id_field: "txid",
    id_prefix: "tx_",
    party: "destination",
    currency: false,
    zero: false,
    down: "NODE_DOWN",
    short: "INSUFFICIENT",
    refused: "INVALID_ADDRESS",
    no_means: None,
    returns: true,
};

/// `funding-v1`: charges of customers for top-ups.
pub const FUNDING_V1: Protocol = Protocol {
    name: "funding-v1",
    collection: "charges",
    id_field: "charge_id",
    id_prefix: "ch_",
    party: "customer",
    currency: true,
    zero: true,
    down: "PROCESSOR_DOWN",
    short: "INSUFFICIENT_FUNDS",
    refused: "CARD_DECLINED",
    no_means: Some("NO_PAYMENT_METHOD"),
    returns: false,
};

/// Parties (customers) starting with this have no means of payment (`NO_PAYMENT_METHOD`), where the
/// protocol has the code.
pub const NO_MEANS_PREFIX: &str = "nocard";

/// The simulator's knobs. Shares are probabilities in `[0, 1]`, drawn from one seeded generator.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub seed: u64,
    /// Sends executed and then answered with a cut connection.
    pub lose_answer: f64,
    /// Sends that hang for `hang_ms` before answering (half of them executed first).
    pub hang: f64,
    pub hang_ms: u64,
    /// Share of `down_period_ms` slots in which the node is down (`NODE_DOWN` to sends).
    pub node_down: f64,
    pub down_period_ms: u64,
    /// Share of requests answered `RATE_LIMITED` with `Retry-After: retry_after_seconds`.
    pub rate_limit: f64,
    pub retry_after_seconds: u64,
    /// What the sim can pay out in all; a send beyond it is `INSUFFICIENT`. `None`: unlimited.
    pub float: Option<i64>,
    /// Parties starting with this are refused (`INVALID_ADDRESS`, `CARD_DECLINED`); empty: none.
    pub invalid_prefix: String,
    /// Share of executed payouts returned `return_after_ms` after they were executed.
    pub returns: f64,
    pub return_after_ms: u64,
}

impl Default for SimConfig {
    /// A well-behaved provider: every knob off.
    fn default() -> SimConfig {
        SimConfig {
            seed: 1,
            lose_answer: 0.0,
            hang: 0.0,
            hang_ms: 15_000,
            node_down: 0.0,
            down_period_ms: 500,
            rate_limit: 0.0,
            retry_after_seconds: 1,
            float: None,
            invalid_prefix: "invalid".to_owned(),
            returns: 0.0,
            return_after_ms: 0,
        }
    }
}

/// One executed transfer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Transfer {
    pub key: String,
    pub txid: String,
    pub amount: i64,
    /// The party (a payout's destination, a charge's customer).
    pub destination: String,
    /// A charge's currency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// Every send that named this key, the executing one included.
    pub sends: u32,
    /// Sends that named this key after it had been executed (Settle should make none: it looks up first).
    pub sends_after_executed: u32,
    pub returned: bool,
}

/// One request as the simulator saw it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LogEntry {
    pub seq: u64,
    /// `lookup` or `send`.
    pub op: String,
    pub key: String,
    /// `found`, `returned`, `absent`, `executed`, `replayed`, `cut`, `hang_executed`, `hang`,
    /// `node_down`, `rate_limited`, `insufficient`, `invalid_address`, `bad_request`.
    pub fate: String,
    /// Whether the caller was sent an answer (not for `cut`, nor for hangs it gave up on).
    pub answered: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Executed {
    pub transfers: Vec<Transfer>,
    pub total_paid: i64,
    /// Times a send arrived for a key while another send of that key was still in flight.
    pub concurrent_sends: u32,
}

struct Book {
    rng: SplitMix64,
    transfers: BTreeMap<String, (Transfer, Option<Instant>)>,
    paid: i64,
    in_flight: BTreeMap<String, u32>,
    concurrent_sends: u32,
    log: Vec<LogEntry>,
}

/// A fault switched on by hand (the demo tells its stories with these), over the random ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forced {
    /// Every send is answered `NODE_DOWN`.
    NodeDown,
    /// Every send is executed and its answer lost.
    LoseAnswers,
}

pub struct Sim {
    config: SimConfig,
    protocol: &'static Protocol,
    started: Instant,
    book: Mutex<Book>,
    forced: Mutex<Option<Forced>>,
}

impl Sim {
    pub fn new(config: SimConfig) -> Arc<Sim> {
        Sim::speaking(config, &PROVIDER_V1)
    }

    pub fn speaking(config: SimConfig, protocol: &'static Protocol) -> Arc<Sim> {
        let rng = SplitMix64::new(config.seed);
        Arc::new(Sim {
            config,
            protocol,
            started: Instant::now(),
            book: Mutex::new(Book {
                rng,
                transfers: BTreeMap::new(),
                paid: 0,
                in_flight: BTreeMap::new(),
                concurrent_sends: 0,
                log: Vec::new(),
            }),
            forced: Mutex::new(None),
        })
    }

    /// Switches a fault on (or off with `None`) until told otherwise.
    pub fn force(&self, fault: Option<Forced>) {
        *self.forced.lock().expect("sim lock") = fault;
    }

    /// The receiving side sends an executed payout back now; false if the key was never executed.
    pub fn return_transfer(&self, key: &str) -> bool {
        let mut book = self.book.lock().expect("sim lock");
        match book.transfers.get_mut(key) {
            Some((_, at)) => {
                *at = Some(Instant::now());
                true
            }
            None => false,
        }
    }

    pub fn executed(&self) -> Executed {
        let book = self.book.lock().expect("sim lock");
        let now = Instant::now();
        Executed {
            transfers: book
                .transfers
                .values()
                .map(|(t, ret)| Transfer { returned: is_returned(*ret, now), ..t.clone() })
                .collect(),
            total_paid: book.paid,
            concurrent_sends: book.concurrent_sends,
        }
    }

    pub fn log(&self) -> Vec<LogEntry> {
        self.book.lock().expect("sim lock").log.clone()
    }

    fn node_is_down(&self) -> bool {
        if *self.forced.lock().expect("sim lock") == Some(Forced::NodeDown) {
            return true;
        }
        if self.config.node_down <= 0.0 {
            return false;
        }
        let slot = self.started.elapsed().as_millis() as u64 / self.config.down_period_ms.max(1);
        let mut r = SplitMix64::new(self.config.seed ^ slot.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        unit(r.next_u64()) < self.config.node_down
    }
}

fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

fn is_returned(at: Option<Instant>, now: Instant) -> bool {
    at.is_some_and(|t| t <= now)
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "code": code, "message": message }))).into_response()
}

fn log(book: &mut Book, op: &str, key: &str, fate: &str, answered: bool) -> u64 {
    let seq = book.log.len() as u64 + 1;
    book.log.push(LogEntry { seq, op: op.to_owned(), key: key.to_owned(), fate: fate.to_owned(), answered });
    seq
}

async fn lookup(State(sim): State<Arc<Sim>>, Path(key): Path<String>) -> Response {
    let mut book = sim.book.lock().expect("sim lock");
    if unit(book.rng.next_u64()) < sim.config.rate_limit {
        log(&mut book, "lookup", &key, "rate_limited", true);
        return rate_limited(&sim.config);
    }
    let found = book.transfers.get(&key).map(|(t, ret)| (t.txid.clone(), is_returned(*ret, Instant::now())));
    let p = sim.protocol;
    match found {
        Some((id, returned)) => {
            log(&mut book, "lookup", &key, if returned { "returned" } else { "found" }, true);
            let mut body = serde_json::json!({ p.id_field: id });
            if p.returns {
                body["status"] = serde_json::json!(if returned { "returned" } else { "executed" });
            }
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        None => {
            log(&mut book, "lookup", &key, "absent", true);
            error(StatusCode::NOT_FOUND, "NOT_FOUND", "nothing with that key")
        }
    }
}

fn rate_limited(config: &SimConfig) -> Response {
    let mut r = error(StatusCode::TOO_MANY_REQUESTS, "RATE_LIMITED", "slow down");
    r.headers_mut().insert("retry-after", HeaderValue::from(config.retry_after_seconds));
    r
}

/// A send's body: `{key, <party>, amount}` (and `currency` where the protocol has it), nothing else.
struct SendBody {
    key: String,
    destination: String,
    amount: i64,
    currency: Option<String>,
}

impl SendBody {
    fn parse(p: &Protocol, body: &[u8]) -> Option<SendBody> {
        let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body).ok()?;
        let allowed = |k: &str| k == "key" || k == p.party || k == "amount" || (p.currency && k == "currency");
        if !v.keys().all(|k| allowed(k)) {
            return None;
        }
        let currency = match p.currency {
            true => Some(v.get("currency")?.as_str()?.to_owned()),
            false => None,
        };
        Some(SendBody {
            key: v.get("key")?.as_str()?.to_owned(),
            destination: v.get(p.party)?.as_str()?.to_owned(),
            amount: v.get("amount")?.as_i64()?,
            currency,
        })
    }
}

/// What a send does, decided on arrival under the lock.
enum Fate {
    Answer(Response),
    /// Executed (or not), then the connection is cut before the answer.
    Cut,
    /// Wait, then answer with this (the caller has usually given up by then).
    Hang(Response),
}

async fn send(State(sim): State<Arc<Sim>>, _headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let Some(req) = SendBody::parse(sim.protocol, &body) else {
        let mut book = sim.book.lock().expect("sim lock");
        log(&mut book, "send", "", "bad_request", true);
        let shape =
            if sim.protocol.currency { "{key, customer, amount, currency}" } else { "{key, destination, amount}" };
        return error(StatusCode::BAD_REQUEST, "BAD_REQUEST", &format!("the body is {shape}"));
    };
    let down = sim.node_is_down();
    let lose = *sim.forced.lock().expect("sim lock") == Some(Forced::LoseAnswers);
    let (fate, _in_flight) = {
        let mut book = sim.book.lock().expect("sim lock");
        let in_flight = book.in_flight.entry(req.key.clone()).or_insert(0);
        *in_flight += 1;
        if *in_flight > 1 {
            book.concurrent_sends += 1;
        }
        // Counted out when this request ends, however it ends: a caller that gives up on a hang
        // drops this handler mid-sleep.
        let guard = InFlight { sim: sim.clone(), key: req.key.clone() };
        (decide(&sim, &mut book, &req, down, lose), guard)
    };
    match fate {
        Fate::Answer(r) => r,
        Fate::Hang(r) => {
            tokio::time::sleep(Duration::from_millis(sim.config.hang_ms)).await;
            r
        }
        Fate::Cut => cut_connection(),
    }
}

/// One send of a key in flight; dropped when the request ends.
struct InFlight {
    sim: Arc<Sim>,
    key: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut book) = self.sim.book.lock()
            && let Some(n) = book.in_flight.get_mut(&self.key)
        {
            *n -= 1;
        }
    }
}

fn decide(sim: &Sim, book: &mut Book, req: &SendBody, down: bool, lose: bool) -> Fate {
    let key = req.key.as_str();
    let p = sim.protocol;
    let least = i64::from(!p.zero);
    if key.is_empty() || req.amount < least || req.destination.is_empty() {
        log(book, "send", key, "bad_request", true);
        return Fate::Answer(error(StatusCode::BAD_REQUEST, "BAD_REQUEST", "a key, a party and an amount"));
    }
    if down {
        log(book, "send", key, "node_down", true);
        return Fate::Answer(error(StatusCode::SERVICE_UNAVAILABLE, p.down, "the node is down"));
    }
    // A key already executed: the same txid, no money moves (provider-v1).
    if let Some((t, _)) = book.transfers.get_mut(key) {
        t.sends += 1;
        t.sends_after_executed += 1;
        let txid = t.txid.clone();
        log(book, "send", key, "replayed", true);
        return Fate::Answer((StatusCode::OK, axum::Json(serde_json::json!({ p.id_field: txid }))).into_response());
    }
    let c = &sim.config;
    if unit(book.rng.next_u64()) < c.rate_limit {
        log(book, "send", key, "rate_limited", true);
        return Fate::Answer(rate_limited(c));
    }
    if !c.invalid_prefix.is_empty() && req.destination.starts_with(&c.invalid_prefix) {
        log(book, "send", key, "invalid_address", true);
        return Fate::Answer(error(StatusCode::UNPROCESSABLE_ENTITY, p.refused, "refused"));
    }
    if let Some(code) = p.no_means
        && req.destination.starts_with(NO_MEANS_PREFIX)
    {
        log(book, "send", key, "no_means", true);
        return Fate::Answer(error(StatusCode::UNPROCESSABLE_ENTITY, code, "no means of payment"));
    }
    if c.float.is_some_and(|f| book.paid.saturating_add(req.amount) > f) {
        log(book, "send", key, "insufficient", true);
        return Fate::Answer(error(StatusCode::UNPROCESSABLE_ENTITY, p.short, "the money cannot cover it"));
    }
    let roll = if lose { 0.0 } else { unit(book.rng.next_u64()) };
    let (execute, fate) = if lose || roll < c.lose_answer {
        (true, "cut")
    } else if roll < c.lose_answer + c.hang {
        let executed = book.rng.next_u64() & 1 == 0;
        (executed, if executed { "hang_executed" } else { "hang" })
    } else {
        (true, "executed")
    };
    let mut txid = None;
    if execute {
        let id = format!("{}{:016x}", p.id_prefix, book.rng.next_u64());
        let roll = unit(book.rng.next_u64());
        let returned =
            (p.returns && roll < c.returns).then(|| Instant::now() + Duration::from_millis(c.return_after_ms));
        book.paid += req.amount;
        book.transfers.insert(
            key.to_owned(),
            (
                Transfer {
                    key: key.to_owned(),
                    txid: id.clone(),
                    amount: req.amount,
                    destination: req.destination.clone(),
                    currency: req.currency.clone(),
                    sends: 1,
                    sends_after_executed: 0,
                    returned: false,
                },
                returned,
            ),
        );
        txid = Some(id);
    }
    log(book, "send", key, fate, fate == "executed");
    let answer = || match &txid {
        Some(id) => (StatusCode::OK, axum::Json(serde_json::json!({ p.id_field: id }))).into_response(),
        None => error(StatusCode::SERVICE_UNAVAILABLE, p.down, "gave up"),
    };
    match fate {
        "cut" => Fate::Cut,
        "hang" | "hang_executed" => Fate::Hang(answer()),
        _ => Fate::Answer(answer()),
    }
}

/// A `200` whose body breaks off: the caller's read fails, as when the connection is cut after the
/// request was written and executed.
fn cut_connection() -> Response {
    let stream = futures_util::stream::iter([
        Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"{\"tx")),
        Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut")),
    ]);
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(axum::body::Body::from_stream(stream))
        .expect("a valid response")
}

async fn executed(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(sim.executed()).into_response()
}

async fn request_log(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(serde_json::json!({ "requests": sim.log() })).into_response()
}

pub fn router(sim: Arc<Sim>) -> Router {
    let collection = sim.protocol.collection;
    Router::new()
        .route(&format!("/v1/{collection}/{{key}}"), axum::routing::get(lookup))
        .route(&format!("/v1/{collection}"), axum::routing::post(send))
        .route("/v1/executed", axum::routing::get(executed))
        .route("/v1/log", axum::routing::get(request_log))
        .with_state(sim)
}

/// A running simulator: its address and its book.
pub struct Running {
    pub addr: SocketAddr,
    pub sim: Arc<Sim>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Binds `listen` (port 0 picks one) and serves until the task is dropped or aborted.
pub async fn start(listen: &str, config: SimConfig) -> std::io::Result<Running> {
    start_speaking(listen, config, &PROVIDER_V1).await
}

/// `start`, speaking `protocol`.
pub async fn start_speaking(listen: &str, config: SimConfig, protocol: &'static Protocol) -> std::io::Result<Running> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let sim = Sim::speaking(config, protocol);
    let app = router(sim.clone());
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, protocol = protocol.name, "provider simulator stopped");
        }
    });
    Ok(Running { addr, sim, task })
}
