//! A pg_auto_failover formation of the test's own (docs/operations/high-availability.md): a
//! monitor, a primary and two synchronous standbys on loopback ports, as the `postgres` user, the
//! Debian packages installed when missing (as root). Its nodes are killed, restarted and switched
//! over by the failover tests; on drop every process it started is ended and every file it made —
//! the folder and the state pg_autoctl keeps per data folder under the `postgres` user's home — is
//! removed.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PACKAGES: [&str; 2] = ["postgresql-15-auto-failover", "pg-auto-failover-cli"];

/// One node's place in the formation, as the monitor reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    pub name: String,
    pub port: u16,
    pub reported: String,
    pub assigned: String,
}

pub struct Formation {
    root: PathBuf,
    path: String,
    monitor_port: u16,
    ports: Vec<u16>,
    /// `pg_autoctl run` per data folder (index 0 is the monitor), each in a process group of its own.
    keepers: Vec<Option<Child>>,
}

/// Installs pg_auto_failover unless `pg_autoctl` is there.
fn ensure_installed() {
    if !Path::new("/usr/bin/pg_autoctl").exists() {
        install();
    }
}

/// Installs pg_auto_failover from Debian's packages (root only).
fn install() {
    assert!(crate::is_root(), "pg_auto_failover is missing; install {} (as root)", PACKAGES.join(" "));
    eprintln!("settle-testkit: installing {}", PACKAGES.join(" "));
    let update = Command::new("apt-get").args(["update", "-qq"]).status().expect("apt-get");
    assert!(update.success(), "apt-get update failed");
    let st = Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(PACKAGES)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .expect("apt-get install");
    assert!(st.success(), "apt-get install {} failed", PACKAGES.join(" "));
}

