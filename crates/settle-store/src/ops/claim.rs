//! Claims: due jobs leased to workers, each with a new attempt row, by guarded UPDATEs (on PostgreSQL
//! several of one line in one statement: docs/design/fair-claims.md §11).

use super::{Caller, Cx, JobCol, JobRow, attach_all, caps, emit, guard_hit, job_row, lines};
use crate::db::Row;
use crate::db::{Db, Engine, args};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::history::EventKind;
use settle_core::job::Rail;
use settle_core::limits;

/// The job claim; `$lock` as for webhooks: nothing on SQLite, `FOR UPDATE SKIP LOCKED` on PostgreSQL,
/// and the guard again in the outer WHERE. `{KINDS}` is replaced by the kind filter's placeholders,
/// `{COLUMNS}` by the job row's columns.
/// `$cancel` is the cancel guard: workers never claim a job whose cancel was requested; the payout
/// processor does claim a queued withdrawal with a cancel request, to ask the provider before the
/// hold is refunded (docs/decisions/0010).
macro_rules! claim_sql {
    ($lock:literal, $cancel:literal) => {
        concat!(
            "UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_token = $2, \
             lease_expires_at = $3, lease_worker = $4, lease_seconds = $5, updated_at = $1 \
             WHERE id = (SELECT id FROM jobs WHERE state = 'queued' AND not_before <= $1 ",
            $cancel,
            " {KINDS} ORDER BY not_before, job_seq LIMIT 1 ",
            $lock,
            ") AND state = 'queued' AND not_before <= $1 ",
            $cancel,
            " RETURNING {COLUMNS}"
        )
    };
}
/// PostgreSQL's claim opens its attempt row in the same statement (the plan,
/// docs/design/batch-plan.md §10): `$4` the worker, `$2` the token, `$1` now.
macro_rules! claim_pg {
    ($cancel:literal) => {
        concat!(
            "WITH c AS (",
            claim_sql!("FOR UPDATE SKIP LOCKED", $cancel),
            "), a AS (INSERT INTO attempts (job_id, attempt_no, worker, lease_token, started_at) \
             SELECT id, attempt, $4, $2, $1 FROM c RETURNING 1) \
             SELECT {COLUMNS}, (SELECT count(*) FROM a) AS attempts FROM c"
        )
    };
}
const CLAIM_PAYOUTS_SQLITE: &str = claim_sql!("", "");
const CLAIM_PAYOUTS_PG: &str = claim_pg!("");

/// Most lines a claim tries for one job before it answers with what it has.
const LINES_TRIED_MAX: usize = 8;
/// Most capped candidates one claim request decides (docs/design/fair-claims.md §10): each costs a
/// try-lock and a counted UPDATE, and the request answers with what it has after them.
const CAPPED_DECISIONS_MAX: usize = 8;

/// What one claim request learned about caps, kept across its jobs: the accounts it skips (busy,
/// or at their cap and parked), the kinds it leaves (busy or full), and its capped decisions.
#[derive(Default)]
struct CapsSeen {
    skip: Vec<String>,
    kinds_left: Vec<String>,
    decisions: usize,
    /// Some account has a cap: this claim takes one job at a time (docs/design/fair-claims.md §11).
    capped: bool,
}

/// The count of attempt rows PostgreSQL's claim opened, after the job's columns.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy)]
enum AttemptsCol {
    attempts,
}

impl crate::db::Col for AttemptsCol {
    fn at(self) -> usize {
        JobCol::COUNT + self as usize
    }
}

