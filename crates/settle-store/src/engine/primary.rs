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
/// A COMMIT that took this long waited for a standby, long enough to have been let go by its server
/// turning synchronous replication off (docs/decisions/0027): its server is asked again after it.
const SLOW_COMMIT: Duration = Duration::from_secs(1);
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

    /// How many hosts the URL lists.
    pub fn count(&self) -> usize {
        self.0.len()
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
    /// Only a primary that replicates synchronously is taken (docs/decisions/0027).
    synchronous: bool,
    pub counters: Counters,
}

/// What one host answered a probe.
enum Role {
    /// Takes writes, on this timeline.
    Primary(u32),
    Standby,
    ReadOnly,
    /// Takes writes but waits for no standby (`synchronous_standby_names` is empty: pg_auto_failover's
    /// `wait_primary`, a primary just promoted or one whose standbys are gone): what it acknowledges
    /// can be lost by the next failover. Refused when the store requires a synchronous standby; its
    /// timeline still counts, so an older primary still up is not taken instead.
    Asynchronous(u32),
}

impl Role {
    /// Why a host that is not taken as the primary was not, after its name.
    fn refusal(&self) -> String {
        match self {
            Role::Primary(timeline) => format!("is on timeline {timeline}, behind the primary's"),
            Role::Standby => "is a standby (in recovery)".to_owned(),
            Role::ReadOnly => "takes no writes (transaction_read_only)".to_owned(),
            Role::Asynchronous(_) => {
                "replicates to no synchronous standby (synchronous_standby_names is empty, as in pg_auto_failover's \
                 wait_primary): a failover could lose what it acknowledges"
                    .to_owned()
            }
        }
    }
}

async fn role(options: &PgConnectOptions, synchronous: bool) -> Result<Role, String> {
    let asked = async {
        let mut c = options.connect().await.map_err(|e| e.to_string())?;
        let role = ask_role(&mut c, synchronous).await.map_err(|e| e.to_string());
        let _ = c.close().await;
        role
    };
    match tokio::time::timeout(PROBE_HOST_TIMEOUT, asked).await {
        Ok(answer) => answer,
        Err(_) => Err(format!("no answer in {} s", PROBE_HOST_TIMEOUT.as_secs())),
    }
}

/// A standby, a server that refuses writes (`default_transaction_read_only`), one that replicates
/// asynchronously (when `synchronous` is asked for), or a primary with its current timeline (from
/// its WAL file name): after a promotion the new primary's is higher.
async fn ask_role(c: &mut PgConnection, synchronous: bool) -> Result<Role, sqlx::Error> {
    // One round trip; `pg_walfile_name` fails during recovery, so it is asked of a primary only.
    let (standby, read_only, replicated, timeline): (bool, bool, bool, String) = sqlx::query_as(
        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on', \
                current_setting('synchronous_standby_names') <> '', \
                CASE WHEN pg_is_in_recovery() THEN '' ELSE substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END",
    )
    .fetch_one(c)
    .await?;
    let timeline = u32::from_str_radix(&timeline, 16).unwrap_or(0);
    Ok(if standby {
        Role::Standby
    } else if read_only {
        Role::ReadOnly
    } else if synchronous && !replicated {
        Role::Asynchronous(timeline)
    } else {
        Role::Primary(timeline)
    })
}

/// Whether a pooled connection's server still waits for a synchronous standby at COMMIT: asked
/// before each use instead of a bare ping when the store requires one (the same round trip).
async fn still_synchronous(c: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT current_setting('synchronous_standby_names') <> ''").fetch_one(c).await
}

