//! How writes reach each engine. An operation is a re-runnable closure over `(db, cx)`; the
//! engines run operations in batches — one transaction, every answer after the COMMIT; no savepoint
//! per operation unless one failed after writing (docs/design/batches-without-savepoints.md) — and
//! differ in who runs the batches:
//! - `sqlite`: one writer thread owning the one connection that writes (rusqlite);
//! - `postgres`: a few lanes, each a task committing batches on a pooled connection, and
//!   single-operation transactions for what may not share one (docs/decisions/0013); `sequencer`
//!   numbers their events after they commit (docs/decisions/0021).

pub(crate) mod postgres;
pub(crate) mod primary;
pub(crate) mod sequencer;
pub(crate) mod sqlite;

use crate::db::Db;
use crate::error::StoreError;
use crate::ops::plan::Intent;
use crate::ops::{CrashHook, Cx, Pending};
use futures_util::future::BoxFuture;
use settle_core::Clock;
use settle_core::backoff::SplitMix64;
use settle_core::job::Policies;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// An operation: run inside a transaction the engine opened; run again (PostgreSQL) after a
/// serialization failure, a deadlock or a lock it was not allowed to wait for.
pub(crate) type OpFn<T> =
    Arc<dyn for<'a, 'c> Fn(&'a mut Db<'c>, &'a Cx) -> BoxFuture<'a, Result<T, StoreError>> + Send + Sync>;

/// How an operation ended inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ran {
    /// Succeeded; its answer waits for the COMMIT.
    Done,
    /// Refused or failed on its own (its error is its answer); rolled back to its savepoint, or, in
    /// a batch without savepoints, having changed nothing (else the batch falls back).
    Failed,
    /// Met a conflict it may not resolve inside the batch (PostgreSQL: a lock wait past the batch's
    /// short lock timeout, a deadlock, a serialization failure, a concurrent create): rolled back to
    /// its savepoint, to run again in a transaction of its own.
    Again,
}

/// How many batches after one that fell back run in careful mode (a savepoint per operation), so a
/// stream of operations that fail after writing costs savepoints, not a second run each
/// (docs/design/batches-without-savepoints.md).
pub(crate) const CAREFUL_BATCHES: u32 = 8;

/// How a batch ended: committed or answered, or rolled back whole because an operation failed
/// after it had written (its own answer is given); the others are left to run again in careful mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batch {
    Ended,
    FellBack,
}

/// An operation that failed after it wrote, in a batch run without savepoints (the transaction is
/// rolled back whole): whether it is answered now with its own outcome, rather than run again with
/// the others in careful mode. Only when that outcome stands on nothing the rollback took away: no
/// operation before it in the batch wrote (`earlier_done` false), or it is no claim about the data
/// at all (an injected crash, a panic — `outcome` `None`). An answer that rests on an earlier
/// operation's rolled-back writes would tell of a state that never committed.
pub(crate) fn answered_now(outcome: Option<Ran>, earlier_done: bool, op: &dyn BatchOp) -> bool {
    !earlier_done || outcome.is_none() || matches!(op.error(), Some(StoreError::InjectedCrash(_)))
}

/// An operation queued for a batch, type-erased.
pub(crate) trait BatchOp: Send {
    /// What the operation will move, if a lane may plan it with others.
    fn intent(&self) -> Option<&Intent>;
    fn run<'a>(&'a mut self, db: &'a mut Db<'_>, cx: &'a Cx) -> BoxFuture<'a, Ran>;
    /// Answers after the batch: its own result if it ran, else `committed`'s error.
    fn deliver(self: Box<Self>, committed: Result<(), StoreError>);
    /// The error its last run ended in, if it did.
    fn error(&self) -> Option<&StoreError>;
    /// The operation to run again in a transaction of its own (PostgreSQL), its answer type
    /// erased: the closure keeps the last run's answer, and `Answer` sends it once that
    /// transaction has ended (the run's answer if it committed, else the transaction's error).
    fn alone(self: Box<Self>) -> (OpFn<()>, Answer);
}

