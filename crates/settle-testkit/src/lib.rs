//! A PostgreSQL server for the tests, found or started without anyone's help.
//!
//! - `SETTLE_TEST_DATABASE_URL=postgres://user@host:port/db` points the tests at an existing
//!   server; each test creates its own database there.
//! - Otherwise the first test process to get here creates a throwaway cluster under
//!   the system temp dir, named after the checkout's target dir (initdb, run as the `postgres` user when we are root, since initdb and
//!   pg_ctl refuse to run as root) and starts it on a loopback port; later processes reuse it
//!   while it runs. `scripts/test` stops it and deletes it at the end of the run; a cluster found
//!   stopped is begun afresh, so the tests' databases never pile up in the temp dir.
//! - A PostgreSQL that cannot be reached or started fails the test: no test skips for lack of one.
//!
//! And a pg_auto_failover formation (`formation`) for the failover tests; an S3 API for the artifact tests (`s3`): moto's standalone server, installed and started
//! the same way; and the tests' Python venv (`python`).

pub mod formation;
pub mod python;
pub mod s3;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn bindir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| rd.flatten().map(|e| e.path().join("bin")).filter(|p| p.join("initdb").exists()).collect())
        .unwrap_or_default();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!(
            "PostgreSQL server binaries (initdb, pg_ctl) not found: install postgresql or set SETTLE_TEST_DATABASE_URL"
        )
    })
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// Runs a PostgreSQL tool, as the `postgres` user when we are root.
fn pg_tool(bin: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    };
    cmd.args(args).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()))
}

/// This checkout's target dir (absolute).
fn target_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    std::fs::create_dir_all(target.join("tmp")).unwrap();
    target.canonicalize().unwrap_or(target)
}

/// The folder of a server the test processes of one run share (`settle-test-{what}-{key}` in the
/// temp dir, the key named after the checkout's target dir), locked while the caller holds the
/// returned file; `target/tmp/settle-{what}.path` points at it so scripts/test can stop the server.
fn shared_dir(what: &str) -> (PathBuf, std::fs::File) {
    let target = target_dir();
    let key = target
        .to_string_lossy()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let root = std::env::temp_dir().join(format!("settle-test-{what}-{key:016x}"));
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(target.join("tmp").join(format!("settle-{what}.path")), root.to_string_lossy().as_bytes()).unwrap();
    let lock = std::fs::File::create(root.join("lock")).unwrap();
    lock.lock().unwrap();
    (root, lock)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn server_answers(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// The admin URL (database `postgres`) of the test server.
pub fn server_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("SETTLE_TEST_DATABASE_URL") {
            return url;
        }
        // The cluster lives under the system temp dir (world-traversable, so the `postgres` user can
        // reach it wherever the checkout is), named after this checkout's target dir; a pointer file
        // in the target dir tells scripts/test where to stop it.
        let (root, _lock) = shared_dir("pg");
        let port_file = root.join("port");
        if let Ok(p) = std::fs::read_to_string(&port_file)
            && let Ok(port) = p.trim().parse::<u16>()
            && server_answers(port)
        {
            return format!("postgres://postgres@127.0.0.1:{port}/postgres");
        }
        let bin = bindir();
        let data = root.join("data");
        if is_root() {
            let st = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&root).status().unwrap();
            assert!(st.success(), "chown of the test cluster folder failed");
        }
        // A cluster that is not running is begun afresh: the databases earlier runs' tests made
        // there are of no use and would only pile up.
        if data.exists() {
            std::fs::remove_dir_all(&data).unwrap();
        }
        let out = pg_tool(&bin.join("initdb"), &["-D", data.to_str().unwrap(), "-A", "trust", "-U", "postgres", "-E", "UTF8"]);
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let port = free_port();
        // fsync off is fine for semantics tests (never for benchmarks): a lost test cluster is rebuilt.
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=400",
            root.display()
        );
        let log = root.join("log");
        let out = pg_tool(&bin.join("pg_ctl"), &["-D", data.to_str().unwrap(), "-o", &opts, "-l", log.to_str().unwrap(), "-w", "-t", "60", "start"]);
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::fs::write(&port_file, port.to_string()).unwrap();
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    })
}

/// A fresh, empty database on the test server; returns its URL.
pub async fn fresh_database() -> String {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let admin = server_url();
    let name = format!("settle_test_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::postgres::PgConnectOptions::from_str(admin)
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot reach the test PostgreSQL at {admin}: {e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut conn).await.unwrap();
    conn.close().await.unwrap();
    match admin.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{name}"),
        None => panic!("SETTLE_TEST_DATABASE_URL must name a database: {admin}"),
    }
}

