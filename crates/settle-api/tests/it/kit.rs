//! A server on port 0 per test, and a small client.

use serde_json::{Value, json};
use settle_api::{Application, Tokens};
use settle_store::{ObjectArtifactStore, SqlStore, Store, StoreOptions};
use std::sync::Arc;

#[derive(Clone, Copy, Debug)]
pub enum Engine {
    Sqlite,
    Postgres,
}

pub struct Server {
    pub base: String,
    pub http: reqwest::Client,
    pub token: Option<String>,
    pub database_url: String,
    // Kept alive for the server: the SQLite file and the artifacts live here.
    _dir: tempfile::TempDir,
    store: Arc<SqlStore>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub replayed: bool,
}

impl Server {
    pub async fn start(engine: Engine) -> Server {
        Server::with_tokens(engine, Tokens::default()).await
    }

    pub async fn with_tokens(engine: Engine, tokens: Tokens) -> Server {
        Server::with_options(engine, tokens, |_| {}).await
    }

    /// A server whose store is opened with `adjust` applied to the options.
    pub async fn with_options(engine: Engine, tokens: Tokens, adjust: impl FnOnce(&mut StoreOptions)) -> Server {
        // Long-polls re-check only every 30 s here, far past any bound a test waits for: an answer
        // in time can only come from the wake-up path (in-process notify, LISTEN/NOTIFY).
        let limits = settle_api::HttpLimits {
            long_poll_recheck: std::time::Duration::from_secs(30),
            ..settle_api::HttpLimits::default()
        };
        Server::with_limits(engine, tokens, adjust, limits).await
    }

    /// As `with_options`, serving under `limits`.
    pub async fn with_limits(
        engine: Engine,
        tokens: Tokens,
        adjust: impl FnOnce(&mut StoreOptions),
        limits: settle_api::HttpLimits,
    ) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let url = match engine {
            Engine::Sqlite => format!("sqlite://{}", dir.path().join("api.db").display()),
            Engine::Postgres => {
                settle_testkit::fresh_database_from_template(
                    &settle_store::SqlStore::postgres_schema_id(),
                    |url| async move { settle_store::SqlStore::migrate_postgres(&url).await.unwrap() },
                )
                .await
            }
        };
        let mut options = StoreOptions {
            artifacts: Some(Arc::new(ObjectArtifactStore::local(dir.path().join("artifacts")).unwrap())),
            ..StoreOptions::default()
        };
        adjust(&mut options);
        let store = Arc::new(SqlStore::open(&url, options).await.unwrap());
        let app =
            Application::build_with("127.0.0.1:0", store.clone() as Arc<dyn Store>, tokens, limits).await.unwrap();
        let base = format!("http://{}", app.local_addr());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(app.run_until(async move {
            let _ = stopped.await;
        }));
        Server {
            base,
            http: reqwest::Client::new(),
            token: None,
            database_url: url,
            _dir: dir,
            store,
            stop: Some(stop),
        }
    }

    /// Waits until `n` long-polls are waiting in this server (`settle_http_long_polls_waiting`), so
    /// what a test does next happens while they wait. The gauge is per process, and nextest runs
    /// each test in a process of its own.
    pub async fn until_long_polls_waiting(&self, n: u32) {
        assert_eq!(
            std::env::var("NEXTEST_EXECUTION_MODE").as_deref(),
            Ok("process-per-test"),
            "the long-poll gauge is per process: run these tests with cargo nextest (scripts/test)"
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let r = self.get("/metrics").await;
            let text = r.body.as_str().unwrap_or_default().to_owned();
            let waiting = text
                .lines()
                .find_map(|l| l.strip_prefix("settle_http_long_polls_waiting "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            if waiting >= f64::from(n) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "{n} long-polls never waited: {waiting}");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    pub async fn send(&self, method: &str, path: &str, body: Option<Value>, token: Option<&str>) -> Reply {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        if let Some(t) = token.or(self.token.as_deref()) {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply { status, body, replayed }
    }

    /// The server's own store (for writes that must not go through HTTP in a measurement).
    pub fn store_handle(&self) -> Arc<SqlStore> {
        self.store.clone()
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send("GET", path, None, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.send("POST", path, Some(body), None).await
    }

    /// POST with an empty body (cancel, requeue).
    pub async fn post_empty(&self, path: &str) -> Reply {
        self.send("POST", path, None, None).await
    }

    pub async fn account(&self, id: &str, grant: i64) {
        assert_eq!(self.post("/v1/accounts", json!({"id": id})).await.status, 201);
        if grant > 0 {
            let r = self
                .post(&format!("/v1/accounts/{id}/grants"), json!({"id": format!("g-{id}"), "amount": grant}))
                .await;
            assert_eq!(r.status, 201, "{}", r.body);
        }
    }

    pub async fn balance(&self, id: &str) -> i64 {
        self.get(&format!("/v1/accounts/{id}")).await.body["balance"].as_i64().unwrap()
    }

    pub async fn job(&self, id: &str, account: &str, cost: i64) -> Value {
        let r = self.post("/v1/jobs", json!({"id": id, "account_id": account, "kind": "render", "cost": cost})).await;
        assert_eq!(r.status, 201, "{}", r.body);
        r.body
    }

    /// Claims one job and returns its lease token.
    pub async fn claim(&self) -> (String, String) {
        let r = self.post("/v1/claims", json!({"worker": "w1"})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let job = &r.body["jobs"][0];
        (job["id"].as_str().unwrap().to_owned(), job["lease_token"].as_str().unwrap().to_owned())
    }
}

pub fn code(r: &Reply) -> &str {
    r.body["error"]["code"].as_str().unwrap_or("")
}
