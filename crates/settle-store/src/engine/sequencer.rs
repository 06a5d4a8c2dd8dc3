//! PostgreSQL: the sequencer, which numbers events after the transactions that wrote them have
//! committed (docs/decisions/0021). Writers put their events in `events` under one stamp per
//! transaction, with a `stamps_pending` row, and take no counter; a pass numbers whole stamps
//! (`stamp_numbers`), gap-free in stamp order, under the `outbox` counter row that only passes take
//! (docs/design/batch-plan.md §4a).
//!
//! One task per process runs the passes, single-flight, on a connection of its own: after a commit
//! of this process that wrote events (`poke`), on a timer for events whose process died between its
//! COMMIT and its pass, and when a reader asks for a round that starts after now (`sync`, which the
//! event feed, webhook fan-out and a job's history call before they read).

use crate::db::Db;
use crate::error::StoreError;
use crate::ops;
use settle_core::limits;
use sqlx::postgres::PgPool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// What the rounds have served: every ticket up to `ok_through` numbered everything committed
/// before it; the newest failed round, which served tickets up to its own, and why.
#[derive(Clone, Debug, Default)]
struct Progress {
    ok_through: u64,
    failed: Option<(u64, Arc<str>)>,
}

pub(crate) struct Sequencer {
    /// A connection of its own, so passes never wait for (or take) one the writers need.
    pool: PgPool,
    /// Tickets handed out: a round that starts after ticket `t` was taken serves it.
    tickets: AtomicU64,
    /// A permit: a poke while a round runs causes another round. Apart from the sequencer, so the
    /// task can wait on it without keeping the store alive.
    poked: Arc<Notify>,
    progress: watch::Sender<Progress>,
    /// This process's event long-polls, woken after a round numbered something.
    events_wake: Arc<Notify>,
    /// Events numbered by this process (a metric).
    pub numbered: AtomicU64,
    /// Told of a pass that met a failover signal.
    primary: Arc<super::primary::Primary>,
}

impl Sequencer {
    pub fn spawn(pool: PgPool, events_wake: Arc<Notify>, primary: Arc<super::primary::Primary>) -> Arc<Sequencer> {
        let poked = Arc::new(Notify::new());
        let s = Arc::new(Sequencer {
            pool,
            tickets: AtomicU64::new(0),
            poked: poked.clone(),
            progress: watch::Sender::new(Progress::default()),
            events_wake,
            numbered: AtomicU64::new(0),
            primary,
        });
        tokio::spawn(run(Arc::downgrade(&s), poked));
        s
    }

    /// Events of this process have committed: number them soon.
    pub fn poke(&self) {
        self.tickets.fetch_add(1, Ordering::SeqCst);
        self.poked.notify_one();
    }

    /// Returns once a round that began after this call has numbered every event committed before
    /// it (read-your-writes for the feed), or with that round's error.
    pub async fn sync(&self) -> Result<(), StoreError> {
        let ticket = self.tickets.fetch_add(1, Ordering::SeqCst) + 1;
        self.poked.notify_one();
        let mut rx = self.progress.subscribe();
        let wait = Duration::from_millis(limits::SEQUENCER_SYNC_WAIT_MS);
        let served = tokio::time::timeout(
            wait,
            rx.wait_for(|p| p.ok_through >= ticket || p.failed.as_ref().is_some_and(|(t, _)| *t >= ticket)),
        )
        .await
        .map_err(|_| StoreError::Unavailable("the event sequencer did not answer in time".into()))?
        .map_err(|_| StoreError::Unavailable("the event sequencer has stopped".into()))?
        .clone();
        match served.failed {
            Some((_, e)) if served.ok_through < ticket => {
                Err(StoreError::Unavailable(format!("numbering events failed: {e}")))
            }
            _ => Ok(()),
        }
    }

    /// One round: every event visible when it starts (each committed before it) numbered. It takes
    /// the newest visible stamp first, then runs passes — each moving whole stamps in stamp order —
    /// until one moved that stamp or was not full. It ends however fast commits keep coming: later
    /// stamps are the next round's.
    async fn round(&self) -> Result<(), StoreError> {
        let newest: Option<i64> =
            sqlx::query_scalar("SELECT MAX(stamp) FROM stamps_pending").fetch_one(&self.pool).await?;
        let Some(newest) = newest else { return Ok(()) };
        loop {
            let n = self.pass().await?;
            if n.stamps < limits::SEQUENCER_STAMPS_MAX || n.last_stamp.is_none_or(|last| last >= newest) {
                return Ok(());
            }
        }
    }

    /// One pass in a transaction of its own (a short lock timeout: another process's pass holds the
    /// counter only briefly), then the wake-ups — after COMMIT and in statements of their own, so a
    /// full notification queue can never stop the numbering.
    async fn pass(&self) -> Result<ops::Numbered, StoreError> {
        // Closed, not returned, unless the pass ends cleanly (a round given up mid-flight included).
        let mut conn = super::primary::Leased::acquire(&self.pool).await?;
        // The COMMIT may wait for a synchronous standby: never cancelled (docs/decisions/0024). Sent
        // with the BEGIN, in one round trip.
        let begin =
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '2s'; SET LOCAL statement_timeout = 0";
        let mut tx = sqlx::Connection::begin_with(&mut *conn, begin).await?;
        let numbered = {
            let mut db = Db::pg(&mut tx);
            ops::number_events(&mut db, limits::SEQUENCER_STAMPS_MAX).await?
        };
        tx.commit().await.map_err(StoreError::from_commit)?;
        conn.clean();
        drop(conn);
        if numbered.events > 0 {
            self.numbered.fetch_add(numbered.events as u64, Ordering::Relaxed);
            self.events_wake.notify_waiters();
            let notify = if numbered.wakes_claims {
                "SELECT pg_notify('settle_events', ''), pg_notify('settle_wake', '')"
            } else {
                "SELECT pg_notify('settle_events', '')"
            };
            if let Err(e) = sqlx::query(notify).execute(&self.pool).await {
                tracing::warn!(error = %e, "cannot NOTIFY other processes of new events; they find them by polling");
            }
        }
        Ok(numbered)
    }
}

/// The task: a round after each poke, or after `SEQUENCER_IDLE_MS` without one; ends when the store
/// is dropped (it waits holding only the permit, never the store).
async fn run(sequencer: Weak<Sequencer>, poked: Arc<Notify>) {
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(limits::SEQUENCER_IDLE_MS), poked.notified()).await;
        let Some(s) = sequencer.upgrade() else { return };
        let serving = s.tickets.load(Ordering::SeqCst);
        // A round stuck on a half-open connection must not hold every reader of the feed: it is
        // given up (its transaction dropped, so rolled back) and the next round starts afresh.
        let limit = Duration::from_millis(limits::SEQUENCER_SYNC_WAIT_MS);
        let result = match tokio::time::timeout(limit, s.round()).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Unavailable("an event sequencer round took too long".into())),
        };
        let failed = result.is_err();
        s.progress.send_modify(|p| match result {
            Ok(()) => p.ok_through = p.ok_through.max(serving),
            Err(e) => {
                if let StoreError::Unavailable(_) = e {
                    s.primary.signal();
                }
                tracing::warn!(error = %e, "numbering events failed; trying again");
                p.failed = Some((serving, Arc::from(e.to_string())));
            }
        });
        drop(s);
        if failed {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
