//! The steps: clients, workers (on time, late, twice, with stale tokens, or never), the background
//! passes, time, and crashes — each chosen by the seed and run to its end before the next.

use crate::machine::{Machine, Rig};
use crate::world::{GRANT, SimJob, World, code};
use settle_core::Credits;
use settle_core::crash::CrashPoint;
use settle_core::ids::RefId;
use settle_core::ids::{AccountId, ArtifactKey, Destination, ItemId, JobId, JobKind, Labels, WorkerName};
use settle_core::job::{JobState, RefundPolicy};
use settle_store::{
    ClaimRequest, Costs, FailSignal, LeaseToken, NewArtifact, NewGrant, NewItem, NewJob, NewWithdrawal, Price,
    Reporter, Store, StoreError,
};

const KINDS: [&str; 2] = ["render", "batch"];
/// The labels each simulated worker has (`w0`, `w1`, `w2`), and the drain's: every one.
const WORKER_LABELS: [&[&str]; 3] = [&[], &["gpu"], &["gpu", "eu"]];

/// Runs one step; returns whether it was a crash (the caller reopens the store).
pub async fn step(w: &mut World, m: &Machine, rig: &Rig) -> bool {
    match w.pick(100) {
        0..22 => create_job(w, m).await,
        22..37 => claim(w, m).await,
        37..62 => report(w, m, rig).await,
        62..66 => cancel(w, m).await,
        66..70 => withdrawal(w, m).await,
        70..71 => top_up(w, m).await,
        71..72 => grant(w, m).await,
        72..73 => set_cap(w, m).await,
        73..85 => pass(w, m).await,
        85..97 => advance(w, rig),
        _ => return crash(w, m, rig).await,
    }
    false
}

/// A crash: the store dies at a crash point inside the next operation, or right after it.
async fn crash(w: &mut World, m: &Machine, rig: &Rig) -> bool {
    let point = CrashPoint::ALL[w.pick(CrashPoint::ALL.len())];
    w.trace(&format!("arm {}", point.name()));
    rig.crash.arm(point);
    match w.pick(4) {
        0 => create_job(w, m).await,
        1 => report(w, m, rig).await,
        2 => cancel(w, m).await,
        _ => pass(w, m).await,
    }
    true
}

fn advance(w: &mut World, rig: &Rig) {
    let ms = match w.pick(3) {
        0 => 1 + w.tape.rng.below_inclusive(999),
        1 => 1_000 + w.tape.rng.below_inclusive(59_000),
        _ => 60_000 + w.tape.rng.below_inclusive(540_000),
    };
    rig.clock.advance_ms(ms);
    w.trace(&format!("time +{ms} ms"));
    // A hung charge may be carried out now, as a hung payout may below.
    if rig.funding.hung() > 0 {
        let ran = rig.funding.run_hung(|_| w.chance(30));
        if ran > 0 {
            w.trace(&format!("hung charges carried out: {ran}"));
        }
    }
    // A hung payout request may be carried out now, long after its caller heard nothing.
    if rig.provider.hung() > 0 {
        let ran = rig.provider.run_hung(|_| w.chance(15));
        w.trace(&format!("hung sends carried out: {ran}"));
    }
    // The payout provider's node goes down, or comes back, now and then.
    if w.chance(10) {
        let down = w.chance(50);
        rig.provider.set_down(down);
        w.trace(&format!("provider down: {down}"));
    }
}

fn account(w: &mut World) -> AccountId {
    let n = w.pick(w.accounts.len());
    AccountId::parse(&w.accounts[n]).expect("an account id")
}