/// Claims up to `limit` due jobs, one guarded UPDATE each; every claim opens an attempt row.
/// Workers take jobs from lines, by priority and turn (docs/design/fair-claims.md §4), and never a
/// reserved kind (a claim naming no kinds leaves them out); a rail's processor takes only its own
/// kind, first due first.
pub(crate) async fn claim(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &ClaimRequest,
    caller: Caller,
) -> Result<Vec<ClaimedJob>, StoreError> {
    if caller == Caller::Worker
        && let Some(reserved) = req.kinds.iter().find(|k| Rail::of(k.as_str()).is_reserved())
    {
        return Err(StoreError::invalid(format!(
            "the job kind {reserved} is reserved: only its built-in processor claims it"
        )));
    }
    let rail_sql = match caller {
        Caller::Processor(rail) => rail.kind().map(|kind| {
            match db.engine() {
                Engine::Sqlite => CLAIM_PAYOUTS_SQLITE,
                Engine::Postgres => CLAIM_PAYOUTS_PG,
            }
            .replace("{KINDS}", &format!("AND kind = '{kind}'"))
            .replace("{COLUMNS}", JobCol::LIST)
        }),
        Caller::Worker => None,
    };
    let lease_seconds = req.lease_seconds.unwrap_or(cx.policy.default.lease_seconds);
    let lease_expires_at = cx.now.plus_seconds(u64::from(lease_seconds));
    let mut claimed = Vec::new();
    let mut caps = CapsSeen::default();
    let want = req.limit.min(limits::CLAIM_LIMIT_MAX) as usize;
    while claimed.len() < want {
        let a = vec![
            crate::db::Value::from(cx.now.micros()),
            cx.token().to_string().into(),
            lease_expires_at.micros().into(),
            req.worker.as_str().into(),
            i64::from(lease_seconds).into(),
        ];
        let found: Vec<Row> = match &rail_sql {
            Some(sql) => db.opt_built(sql.clone(), &a).await?.into_iter().collect(),
            None => take_from_lines(db, cx, req, &a, &mut caps, want - claimed.len()).await?,
        };
        if found.is_empty() {
            break;
        }
        let taken = found.len();
        let mut leases = Vec::with_capacity(taken);
        for claimed_row in &found {
            leases.push(leased(db, cx, req, claimed_row, taken, lease_expires_at).await?);
        }
        // The answers read together: two statements for the take, whatever its length.
        let (rows, leases): (Vec<JobRow>, Vec<Lease>) = leases.into_iter().unzip();
        for (job, lease) in attach_all(db, cx, rows).await?.into_iter().zip(leases) {
            claimed.push(announced(db, cx, req, job, lease).await?);
        }
    }
    if caller == Caller::Worker && !req.labels.is_empty() {
        let labels = req.labels.text();
        if lock_lines(cx).labels_due(&labels, cx.now) {
            lines::labels_seen(db, &labels, cx.now).await?;
        }
    }
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(claimed)
}

/// What a claimed job's answer needs besides its row: its token, its lease's end, its attempt.
struct Lease {
    token: String,
    expires: settle_core::clock::Timestamp,
    attempt: i64,
}

/// One job the claim's statement took (`taken` jobs by that statement, each with its attempt): its
/// kind's lease, and its attempt on SQLite.
async fn leased(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &ClaimRequest,
    claimed_row: &Row,
    taken: usize,
    lease_expires_at: settle_core::clock::Timestamp,
) -> Result<(JobRow, Lease), StoreError> {
    let mut row = job_row(claimed_row)?;
    if db.engine() == Engine::Postgres {
        let attempts = u64::try_from(claimed_row.i64(AttemptsCol::attempts)?).unwrap_or(0);
        if attempts != taken as u64 {
            return Err(StoreError::internal(format!("a claim took {taken} jobs and opened {attempts} attempts")));
        }
    }
    let token = row.lease_token.clone().ok_or_else(|| StoreError::internal("a claimed job has no lease token"))?;
    let (job_id, attempt) = (row.id.clone(), row.attempt);
    cx.point(CrashPoint::AfterGuard)?;
    // A claim that names no lease gets its job kind's.
    let mut expires = lease_expires_at;
    let kind_lease = cx.policy.for_kind(&row.kind).lease_seconds;
    if let Some(at) = row.lease_expires_at.filter(|_| row.lease_seconds == i64::from(kind_lease)) {
        // Its kind's lease already: the claim's own, or taken in the statement of several.
        expires = settle_core::clock::Timestamp::from_micros(at);
    } else if req.lease_seconds.is_none() {
        expires = cx.now.plus_seconds(u64::from(kind_lease));
        let rows = db
            .exec(
                "UPDATE jobs SET lease_expires_at = $3, lease_seconds = $4 WHERE id = $1 AND lease_token = $2",
                args![&job_id, &token, expires.micros(), i64::from(kind_lease)],
            )
            .await?;
        guard_hit(rows, "kind lease")?;
        row.lease_expires_at = Some(expires.micros());
        row.lease_seconds = i64::from(kind_lease);
    }
    if db.engine() == Engine::Sqlite {
        db.exec(
            "INSERT INTO attempts (job_id, attempt_no, worker, lease_token, started_at) VALUES ($1, $2, $3, $4, $5)",
            args![&job_id, attempt, req.worker.as_str(), &token, cx.now.micros()],
        )
        .await?;
    }
    Ok((row, Lease { token, expires, attempt }))
}

