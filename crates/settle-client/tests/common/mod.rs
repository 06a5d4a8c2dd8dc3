//! What the SDK's tests share: `settle serve`'s application in this process, on a port of its own
//! over a SQLite file, until the returned server is dropped.
#![allow(dead_code)]

use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub struct Served {
    pub base: String,
    serving: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.serving.cancel();
    }
}

pub async fn serve() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("sdk.db").display());
    let store = Arc::new(settle_store::SqlStore::open(&url, settle_store::StoreOptions::default()).await.unwrap());
    let app = settle_api::Application::build("127.0.0.1:0", store, settle_api::Tokens::default()).await.unwrap();
    let base = format!("http://{}", app.local_addr());
    let serving = CancellationToken::new();
    tokio::spawn(app.run_until(serving.clone().cancelled_owned()));
    Served { base, serving, _dir: dir }
}
