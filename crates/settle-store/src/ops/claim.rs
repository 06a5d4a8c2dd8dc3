//! Claims: due jobs leased to workers, each with a new attempt row, in one guarded UPDATE per job.

use super::{Caller, Cx, JobCol, attach, emit, guard_hit, job_row};
use crate::db::{Db, Engine, args};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::history::EventKind;
use settle_core::job::{self};
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
const CLAIM_SQLITE: &str = claim_sql!("", "AND cancel_requested = 0");
const CLAIM_PG: &str = claim_pg!("AND cancel_requested = 0");
const CLAIM_PAYOUTS_SQLITE: &str = claim_sql!("", "");
const CLAIM_PAYOUTS_PG: &str = claim_pg!("");

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
/// Workers never get a withdrawal (a claim naming no kinds leaves them out); the payout processor
/// gets only withdrawals.
pub(crate) async fn claim(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &ClaimRequest,
    caller: Caller,
) -> Result<Vec<ClaimedJob>, StoreError> {
    let template = match (db.engine(), caller) {
        (Engine::Sqlite, Caller::Worker) => CLAIM_SQLITE,
        (Engine::Postgres, Caller::Worker) => CLAIM_PG,
        (Engine::Sqlite, Caller::PayoutProcessor) => CLAIM_PAYOUTS_SQLITE,
        (Engine::Postgres, Caller::PayoutProcessor) => CLAIM_PAYOUTS_PG,
    };
    let names_withdrawal = req.kinds.iter().any(|k| k.as_str() == job::WITHDRAWAL_KIND);
    let kinds_sql = match caller {
        Caller::PayoutProcessor => format!("AND kind = '{}'", job::WITHDRAWAL_KIND),
        Caller::Worker if names_withdrawal => {
            return Err(StoreError::invalid("withdrawals are claimed only by the built-in payout processor"));
        }
        Caller::Worker if req.kinds.is_empty() => format!("AND kind <> '{}'", job::WITHDRAWAL_KIND),
        Caller::Worker => {
            let params: Vec<String> = (0..req.kinds.len()).map(|i| format!("${}", 6 + i)).collect();
            format!("AND kind IN ({})", params.join(", "))
        }
    };
    let sql = template.replace("{KINDS}", &kinds_sql).replace("{COLUMNS}", JobCol::LIST);
    let lease_seconds = req.lease_seconds.unwrap_or(cx.policy.default.lease_seconds);
    let lease_expires_at = cx.now.plus_seconds(u64::from(lease_seconds));
    let mut claimed = Vec::new();
    for _ in 0..req.limit.min(limits::CLAIM_LIMIT_MAX) {
        let token = cx.token().to_string();
        let mut a = vec![
            crate::db::Value::from(cx.now.micros()),
            token.clone().into(),
            lease_expires_at.micros().into(),
            req.worker.as_str().into(),
            i64::from(lease_seconds).into(),
        ];
        if caller == Caller::Worker {
            a.extend(req.kinds.iter().map(|k| crate::db::Value::from(k.as_str())));
        }
        let Some(claimed_row) = db.opt_built(sql.clone(), &a).await? else { break };
        let mut row = job_row(&claimed_row)?;
        if db.engine() == Engine::Postgres {
            guard_hit(u64::try_from(claimed_row.i64(AttemptsCol::attempts)?).unwrap_or(0), "claim's attempt")?;
        }
        let (job_id, attempt) = (row.id.clone(), row.attempt);
        cx.point(CrashPoint::AfterGuard)?;
        // A claim that names no lease gets its job kind's.
        let mut expires = lease_expires_at;
        let kind_lease = cx.policy.for_kind(&row.kind).lease_seconds;
        if req.lease_seconds.is_none() && kind_lease != lease_seconds {
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
        let job = attach(db, cx, row).await?;
        #[cfg(debug_assertions)]
        assert_eq!(job, super::must_read_job(db, cx, &job_id).await?, "a claimed job's answer must be what was stored");
        emit(
            db,
            cx,
            EventKind::JobClaimed,
            Some(&job_id),
            job.account_id.as_str(),
            serde_json::json!({ "attempt": attempt, "worker": req.worker.as_str() }),
        )
        .await?;
        cx.point(CrashPoint::AfterOutbox)?;
        claimed.push(ClaimedJob { job, lease_token: LeaseToken(token), lease_expires_at: expires });
    }
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(claimed)
}
