//! Validated identifiers. Construction is the only place input is checked; a value of one of
//! these types is known to be well-formed everywhere else.

use crate::limits::{
    ARTIFACT_KEY_LEN_MAX, DESTINATION_LEN_MAX, FAIL_CODE_LEN_MAX, ID_LEN_MAX, LABEL_LEN_MAX, WORKER_LEN_MAX,
};
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} must be {rule}")]
pub struct IdError {
    pub what: &'static str,
    pub rule: &'static str,
}

fn is_id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')
}

/// The spec's id rule. `.` and `..` are refused although their characters are allowed: every URL
/// client (browsers, Node, curl, Rust's `url`) removes such path segments, `%2e%2e` too, so
/// `/v1/jobs/J/items/../succeed` would arrive as `/v1/jobs/J/succeed` (decision 0017).
fn check_id(what: &'static str, s: &str) -> Result<(), IdError> {
    if s.is_empty() || s.len() > ID_LEN_MAX || !s.chars().all(is_id_char) || s == "." || s == ".." {
        return Err(IdError { what, rule: "1-128 characters of [A-Za-z0-9_.:-], and not '.' or '..'" });
    }
    Ok(())
}

macro_rules! client_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            pub fn parse(s: &str) -> Result<$name, IdError> {
                check_id($what, s)?;
                Ok($name(s.to_owned()))
            }
            /// An id read back from Settle's own database: checked when it was written, perhaps
            /// under an earlier rule (ids `.` and `..` were valid before decision 0017), so a
            /// background pass or a read never stops at a row the current rule would refuse.
            pub fn stored(s: &str) -> $name {
                debug_assert!(!s.is_empty() && s.len() <= ID_LEN_MAX, "a stored id is 1-128 characters");
                $name(s.to_owned())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            /// Honours a width and alignment (`{:<24}`): the operator commands print columns.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(&self.0)
            }
        }

        /// Its text, without a copy (a wire type's field).
        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        /// Compared with its text, as a `String` is (`job.kind == WITHDRAWAL_KIND`).
        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

client_id!(/// An account, chosen by the client.
    AccountId, "account id");
client_id!(/// A job, chosen by the client; also its idempotency key for create.
    JobId, "job id");
client_id!(/// An item within a job; `main` for a job created with a plain `cost`.
    ItemId, "item id");
client_id!(/// A grant's or adjustment's id: its idempotency key.
    RefId, "id");
client_id!(/// A job kind (`render`, `withdrawal`, …): selects retry policy and workers.
    JobKind, "job kind");

impl ItemId {
    /// The single item of a job created with a plain `cost`.
    pub fn main() -> ItemId {
        ItemId("main".to_owned())
    }
}

/// The name a worker gives itself in claims; recorded in the attempt log.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerName(String);

