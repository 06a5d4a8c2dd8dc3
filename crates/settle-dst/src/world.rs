//! What the simulated clients and workers know, and the auditor's rules (docs/decisions/0025 §4
//! and its review): what `Store::audit` cannot see — each item's states over time, answers to
//! stale tokens, the provider's call log, artifacts left behind a cancel, internal errors.

use crate::fakes::{SimArtifacts, SimFunding, SimProvider, sends_follow_absent_lookups};
pub use crate::sim_job::SimJob;
use crate::tape::Tape;
use settle_core::Credits;
use settle_core::backoff::SplitMix64;
use settle_core::ids::RefId;
use settle_core::ids::{AccountId, FailCode};
use settle_core::item::{ItemSignal, ItemState, RefundReason, arrow};
use settle_core::job::{JobState, Policies, RefundPolicy, RetryPolicy};
use settle_store::{JobFilter, NewAccount, NewGrant, Operators, Page, SYSTEM_ACTOR, SqlStore, Store, StoreError};
use std::collections::{BTreeMap, BTreeSet};

pub const ACCOUNTS: usize = 3;
pub const GRANT: i64 = 10_000;
/// The account that lives on its overdraft (the cash rule's ground).
pub const OWING: &str = "owing";
/// The owing account's terms: a little cash, a trial, and an overdraft it lives on.
const OWING_CASH: i64 = 60;
const OWING_TRIAL: i64 = 100;
const OWING_OVERDRAFT: i64 = 200;

/// The account that starts with a cap (issue 44), and its cap; the kind with one, and its.
pub const CAPPED: &str = "acct0";
pub const ACCOUNT_CAP: i64 = 2;
pub const KIND_CAP: (&str, i64) = ("batch", 3);
/// The balance alerts every funded account carries from the start, spread over what a run spends
/// (a few hundred credits), so its charges, refunds and reclaims cross them both ways (issue 45).
pub const ALERTS: [(&str, i64); 5] =
    [("a40", GRANT - 40), ("a120", GRANT - 120), ("a200", GRANT - 200), ("a300", GRANT - 300), ("a450", GRANT - 450)];

/// The account that carries spend limits from the start (issue 45), and its limits (period,
/// amount, the one kind they are for or every kind): tight enough that a run's creates meet them.
pub const LIMITED: &str = "acct1";
pub const LIMITS: [(settle_core::spend::Period, i64, Option<&str>); 2] =
    [(settle_core::spend::Period::Day, 100, Some("render")), (settle_core::spend::Period::Month, 300, None)];

/// The account with an auto top-up rule from the start (issue 45): under `GRANT − 60` it buys 60,
/// at most 480 a month — so a run crosses it often, meets the month's maximum, and, when a charge
/// is declined, pauses it.
pub const RULED: &str = "acct2";

fn rule() -> settle_store::NewAutoTopUp {
    settle_store::NewAutoTopUp {
        below: GRANT - 60,
        credits: Credits::new(60),
        price: 59,
        currency: settle_core::currency::Currency::parse("EUR").expect("a currency"),
        customer: settle_core::ids::Customer::parse("cus_acct2").expect("a customer"),
        monthly_credits_max: 480,
    }
}

/// Short leases and backoffs, so a few hundred steps of simulated time see them run out; a cap on
/// the kind `batch`.
pub fn policies() -> Policies {
    let default =
        RetryPolicy { attempts_max: 3, lease_seconds: 30, confirm_window_seconds: 120, ..RetryPolicy::default() };
    let withdrawal = RetryPolicy { refund_on: RefundPolicy::FinalFailure, lease_seconds: 60, ..default.clone() };
    let top_up = withdrawal.clone();
    let batch = RetryPolicy { max_running: Some(KIND_CAP.1), ..default.clone() };
    Policies {
        default,
        kinds: [("withdrawal".to_owned(), withdrawal), ("top_up".to_owned(), top_up), (KIND_CAP.0.to_owned(), batch)]
            .into_iter()
            .collect(),
    }
}