/// A claimed job's `job.claimed` event, and its answer.
async fn announced(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &ClaimRequest,
    job: Job,
    lease: Lease,
) -> Result<ClaimedJob, StoreError> {
    #[cfg(debug_assertions)]
    assert_eq!(
        job,
        super::must_read_job(db, cx, job.id.as_str()).await?,
        "a claimed job's answer must be what was stored"
    );
    emit(
        db,
        cx,
        EventKind::JobClaimed,
        Some(job.id.as_str()),
        job.account_id.as_str(),
        serde_json::json!({ "attempt": lease.attempt, "worker": req.worker.as_str() }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    Ok(ClaimedJob { job, lease_token: LeaseToken(lease.token), lease_expires_at: lease.expires })
}

/// A worker's next job: from the lines its kinds and labels allow, best priority first, lines of
/// one priority in turn; `None` when none has a job to give. The process's list of lines is read
/// again when stale, and once more — after lining up what became due — before answering `None`.
async fn take_from_lines(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &ClaimRequest,
    base: &[crate::db::Value],
    caps: &mut CapsSeen,
    want: usize,
) -> Result<Vec<Row>, StoreError> {
    let lined_first = lock_lines(cx).line_up_due(cx.now);
    if lined_first {
        line_up_now(db, cx).await?;
    }
    let mut read_now = false;
    for pass in 0..2 {
        if caps.decisions >= CAPPED_DECISIONS_MAX {
            return Ok(Vec::new());
        }
        if pass == 1 {
            // Nothing found: line up what became due (unless this claim just did), and read the
            // lines again — unless this claim has just read them and nothing was lined, when the
            // same lines would give the same nothing.
            let lined = !lined_first && line_up_now(db, cx).await?;
            if read_now && !lined {
                return Ok(Vec::new());
            }
        }
        if pass == 1 || !lock_lines(cx).is_fresh(cx.now) {
            read_now = true;
            let after = lock_lines(cx).page_after().cloned();
            let read = lines::active_lines(db, after.as_ref()).await?;
            lock_lines(cx).replace(cx.now, read);
        }
        let candidates = lock_lines(cx).for_claim(&req.kinds, &req.labels);
        for line in candidates.iter().take(LINES_TRIED_MAX) {
            if caps.kinds_left.contains(&line.kind) {
                continue;
            }
            // Served when chosen: this process's next claim, concurrent or not, tries another
            // line of the same priority first.
            lock_lines(cx).served(line);
            // Several at once only from the one line of its priority this claim takes from: with
            // two, successive jobs alternate between them (docs/design/fair-claims.md §11).
            let alone = candidates
                .iter()
                .take(LINES_TRIED_MAX)
                .filter(|l| l.priority == line.priority && !caps.kinds_left.contains(&l.kind))
                .count()
                == 1;
            // Several at once take the kind's lease in their statement.
            let kind_lease = (req.lease_seconds.is_none()).then(|| {
                let seconds = cx.policy.for_kind(&line.kind).lease_seconds;
                let mut b = base.to_vec();
                b[2] = cx.now.plus_seconds(u64::from(seconds)).micros().into();
                b[4] = i64::from(seconds).into();
                b
            });
            let rows = take_from_line(db, cx, line, base, caps, (if alone { want } else { 1 }, kind_lease)).await?;
            if !rows.is_empty() {
                return Ok(rows);
            }
        }
    }
    Ok(Vec::new())
}

/// The line's next job this claim may take (docs/design/fair-claims.md §10): uncapped, in the one
/// statement that finds it; capped, decided alone — an account busy or at its cap is skipped and the
/// line tried again, a kind busy or full leaves the line.
async fn take_from_line(
    db: &mut Db<'_>,
    cx: &Cx,
    line: &lines::LineKey,
    base: &[crate::db::Value],
    seen: &mut CapsSeen,
    (want, kind_lease): (usize, Option<Vec<crate::db::Value>>),
) -> Result<Vec<Row>, StoreError> {
    let kind_cap = cx.policy.for_kind(&line.kind).max_running;
    // Several uncapped jobs in one statement (docs/design/fair-claims.md §11); none taken so (the
    // line's next job is capped, or there is none) leaves it to the take of one job.
    if want > 1 && db.engine() == Engine::Postgres && seen.skip.is_empty() && kind_cap.is_none() && !seen.capped {
        let tokens = (0..want).map(|_| cx.token().to_string()).collect();
        let taken = caps::take_many(db, line, &kind_lease.unwrap_or_else(|| base.to_vec()), tokens).await?;
        if !taken.capped {
            return Ok(taken.rows);
        }
        seen.capped = true;
    }
    loop {
        let candidate = match caps::take(db, line, base, &seen.skip, kind_cap.is_some()).await? {
            caps::Take::Claimed(row) => return Ok(vec![row]),
            caps::Take::Empty => return Ok(Vec::new()),
            caps::Take::Capped(c) => c,
        };
        if seen.decisions >= CAPPED_DECISIONS_MAX {
            return Ok(Vec::new());
        }
        seen.decisions += 1;
        match caps::decide(db, cx, base, &candidate, line, kind_cap).await? {
            caps::Decision::Claimed(row) => return Ok(vec![row]),
            caps::Decision::AccountBusy | caps::Decision::AccountFull => seen.skip.push(candidate.account_id),
            caps::Decision::KindBusy | caps::Decision::KindFull => {
                seen.kinds_left.push(line.kind.clone());
                return Ok(Vec::new());
            }
        }
    }
}

/// Lets parked jobs of accounts below their caps wait again (`caps::unpark`), in this process's
/// rotation over the accounts that have some; how many.
pub(crate) async fn unpark_pass(db: &mut Db<'_>, cx: &Cx) -> Result<u64, StoreError> {
    let after = lock_lines(cx).unpark_after.clone();
    let (unparked, next) = caps::unpark(db, &after).await?;
    lock_lines(cx).unpark_after = next;
    Ok(unparked)
}

/// The unpark pass of the lease rescuer: [`unpark_pass`], and when it unparked any, a wake-up for
/// other processes' long-polling claims (this process wakes its own).
pub(crate) async fn unpark_and_wake(db: &mut Db<'_>, cx: &Cx) -> Result<u64, StoreError> {
    let unparked = unpark_pass(db, cx).await?;
    if unparked > 0 && db.engine() == Engine::Postgres {
        db.one("SELECT 1 AS woken FROM (SELECT pg_notify('settle_wake', '')) n", args![]).await?;
    }
    Ok(unparked)
}

/// Lines up due waiting jobs (parked ones that may run again first), and notes the lines they
/// joined; whether it lined any.
async fn line_up_now(db: &mut Db<'_>, cx: &Cx) -> Result<bool, StoreError> {
    unpark_pass(db, cx).await?;
    let lined = lines::line_up(db, cx.now).await?;
    let mut known = lock_lines(cx);
    known.lined_up(cx.now);
    let any = !lined.is_empty();
    for line in lined {
        known.add(line);
    }
    Ok(any)
}

pub(super) fn lock_lines(cx: &Cx) -> std::sync::MutexGuard<'_, lines::Lines> {
    cx.lines.lock().unwrap_or_else(|p| p.into_inner())
}
