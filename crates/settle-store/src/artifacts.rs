//! Where workers' artifacts live, so teardown can delete those of undelivered items.
//!
//! Workers write their outputs themselves, at the path the register answer gives
//! (`{job_id}/{item_id}/{key}`, under the store's root); Settle only ever deletes. The store is
//! named by a location: a directory (`file:///srv/artifacts`, or a plain path), an S3 bucket or
//! S3-compatible store (`s3://bucket/prefix`), or `memory://` for tests — all through the
//! `object_store` crate.

use async_trait::async_trait;
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[async_trait]
pub trait ArtifactStore: Send + Sync {
    /// Where the store is (`file:///srv/artifacts`, `s3://bucket/prefix`), without credentials:
    /// recorded with each artifact, so a teardown run against another store refuses.
    fn location(&self) -> String;

    /// Deletes `key`. A key that is already gone is a success: teardown re-runs cleanup in full.
    async fn delete(&self, key: &str) -> Result<(), String>;

    /// Deletes every key (each as `delete` would); the first failure is returned, and a later
    /// pass deletes again whatever is left.
    async fn delete_all(&self, keys: &[String]) -> Result<(), String> {
        for key in keys {
            self.delete(key).await?;
        }
        Ok(())
    }
}

/// A location that names no artifact store Settle can open.
#[derive(Debug, thiserror::Error)]
#[error("artifact store {location}: {message}")]
pub struct ArtifactsError {
    pub location: String,
    pub message: String,
}

/// Why a store's check failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreCheck {
    #[error("artifact store misconfigured: {0}")]
    Misconfigured(String),
    #[error("artifact store unreachable: {0}")]
    Unreachable(String),
}

/// How long one request to a remote store may take, and how long its retries may go on: a
/// teardown that cannot delete now leaves the job `cancelling`, and the sweeper's next pass
/// deletes again — a slow store must not hold the sweeper (or a cancel request) for minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const RETRY_FOR: Duration = Duration::from_secs(8);
const RETRIES: usize = 2;
/// A whole `delete_all` (or `check`) ends by then, whatever the settings say.
const DEADLINE: Duration = Duration::from_secs(10);
/// After the store failed to answer, deletes fail at once for this long: one pass of the sweeper
/// over a hundred cancelling jobs waits for the store once, not a hundred times.
const UNREACHABLE_FOR: Duration = Duration::from_secs(5);
/// The file that marks a directory as the artifact store: a delete in a directory without it (a
/// volume not mounted) is refused rather than taken for "already gone".
pub const DIRECTORY_MARKER: &str = ".settle-artifacts";
/// What `check` deletes to learn whether the bucket exists and lets Settle delete (S3 answers the
/// delete of a missing key with success).
const PROBE: &str = ".settle-probe";

/// Artifacts in an object store, under a root prefix.
#[derive(Debug, Clone)]
pub struct ObjectArtifactStore {
    store: Arc<dyn ObjectStore>,
    root: ObjectPath,
    location: String,
    kind: Kind,
    /// Since when the store has not answered (see `UNREACHABLE_FOR`).
    unreachable_since: Arc<Mutex<Option<Instant>>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// "Not found" from a delete means the file is gone; the root must hold the marker.
    Directory(std::path::PathBuf),
    Memory,
    /// S3 answers a delete of a missing key with success: its "not found" is the bucket's, and a
    /// teardown that took a misnamed bucket for deleted artifacts would leave the real ones behind.
    S3,
}

impl ObjectArtifactStore {
    /// Opens the store a location names: `file:///abs/dir` or a plain path (a directory, created
    /// if missing), `s3://bucket[/prefix]` (credentials, region and endpoint from the standard
    /// `AWS_*` environment variables; `AWS_ENDPOINT_URL` for S3-compatible stores, whose `http://`
    /// endpoints are allowed), or `memory://`.
    pub fn open(location: &str) -> Result<ObjectArtifactStore, ArtifactsError> {
        ObjectArtifactStore::open_with(location, std::iter::empty::<(String, String)>())
    }