async fn create_job(w: &mut World, m: &Machine) {
    let id = w.fresh_id("j");
    let account = account(w);
    let kind = KINDS[w.pick(KINDS.len())];
    let n = 1 + w.pick(3);
    let mut items = Vec::new();
    let mut sim = SimJob { account: account.as_str().to_owned(), ..SimJob::default() };
    for i in 0..n {
        let held = w.chance(30);
        let amount = Credits::new(1 + w.tape.rng.below_inclusive(19) as i64);
        let item = format!("i{i}");
        items.push(NewItem {
            id: ItemId::parse(&item).expect("an item id"),
            price: if held { Price::Hold(amount) } else { Price::Cost(amount) },
        });
        sim.prices.insert(item.clone(), amount.get());
        sim.items.push((item, held));
    }
    let refund_on = if w.chance(20) { Some(RefundPolicy::FinalFailure) } else { None };
    sim.final_failure = refund_on.is_some();
    // Priorities and labels (issue 44): a claim may only hand a job to a worker with its labels,
    // and the drain (a worker with every label) must leave none behind.
    let priority = match w.pick(4) {
        0 => Some(0),
        1 => Some(90),
        _ => None,
    };
    let requires: &[&str] = match w.pick(8) {
        0 | 1 => &["gpu"],
        2 => &["eu", "gpu"],
        _ => &[],
    };
    sim.requires = requires.iter().map(|l| (*l).to_owned()).collect();
    let req = NewJob {
        id: JobId::parse(&id).expect("a job id"),
        account_id: account,
        kind: JobKind::parse(kind).expect("a kind"),
        items,
        payload: serde_json::Value::Null,
        max_attempts: Some(1 + w.pick(3) as u32),
        refund_on,
        not_before: None,
        priority,
        requires: Labels::parse(requires, 8).expect("labels"),
    };
    let made = m.store.create_job(req).await;
    w.answer(&format!("create {id} {kind} x{n}"), made.as_ref().map(|c| c.value.state));
    w.jobs.insert(id.clone(), sim);
    w.moved(id);
}

async fn claim(w: &mut World, m: &Machine) {
    let n = w.pick(3);
    let worker = format!("w{n}");
    let labels = WORKER_LABELS[n];
    let req = ClaimRequest {
        worker: WorkerName::parse(&worker).expect("a worker"),
        kinds: KINDS.iter().map(|k| JobKind::parse(k).expect("a kind")).collect(),
        labels: Labels::parse(labels, 64).expect("labels"),
        limit: 1 + w.pick(2) as u32,
        lease_seconds: None,
    };
    let claimed = m.store.claim(req).await;
    w.answer(&format!("claim by {worker}"), claimed.as_ref().map(|c| c.len()));
    let claimed = claimed.unwrap_or_default();
    if let Err(broke) = caps_held(w, m, &claimed).await {
        w.tape.broken.push(broke);
        return;
    }
    for c in claimed {
        let id = c.job.id.as_str().to_owned();
        w.trace(&format!("claimed {id}"));
        if let Some(sim) = w.jobs.get_mut(&id) {
            if let Some(missing) = sim.requires.iter().find(|l| !labels.contains(&l.as_str())) {
                let broke = format!("{worker} (labels {labels:?}) was given {id}, which requires {missing}");
                w.tape.broken.push(broke);
                return;
            }
            sim.tokens.push(c.lease_token);
        }
        w.touched.insert(id);
    }
}

/// A claim that gave out a job of a capped account or kind left it at most at its cap: each step
/// runs alone, so the running jobs counted now are those before the claim and what it gave.
async fn caps_held(w: &World, m: &Machine, claimed: &[settle_store::ClaimedJob]) -> Result<(), String> {
    use settle_core::job::JobState;
    use settle_store::{JobFilter, Page};
    let running = |filter: JobFilter| async move {
        let page = Page { after: 0, limit: 1_000 };
        // Withdrawals never count toward a cap (decision 0032).
        let rows = m.store.jobs(&JobFilter { state: Some(JobState::Running), ..filter }, page).await;
        rows.map(|p| p.rows.iter().filter(|j| !settle_core::job::Rail::of(j.kind.as_str()).is_reserved()).count())
    };
    let mut accounts: Vec<&AccountId> = claimed.iter().map(|c| &c.job.account_id).collect();
    accounts.dedup();
    for a in accounts {
        let Some(Some(cap)) = w.caps.get(a.as_str()) else { continue };
        let filter = JobFilter { account_id: Some(a.clone()), ..JobFilter::ALL };
        let n = running(filter).await.map_err(|e| format!("count running: {e}"))?;
        if n as i64 > *cap {
            return Err(format!("a claim put account {a} at {n} running jobs, over its cap {cap}"));
        }
    }
    let (kind, cap) = crate::world::KIND_CAP;
    if claimed.iter().any(|c| c.job.kind.as_str() == kind) {
        let filter = JobFilter { kind: Some(JobKind::parse(kind).expect("a kind")), ..JobFilter::ALL };
        let n = running(filter).await.map_err(|e| format!("count running: {e}"))?;
        if n as i64 > cap {
            return Err(format!("a claim put kind {kind} at {n} running jobs, over its cap {cap}"));
        }
    }
    Ok(())
}