/// A fresh database that is already what `make` makes of an empty one: a copy of a template
/// database (`CREATE DATABASE … TEMPLATE`) that the first test process to need it made with `make`,
/// under an advisory lock so processes starting at once make it once. `key` names what `make`
/// makes (for the store: its schema id, so a changed migration gets a template of its own).
/// Copying a template costs the server a file copy; migrating each test's database ran thirty-odd
/// migrations' DDL, ~0.14 CPU-seconds of the server's for each of the suite's ~750 databases.
pub async fn fresh_database_from_template<F, Fut>(key: &str, make: F) -> String
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    assert!(key.chars().all(|c| c.is_ascii_alphanumeric()), "a template key is letters and digits: {key}");
    let admin = server_url();
    let base = match admin.rsplit_once('/') {
        Some((base, _)) => base.to_owned(),
        None => panic!("SETTLE_TEST_DATABASE_URL must name a database: {admin}"),
    };
    let template = format!("settle_template_{key}");
    let mut conn = sqlx::postgres::PgConnectOptions::from_str(admin)
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot reach the test PostgreSQL at {admin}: {e}"));
    // Held by this session until it closes: released by a test that panics mid-make, too.
    sqlx::query("SELECT pg_advisory_lock(1585151575)").execute(&mut conn).await.unwrap();
    let exists = sqlx::query("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(&template)
        .fetch_optional(&mut conn)
        .await
        .unwrap()
        .is_some();
    if !exists {
        // Made under another name and renamed once whole: a process that died making it leaves
        // only the unfinished one, dropped by the next.
        let making = format!("{template}_making");
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {making} WITH (FORCE)")))
            .execute(&mut conn)
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {making}"))).execute(&mut conn).await.unwrap();
        make(format!("{base}/{making}")).await;
        sqlx::query(sqlx::AssertSqlSafe(format!("ALTER DATABASE {making} RENAME TO {template}")))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    sqlx::query("SELECT pg_advisory_unlock(1585151575)").execute(&mut conn).await.unwrap();
    let name = format!("settle_test_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name} TEMPLATE {template}")))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    format!("{base}/{name}")
}

/// A PostgreSQL cluster of a test's own, to be killed and restarted under load (the shared test
/// server must never be). `synchronous_commit` is on, so an acknowledged commit is in the WAL the
/// OS holds before the client hears of it; `fsync` is off, which a killed server process (the OS
/// stays up) does not care about.
pub struct Cluster {
    bin: PathBuf,
    _dir: TempDirOwned,
    data: PathBuf,
    log: PathBuf,
    opts: String,
    port: u16,
}

/// A folder under the temp dir removed on drop (the cluster's files belong to `postgres` when we
/// are root, so it is removed as root either way).
struct TempDirOwned(PathBuf);

impl Drop for TempDirOwned {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Cluster {
    /// initdb and start a new cluster on a free loopback port.
    pub fn start() -> Cluster {
        let bin = bindir();
        let dir = std::env::temp_dir().join(format!("settle-test-own-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        if is_root() {
            let st = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status().unwrap();
            assert!(st.success(), "chown of the cluster folder failed");
        }
        let data = dir.join("data");
        let out = pg_tool(
            &bin.join("initdb"),
            &["-D", data.to_str().unwrap(), "-A", "trust", "-U", "postgres", "-E", "UTF8"],
        );
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let port = free_port();
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=on -c max_connections=100",
            dir.display()
        );
        let log = dir.join("log");
        let c = Cluster { bin, _dir: TempDirOwned(dir), data, log, opts, port };
        c.up();
        c
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn pg_ctl(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["-D", self.data.to_str().unwrap()];
        all.extend_from_slice(args);
        pg_tool(&self.bin.join("pg_ctl"), &all)
    }

    /// Starts the server (again) on its port and waits until it accepts connections.
    pub fn up(&self) {
        let out = self.pg_ctl(&["-o", &self.opts, "-l", self.log.to_str().unwrap(), "-w", "-t", "60", "start"]);
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// `pg_ctl stop -m immediate`: every server process is killed at once, as by a crash; the next
    /// start runs crash recovery from the WAL.
    pub fn kill(&self) {
        let out = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
        assert!(out.status.success(), "pg_ctl stop -m immediate failed: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    }
}

/// Waits until `n` sessions on the database at `url` are LISTENing for Settle's wake-ups (a store
/// connects its listener in the background): what a test does next reaches them.
pub async fn until_listening(url: &str, n: i64) {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let mut conn = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%settle_wake%'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if listening >= n {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "only {listening} of {n} wake-up listeners connected");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    conn.close().await.unwrap();
}
