//! PostgreSQL: which of the URL's hosts is the writable primary (docs/decisions/0024).
//!
//! - [`Hosts::parse`]: libpq's multi-host URL (`postgres://u@h1:p1,h2:p2/db?target_session_attrs=read-write`),
//!   one set of connect options per host.
//! - [`Primary::signal`]: a hunt that asks every host `pg_is_in_recovery()` and points every pool
//!   at the primary; one at a time.
//! - Every new pooled connection is checked the same way ([`Primary::pool_options`]'s
//!   `after_connect`). A failover signal (an `Unavailable` answer: a read-only transaction, a
//!   shutdown, a cut connection) closes the connection that met it and starts a probe; when the
//!   probe finds the primary moved, or no primary, it marks an epoch before which no pooled
//!   connection is used again.

use crate::error::StoreError;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a probe waits for one host to connect and answer.
const PROBE_HOST_TIMEOUT: Duration = Duration::from_secs(3);
/// How long an idle pooled connection's ping may take before it is closed instead of used.
const PING_LIMIT: Duration = Duration::from_secs(2);
/// Between two probes of a hunt that found no primary.
const HUNT_PAUSE: Duration = Duration::from_millis(500);

/// The hosts of a PostgreSQL URL, each with the URL's user, database and parameters.
#[derive(Clone)]
pub(crate) struct Hosts(Vec<(String, PgConnectOptions)>);

impl Hosts {
    /// Parses `postgres://[user[:password]@]h1[:p1][,h2[:p2]…][/db][?params]`. Settle reads
    /// `target_session_attrs` itself: `read-write` (the default) or `primary`, since it only writes.
    pub fn parse(url: &str) -> Result<Hosts, StoreError> {
        let bad = |why: &str| StoreError::invalid(format!("bad postgres url {}: {why}", crate::db::redacted_url(url)));
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
        // The authority ends at the first `/` or `?`; its user info at its last `@`, so a raw `@`
        // in a password stays in it.
        let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
        let (userinfo, after) = match authority.rfind('@') {
            Some(i) => (Some(&rest[..i]), &rest[i + 1..]),
            None => (None, rest),
        };
        let tail_at = after.find(['/', '?']).unwrap_or(after.len());
        let (hostlist, tail) = after.split_at(tail_at);
        let (path, query) = match tail.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (tail, None),
        };
        let mut params = Vec::new();
        for p in query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty()) {
            match p.split_once('=') {
                Some(("target_session_attrs", v)) => match v {
                    "read-write" | "primary" => {}
                    other => {
                        return Err(bad(&format!(
                            "target_session_attrs={other}: Settle writes, so only read-write or primary"
                        )));
                    }
                },
                Some(("host" | "hostaddr" | "port", v)) if v.contains(',') => {
                    return Err(bad("list the hosts in the authority (h1:p1,h2:p2), not in host= or port="));
                }
                _ => params.push(p),
            }
        }
        let query = if params.is_empty() { String::new() } else { format!("?{}", params.join("&")) };
        let user = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let mut hosts = Vec::new();
        for host in hostlist.split(',') {
            if hostlist.contains(',') && host.is_empty() {
                return Err(bad("an empty host in the host list"));
            }
            let one = format!("{scheme}://{user}{host}{path}{query}");
            let options = PgConnectOptions::from_str(&one).map_err(|e| bad(&e.to_string()))?;
            let name = if host.is_empty() { "localhost".to_owned() } else { host.to_owned() };
            hosts.push((name, options));
        }
        Ok(Hosts(hosts))
    }

    /// Each host's options, changed by `f` (the session settings every connection gets).
    pub fn map(self, f: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Hosts {
        Hosts(self.0.into_iter().map(|(name, o)| (name, f(o))).collect())
    }
}

/// A pooled connection that goes back to its pool only when its user says it ended cleanly
/// ([`Leased::clean`]); otherwise — an error that may have left it unusable, a transaction cut off
/// mid-flight by a dropped future or a deadline — it is closed (sqlx's close has a time limit;
/// its return to the pool pings without one).
pub(crate) struct Leased {
    conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
    clean: bool,
}

impl Leased {
    pub async fn acquire(pool: &PgPool) -> Result<Leased, sqlx::Error> {
        Ok(Leased { conn: pool.acquire().await?, clean: false })
    }

    /// The connection ended cleanly (no transaction open, no failover signal): it may be reused.
    pub fn clean(&mut self) {
        self.clean = true;
    }

    /// Clean unless `result` is a failover signal (`Unavailable`).
    pub fn clean_unless_unavailable<T>(&mut self, result: &Result<T, StoreError>) {
        if !matches!(result, Err(StoreError::Unavailable(_))) {
            self.clean = true;
        }
    }
}

