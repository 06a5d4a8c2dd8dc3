//! Creating a job: validated, fingerprinted for create-by-id replays, its items inserted and charged
//! one ledger line each, in one transaction with its `job.queued` event.

use super::allocations::Spend;
use super::plan::{TakeAt, check_counts, take_from_head};
use super::{
    BalanceCheck, Cx, Holds, Line, Posting, attach, debits_from_grants, emit, guard_hit, lock_account_job, next_seq,
    post, post_balance, read_job_row,
};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::fingerprint::{Fingerprint, canonical_json};
use settle_core::history::EventKind;
use settle_core::item::ItemState;
use settle_core::job::{self, JobState};
use settle_core::ledger::{AllocationKind, EntryKind};
use settle_core::limits;
use settle_core::{Credits, Timestamp};
use std::sync::LazyLock;

pub(crate) fn job_fingerprint(job: &ValidJob) -> [u8; 32] {
    let req = &job.req;
    let mut f = Fingerprint::new("job")
        .str("id", req.id.as_str())
        .str("account_id", req.account_id.as_str())
        .str("kind", req.kind.as_str())
        .str("payload", &job.payload)
        .opt_i64("max_attempts", req.max_attempts.map(i64::from))
        .opt_str("refund_on", req.refund_on.map(|p| p.as_str()))
        .opt_i64("not_before", req.not_before.map(|t| t.micros()))
        .i64("items", req.items.len() as i64);
    for item in &req.items {
        f = f.str("item", item.id.as_str());
        // A fixed item's field is what it was before held items, so earlier creates still replay.
        f = match item.price {
            Price::Cost(c) => f.i64("cost", c.get()),
            Price::Hold(n) => f.i64("hold", n.get()),
        };
    }
    // Priority and labels join only when they say something, so creates made before them, and an
    // explicit default, still replay.
    if let Some(p) = req.priority.filter(|p| *p != limits::JOB_PRIORITY_DEFAULT) {
        f = f.i64("priority", i64::from(p));
    }
    if !req.requires.is_empty() {
        f = f.str("requires", &req.requires.text());
    }
    f.finish()
}

/// A job request that passed [`validate_job`], with its total cost and its payload as stored:
/// made only there, so the writes below take a request checked exactly once.
#[derive(Debug, Clone)]
pub(crate) struct ValidJob {
    pub req: NewJob,
    pub total: Credits,
    /// `req.payload` as canonical JSON text: what is stored and fingerprinted.
    pub payload: String,
}

pub(crate) fn validate_job(req: NewJob) -> Result<ValidJob, StoreError> {
    if req.items.is_empty() || req.items.len() > limits::JOB_ITEMS_MAX {
        return Err(StoreError::invalid(format!("a job has 1 to {} items", limits::JOB_ITEMS_MAX)));
    }
    let mut ids: Vec<&str> = req.items.iter().map(|i| i.id.as_str()).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err(StoreError::invalid("item ids must be unique within a job"));
    }
    for item in &req.items {
        match item.price {
            Price::Cost(c) if c.is_negative() => return Err(StoreError::invalid("item cost must be zero or more")),
            Price::Hold(n) if !n.is_positive() => return Err(StoreError::invalid("item hold must be more than zero")),
            _ => {}
        }
    }
    let total = Credits::checked_sum(req.items.iter().map(|i| i.price.charged()))?;
    if total.get() > limits::BALANCE_MAX {
        return Err(StoreError::Overflow);
    }
    if let Some(n) = req.max_attempts
        && !(1..=limits::ATTEMPTS_MAX_LIMIT).contains(&n)
    {
        return Err(StoreError::invalid(format!("max_attempts must be between 1 and {}", limits::ATTEMPTS_MAX_LIMIT)));
    }
    if let Some(p) = req.priority
        && p > limits::JOB_PRIORITY_MAX
    {
        return Err(StoreError::invalid(format!("priority must be between 0 and {}", limits::JOB_PRIORITY_MAX)));
    }
    if req.requires.len() > limits::JOB_REQUIRES_MAX {
        return Err(StoreError::invalid(format!("a job requires at most {} labels", limits::JOB_REQUIRES_MAX)));
    }
    let payload = canonical_json(&req.payload);
    if payload.len() > limits::PAYLOAD_BYTES_MAX {
        return Err(StoreError::invalid(format!("payload is larger than {} bytes", limits::PAYLOAD_BYTES_MAX)));
    }
    Ok(ValidJob { req, total, payload })
}

