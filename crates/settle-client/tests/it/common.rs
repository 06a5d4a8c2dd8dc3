//! What the SDK's tests share: `settle serve`'s application in this process, on a port of its own
//! over a SQLite file, until the returned server is dropped.

use serde_json::Value;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub struct Served {
    pub base: String,
    /// The server's store, for what a test does behind the API (the lease rescuer's pass).
    pub store: Arc<settle_store::SqlStore>,
    serving: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.serving.cancel();
    }
}

pub async fn serve() -> Served {
    serve_on(false).await
}

/// As `serve`, on a fresh PostgreSQL database (the test kit's cluster) when `postgres`.
pub async fn serve_on(postgres: bool) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let url = if postgres {
        settle_testkit::fresh_database_from_template(&settle_store::SqlStore::postgres_schema_id(), |url| async move {
            settle_store::SqlStore::migrate_postgres(&url).await.unwrap()
        })
        .await
    } else {
        format!("sqlite://{}", dir.path().join("sdk.db").display())
    };
    let store = Arc::new(settle_store::SqlStore::open(&url, settle_store::StoreOptions::default()).await.unwrap());
    let app =
        settle_api::Application::build("127.0.0.1:0", store.clone(), settle_api::Tokens::default()).await.unwrap();
    let base = format!("http://{}", app.local_addr());
    let serving = CancellationToken::new();
    tokio::spawn(app.run_until(serving.clone().cancelled_owned()));
    Served { base, store, serving, _dir: dir }
}

/// One HTTP request: the status and the JSON answer (null when there is none).
pub async fn call(http: &reqwest::Client, method: reqwest::Method, url: String, body: Option<Value>) -> (u16, Value) {
    let mut req = http.request(method, url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}