pub struct World {
    /// The random stream, the trace and the rules answers broke.
    pub tape: Tape,
    pub accounts: Vec<String>,
    pub jobs: BTreeMap<String, SimJob>,
    pub next_id: u64,
    /// Jobs a step may have moved; every job after a pass or a crash.
    pub touched: BTreeSet<String>,
    pub touched_all: bool,
    /// Accounts a step may have moved money on (`moved`, a grant).
    pub touched_accounts: BTreeSet<String>,
    /// The auditor's own account of each balance (`money`).
    pub books: crate::money::Books,
    /// What the simulated webhook sender knows (`hooks`).
    pub hooks: crate::hooks::Hooks,
    /// How much of the payout and funding providers' logs `check` has read.
    provider_read: usize,
    funding_read: usize,
    /// The top-ups whose grants are in the books.
    bought: BTreeSet<String>,
    /// Each account's cap as the simulated admin last set it.
    pub caps: BTreeMap<String, Option<i64>>,
}

impl World {
    pub fn new(rng: SplitMix64) -> World {
        World {
            tape: Tape::new(rng),
            accounts: Vec::new(),
            jobs: BTreeMap::new(),
            next_id: 0,
            touched: BTreeSet::new(),
            touched_all: false,
            touched_accounts: BTreeSet::new(),
            books: crate::money::Books::default(),
            hooks: crate::hooks::Hooks::default(),
            provider_read: 0,
            funding_read: 0,
            bought: BTreeSet::new(),
            caps: BTreeMap::new(),
        }
    }

    pub fn trace(&mut self, line: &str) {
        self.tape.trace(line);
    }

    pub fn pick(&mut self, n: usize) -> usize {
        self.tape.pick(n)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.tape.chance(percent)
    }