pub(crate) async fn create_job(db: &mut Db<'_>, cx: &Cx, job: &ValidJob) -> Result<Created<Job>, StoreError> {
    let req = &job.req;
    match job::Rail::of(req.kind.as_str()) {
        job::Rail::Work => {}
        job::Rail::Payout => {
            return Err(StoreError::invalid(
                "the job kind withdrawal is reserved: create withdrawals with POST /v1/withdrawals",
            ));
        }
        job::Rail::Funding => {
            return Err(StoreError::invalid("the job kind top_up is reserved: create top-ups with POST /v1/top-ups"));
        }
    }
    let fp = job_fingerprint(job);
    // The account, then the job: replay or conflict first, so a re-sent create takes no sequence
    // number. Two concurrent creates of one id on PostgreSQL: the loser hits `jobs_pkey`, is
    // retried, and lands here — or, on PostgreSQL's plan, which charges before it inserts, finds the
    // charge refused because the winner's charge took the credit: asked again below.
    if let Some(replayed) = replay(db, cx, job, &fp, Lock::Job).await? {
        return replayed;
    }
    let job = match db.engine() {
        // The common shape in three statements (docs/design/batch-plan.md §10).
        Engine::Postgres => match creates(db, cx, job, &fp).await {
            // The refusal waited for the account's row: a create of the same id that held it has
            // committed by now, and the job it made is the answer (a replay, or a conflict) — its
            // charge may be what took the credit or the spend limit's room.
            Err(refused @ (StoreError::InsufficientCredits { .. } | StoreError::SpendLimitExceeded { .. })) => {
                match replay(db, cx, job, &fp, Lock::None).await? {
                    Some(replayed) => return replayed,
                    None => return Err(refused),
                }
            }
            planned => planned?,
        },
        Engine::Sqlite => insert_job(db, cx, job, &fp, Pay::Overdraft).await?,
    };
    if job.not_before <= cx.now {
        // Lined at once: this process's claims know the line without reading the list again.
        let line = super::lines::LineKey {
            priority: i64::from(job.priority),
            kind: job.kind.to_string(),
            requires: job.requires.text(),
        };
        super::claim::lock_lines(cx).add(line);
    }
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: job, replayed: false })
}

/// Whether `replay` locks the job it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lock {
    Job,
    None,
}

/// The answer to a create whose id is taken already: the job as it stands when the request is the
/// same (a replay), a conflict when it differs; `None` when the id is free.
/// `Lock::Job` first thing, as every job transition starts (the job's row, then the account's);
/// `Lock::None` after a refused charge, which holds the account's row already: a job read then is
/// not locked (locking it would take the job after the account, against the lock order).
async fn replay(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &ValidJob,
    fp: &[u8; 32],
    lock: Lock,
) -> Result<Option<Result<Created<Job>, StoreError>>, StoreError> {
    let req = &job.req;
    let existing = match lock {
        Lock::Job => lock_account_job(db, req.account_id.as_str(), req.id.as_str()).await?,
        Lock::None => Some(read_job_row(db, req.id.as_str()).await?),
    };
    let Some(existing) = existing else {
        return Err(StoreError::not_found("account", req.account_id.as_str()));
    };
    let Some(existing) = existing else { return Ok(None) };
    if existing.request_hash != *fp {
        return Ok(Some(Err(StoreError::IdempotencyConflict { what: "job", id: req.id.to_string() })));
    }
    Ok(Some(Ok(Created { value: attach(db, cx, existing).await?, replayed: true })))
}

/// How a new job's charges are paid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pay {
    /// Work: the balance and the overdraft.
    Overdraft,
    /// A withdrawal: the balance alone, never the overdraft (spec §1).
    Cash,
    /// A top-up: it charges nothing, and reserves its credits in `held` under the balance's bound,
    /// so the grant its confirmed charge writes can never be refused (money-controls.md §11.4).
    Reserve(i64),
}

