//! What a scoped token may see and move (decision 0018): some accounts (by exact id or by id
//! prefix) and some job kinds. An unscoped token — every admin token, and client and worker tokens
//! configured without a scope — sees everything, as before scopes existed.

use crate::ids::{AccountId, IdError, JobKind};

/// Accounts a scope names: exactly one id, or every id starting with a prefix (`acme-*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountPattern {
    Exact(String),
    Prefix(String),
}

impl AccountPattern {
    /// `acme-7` (exact) or `acme-*` (a prefix; `*` only at the end, after at least one character).
    pub fn parse(s: &str) -> Result<AccountPattern, IdError> {
        let bad = IdError { what: "account pattern", rule: "an account id, or an id prefix followed by '*'" };
        match s.strip_suffix('*') {
            Some(prefix) => {
                // A prefix is the start of an id: the id alphabet, at most an id long, no `*`.
                let ok = !prefix.is_empty()
                    && prefix.len() < crate::limits::ID_LEN_MAX
                    && prefix.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
                if ok { Ok(AccountPattern::Prefix(prefix.to_owned())) } else { Err(bad) }
            }
            None => AccountId::parse(s).map(|a| AccountPattern::Exact(a.as_str().to_owned())).map_err(|_| bad),
        }
    }

    pub fn matches(&self, account: &str) -> bool {
        match self {
            AccountPattern::Exact(id) => account == id,
            AccountPattern::Prefix(p) => account.starts_with(p.as_str()),
        }
    }
}

/// A token's scope. `None` in a field means "all"; a scope is never empty (`Some(vec![])` is
/// refused where scopes are configured: a token that may see nothing is a mistake).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Scope {
    pub accounts: Option<Vec<AccountPattern>>,
    pub kinds: Option<Vec<JobKind>>,
}

impl Scope {
    /// Everything: an unscoped token.
    pub const ALL: Scope = Scope { accounts: None, kinds: None };

    pub fn is_all(&self) -> bool {
        self.accounts.is_none() && self.kinds.is_none()
    }

    pub fn account(&self, account: &str) -> bool {
        self.accounts.as_ref().is_none_or(|ps| ps.iter().any(|p| p.matches(account)))
    }

    pub fn kind(&self, kind: &str) -> bool {
        self.kinds.as_ref().is_none_or(|ks| ks.iter().any(|k| k.as_str() == kind))
    }

    /// A job (by its account and kind) is in scope when both are.
    pub fn job(&self, account: &str, kind: &str) -> bool {
        self.account(account) && self.kind(kind)
    }

    /// `accounts=acme-*,bob kinds=render` (either or both; the words of a token file line).
    pub fn parse_words<'a>(words: impl IntoIterator<Item = &'a str>) -> Result<Scope, String> {
        let mut scope = Scope::ALL;
        for word in words {
            let Some((key, list)) = word.split_once('=') else {
                return Err(format!("expected accounts=… or kinds=…, not {word:?}"));
            };
            let items: Vec<&str> = list.split(',').collect();
            if items.iter().any(|i| i.is_empty()) {
                return Err(format!("{key}= needs a comma-separated list without empty entries"));
            }
            match key {
                "accounts" if scope.accounts.is_none() => {
                    let patterns = items.iter().map(|i| AccountPattern::parse(i)).collect::<Result<Vec<_>, _>>();
                    scope.accounts = Some(patterns.map_err(|e| format!("accounts=: {e}"))?);
                }
                "kinds" if scope.kinds.is_none() => {
                    let kinds = items.iter().map(|i| JobKind::parse(i)).collect::<Result<Vec<_>, _>>();
                    scope.kinds = Some(kinds.map_err(|e| format!("kinds=: {e}"))?);
                }
                "accounts" | "kinds" => return Err(format!("{key}= is given twice")),
                other => return Err(format!("unknown scope {other}= (accounts= or kinds=)")),
            }
        }
        Ok(scope)
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_all() {
            return f.write_str("all");
        }
        let mut words = Vec::new();
        if let Some(ps) = &self.accounts {
            let list: Vec<String> = ps
                .iter()
                .map(|p| match p {
                    AccountPattern::Exact(id) => id.clone(),
                    AccountPattern::Prefix(p) => format!("{p}*"),
                })
                .collect();
            words.push(format!("accounts={}", list.join(",")));
        }
        if let Some(ks) = &self.kinds {
            let list: Vec<&str> = ks.iter().map(JobKind::as_str).collect();
            words.push(format!("kinds={}", list.join(",")));
        }
        f.write_str(&words.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_name_accounts_exactly_or_by_prefix_and_kinds_exactly() {
        let s = Scope::parse_words(["accounts=acme-*,bob", "kinds=render,thumb"]).unwrap();
        assert_eq!(s.to_string(), "accounts=acme-*,bob kinds=render,thumb");
        for (account, kind, inside) in [
            ("acme-1", "render", true),
            ("acme-", "thumb", true),
            ("bob", "render", true),
            ("bobby", "render", false),
            ("acme", "render", false),
            ("xacme-1", "render", false),
            ("acme-1", "withdrawal", false),
            ("acme-1", "render2", false),
        ] {
            assert_eq!(s.job(account, kind), inside, "{account} {kind}");
        }
        assert!(Scope::ALL.job("anyone", "anything") && Scope::ALL.is_all());
        let accounts_only = Scope::parse_words(["accounts=a"]).unwrap();
        assert!(accounts_only.kind("anything") && !accounts_only.account("b"));
        for bad in [
            vec!["accounts="],
            vec!["accounts=a,,b"],
            vec!["accounts=*"],
            vec!["accounts=a*b"],
            vec!["accounts=a b"],
            vec!["accounts=.."],
            vec!["kinds=.."],
            vec!["kinds=a*"],
            vec!["accounts=a", "accounts=b"],
            vec!["roles=admin"],
            vec!["accounts"],
        ] {
            assert!(Scope::parse_words(bad.clone()).is_err(), "{bad:?}");
        }
    }
}