/// An admin sets or removes an account's cap (never 0 here: the drain at the end must finish
/// every job).
async fn set_cap(w: &mut World, m: &Machine) {
    let account = account(w);
    let cap = match w.pick(4) {
        0 => None,
        n => Some(n as i64),
    };
    let changes = settle_store::AccountChanges { overdraft_limit: None, max_running: Some(cap) };
    let set = m.store.update_account(&account, changes, settle_store::SYSTEM_ACTOR).await;
    w.answer(&format!("cap {account} {cap:?}"), set.as_ref().map(|a| a.max_running));
    if set.is_ok() {
        w.caps.insert(account.as_str().to_owned(), cap);
    }
}

/// A job some worker holds (or held) a token for, and which token: the newest mostly, an older
/// one sometimes (a worker that outlived its lease). `stale` when a newer token is known.
fn leased(w: &mut World) -> Option<(String, LeaseToken, bool)> {
    let held: Vec<String> = w.jobs.iter().filter(|(_, j)| !j.tokens.is_empty()).map(|(id, _)| id.clone()).collect();
    if held.is_empty() {
        return None;
    }
    let id = held[w.pick(held.len())].clone();
    let n = w.jobs[&id].tokens.len();
    let which = if w.chance(75) { n - 1 } else { w.pick(n) };
    Some((id.clone(), w.jobs[&id].tokens[which].clone(), which + 1 < n))
}

/// What a held item costs: somewhere up to its hold (at most 20 here).
fn costs(w: &mut World, job: &str, only: Option<&str>) -> Costs {
    let items: Vec<(String, bool)> = w.jobs[job].items.clone();
    let mut c = Costs::default();
    for (item, held) in items {
        if held && only.is_none_or(|o| o == item) {
            let price = w.tape.rng.below_inclusive(1) as i64; // 0 or 1: always within any hold
            c.0.insert(ItemId::parse(&item).expect("an item id"), Credits::new(price));
        }
    }
    c
}

async fn report(w: &mut World, m: &Machine, rig: &Rig) {
    let Some((id, token, stale)) = leased(w) else { return };
    let times = if w.chance(20) { 2 } else { 1 };
    let action = w.pick(7);
    for _ in 0..times {
        report_once(w, m, rig, &id, &token, stale, action).await;
    }
    w.moved(id);
}