/// Inserts a new job (its id known to be free): the job row, its items `charged`, one charge per
/// item paid as `pay` says (`insufficient_credits` aborts the whole transaction), and `job.queued`.
/// Returns the job as written, built from the request (debug builds check it against a re-read).
pub(crate) async fn insert_job(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &ValidJob,
    fp: &[u8; 32],
    pay: Pay,
) -> Result<Job, StoreError> {
    debug_assert!(!matches!(pay, Pay::Reserve(_)) || job.total.get() == 0, "a top-up charges nothing");
    let terms = Terms::of(cx, job);
    // The job row is written before its charge: the spend limits are checked first.
    super::spend_limits::check_first(db, cx, job.req.account_id.as_str(), job.req.kind.as_str(), job.total.get())
        .await?;
    let job_seq = insert_rows(db, cx, job, fp, &terms).await?;
    charge_items(db, cx, job, pay, job_seq).await?;
    cx.point(CrashPoint::AfterLedger)?;
    queued(db, cx, job).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = as_written(cx, job, &terms)?;
    #[cfg(debug_assertions)]
    {
        let stored = super::must_read_job(db, cx, job.id.as_str()).await?;
        assert_eq!(job, stored, "a created job's answer must be what was stored");
    }
    Ok(job)
}

/// What a new job takes from its kind's policy where the request names nothing.
#[derive(Debug, Clone, Copy)]
pub(super) struct Terms {
    pub max_attempts: u32,
    pub refund_on: job::RefundPolicy,
    pub not_before: Timestamp,
}

impl Terms {
    pub fn of(cx: &Cx, job: &ValidJob) -> Terms {
        let req = &job.req;
        let policy = cx.policy.for_kind(req.kind.as_str());
        Terms {
            max_attempts: req.max_attempts.unwrap_or(policy.attempts_max),
            refund_on: req.refund_on.unwrap_or(policy.refund_on),
            not_before: req.not_before.unwrap_or(cx.now),
        }
    }
}

/// `job.queued`: what was charged, split into the fixed prices (`cost`) and the holds of held items
/// (`hold`, priced by their success): a hold is not a cost.
pub(super) async fn queued(db: &mut Db<'_>, cx: &Cx, job: &ValidJob) -> Result<(), StoreError> {
    let (req, total) = (&job.req, job.total);
    let mut held = 0_i64;
    for item in &req.items {
        if let Some(h) = item.price.hold() {
            held = held.checked_add(h.get()).ok_or(StoreError::Overflow)?;
        }
    }
    let cost = total.get().checked_sub(held).ok_or(StoreError::Overflow)?;
    let data = serde_json::json!({
        "kind": req.kind.as_str(), "charged": total.get(), "cost": cost, "hold": held, "items": req.items.len(),
    });
    emit(db, cx, EventKind::JobQueued, Some(req.id.as_str()), req.account_id.as_str(), data).await
}

/// The job row's INSERT; its number `{SEQ}`: SQLite's from the batch's counters (`$2`), PostgreSQL's
/// from a sequence in the same statement (`$2` is NULL there).
const INSERT_JOB: &str = "INSERT INTO jobs (id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, \
     refund_on, cancel_requested, not_before, lease_seconds, payload, request_hash, created_at, updated_at, priority, \
     requires, turn, parked) \
     VALUES ($1, {SEQ}, $3, $4, 'queued', $5, 0, 0, $6, $7, 0, $8, $9, $10, $11, $12, $12, $13, $14, {TURN}, \
     CASE WHEN {NOT_RESERVED} THEN {PARKED} ELSE 0 END)";
static INSERT_JOB_SQLITE: LazyLock<String> = LazyLock::new(|| {
    INSERT_JOB
        .replace("{SEQ}", "$2")
        .replace("{TURN}", &turn_of_new(Engine::Sqlite, "$13", "$4", "$14", "$3", "$8", "$12"))
        .replace("{PARKED}", &parked_of_new(Engine::Sqlite, "$3"))
        .replace("{NOT_RESERVED}", &job::not_reserved("$4"))
});
static INSERT_JOB_PG: LazyLock<String> = LazyLock::new(|| {
    INSERT_JOB
        .replace("{SEQ}", "COALESCE($2, nextval('job_seq_numbers'))")
        .replace("{TURN}", &turn_of_new(Engine::Postgres, "$13", "$4", "$14", "$3", "$8", "$12"))
        .replace("{PARKED}", &parked_of_new(Engine::Postgres, "$3"))
        .replace("{NOT_RESERVED}", &job::not_reserved("$4"))
});

