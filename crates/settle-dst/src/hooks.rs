//! Webhook delivery, simulated through the store's own fan-out, leases and reports (the HTTP
//! sender needs sockets; docs/decisions/0025 §8): a receiver that takes a send, refuses it, or
//! never answers (the lease lapses), a sender that reports twice or late with a lease it lost; and
//! the auditor's rules for it:
//! - **in order per job**: a delivery is leased only when every earlier event of its line (its
//!   job, or its account for an account's own events) was delivered to the endpoint;
//! - **a lost lease changes nothing**: a report with a token a later lease replaced never takes
//!   effect;
//! - **at least once** (at the end): after the drain — dead deliveries requeued by a person, the
//!   receiver taking everything — every event of the feed was delivered.

use crate::tape::Tape;
use settle_store::{
    BreakerPolicy, DeliveryFilter, DeliveryReport, DeliveryState, Event, LeaseToken, SqlStore, StartFrom, Store,
};
use std::collections::{BTreeMap, BTreeSet};

pub const ENDPOINT: &str = "sim-hook";
const LEASE_MS: u64 = 15_000;
const ATTEMPTS_MAX: u32 = 4;
const BREAKER: BreakerPolicy = BreakerPolicy { failures: 3, open_ms: 2_000, open_ms_max: 30_000 };

/// What the simulated sender and receiver know of the endpoint's deliveries.
#[derive(Debug, Default)]
pub struct Hooks {
    /// Whether this run has an endpoint: half the seeds do (a delivery per event is a write, and
    /// the other half runs faster).
    on: bool,
    /// Every event of the feed read so far, by line (its job, or `account:` and its account).
    lines: BTreeMap<String, Vec<i64>>,
    /// Each event's line.
    line_of: BTreeMap<i64, String>,
    /// How far the feed has been read (it has no gaps: every event up to here is in `lines`).
    feed_read: i64,
    /// Events the receiver took and the store confirmed.
    delivered: BTreeSet<i64>,
    /// Events whose "delivered" report got no answer (a crash): the store may hold it or not.
    uncertain: BTreeSet<i64>,
    /// The newest lease token each event was given.
    newest: BTreeMap<i64, LeaseToken>,
    /// Leases whose sender never reported (a receiver that hung, a sender that died).
    unreported: Vec<(i64, LeaseToken)>,
}

fn line_of(e: &Event) -> String {
    match &e.job_id {
        Some(job) => job.clone(),
        None => format!("account:{}", e.account_id),
    }
}

impl Hooks {
    /// The endpoint begins at the feed's first event, in half the runs.
    pub async fn start(&mut self, t: &mut Tape, store: &SqlStore) {
        self.on = t.chance(50);
        if !self.on {
            return;
        }
        let began = store.webhooks().start(ENDPOINT, StartFrom::Beginning).await;
        t.answer("webhook start", began.as_ref().map(|b| *b));
    }

    /// One pass of the simulated deliverer: fan out, now and then a late report, then a lease of a
    /// few deliveries, each taken, refused or left without an answer.
    pub async fn pass(&mut self, t: &mut Tape, store: &SqlStore) -> Result<(), String> {
        if !self.on {
            return Ok(());
        }
        let fanned = store.webhooks().fan_out(ENDPOINT, 1 + t.pick(20) as u32).await;
        t.answer("webhook fan-out", fanned.as_ref().map(|n| *n));
        if !self.unreported.is_empty() && t.chance(25) {
            let n = t.pick(self.unreported.len());
            let (seq, token) = self.unreported.remove(n);
            self.report(t, store, seq, &token, true).await?;
        }
        let limit = 1 + t.pick(3) as u32;
        let leased = store.webhooks().lease(ENDPOINT, limit, LEASE_MS, ATTEMPTS_MAX, BREAKER).await;
        t.answer("webhook lease", leased.as_ref().map(|d| d.iter().map(|d| d.event.seq).collect::<Vec<_>>()));
        for d in leased.unwrap_or_default() {
            let token = d.lease_token.clone().ok_or("a leased delivery without a token")?;
            self.leased(store, d.event.seq).await?;
            self.newest.insert(d.event.seq, token.clone());
            match t.pick(100) {
                0..60 => {
                    self.report(t, store, d.event.seq, &token, true).await?;
                    if t.chance(10) {
                        self.report(t, store, d.event.seq, &token, true).await?;
                    }
                }
                60..85 => self.report(t, store, d.event.seq, &token, false).await?,
                _ => self.unreported.push((d.event.seq, token)),
            }
        }
        Ok(())
    }

