//! The console's HTML, server-rendered with maud (every interpolation escaped). No page loads
//! anything from another origin: the stylesheet and the one script are served by `settle serve`.

use super::session::Session;
use maud::{DOCTYPE, Markup, html};
use settle_core::Timestamp;
use settle_core::ids::JobId;
use settle_core::job::JobState;
use settle_core::ledger::EntryKind;
use settle_store::{
    AccountDetail, Action, Attempt, Job, JobFilter, JobHistory, JobTotals, LedgerEntry, Overview, SignalRecord,
};

/// Credits with thousands separators: `-1,250`.
pub fn credits(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// A time as operators read it: `2026-12-01 04:17:20Z`.
pub fn time(t: Timestamp) -> String {
    let s = t.rfc3339();
    let s = s.replacen('T', " ", 1);
    match s.find('.') {
        Some(dot) => format!("{}Z", &s[..dot]),
        None => s,
    }
}

fn state_badge(state: JobState) -> Markup {
    html! { span class={ "badge s-" (state.as_str()) } { (state.as_str()) } }
}

fn signed(n: i64) -> Markup {
    let class = if n < 0 {
        "neg"
    } else if n > 0 {
        "pos"
    } else {
        ""
    };
    html! { span class=(class) { (if n > 0 { "+" } else { "" }) (credits(n)) } }
}

/// The page frame: navigation, who is signed in, and the page's own content.
pub fn layout(title: &str, session: Option<&Session>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Settle" }
                link rel="stylesheet" href="/console/assets/console.css";
                script src="/console/assets/console.js" defer {}
            }
            body {
                header class="top" {
                    a class="brand" href="/console" { "Settle" }
                    @if let Some(s) = session {
                        nav {
                            a href="/console" { "Overview" }
                            a href="/console/jobs" { "Jobs" }
                            a href="/console/jobs?state=dead" { "Dead letters" }
                            a href="/console/accounts" { "Accounts" }
                            a href="/console/withdrawals" { "Withdrawals" }
                            a href="/console/top-ups" { "Top-ups" }
                            // Deliveries carry every account's events: not for a scoped session.
                            @if s.actor.scope.is_all() {
                                a href="/console/webhooks" { "Webhooks" }
                            }
                            a href="/docs" { "API reference" }
                        }
                        form class="find" method="get" action="/console/find" {
                            input type="search" name="q" placeholder="job or account id" aria-label="Find a job or account";
                        }
                        div class="who" {
                            span class={ "role r-" (s.actor.role.name()) } title="who is signed in" {
                                (s.actor.name) " · " (s.actor.role.name())
                            }
                            @if !s.loopback {
                                form method="post" action="/console/logout" class="inline" {
                                    input type="hidden" name="csrf" value=(s.csrf);
                                    button type="submit" class="link" { "Sign out" }
                                }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

pub fn login(error: Option<&str>) -> Markup {
    layout(
        "Sign in",
        None,
        html! {
            section class="card narrow" {
                h1 { "Sign in" }
                p class="muted" { "With an admin or client token of this server. Client tokens see; admin tokens may act." }
                @if let Some(e) = error { p class="error" role="alert" { (e) } }
                form method="post" action="/console/login" {
                    label for="token" { "Token" }
                    input id="token" type="password" name="token" autocomplete="current-password" required autofocus;
                    button type="submit" { "Sign in" }
                }
            }
        },
    )
}

pub fn message(session: Option<&Session>, title: &str, text: &str) -> Markup {
    layout(
        title,
        session,
        html! { section class="card" { h1 { (title) } p { (text) } p { a href="/console" { "Back to the overview" } } } },
    )
}

/// A hidden CSRF field and a button, as one POST form.
fn action_button(session: &Session, action: &str, label: &str, confirm: Option<&str>, danger: bool) -> Markup {
    html! {
        form method="post" action=(action) class="inline" data-confirm=[confirm] {
            input type="hidden" name="csrf" value=(session.csrf);
            button type="submit" class=(if danger { "danger" } else { "" }) { (label) }
        }
    }
}

/// The overview's live part (replaced in place by the page's refresh).
pub fn overview(
    session: &Session,
    o: &Overview,
    failures: &[settle_store::FailureCount],
    webhooks: &WebhookSummary,
) -> Markup {
    let total = |state: JobState| o.jobs.iter().filter(|(_, s, _)| *s == state).map(|(_, _, n)| n).sum::<i64>();
    // Dead letters are what a person may requeue: a dead withdrawal's hold was refunded, it is not one.
    let dead_withdrawals = o
        .jobs
        .iter()
        .filter(|(k, s, _)| *s == JobState::Dead && k.as_str() == settle_core::job::WITHDRAWAL_KIND)
        .map(|(_, _, n)| n)
        .sum::<i64>();
    let dead_letters = total(JobState::Dead) - dead_withdrawals;
    let mut kinds: Vec<&str> = o.jobs.iter().map(|(k, _, _)| k.as_str()).collect();
    kinds.dedup();
    let count = |kind: &str, state: JobState| {
        o.jobs.iter().find(|(k, s, _)| k == kind && *s == state).map(|(_, _, n)| *n).unwrap_or(0)
    };
    let body = html! {
        div id="live" data-refresh="10" {
            h1 { "Overview" }
            section class="tiles" {
                a class="tile" href="/console/jobs?state=queued" { span class="n" { (credits(o.due)) } span { "due now" } }
                a class="tile" href="/console/jobs?state=running" { span class="n" { (credits(total(JobState::Running))) } span { "running" } }
                a class={ "tile" @if dead_letters > 0 { " warn" } } href="/console/jobs?state=dead" {
                    span class="n" { (credits(dead_letters)) } span { "dead letters" }
                }
                @if dead_withdrawals > 0 {
                    a class="tile" href="/console/jobs?state=dead&kind=withdrawal" {
                        span class="n" { (credits(dead_withdrawals)) } span { "dead withdrawals (refunded)" }
                    }
                }
                a class={ "tile" @if total(JobState::Unknown) > 0 { " warn" } } href="/console/jobs?state=unknown" {
                    span class="n" { (credits(total(JobState::Unknown))) } span { "unknown, for the reconciler" }
                }
                a class="tile" href="/console/jobs?state=cancelling" { span class="n" { (credits(total(JobState::Cancelling))) } span { "cancelling" } }
            }
            section class="card" {
                h2 { "Transitions per minute, last hour" }
                (chart(&o.per_minute))
                @if o.per_minute_truncated { p class="muted" { "Counted from the latest " (credits(settle_store::OVERVIEW_EVENTS_MAX)) " events." } }
            }
            section class="card" {
                h2 { "Jobs by kind and state" }
                div class="scroll" {
                    table {
                        thead { tr { th { "kind" } @for s in JobState::ALL { th class="num" { (s.as_str()) } } } }
                        tbody {
                            @for k in &kinds {
                                tr {
                                    td { a href={ "/console/jobs?kind=" (k) } { (k) } }
                                    @for s in JobState::ALL {
                                        td class="num" {
                                            @let n = count(k, s);
                                            @if n > 0 { a href={ "/console/jobs?kind=" (k) "&state=" (s.as_str()) } { (credits(n)) } } @else { span class="muted" { "·" } }
                                        }
                                    }
                                }
                            }
                            @if kinds.is_empty() { tr { td colspan="9" class="muted" { "No jobs yet." } } }
                        }
                    }
                }
            }
            (failures_and_webhooks(failures, webhooks))
            @if session.can_act() {
                section class="card" {
                    h2 { "Audit" }
                    p class="muted" { "Recompute L1–L9 from the stored rows (every balance, item, chain and event)." }
                    (action_button(session, "/console/audit", "Run settle audit", None, false))
                }
            }
        }
    };
    layout("Overview", Some(session), body)
}

/// The overview's failures by code and webhook endpoints.
fn failures_and_webhooks(failures: &[settle_store::FailureCount], webhooks: &WebhookSummary) -> Markup {
    html! {
    section class="card" {
        h2 { "Failures by code" }
        p class="muted" { "Jobs now dead, unknown or waiting to retry, by their last fail code." }
        table {
            thead { tr { th { "code" } th { "state" } th class="num" { "jobs" } } }
            tbody {
                @for f in failures {
                    tr {
                        // With the state, so the jobs page offers the bulk action that fits them.
                        td { a href={ "/console/jobs?fail_code=" (super::query::urlencode(&f.code)) "&state=" (if f.state == settle_store::FailureState::Retrying { "queued" } else { f.state.as_str() }) } { code { (f.code) } } }
                        td { (f.state) }
                        td class="num" { (credits(f.count)) }
                    }
                }
                @if failures.is_empty() { tr { td colspan="3" class="muted" { "No failures." } } }
            }
        }
    }
    section class="card" {
        h2 { a href="/console/webhooks" { "Webhook endpoints" } }
        table {
            thead { tr { th { "endpoint" } th { "breaker" } th class="num" { "pending" } th class="num" { "dead" } } }
            tbody {
                @for e in &webhooks.endpoints {
                    tr { td { (e.0) } td { (e.1) } td class="num" { (credits(e.2)) } td class="num" { (credits(e.3)) } }
                }
                @if webhooks.endpoints.is_empty() { tr { td colspan="4" class="muted" { "No webhook endpoints configured." } } }
            }
        }
    }
    }
}

/// Endpoint, breaker state, pending deliveries, dead deliveries.
#[derive(Default)]
pub struct WebhookSummary {
    pub endpoints: Vec<(String, String, i64, i64)>,
}

/// Bars of events per minute, as an inline SVG (no script).
fn chart(per_minute: &[(Timestamp, i64)]) -> Markup {
    let max = per_minute.iter().map(|(_, n)| *n).max().unwrap_or(0).max(1);
    let (w, h) = (600.0_f64, 120.0_f64);
    let bar = w / per_minute.len().max(1) as f64;
    let total: i64 = per_minute.iter().map(|(_, n)| n).sum();
    html! {
        svg class="chart" viewBox={ "0 0 " (w) " " (h + 16.0) } role="img" aria-label={ (credits(total)) " transitions in the last hour" } {
            @for (i, (at, n)) in per_minute.iter().enumerate() {
                @let bh = (*n as f64 / max as f64) * h;
                rect x=(format!("{:.1}", i as f64 * bar)) y=(format!("{:.1}", h - bh)) width=(format!("{:.1}", (bar - 1.0).max(1.0))) height=(format!("{:.1}", bh)) {
                    title { (time(*at)) ": " (n) }
                }
            }
            text x="0" y=(h + 14.0) { "−60 min" }
            text x=(w) y=(h + 14.0) text-anchor="end" { "now · peak " (credits(max)) "/min · " (credits(total)) " in all" }
        }
    }
}

/// The jobs list with its filter and, for admins, the bulk actions on everything it matches.
pub fn jobs(
    session: &Session,
    q: &super::query::JobsQuery,
    page: &[Job],
    next: Option<i64>,
    totals: &JobTotals,
    dead_withdrawals: i64,
) -> Markup {
    let filter_qs = q.filter_query();
    let body = html! {
        h1 { "Jobs" }
        form class="filters" method="get" action="/console/jobs" {
            label { "state " select name="state" {
                option value="" { "any" }
                @for s in JobState::ALL { option value=(s.as_str()) selected[q.state.as_deref() == Some(s.as_str())] { (s.as_str()) } }
            } }
            label { "kind " input name="kind" value=[q.kind.as_deref()] size="12"; }
            label { "account " input name="account" value=[q.account.as_deref()] size="12"; }
            label { "fail code " input name="fail_code" value=[q.fail_code.as_deref()] size="12"; }
            label { "priority " input name="priority" value=[q.priority.as_deref()] size="3" inputmode="numeric"; }
            label { "id prefix " input name="prefix" value=[q.prefix.as_deref()] size="12"; }
            button type="submit" { "Filter" }
        }
        p class="muted" {
            (credits(totals.jobs)) " jobs match, priced at " (credits(totals.cost)) " credits"
            @if let Some(net) = totals.net { "; they cost their accounts " (credits(-net)) " credits now (after refunds and releases)." }
            @else { " (what they cost now, after refunds, is on each job's page)." }
        }
        @if session.can_act() && totals.jobs > 0 {
            div class="bulk" {
                @if q.state.as_deref() == Some("dead") && dead_withdrawals < totals.jobs {
                    a class="button" href={ "/console/bulk?action=requeue&" (filter_qs) } { "Requeue all " (credits(totals.jobs)) " matching…" }
                }
                @if dead_withdrawals > 0 {
                    p class="muted" {
                        @if dead_withdrawals == totals.jobs { "These are dead withdrawals" } @else { (credits(dead_withdrawals)) " of them are dead withdrawals" }
                        ", never requeued: each one's hold was refunded when it died. To pay out again, create a new withdrawal."
                    }
                }
                @if matches!(q.state.as_deref(), Some("queued") | Some("running")) {
                    a class="button danger" href={ "/console/bulk?action=cancel&" (filter_qs) } { "Cancel all " (credits(totals.jobs)) " matching…" }
                }
            }
        }
        div class="scroll" {
            table class="jobs" {
                thead { tr { th { "job" } th { "state" } th { "kind" } th class="num" { "priority" } th { "account" } th class="num" { "cost" } th class="num" { "net" } th class="num" { "attempts" } th { "last error" } th { "updated" } } }
                tbody {
                    @for j in page {
                        tr {
                            td { a href={ "/console/jobs/" (j.id) } { (j.id) } }
                            td { (state_badge(j.state)) @if j.cancel_requested { " " span class="badge s-cancelling" { "cancel requested" } } }
                            td { (j.kind) @for l in j.requires.iter() { " " span class="badge" { (l.as_str()) } } }
                            td class="num" { (j.priority) }
                            td { a href={ "/console/accounts/" (j.account_id) } { (j.account_id) } }
                            td class="num" { (credits(j.cost.get())) }
                            td class="num" { (signed(j.net.get())) }
                            td class="num" { (j.attempt.saturating_sub(j.budget_base)) "/" (j.max_attempts) }
                            td { @if let Some(e) = &j.last_error { code { (e.code) } } }
                            td class="nowrap" { (time(j.updated_at)) }
                        }
                    }
                    @if page.is_empty() { tr { td colspan="10" class="muted" { "No jobs match." } } }
                }
            }
        }
        @if let Some(after) = next {
            p { a class="button" href={ "/console/jobs?" (filter_qs) "&after=" (after) } { "Next page →" } }
        }
    };
    layout("Jobs", Some(session), body)
}

pub struct JobPage<'a> {
    pub job: &'a Job,
    pub attempts: &'a [Attempt],
    pub signals: &'a [SignalRecord],
    pub history: &'a JobHistory,
    pub actions: &'a [Action],
    /// The withdrawal's own facts, when the job is one.
    pub withdrawal: Option<&'a settle_store::Withdrawal>,
    /// The top-up's own facts, when the job is one.
    pub top_up: Option<&'a settle_store::TopUp>,
    /// Which grants paid for its items (docs/decisions/0023).
    pub paid_by: &'a [settle_store::Allocation],
    /// Queued, requiring labels no worker has claimed with in `LABELS_SEEN_WINDOW_SECONDS`.
    pub unmatched: bool,
    /// Queued, its account capped: the cap and how many of the account's jobs run now.
    pub capped: Option<(i64, usize)>,
}

/// How far back the console looks for a worker with a queued job's labels.
pub const LABELS_SEEN_WINDOW_SECONDS: u64 = 600;

pub fn job(session: &Session, p: &JobPage<'_>) -> Markup {
    let j = p.job;
    let finished = j.state.is_terminal();
    let body = html! {
        p class="crumbs" { a href="/console/jobs" { "Jobs" } " / " (j.kind) }
        h1 { "Job " code { (j.id) } " " (state_badge(j.state)) }
        section class="card facts" {
            dl {
                dt { "account" } dd { a href={ "/console/accounts/" (j.account_id) } { (j.account_id) } }
                dt { "kind" } dd { (j.kind) }
                @if j.kind != settle_core::job::WITHDRAWAL_KIND {
                    dt { "priority" } dd { (j.priority) span class="muted" { " (0 is claimed first)" } }
                    dt { "requires" } dd {
                        @if j.requires.is_empty() { span class="muted" { "no labels: any worker of its kind" } }
                        @for l in j.requires.iter() { code { (l.as_str()) } " " }
                        @if p.unmatched {
                            br; strong class="error" { "Waiting: no worker with these labels has claimed in the last " (LABELS_SEEN_WINDOW_SECONDS / 60) " minutes." }
                        }
                    }
                    @if let Some((cap, running)) = p.capped {
                        dt { "account cap" } dd {
                            (running) " of at most " (cap) " running"
                            @if running as i64 >= cap {
                                br; strong class="error" { "Waiting: its account is at its cap; it starts when one of them ends." }
                            }
                        }
                    }
                }
                @if let Some(w) = p.withdrawal {
                    dt { "destination" } dd { code { (w.destination) } }
                    dt { "provider txid" } dd { @if let Some(t) = &w.provider_txid { code { (t) } } @else { span class="muted" { "not known yet" } } }
                    dt { "idempotency key" } dd { code { (w.idempotency_key) } }
                    @if let Some(t) = w.returned_at { dt { "returned" } dd { (time(t)) } }
                }
                @if let Some(t) = p.top_up {
                    dt { "buys" } dd { (credits(t.credits.get())) " credits for " (t.price) " " (t.currency) " (minor units)" }
                    dt { "customer" } dd { code { (t.customer) } }
                    dt { "charge" } dd { @if let Some(c) = &t.provider_charge_id { code { (c) } } @else { span class="muted" { "not confirmed yet (nothing granted)" } } }
                    dt { "grant" } dd { @if let Some(g) = &t.grant_id { code { (g) } } @else { span class="muted" { "none" } } }
                    dt { "idempotency key" } dd { code { (t.idempotency_key) } }
                    @if t.rule { dt { "made by" } dd { "the account's auto top-up rule" } }
                }
                @if j.items.iter().any(|i| i.hold.is_some()) {
                    dt { "held at create" } dd { (credits(j.cost.get())) " credits" }
                    dt { "priced" } dd {
                        @let priced: Vec<i64> = j.items.iter().filter_map(|i| i.priced_cost().map(|c| c.get())).collect();
                        (credits(priced.iter().sum())) " credits, " (priced.len()) " of " (j.items.len()) " item(s)"
                    }
                } @else {
                    dt { "cost" } dd { (credits(j.cost.get())) " credits" }
                }
                dt { "net now" } dd { (signed(j.net.get())) " credits" }
                dt { "attempts" } dd {
                    // A requeue gives a fresh budget, and a release is not counted: count the
                    // attempts against the budget.
                    @if j.budget_base > 0 {
                        (j.attempt - j.budget_base) " of " (j.max_attempts) " counted (" (j.attempt) " in all; releases and requeues are not counted)"
                    } @else {
                        (j.attempt) " of " (j.max_attempts)
                    }
                }
                dt { "refund on" } dd { (j.refund_on.as_str()) }
                dt { "not before" } dd { (time(j.not_before)) }
                @if let Some(t) = j.lease_expires_at { dt { "lease expires" } dd { (time(t)) } }
                @if j.cancel_requested { dt { "cancel" } dd { "requested" } }
                @if let Some(e) = &j.last_error { dt { "last error" } dd { code { (e.code) } " " (e.message.as_deref().unwrap_or("")) } }
                dt { "created" } dd { (time(j.created_at)) }
                dt { "updated" } dd { (time(j.updated_at)) }
            }
            @if session.can_act() {
                div class="actions" {
                    // A dead withdrawal is never requeued (its hold was refunded): a new one is made.
                    @if j.state == JobState::Dead && j.kind != settle_core::job::WITHDRAWAL_KIND {
                        (action_button(session, &format!("/console/jobs/{}/requeue", j.id), "Requeue", Some("Requeue this dead job with a fresh attempt budget?"), false))
                    }
                    @if !finished && j.state != JobState::Unknown && !j.cancel_requested {
                        (action_button(session, &format!("/console/jobs/{}/cancel", j.id), "Cancel", Some("Cancel this job? Undelivered items are refunded."), true))
                    }
                }
            }
        }
        section class="card" {
            h2 { "Timeline" }
            (timeline(p))
        }
        (paid_by(p))
        (job_reports(p))
        (job_records(p))
    };
    layout(&format!("Job {}", j.id), Some(session), body)
}

/// Which grants paid for the job's items, and what of it went back (docs/decisions/0023).
fn paid_by(p: &JobPage<'_>) -> Markup {
    html! {
    section class="card" {
        h2 { "Paid by" }
        p class="muted" { "Each charge takes from the account's grants by priority, then soonest expiry, then age; a refund gives each part back to its grant (and expires at once on a grant that has expired)." }
        div class="scroll" { table {
            thead { tr { th { "item" } th { "taken by" } th { "from" } th class="num" { "credits" } th class="num" { "given back" } } }
            tbody {
                @for a in p.paid_by {
                    tr {
                        td { code { (a.item_id.as_deref().unwrap_or("")) } }
                        td { (a.kind) }
                        td {
                            @match (&a.grant_id, a.origin.as_deref()) {
                                (None, _) => span class="muted" { "debt (no grant covered it)" },
                                (Some(g), Some("opening")) => { "the opening balance of " code { (g) } },
                                (Some(g), origin) => { (origin.unwrap_or("grant")) " " code { (g) } },
                            }
                        }
                        td class="num" { (credits(a.taken.get())) }
                        td class="num" { (credits(a.given_back.get())) }
                    }
                }
                @if p.paid_by.is_empty() { tr { td colspan="5" class="muted" { "Nothing charged." } } }
            }
        } }
    }
    }
}

/// A job's attempts, and the signals that changed nothing.
fn job_reports(p: &JobPage<'_>) -> Markup {
    html! {
    section class="card" {
        h2 { "Attempts" }
        div class="scroll" { table {
            thead { tr { th { "#" } th { "worker" } th { "started" } th { "ended" } th { "result" } th { "code" } th { "message" } } }
            tbody {
                @for a in p.attempts {
                    tr {
                        td class="num" { (a.attempt_no) }
                        td { (a.worker) }
                        td class="nowrap" { (time(a.started_at)) }
                        td class="nowrap" { @if let Some(t) = a.finished_at { (time(t)) } @else { span class="muted" { "open" } } }
                        td {
                            (a.result.map_or("open", |r| r.as_str()))
                            @if let Some(t) = a.recovered_at { br; span class="recovered" { "recovered by its late success at " (time(t)) } }
                        }
                        td { @if let Some(c) = &a.fail_code { code { (c) } } }
                        td { (a.message.as_deref().unwrap_or("")) }
                    }
                }
                @if p.attempts.is_empty() { tr { td colspan="7" class="muted" { "Not claimed yet." } } }
            }
        } }
    }
    section class="card" {
        h2 { "Signals outside the attempts" }
        p class="muted" { "Stale tokens (an earlier attempt) and repeats changed nothing. A late success marked " code { "recovered" } " did: it took back the failed job's refund (the reclaim is in the ledger)." }
        div class="scroll" { table {
            thead { tr { th { "received" } th { "signal" } th { "attempt" } th { "effect" } th { "code" } th { "message" } } }
            tbody {
                @for s in p.signals {
                    tr {
                        td class="nowrap" { (time(s.received_at)) }
                        td { (s.signal.as_str()) }
                        td class="num" { @if let Some(n) = s.attempt_no { (n) } }
                        td { (s.effect.as_str()) }
                        td { @if let Some(c) = &s.fail_code { code { (c) } } }
                        td { (s.message.as_deref().unwrap_or("")) }
                    }
                }
                @if p.signals.is_empty() { tr { td colspan="6" class="muted" { "None." } } }
            }
        } }
        @if p.history.signals_unlogged > 0 {
            p class="muted" {
                "…and " (p.history.signals_unlogged) " more after the first "
                (settle_core::limits::SIGNALS_LOGGED_MAX) ", counted but not kept."
            }
        }
    }
    }
}

/// What a held item's price left of its hold, released when it was delivered.
fn released(i: &settle_store::Item) -> Markup {
    match i.hold {
        Some(h) if i.state == settle_core::item::ItemState::Succeeded => html! { (credits(h.get() - i.cost.get())) },
        _ => html! { "" },
    }
}

/// A job's items, ledger entries, artifacts and events.
fn job_records(p: &JobPage<'_>) -> Markup {
    let j = p.job;
    html! {
    section class="card" {
        h2 { "Items" }
        div class="scroll" { table {
            thead { tr { th { "item" } th class="num" { "hold" } th class="num" { "cost" } th class="num" { "released" } th { "state" } th { "refund reason" } } }
            tbody {
                @for i in &j.items {
                    tr {
                        td { (i.id) }
                        td class="num" { @if let Some(h) = i.hold { (credits(h.get())) } @else { span class="muted" { "fixed" } } }
                        td class="num" { @if let Some(c) = i.priced_cost() { (credits(c.get())) } @else { span class="muted" { "not priced" } } }
                        td class="num" { (released(i)) }
                        td { (i.state.as_str()) }
                        td { (i.refund_reason.map_or("", |r| r.as_str())) }
                    }
                }
            }
        } }
    }
    section class="card" {
        h2 { "Ledger entries" }
        (entries_table(&p.history.entries, false))
    }
    section class="card" {
        h2 { "Artifacts" }
        table {
            thead { tr { th { "item" } th { "key" } th { "stored at" } th { "registered" } } }
            tbody {
                @for a in &p.history.artifacts { tr { td { (a.item_id) } td { code { (a.key) } } td { code { (a.path) } } td class="nowrap" { (time(a.created_at)) } } }
                @if p.history.artifacts.is_empty() { tr { td colspan="4" class="muted" { "None." } } }
            }
        }
    }
    section class="card" {
        h2 { "Events" }
        div class="scroll" { table {
            thead { tr { th class="num" { "seq" } th { "at" } th { "type" } th { "data" } } }
            tbody {
                @for e in &p.history.events {
                    tr { td class="num" { (e.seq) } td class="nowrap" { (time(e.created_at)) } td { (e.kind.as_str()) } td { code class="wrap" { (e.data) } } }
                }
            }
        } }
    }
    }
}

/// Everything that happened to the job, by time: attempts, signals, ledger entries, operator
/// actions (events are listed below it).
fn timeline(p: &JobPage<'_>) -> Markup {
    let mut rows: Vec<(i64, u8, Markup)> = Vec::new();
    rows.push((p.job.created_at.micros(), 0, html! { "created, " (credits(p.job.cost.get())) " credits charged" }));
    for a in p.attempts {
        rows.push((a.started_at.micros(), 1, html! { "attempt " (a.attempt_no) " claimed by " strong { (a.worker) } }));
        if let Some(t) = a.finished_at {
            rows.push((
                t.micros(),
                2,
                html! {
                    "attempt " (a.attempt_no) " ended: " strong { (a.result.map_or("open", |r| r.as_str())) }
                    @if let Some(c) = &a.fail_code { " " code { (c) } } @if let Some(m) = &a.message { " — " (m) }
                },
            ));
        }
    }
    for s in p.signals {
        rows.push((s.received_at.micros(), 3, html! {
            "signal " strong { (s.signal.as_str()) } " from attempt " (s.attempt_no.map(|n| n.to_string()).unwrap_or_else(|| "?".into()))
            ": " em { (s.effect.as_str()) } @if let Some(c) = &s.fail_code { " " code { (c) } }
        }));
    }
    for e in &p.history.entries {
        rows.push((
            e.created_at.micros(),
            4,
            html! {
                (e.kind.as_str()) " " (signed(e.amount.get())) " (item " (e.item_id.as_deref().unwrap_or("-")) ")"
            },
        ));
    }
    for a in p.actions {
        rows.push((
            a.at.micros(),
            5,
            html! { "operator " strong { (a.actor) } ": " (a.action) " " code class="wrap" { (a.detail) } },
        ));
    }
    rows.sort_by_key(|(t, order, _)| (*t, *order));
    html! {
        ol class="timeline" {
            @for (t, _, what) in rows { li { span class="t" { (time(Timestamp::from_micros(t))) } " " (what) } }
        }
    }
}

fn entries_table(entries: &[LedgerEntry], with_job: bool) -> Markup {
    html! {
        div class="scroll" { table {
            thead { tr {
                // Amount and balance first: on a phone they are what shows before the box scrolls.
                th class="num" { "seq" } th { "kind" } th class="num" { "amount" } th class="num" { "balance after" } th { "at" }
                @if with_job { th { "job / grant" } } th { "item" } th { "reason" }
            } }
            tbody {
                @for e in entries {
                    tr id={ "e" (e.seq) } {
                        td class="num" { a href={ "/console/accounts/" (e.account_id) "#e" (e.seq) } { (e.seq) } }
                        td { (e.kind.as_str()) }
                        td class="num" { (signed(e.amount.get())) }
                        td class="num" { (credits(e.balance_after.get())) }
                        td class="nowrap" { (time(e.created_at)) }
                        @if with_job {
                            td {
                                @if let Some(j) = &e.job_id { a href={ "/console/jobs/" (j) } { (j) } }
                                @else if let Some(r) = &e.ref_id { (r) }
                            }
                        }
                        td { (e.item_id.as_deref().unwrap_or("")) }
                        td { (e.reason.as_deref().unwrap_or("")) (hold_note(e, entries)) }
                    }
                }
                @if entries.is_empty() { tr { td colspan="8" class="muted" { "No entries." } } }
            }
        } }
    }
}

/// A held item's charge and its release, told as a pair (docs/decisions/0022): the charge was the
/// hold, the release what its price did not use.
fn hold_note(e: &LedgerEntry, entries: &[LedgerEntry]) -> Markup {
    let pair = |kind: EntryKind| {
        entries.iter().find(|o| o.kind == kind && o.job_id == e.job_id && o.item_id == e.item_id && e.job_id.is_some())
    };
    html! {
        @match e.kind {
            EntryKind::Release => {
                span class="muted" { "the unused rest of a hold" }
                @if let Some(c) = pair(EntryKind::Charge) {
                    span class="muted" {
                        ": held " (credits(-c.amount.get())) " at " a href={ "#e" (c.seq) } { "#" (c.seq) }
                        ", priced at " (credits(-c.amount.get() - e.amount.get()))
                    }
                }
            }
            EntryKind::Charge => @if let Some(r) = pair(EntryKind::Release) {
                span class="muted" {
                    "a hold: " (credits(r.amount.get())) " released at " a href={ "#e" (r.seq) } { "#" (r.seq) }
                    ", priced at " (credits(-e.amount.get() - r.amount.get()))
                }
            },
            _ => {}
        }
    }
}

/// What the account page shows beside the account's stored figures.
pub struct AccountPage<'a> {
    pub detail: &'a AccountDetail,
    pub chain: Option<Option<i64>>,
    pub grants: &'a [settle_store::Grant],
    pub alerts: &'a [settle_store::Alert],
    pub limits: &'a [settle_store::SpendLimit],
    /// The auto top-up rule, when the account has one.
    pub rule: Option<&'a settle_store::AutoTopUp>,
    pub entries: &'a [LedgerEntry],
    pub next: Option<i64>,
    pub actions: &'a [Action],
}

/// The account page's auto top-up rule: what it buys, whether it is on, and this month's count.
fn auto_top_up(account: &str, rule: Option<&settle_store::AutoTopUp>) -> Markup {
    html! {
    section class="card" {
        h2 { "Auto top-up" }
        @match rule {
            Some(r) => {
                p class="muted" { "When a posting takes the balance under its threshold, the funding processor buys credits — unless a top-up is in flight or the month's count would pass its maximum. A rule whose top-up died waits, paused, until it is put again." }
                dl {
                    dt { "state" } dd { @if r.state == settle_store::RuleState::Paused { strong class="error" { "paused" } } @else { "active" } }
                    dt { "below" } dd { (credits(r.below)) " credits" }
                    dt { "buys" } dd { (credits(r.credits.get())) " credits for " (r.price) " " (r.currency) " (minor units) from " code { (r.customer) } }
                    dt { "this month" } dd { (credits(r.credits_this_month)) " of " (credits(r.monthly_credits_max)) " credits; starts again " (time(r.month_resets_at)) }
                }
                p { a href={ "/console/top-ups" } { "Top-ups →" } }
            }
            None => p class="muted" { "None. PUT /v1/accounts/" (account) "/auto-top-up sets one." },
        }
    }
    }
}

/// The account page's money controls: its balance alerts and its spend limits.
fn money_controls(account: &str, alerts: &[settle_store::Alert], limits: &[settle_store::SpendLimit]) -> Markup {
    html! {
    section class="card" {
        h2 { "Balance alerts" }
        p class="muted" { "Each fires account.balance_low once when a posting takes the balance under its threshold, and account.balance_recovered once when one takes it back; nothing fires while the balance stays on one side." }
        div class="scroll" { table class="alerts" {
            thead { tr { th { "alert" } th class="num" { "below" } th { "the balance is" } } }
            tbody {
                @for al in alerts {
                    tr {
                        td { code { (al.id) } }
                        td class="num" { (credits(al.below)) }
                        td { @if al.side == settle_store::AlertSide::Below { strong class="error" { "below" } } @else { "above" } }
                    }
                }
                @if alerts.is_empty() { tr { td colspan="3" class="muted" { "None. PUT /v1/accounts/" (account) "/alerts sets them." } } }
            }
        } }
    }
    section class="card" {
        h2 { "Spend limits" }
        p class="muted" { "A create that would take a period's spend over a limit is refused (402 spend_limit_exceeded) and writes nothing. Spend is what charges, holds and reclaims took in the period, less what refunds and releases gave back; a reclaim is never refused, so a period may end over." }
        div class="scroll" { table class="limits" {
            thead { tr { th { "per" } th class="num" { "spent" } th class="num" { "limit" } th { "kinds" } th { "resets" } } }
            tbody {
                @for l in limits {
                    tr {
                        td { "UTC " (l.period.as_str()) }
                        td class="num" { @if l.spent >= l.amount { strong class="error" { (credits(l.spent)) } } @else { (credits(l.spent)) } }
                        td class="num" { (credits(l.amount)) }
                        td { @if l.kinds.is_empty() { span class="muted" { "every kind but withdrawal" } } @else { @for (i, k) in l.kinds.iter().enumerate() { @if i > 0 { ", " } code { (k) } } } }
                        td { (time(l.resets_at)) }
                    }
                }
                @if limits.is_empty() { tr { td colspan="5" class="muted" { "None. PUT /v1/accounts/" (account) "/limits sets them." } } }
            }
        } }
    }
    }
}

pub fn account(session: &Session, p: &AccountPage<'_>, q: &super::query::EntriesQuery) -> Markup {
    let (d, chain, entries, next, actions) = (p.detail, p.chain, p.entries, p.next, p.actions);
    let a = &d.account;
    let kinds = ["grant", "adjustment", "charge", "refund", "reclaim", "release", "payout_return", "expire"];
    let body = html! {
        h1 { "Account " code { (a.id.as_str()) } }
        section class="tiles" {
            div class="tile" { span class="n" { (credits(a.balance.get())) } span { "balance" } }
            div class="tile" { span class="n" { (credits(a.overdraft_limit.get())) } span { "overdraft limit" } }
            div class="tile" {
                @match a.max_running {
                    Some(cap) => { span class="n" { (cap) } span { "jobs at most running at once (its cap)" } }
                    None => { span class="n" { "—" } span { "no cap on running jobs" } }
                }
            }
            div class="tile" { span class="n" { (credits(d.pending)) } span { "charged to work not decided yet (jobs, unpaid withdrawals)" } }
            div class="tile" { span class="n" { (credits(d.exposure)) } span { "refunded, reclaimable by a late success" } }
            @if d.debt > 0 {
                div class="tile" { span class="n" { (credits(d.debt)) } span { "debt: spent on the overdraft, paid by the next grant" } }
            }
        }
        section class="card" {
            h2 { "Grants" }
            p class="muted" { "Charges take from active grants by priority (lowest first), then soonest expiry, then age. What an expired grant had left is taken by one expire entry; credit given back to it later expires at once." }
            div class="scroll" { table class="grants" {
                // On a phone the columns that decide what a grant can still pay come first (what is
                // left, its state, when it expires); where it came from and its priority follow.
                thead { tr { th { "grant" } th class="num" { "left" } th { "state" } th { "expires" } th class="num" { "amount" } th { "from" } th class="num" { "priority" } } }
                tbody {
                    @for g in p.grants {
                        tr {
                            td { code { (g.id) } }
                            td class="num" { (credits(g.remaining.get())) }
                            td { (g.state.as_str()) }
                            td { @if let Some(t) = g.expires_at { (time(t)) } @else { span class="muted" { "never" } } }
                            td class="num" { (credits(g.amount.get())) }
                            td { (g.origin) }
                            td class="num" { (g.priority) }
                        }
                    }
                    @if p.grants.is_empty() { tr { td colspan="7" class="muted" { "None." } } }
                }
            } }
        }
        (money_controls(a.id.as_str(), p.alerts, p.limits))
        (auto_top_up(a.id.as_str(), p.rule))
        section class="card" {
            h2 { "Why the balance is what it is" }
            p {
                "The balance is the sum of the account's " (credits(d.entries)) " ledger entries, each with the running balance after it. "
                "Hash chain: "
                @match chain {
                    None => a href={ "/console/accounts/" (a.id.as_str()) "?chain=true" } { "check it" },
                    Some(None) => strong class="ok" { "intact" },
                    Some(Some(seq)) => strong class="error" { "broken at entry " (seq) },
                }
                "."
            }
            form class="filters" method="get" {
                label { "kind " select name="kind" {
                    option value="" { "any" }
                    @for k in kinds { option value=(k) selected[q.kind.as_deref() == Some(k)] { (k) } }
                } }
                label { "from " input type="datetime-local" name="since" value=[q.since.as_deref()]; }
                button type="submit" { "Show" }
            }
            (entries_table(entries, true))
            @if let Some(after) = next {
                p { a class="button" href={ "?after=" (after) @if let Some(k) = &q.kind { "&kind=" (super::query::urlencode(k)) } @if let Some(s) = &q.since { "&since=" (super::query::urlencode(s)) } } { "Next page →" } }
            }
        }
        section class="card" {
            h2 { "Operator actions" }
            (actions_table(actions))
        }
        p { a href={ "/console/jobs?account=" (a.id.as_str()) } { "This account's jobs →" } }
    };
    layout(&format!("Account {}", a.id.as_str()), Some(session), body)
}

pub fn actions_table(actions: &[Action]) -> Markup {
    html! {
        div class="scroll" { table {
            thead { tr { th { "at" } th { "who" } th { "action" } th { "job" } th { "detail" } } }
            tbody {
                @for a in actions {
                    tr {
                        td class="nowrap" { (time(a.at)) }
                        td { (a.actor) }
                        td { (a.action) }
                        td { @if let Some(j) = &a.job_id { a href={ "/console/jobs/" (j) } { (j) } } }
                        td { code class="wrap" { (a.detail) } }
                    }
                }
                @if actions.is_empty() { tr { td colspan="5" class="muted" { "None." } } }
            }
        } }
    }
}

/// The confirmation of a bulk action: how many jobs and credits it will touch.
pub fn bulk_confirm(
    session: &Session,
    action: super::JobAction,
    filter: &JobFilter,
    filter_qs: &str,
    totals: &JobTotals,
) -> Markup {
    let what = if action == super::JobAction::Requeue { "Requeue" } else { "Cancel" };
    let body = html! {
        h1 { (what) " every matching job" }
        section class="card" {
            p {
                "This will " strong { (action) } " " strong { (credits(totals.jobs)) " jobs" }
                " matching " (describe(filter)) ", carrying " strong { (credits(totals.cost)) " credits" } " of cost"
                @if let Some(net) = totals.net { " (" (credits(-net)) " held from their accounts now)" } "."
            }
            @if action == super::JobAction::Cancel { p { "Queued jobs are cancelled and refunded at once; running jobs stop at their next item boundary." } }
            @if action == super::JobAction::Requeue { p { "Each goes back to queued with a fresh attempt budget; what was refunded stays refunded until a success reclaims it." } }
            p class="muted" { "At most " (super::query::BULK_MAX) " jobs are acted on per submission; run it again for the rest." }
            form method="post" action="/console/bulk" {
                input type="hidden" name="csrf" value=(session.csrf);
                input type="hidden" name="action" value=(action);
                input type="hidden" name="filter" value=(filter_qs);
                input type="hidden" name="expected" value=(totals.jobs);
                input type="hidden" name="until" value=(totals.last_seq);
                button type="submit" class="danger" { (what) " " (credits(totals.jobs)) " jobs" }
                " "
                a href={ "/console/jobs?" (filter_qs) } { "Back" }
            }
        }
    };
    layout(what, Some(session), body)
}

pub fn describe(f: &JobFilter) -> String {
    let mut parts = Vec::new();
    if let Some(s) = f.state {
        parts.push(format!("state {}", s.as_str()));
    }
    if let Some(k) = &f.kind {
        parts.push(format!("kind {}", k.as_str()));
    }
    if let Some(a) = &f.account_id {
        parts.push(format!("account {}", a.as_str()));
    }
    if let Some(c) = &f.fail_code {
        parts.push(format!("fail code {}", c.as_str()));
    }
    if let Some(p) = &f.id_prefix {
        parts.push(format!("id prefix {p}"));
    }
    if parts.is_empty() { "every job".into() } else { parts.join(", ") }
}

pub fn bulk_done(
    session: &Session,
    action: super::JobAction,
    done: u64,
    skipped: &[(JobId, String)],
    more: bool,
) -> Markup {
    let body = html! {
        h1 { "Done" }
        section class="card" {
            p { strong { (done) } " jobs " (if action == super::JobAction::Requeue { "requeued" } else { "cancelled or asked to cancel" }) "." }
            @if more { p { strong { "More jobs match than one submission takes (" (super::query::BULK_MAX) "): run it again." } } }
            @if !skipped.is_empty() {
                p { (skipped.len()) " skipped:" }
                ul { @for (id, why) in skipped.iter().take(50) { li { a href={ "/console/jobs/" (id) } { (id) } ": " (why) } } }
            }
            p { a href="/console/jobs" { "Back to jobs" } }
        }
    };
    layout("Done", Some(session), body)
}

pub fn audit(session: &Session, report: &settle_store::AuditReport) -> Markup {
    let body = html! {
        h1 { "Audit" }
        section class="card" {
            @if report.violations.is_empty() {
                p class="ok" { strong { "Clean." } " L1–L9 hold: " (credits(report.accounts_checked as i64)) " accounts, "
                    (credits(report.items_checked as i64)) " items, " (credits(report.entries_checked as i64)) " ledger entries checked." }
            } @else {
                p class="error" { strong { (report.violations.len()) " violations." } }
                table {
                    thead { tr { th { "invariant" } th { "account" } th { "job" } th { "item" } th { "what" } } }
                    tbody { @for v in &report.violations { tr {
                        td { (v.invariant) } td { (v.account_id.as_deref().unwrap_or("")) }
                        td { @if let Some(j) = &v.job_id { a href={ "/console/jobs/" (j) } { (j) } } }
                        td { (v.item_id.as_deref().unwrap_or("")) } td { (v.message) }
                    } } }
                }
            }
        }
    };
    layout("Audit", Some(session), body)
}

pub fn accounts(session: &Session, rows: &[settle_store::Account], next: Option<&str>) -> Markup {
    let body = html! {
        h1 { "Accounts" }
        p class="muted" { "In id order. Each account's page has its grants, holds, ledger and hash chain." }
        div class="scroll" { table {
            thead { tr { th { "account" } th class="num" { "balance" } th class="num" { "overdraft limit" } th { "created" } } }
            tbody {
                @for a in rows {
                    tr {
                        td { a href={ "/console/accounts/" (a.id) } { (a.id) } }
                        td class="num" { (signed(a.balance.get())) }
                        td class="num" { (credits(a.overdraft_limit.get())) }
                        td class="nowrap" { (time(a.created_at)) }
                    }
                }
                @if rows.is_empty() { tr { td colspan="4" class="muted" { "No accounts." } } }
            }
        } }
        @if let Some(after) = next {
            p { a class="button" href={ "/console/accounts?after=" (super::query::urlencode(after)) } { "Next page →" } }
        }
    };
    layout("Accounts", Some(session), body)
}

pub fn withdrawals(session: &Session, rows: &[settle_store::Withdrawal], next: Option<i64>) -> Markup {
    let body = html! {
        h1 { "Withdrawals" }
        p class="muted" { "Each withdrawal's job page has its attempts and what the provider answered at each; the payout processor and the reconciler write their findings there." }
        div class="scroll" { table {
            thead { tr { th { "withdrawal" } th { "state" } th { "account" } th class="num" { "amount" } th { "destination" } th { "provider txid" } th { "idempotency key" } th { "last finding" } th { "updated" } } }
            tbody {
                @for w in rows {
                    tr {
                        td { a href={ "/console/jobs/" (w.job.id) } { (w.job.id) } }
                        td { (state_badge(w.job.state)) }
                        td { a href={ "/console/accounts/" (w.job.account_id) } { (w.job.account_id) } }
                        td class="num" { (credits(w.amount.get())) }
                        td { (w.destination) }
                        td { code { (w.provider_txid.as_deref().unwrap_or("")) } }
                        td { code { (w.idempotency_key) } }
                        td {
                            @if let Some(e) = &w.job.last_error { code { (e.code) } " " (e.message.as_deref().unwrap_or("")) }
                            @if let Some(t) = w.returned_at { "returned " (time(t)) }
                        }
                        td class="nowrap" { (time(w.job.updated_at)) }
                    }
                }
                @if rows.is_empty() { tr { td colspan="9" class="muted" { "No withdrawals." } } }
            }
        } }
        @if let Some(after) = next { p { a class="button" href={ "/console/withdrawals?after=" (after) } { "Next page →" } } }
    };
    layout("Withdrawals", Some(session), body)
}

pub fn top_ups(session: &Session, rows: &[settle_store::TopUp], next: Option<i64>) -> Markup {
    let body = html! {
        h1 { "Top-ups" }
        p class="muted" { "Credits bought through the funding provider. Only a confirmed charge grants them; each top-up's job page has its attempts and what the provider answered at each." }
        div class="scroll" { table {
            thead { tr { th { "top-up" } th { "state" } th { "account" } th class="num" { "credits" } th class="num" { "price" } th { "customer" } th { "charge" } th { "grant" } th { "last finding" } th { "updated" } } }
            tbody {
                @for t in rows {
                    tr {
                        td { a href={ "/console/jobs/" (t.job.id) } { (t.job.id) } }
                        td { (state_badge(t.job.state)) }
                        td { a href={ "/console/accounts/" (t.job.account_id) } { (t.job.account_id) } }
                        td class="num" { (credits(t.credits.get())) }
                        td class="num" { (t.price) " " (t.currency) }
                        td { (t.customer) }
                        td { code { (t.provider_charge_id.as_deref().unwrap_or("")) } }
                        td { code { (t.grant_id.as_deref().unwrap_or("")) } }
                        td { @if let Some(e) = &t.job.last_error { code { (e.code) } " " (e.message.as_deref().unwrap_or("")) } }
                        td class="nowrap" { (time(t.job.updated_at)) }
                    }
                }
                @if rows.is_empty() { tr { td colspan="10" class="muted" { "No top-ups." } } }
            }
        } }
        @if let Some(after) = next { p { a class="button" href={ "/console/top-ups?after=" (after) } { "Next page →" } } }
    };
    layout("Top-ups", Some(session), body)
}

pub fn webhooks(session: &Session, summary: &WebhookSummary, dead: &[settle_store::Delivery]) -> Markup {
    let body = html! {
        h1 { "Webhooks" }
        section class="card" {
            h2 { "Endpoints" }
            table {
                thead { tr { th { "endpoint" } th { "breaker" } th class="num" { "pending" } th class="num" { "dead" } } }
                tbody { @for e in &summary.endpoints { tr { td { (e.0) } td { (e.1) } td class="num" { (credits(e.2)) } td class="num" { (credits(e.3)) } } } }
            }
        }
        section class="card" {
            h2 { "Dead deliveries" }
            div class="scroll" { table {
                thead { tr { th { "endpoint" } th class="num" { "event" } th { "type" } th class="num" { "attempts" } th { "last error" } @if session.can_act() { th {} } } }
                tbody {
                    @for d in dead {
                        tr {
                            td { (d.endpoint_id) } td class="num" { (d.event.seq) } td { (d.event.kind.as_str()) } td class="num" { (d.attempts) }
                            td { (d.last_status.map(|s| s.to_string()).unwrap_or_default()) " " (d.last_error.as_deref().unwrap_or("")) }
                            @if session.can_act() {
                                td { (action_button(session, &format!("/console/webhooks/{}/{}/requeue", super::query::urlencode(&d.endpoint_id), d.event.seq), "Requeue", None, false)) }
                            }
                        }
                    }
                    @if dead.is_empty() { tr { td colspan="6" class="muted" { "No dead deliveries." } } }
                }
            } }
        }
    };
    layout("Webhooks", Some(session), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credits_read_with_separators() {
        let cases = [
            (0, "0"),
            (999, "999"),
            (1_000, "1,000"),
            (-1_250, "-1,250"),
            (1_234_567, "1,234,567"),
            (i64::MIN, "-9,223,372,036,854,775,808"),
        ];
        for (n, text) in cases {
            assert_eq!(credits(n), text);
        }
    }

    #[test]
    fn interpolated_text_is_escaped() {
        let page = message(None, "x", "<script>alert(1)</script>").into_string();
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;") && !page.contains("<script>alert"), "{page}");
    }
}