/// A new job's turn in its line (docs/design/fair-claims.md §4), from the jobs lined now: the line's
/// front, or one after its account's last turn there, whichever is later; NULL (waiting, lined when
/// due) for a job not due yet and for a withdrawal (never lined). Each argument is the placeholder
/// of: the priority, kind, requires, account, `not_before`, now.
pub(super) fn turn_of_new(engine: Engine, p: &str, k: &str, r: &str, a: &str, not_before: &str, now: &str) -> String {
    let greatest = match engine {
        Engine::Sqlite => "MAX",
        Engine::Postgres => "GREATEST",
    };
    let line = format!("priority = {p} AND kind = {k} AND requires = {r} AND state = 'queued' AND turn IS NOT NULL");
    format!(
        "CASE WHEN {not_before} <= {now} AND {reserved} AND {parked} = 0 THEN {greatest}(\
         COALESCE((SELECT turn FROM jobs WHERE {line} ORDER BY turn LIMIT 1), 0), \
         COALESCE((SELECT MAX(turn) + 1 FROM jobs WHERE {line} AND account_id = {a}), 0)) END",
        reserved = job::not_reserved(k),
        parked = parked_of_new(engine, a),
    )
}

/// Whether a new job enters parked (docs/design/fair-claims.md §10): its account is capped and
/// already has parked jobs — it waits behind them, and a claim never walks a capped account's
/// growing backlog in a line. 1 or 0.
pub(super) fn parked_of_new(engine: Engine, a: &str) -> String {
    let index = match engine {
        Engine::Sqlite => " INDEXED BY jobs_parked",
        Engine::Postgres => "",
    };
    format!(
        "(CASE WHEN EXISTS (SELECT 1 FROM accounts x WHERE x.id = {a} AND x.max_running IS NOT NULL) \
         AND EXISTS (SELECT 1 FROM jobs y{index} WHERE y.account_id = {a} AND y.state = 'queued' AND y.parked = 1) \
         THEN 1 ELSE 0 END)"
    )
}

/// The job row, numbered (the `AfterGuard` crash point right after it), and its items `charged`.
/// Returns the number SQLite's writer gave it (PostgreSQL's comes from a sequence in the statement).
async fn insert_rows(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &ValidJob,
    fp: &[u8; 32],
    terms: &Terms,
) -> Result<Option<i64>, StoreError> {
    let req = &job.req;
    let (sql, job_seq) = match db.engine() {
        Engine::Sqlite => (&*INSERT_JOB_SQLITE, Some(next_seq(cx, "job", 1)?)),
        Engine::Postgres => (&*INSERT_JOB_PG, None),
    };
    let inserted = db
        .exec(
            sql,
            args![
                req.id.as_str(),
                job_seq,
                req.account_id.as_str(),
                req.kind.as_str(),
                job.total.get(),
                i64::from(terms.max_attempts),
                terms.refund_on.as_str(),
                terms.not_before.micros(),
                i64::from(limits::LEASE_SECONDS_DEFAULT),
                &job.payload,
                fp,
                cx.now.micros(),
                i64::from(req.priority.unwrap_or(limits::JOB_PRIORITY_DEFAULT)),
                req.requires.text()
            ],
        )
        .await?;
    guard_hit(inserted, "job insert")?;
    cx.point(CrashPoint::AfterGuard)?;
    if db.engine() == Engine::Postgres && req.items.len() > 1 {
        // One statement for a batch job's items, not a round trip each.
        let n = db
            .exec(
                "INSERT INTO items (job_id, item_id, ord, cost, hold, state) \
                 SELECT $1, u.item_id, u.ord - 1, u.cost, u.hold, 'charged' \
                 FROM unnest($2::text[], $3::bigint[], $4::bigint[]) WITH ORDINALITY AS u(item_id, cost, hold, ord)",
                &[
                    Value::Text(req.id.to_string()),
                    Value::Texts(req.items.iter().map(|i| i.id.to_string()).collect()),
                    Value::I64s(req.items.iter().map(|i| i.price.charged().get()).collect()),
                    Value::OptI64s(req.items.iter().map(|i| i.price.hold().map(|n| n.get())).collect()),
                ],
            )
            .await?;
        if n != req.items.len() as u64 {
            return Err(StoreError::internal(format!("{} of a job's {} items inserted", n, req.items.len())));
        }
        return Ok(job_seq);
    }
    for (ord, item) in req.items.iter().enumerate() {
        db.exec(
            "INSERT INTO items (job_id, item_id, ord, cost, hold, state) VALUES ($1, $2, $3, $4, $5, 'charged')",
            args![
                req.id.as_str(),
                item.id.as_str(),
                ord as i64,
                item.price.charged().get(),
                item.price.hold().map(|n| n.get())
            ],
        )
        .await?;
    }
    Ok(job_seq)
}

