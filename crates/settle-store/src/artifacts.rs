//! Where workers' artifacts live, so teardown can delete those of undelivered items.

use async_trait::async_trait;
use std::path::PathBuf;

#[async_trait]
pub trait ArtifactStore: Send + Sync {
    /// Deletes `key`. A key that is already gone is a success: teardown re-runs cleanup in full.
    async fn delete(&self, key: &str) -> Result<(), String>;
}

/// Artifacts as files under a root directory; the key is a relative path (validated by `ArtifactKey`).
#[derive(Debug, Clone)]
pub struct FsArtifactStore {
    root: PathBuf,
}

impl FsArtifactStore {
    pub fn new(root: impl Into<PathBuf>) -> FsArtifactStore {
        FsArtifactStore { root: root.into() }
    }
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }
}

#[async_trait]
impl ArtifactStore for FsArtifactStore {
    async fn delete(&self, key: &str) -> Result<(), String> {
        match tokio::fs::remove_file(self.path_of(key)).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("delete {key}: {e}")),
        }
    }
}