fn free_ports(n: usize) -> Vec<u16> {
    // Held together, so no two are the same.
    let held: Vec<_> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    held.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

impl Formation {
    /// A monitor and three nodes; returns once one is primary and two are secondaries.
    pub fn start() -> Formation {
        ensure_installed();
        let root = std::env::temp_dir().join(format!("settle-test-ha-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&root).unwrap();
        if crate::is_root() {
            let st = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&root).status().unwrap();
            assert!(st.success(), "chown of the formation folder failed");
        }
        let ports = free_ports(4);
        let mut f = Formation {
            path: std::env::var("PATH").unwrap_or_default(),
            root,
            monitor_port: ports[0],
            ports: ports[1..].to_vec(),
            keepers: vec![None, None, None, None],
        };
        f.autoctl(&[
            "create",
            "monitor",
            "--pgdata",
            &f.data(0),
            "--pgport",
            &f.monitor_port.to_string(),
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
        ]);
        f.run(0);
        let monitor = format!("postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable", f.monitor_port);
        for node in 1..=3 {
            f.autoctl(&[
                "create",
                "postgres",
                "--pgdata",
                &f.data(node),
                "--pgport",
                &f.ports[node - 1].to_string(),
                "--hostname",
                "127.0.0.1",
                "--auth",
                "trust",
                "--no-ssl",
                "--monitor",
                &monitor,
                "--name",
                &format!("node{node}"),
                "--dbname",
                "settle",
            ]);
            f.run(node);
            // Each node joins before the next is created (the recipe's order).
            f.wait(120, &format!("node{node} to join"), |s| {
                s.iter()
                    .filter(|n| {
                        n.reported == n.assigned && ["single", "primary", "secondary"].contains(&n.reported.as_str())
                    })
                    .count()
                    == node
            });
        }
        f
    }

    fn data(&self, node: usize) -> String {
        let name = if node == 0 { "monitor".to_owned() } else { format!("node{node}") };
        self.root.join(name).to_string_lossy().into_owned()
    }

    fn command(&self, args: &[&str]) -> Command {
        let path = format!("/usr/lib/postgresql/15/bin:{}", self.path);
        let mut c = if crate::is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "env"]).arg(format!("PATH={path}")).arg("pg_autoctl");
            c
        } else {
            let mut c = Command::new("pg_autoctl");
            c.env("PATH", path);
            c
        };
        c.args(args).current_dir(&self.root);
        c
    }

    fn autoctl(&self, args: &[&str]) -> String {
        let out = self.command(args).output().expect("pg_autoctl");
        assert!(
            out.status.success(),
            "pg_autoctl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts node `node`'s keeper (0: the monitor), which starts its PostgreSQL.
    pub fn run(&mut self, node: usize) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join(format!("keeper{node}.log")))
            .unwrap();
        let child = self
            .command(&["run", "--pgdata", &self.data(node)])
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .process_group(0)
            .spawn()
            .expect("pg_autoctl run");
        self.keepers[node] = Some(child);
    }

    /// The multi-host URL of the `settle` database, as `pg_autoctl show uri` gives it (user `postgres`).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("postgres://postgres@{}/settle?target_session_attrs=read-write&sslmode=disable", hosts.join(","))
    }

    /// One node's own URL (`node` 1–3).
    pub fn node_url(&self, node: usize) -> String {
        format!("postgres://postgres@127.0.0.1:{}/settle?sslmode=disable", self.ports[node - 1])
    }

    /// The nodes as the monitor reports them.
    pub fn state(&self) -> Vec<NodeState> {
        let out = self.command(&["show", "state", "--pgdata", &self.data(0), "--json"]).output().expect("pg_autoctl");
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else { return Vec::new() };
        v.as_array()
            .map(|nodes| {
                nodes
                    .iter()
                    .map(|n| NodeState {
                        name: n["nodename"].as_str().unwrap_or_default().to_owned(),
                        port: n["nodeport"].as_u64().unwrap_or_default() as u16,
                        reported: n["current_group_state"].as_str().unwrap_or_default().to_owned(),
                        assigned: n["assigned_group_state"].as_str().unwrap_or_default().to_owned(),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until `done(state)` holds, at most `secs`; panics with the last state otherwise.
    pub fn wait(&self, secs: u64, what: &str, done: impl Fn(&[NodeState]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let s = self.state();
            if done(&s) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the formation did not get to {what} in {secs} s: {s:?}\nthe monitor's last events:\n{}\n{}",
                self.events(30),
                self.unsettled_logs(&s)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The last lines of the keeper's log and of PostgreSQL's own log of every node that is not in
    /// its assigned state: what tells a node stuck in a transition from Settle's part in a failure.
    fn unsettled_logs(&self, s: &[NodeState]) -> String {
        self.logs_of(s.iter().filter(|n| n.reported != n.assigned))
    }

    /// The last lines of the keeper's log and of PostgreSQL's own log of each of `nodes`.
    fn logs_of<'a>(&self, nodes: impl Iterator<Item = &'a NodeState>) -> String {
        let mut out = String::new();
        for n in nodes {
            let Some(node) = self.ports.iter().position(|&port| port == n.port).map(|i| i + 1) else { continue };
            out.push_str(&format!("--- {} ({} → {}): keeper{node}.log\n", n.name, n.reported, n.assigned));
            out.push_str(&tail(&self.root.join(format!("keeper{node}.log")), 40));
            let logs = Path::new(&self.data(node)).join("log");
            let newest = std::fs::read_dir(&logs)
                .into_iter()
                .flatten()
                .flatten()
                .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok());
            if let Some(e) = newest {
                out.push_str(&format!("--- {}: {}\n", n.name, e.path().display()));
                out.push_str(&tail(&e.path(), 30));
            }
        }
        out
    }

    /// The monitor's last `count` events (`pg_autoctl show events`), oldest first: what a failed
    /// test prints so the formation's part in it can be told from Settle's.
    pub fn events(&self, count: usize) -> String {
        let args = ["show", "events", "--pgdata", &self.data(0), "--count", &count.to_string()];
        match self.command(&args).output() {
            Ok(out) => format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
            Err(e) => format!("pg_autoctl show events: {e}"),
        }
    }

    /// The node (1–3) the monitor has as primary, if one is.
    pub fn primary(&self) -> Option<usize> {
        let s = self.state();
        let p = s.iter().find(|n| n.assigned == "primary" && n.reported == "primary")?;
        self.ports.iter().position(|&port| port == p.port).map(|i| i + 1)
    }

    /// The node (1–3) that takes writes now: `primary`, or `wait_primary` (a primary whose standbys
    /// are not all back), as reported.
    pub fn writable(&self) -> Option<usize> {
        let s = self.state();
        let p =
            s.iter().find(|n| n.reported == n.assigned && (n.reported == "primary" || n.reported == "wait_primary"))?;
        self.ports.iter().position(|&port| port == p.port).map(|i| i + 1)
    }

    /// Every node (1–3) that is a secondary, settled.
    pub fn secondaries(&self) -> Vec<usize> {
        let s = self.state();
        s.iter()
            .filter(|n| n.assigned == "secondary" && n.reported == "secondary")
            .filter_map(|n| self.ports.iter().position(|&port| port == n.port).map(|i| i + 1))
            .collect()
    }

    /// SIGKILL of node `node`'s keeper and its PostgreSQL: every process of the keeper's group, the
    /// postmaster and its children, and any other whose command line names the node's data folder.
    /// Their pid files are removed: on a machine whose init does not reap orphans, a killed
    /// process lingers as a zombie that `kill -0` still finds, and pg_autoctl and PostgreSQL would
    /// take it for a running instance and refuse to start again. So is the socket's lock file,
    /// which names the dead postmaster's pid: once another process has that pid (on a busy
    /// machine, often), PostgreSQL refuses to start ("lock file … already exists"), and
    /// pg_autoctl's retries then race its own standby setup — seen on 2026-12-06: a standby
    /// started without `standby.signal`, ran crash recovery as a primary, and its WAL no longer
    /// followed the primary's (it never streamed again).
    pub fn kill(&mut self, node: usize) {
        let postmaster = self.postmaster(node);
        let socket_lock = self.socket_lock(node);
        if let Some(mut child) = self.keepers[node].take() {
            let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
            let _ = child.wait();
        }
        if let Some(pm) = postmaster {
            for pid in std::iter::once(pm).chain(children_of(pm)) {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
        }
        kill_naming(&self.data(node));
        if let Some(lock) = socket_lock {
            let _ = std::fs::remove_file(&lock);
            let _ = std::fs::remove_file(lock.with_extension(""));
        }
        let _ = std::fs::remove_file(Path::new(&self.data(node)).join("postmaster.pid"));
        let _ = std::fs::remove_file(runtime_dir(&self.data(node)).join("pg_autoctl.pid"));
    }

    /// The lock file of the node's Unix socket (`<socket dir>/.s.PGSQL.<port>.lock`), from the
    /// port and socket directory its `postmaster.pid` records (lines 4 and 5).
    fn socket_lock(&self, node: usize) -> Option<PathBuf> {
        let pidfile = std::fs::read_to_string(Path::new(&self.data(node)).join("postmaster.pid")).ok()?;
        let lines: Vec<&str> = pidfile.lines().collect();
        let (port, dir) = (lines.get(3)?.trim(), lines.get(4)?.trim());
        (!dir.is_empty()).then(|| Path::new(dir).join(format!(".s.PGSQL.{port}.lock")))
    }

    /// The node's postmaster, from its `postmaster.pid`.
    fn postmaster(&self, node: usize) -> Option<u32> {
        let pidfile = std::fs::read_to_string(Path::new(&self.data(node)).join("postmaster.pid")).ok()?;
        pidfile.lines().next().and_then(|l| l.trim().parse::<u32>().ok())
    }

    /// SIGSTOP of node `node`'s keeper and PostgreSQL (the keeper's whole process group): the node
    /// is there but answers nothing — a standby that stops acknowledging.
    pub fn pause(&self, node: usize) {
        self.signal_group(node, "-STOP");
    }

    /// SIGCONT after [`Formation::pause`].
    pub fn resume(&self, node: usize) {
        self.signal_group(node, "-CONT");
    }

    /// `signal` to the node's keeper group and to its PostgreSQL — the postmaster (from its
    /// `postmaster.pid`) and every process it started (the keeper starts it in a group of its own).
    fn signal_group(&self, node: usize, signal: &str) {
        let child = self.keepers[node].as_ref().expect("the node's keeper runs");
        let st = Command::new("kill").args([signal, "--", &format!("-{}", child.id())]).status().unwrap();
        assert!(st.success(), "kill {signal} of node{node}'s process group failed");
        let postmaster = self.postmaster(node).unwrap_or_else(|| panic!("node{node} has no postmaster.pid"));
        for pid in std::iter::once(postmaster).chain(children_of(postmaster)) {
            let _ = Command::new("kill").args([signal, &pid.to_string()]).status();
        }
    }

    /// Waits until the primary streams to `standbys` standbys that have replayed to within 1 MB of
    /// its WAL, at most `secs`. A standby the monitor calls `secondary` may still be replaying
    /// what it missed while it was down; switched over in that state, pg_auto_failover 1.6's
    /// rejoin can leave it in `join_secondary` for good, waiting for WAL of the old timeline
    /// (seen on 2026-12-05: "waiting for WAL to become available" for four minutes). An operator
    /// switches over to caught-up standbys; so does the test.
    pub fn wait_caught_up(&self, standbys: usize, secs: u64) {
        let sql = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' \
                   AND pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn) < 1048576";
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let caught_up = self
                .writable()
                .and_then(|p| self.psql(p, sql))
                .and_then(|out| out.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if caught_up >= standbys {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standbys did not catch up in {secs} s: {:?}\n{}\n{}",
                self.writable().and_then(|p| self.psql(
                    p,
                    "SELECT application_name, state, pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn) \
                     FROM pg_stat_replication"
                )),
                self.events(20),
                self.logs_of(self.state().iter().filter(|n| n.assigned != "primary"))
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `sql` run by psql on node `node` (1–3) as `postgres`: its unaligned output, or None.
    fn psql(&self, node: usize, sql: &str) -> Option<String> {
        let port = self.ports[node - 1].to_string();
        let args = ["-h", "127.0.0.1", "-p", &port, "-d", "settle", "-XAtc", sql];
        let psql = "/usr/lib/postgresql/15/bin/psql";
        let out = if crate::is_root() {
            Command::new("runuser").args(["-u", "postgres", "--", psql]).args(args).output()
        } else {
            Command::new(psql).args(args).output()
        }
        .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `pg_autoctl perform switchover`: the monitor promotes a standby after the primary drained.
    /// Returns at once (`--wait 0`): the caller waits for the new primary with [`Formation::wait`]
    /// (pg_autoctl's own wait gives up after 60 s while a standby that just rejoined reports in).
    pub fn switchover(&self) {
        self.autoctl(&["perform", "switchover", "--pgdata", &self.data(0), "--wait", "0"]);
    }
}

/// Where pg_autoctl keeps a data folder's pid file: `$XDG_RUNTIME_DIR/pg_autoctl/…`, else
/// `/tmp/pg_autoctl/…` (runuser passes no `XDG_RUNTIME_DIR` to the postgres user here).
fn runtime_dir(pgdata: &str) -> PathBuf {
    Path::new("/tmp/pg_autoctl").join(pgdata.trim_start_matches('/'))
}

/// The last `lines` lines of a file, or why there are none.
fn tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            let mut out = all[all.len().saturating_sub(lines)..].join("\n");
            out.push('\n');
            out
        }
        Err(e) => format!("({}: {e})\n", path.display()),
    }
}

/// The processes whose parent is `parent` (from `/proc/*/stat`).
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            // The parent pid is the second field after the command's closing parenthesis.
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse::<u32>().ok()?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

/// SIGKILL of every process whose command line contains `needle`.
fn kill_naming(needle: &str) {
    let Ok(dir) = std::fs::read_dir("/proc") else { return };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if pid == std::process::id() as i32 {
            continue;
        }
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
        if String::from_utf8_lossy(&cmd).contains(needle) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    }
}

impl Drop for Formation {
    fn drop(&mut self) {
        for node in (0..self.keepers.len()).rev() {
            if let Some(mut child) = self.keepers[node].take() {
                let _ = Command::new("kill").args(["-TERM", "--", &format!("-{}", child.id())]).status();
                let deadline = Instant::now() + Duration::from_secs(20);
                while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(100));
                }
                let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
                let _ = child.wait();
            }
        }
        for node in 0..self.keepers.len() {
            if let Some(pm) = self.postmaster(node) {
                for pid in std::iter::once(pm).chain(children_of(pm)) {
                    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                }
            }
        }
        kill_naming(&self.root.to_string_lossy());
        if std::env::var_os("SETTLE_KEEP_FORMATION").is_some() {
            eprintln!("formation kept at {}", self.root.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_dir_all(runtime_dir(&self.root.to_string_lossy()));
        // pg_autoctl's state per data folder, under the postgres user's home.
        let home = if crate::is_root() {
            PathBuf::from("/var/lib/postgresql")
        } else {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
        };
        let rel = self.root.strip_prefix("/").unwrap_or(&self.root).to_owned();
        for base in [".config/pg_autoctl", ".local/share/pg_autoctl"] {
            let _ = std::fs::remove_dir_all(home.join(base).join(&rel));
        }
    }
}