/// One charge per item under `check`; every charged item is held until it is decided.
async fn charge_items(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &ValidJob,
    pay: Pay,
    job_seq: Option<i64>,
) -> Result<(), StoreError> {
    let lines = charge_lines(job, job_seq)?;
    let req = &job.req;
    let (check, reserved) = match pay {
        Pay::Overdraft => (BalanceCheck::Overdraft, 0),
        Pay::Cash => (BalanceCheck::Cash, 0),
        Pay::Reserve(credits) => (BalanceCheck::Bounded, credits),
    };
    let held = job.total.get().checked_add(reserved).ok_or(StoreError::Overflow)?;
    let holds = Holds { held, exposure: 0 };
    // A withdrawal being made draws only on credit that never expires, and is refused otherwise.
    let spend = if check == BalanceCheck::Cash { Spend::CashOnly } else { Spend::Any };
    let kind = Some(req.kind.as_str());
    post(db, cx, Posting { account_id: req.account_id.as_str(), job_kind: kind, check, lines: &lines, holds }, spend)
        .await
}

/// One charge line per item, in the job's order.
/// `job_seq`: the number SQLite's writer gave the job (`insert_rows`); PostgreSQL's plan charges
/// before it inserts, and writes none.
pub(super) fn charge_lines(job: &ValidJob, job_seq: Option<i64>) -> Result<Vec<Line<'_>>, StoreError> {
    let req = &job.req;
    req.items
        .iter()
        .map(|i| {
            Ok(Line {
                kind: EntryKind::Charge,
                amount: i.price.charged().checked_neg()?,
                job_id: Some(req.id.as_str()),
                job_seq,
                item_id: Some(i.id.as_str()),
                ref_id: None,
                reason: None,
                request_hash: None,
            })
        })
        .collect()
}

/// The job as `insert_job` wrote it, built from the request.
pub(super) fn as_written(cx: &Cx, job: &ValidJob, terms: &Terms) -> Result<Job, StoreError> {
    let req = &job.req;
    let Terms { max_attempts, refund_on, not_before } = *terms;
    Ok(Job {
        id: req.id.clone(),
        account_id: req.account_id.clone(),
        kind: req.kind.clone(),
        state: JobState::Queued,
        cost: job.total,
        net: job.total.checked_neg()?,
        attempt: 0,
        max_attempts,
        budget_base: 0,
        refund_on,
        cancel_requested: false,
        not_before,
        priority: req.priority.unwrap_or(limits::JOB_PRIORITY_DEFAULT),
        requires: req.requires.clone(),
        lease_expires_at: None,
        last_error: None,
        items: req
            .items
            .iter()
            .map(|i| Item {
                id: i.id.clone(),
                cost: i.price.charged(),
                hold: i.price.hold(),
                state: ItemState::Charged,
                refund_reason: None,
            })
            .collect(),
        payload: job.payload.clone(),
        result: None,
        created_at: cx.now,
        updated_at: cx.now,
    })
}

columns! {
    /// What the write of a create changed, table by table, and whether the head grant paid.
    CreateWroteCol { jobs, items, took, parts }
}