    /// `open` with S3 settings given here rather than in the environment (they win over it):
    /// `object_store`'s keys, such as `aws_endpoint`, `aws_access_key_id`, `aws_region`.
    pub fn open_with(
        location: &str,
        settings: impl IntoIterator<Item = (impl AsRef<str>, impl Into<String>)>,
    ) -> Result<ObjectArtifactStore, ArtifactsError> {
        let fail = |message: String| ArtifactsError { location: redacted(location), message };
        let Some((scheme, rest)) = location.split_once("://") else {
            return ObjectArtifactStore::local(location);
        };
        match scheme {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(fail("a file location is an absolute path: file:///srv/artifacts".into()));
                }
                ObjectArtifactStore::local(rest)
            }
            "memory" => {
                if !rest.is_empty() {
                    return Err(fail("memory:// takes no path".into()));
                }
                Ok(ObjectArtifactStore::memory())
            }
            "s3" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(fail("name the bucket: s3://bucket/prefix".into()));
                }
                if !valid_bucket(bucket) {
                    return Err(fail(
                        "a bucket name is 3-63 characters of a-z, 0-9, '.' and '-', beginning and ending with a letter or digit"
                            .into(),
                    ));
                }
                let root = ObjectPath::parse(prefix).map_err(|e| fail(format!("prefix: {e}")))?;
                let (store, endpoint) = s3(bucket, settings).map_err(|e| fail(e.to_string()))?;
                // The endpoint is part of where the objects are: the same bucket name at another
                // S3-compatible store is another store.
                let location = match endpoint {
                    Some(e) => format!("s3://{bucket}/{root}?endpoint={}", e.trim_end_matches('/')),
                    None => format!("s3://{bucket}/{root}"),
                };
                Ok(ObjectArtifactStore::new(store, root, location, Kind::S3))
            }
            other => Err(fail(format!("unknown scheme {other}:// (file://, s3:// or memory://)"))),
        }
    }

    /// Opens a store as an artifact row recorded it (`location()` of the store it was registered
    /// in), for its teardown: a directory must exist with its marker (it is never created here);
    /// an S3 location's endpoint is taken from it, credentials from the environment.
    pub fn open_recorded(location: &str) -> Result<ObjectArtifactStore, ArtifactsError> {
        let fail = |message: &str| ArtifactsError { location: redacted(location), message: message.to_owned() };
        if let Some(dir) = location.strip_prefix("file://") {
            if !std::path::Path::new(dir).join(DIRECTORY_MARKER).is_file() {
                return Err(fail(
                    "the directory it was registered in is not there (or not marked): is it mounted here?",
                ));
            }
            return ObjectArtifactStore::local(dir);
        }
        if location.starts_with("s3://") {
            return match location.split_once("?endpoint=") {
                Some((at, endpoint)) => ObjectArtifactStore::open_with(at, [("aws_endpoint", endpoint)]),
                None => ObjectArtifactStore::open(location),
            };
        }
        Err(fail("a store of another process (memory://) or of an unknown kind: its artifacts cannot be reached"))
    }

    /// Artifacts as files under `dir`. A directory that does not exist is created and marked as
    /// the artifact store (`DIRECTORY_MARKER`); one that exists must carry the marker — an empty
    /// mount point (a volume not mounted) is not taken for a store whose files are all gone, at
    /// start or later (deletes check it too). A directory of artifacts from before markers is
    /// marked by hand: `touch DIR/.settle-artifacts`.
    pub fn local(dir: impl AsRef<std::path::Path>) -> Result<ObjectArtifactStore, ArtifactsError> {
        let dir = dir.as_ref();
        let fail = |message: String| ArtifactsError { location: dir.display().to_string(), message };
        let created = !dir.exists();
        if created {
            std::fs::create_dir_all(dir).map_err(|e| fail(format!("create the directory: {e}")))?;
        } else if !dir.is_dir() {
            return Err(fail("not a directory".into()));
        }
        let dir = dir.canonicalize().map_err(|e| fail(e.to_string()))?;
        let marker = dir.join(DIRECTORY_MARKER);
        if created {
            let note = "Settle's artifact store: teardown deletes undelivered items' artifacts here.\n";
            std::fs::write(&marker, note).map_err(|e| fail(format!("write {}: {e}", marker.display())))?;
        } else if !marker.exists() {
            return Err(fail(format!(
                "the directory exists but is not marked as Settle's artifact store ({DIRECTORY_MARKER} is missing): \
                 if the volume is not mounted, mount it; if this is the store, `touch {}`",
                marker.display()
            )));
        }
        let store = object_store::local::LocalFileSystem::new_with_prefix(&dir).map_err(|e| fail(e.to_string()))?;
        let location = format!("file://{}", dir.display());
        Ok(ObjectArtifactStore::new(Arc::new(store), ObjectPath::default(), location, Kind::Directory(dir)))
    }

    /// Artifacts in this process's memory (tests; a worker in another process cannot write there).
    pub fn memory() -> ObjectArtifactStore {
        let store = Arc::new(object_store::memory::InMemory::new());
        ObjectArtifactStore::new(store, ObjectPath::default(), "memory://".into(), Kind::Memory)
    }

    fn new(store: Arc<dyn ObjectStore>, root: ObjectPath, location: String, kind: Kind) -> ObjectArtifactStore {
        ObjectArtifactStore { store, root, location, kind, unreachable_since: Arc::default() }
    }

    /// The location, without credentials (they never appear in one).
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Whether this is `memory://` (no other process can write there).
    pub fn is_memory(&self) -> bool {
        self.kind == Kind::Memory
    }

    /// Where an artifact's path (the register answer's `path`) is in the object store.
    pub fn object_path(&self, path: &str) -> Result<ObjectPath, String> {
        let rel = ObjectPath::parse(path).map_err(|e| format!("artifact path {path}: {e}"))?;
        if rel.as_ref().is_empty() {
            return Err(format!("artifact path {path:?} is empty"));
        }
        Ok(if self.root.as_ref().is_empty() { rel } else { self.root.parts().chain(rel.parts()).collect() })
    }

    /// Asks the store whether Settle can delete there, by deleting a key that is not there
    /// (`.settle-probe` under the root; a directory: its marker is checked). A bucket that does not
    /// exist, refuses Settle's credentials or its deletes, or lives in another region is
    /// `Misconfigured` (`settle serve` refuses to start); one that does not answer now is
    /// `Unreachable` (a warning: teardowns wait for it).
    pub async fn check(&self) -> Result<(), StoreCheck> {
        if let Kind::Directory(dir) = &self.kind {
            return self.marked(dir).map_err(StoreCheck::Misconfigured);
        }
        let probe = self.object_path(PROBE).map_err(StoreCheck::Misconfigured)?;
        let store = self.store.clone();
        // Through the same bulk delete teardown uses (a store without it fails here, not later).
        let asked = tokio::time::timeout(DEADLINE, async move {
            let mut answers = store.delete_stream(futures_util::stream::iter([Ok(probe)]).boxed());
            answers.next().await.unwrap_or(Ok(ObjectPath::default())).map(drop)
        })
        .await;
        let e = match asked {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => return Err(StoreCheck::Unreachable(format!("{}: no answer within {DEADLINE:?}", self.location))),
        };
        let message = format!("{}: {e}", self.location);
        Err(if refused(&e) { StoreCheck::Misconfigured(message) } else { StoreCheck::Unreachable(message) })
    }

    /// A directory store's root still holds its marker (else it is not the store: unmounted, moved).
    fn marked(&self, dir: &std::path::Path) -> Result<(), String> {
        let marker = dir.join(DIRECTORY_MARKER);
        match marker.try_exists() {
            Ok(true) => Ok(()),
            Ok(false) => Err(format!(
                "{}: {} is missing — is the volume mounted? (deletes there would find nothing and count as done)",
                self.location,
                marker.display()
            )),
            Err(e) => Err(format!("{}: {}: {e}", self.location, marker.display())),
        }
    }

    /// Writes an artifact (what a worker in this process does: the demo, tests).
    pub async fn put(&self, path: &str, bytes: Vec<u8>) -> Result<(), String> {
        let at = self.object_path(path)?;
        self.store.put(&at, bytes.into()).await.map(|_| ()).map_err(|e| format!("put {path}: {e}"))
    }

    /// Whether an artifact is there.
    pub async fn exists(&self, path: &str) -> Result<bool, String> {
        let at = self.object_path(path)?;
        match self.store.head(&at).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(format!("head {path}: {e}")),
        }
    }
}