    pub fn fresh_id(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}{}", self.next_id)
    }

    /// The accounts, each with a grant that never expires.
    pub async fn setup(&mut self, store: &SqlStore) {
        self.hooks.start(&mut self.tape, store).await;
        for n in 0..ACCOUNTS {
            let id = format!("acct{n}");
            let account = AccountId::parse(&id).expect("an account id");
            let cap = (id == CAPPED).then_some(ACCOUNT_CAP);
            let made = store
                .create_account(
                    NewAccount { id: account.clone(), overdraft_limit: Credits::ZERO, max_running: cap },
                    SYSTEM_ACTOR,
                )
                .await;
            self.answer("setup account", made.as_ref().map(|_| ()));
            self.caps.insert(id.clone(), cap);
            let grant = NewGrant {
                id: RefId::parse(&format!("g{n}")).expect("a ref id"),
                amount: Credits::new(GRANT),
                reason: None,
                expires_at: None,
                priority: None,
            };
            let granted = store.grant(&account, grant, SYSTEM_ACTOR).await;
            self.answer("setup grant", granted.as_ref().map(|_| ()));
            if granted.is_ok() {
                self.books.granted(&id, GRANT);
            }
            let alerts = ALERTS.iter().map(|(a, below)| (a.to_string(), *below)).collect();
            let set = store.set_alerts(&account, alerts, SYSTEM_ACTOR).await;
            self.answer("setup alerts", set.as_ref().map(|_| ()));
            if id == RULED {
                let put = store.funding().put_auto_top_up(&account, rule(), SYSTEM_ACTOR).await;
                self.answer("setup rule", put.as_ref().map(|_| ()));
            }
            if id == LIMITED {
                let limits = LIMITS
                    .iter()
                    .map(|(period, amount, kind)| settle_store::NewLimit {
                        period: *period,
                        amount: *amount,
                        kinds: kind.iter().map(|k| (*k).to_owned()).collect(),
                    })
                    .collect();
                let set = store.set_limits(&account, limits, SYSTEM_ACTOR).await;
                self.answer("setup limits", set.as_ref().map(|_| ()));
            }
            self.accounts.push(id);
        }
        self.setup_in_debt(store).await;
    }

    /// One more account that lives on its overdraft: a little cash, a trial that outlasts the run,
    /// room to owe — the ground the cash rule stands on (semantics §1, L6): its withdrawals must
    /// never let the trial cover what the overdraft lent.
    async fn setup_in_debt(&mut self, store: &SqlStore) {
        let id = OWING.to_owned();
        let account = AccountId::parse(&id).expect("an account id");
        let made = store
            .create_account(
                NewAccount { id: account.clone(), overdraft_limit: Credits::new(OWING_OVERDRAFT), max_running: None },
                SYSTEM_ACTOR,
            )
            .await;
        self.answer("setup account", made.as_ref().map(|_| ()));
        let trial_ends = store.now().plus_seconds(7 * 24 * 3600);
        for (grant, amount, expires_at, priority) in
            [("owing-cash", OWING_CASH, None, None), ("owing-trial", OWING_TRIAL, Some(trial_ends), Some(90))]
        {
            let req = NewGrant {
                id: RefId::parse(grant).expect("a ref id"),
                amount: Credits::new(amount),
                reason: None,
                expires_at,
                priority,
            };
            let granted = store.grant(&account, req, SYSTEM_ACTOR).await;
            self.answer("setup grant", granted.as_ref().map(|_| ()));
            if granted.is_ok() {
                self.books.granted(&id, amount);
            }
        }
        self.accounts.push(id);
    }

    pub fn answer<T: std::fmt::Debug>(&mut self, what: &str, result: Result<T, &StoreError>) {
        self.tape.answer(what, result);
    }

    /// A step sent `job` a signal that may move money: its items and its account's balance are
    /// checked after the step.
    pub fn moved(&mut self, job: String) {
        if let Some(j) = self.jobs.get(&job) {
            self.touched_accounts.insert(j.account.clone());
        }
        self.touched.insert(job);
    }

    /// After a crash: the workers died with the process, so they hold no lease now; the tokens stay
    /// known (a late report may still come from a machine that outlived it).
    pub fn after_crash(&mut self) {
        self.touched_all = true;
    }

    /// The auditor, after each step: the rules the step's answers broke; every touched job's items
    /// moved only along the item machine, an item a worker failed never reclaimed, a cancelled job
    /// left no artifact; every send of a key came right after a lookup that found it absent; and
    /// with `full`, the store's own audit (L1–L9).
    pub async fn check(
        &mut self,
        store: &SqlStore,
        (provider, funding): (&SimProvider, &SimFunding),
        artifacts: &SimArtifacts,
        full: bool,
    ) -> Result<(), String> {
        if let Some(b) = self.tape.broken.first() {
            return Err(b.clone());
        }
        // The accounts whose balances the step may have moved: every one after a pass or a crash.
        let mut accounts = std::mem::take(&mut self.touched_accounts);
        let all = self.touched_all || full;
        if all {
            accounts.extend(self.accounts.iter().cloned());
        }
        self.check_jobs(store, artifacts).await?;
        self.check_provider(provider, funding)?;
        // Only the funding processor's passes (and the drain's) confirm charges: a step without
        // one granted nothing, and listing every top-up at every step doubled a seed's time.
        if all {
            self.count_bought(store, funding).await?;
            accounts.extend(std::mem::take(&mut self.touched_accounts));
        }
        self.books.check(&self.jobs, store, &accounts).await?;
        if full {
            let report = store.audit(None).await.map_err(|e| format!("audit: {e}"))?;
            if !report.ok() {
                return Err(format!("audit: {:?}", report.violations));
            }
            // The audit from the last check's checkpoint agrees (decision 0040): a job moved
            // without a line or an event naming it would leave the sums it takes by difference
            // short of what the accounts hold.
            let run = settle_store::AuditRun { from_checkpoint: true, record: true };
            let from = store.audit_with(run, None).await.map_err(|e| format!("audit from the checkpoint: {e}"))?;
            if !from.ok() {
                return Err(format!("audit from the checkpoint: {:?}", from.violations));
            }
            if let Some(Err(why)) = &from.checkpoint.recorded {
                return Err(format!("audit from the checkpoint: not recorded: {why}"));
            }
        }
        Ok(())
    }

    /// The jobs a step may have moved: every job (one listing) after a pass or a crash, else those
    /// it touched (a read each). A job whose create never committed is not there.
    async fn moved_jobs(&mut self, store: &SqlStore) -> Result<Vec<settle_store::Job>, String> {
        let mut jobs = Vec::new();
        if std::mem::take(&mut self.touched_all) {
            self.touched.clear();
            let mut after = 0;
            loop {
                let page = store
                    .jobs(&JobFilter::ALL, Page { after, limit: 500 })
                    .await
                    .map_err(|e| format!("list jobs: {e}"))?;
                jobs.extend(page.rows);
                match page.next_after {
                    Some(n) => after = n,
                    None => return Ok(jobs),
                }
            }
        }
        for id in std::mem::take(&mut self.touched) {
            match store.job(&settle_core::ids::JobId::parse(&id).expect("a job id")).await {
                Ok(j) => jobs.push(j),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(format!("read job {id}: {e}")),
            }
        }
        Ok(jobs)
    }

    async fn check_jobs(&mut self, store: &SqlStore, artifacts: &SimArtifacts) -> Result<(), String> {
        for job in self.moved_jobs(store).await? {
            let id = job.id.as_str().to_owned();
            let Some(sim) = self.jobs.get_mut(&id) else { continue };
            for item in &job.items {
                let now = (item.state, item.refund_reason);
                let key = item.id.as_str().to_owned();
                if let Some(&(before, _)) = sim.seen.get(&key)
                    && before != now.0
                    && !reachable(before, now.0)
                {
                    return Err(format!("job {id} item {key} moved {before:?} → {:?}", now.0));
                }
                if now.0 == ItemState::Reclaimed
                    && !sim.item_succeeded.contains(&key)
                    && sim
                        .seen
                        .get(&key)
                        .is_some_and(|s| s.0 == ItemState::Refunded && s.1 == Some(RefundReason::ItemFailed))
                {
                    return Err(format!("job {id} item {key}: a worker failed it, and a job success reclaimed it"));
                }
                sim.costs.insert(key.clone(), item.cost.get());
                sim.seen.insert(key, now);
            }
            // A cancel accepted while the job ran wins over any success after it (spec §3: completion
            // is conditional on no cancel request) — unless the job holds its refunds to the final
            // failure, whose money may have left.
            if sim.cancel_accepted && !sim.final_failure && !sim.withdrawal && job.state == JobState::Succeeded {
                return Err(format!("job {id} succeeded after its cancel was accepted"));
            }
            // A cancel deletes what was made for items not delivered; a delivered item keeps its.
            if job.state == JobState::Cancelled {
                let undelivered = |item: &str| {
                    job.items
                        .iter()
                        .any(|i| i.id.as_str() == item && matches!(i.state, ItemState::Cancelled | ItemState::Refunded))
                };
                if let Some((_, left)) =
                    sim.artifacts.iter().find(|(item, path)| undelivered(item) && artifacts.has(path))
                {
                    return Err(format!(
                        "job {id} is cancelled and its artifact {left} of an undelivered item is still there"
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_provider(&mut self, provider: &SimProvider, funding: &SimFunding) -> Result<(), String> {
        self.provider_read = sends_follow_absent_lookups(&provider.log(), self.provider_read, "payout")?;
        self.funding_read = sends_follow_absent_lookups(&funding.log(), self.funding_read, "funding")?;
        Ok(())
    }

    /// The credits each top-up granted, into the auditor's books: only a key the funding provider
    /// charged may be granted, and each once (issue 45).
    async fn count_bought(&mut self, store: &SqlStore, funding: &SimFunding) -> Result<(), String> {
        let charged = funding.charged();
        let mut after = 0;
        loop {
            let page = store
                .funding()
                .top_ups(&settle_store::TopUpFilter::default(), Page { after, limit: 500 })
                .await
                .map_err(|e| format!("list top-ups: {e}"))?;
            for t in &page.rows {
                let id = t.job.id.as_str().to_owned();
                if t.grant_id.is_none() || self.bought.contains(&id) {
                    continue;
                }
                if charged.get(&t.idempotency_key) != Some(&t.price) {
                    return Err(format!("top-up {id} granted {} credits without a charge of its key", t.credits.get()));
                }
                self.books.granted(t.job.account_id.as_str(), t.credits.get());
                self.touched_accounts.insert(t.job.account_id.as_str().to_owned());
                self.bought.insert(id);
            }
            match page.next_after {
                Some(n) => after = n,
                None => return Ok(()),
            }
        }
    }

    /// Top-ups after the drain: every key the funding provider charged was granted (a late charge
    /// too), and the auto rule made no top-up after one of its own died (a declined card is never
    /// charged in a loop).
    async fn check_top_ups(&mut self, store: &SqlStore, funding: &SimFunding) -> Result<(), String> {
        self.count_bought(store, funding).await?;
        let filter = settle_store::TopUpFilter::default();
        let all = store.funding().top_ups(&filter, Page { after: 0, limit: 1_000 }).await.map_err(|e| e.to_string())?;
        if all.next_after.is_some() {
            return Err("more than a page of top-ups: the end check would not read them all".into());
        }
        for key in funding.charged().keys() {
            match all.rows.iter().find(|t| &t.idempotency_key == key) {
                Some(t) if t.grant_id.is_some() => {}
                other => return Err(format!("the funding provider charged {key}, but {other:?} granted nothing")),
            }
        }
        let mut died = None;
        for t in all.rows.iter().filter(|t| t.rule) {
            if let Some(dead) = &died {
                return Err(format!("the rule made {} after its top-up {dead} died", t.job.id.as_str()));
            }
            if t.job.state == JobState::Dead {
                died = Some(t.job.id.as_str().to_owned());
            }
        }
        Ok(())
    }

    /// Liveness, after the drain: every job terminal or `unknown`; every withdrawal that succeeded
    /// was executed by the provider once with its amount, and none that did not succeed was; the
    /// event feed is numbered 1, 2, 3, … with no gap.
    pub async fn check_end(
        &mut self,
        store: &SqlStore,
        (provider, funding): (&SimProvider, &SimFunding),
    ) -> Result<(), String> {
        let mut after = 0;
        loop {
            let page = store.jobs(&JobFilter::ALL, Page { after, limit: 500 }).await.map_err(|e| e.to_string())?;
            for job in &page.rows {
                if !job.state.is_terminal() && job.state != JobState::Unknown {
                    return Err(format!("job {} is still {:?} after the drain", job.id.as_str(), job.state));
                }
            }
            match page.next_after {
                Some(n) => after = n,
                None => break,
            }
        }
        self.check_withdrawals(store, provider).await?;
        self.check_top_ups(store, funding).await?;
        self.check_alerts(store).await?;
        self.check_limits(store).await?;
        self.hooks.check_end(store).await?;
        let mut next = 1;
        loop {
            let page = store.events(next - 1, 500, &settle_core::scope::Scope::ALL).await.map_err(|e| e.to_string())?;
            if page.rows.is_empty() {
                break;
            }
            for e in &page.rows {
                if e.seq != next {
                    return Err(format!("the event feed skips from {} to {}", next - 1, e.seq));
                }
                next += 1;
            }
        }
        Ok(())
    }
}

impl World {
    /// Balance alerts (issue 45): each funded account's `account.balance_low` and
    /// `account.balance_recovered` events, in feed order, are exactly the crossings of `ALERTS` its
    /// ledger shows after the setup grant (each line's balance against each alert's side, starting
    /// above all of them), each naming the entry that crossed.
    async fn check_alerts(&self, store: &SqlStore) -> Result<(), String> {
        use settle_core::history::EventKind;
        let mut fired: BTreeMap<String, Vec<(EventKind, String, i64, i64)>> = BTreeMap::new();
        let mut after = 0;
        loop {
            let page = store.events(after, 500, &settle_core::scope::Scope::ALL).await.map_err(|e| e.to_string())?;
            let Some(last) = page.rows.last() else { break };
            after = last.seq;
            for e in page
                .rows
                .iter()
                .filter(|e| matches!(e.kind, EventKind::AccountBalanceLow | EventKind::AccountBalanceRecovered))
            {
                let d: serde_json::Value = serde_json::from_str(&e.data).map_err(|err| err.to_string())?;
                let field = |k: &str| d[k].as_i64().unwrap_or(i64::MIN);
                let alert = d["alert"].as_str().unwrap_or_default().to_owned();
                fired.entry(e.account_id.clone()).or_default().push((
                    e.kind,
                    alert,
                    field("balance_after"),
                    field("ledger_seq"),
                ));
            }
        }
        // The owing account carries no alerts: none may fire there.
        if let Some(stray) = fired.remove(OWING) {
            return Err(format!("account {OWING} has no alerts, yet fired {stray:?}"));
        }
        for account in self.accounts.iter().filter(|a| a.as_str() != OWING) {
            let id = AccountId::parse(account).expect("an account id");
            let mut above = [true; ALERTS.len()];
            let mut want = Vec::new();
            let mut after = 0;
            loop {
                let page = store.ledger(&id, Page { after, limit: 500 }).await.map_err(|e| e.to_string())?;
                for e in page.rows.iter().filter(|e| e.account_seq > 1) {
                    let balance = e.balance_after.get();
                    // Falling: the highest threshold first; rising: the lowest (ALERTS runs high to low).
                    let order: Vec<usize> = if e.amount.is_negative() {
                        (0..ALERTS.len()).collect()
                    } else {
                        (0..ALERTS.len()).rev().collect()
                    };
                    for i in order {
                        let (alert, below) = ALERTS[i];
                        let kind = match above[i] {
                            true if balance < below => EventKind::AccountBalanceLow,
                            false if balance >= below => EventKind::AccountBalanceRecovered,
                            _ => continue,
                        };
                        above[i] = !above[i];
                        want.push((kind, alert.to_owned(), balance, e.seq));
                    }
                }
                match page.next_after {
                    Some(n) => after = n,
                    None => break,
                }
            }
            let got = fired.remove(account).unwrap_or_default();
            if got != want {
                return Err(format!(
                    "account {account}'s alert events {got:?} are not its ledger's crossings {want:?}"
                ));
            }
        }
        Ok(())
    }

    /// Spend limits (issue 45): walking the limited account's ledger in order, with each line's job
    /// kind and date, every create's charge (a job's charge lines, posted together) left each
    /// limit covering its kind at or under its amount in the line's period — only reclaims may
    /// take a period over (the work was delivered), and no create may pass after them.
    async fn check_limits(&self, store: &SqlStore) -> Result<(), String> {
        use settle_core::ledger::EntryKind;
        use settle_core::spend::{self, counts};
        let id = AccountId::parse(LIMITED).expect("an account id");
        let mut entries = Vec::new();
        let mut after = 0;
        loop {
            let page = store.ledger(&id, Page { after, limit: 500 }).await.map_err(|e| e.to_string())?;
            entries.extend(page.rows);
            match page.next_after {
                Some(n) => after = n,
                None => break,
            }
        }
        let mut kinds: BTreeMap<String, String> = BTreeMap::new();
        for job in entries.iter().filter_map(|e| e.job_id.clone()) {
            if let std::collections::btree_map::Entry::Vacant(slot) = kinds.entry(job) {
                let j = store.job(&settle_core::ids::JobId::parse(slot.key()).expect("a job id")).await;
                slot.insert(j.map_err(|e| e.to_string())?.kind.as_str().to_owned());
            }
        }
        // (limit, period start) → the net spent so far.
        let mut spent: BTreeMap<(usize, i64), i64> = BTreeMap::new();
        for (i, e) in entries.iter().enumerate() {
            let Some(job) = &e.job_id else { continue };
            if !counts(e.kind) {
                continue;
            }
            let kind = &kinds[job];
            for (l, (period, amount, only)) in LIMITS.iter().enumerate() {
                let named: Vec<String> = only.iter().map(|k| (*k).to_owned()).collect();
                if !spend::covers(&named, kind) {
                    continue;
                }
                let at = (l, period.start(e.created_at).micros());
                let total = spent.entry(at).or_default();
                *total -= e.amount.get();
                // A create's charge ends where the next line is not a charge of the same job.
                let next = entries.get(i + 1);
                let ends = e.kind == EntryKind::Charge
                    && next.is_none_or(|n| n.kind != EntryKind::Charge || n.job_id.as_ref() != Some(job));
                if ends && *total > *amount {
                    return Err(format!(
                        "account {LIMITED}'s create {job} ({kind}) took its {} limit of {amount} to {total} (entry {})",
                        period.as_str(),
                        e.seq
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every withdrawal against the provider's book, after the drain:
    /// - succeeded: executed once, with its amount;
    /// - executed but dead (a hung send carried out after a definitive refusal): the re-check found
    ///   it — its txid recorded and the refunded amount taken back, so it costs its amount;
    /// - executed but cancelled: a `withdrawal.late_execution` event tells a person (decision
    ///   0010 §8: a cancelled withdrawal cannot be booked as a success);
    /// - not executed: never succeeded.
    async fn check_withdrawals(&mut self, store: &SqlStore, provider: &SimProvider) -> Result<(), String> {
        let executed = provider.executed();
        let ids: Vec<String> = self.jobs.iter().filter(|(_, j)| j.withdrawal).map(|(id, _)| id.clone()).collect();
        for id in &ids {
            let job_id = settle_core::ids::JobId::parse(id).expect("an id");
            let Ok(w) = store.payouts().withdrawal(&job_id).await else { continue };
            let paid = executed.get(&w.idempotency_key);
            if paid.is_some_and(|p| *p != w.amount.get()) {
                return Err(format!("withdrawal {id}: the provider executed {paid:?}, not {}", w.amount.get()));
            }
            let item = w.job.items.first().map(|i| i.state);
            if paid.is_some() && matches!(w.job.state, JobState::Dead | JobState::Cancelled) {
                self.trace(&format!("withdrawal {id}: {:?} and executed after all", w.job.state));
            }
            match (w.job.state, paid.is_some()) {
                (JobState::Succeeded, false) => {
                    return Err(format!("withdrawal {id} succeeded and the provider never executed it"));
                }
                (JobState::Dead, true)
                    if w.provider_txid.is_none()
                        || !matches!(item, Some(ItemState::Reclaimed | ItemState::Succeeded)) =>
                {
                    return Err(format!(
                        "withdrawal {id} is dead, the provider executed it, and the re-check did not take \
                         it back (txid {:?}, item {item:?})",
                        w.provider_txid
                    ));
                }
                (JobState::Cancelled, true) => {
                    let history = store.job_history(&job_id).await.map_err(|e| format!("history of {id}: {e}"))?;
                    if !history
                        .events
                        .iter()
                        .any(|e| e.kind == settle_core::history::EventKind::WithdrawalLateExecution)
                    {
                        return Err(format!(
                            "withdrawal {id} is cancelled and was executed, with no late_execution event"
                        ));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Whether the item machine leads from `from` to `to` in one or more arrows.
fn reachable(from: ItemState, to: ItemState) -> bool {
    let mut seen = vec![from];
    let mut i = 0;
    while i < seen.len() {
        for signal in ItemSignal::ALL {
            if let Some(a) = arrow(seen[i], signal)
                && !seen.contains(&a.to)
            {
                seen.push(a.to);
            }
        }
        i += 1;
    }
    seen[1..].contains(&to)
}

/// A fail code the simulated workers use.
pub fn code(c: &str) -> FailCode {
    FailCode::parse(c).expect("a fail code")
}