async fn report_once(w: &mut World, m: &Machine, rig: &Rig, id: &str, token: &LeaseToken, stale: bool, action: usize) {
    let job = JobId::parse(id).expect("a job id");
    let items: Vec<(String, bool)> = w.jobs[id].items.clone();
    let (item, held) = items[w.pick(items.len())].clone();
    let item_id = ItemId::parse(&item).expect("an item id");
    // What a stale token may get: a refusal, or a replay of what took effect (never a new effect).
    let label = format!("{id} {}", if stale { "stale" } else { "current" });
    let applied: Option<bool> = match action {
        0 => {
            let c = costs(w, id, None);
            let r = m.store.succeed_priced(&job, Reporter::Lease(token), None, &c).await;
            w.answer(&format!("succeed {label}"), r.as_ref().map(|o| o.applied));
            None // any token some attempt held may report a success (the seed's late success)
        }
        1 => {
            let retryable = w.chance(50);
            let signal = FailSignal {
                lease_token: token.clone(),
                code: code(if retryable { "TIMEOUT" } else { "INVALID_INPUT" }),
                message: None,
                retryable: Some(retryable),
                retry_after_ms: None,
            };
            let r = m.store.fail(&job, signal).await;
            w.answer(&format!("fail {label}"), r.as_ref().map(|o| o.applied));
            r.ok().map(|o| o.applied)
        }
        2 => {
            let price = if held { Some(Credits::new(w.tape.rng.below_inclusive(1) as i64)) } else { None };
            w.jobs.get_mut(id).expect("a job").item_succeeded.insert(item.clone());
            let r = m.store.item_succeed_priced(&job, &item_id, token, price).await;
            w.answer(&format!("item succeed {label} {item}"), r.as_ref().map(|o| o.applied));
            r.ok().map(|o| o.applied)
        }
        3 => {
            let r = m.store.item_fail(&job, &item_id, token, &code("BAD_FRAME"), None).await;
            w.answer(&format!("item fail {label} {item}"), r.as_ref().map(|o| o.applied));
            r.ok().map(|o| o.applied)
        }
        4 => {
            let r = m.store.heartbeat(&job, token).await;
            w.answer(&format!("heartbeat {label}"), r.as_ref().map(|_| ()));
            r.ok().map(|_| true)
        }
        5 => {
            let r = m.store.mark_unknown(&job, token, Some("no answer")).await;
            w.answer(&format!("unknown {label}"), r.as_ref().map(|o| o.applied));
            r.ok().map(|o| o.applied)
        }
        _ => {
            // The worker writes the object where its key lives (`{job}/{item}/{key}`,
            // docs/decisions/0015), then registers it.
            let artifact = NewArtifact { key: ArtifactKey::parse("out").expect("an artifact key") };
            let path = format!("{id}/{item}/out");
            let r = m.store.register_artifact(&job, &item_id, token, artifact).await;
            w.answer(&format!("artifact {label} {item}"), r.as_ref().map(|_| ()));
            if r.is_ok() {
                rig.artifacts.put(&path);
                w.jobs.get_mut(id).expect("a job").artifacts.push((item.clone(), path));
            }
            None // writing into the job's store is allowed while any token is the current lease
        }
    };
    if stale && applied == Some(true) {
        w.tape.broken.push(format!("a report with job {id}'s stale token took effect (action {action})"));
    }
}

async fn cancel(w: &mut World, m: &Machine) {
    if w.jobs.is_empty() {
        return;
    }
    let ids: Vec<String> = w.jobs.keys().cloned().collect();
    let id = ids[w.pick(ids.len())].clone();
    let r = m.store.cancel(&JobId::parse(&id).expect("a job id"), None).await;
    w.answer(&format!("cancel {id}"), r.as_ref().map(|o| o.job().state));
    if let Ok(settle_store::CancelOutcome::Accepted(_)) = &r {
        let sim = w.jobs.get_mut(&id).expect("a job");
        sim.cancel_accepted = true;
        // Seed 003's race ⑤: the worker's success arrives right after the accepted cancel, before
        // it heard of it. The cancel wins: the job is torn down, never completed.
        if let Some(token) = sim.tokens.last().cloned()
            && w.chance(50)
        {
            let c = costs(w, &id, None);
            let r =
                m.store.succeed_priced(&JobId::parse(&id).expect("a job id"), Reporter::Lease(&token), None, &c).await;
            w.answer(&format!("succeed after cancel {id}"), r.as_ref().map(|o| o.applied));
        }
    }
    w.moved(id);
}

async fn withdrawal(w: &mut World, m: &Machine) {
    let id = w.fresh_id("wd");
    // Half of them from the account that lives on its overdraft: the cash rule's ground.
    let account = if w.chance(50) { AccountId::parse(crate::world::OWING).expect("an account id") } else { account(w) };
    let amount = 1 + w.tape.rng.below_inclusive(39) as i64;
    let req = NewWithdrawal {
        id: JobId::parse(&id).expect("an id"),
        account_id: account.clone(),
        amount: Credits::new(amount),
        destination: Destination::parse("DE00000000000000000001").expect("a destination"),
    };
    let r = m.store.payouts().create_withdrawal(req).await;
    w.answer(&format!("withdraw {id} {amount}"), r.as_ref().map(|c| c.value.job.state));
    let sim = SimJob {
        withdrawal: true,
        items: vec![("main".into(), false)],
        account: account.as_str().to_owned(),
        prices: [("main".to_owned(), amount)].into_iter().collect(),
        ..SimJob::default()
    };
    w.jobs.insert(id.clone(), sim);
    w.moved(id);
}

