//! Configuration (issue 42, part 7): docs/configuration.md names every setting the binary reads;
//! `listen`, `db`, `artifacts` and `tokens_file` may be set in the file; secrets come from
//! `*_FILE` variables or files the configuration names; SIGHUP re-reads the tokens and the webhook
//! endpoints without dropping a request, and a wrong new set replaces nothing.

use crate::common::free_port;
use std::collections::BTreeSet;
use std::io::{BufRead, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// `settle ARGS` with no SETTLE_ variable of the test's environment.
fn settle(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SETTLE_")) {
        cmd.env_remove(k);
    }
    cmd.args(args).output().unwrap()
}

/// The `## ` sections of a Markdown file: heading → the first cell of each table row.
fn documented(doc: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut sections: Vec<(String, BTreeSet<String>)> = Vec::new();
    for line in doc.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            sections.push((heading.replace('`', ""), BTreeSet::new()));
        } else if let (Some(rest), Some((_, cells))) = (line.strip_prefix("| `"), sections.last_mut())
            && let Some((name, _)) = rest.split_once('`')
        {
            cells.insert(name.to_owned());
        }
    }
    sections
}

#[test]
fn the_reference_names_every_setting() {
    let doc = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let sections = documented(&doc);
    let section = |heading_starts: &str| -> &BTreeSet<String> {
        &sections
            .iter()
            .find(|(h, _)| h.starts_with(heading_starts))
            .unwrap_or_else(|| panic!("no ## {heading_starts}"))
            .1
    };
    // Every key of a configuration that uses every section, as `settle config` writes it out.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("full.toml");
    std::fs::write(
        &file,
        "tokens_file = \"/etc/settle/tokens\"\n[kinds.render]\nattempts_max = 3\n[provider]\nurl = \"http://127.0.0.1:9/\"\n\
         [[webhooks]]\nid = \"ops\"\nurl = \"https://example.test/hook\"\nsecret = \"0123456789abcdef0123\"\n",
    )
    .unwrap();
    let out = settle(&["config", "--config", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let effective: toml::Table = toml::from_str(&String::from_utf8_lossy(&out.stdout)).unwrap();
    let mut missing = Vec::new();
    for (key, value) in &effective {
        let mut check = |heading: &str, table: &toml::Table, env_prefix: Option<&str>| {
            for field in table.keys() {
                if !section(heading).contains(field) {
                    missing.push(format!("{heading}: {field}"));
                }
                if let Some(prefix) = env_prefix {
                    let var = format!("{prefix}{}", field.to_ascii_uppercase());
                    if !doc.contains(&format!("`{var}`")) {
                        missing.push(format!("{heading}: {var}"));
                    }
                }
            }
        };
        match value {
            toml::Value::Table(table) if key == "kinds" => {
                for kind in table.values() {
                    check("[defaults]", kind.as_table().unwrap(), None);
                }
            }
            toml::Value::Table(table) if key == "defaults" => check("[defaults]", table, Some("SETTLE_")),
            toml::Value::Table(table) => {
                let prefix = format!("SETTLE_{}_", key.to_ascii_uppercase());
                check(&format!("[{key}]"), table, Some(&prefix));
            }
            toml::Value::Array(tables) if key == "webhooks" => {
                for t in tables {
                    check("[[webhooks]]", t.as_table().unwrap(), None);
                }
            }
            _ => {
                if !section("Top level").contains(key) {
                    missing.push(format!("top level: {key}"));
                }
            }
        }
    }
    assert!(doc.contains("`SETTLE_KIND_<KIND>_<FIELD>`"), "a kind's variables");
    // Every flag and variable of the commands that run Settle.
    for command in ["serve", "worker", "migrate", "jobs", "ledger", "audit"] {
        let help = String::from_utf8_lossy(&settle(&[command, "--help"]).stdout).into_owned();
        for word in help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']' || c == '=') {
            let word = word.trim_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'));
            let named = (word.starts_with("--") && word.len() > 2 && !matches!(word, "--help" | "--version"))
                || word.starts_with("SETTLE_");
            if named && !doc.contains(&format!("`{word}`")) {
                missing.push(format!("settle {command}: {word}"));
            }
        }
    }
    // Every variable the code that starts a server reads, and the `_FILE` form of each secret.
    for source in ["main.rs", "serve.rs", "config.rs", "secrets.rs"] {
        let text = std::fs::read_to_string(root().join("crates/settle-cli/src").join(source)).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (i, _) in code.match_indices("\"SETTLE_") {
            let name: String = code[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if name.ends_with('_') {
                continue; // a prefix (SETTLE_LOOPS_…): its variables are checked above
            }
            let secret = code[..i].rsplit('\n').next().is_some_and(|line| line.contains("secrets::from_env("));
            for var in [Some(name.clone()), secret.then(|| format!("{name}_FILE"))].into_iter().flatten() {
                if !doc.contains(&format!("`{var}`")) {
                    missing.push(format!("{source}: {var}"));
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "docs/configuration.md does not name: {missing:#?}");
}

/// A file only root and its group may read.
fn secret_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    path
}

/// `curl` with a bearer token: the status and the body.
fn curl(method: &str, url: &str, token: Option<&str>, body: Option<&str>) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", method, url]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("authorization: Bearer {t}")]);
    }
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "-d", b]);
    }
    let out = String::from_utf8_lossy(&cmd.output().unwrap().stdout).into_owned();
    let (body, status) = out.rsplit_once('\n').unwrap();
    (status.trim().parse().unwrap_or(0), body.to_owned())
}

