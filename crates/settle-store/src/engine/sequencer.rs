//! PostgreSQL: the sequencer, which numbers events after the transactions that wrote them have
//! committed (docs/decisions/0021). Writers put their events in `outbox_pending` under one stamp per
//! transaction and take no counter; a pass moves whole stamps into `outbox`, numbered gap-free in
//! stamp order, under the `outbox` counter row that only passes take.
//!
//! One task per process runs the passes, single-flight, on a connection of its own: after a commit
//! of this process that wrote events (`poke`), on a timer for events whose process died between its
//! COMMIT and its pass, and when a reader asks for a pass that starts after now (`sync`, which the
//! event feed, webhook fan-out and a job's history call before they read).

use crate::db::Db;
use crate::error::StoreError;
use crate::ops;
use settle_core::limits;
use sqlx::postgres::PgPool;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// What the newest round of passes served: every ticket up to `ticket`, or its error.
#[derive(Clone, Debug, Default)]
struct Progress {
    ticket: u64,
    failed: Option<Arc<str>>,
}

pub(crate) struct Sequencer {
    /// A connection of its own, so passes never wait for (or take) one the writers need.
    pool: PgPool,
    /// Tickets handed out: a round that starts after ticket `t` was taken serves it.
    tickets: AtomicU64,
    /// A permit: a poke while a round runs causes another round.
    poked: Notify,
    progress: watch::Sender<Progress>,
    /// This process's event long-polls, woken after a round numbered something.
    events_wake: Arc<Notify>,
    /// Events numbered by this process (a metric).
    pub numbered: AtomicU64,
}

impl Sequencer {
    pub fn spawn(pool: PgPool, events_wake: Arc<Notify>) -> Arc<Sequencer> {
        let s = Arc::new(Sequencer {
            pool,
            tickets: AtomicU64::new(0),
            poked: Notify::new(),
            progress: watch::Sender::new(Progress::default()),
            events_wake,
            numbered: AtomicU64::new(0),
        });
        tokio::spawn(run(Arc::downgrade(&s)));
        s
    }

    /// Events of this process have committed: number them soon.
    pub fn poke(&self) {
        self.tickets.fetch_add(1, Ordering::SeqCst);
        self.poked.notify_one();
    }

    /// Returns once a round that began after this call has numbered every event committed before
    /// it (read-your-writes for the feed), or its error.
    pub async fn sync(&self) -> Result<(), StoreError> {
        let ticket = self.tickets.fetch_add(1, Ordering::SeqCst) + 1;
        self.poked.notify_one();
        let mut rx = self.progress.subscribe();
        let served = tokio::time::timeout(
            Duration::from_millis(limits::SEQUENCER_SYNC_WAIT_MS),
            rx.wait_for(|p| p.ticket >= ticket),
        )
        .await
        .map_err(|_| StoreError::Unavailable("the event sequencer did not answer in time".into()))?
        .map_err(|_| StoreError::Unavailable("the event sequencer has stopped".into()))?
        .clone();
        match served.failed {
            None => Ok(()),
            Some(e) => Err(StoreError::Unavailable(format!("numbering events failed: {e}"))),
        }
    }

    /// One round: passes until nothing committed is left pending (at most
    /// `SEQUENCER_PASSES_MAX`, so a round under a constant stream of commits still ends).
    async fn round(&self) -> Result<(), StoreError> {
        for _ in 0..limits::SEQUENCER_PASSES_MAX {
            let n = self.pass().await?;
            if n.stamps < limits::SEQUENCER_STAMPS_MAX {
                return Ok(());
            }
        }
        Ok(())
    }

    /// One pass: nothing written when nothing committed is pending; otherwise one transaction that
    /// numbers up to `SEQUENCER_STAMPS_MAX` whole stamps, then the wake-ups — after COMMIT and in
    /// statements of their own, so a full notification queue can never stop the numbering.
    async fn pass(&self) -> Result<ops::Numbered, StoreError> {
        let pending: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_pending)").fetch_one(&self.pool).await?;
        if !pending {
            return Ok(ops::Numbered::default());
        }
        let mut tx = self.pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await?;
        let numbered = {
            let mut db = Db::Pg(&mut tx);
            ops::number_events(&mut db, limits::SEQUENCER_STAMPS_MAX).await?
        };
        tx.commit().await.map_err(StoreError::from_commit)?;
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

/// The task: a round after each poke, or after `SEQUENCER_IDLE_MS` without one; ends when the store is
/// dropped.
async fn run(sequencer: std::sync::Weak<Sequencer>) {
    loop {
        let Some(s) = sequencer.upgrade() else { return };
        let _ = tokio::time::timeout(Duration::from_millis(limits::SEQUENCER_IDLE_MS), s.poked.notified()).await;
        let serving = s.tickets.load(Ordering::SeqCst);
        let result = s.round().await;
        let failed = match result {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(error = %e, "numbering events failed; trying again");
                Some(Arc::<str>::from(e.to_string()))
            }
        };
        let pause = failed.is_some();
        s.progress.send_replace(Progress { ticket: serving, failed });
        drop(s);
        if pause {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