impl Primary {
    /// Finds the primary among `hosts` (a clear refusal naming what each host answered when none
    /// is), for the pools made with [`Primary::pool_options`].
    pub async fn find(hosts: Hosts, synchronous: bool) -> Result<Arc<Primary>, StoreError> {
        let p = Arc::new(Primary {
            synchronous,
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

    /// The primary's connect options (the pools are made with them).
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
                    let Some(p) = primary.upgrade() else { return Ok(()) };
                    let role = ask_role(conn, p.synchronous).await?;
                    p.counters.connections_opened.fetch_add(1, Ordering::Relaxed);
                    match role {
                        Role::Primary(timeline) if timeline >= p.timeline.load(Ordering::SeqCst) => {
                            p.timeline.fetch_max(timeline, Ordering::SeqCst);
                            return Ok(());
                        }
                        Role::Asynchronous(timeline) => {
                            p.timeline.fetch_max(timeline, Ordering::SeqCst);
                        }
                        _ => {}
                    }
                    p.signal();
                    Err(sqlx::Error::Protocol(format!("{} {}, not the primary", p.host(), role.refusal())))
                })
            })
            .before_acquire(move |conn, meta| {
                let primary = on_acquire.upgrade();
                let fresh = primary.as_ref().is_none_or(|p| p.is_after_epoch(meta.age));
                Box::pin(async move {
                    if !fresh {
                        return Ok(false);
                    }
                    let Some(p) = primary.filter(|p| p.synchronous) else {
                        return Ok(matches!(tokio::time::timeout(PING_LIMIT, conn.ping()).await, Ok(Ok(()))));
                    };
                    match tokio::time::timeout(PING_LIMIT, still_synchronous(conn)).await {
                        Ok(Ok(true)) => Ok(true),
                        // Its server stopped waiting for a standby: closed, and the hunt looks for
                        // a primary that does (a new connection to this one is refused until then).
                        Ok(Ok(false)) => {
                            p.signal();
                            Ok(false)
                        }
                        _ => Ok(false),
                    }
                })
            })
    }

    /// After a COMMIT that took `took`, on its connection: when the store requires a synchronous
    /// standby and the COMMIT waited long enough to have been let go by its server turning
    /// synchronous replication off — pg_auto_failover cancels the waits when it does, and
    /// PostgreSQL then answers success with only a warning — asks whether the server still waits for
    /// a standby (the backend reads the reloaded setting before this query). One that no longer
    /// does may hold the commit alone: the outcome is unknown (`Unavailable`, a `503`; the same
    /// request again converges through the guards).
    pub async fn confirm_commit(&self, conn: &mut PgConnection, took: Duration) -> Result<(), StoreError> {
        if !self.synchronous || took < SLOW_COMMIT {
            return Ok(());
        }
        match tokio::time::timeout(PING_LIMIT, still_synchronous(conn)).await {
            Ok(Ok(true)) => Ok(()),
            _ => Err(StoreError::Unavailable(
                "the COMMIT waited for a standby and its server then stopped waiting for one (or did not answer): \
                 it may hold this commit alone, so the outcome is unknown"
                    .into(),
            )),
        }
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
    /// a tie. When the host on the highest timeline replicates asynchronously and the store requires
    /// a synchronous standby, there is no primary yet: an older one still up is never taken instead.
    async fn look(&self) -> Result<usize, StoreError> {
        let n = self.hosts.0.len();
        let current = self.current.load(Ordering::SeqCst);
        let mut best: Option<(u32, usize)> = None;
        let mut newest = 0;
        let mut answers = Vec::new();
        for i in (0..n).map(|k| (current + k) % n) {
            let (name, options) = &self.hosts.0[i];
            match role(options, self.synchronous).await {
                Ok(Role::Primary(timeline)) => {
                    newest = newest.max(timeline);
                    if best.is_none_or(|(t, _)| timeline > t) {
                        best = Some((timeline, i));
                    }
                }
                Ok(other) => {
                    if let Role::Asynchronous(timeline) = other {
                        newest = newest.max(timeline);
                    }
                    answers.push(format!("{name} {}", other.refusal()));
                }
                Err(e) => answers.push(format!("{name}: {e}")),
            }
        }
        self.timeline.fetch_max(newest, Ordering::SeqCst);
        match best {
            Some((timeline, i)) if timeline >= newest => return Ok(i),
            Some((timeline, i)) => {
                answers.push(format!("{} is on timeline {timeline}, behind the newest ({newest})", self.hosts.0[i].0))
            }
            None => {}
        }
        Err(StoreError::Unavailable(format!("no writable PostgreSQL primary: {}", answers.join("; "))))
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