    /// A report, and what the auditor learns from its answer.
    async fn report(
        &mut self,
        t: &mut Tape,
        store: &SqlStore,
        seq: i64,
        token: &LeaseToken,
        took: bool,
    ) -> Result<(), String> {
        let report = if took {
            DeliveryReport::Delivered { status: 200 }
        } else {
            let retry_at = store.now().plus_millis(1_000 + t.rng.below_inclusive(29_000));
            DeliveryReport::Failed {
                status: Some(503),
                error: "unavailable".into(),
                retry_at,
                attempts_max: ATTEMPTS_MAX,
            }
        };
        let r = store.webhooks().report(ENDPOINT, seq, token, report, BREAKER).await;
        t.answer(&format!("webhook report {seq} took={took}"), r.as_ref().map(|a| *a));
        let stale = self.newest.get(&seq) != Some(token);
        match r {
            Ok(true) if stale => Err(format!("a report for event {seq} with a lease a later one replaced took effect")),
            Ok(true) if took => {
                self.delivered.insert(seq);
                Ok(())
            }
            Err(_) if took => {
                self.uncertain.insert(seq);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// A delivery was leased: every earlier event of its line must have been delivered.
    async fn leased(&mut self, store: &SqlStore, seq: i64) -> Result<(), String> {
        if seq > self.feed_read {
            self.read_feed(store).await?;
        }
        let Some(line) = self.line_of.get(&seq).cloned() else {
            return Err(format!("event {seq} was leased for delivery and is not in the feed"));
        };
        let seqs = self.lines[&line].clone();
        for earlier in seqs.into_iter().take_while(|s| *s < seq) {
            if !self.delivered(store, earlier).await? {
                return Err(format!("event {seq} of {line} was leased before event {earlier} of it was delivered"));
            }
        }
        Ok(())
    }

    /// Whether `seq` was delivered: known, or — after a report that got no answer — asked of the store.
    async fn delivered(&mut self, store: &SqlStore, seq: i64) -> Result<bool, String> {
        if self.delivered.contains(&seq) {
            return Ok(true);
        }
        if !self.uncertain.contains(&seq) {
            return Ok(false);
        }
        let filter = DeliveryFilter { endpoint_id: Some(ENDPOINT.into()), state: Some(DeliveryState::Delivered) };
        let page = store.webhooks().deliveries(&filter, seq - 1, 1).await.map_err(|e| format!("deliveries: {e}"))?;
        let yes = page.rows.first().is_some_and(|d| d.event.seq == seq);
        if yes {
            self.uncertain.remove(&seq);
            self.delivered.insert(seq);
        }
        Ok(yes)
    }

    async fn read_feed(&mut self, store: &SqlStore) -> Result<(), String> {
        loop {
            let page = store
                .events(self.feed_read, 500, &settle_core::scope::Scope::ALL)
                .await
                .map_err(|e| format!("events: {e}"))?;
            if page.rows.is_empty() {
                return Ok(());
            }
            for e in &page.rows {
                self.lines.entry(line_of(e)).or_default().push(e.seq);
                self.line_of.insert(e.seq, line_of(e));
                self.feed_read = e.seq;
            }
        }
    }

    /// The drain's part: a person requeues what died, the receiver takes everything; returns how
    /// many deliveries this round made.
    pub async fn drain_round(&mut self, t: &mut Tape, store: &SqlStore) -> Result<usize, String> {
        if !self.on {
            return Ok(0);
        }
        let fanned = store.webhooks().fan_out(ENDPOINT, 1_000).await.map_err(|e| format!("fan-out: {e}"))?;
        let requeued =
            store.webhooks().requeue_dead(ENDPOINT, 1_000, "sim").await.map_err(|e| format!("requeue: {e}"))?;
        t.trace(&format!("webhook drain: fanned {fanned}, requeued {requeued}"));
        let mut made = fanned as usize + requeued as usize;
        loop {
            let leased = store
                .webhooks()
                .lease(ENDPOINT, 50, LEASE_MS, ATTEMPTS_MAX, BREAKER)
                .await
                .map_err(|e| format!("lease: {e}"))?;
            if leased.is_empty() {
                return Ok(made);
            }
            for d in leased {
                let token = d.lease_token.clone().ok_or("a leased delivery without a token")?;
                self.leased(store, d.event.seq).await?;
                self.newest.insert(d.event.seq, token.clone());
                self.report(t, store, d.event.seq, &token, true).await?;
                made += 1;
            }
        }
    }

    /// At least once: every event of the feed was delivered.
    pub async fn check_end(&mut self, store: &SqlStore) -> Result<(), String> {
        if !self.on {
            return Ok(());
        }
        self.read_feed(store).await?;
        let all: Vec<i64> = self.lines.values().flatten().copied().collect();
        for seq in all {
            if !self.delivered(store, seq).await? {
                return Err(format!("event {seq} was never delivered to the endpoint"));
            }
        }
        Ok(())
    }
}
