//! Where workers' artifacts live, so teardown can delete those of undelivered items.
//!
//! Workers write their outputs themselves, at the path the register answer gives
//! (`{job_id}/{item_id}/{key}`, under the store's root); Settle only ever deletes. The store is
//! named by a location: a directory (`file:///srv/artifacts`, or a plain path), an S3 bucket or
//! S3-compatible store (`s3://bucket/prefix`), or `memory://` for tests — all through the
//! `object_store` crate.

use async_trait::async_trait;
use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::sync::Arc;
use std::time::Duration;

#[async_trait]
pub trait ArtifactStore: Send + Sync {
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
/// deletes again — a slow store must not hold the sweeper for minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RETRY_FOR: Duration = Duration::from_secs(15);
const RETRIES: usize = 3;

/// Artifacts in an object store, under a root prefix.
#[derive(Debug, Clone)]
pub struct ObjectArtifactStore {
    store: Arc<dyn ObjectStore>,
    root: ObjectPath,
    location: String,
    /// Whether "not found" from a delete means the object is gone (a directory). S3 answers a
    /// delete of a missing key with success; its "not found" is the bucket's, and a teardown that
    /// took a misnamed bucket for deleted artifacts would leave the real ones behind.
    not_found_is_gone: bool,
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
        let fail = |message: String| ArtifactsError { location: location.to_owned(), message };
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
                let root = ObjectPath::parse(prefix).map_err(|e| fail(format!("prefix: {e}")))?;
                let store = s3(bucket, settings).map_err(|e| fail(e.to_string()))?;
                let location = format!("s3://{bucket}/{root}");
                Ok(ObjectArtifactStore { store, root, location, not_found_is_gone: false })
            }
            other => Err(fail(format!("unknown scheme {other}:// (file://, s3:// or memory://)"))),
        }
    }

    /// Artifacts as files under `dir` (created if missing).
    pub fn local(dir: impl AsRef<std::path::Path>) -> Result<ObjectArtifactStore, ArtifactsError> {
        let dir = dir.as_ref();
        let fail = |message: String| ArtifactsError { location: dir.display().to_string(), message };
        std::fs::create_dir_all(dir).map_err(|e| fail(format!("create the directory: {e}")))?;
        let store = object_store::local::LocalFileSystem::new_with_prefix(dir).map_err(|e| fail(e.to_string()))?;
        let location = format!("file://{}", dir.canonicalize().map_err(|e| fail(e.to_string()))?.display());
        Ok(ObjectArtifactStore {
            store: Arc::new(store),
            root: ObjectPath::default(),
            location,
            not_found_is_gone: true,
        })
    }

    /// Artifacts in this process's memory (tests; a worker in another process cannot write there).
    pub fn memory() -> ObjectArtifactStore {
        ObjectArtifactStore {
            store: Arc::new(object_store::memory::InMemory::new()),
            root: ObjectPath::default(),
            location: "memory://".into(),
            not_found_is_gone: true,
        }
    }

    /// The location, without credentials (they never appear in one).
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Where an artifact's path (the register answer's `path`) is in the object store.
    pub fn object_path(&self, path: &str) -> Result<ObjectPath, String> {
        let rel = ObjectPath::parse(path).map_err(|e| format!("artifact path {path}: {e}"))?;
        if rel.as_ref().is_empty() {
            return Err(format!("artifact path {path:?} is empty"));
        }
        Ok(if self.root.as_ref().is_empty() { rel } else { self.root.parts().chain(rel.parts()).collect() })
    }

    /// Asks the store whether it is there: a bucket that does not exist or refuses Settle's
    /// credentials is `Misconfigured` (`settle serve` refuses to start); one that does not answer
    /// now is `Unreachable` (a warning: teardowns wait for it).
    pub async fn check(&self) -> Result<(), StoreCheck> {
        let root = (!self.root.as_ref().is_empty()).then_some(&self.root);
        let e = match self.store.list_with_delimiter(root).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let message = format!("{}: {e}", self.location);
        // The store answered and refused (no such bucket, access denied, bad credentials): a 4xx.
        // object_store keeps the status in an error type it does not export, so its message is read.
        let refused = matches!(
            e,
            object_store::Error::NotFound { .. }
                | object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }
        ) || message.contains("status code: 4");
        Err(if refused { StoreCheck::Misconfigured(message) } else { StoreCheck::Unreachable(message) })
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

/// An S3 client whose requests give up soon (see `REQUEST_TIMEOUT`); `http://` endpoints allowed,
/// since an operator who names one means it (a store on the same network, MinIO, moto).
fn s3(
    bucket: &str,
    settings: impl IntoIterator<Item = (impl AsRef<str>, impl Into<String>)>,
) -> Result<Arc<dyn ObjectStore>, object_store::Error> {
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
    if builder.get_config_value(&AmazonS3ConfigKey::Endpoint).is_some_and(|e| e.starts_with("http://")) {
        builder = builder.with_allow_http(true);
    }
    let store = builder
        .with_bucket_name(bucket)
        .with_retry(RetryConfig { backoff: BackoffConfig::default(), max_retries: RETRIES, retry_timeout: RETRY_FOR })
        .build()?;
    Ok(Arc::new(store))
}

#[async_trait]
impl ArtifactStore for ObjectArtifactStore {
    async fn delete(&self, key: &str) -> Result<(), String> {
        self.delete_all(&[key.to_owned()]).await
    }

    /// One stream of deletes (S3 sends them 1,000 to a request); a missing object is deleted, a
    /// missing bucket is an error.
    async fn delete_all(&self, keys: &[String]) -> Result<(), String> {
        let paths: Vec<object_store::Result<ObjectPath>> = keys
            .iter()
            .map(|k| {
                self.object_path(k).map_err(|e| object_store::Error::Generic { store: "settle", source: e.into() })
            })
            .collect();
        let results = self.store.delete_stream(futures_util::stream::iter(paths).boxed());
        let not_found_is_gone = self.not_found_is_gone;
        results
            .map(|r| match r {
                Err(object_store::Error::NotFound { .. }) if not_found_is_gone => Ok(()),
                other => other.map(|_| ()),
            })
            .try_collect::<Vec<()>>()
            .await
            .map(|_| ())
            .map_err(|e| format!("delete from {}: {e}", self.location))
    }
}