impl std::ops::Deref for Leased {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for Leased {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Drop for Leased {
    fn drop(&mut self) {
        if !self.clean {
            self.conn.close_on_drop();
        }
    }
}

/// Counters for `/metrics`, kept without a database read so they answer during an outage.
#[derive(Default)]
pub(crate) struct Counters {
    pub connections_opened: AtomicU64,
    pub failover_signals: AtomicU64,
    pub primary_changes: AtomicU64,
}

/// The primary among the hosts, and the pools that follow it.
pub(crate) struct Primary {
    hosts: Hosts,
    current: AtomicUsize,
    pools: Mutex<Vec<PgPool>>,
    /// The newest failover signal: a pooled connection opened before it is closed, not used.
    epoch: Mutex<Option<Instant>>,
    /// A hunt for the primary is on.
    hunting: AtomicBool,
    /// The highest timeline a primary was seen on: a connection to a server behind it is refused.
    timeline: AtomicU32,
    pub counters: Counters,
}

/// What one host answered a probe.
enum Role {
    /// Takes writes, on this timeline.
    Primary(u32),
    Standby,
    ReadOnly,
}

async fn role(options: &PgConnectOptions) -> Result<Role, String> {
    let asked = async {
        let mut c = options.connect().await.map_err(|e| e.to_string())?;
        let role = ask_role(&mut c).await.map_err(|e| e.to_string());
        let _ = c.close().await;
        role
    };
    match tokio::time::timeout(PROBE_HOST_TIMEOUT, asked).await {
        Ok(answer) => answer,
        Err(_) => Err(format!("no answer in {} s", PROBE_HOST_TIMEOUT.as_secs())),
    }
}

/// A standby, a server that refuses writes (`default_transaction_read_only`), or a primary with
/// its current timeline (from its WAL file name): after a promotion the new primary's is higher.
async fn ask_role(c: &mut PgConnection) -> Result<Role, sqlx::Error> {
    // One round trip; `pg_walfile_name` fails during recovery, so it is asked of a primary only.
    let (standby, read_only, timeline): (bool, bool, String) = sqlx::query_as(
        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on', \
                CASE WHEN pg_is_in_recovery() THEN '' ELSE substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END",
    )
    .fetch_one(c)
    .await?;
    Ok(if standby {
        Role::Standby
    } else if read_only {
        Role::ReadOnly
    } else {
        Role::Primary(u32::from_str_radix(&timeline, 16).unwrap_or(0))
    })
}

impl Primary {
    /// Finds the primary among `hosts` (a clear refusal naming what each host answered when none
    /// is), for the pools made with [`Primary::pool_options`].
    pub async fn find(hosts: Hosts) -> Result<Arc<Primary>, StoreError> {
        let p = Arc::new(Primary {
            hosts,
            current: AtomicUsize::new(0),
            pools: Mutex::new(Vec::new()),
            epoch: Mutex::new(None),
            hunting: AtomicBool::new(false),
            timeline: AtomicU32::new(0),
            counters: Counters::default(),
        });
        let found = p.look().await?;
        p.current.store(found, Ordering::SeqCst);
        Ok(p)
    }

    /// The primary's connect options (for a connection outside the pools: the migrator's lock).
    pub fn options(&self) -> PgConnectOptions {
        self.hosts.0[self.current.load(Ordering::SeqCst)].1.clone()
    }

    /// The host connections go to now (`host:port` as written in the URL).
    pub fn host(&self) -> String {
        self.hosts.0[self.current.load(Ordering::SeqCst)].0.clone()
    }

    /// Pool options whose connections are checked to be the primary's when made — not a standby,
    /// not read-only, not on a timeline older than one a probe has seen (an old primary still up
    /// after a promotion) — and are closed, not used, once a failover epoch newer than them passed.
    /// An idle connection is pinged (2 s at most) only after that check, so a stale one costs no
    /// wait on a host that is gone.
    pub fn pool_options(self: &Arc<Self>) -> PgPoolOptions {
        let (on_connect, on_acquire) = (Arc::downgrade(self), Arc::downgrade(self));
        PgPoolOptions::new()
            .test_before_acquire(false)
            .after_connect(move |conn, _meta| {
                let primary = on_connect.clone();
                Box::pin(async move {
                    let role = ask_role(conn).await?;
                    let Some(p) = primary.upgrade() else { return Ok(()) };
                    p.counters.connections_opened.fetch_add(1, Ordering::Relaxed);
                    let refused = match role {
                        Role::Primary(timeline) if timeline >= p.timeline.load(Ordering::SeqCst) => {
                            p.timeline.fetch_max(timeline, Ordering::SeqCst);
                            return Ok(());
                        }
                        Role::Primary(timeline) => format!("is on timeline {timeline}, behind the primary's"),
                        Role::Standby => "is a standby (in recovery)".to_owned(),
                        Role::ReadOnly => "takes no writes (transaction_read_only)".to_owned(),
                    };
                    p.signal();
                    Err(sqlx::Error::Protocol(format!("{} {refused}, not the primary", p.host())))
                })
            })
            .before_acquire(move |conn, meta| {
                let fresh = on_acquire.upgrade().is_none_or(|p| p.is_after_epoch(meta.age));
                Box::pin(async move {
                    if !fresh {
                        return Ok(false);
                    }
                    Ok(matches!(tokio::time::timeout(PING_LIMIT, conn.ping()).await, Ok(Ok(()))))
                })
            })
    }