/// Whether an error is the store's refusal (no such bucket, access denied, bad credentials, another
/// region) rather than no answer. object_store keeps the HTTP status in an error type it does not
/// export, so the message is read for the statuses and S3's codes.
fn refused(e: &object_store::Error) -> bool {
    if matches!(
        e,
        object_store::Error::NotFound { .. }
            | object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. }
    ) {
        return true;
    }
    let text = e.to_string();
    ["status code: 400", "status code: 401", "status code: 403", "status code: 404", "status code: 301"]
        .iter()
        .chain(&["NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "redirect"])
        .any(|needle| text.contains(needle))
}

/// A location as it may be shown: credentials someone put in it (`s3://key:secret@bucket`) are not.
fn redacted(location: &str) -> String {
    match location.split_once("://") {
        Some((scheme, rest)) => {
            let authority = rest.split('/').next().unwrap_or("");
            match authority.rsplit_once('@') {
                Some((_, host)) => format!("{scheme}://***@{host}{}", &rest[authority.len()..]),
                None => location.to_owned(),
            }
        }
        None => location.to_owned(),
    }
}

/// Whether an error is the store not answering (no connection, a timeout, a 5xx after the
/// retries) rather than an answer about these keys.
fn unanswered(e: &object_store::Error) -> bool {
    if refused(e) {
        return false;
    }
    let text = e.to_string().to_ascii_lowercase();
    ["error sending request", "connect", "timed out", "timeout", "dns", "status code: 5", "connection"]
        .iter()
        .any(|needle| text.contains(needle))
}

/// What a worker wrote under keys used as directories (`frames/0001.png` under the key `frames`).
/// A directory store removes such a directory whole here (files and empty folders; a symlink is
/// removed, never followed) and returns nothing; an object store is listed once per job prefix
/// (one LIST request a page, whatever the number of keys) and returns the objects under `key/`,
/// for the caller to delete with the keys.
async fn under_keys(
    store: &Arc<dyn ObjectStore>,
    kind: &Kind,
    root_len: usize,
    paths: &[ObjectPath],
) -> Result<Vec<ObjectPath>, object_store::Error> {
    if let Kind::Directory(dir) = kind {
        let dirs: Vec<std::path::PathBuf> = paths.iter().map(|p| dir.join(p.as_ref())).collect();
        let removed = tokio::task::spawn_blocking(move || {
            for d in dirs {
                if std::fs::symlink_metadata(&d).is_ok_and(|m| m.is_dir()) {
                    std::fs::remove_dir_all(&d).map_err(|e| format!("remove the directory {}: {e}", d.display()))?;
                }
            }
            Ok::<(), String>(())
        })
        .await;
        return match removed {
            Ok(Ok(())) => Ok(Vec::new()),
            Ok(Err(message)) => Err(object_store::Error::Generic { store: "LocalFileSystem", source: message.into() }),
            Err(e) => Err(object_store::Error::Generic { store: "LocalFileSystem", source: Box::new(e) }),
        };
    }
    let keys: std::collections::BTreeSet<&str> = paths.iter().map(|p| p.as_ref()).collect();
    let mut prefixes: Vec<ObjectPath> = Vec::new();
    for p in paths {
        // `{root}/{job}/{item}/{key}`: the job's folder holds every key this teardown names.
        let prefix: ObjectPath = p.parts().take(root_len + 1).collect();
        if !prefixes.contains(&prefix) {
            prefixes.push(prefix);
        }
    }
    let mut under = Vec::new();
    for prefix in prefixes {
        let mut listed = store.list(Some(&prefix));
        while let Some(meta) = listed.next().await {
            let at = meta?.location;
            let inside = |key: &&str| at.as_ref().strip_prefix(*key).is_some_and(|rest| rest.starts_with('/'));
            if keys.iter().any(inside) {
                under.push(at);
            }
        }
    }
    Ok(under)
}

/// S3's bucket naming rules (3-63 of `a-z0-9.-`, a letter or digit at each end): a location with
/// anything else (credentials, `user@`) is refused before it can be echoed in logs.
fn valid_bucket(b: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    (3..=63).contains(&b.len())
        && b.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
        && edge(b.chars().next())
        && edge(b.chars().last())
}

/// An S3 client whose requests give up soon (see `REQUEST_TIMEOUT`); `http://` endpoints allowed,
/// since an operator who names one means it (a store on the same network, MinIO, moto).
/// Returns the client and the endpoint it was given, if any.
fn s3(
    bucket: &str,
    settings: impl IntoIterator<Item = (impl AsRef<str>, impl Into<String>)>,
) -> Result<(Arc<dyn ObjectStore>, Option<String>), object_store::Error> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    use object_store::{BackoffConfig, ClientConfigKey, RetryConfig};
    // reqwest is built without a TLS provider of its own: Settle's is rustls on ring. Installing
    // it fails only when a provider is already installed, which is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Settle's timeouts first, then the environment's `AWS_*` (as `from_env` reads them), then
    // the settings given: each may override what came before.
    let mut builder = AmazonS3Builder::new()
        .with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), format!("{}s", REQUEST_TIMEOUT.as_secs()))
        .with_config(
            AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
            format!("{}s", CONNECT_TIMEOUT.as_secs()),
        );
    for (key, value) in std::env::vars() {
        if key.starts_with("AWS_")
            && let Ok(key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>()
        {
            builder = builder.with_config(key, value);
        }
    }
    for (key, value) in settings {
        let key: AmazonS3ConfigKey = key.as_ref().parse()?;
        builder = builder.with_config(key, value);
    }
    let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
    if let Some(endpoint) = &endpoint {
        let authority = endpoint.split("://").nth(1).unwrap_or(endpoint).split('/').next().unwrap_or("");
        if authority.contains('@') {
            return Err(object_store::Error::Generic {
                store: "S3",
                source: "the endpoint carries credentials (user@host): give them in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                    .into(),
            });
        }
        if endpoint.starts_with("http://") {
            builder = builder.with_allow_http(true);
        }
    }
    let store = builder
        .with_bucket_name(bucket)
        .with_retry(RetryConfig { backoff: BackoffConfig::default(), max_retries: RETRIES, retry_timeout: RETRY_FOR })
        .build()?;
    Ok((Arc::new(store), endpoint))
}