/// A top-up bought by hand on an account (issue 45): nothing charged to it; its credits are granted
/// only once the funding provider's charge is confirmed (`World::count_bought`).
async fn top_up(w: &mut World, m: &Machine) {
    let id = w.fresh_id("tu");
    let account = account(w);
    let credits = 1 + w.tape.rng.below_inclusive(299) as i64;
    let req = settle_store::NewTopUp {
        id: JobId::parse(&id).expect("an id"),
        account_id: account.clone(),
        credits: Credits::new(credits),
        price: credits * 10,
        currency: settle_core::currency::Currency::parse("EUR").expect("a currency"),
        customer: settle_core::ids::Customer::parse("cus_sim").expect("a customer"),
    };
    let r = m.store.funding().create_top_up(req).await;
    w.answer(&format!("top up {id} {credits}"), r.as_ref().map(|c| c.value.job.state));
    w.touched_accounts.insert(account.as_str().to_owned());
}

/// A grant, half of them expiring within the hour.
async fn grant(w: &mut World, m: &Machine) {
    let id = w.fresh_id("g");
    let account = account(w);
    let amount = 1 + w.tape.rng.below_inclusive(GRANT as u64 / 10) as i64;
    let expires_at =
        if w.chance(50) { Some(m.store.now().plus_seconds(60 + w.tape.rng.below_inclusive(3_540))) } else { None };
    let req = NewGrant {
        id: RefId::parse(&id).expect("a ref id"),
        amount: Credits::new(amount),
        reason: None,
        expires_at,
        priority: Some(w.tape.rng.below_inclusive(100) as i64),
    };
    let r = m.store.grant(&account, req, settle_store::SYSTEM_ACTOR).await;
    w.answer(&format!("grant {id}"), r.as_ref().map(|_| ()));
    if r.is_ok() {
        w.books.granted(account.as_str(), amount);
    }
    w.touched_accounts.insert(account.as_str().to_owned());
}

async fn pass(w: &mut World, m: &Machine) {
    let which = w.pick(11);
    let r: Result<usize, StoreError> = match which {
        0 => m.maintenance.rescue_pass().await.map(|v| v.len()),
        1 => m.maintenance.sweep_pass().await.map(|v| v.len()),
        2 => m.maintenance.reconcile_pass().await.map(|v| v.len()),
        3 => m.maintenance.expire_pass().await.map(|v| v.len()),
        4 => m.payouts.process_pass().await.map(|v| v.len()),
        5 => m.payouts.reconcile_pass().await.map(|v| v.len()),
        6 => m.payouts.recheck_pass().await.map(|v| v.len()),
        7 => m.funding.process_pass().await.map(|v| v.len()),
        8 => m.funding.reconcile_pass().await.map(|v| v.len()),
        9 => m.funding.recheck_pass().await.map(|v| v.len()),
        _ => {
            // Its answers are checked as they come; a broken rule ends the run at this step.
            if let Err(what) = w.hooks.pass(&mut w.tape, &m.store).await {
                w.tape.broken.push(what);
            }
            Ok(0)
        }
    };
    w.answer(&format!("pass {which}"), r.as_ref().map(|n| *n));
    w.touched_all = true;
}

/// A processor's passes in a drain round (the payout and the funding processor alike); returns how
/// many jobs they moved. Its reconcile and re-check passes read one job each, so each runs once per
/// job that may need it (`reconciles`: unknown ones; `rechecks`: those the re-check reads) and a few
/// more, for their cursors to come round; the re-check only once the work has stopped.
async fn drain_rail<R: settle_worker::processor::Rail>(
    p: &settle_worker::processor::Processor<R>,
    (reconciles, rechecks): (usize, usize),
    recheck: bool,
) -> usize {
    let mut moved = 0;
    for _ in 0..50 {
        match p.process_pass().await {
            Ok(v) if !v.is_empty() => moved += v.len(),
            _ => break,
        }
    }
    for _ in 0..reconciles + 1 {
        moved += p.reconcile_pass().await.map_or(0, |v| v.len());
    }
    if recheck {
        for _ in 0..rechecks + 3 {
            moved += p.recheck_pass().await.map_or(0, |v| v.len());
        }
    }
    moved
}

