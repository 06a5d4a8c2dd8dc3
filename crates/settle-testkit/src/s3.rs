//! An S3 API for the tests: moto's standalone server (PyPI `moto[server]`), found or started
//! without anyone's help, as the PostgreSQL server is.
//!
//! - `SETTLE_TEST_S3_ENDPOINT=http://host:port` points the tests at an S3-compatible server that
//!   accepts any credentials and unsigned bucket creation (moto, or one like it).
//! - Otherwise the first test process to get here starts `moto_server` on a loopback port (from
//!   `target/python-venv`, where it is installed with pip if missing), detached, and later
//!   processes reuse it while it answers; `scripts/test` stops it at the end of the run.
//! - A server that cannot be installed, started or reached fails the test: nothing skips.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The moto release the tests run against.
const MOTO: &str = "moto[server]==5.2.5";

/// A bucket of a test's own on the test S3 server.
pub struct Bucket {
    pub endpoint: String,
    pub name: String,
}

impl Bucket {
    /// `s3://{bucket}/{prefix}`
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.name)
    }

    /// The settings that reach this server through `endpoint` (the server itself, or a proxy in
    /// front of it): `object_store`'s keys, moto's fixed test credentials.
    pub fn settings_via(&self, endpoint: &str) -> Vec<(String, String)> {
        [
            ("aws_endpoint", endpoint),
            ("aws_access_key_id", "testing"),
            ("aws_secret_access_key", "testing"),
            ("aws_region", "us-east-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    pub fn settings(&self) -> Vec<(String, String)> {
        self.settings_via(&self.endpoint)
    }
}

impl Bucket {
    /// Writes an object at `key` with a plain unsigned PUT (as a worker's own S3 client would,
    /// nothing of Settle's on the way).
    pub fn put(&self, key: &str, body: &[u8]) {
        let status = send(&self.endpoint, "PUT", &format!("/{}/{key}", self.name), body);
        assert_eq!(status, 200, "PUT {key}");
    }

    /// Whether an object is at `key` (a plain HEAD).
    pub fn exists(&self, key: &str) -> bool {
        match send(&self.endpoint, "HEAD", &format!("/{}/{key}", self.name), b"") {
            200 => true,
            404 => false,
            other => panic!("HEAD {key} answered {other}"),
        }
    }
}

/// A fresh, empty bucket on the test S3 server.
pub fn fresh_bucket() -> Bucket {
    let endpoint = endpoint().to_owned();
    let name = format!("settle-test-{}", uuid::Uuid::new_v4().simple());
    let status = request(&endpoint, "PUT", &format!("/{name}"));
    assert!(status == 200, "creating bucket {name} on {endpoint} answered {status}");
    Bucket { endpoint, name }
}

/// The test S3 server's endpoint, `http://127.0.0.1:PORT`.
pub fn endpoint() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("SETTLE_TEST_S3_ENDPOINT") {
            return url;
        }
        let (root, _lock) = super::shared_dir("moto");
        let port_file = root.join("port");
        if let Ok(p) = std::fs::read_to_string(&port_file)
            && let Ok(port) = p.trim().parse::<u16>()
            && answers(port)
        {
            return format!("http://127.0.0.1:{port}");
        }
        let bin = moto_server();
        // A port taken between choosing it and moto binding it makes moto exit: try another.
        let mut tries = 0;
        let port = loop {
            tries += 1;
            let port = super::free_port();
            let log = std::fs::File::create(root.join("log")).unwrap();
            // Its own process group and no handle on the test's output: it outlives this test
            // process (the next ones reuse it) and nextest does not wait for it.
            let mut child = {
                use std::os::unix::process::CommandExt;
                Command::new(&bin)
                    .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .process_group(0)
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
            };
            let deadline = Instant::now() + Duration::from_secs(60);
            let exited = loop {
                if answers(port) {
                    break None;
                }
                if let Some(status) = child.try_wait().unwrap() {
                    break Some(status);
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break Some(child.wait().unwrap());
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            match exited {
                None => {
                    // Pid and port together, once it answers: scripts/test stops what is named here.
                    std::fs::write(root.join("pid"), child.id().to_string()).unwrap();
                    break port;
                }
                Some(status) => assert!(
                    tries < 3,
                    "moto_server did not answer on port {port} ({status}):\n{}",
                    std::fs::read_to_string(root.join("log")).unwrap_or_default()
                ),
            }
        };
        std::fs::write(&port_file, port.to_string()).unwrap();
        format!("http://127.0.0.1:{port}")
    })
}

/// `moto_server` from `SETTLE_TEST_MOTO_SERVER`, else from the tests' venv (installed there if
/// missing).
fn moto_server() -> PathBuf {
    match std::env::var("SETTLE_TEST_MOTO_SERVER") {
        Ok(bin) => PathBuf::from(bin),
        Err(_) => super::python::tool("moto_server", MOTO),
    }
}

/// Whether moto answers its own API on `port`.
fn answers(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        && request(&format!("http://127.0.0.1:{port}"), "GET", "/moto-api/data.json") == 200
}

/// One unsigned HTTP/1.1 request; returns the status (0 when there is no answer).
fn request(endpoint: &str, method: &str, path: &str) -> u16 {
    send(endpoint, method, path, b"")
}

fn send(endpoint: &str, method: &str, path: &str, body: &[u8]) -> u16 {
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let Ok(mut stream) = std::net::TcpStream::connect(host) else { return 0 };
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // Moto checks no signature, but answers an anonymous read of a private object with 403: the
    // request names the test credentials in an Authorization header it does not verify.
    let auth =
        "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00";
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body)).is_err() {
        return 0;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}
