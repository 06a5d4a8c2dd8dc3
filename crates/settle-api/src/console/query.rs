//! The console's queries as links and forms carry them: the jobs filter, the ledger's, and how a
//! value is put in a URL. Below the handlers and the pages, which both use them.

use crate::error::ApiError;
use serde::Deserialize;
use settle_core::ids::{AccountId, FailCode, JobKind};
use settle_core::job::JobState;
use settle_core::limits;
use settle_store::JobFilter;

settle_core::names! {
    /// What an operator does to jobs from the console, to one or to every job a filter matches.
    pub JobAction {
        Requeue = "requeue",
        Cancel = "cancel",
    }
}

/// Jobs one bulk submission acts on at most; the rest take another submission.
pub const BULK_MAX: u32 = 1_000;

/// The jobs list's query: the filter, as the form sends it, and the page.
#[derive(Debug, Default, Deserialize)]
pub struct JobsQuery {
    pub state: Option<String>,
    pub kind: Option<String>,
    pub account: Option<String>,
    pub fail_code: Option<String>,
    pub priority: Option<String>,
    pub prefix: Option<String>,
    pub after: Option<i64>,
}

pub(crate) fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(super) fn nonempty(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

impl JobsQuery {
    /// The filter's part of a query string (no paging), to carry in links and forms.
    pub fn filter_query(&self) -> String {
        let pairs = [
            ("state", &self.state),
            ("kind", &self.kind),
            ("account", &self.account),
            ("fail_code", &self.fail_code),
            ("priority", &self.priority),
            ("prefix", &self.prefix),
        ];
        pairs
            .iter()
            .filter_map(|(k, v)| nonempty(v).map(|v| format!("{k}={}", urlencode(v))))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// The filter, within what the session's token may see.
    pub(super) fn filter(&self, scope: &settle_core::scope::Scope) -> Result<JobFilter, ApiError> {
        let bad = |what: &str| ApiError::invalid(format!("The {what} in the filter is not valid."));
        Ok(JobFilter {
            state: nonempty(&self.state).map(|s| JobState::parse(s).ok_or_else(|| bad("state"))).transpose()?,
            kind: nonempty(&self.kind).map(|k| JobKind::parse(k).map_err(|_| bad("kind"))).transpose()?,
            account_id: nonempty(&self.account).map(|a| AccountId::parse(a).map_err(|_| bad("account"))).transpose()?,
            fail_code: nonempty(&self.fail_code)
                .map(|c| FailCode::parse(c).map_err(|_| bad("fail code")))
                .transpose()?,
            priority: nonempty(&self.priority)
                .map(|p| p.parse::<u8>().ok().filter(|p| *p <= limits::JOB_PRIORITY_MAX).ok_or_else(|| bad("priority")))
                .transpose()?,
            id_prefix: nonempty(&self.prefix).map(str::to_owned),
            until_seq: None,
            scope: scope.clone(),
        })
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct EntriesQuery {
    pub kind: Option<String>,
    /// `YYYY-MM-DDTHH:MM` (a `datetime-local` field, read as UTC) or RFC 3339.
    pub since: Option<String>,
    pub after: Option<i64>,
    /// Recompute the account's hash chain (`chain=true`).
    pub chain: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::JobAction;

    #[test]
    fn job_actions_round_trip() {
        for a in JobAction::ALL {
            assert_eq!(JobAction::parse(a.as_str()), Some(a));
        }
        assert_eq!(JobAction::ALL.map(JobAction::as_str), ["requeue", "cancel"]);
        assert_eq!(JobAction::parse("delete"), None);
    }
}