/// A webhook receiver on a free port: every request's head and body, answered 200.
fn receiver() -> (u16, mpsc::Receiver<(String, Vec<u8>)>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
            let mut head = String::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                head.push_str(&line.to_ascii_lowercase());
            }
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let _ = tx.send((head, body));
        }
    });
    (port, rx)
}

/// A `settle serve` whose stderr lines arrive on a channel; killed on drop.
struct Server {
    child: Child,
    stderr: mpsc::Receiver<String>,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(cwd: &Path, config: &Path, env: &[(&str, &Path)]) -> (Server, u16) {
        let text = std::fs::read_to_string(config).unwrap();
        let port: u16 = text
            .lines()
            .find_map(|l| l.strip_prefix("listen = \"127.0.0.1:"))
            .and_then(|p| p.trim_end_matches('"').parse().ok())
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SETTLE_")) {
            cmd.env_remove(k);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .args(["serve", "--config", config.to_str().unwrap()])
            .current_dir(cwd)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, stderr) = mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let server = Server { child, stderr, base: format!("http://127.0.0.1:{port}") };
        server.wait_for_line("serving on");
        (server, port)
    }

    fn wait_for_line(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(e) => panic!("settle serve never said {needle:?}: {e}"),
            }
        }
    }

    fn hangup(&self) {
        assert!(Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status().unwrap().success());
    }
}

const ADMIN_A: &str = "admin-token-a-0123456789";
const ADMIN_B: &str = "admin-token-b-0123456789";
const METRICS: &str = "metrics-token-0123456789";

