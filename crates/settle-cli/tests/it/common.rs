//! What the binary's tests share: a `settle serve` process on a free port, killed on drop, and
//! one HTTP call helper.

use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits until `port` accepts connections (30 s at most).
pub fn wait_for(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "port {port} did not open");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process killed and reaped on drop.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct Serve {
    pub child: Child,
    pub base: String,
    dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    /// SIGTERM, then waits for the process to exit; returns whether it exited cleanly.
    pub fn stop(&mut self) -> bool {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        self.child.wait().map(|s| s.success()).unwrap_or(false)
    }

    /// What the process has logged so far (its standard error).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default()
    }
}

/// `settle serve` in a temp dir of its own (its default SQLite database lives there) on a free
/// port, with the database and config given; its log goes to a file there (`Serve::log`).
pub fn serve(db: Option<&str>, config: Option<&std::path::Path>) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")]).current_dir(dir.path());
    if let Some(db) = db {
        cmd.args(["--db", db]);
    }
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let log = std::fs::File::create(dir.path().join("serve.log")).unwrap();
    let child = cmd
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    wait_for(port);
    Serve { child, base: format!("http://127.0.0.1:{port}"), dir }
}

pub async fn call(http: &reqwest::Client, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    let mut req = http.request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}