static CREATE_WRITE: LazyLock<String> = LazyLock::new(|| {
    let take = take_from_head(&TakeAt {
        account: "$2",
        total: "$15",
        kind: "$16",
        job: "$1",
        first_seq: "$17",
        now: "$11",
        lines: "$12::text[], $13::bigint[]",
    });
    let turn =
        turn_of_new(Engine::Postgres, "$18::bigint", "$3::text", "$19::text", "$2::text", "$7::bigint", "$11::bigint");
    let parked = parked_of_new(Engine::Postgres, "$2::text");
    let reserved = job::not_reserved("$3::text");
    format!(
        "WITH \
         j AS (INSERT INTO jobs (id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, \
               refund_on, cancel_requested, not_before, lease_seconds, payload, request_hash, created_at, updated_at, \
               priority, requires, turn, parked) \
               VALUES ($1, nextval('job_seq_numbers'), $2, $3, 'queued', $4, 0, 0, $5, $6, 0, $7, $8, $9, $10, $11, $11, \
               $18, $19, {turn}, CASE WHEN {reserved} THEN {parked} ELSE 0 END) \
               RETURNING 1), \
         i AS (INSERT INTO items (job_id, item_id, ord, cost, hold, state) \
               SELECT $1, u.item_id, u.ord - 1, u.cost, u.hold, 'charged' \
               FROM j, unnest($12::text[], $13::bigint[], $14::bigint[]) WITH ORDINALITY AS u(item_id, cost, hold, ord) \
               RETURNING 1), \
         {take} \
         SELECT (SELECT count(*) FROM j) AS jobs, (SELECT count(*) FROM i) AS items, (SELECT count(*) FROM took) AS took, \
         (SELECT count(*) FROM parts) AS parts"
    )
});

/// A new job (its id free, its account existing) in the plan: the charge first — the guarded
/// balance UPDATE, which locks the account row, so the head grant read after it is current, and a
/// refused charge writes nothing — then the job, its items and the head grant's take in one
/// statement. When the head grant cannot pay it all, the general take (which may split across
/// grants and run into debt) follows in the same transaction.
pub(crate) async fn creates(db: &mut Db<'_>, cx: &Cx, job: &ValidJob, fp: &[u8; 32]) -> Result<Job, StoreError> {
    let req = &job.req;
    let terms = Terms::of(cx, job);
    let lines = charge_lines(job, None)?;
    let holds = Holds { held: job.total.get(), exposure: 0 };
    let posting = Posting {
        account_id: req.account_id.as_str(),
        job_kind: Some(req.kind.as_str()),
        check: BalanceCheck::Overdraft,
        lines: &lines,
        holds,
    };
    let posted = post_balance(db, cx, &posting).await?;
    let amounts: Vec<i64> = lines.iter().map(|l| -l.amount.get()).collect();
    let wrote = db
        .one(
            &CREATE_WRITE,
            &[
                Value::from(req.id.as_str()),
                req.account_id.as_str().into(),
                req.kind.as_str().into(),
                job.total.get().into(),
                i64::from(terms.max_attempts).into(),
                terms.refund_on.as_str().into(),
                terms.not_before.micros().into(),
                i64::from(limits::LEASE_SECONDS_DEFAULT).into(),
                job.payload.as_str().into(),
                Value::Blob(fp.to_vec()),
                cx.now.micros().into(),
                Value::Texts(req.items.iter().map(|i| i.id.to_string()).collect()),
                Value::I64s(amounts.clone()),
                Value::OptI64s(req.items.iter().map(|i| i.price.hold().map(|n| n.get())).collect()),
                job.total.get().into(),
                AllocationKind::of_debit(EntryKind::Charge).as_str().into(),
                posted.first_account_seq.into(),
                i64::from(req.priority.unwrap_or(limits::JOB_PRIORITY_DEFAULT)).into(),
                req.requires.text().into(),
            ],
        )
        .await?;
    let paying = amounts.iter().filter(|x| **x > 0).count() as i64;
    let took = wrote.i64(CreateWroteCol::took)?;
    let counts = [
        ("job", wrote.i64(CreateWroteCol::jobs)?, 1),
        ("items", wrote.i64(CreateWroteCol::items)?, req.items.len() as i64),
        ("allocation parts", wrote.i64(CreateWroteCol::parts)?, if took == 1 { paying } else { 0 }),
    ];
    check_counts("the create of job", req.id.as_str(), &counts)?;
    cx.point(CrashPoint::AfterGuard)?;
    if took == 0 && job.total.is_positive() {
        debits_from_grants(db, cx, &posting, &posted, Spend::Any).await?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    queued(db, cx, job).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let answer = as_written(cx, job, &terms)?;
    #[cfg(debug_assertions)]
    super::plan::assert_stored(db, cx, &answer).await?;
    Ok(answer)
}