/// Sends an operation's answer once the transaction it ran alone in has ended.
pub(crate) type Answer = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

pub(crate) struct Op<T> {
    pub f: OpFn<T>,
    pub intent: Option<Intent>,
    pub out: Option<Result<T, StoreError>>,
    pub reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send + 'static> Op<T> {
    pub fn boxed(f: OpFn<T>, intent: Option<Intent>) -> (Box<dyn BatchOp>, oneshot::Receiver<Result<T, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Box::new(Op { f, intent, out: None, reply }), answer)
    }
}

impl<T: Send + 'static> BatchOp for Op<T> {
    fn intent(&self) -> Option<&Intent> {
        self.intent.as_ref()
    }

    fn run<'a>(&'a mut self, db: &'a mut Db<'_>, cx: &'a Cx) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
            // A run after a rolled-back one (a batch that fell back) answers with its own result
            // only: a panic leaves none.
            self.out = None;
            let f = self.f.clone();
            match f(db, cx).await {
                Ok(v) => {
                    self.out = Some(Ok(v));
                    Ran::Done
                }
                Err(e) => {
                    let again = matches!(e, StoreError::Retryable(_) | StoreError::Busy(_));
                    self.out = Some(Err(e));
                    if again { Ran::Again } else { Ran::Failed }
                }
            }
        })
    }

    fn deliver(self: Box<Self>, committed: Result<(), StoreError>) {
        let answer = match (self.out, committed) {
            (Some(Err(own)), _) => Err(own),
            (Some(Ok(v)), Ok(())) => Ok(v),
            (_, Err(e)) => Err(e),
            (None, Ok(())) => Err(StoreError::internal("operation never ran")),
        };
        let _ = self.reply.send(answer);
    }

    fn error(&self) -> Option<&StoreError> {
        match &self.out {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }

    fn alone(self: Box<Self>) -> (OpFn<()>, Answer) {
        // Each run (the transaction may run it again) leaves its answer here; the committed run's
        // is the one sent.
        let last: Arc<Mutex<Option<T>>> = Arc::default();
        let (f, kept) = (self.f, last.clone());
        let run: OpFn<()> = Arc::new(move |db: &mut Db<'_>, cx: &Cx| -> BoxFuture<'_, Result<(), StoreError>> {
            let (f, kept) = (f.clone(), kept.clone());
            Box::pin(async move {
                let v = f(db, cx).await?;
                *kept.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
                Ok(())
            })
        });
        let reply = self.reply;
        let answer: Answer = Box::new(move |ended: Result<(), StoreError>| {
            let answer = ended.and_then(|()| {
                last.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .ok_or_else(|| StoreError::internal("operation committed without an answer"))
            });
            let _ = reply.send(answer);
        });
        (run, answer)
    }
}

/// What the engines need to build each operation's context.
#[derive(Clone)]
pub(crate) struct Env {
    pub clock: Arc<dyn Clock>,
    pub policy: Arc<Policies>,
    pub rng: Arc<Mutex<SplitMix64>>,
    pub crash: Option<Arc<dyn CrashHook>>,
    /// `StoreOptions::token_seed`'s stream, when set.
    pub tokens: Option<Arc<Mutex<SplitMix64>>>,
    pub broken: Option<crate::broken::Guard>,
    pub lines: Arc<Mutex<crate::ops::lines::Lines>>,
}

impl Env {
    /// The context of one operation; `pending` is the PostgreSQL transaction's queue of ledger
    /// lines and events (`None` on SQLite and for reads).
    pub fn cx(&self, pending: Option<Arc<Mutex<Pending>>>) -> Cx {
        Cx {
            now: self.clock.now(),
            policy: self.policy.clone(),
            rng: self.rng.clone(),
            crash: self.crash.clone(),
            tokens: self.tokens.clone(),
            broken: self.broken,
            pending,
            counters: None,
            ahead: Mutex::new(None),
            lines: self.lines.clone(),
            crossings: Mutex::new(Vec::new()),
        }
    }
}