/// The load stops; time runs on while the passes run and an honest worker finishes whatever is
/// claimable, until nothing changes; then the end rules (`World::check_end`).
pub async fn drain(w: &mut World, m: &Machine, rig: &Rig) -> Result<(), String> {
    rig.crash.disarm();
    rig.provider.set_down(false);
    // Half the hung requests are carried out as the drain begins, the rest once the work has
    // stopped (every withdrawal in its final state): the re-check must find those Settle gave up on.
    let ran = rig.provider.run_hung(|_| w.chance(50));
    let charged = rig.funding.run_hung(|_| w.chance(50));
    w.trace(&format!("drain: hung sends carried out: {ran}, hung charges: {charged}"));
    let withdrawals = w.jobs.values().filter(|j| j.withdrawal).count();
    let mut quiet = 0;
    for round in 0..30 {
        rig.clock.advance_ms(600_000);
        if quiet == 1 {
            let ran = rig.provider.run_hung(|_| true);
            let charged = rig.funding.run_hung(|_| true);
            w.trace(&format!("drain: the last hung sends carried out: {ran}, charges: {charged}"));
        }
        let _ = m.maintenance.rescue_pass().await;
        let _ = m.maintenance.sweep_pass().await;
        let _ = m.maintenance.expire_pass().await;
        let _ = m.maintenance.reconcile_pass().await;
        let top_ups = m
            .store
            .funding()
            .top_ups(&settle_store::TopUpFilter::default(), settle_store::Page { after: 0, limit: 1_000 })
            .await
            .map_or((0, 0), |p| {
                let count = |f: &dyn Fn(JobState) -> bool| p.rows.iter().filter(|t| f(t.job.state)).count();
                (count(&|s| s == JobState::Unknown), count(&|s| matches!(s, JobState::Dead | JobState::Cancelled)))
            });
        let payouts = drain_rail(&m.payouts, (withdrawals, withdrawals), quiet > 0).await
            + drain_rail(&m.funding, top_ups, quiet > 0).await;
        let req = ClaimRequest {
            worker: WorkerName::parse("drain").expect("a worker"),
            kinds: KINDS.iter().map(|k| JobKind::parse(k).expect("a kind")).collect(),
            labels: Labels::parse(WORKER_LABELS[2], 64).expect("labels"),
            limit: 50,
            lease_seconds: None,
        };
        let claimed = m.store.claim(req).await.map_err(|e| format!("drain claim: {e}"))?;
        let delivered = w.hooks.drain_round(&mut w.tape, &m.store).await?;
        w.trace(&format!(
            "drain round {round}: {} claimed, {payouts} withdrawals moved, {delivered} webhook deliveries",
            claimed.len()
        ));
        // Done once three rounds in a row had nothing left to claim, move or deliver (leases,
        // backoffs and windows have all run out by then).
        quiet = if claimed.is_empty() && payouts == 0 && delivered == 0 { quiet + 1 } else { 0 };
        if quiet == 3 {
            break;
        }
        for c in claimed {
            let id = c.job.id.as_str().to_owned();
            let priced = costs(w, &id, None);
            let r = m.store.succeed_priced(&c.job.id, Reporter::Lease(&c.lease_token), None, &priced).await;
            w.answer(&format!("drain succeed {id}"), r.as_ref().map(|o| o.applied));
        }
        w.touched_all = true;
        w.check(&m.store, (&rig.provider, &rig.funding), &rig.artifacts, false).await?;
    }
    w.check(&m.store, (&rig.provider, &rig.funding), &rig.artifacts, true).await?;
    w.check_end(&m.store, (&rig.provider, &rig.funding)).await
}