#[test]
fn the_file_says_where_to_serve_and_secrets_come_from_files() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (hook_port, deliveries) = receiver();
    let tokens = secret_file(d, "tokens", &format!("admin {ADMIN_A} ops\n"));
    let hook_secret = secret_file(d, "hook.secret", "hook-secret-0123456789\n");
    let metrics = secret_file(d, "metrics.token", METRICS);
    let console = secret_file(d, "console.secret", "console-secret-0123456789-0123456789");
    let port = free_port();
    let config = d.join("settle.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\ndb = \"sqlite://{0}/from-the-file.db\"\nartifacts = \"{0}/artifacts\"\n\
             tokens_file = \"{1}\"\n[[webhooks]]\nid = \"hook\"\nurl = \"http://127.0.0.1:{hook_port}/\"\nsecret_file = \"{2}\"\n",
            d.display(),
            tokens.display(),
            hook_secret.display()
        ),
    )
    .unwrap();
    let env = [("SETTLE_METRICS_TOKEN_FILE", metrics.as_path()), ("SETTLE_CONSOLE_SECRET_FILE", console.as_path())];
    let (s, _) = Server::start(cwd.path(), &config, &env);
    assert!(d.join("from-the-file.db").exists(), "the store is the file's db");
    assert!(!cwd.path().join("settle.db").exists(), "not the default");
    assert!(d.join("artifacts").is_dir(), "the artifacts are the file's");
    assert_eq!(curl("GET", &format!("{}/v1/accounts", s.base), None, None).0, 401, "the file's tokens are required");
    assert_eq!(curl("GET", &format!("{}/v1/accounts", s.base), Some(ADMIN_A), None).0, 200);
    assert_eq!(curl("GET", &format!("{}/metrics", s.base), None, None).0, 401, "the metrics token from its file");
    assert_eq!(curl("GET", &format!("{}/metrics", s.base), Some(METRICS), None).0, 200);
    // The webhook is signed with the secret from its file (without the file's line break).
    let (st, _) = curl("POST", &format!("{}/v1/accounts", s.base), Some(ADMIN_A), Some(r#"{"id":"acme"}"#));
    assert_eq!(st, 201);
    let (st, _) =
        curl("POST", &format!("{}/v1/accounts/acme/grants", s.base), Some(ADMIN_A), Some(r#"{"id":"g1","amount":5}"#));
    assert_eq!(st, 201);
    let (head, body) = deliveries.recv_timeout(Duration::from_secs(20)).expect("a delivery");
    let signature = head.lines().find_map(|l| l.strip_prefix("settle-signature:")).unwrap().trim().to_owned();
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    settle_core::signature::verify("hook-secret-0123456789", &signature, &body, now, 300)
        .expect("signed with the file's secret");

    // A file that cannot be read is refused without quoting the line: it may hold a secret.
    let broken = d.join("broken.toml");
    std::fs::write(&broken, "[[webhooks]]\nid = \"x\"\nsecret = \"topsecret-0123456789\" oops\n").unwrap();
    let out = settle(&["config", "--config", broken.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("line 3"), "{err}");
    assert!(!err.contains("topsecret"), "the secret was printed: {err}");
    // Secrets one way only, and never from a file every user may read.
    let out = settle(&["config", "--config", config.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("listen = \"127.0.0.1:{port}\"")) && text.contains("secret = \"<redacted>\""),
        "{text}"
    );
    std::fs::set_permissions(&hook_secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = settle(&["config", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("open to every user"));
    let out = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["migrate", "--db", "sqlite://x.db"])
        .current_dir(cwd.path())
        .env("SETTLE_DATABASE_PASSWORD", "pw")
        .output()
        .unwrap();
    assert!(!out.status.success(), "a password for an SQLite store is refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("postgres://"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn sighup_rereads_tokens_and_webhooks_without_dropping_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (hook_port, deliveries) = receiver();
    let tokens = secret_file(d, "tokens", &format!("admin {ADMIN_A} ops\n"));
    let port = free_port();
    let config = d.join("settle.toml");
    let base_config = format!(
        "listen = \"127.0.0.1:{port}\"\ndb = \"sqlite://{0}/s.db\"\nartifacts = \"{0}/artifacts\"\ntokens_file = \"{1}\"\n",
        d.display(),
        tokens.display()
    );
    std::fs::write(&config, &base_config).unwrap();
    let (s, _) = Server::start(d, &config, &[]);
    let url = |path: &str| format!("{}{path}", s.base);
    assert_eq!(curl("POST", &url("/v1/accounts"), Some(ADMIN_A), Some(r#"{"id":"acme"}"#)).0, 201);

    // A long-poll authorised by the old token is in flight across the reload.
    let claim = std::thread::spawn({
        let url = url("/v1/claims");
        move || curl("POST", &url, Some(ADMIN_A), Some(r#"{"worker":"w","wait_seconds":4}"#))
    });
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&tokens, format!("admin {ADMIN_B} ops-rotated\n")).unwrap();
    let secret = secret_file(d, "hook.secret", "hook-secret-0123456789");
    std::fs::write(
        &config,
        format!(
            "{base_config}[[webhooks]]\nid = \"hook\"\nurl = \"http://127.0.0.1:{hook_port}/\"\nsecret_file = \"{}\"\n",
            secret.display()
        ),
    )
    .unwrap();
    s.hangup();
    let said = s.wait_for_line("settle: SIGHUP");
    assert!(said.contains("reloaded 1 tokens, 1 webhook endpoints"), "{said}");
    assert!(!claim.is_finished(), "the long-poll is still waiting");
    assert_eq!(claim.join().unwrap().0, 200, "a request in flight is answered, not dropped");
    assert_eq!(curl("GET", &url("/v1/accounts"), Some(ADMIN_A), None).0, 401, "the removed token is refused");
    assert_eq!(curl("GET", &url("/v1/accounts"), Some(ADMIN_B), None).0, 200, "the new token works");
    // The new endpoint gets what happens from now on.
    let grant = r#"{"id":"after-reload","amount":5}"#;
    assert_eq!(curl("POST", &url("/v1/accounts/acme/grants"), Some(ADMIN_B), Some(grant)).0, 201);
    let (_, body) = deliveries.recv_timeout(Duration::from_secs(20)).expect("the new endpoint's first delivery");
    assert!(String::from_utf8_lossy(&body).contains("after-reload"), "{}", String::from_utf8_lossy(&body));

    // A wrong new set (a tokens file with no token) replaces nothing.
    std::fs::write(&tokens, "# emptied by mistake\n").unwrap();
    s.hangup();
    let said = s.wait_for_line("settle: SIGHUP");
    assert!(said.contains("nothing reloaded") && said.contains("holds no token"), "{said}");
    assert_eq!(curl("GET", &url("/v1/accounts"), Some(ADMIN_B), None).0, 200, "the running tokens stay");
}