impl WorkerName {
    pub fn parse(s: &str) -> Result<WorkerName, IdError> {
        let ok =
            !s.is_empty() && s.len() <= WORKER_LEN_MAX && s.chars().all(|c| is_id_char(c) || matches!(c, '/' | '@'));
        if !ok {
            return Err(IdError { what: "worker", rule: "1-128 characters of [A-Za-z0-9_.:@/-]" });
        }
        Ok(WorkerName(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A failure code such as `NODE_DOWN`: upper-case, digits and `_`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FailCode(String);

impl FailCode {
    pub fn parse(s: &str) -> Result<FailCode, IdError> {
        let ok = !s.is_empty()
            && s.len() <= FAIL_CODE_LEN_MAX
            && s.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
        if !ok {
            return Err(IdError { what: "code", rule: "1-64 characters of [A-Z0-9_]" });
        }
        Ok(FailCode(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    pub fn lease_expired() -> FailCode {
        FailCode("LEASE_EXPIRED".to_owned())
    }
    pub fn timeout_confirmed_not_sent() -> FailCode {
        FailCode("TIMEOUT_CONFIRMED_NOT_SENT".to_owned())
    }
    /// A top-up whose charge the funding provider still did not know after the confirm window.
    pub fn timeout_confirmed_not_charged() -> FailCode {
        FailCode("TIMEOUT_CONFIRMED_NOT_CHARGED".to_owned())
    }
    pub fn cancelled() -> FailCode {
        FailCode("CANCELLED".to_owned())
    }
    /// An operator confirmed, by means outside Settle, that an unknown withdrawal was not sent.
    pub fn confirmed_not_sent() -> FailCode {
        FailCode("CONFIRMED_NOT_SENT".to_owned())
    }
    /// A payout attempt could not ask the provider whether its key exists; nothing was sent.
    pub fn lookup_failed() -> FailCode {
        FailCode("LOOKUP_FAILED".to_owned())
    }
}

impl fmt::Display for FailCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// A worker capability a job may require (`gpu:a100`, `region:eu`): 1-64 characters of
/// `[A-Za-z0-9_.:/=-]`, compared exactly.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label(String);

impl Label {
    pub fn parse(s: &str) -> Result<Label, IdError> {
        let ok = !s.is_empty()
            && s.len() <= LABEL_LEN_MAX
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '/' | '=' | '-'));
        if !ok {
            return Err(IdError { what: "label", rule: "1-64 characters of [A-Za-z0-9_.:/=-]" });
        }
        Ok(Label(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A set of labels in one canonical form — sorted, each once — so equal sets have equal text: a
/// job's requirements are stored and compared as `Labels::text`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Labels(Vec<Label>);

impl Labels {
    /// At most `max` distinct labels (duplicates are folded before counting).
    pub fn parse<S: AsRef<str>>(labels: &[S], max: usize) -> Result<Labels, IdError> {
        let mut set = labels.iter().map(|l| Label::parse(l.as_ref())).collect::<Result<Vec<_>, _>>()?;
        set.sort();
        set.dedup();
        if set.len() > max {
            return Err(IdError { what: "labels", rule: "at most 8 distinct labels for a job, 64 for a worker" });
        }
        Ok(Labels(set))
    }
    /// Labels stored by Settle itself, in `text`'s form.
    pub fn stored(text: &str) -> Labels {
        Labels(text.split(' ').filter(|l| !l.is_empty()).map(|l| Label(l.to_owned())).collect())
    }
    /// The canonical text: the labels in order, each followed by nothing but one space between
    /// (`""` for none). No label holds a space.
    pub fn text(&self) -> String {
        self.0.iter().map(Label::as_str).collect::<Vec<_>>().join(" ")
    }
    pub fn iter(&self) -> impl Iterator<Item = &Label> {
        self.0.iter()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Whether every label of `self` is in `have`.
    pub fn covered_by(&self, have: &Labels) -> bool {
        self.0.iter().all(|l| have.0.binary_search(l).is_ok())
    }
}

/// A key in the artifact store: a relative path of safe characters, no `..`, no empty segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ArtifactKey(String);

impl ArtifactKey {
    pub fn parse(s: &str) -> Result<ArtifactKey, IdError> {
        let chars_ok = s.chars().all(|c| is_id_char(c) || c == '/');
        let segments_ok = s.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != "..");
        if s.is_empty() || s.len() > ARTIFACT_KEY_LEN_MAX || !chars_ok || !segments_ok {
            return Err(IdError {
                what: "artifact key",
                rule: "a relative path of 1-512 characters of [A-Za-z0-9_.:/-] without '.', '..' or empty segments",
            });
        }
        Ok(ArtifactKey(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Where the artifact lives in the artifact store: under its job's and item's own prefix,
    /// `{job_id}/{item_id}/{key}`, so no worker can name (and no teardown delete) another job's
    /// object. An id made before ids `.` and `..` were refused (decision 0017) may still be one of
    /// them, which a path must not: those two are written with their dots as `%2E` (`%` is no id
    /// character, so nothing else reads alike).
    pub fn path_in(&self, job_id: &str, item_id: &str) -> String {
        fn segment(id: &str) -> std::borrow::Cow<'_, str> {
            if id == "." || id == ".." { id.replace('.', "%2E").into() } else { id.into() }
        }
        format!("{}/{}/{}", segment(job_id), segment(item_id), self.0)
    }
}

/// Where a withdrawal pays out (an account number, an address): 1-256 printable ASCII characters,
/// not starting or ending with a space. The provider decides whether it is valid.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Destination(String);

impl Destination {
    pub fn parse(s: &str) -> Result<Destination, IdError> {
        let ok = !s.is_empty()
            && s.len() <= DESTINATION_LEN_MAX
            && s.bytes().all(|b| (0x20..=0x7e).contains(&b))
            && !s.starts_with(' ')
            && !s.ends_with(' ');
        if !ok {
            return Err(IdError {
                what: "destination",
                rule: "1-256 printable ASCII characters, not starting or ending with a space",
            });
        }
        Ok(Destination(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Who the funding provider charges for a top-up (its customer reference): the same rule as a
/// destination. The provider decides whether it is valid.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Customer(String);

impl Customer {
    pub fn parse(s: &str) -> Result<Customer, IdError> {
        Destination::parse(s).map(|d| Customer(d.0)).map_err(|_| IdError {
            what: "customer",
            rule: "1-256 printable ASCII characters, not starting or ending with a space",
        })
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41: `settle withdrawals list` drifted because ids printed no padding.
    #[test]
    fn ids_and_credits_honour_a_width() {
        assert_eq!(format!("{:<6}|", JobId::parse("ab").unwrap()), "ab    |");
        assert_eq!(format!("{:>4}|", FailCode::parse("X").unwrap()), "   X|");
        assert_eq!(format!("{:>+5}|", crate::Credits::new(3)), "   +3|");
    }

    #[test]
    fn ids_follow_the_spec_alphabet() {
        assert!(JobId::parse("job-1:a_b.c").is_ok());
        assert!(JobId::parse("").is_err());
        assert!(JobId::parse(&"x".repeat(128)).is_ok());
        assert!(JobId::parse(&"x".repeat(129)).is_err());
        assert!(JobId::parse("a b").is_err());
        assert!(JobId::parse("é").is_err());
        assert!(JobId::parse("a/b").is_err());
        // URL clients remove these two path segments, so they would address another route.
        for dots in [".", ".."] {
            assert!(JobId::parse(dots).is_err() && ItemId::parse(dots).is_err(), "{dots}");
            assert!(AccountId::parse(dots).is_err() && RefId::parse(dots).is_err() && JobKind::parse(dots).is_err());
        }
        for fine in ["...", ".a", "a.", "..a", "a..b"] {
            assert!(JobId::parse(fine).is_ok(), "{fine}");
        }
    }

    #[test]
    fn ids_compare_with_and_give_up_their_text() {
        let kind = JobKind::parse("withdrawal").unwrap();
        assert!(kind == "withdrawal" && kind == *"withdrawal" && kind != "render");
        assert_eq!(String::from(JobId::parse("j-1").unwrap()), "j-1");
    }

    #[test]
    fn labels_are_one_canonical_set() {
        let a = Labels::parse(&["region:eu", "gpu:a100", "gpu:a100"], 8).unwrap();
        assert_eq!(a.text(), "gpu:a100 region:eu");
        assert_eq!(Labels::stored(&a.text()), a);
        assert_eq!(Labels::stored(""), Labels::default());
        assert!(a.covered_by(&Labels::parse(&["x", "region:eu", "gpu:a100"], 64).unwrap()));
        assert!(!a.covered_by(&Labels::parse(&["gpu:a100"], 64).unwrap()));
        assert!(Labels::default().covered_by(&Labels::default()));
        for bad in ["", "a b", "é", &"x".repeat(65)] {
            assert!(Label::parse(bad).is_err(), "{bad:?}");
        }
        let nine: Vec<String> = (0..9).map(|i| format!("l{i}")).collect();
        assert!(Labels::parse(&nine, 8).is_err() && Labels::parse(&nine, 64).is_ok());
    }

    #[test]
    fn artifact_keys_stay_inside_the_store() {
        assert!(ArtifactKey::parse("job-1/frame-0001.png").is_ok());
        for bad in ["", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a b"] {
            assert!(ArtifactKey::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn destinations_are_printable_and_bounded() {
        assert!(Destination::parse("bc1q-test addr:42").is_ok());
        assert!(Destination::parse(&"d".repeat(256)).is_ok());
        for bad in [String::new(), "d".repeat(257), " lead".into(), "trail ".into(), "tab\there".into(), "é".into()] {
            assert!(Destination::parse(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn fail_codes_are_upper_snake() {
        assert!(FailCode::parse("NODE_DOWN").is_ok());
        assert!(FailCode::parse("node_down").is_err());
        assert!(FailCode::parse("").is_err());
    }

    #[test]
    fn worker_names_codes_keys_and_destinations_keep_their_rules() {
        let long = |n: usize| "w".repeat(n);
        for ok in ["w1", "gpu-node_3.eu:7", "pool/a@host", &long(WORKER_LEN_MAX)] {
            assert_eq!(WorkerName::parse(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "has space", "ünï", &long(WORKER_LEN_MAX + 1)] {
            assert!(WorkerName::parse(bad).is_err(), "{bad:?}");
        }
        let code = FailCode::parse("NODE_DOWN").unwrap();
        assert_eq!((code.as_str(), code.to_string()), ("NODE_DOWN", "NODE_DOWN".to_owned()));
        let key = format!("{}/x", "k".repeat(ARTIFACT_KEY_LEN_MAX - 2));
        assert_eq!(ArtifactKey::parse(&key).unwrap().as_str(), key, "exactly the longest key");
        assert!(ArtifactKey::parse(&format!("{key}y")).is_err(), "one longer");
        assert!(ArtifactKey::parse("a//b").is_err() && ArtifactKey::parse("a/../b").is_err());
        let to = Destination::parse("DE00 1234").unwrap();
        assert_eq!(to.as_str(), "DE00 1234");
    }

    #[test]
    fn an_artifact_lives_under_its_own_job_and_item() {
        let key = ArtifactKey::parse("out/frame.png").unwrap();
        assert_eq!(key.path_in("render-1", "f1"), "render-1/f1/out/frame.png");
        // Two jobs with the same key never share an object.
        assert_ne!(key.path_in("a", "i"), key.path_in("b", "i"));
        // Ids that a path would read as "here" or "up" stay one segment of their own.
        assert_eq!(key.path_in("..", "."), "%2E%2E/%2E/out/frame.png");
        for bad in ["../x", "/abs", "a//b", "a/./b", "", "a/"] {
            assert!(ArtifactKey::parse(bad).is_err(), "{bad}");
        }
    }
}