#[async_trait]
impl ArtifactStore for ObjectArtifactStore {
    fn location(&self) -> String {
        self.location.clone()
    }

    async fn delete(&self, key: &str) -> Result<(), String> {
        self.delete_all(&[key.to_owned()]).await
    }

    /// One stream of deletes (S3 sends them 1,000 to a request); every key must come back deleted.
    /// A missing file is deleted; a missing bucket, a directory without its marker, a refusal, no
    /// answer within `DEADLINE` are errors. Run on a task of its own, so a panic in the client
    /// fails this teardown, not the loop that runs it.
    async fn delete_all(&self, keys: &[String]) -> Result<(), String> {
        let fail = |message: String| format!("delete from {}: {message}", self.location);
        if let Some(since) = *self.unreachable_since.lock().expect("not poisoned")
            && since.elapsed() < UNREACHABLE_FOR
        {
            let ago = since.elapsed().as_secs_f64();
            return Err(fail(format!("the store did not answer {ago:.1} s ago; trying again soon")));
        }
        if let Kind::Directory(dir) = &self.kind {
            self.marked(dir)?;
        }
        let paths = keys.iter().map(|k| self.object_path(k)).collect::<Result<Vec<_>, String>>().map_err(fail)?;
        let (store, kind, gone_if_missing, expected) =
            (self.store.clone(), self.kind.clone(), self.kind != Kind::S3, keys.len());
        let root_len = self.root.parts().count();
        let work = tokio::spawn(tokio::time::timeout(DEADLINE, async move {
            // A key is one object; a worker that wrote under it as a directory meant what it wrote
            // there as the key's too (decision 0028 §6): that goes first, the keys after.
            let under = under_keys(&store, &kind, root_len, &paths).await?;
            let mut deleted = 0;
            let all = under.into_iter().chain(paths).map(Ok);
            let mut results = store.delete_stream(futures_util::stream::iter(all).boxed());
            while let Some(r) = results.next().await {
                match r {
                    Ok(_) => deleted += 1,
                    Err(object_store::Error::NotFound { .. }) if gone_if_missing => deleted += 1,
                    Err(e) => return Err(e),
                }
            }
            Ok(deleted)
        }));
        let no_answer = match work.await {
            Ok(Ok(Ok(deleted))) if deleted >= expected => return Ok(()),
            Ok(Ok(Ok(deleted))) => return Err(fail(format!("{deleted} of {expected} keys answered deleted"))),
            // Only a store that did not answer holds the others back: an error of this job's own
            // (a key refused, a file that will not go) fails this job alone, every pass.
            Ok(Ok(Err(e))) if !unanswered(&e) => return Err(fail(e.to_string())),
            Ok(Ok(Err(e))) => e.to_string(),
            Ok(Err(_)) => format!("no answer within {DEADLINE:?}"),
            Err(e) => return Err(fail(format!("the delete failed: {e}"))),
        };
        *self.unreachable_since.lock().expect("not poisoned") = Some(Instant::now());
        Err(fail(no_answer))
    }
}