    /// Registers a pool to follow the primary.
    pub fn follow(&self, pool: &PgPool) {
        self.pools.lock().unwrap_or_else(|p| p.into_inner()).push(pool.clone());
    }

    /// Whether a connection opened `age` ago is newer than the newest failover signal.
    pub fn is_after_epoch(&self, age: Duration) -> bool {
        let epoch = *self.epoch.lock().unwrap_or_else(|p| p.into_inner());
        match (epoch, Instant::now().checked_sub(age)) {
            (Some(epoch), Some(made)) => made > epoch,
            _ => true,
        }
    }

    /// A failover signal: the server may no longer be the primary (or be gone). A hunt looks for
    /// the primary — again every 500 ms until one answers, so Settle is back within a probe of the
    /// promotion — unless one is on; the connection that met the signal is closed by its user.
    pub fn signal(self: &Arc<Self>) {
        self.counters.failover_signals.fetch_add(1, Ordering::Relaxed);
        if self.hunting.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(p) = weak.upgrade() else { return };
                match p.probe().await {
                    Ok(()) => {
                        p.hunting.store(false, Ordering::SeqCst);
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "looking for the PostgreSQL primary"),
                }
                drop(p);
                tokio::time::sleep(HUNT_PAUSE).await;
            }
        });
    }

    /// Looks for the primary and points every pool at it (one hunt at a time: [`Primary::signal`]).
    /// Pooled connections are given up (the failover epoch moves) when the primary moved, or when
    /// no host is one.
    async fn probe(&self) -> Result<(), StoreError> {
        let found = match self.look().await {
            Ok(found) => found,
            Err(e) => {
                self.mark_epoch();
                return Err(e);
            }
        };
        if self.current.swap(found, Ordering::SeqCst) != found {
            self.counters.primary_changes.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(primary = %self.hosts.0[found].0, "the PostgreSQL primary moved; connections follow it");
            let options = self.hosts.0[found].1.clone();
            for pool in self.pools.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                pool.set_connect_options(options.clone());
            }
            // Connections made before this point led elsewhere.
            self.mark_epoch();
        }
        Ok(())
    }

    fn mark_epoch(&self) {
        *self.epoch.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// Asks every host; the primary is the one that takes writes, on the highest timeline when two
    /// say they do (an old primary back up before it learned of its demotion), the current host on
    /// a tie.
    async fn look(&self) -> Result<usize, StoreError> {
        let n = self.hosts.0.len();
        let current = self.current.load(Ordering::SeqCst);
        let mut best: Option<(u32, usize)> = None;
        let mut answers = Vec::new();
        for i in (0..n).map(|k| (current + k) % n) {
            let (name, options) = &self.hosts.0[i];
            match role(options).await {
                Ok(Role::Primary(timeline)) => {
                    if best.is_none_or(|(t, _)| timeline > t) {
                        best = Some((timeline, i));
                    }
                }
                Ok(Role::Standby) => answers.push(format!("{name} is a standby (in recovery)")),
                Ok(Role::ReadOnly) => answers.push(format!("{name} takes no writes (transaction_read_only)")),
                Err(e) => answers.push(format!("{name}: {e}")),
            }
        }
        if let Some((timeline, _)) = best {
            self.timeline.fetch_max(timeline, Ordering::SeqCst);
        }
        best.map(|(_, i)| i)
            .ok_or_else(|| StoreError::Unavailable(format!("no writable PostgreSQL primary: {}", answers.join("; "))))
    }
}

#[cfg(test)]
mod tests {
    use super::Hosts;

    #[test]
    fn a_host_list_is_one_set_of_options_per_host() {
        let h = Hosts::parse("postgres://u:p@w0rd@10.0.0.1:6001,10.0.0.2:6002,db3/settle?target_session_attrs=read-write&application_name=a@b")
            .unwrap();
        let names: Vec<_> = h.0.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["10.0.0.1:6001", "10.0.0.2:6002", "db3"]);
        assert_eq!(h.0[1].1.get_port(), 6002);
        assert_eq!(h.0[2].1.get_port(), 5432);
        assert_eq!(h.0[0].1.get_database(), Some("settle"));
        assert_eq!(h.0[0].1.get_username(), "u");
        let one = Hosts::parse("postgres://localhost/settle").unwrap();
        assert_eq!(one.0.len(), 1);
    }

    #[test]
    fn a_url_that_asks_for_a_standby_or_lists_hosts_in_parameters_is_refused() {
        for url in [
            "postgres://h1,h2/settle?target_session_attrs=read-only",
            "postgres://h1,h2/settle?target_session_attrs=any",
            "postgres://h1,,h2/settle",
            "postgres:///settle?host=h1,h2",
        ] {
            let e = Hosts::parse(url).err().unwrap_or_else(|| panic!("{url} was taken"));
            assert!(e.to_string().contains("bad postgres url"), "{e}");
        }
    }
}
