//! How writes reach each engine. An operation is a re-runnable closure over `(db, cx)`; the
//! engines run operations in batches — one transaction, a savepoint each, every answer after the
//! COMMIT — and differ in who runs the batches:
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
    /// Refused or failed on its own (its error is its answer); rolled back to its savepoint.
    Failed,
    /// Met a conflict it may not resolve inside the batch (PostgreSQL: a lock wait past the batch's
    /// short lock timeout, a deadlock, a serialization failure, a concurrent create): rolled back to
    /// its savepoint, to run again in a transaction of its own.
    Again,
}

/// An operation queued for a batch, type-erased.
pub(crate) trait BatchOp: Send {
    fn run<'a>(&'a mut self, db: &'a mut Db<'_>, cx: &'a Cx) -> BoxFuture<'a, Ran>;
    /// Answers after the batch: its own result if it ran, else `committed`'s error.
    fn deliver(self: Box<Self>, committed: Result<(), StoreError>);
    /// The operation to run again in a transaction of its own (PostgreSQL), its answer type
    /// erased: the closure keeps the last run's answer, and `Answer` sends it once that
    /// transaction has ended (the run's answer if it committed, else the transaction's error).
    fn alone(self: Box<Self>) -> (OpFn<()>, Answer);
}

/// Sends an operation's answer once the transaction it ran alone in has ended.
pub(crate) type Answer = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

pub(crate) struct Op<T> {
    pub f: OpFn<T>,
    pub out: Option<Result<T, StoreError>>,
    pub reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send + 'static> Op<T> {
    pub fn boxed(f: OpFn<T>) -> (Box<dyn BatchOp>, oneshot::Receiver<Result<T, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        (Box::new(Op { f, out: None, reply }), answer)
    }
}

impl<T: Send + 'static> BatchOp for Op<T> {
    fn run<'a>(&'a mut self, db: &'a mut Db<'_>, cx: &'a Cx) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
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
        }
    }
}
