//! The etcd store: several coordinators over one etcd cluster, one leading.
//!
//! # Keys (under `prefix`, by default `/pagewire/<cluster_name>/`)
//!
//! * `leader`: the leading coordinator's gRPC address, attached to its etcd
//!   lease. The key's *create revision* is that leader's **fence**.
//! * `state`: the cluster state, the `PersistedState` protobuf (members,
//!   map, epoch, policy; the state file holds the same message).
//! * `epochs/<epoch, 20 decimal digits>`: one record per published epoch,
//!   JSON `{"leader": address, "fence": revision, "reason": text}`, created
//!   exactly once in the transaction that stores that epoch's state. The
//!   last [`KEEP_EPOCHS`] are kept. It is the audit trail the tests check:
//!   every epoch written once, each by a fenced leader.
//! * `coordinators/<address>`: one key per running coordinator, under its
//!   own lease, so `Status` lists them.
//!
//! # Election (one task per coordinator, [`EtcdStore::elect`])
//!
//! 1. **Session.** Grant a lease of `lease_ttl_s`; keep it alive every
//!    TTL/3 ([`EtcdStore::keep_alive`]). An answered keep-alive sent at `t`
//!    makes the session valid until `t + TTL` (etcd counts the TTL from when
//!    it received the request, which is later). A keep-alive stream that
//!    breaks or stays silent is dropped and opened again (a late answer on
//!    an old stream must not be taken for a newer request's), with the same
//!    lease, until the session's validity runs out: then the session ends.
//! 2. **Campaign.** A transaction: if `leader` does not exist
//!    (`create_revision == 0`), put it with this coordinator's address
//!    under the session lease; else read it.
//! 3. **Won.** A new term begins ([`Leadership::begin_term`]); the fence is
//!    the transaction's revision. The task reads `state` and hands it to the
//!    service ([`Event::Lead`]), which loads it, gives every member a fresh
//!    lease, and only then leads ([`Leadership::lead`], for that term only).
//!    It leads until the session ends, the leader key is gone or not its
//!    own, or a save is fenced off or gets no answer.
//! 4. **Lost.** Follow the key's value; watch the key; campaign again when
//!    it is deleted (its leader resigned, or its lease expired).
//! 5. **Stepping down** is immediate and local: the role changes before
//!    anything else, so no write starts after it. The lease is then revoked
//!    (best effort; a lease that could not be revoked is revoked when etcd
//!    answers again), so the others need not wait out the TTL.
//!
//! # Fencing (every save, [`Store::save`])
//!
//! A transaction: `create_revision(leader) == fence` (and, when the save
//! publishes epoch `E`, `create_revision(epochs/E) == 0`) → put `state`, put
//! `epochs/E`, delete `epochs/(E - KEEP_EPOCHS)`; else read `leader`. A
//! failed comparison means another coordinator leads (or `E` exists): step
//! down, refuse. No answer within `request_timeout_ms`: the outcome is
//! unknown, so step down too; whoever leads next reads back what etcd holds.
//! The cluster rolls its change back and publishes nothing unless the save
//! succeeded.
//!
//! # Followers
//!
//! A watch on `state` ([`EtcdStore::follow_state`]) hands every new state to
//! the service ([`Event::State`]), which loads it unless it leads. A follower
//! answers `GetMap` and `ListNodes`, and opens a `WatchMap` stream (and
//! answers `Status` without a `store_problem`), only after
//! [`EtcdStore::confirm`]: a quorum read of `state`'s mod revision, then a
//! wait until the watch has delivered that revision. So an answer is the state etcd held at some instant after the
//! call arrived, as the leader's own would be.
//!
//! # Critical interleavings
//!
//! * *A leader paused past its lease* (SIGSTOP) while another wins: on
//!   waking, its session's validity has passed, so [`Leadership`] says it
//!   does not lead before it serves anything; and any save it had started
//!   carries the old fence, which no longer matches the new leader key.
//! * *Stepping down between winning and loading the state*: the term moved
//!   on, so the late [`Leadership::lead`] does nothing.
//! * *A state event queued before this coordinator won*: the service skips
//!   state events while it leads, and the state it leads from was read after
//!   the win, when no one else could write.
//! * *A save that commits but whose answer comes too late*: the watch may
//!   deliver its revision while the save still waits, i.e. while this
//!   coordinator leads. The service decides a state event under the cluster
//!   lock, which the save holds until it has stepped down and rolled back;
//!   it then no longer leads, and loads the state etcd holds instead of
//!   keeping the epoch before it (see [`crate::follow::apply_events`]).
//! * *Losing quorum*: keep-alives go unanswered, the leader steps down
//!   within one TTL, campaigns fail, every coordinator reports the problem
//!   (`Status.store_problem`, a warning in the log), and no map changes.
//!   Nodes keep the map they have until their own leases run out. When a
//!   member returns, leases are granted again and an election follows.

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use prost::Message;
use tokio::runtime::Handle;
use tokio::sync::{Notify, mpsc};

use super::{BoxFuture, Store, StoreError};
use crate::follow::Event;
use crate::ha::Leadership;
use crate::metrics::Metrics;
use crate::persist::PersistedState;

/// How many `epochs/` records are kept.
pub const KEEP_EPOCHS: u64 = 4096;

/// How the coordinator reaches etcd (the `[etcd]` config section).
#[derive(Debug, Clone)]
pub(crate) struct EtcdOptions {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) lease_ttl_s: u64,
    pub(crate) request_timeout: Duration,
    pub(crate) user: Option<(String, String)>,
    pub(crate) ca_file: Option<PathBuf>,
    pub(crate) cert_file: Option<PathBuf>,
    pub(crate) key_file: Option<PathBuf>,
    pub(crate) domain: String,
}

impl EtcdOptions {
    /// The options from the config, with `endpoints` from its `store`.
    pub(crate) fn from_config(
        cfg: &crate::Config,
        endpoints: Vec<String>,
    ) -> Result<Self, crate::StartError> {
        let e = &cfg.etcd;
        let user = match &e.password_file {
            Some(path) => {
                let password = std::fs::read_to_string(path)
                    .map_err(|err| {
                        crate::StartError::Store(format!(
                            "cannot read etcd.password_file {}: {err}",
                            path.display()
                        ))
                    })?
                    .trim()
                    .to_owned();
                Some((e.username.clone(), password))
            }
            None => None,
        };
        Ok(Self {
            endpoints,
            prefix: cfg.etcd_prefix(),
            lease_ttl_s: e.lease_ttl_s,
            request_timeout: Duration::from_millis(e.request_timeout_ms),
            user,
            ca_file: e.ca_file.clone(),
            cert_file: e.cert_file.clone(),
            key_file: e.key_file.clone(),
            domain: e.domain.clone(),
        })
    }
}

#[derive(Debug, Clone)]
struct Keys {
    leader: String,
    state: String,
    epochs: String,
    coordinators: String,
}

impl Keys {
    fn new(prefix: &str) -> Self {
        let p = if prefix.ends_with('/') {
            prefix.to_owned()
        } else {
            format!("{prefix}/")
        };
        Self {
            leader: format!("{p}leader"),
            state: format!("{p}state"),
            epochs: format!("{p}epochs/"),
            coordinators: format!("{p}coordinators/"),
        }
    }

    fn epoch(&self, e: u64) -> String {
        format!("{}{e:020}", self.epochs)
    }
}

/// The record stored under `epochs/<E>`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct EpochRecord {
    pub leader: String,
    pub fence: i64,
    pub reason: String,
}

pub(crate) struct EtcdStore {
    handle: Handle,
    /// Ends the store's runtime thread when dropped.
    _stop: std::sync::mpsc::SyncSender<()>,
    client: Client,
    keys: Keys,
    ha: Arc<Leadership>,
    metrics: Arc<Metrics>,
    /// The fence while this coordinator has won (`None` otherwise).
    fence: Mutex<Option<i64>>,
    /// Leases of ended sessions that etcd did not revoke yet.
    stale_leases: Mutex<Vec<i64>>,
    session_lease: Mutex<Option<i64>>,
    peers_cache: Mutex<Option<(Instant, Vec<String>)>>,
    /// Ends the current session (a fenced-off or unanswered save).
    end_session: Notify,
    /// What to connect with to explain a failure ([`TlsCheck::explain`]).
    tls_check: TlsCheck,
    /// When the last explanation was made, and what it found.
    explained: Mutex<Option<(Instant, Option<String>)>>,
    ttl: Duration,
    timeout: Duration,
    events: mpsc::UnboundedSender<Event>,
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// `e` in one line, without the noise of nested transport errors.
fn short(e: &impl std::fmt::Display) -> String {
    let s = e.to_string();
    match s.char_indices().nth(300) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s,
    }
}

impl EtcdStore {
    /// Connects (retrying until etcd answers, saying so in the log) and
    /// returns the store with the receiver of its events. Nothing runs
    /// until [`EtcdStore::start`].
    pub(crate) async fn connect(
        opts: EtcdOptions,
        ha: Arc<Leadership>,
        metrics: Arc<Metrics>,
    ) -> Result<(Arc<Self>, mpsc::UnboundedReceiver<Event>), String> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::sync_channel::<()>(0);
        std::thread::Builder::new()
            .name("etcd-store".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("etcd-store")
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(rt.handle().clone()));
                // Until the store is dropped (the sender goes away).
                let _ = stop_rx.recv();
                rt.shutdown_timeout(Duration::from_millis(500));
            })
            .map_err(|e| format!("cannot start the etcd thread: {e}"))?;
        let handle = handle_rx
            .recv()
            .map_err(|_| "the etcd thread did not start".to_owned())??;

        let mut copts = ConnectOptions::new()
            .with_connect_timeout(opts.request_timeout)
            .with_keep_alive(Duration::from_secs(1), opts.request_timeout)
            .with_keep_alive_while_idle(true)
            .with_require_leader(true);
        if let Some((u, p)) = &opts.user {
            // etcd's tokens expire (5 minutes by default): get a new one
            // when one does, rather than fail every request from then on.
            copts = copts
                .with_user(u.clone(), p.clone())
                .with_auto_token_refresh(true);
        }
        let tls = opts.ca_file.is_some() || opts.cert_file.is_some();
        let mut check = TlsCheck {
            endpoints: opts.endpoints.clone(),
            ca: None,
            identity: None,
            domain: opts.domain.clone(),
            timeout: opts.request_timeout.min(Duration::from_secs(1)),
        };
        if tls {
            let mut t = TlsOptions::new();
            if let Some(ca) = &opts.ca_file {
                let pem = std::fs::read(ca)
                    .map_err(|e| format!("cannot read etcd.ca_file {}: {e}", ca.display()))?;
                check.ca = Some((ca.clone(), pem.clone()));
                t = t.ca_certificate(Certificate::from_pem(pem));
            }
            if let (Some(c), Some(k)) = (&opts.cert_file, &opts.key_file) {
                let cert = std::fs::read(c)
                    .map_err(|e| format!("cannot read etcd.cert_file {}: {e}", c.display()))?;
                let key = std::fs::read(k)
                    .map_err(|e| format!("cannot read etcd.key_file {}: {e}", k.display()))?;
                check.identity = Some((c.clone(), cert.clone(), key.clone()));
                t = t.identity(Identity::from_pem(cert, key));
            }
            if !opts.domain.is_empty() {
                t = t.domain_name(opts.domain.clone());
            }
            copts = copts.with_tls(t);
        }
        let scheme = if tls { "https" } else { "http" };
        let endpoints: Vec<String> = opts
            .endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect();
        let mut wait = Duration::from_millis(100);
        let client = loop {
            let (eps, co) = (endpoints.clone(), copts.clone());
            let r = handle
                .spawn(async move { Client::connect(eps, Some(co)).await })
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| short(&e)));
            match r {
                Ok(c) => break c,
                Err(e) => {
                    if ha.set_problem(Some(format!("cannot connect to etcd: {e}"))) {
                        tracing::warn!(error = %e, "cannot connect to etcd; retrying");
                    }
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        };
        let (events, rx) = mpsc::unbounded_channel();
        let store = Arc::new(Self {
            handle,
            _stop: stop_tx,
            client,
            keys: Keys::new(&opts.prefix),
            ha,
            metrics,
            fence: Mutex::new(None),
            stale_leases: Mutex::new(Vec::new()),
            session_lease: Mutex::new(None),
            peers_cache: Mutex::new(None),
            end_session: Notify::new(),
            tls_check: check,
            explained: Mutex::new(None),
            ttl: secs(opts.lease_ttl_s),
            timeout: opts.request_timeout,
            events,
        });
        Ok((store, rx))
    }

    /// Runs `f` on the store's runtime within the request timeout, trying
    /// again (on another endpoint) while it fails before reaching etcd.
    async fn call<T, F, Fut>(&self, f: F) -> Result<T, String>
    where
        F: Fn(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        let fut = retrying(self.client.clone(), f, self.timeout);
        match self.handle.spawn(fut).await {
            Ok(r) => r,
            Err(e) => Err(format!("etcd task failed: {e}")),
        }
    }

    fn fence(&self) -> Option<i64> {
        *self.fence.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_fence(&self, f: Option<i64>) {
        *self.fence.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }

    /// Stops leading at once (see the header, rule 5).
    fn step_down(&self, why: &str, leader: Option<String>) {
        self.set_fence(None);
        if self.ha.follow(leader) {
            self.metrics.leading.set(0);
            tracing::warn!(why, "no longer leading: writes are refused from now on");
        }
        self.end_session.notify_one();
    }

    /// Sets the store problem, logging it once.
    fn problem(&self, what: String) {
        if self.ha.set_problem(Some(what.clone())) {
            tracing::warn!(problem = %what, "etcd does not answer: no map change can be published until it does");
        }
    }

    /// Why etcd refuses this coordinator's connections, if a TLS
    /// handshake with each endpoint shows it ([`TlsCheck::explain`]); made
    /// at most every [`EXPLAIN_EVERY`], the last finding kept meanwhile.
    async fn explain(&self) -> Option<String> {
        if let Some((at, why)) = &*self.explained.lock().unwrap_or_else(|e| e.into_inner())
            && at.elapsed() < EXPLAIN_EVERY
        {
            return why.clone();
        }
        let check = self.tls_check.clone();
        let why = self
            .handle
            .spawn_blocking(move || check.explain())
            .await
            .unwrap_or(None);
        *self.explained.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), why.clone()));
        why
    }

    fn clear_problem(&self) {
        if self.ha.set_problem(None) {
            tracing::info!("etcd answers again");
        }
    }

    async fn elect(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            // Leases of ended sessions go first: one may still hold the
            // leader key that everyone else is waiting on.
            let stale: Vec<i64> = self
                .stale_leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for id in stale {
                if self
                    .call(move |mut c| async move { c.lease_revoke(id).await })
                    .await
                    .is_ok()
                    || self.lease_gone(id).await
                {
                    self.stale_leases
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .retain(|&l| l != id);
                }
            }
            let sent = Instant::now();
            let ttl_s = i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX);
            let lease = match self
                .call(move |mut c| async move { c.lease_grant(ttl_s, None).await })
                .await
            {
                Ok(r) => r.id(),
                Err(e) => {
                    self.problem(match self.explain().await {
                        Some(why) => {
                            format!("cannot open an etcd session: {why} (the request: {e})")
                        }
                        None => format!("cannot open an etcd session (no quorum?): {e}"),
                    });
                    self.ha.follow(None);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            self.clear_problem();
            *self.session_lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(lease);
            self.ha.extend(sent + self.ttl);
            let (key, me) = (
                format!("{}{}", self.keys.coordinators, self.ha.me()),
                self.ha.me().to_owned(),
            );
            if let Err(e) = self
                .call(move |mut c| {
                    let (key, me) = (key.clone(), me.clone());
                    async move {
                        c.put(key, me, Some(PutOptions::new().with_lease(lease)))
                            .await
                    }
                })
                .await
            {
                tracing::debug!(error = %e, "could not list this coordinator in etcd");
            }
            let mut keeper = self
                .handle
                .spawn(self.clone().keep_alive(lease, sent + self.ttl));
            let why = tokio::select! {
                r = &mut keeper => r.unwrap_or_else(|e| format!("keep-alive task failed: {e}")),
                why = self.campaign(lease) => why,
            };
            keeper.abort();
            if self.fence().is_some() || self.ha.is_leading() {
                tracing::warn!(why = %why, "etcd session ended; following until elected again");
            } else {
                tracing::info!(why = %why, "etcd session ended; opening another");
            }
            self.step_down(&why, None);
            // The notification that ended this session is spent.
            let _ = tokio::time::timeout(Duration::ZERO, self.end_session.notified()).await;
            *self.session_lease.lock().unwrap_or_else(|e| e.into_inner()) = None;
            if self
                .call(move |mut c| async move { c.lease_revoke(lease).await })
                .await
                .is_err()
            {
                self.stale_leases
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(lease);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether etcd says lease `id` no longer exists.
    async fn lease_gone(&self, id: i64) -> bool {
        self.call(move |mut c| async move { c.lease_time_to_live(id, None).await })
            .await
            .is_ok_and(|r| r.ttl() <= 0)
    }

    /// Keeps the session's lease alive; returns why the session ended.
    async fn keep_alive(self: Arc<Self>, lease: i64, mut until: Instant) -> String {
        let period = self.ttl / 3;
        let mut stream = None;
        let mut last_error = String::from("none");
        loop {
            tokio::time::sleep(period).await;
            if Instant::now() >= until {
                return format!(
                    "no keep-alive answered within the {} s lease (last error: {last_error})",
                    self.ttl.as_secs()
                );
            }
            if stream.is_none() {
                let mut c = self.client.clone();
                match tokio::time::timeout(period, c.lease_keep_alive(lease)).await {
                    Ok(Ok(s)) => stream = Some(s),
                    Ok(Err(e)) => {
                        last_error = short(&e);
                        continue;
                    }
                    Err(_) => {
                        last_error = "opening the keep-alive stream timed out".into();
                        continue;
                    }
                }
            }
            let Some((keeper, responses)) = stream.as_mut() else {
                continue;
            };
            let sent = Instant::now();
            let r = tokio::time::timeout(period, async {
                keeper.keep_alive().await?;
                responses.message().await
            })
            .await;
            match r {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                    until = sent + secs(u64::try_from(resp.ttl()).unwrap_or(0));
                    self.ha.extend(until);
                    self.clear_problem();
                }
                Ok(Ok(Some(_))) => return "the etcd lease expired".into(),
                Ok(Ok(None)) => {
                    last_error = "the keep-alive stream ended".into();
                    stream = None;
                }
                Ok(Err(e)) => {
                    last_error = short(&e);
                    tracing::info!(why = %last_error, "an etcd stream broke; reconnecting with the same lease");
                    stream = None;
                }
                Err(_) => {
                    last_error = "a keep-alive went unanswered".into();
                    // A late answer on this stream would be taken for a
                    // newer request's: open another.
                    stream = None;
                }
            }
            if stream.is_none() && Instant::now() + period >= until {
                self.problem(format!("etcd keep-alives unanswered: {last_error}"));
            }
        }
    }

    /// Campaigns within the session of `lease` until leadership is lost or
    /// the session must end; returns why.
    async fn campaign(&self, lease: i64) -> String {
        loop {
            let k = self.keys.leader.clone();
            let me = self.ha.me().to_owned();
            let txn = Txn::new()
                .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    k.clone(),
                    me,
                    Some(PutOptions::new().with_lease(lease)),
                )])
                .or_else([TxnOp::get(k.clone(), None)]);
            let r = match self
                .call(move |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await
            {
                Ok(r) => r,
                Err(e) => {
                    self.problem(format!("cannot campaign: {e}"));
                    self.ha.follow(None);
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(200)) => continue,
                        () = self.end_session.notified() => return "asked to end the session".into(),
                    }
                }
            };
            let rev = r.header().map_or(0, |h| h.revision());
            if r.succeeded() {
                return self.lead(rev).await;
            }
            let current = r.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                    (
                        kv.value_str().unwrap_or_default().to_owned(),
                        kv.create_revision(),
                        kv.lease(),
                    )
                }),
                _ => None,
            });
            let Some((leader, created, holder_lease)) = current else {
                continue; // deleted in between: campaign again
            };
            if holder_lease == lease {
                // Our own key from this session (an unanswered save made us
                // step down): give it up and campaign afresh.
                return "the leader key of this session was still held".into();
            }
            let ours = self
                .stale_leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&holder_lease);
            if ours
                && self
                    .call(move |mut c| async move { c.lease_revoke(holder_lease).await })
                    .await
                    .is_ok()
            {
                // An earlier session of ours still held it: freed now.
                self.stale_leases
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|&l| l != holder_lease);
                continue;
            }
            let news = self.ha.leader().as_deref() != Some(leader.as_str());
            self.ha.follow(Some(leader.clone()));
            if news {
                self.metrics.leader_changes.inc();
                tracing::info!(leader = %leader, "following");
            }
            if let Some(why) = self.wait_key_gone(created, rev).await {
                return why;
            }
        }
    }

    /// Leads with `fence` until it must stop; returns why.
    async fn lead(&self, fence: i64) -> String {
        let term = self.ha.begin_term();
        self.set_fence(Some(fence));
        let k = self.keys.state.clone();
        let state = match self
            .call(move |mut c| {
                let k = k.clone();
                async move { c.get(k, None).await }
            })
            .await
        {
            Ok(r) => match r.kvs().first() {
                None => None,
                Some(kv) => match PersistedState::decode(kv.value()) {
                    Ok(st) => Some((st, kv.mod_revision())),
                    Err(e) => {
                        tracing::error!(error = %e, key = %self.keys.state, "the state in etcd cannot be decoded; not leading");
                        return format!("undecodable state in etcd: {e}");
                    }
                },
            },
            Err(e) => return format!("cannot read the state after winning: {e}"),
        };
        let epoch = state
            .as_ref()
            .and_then(|(s, _)| s.map.as_ref())
            .map_or(0, |m| m.epoch);
        tracing::info!(fence, epoch, "elected leader");
        self.metrics.elections.inc();
        self.metrics.leader_changes.inc();
        if self.events.send(Event::Lead { term, state }).is_err() {
            return "the service is gone".into();
        }
        // Hold until the leader key is not ours any more, or the session
        // must end.
        match self.wait_key_gone(fence, fence).await {
            Some(why) => why,
            None => "the leader key was deleted".into(),
        }
    }

    /// Waits until the leader key created at `created` is deleted or
    /// replaced (`None`), or the session must end (`Some(why)`). `seen` is
    /// a revision at which it was still that key.
    async fn wait_key_gone(&self, created: i64, seen: i64) -> Option<String> {
        let ended = || Some("asked to end the session".to_owned());
        let mut from = seen + 1;
        loop {
            let (k, opts) = (
                self.keys.leader.clone(),
                WatchOptions::new().with_start_revision(from),
            );
            let watch = self.call(move |mut c| {
                let (k, opts) = (k.clone(), opts.clone());
                async move { c.watch(k, Some(opts)).await }
            });
            let opened = tokio::select! {
                w = watch => w.ok(),
                () = self.end_session.notified() => return ended(),
            };
            if let Some(mut stream) = opened {
                loop {
                    let msg = tokio::select! {
                        m = stream.message() => m,
                        () = self.end_session.notified() => return ended(),
                    };
                    let Ok(Some(resp)) = msg else { break };
                    if resp.canceled() {
                        break;
                    }
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        from = from.max(kv.mod_revision() + 1);
                        if ev.event_type() == EventType::Delete || kv.create_revision() != created {
                            return None;
                        }
                    }
                }
            }
            // The watch could not be opened, broke or was cancelled (a
            // compacted start revision): is the key still the one we watch?
            // Then watch again from the revision of that answer.
            match self.leader_key_created().await {
                Ok((Some(c), rev)) if c == created => from = from.max(rev + 1),
                Ok(_) => return None,
                Err(_) => {}
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
                () = self.end_session.notified() => return ended(),
            }
        }
    }

    /// The leader key's create revision (`None`: no leader key) and the
    /// revision of the answer.
    async fn leader_key_created(&self) -> Result<(Option<i64>, i64), String> {
        let k = self.keys.leader.clone();
        let r = self
            .call(move |mut c| {
                let k = k.clone();
                async move { c.get(k, None).await }
            })
            .await?;
        Ok((
            r.kvs().first().map(|kv| kv.create_revision()),
            r.header().map_or(0, |h| h.revision()),
        ))
    }

    /// Hands every state etcd holds to the service, for ever.
    async fn follow_state(self: Arc<Self>) {
        let mut last = 0i64;
        loop {
            let k = self.keys.state.clone();
            let from = match self
                .call(move |mut c| {
                    let k = k.clone();
                    async move { c.get(k, None).await }
                })
                .await
            {
                Ok(r) => {
                    if let Some(kv) = r.kvs().first() {
                        self.deliver(kv.value(), kv.mod_revision(), &mut last);
                    }
                    r.header().map_or(0, |h| h.revision()) + 1
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let k = self.keys.state.clone();
            let opts = WatchOptions::new().with_start_revision(from);
            if let Ok(mut stream) = self
                .call(move |mut c| {
                    let (k, opts) = (k.clone(), opts.clone());
                    async move { c.watch(k, Some(opts)).await }
                })
                .await
            {
                while let Ok(Some(resp)) = stream.message().await {
                    if resp.canceled() {
                        break;
                    }
                    for ev in resp.events() {
                        if ev.event_type() == EventType::Put
                            && let Some(kv) = ev.kv()
                        {
                            self.deliver(kv.value(), kv.mod_revision(), &mut last);
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn deliver(&self, value: &[u8], rev: i64, last: &mut i64) {
        if rev <= *last {
            return;
        }
        match PersistedState::decode(value) {
            Ok(state) => {
                *last = rev;
                let _ = self.events.send(Event::State { state, rev });
            }
            Err(e) => {
                tracing::error!(error = %e, rev, "the state in etcd cannot be decoded; ignored");
            }
        }
    }

    /// Confirms that this coordinator's copy of the state is etcd's current
    /// one (see the header, "Followers").
    pub(crate) async fn confirm(&self) -> Result<(), String> {
        let k = self.keys.state.clone();
        let r = self
            .call(move |mut c| {
                let k = k.clone();
                async move { c.get(k, Some(GetOptions::new().with_keys_only())).await }
            })
            .await?;
        let rev = r.kvs().first().map_or(0, |kv| kv.mod_revision());
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.ha.applied_rev() < rev {
            if Instant::now() >= deadline {
                return Err(format!(
                    "the watch has not delivered revision {rev} of the state yet"
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// The addresses of every running coordinator (read at most once a
    /// second: every reader's `Status` poll asks).
    pub(crate) async fn peers(&self) -> Result<Vec<String>, String> {
        {
            let cache = self.peers_cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, peers)) = &*cache
                && at.elapsed() < Duration::from_secs(1)
            {
                return Ok(peers.clone());
            }
        }
        let k = self.keys.coordinators.clone();
        let r = self
            .call(move |mut c| {
                let k = k.clone();
                async move { c.get(k, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let peers: Vec<String> = r
            .kvs()
            .iter()
            .filter_map(|kv| kv.value_str().ok().map(str::to_owned))
            .collect();
        *self.peers_cache.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), peers.clone()));
        Ok(peers)
    }

    /// On shutdown: stop leading and give the lease back, so another
    /// coordinator takes over at once.
    pub(crate) async fn resign(&self) {
        self.set_fence(None);
        self.ha.follow(None);
        if let Some(id) = self.session() {
            match self
                .call(move |mut c| async move { c.lease_revoke(id).await })
                .await
            {
                Ok(_) => tracing::info!("resigned: etcd lease revoked"),
                Err(e) => {
                    tracing::warn!(error = %e, "could not revoke the etcd lease; the others wait out its TTL")
                }
            }
        }
    }

    /// Runs `f` as [`EtcdStore::call`] does, blocking this thread until it
    /// ends (for the synchronous save, called under the cluster lock).
    fn block<T, F, Fut>(&self, f: F) -> Result<T, String>
    where
        F: Fn(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let fut = retrying(self.client.clone(), f, self.timeout);
        self.handle.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(self.timeout + Duration::from_millis(250))
            .unwrap_or_else(|_| {
                Err(format!(
                    "etcd did not answer within {} ms",
                    self.timeout.as_millis()
                ))
            })
    }
}

/// Whether `e` happened before the request reached etcd (a connection that
/// could not be made): safe to send again, whatever the request.
fn not_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::Unavailable
                && (s.message().contains("connect error")
                    || s.message().contains("error trying to connect"))
        }
        _ => false,
    }
}

/// `f(client)` within `timeout`, sent again while it fails with
/// [`not_sent`] (the balanced channel may pick an endpoint that is down).
async fn retrying<T, F, Fut>(client: Client, f: F, timeout: Duration) -> Result<T, String>
where
    F: Fn(Client) -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match tokio::time::timeout_at(deadline, f(client.clone())).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if not_sent(&e) => {
                last = short(&e);
                tokio::time::sleep(Duration::from_millis(20)).await;
                if tokio::time::Instant::now() >= deadline {
                    return Err(last);
                }
            }
            Ok(Err(e)) => return Err(short(&e)),
            Err(_) => {
                return Err(if last.is_empty() {
                    format!("etcd did not answer within {} ms", timeout.as_millis())
                } else {
                    format!(
                        "etcd did not answer within {} ms (last error: {last})",
                        timeout.as_millis()
                    )
                });
            }
        }
    }
}

/// How often at most [`EtcdStore::explain`] connects to etcd to explain a
/// failure.
const EXPLAIN_EVERY: Duration = Duration::from_secs(5);

/// The coordinator's TLS settings towards etcd, to explain a refused
/// connection. etcd's client errors say little ("transport error", "broken
/// pipe", "connection closed"): the TLS alert etcd sent, or the certificate
/// check that failed, is lost inside the HTTP/2 client. A handshake of our
/// own, made the way the client makes it, sees them.
#[derive(Clone)]
struct TlsCheck {
    /// host:port of each member.
    endpoints: Vec<String>,
    /// `etcd.ca_file` and its contents; `None`: plain http.
    ca: Option<(PathBuf, Vec<u8>)>,
    /// `etcd.cert_file`, the certificate chain and the key (PEM).
    identity: Option<(PathBuf, Vec<u8>, Vec<u8>)>,
    /// `etcd.domain`: the name etcd's certificate must carry (empty: the
    /// endpoint's host).
    domain: String,
    /// Time limit of each step (connect, handshake, the first read).
    timeout: Duration,
}

/// The HTTP/2 client preface and an empty SETTINGS frame: etcd answers them
/// with its own SETTINGS once it has accepted the connection.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

impl TlsCheck {
    /// Connects to every endpoint (in parallel) as the client does and
    /// returns what is wrong with TLS, naming the endpoints, when something
    /// is: etcd serves TLS and the coordinator speaks plain http, or the
    /// reverse, etcd's certificate fails the check against `etcd.ca_file`,
    /// or etcd refuses the client certificate (or its absence). `None` when
    /// TLS is not the problem (an endpoint that is down is not a TLS
    /// problem).
    fn explain(&self) -> Option<String> {
        let found: Vec<(String, Option<String>)> = std::thread::scope(|s| {
            let calls: Vec<_> = self
                .endpoints
                .iter()
                .map(|e| (e, s.spawn(move || self.check(e))))
                .collect();
            calls
                .into_iter()
                .map(|(e, h)| (e.clone(), h.join().unwrap_or(None)))
                .collect()
        });
        // One line per distinct reason, with the endpoints it applies to.
        let mut reasons: Vec<(String, Vec<String>)> = Vec::new();
        for (endpoint, why) in found {
            let Some(why) = why else { continue };
            match reasons.iter_mut().find(|(r, _)| *r == why) {
                Some((_, eps)) => eps.push(endpoint),
                None => reasons.push((why, vec![endpoint])),
            }
        }
        if reasons.is_empty() {
            return None;
        }
        Some(
            reasons
                .iter()
                .map(|(why, eps)| format!("etcd {}: {why}", eps.join(", ")))
                .collect::<Vec<_>>()
                .join("; "),
        )
    }

    /// What is wrong with TLS towards `endpoint` (host:port), if anything.
    fn check(&self, endpoint: &str) -> Option<String> {
        use std::io::{Read, Write};
        use std::net::ToSocketAddrs;

        let (host, _) = endpoint.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addr = endpoint.to_socket_addrs().ok()?.next()?;
        // Down or unreachable: not a TLS problem.
        let tcp = std::net::TcpStream::connect_timeout(&addr, self.timeout).ok()?;
        tcp.set_read_timeout(Some(self.timeout)).ok()?;
        tcp.set_write_timeout(Some(self.timeout)).ok()?;
        let name = if self.domain.is_empty() {
            host
        } else {
            &self.domain
        };
        let server_name = match rustls::pki_types::ServerName::try_from(name.to_owned()) {
            Ok(n) => n,
            Err(e) => return Some(format!("{name:?} is not a valid TLS server name: {e}")),
        };
        let config = match self.client_config() {
            Ok(c) => c,
            Err(e) => return Some(e),
        };
        let conn = rustls::ClientConnection::new(Arc::new(config), server_name).ok()?;
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        // The write drives the handshake; the read gets etcd's SETTINGS,
        // or the alert with which it refuses the client certificate (with
        // TLS 1.3 it sends that after the client's side of the handshake).
        let mut buf = [0u8; 64];
        let outcome = tls
            .write_all(H2_PREFACE)
            .and_then(|()| tls.flush())
            .and_then(|()| tls.read(&mut buf));
        let handshaken = !tls.conn.is_handshaking();
        let error = outcome.err();
        let tls_error = error
            .as_ref()
            .and_then(|e| e.get_ref())
            .and_then(|e| e.downcast_ref::<rustls::Error>());
        let Some((ca_file, _)) = &self.ca else {
            // Plain http: a server that shows a certificate or sends an
            // alert speaks TLS.
            return (handshaken
                || matches!(
                    tls_error,
                    Some(rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_))
                ))
            .then(|| {
                "etcd serves TLS (https) but this coordinator speaks plain http: set \
                 etcd.ca_file to the CA that signed etcd's certificate (and etcd.cert_file \
                 and etcd.key_file if etcd requires client certificates)"
                    .to_owned()
            });
        };
        match tls_error {
            None if handshaken => None,
            // Not TLS at all (or nothing came back).
            None | Some(rustls::Error::InvalidMessage(_)) => Some(format!(
                "no TLS answer ({}): does etcd serve plain http? TLS is on because \
                 etcd.ca_file is set; etcd serves TLS with --cert-file and --key-file and \
                 https:// client URLs",
                error.map_or_else(|| "the connection closed".to_owned(), |e| e.to_string())
            )),
            Some(rustls::Error::InvalidCertificate(e)) => Some(format!(
                "etcd's certificate fails the check: {e:?}; etcd.ca_file {} must hold the CA \
                 that signed it, and it must carry the name {name:?} (etcd.domain, else the \
                 endpoint's host) and be valid now",
                ca_file.display()
            )),
            Some(rustls::Error::AlertReceived(alert)) => Some(match &self.identity {
                None => format!(
                    "etcd refused the connection with the TLS alert {alert:?}: it requires a \
                     client certificate; set etcd.cert_file and etcd.key_file"
                ),
                Some((cert_file, _, _)) => format!(
                    "etcd refused this coordinator's client certificate etcd.cert_file {} \
                     with the TLS alert {alert:?}: it must be signed by a CA in etcd's \
                     --trusted-ca-file, allow client authentication, and be valid now",
                    cert_file.display()
                ),
            }),
            Some(e) => Some(format!("TLS with etcd failed: {e}")),
        }
    }

    /// rustls's client config as tonic builds it from the same files:
    /// `etcd.ca_file` the only root (none for plain http, where the check
    /// only asks whether etcd speaks TLS), the client certificate if set.
    fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let mut roots = rustls::RootCertStore::empty();
        if let Some((path, pem)) = &self.ca {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let added = cert
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|c| roots.add(c).map_err(|e| e.to_string()));
                if let Err(e) = added {
                    return Err(format!(
                        "etcd.ca_file {} holds no usable certificate: {e}",
                        path.display()
                    ));
                }
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
        match &self.identity {
            None => Ok(builder.with_no_client_auth()),
            Some((path, cert, key)) => {
                let bad = |e: String| {
                    format!(
                        "etcd.cert_file {} or etcd.key_file is not a usable PEM certificate \
                         and key: {e}",
                        path.display()
                    )
                };
                let chain = CertificateDer::pem_slice_iter(cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad(format!("{e:?}")))?;
                let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad(format!("{e:?}")))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| bad(e.to_string()))
            }
        }
    }
}

impl EtcdStore {
    /// The lease of the current session, if any.
    fn session(&self) -> Option<i64> {
        *self.session_lease.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Store for EtcdStore {
    /// Starts the election and the state watch on the store's runtime.
    fn start(self: Arc<Self>) {
        let handle = self.handle.clone();
        handle.spawn(self.clone().elect());
        handle.spawn(self.follow_state());
    }

    fn confirm(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(EtcdStore::confirm(self))
    }

    fn peers(&self) -> BoxFuture<'_, Result<Vec<String>, String>> {
        Box::pin(EtcdStore::peers(self))
    }

    fn resign(&self) -> BoxFuture<'_, ()> {
        Box::pin(EtcdStore::resign(self))
    }

    fn save(
        &self,
        state: &PersistedState,
        new_epoch: Option<(u64, &str)>,
    ) -> Result<(), StoreError> {
        let fence = match self.fence() {
            Some(f) if self.ha.is_leading() => f,
            _ => {
                return Err(StoreError::NotLeader {
                    leader: self.ha.leader(),
                });
            }
        };
        let mut when = vec![Compare::create_revision(
            self.keys.leader.clone(),
            CompareOp::Equal,
            fence,
        )];
        let mut then = vec![TxnOp::put(
            self.keys.state.clone(),
            state.encode_to_vec(),
            None,
        )];
        if let Some((epoch, reason)) = new_epoch {
            let record = EpochRecord {
                leader: self.ha.me().to_owned(),
                fence,
                reason: reason.to_owned(),
            };
            let record = serde_json::to_vec(&record).unwrap_or_default();
            when.push(Compare::create_revision(
                self.keys.epoch(epoch),
                CompareOp::Equal,
                0,
            ));
            then.push(TxnOp::put(self.keys.epoch(epoch), record, None));
            if epoch > KEEP_EPOCHS {
                then.push(TxnOp::delete(self.keys.epoch(epoch - KEEP_EPOCHS), None));
            }
        }
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(self.keys.leader.clone(), None)]);
        match self.block(move |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        }) {
            Ok(resp) if resp.succeeded() => {
                self.ha.applied(resp.header().map_or(0, |h| h.revision()));
                Ok(())
            }
            Ok(resp) => {
                let holder = resp.op_responses().into_iter().find_map(|op| match op {
                    TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                        (
                            kv.value_str().unwrap_or_default().to_owned(),
                            kv.create_revision(),
                        )
                    }),
                    _ => None,
                });
                let (why, leader) = match holder {
                    Some((_, created)) if created == fence => (
                        format!(
                            "epoch {} is already in etcd: another leader published it",
                            new_epoch.map_or(0, |(e, _)| e)
                        ),
                        None,
                    ),
                    Some((addr, _)) => (
                        format!("the leader key is {addr}'s now: fenced off"),
                        Some(addr),
                    ),
                    None => ("the leader key is gone: fenced off".to_owned(), None),
                };
                self.step_down(&why, leader.clone());
                Err(StoreError::NotLeader { leader })
            }
            Err(e) => {
                let why = format!("a state write got no answer ({e}); its outcome is unknown");
                self.step_down(&why, None);
                Err(StoreError::Unavailable(e))
            }
        }
    }
}

/// The per-epoch records in etcd, oldest first (for tests and `pwctl`
/// audits): `(epoch, record)`.
pub async fn epoch_history(
    endpoints: &[String],
    prefix: &str,
) -> Result<Vec<(u64, EpochRecord)>, String> {
    let keys = Keys::new(prefix);
    let c = Client::connect(
        endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect::<Vec<_>>(),
        None,
    )
    .await
    .map_err(|e| short(&e))?;
    let prefix = keys.epochs.clone();
    let r = retrying(
        c,
        move |mut c| {
            let k = prefix.clone();
            async move { c.get(k, Some(GetOptions::new().with_prefix())).await }
        },
        Duration::from_secs(10),
    )
    .await?;
    let mut out = Vec::new();
    for kv in r.kvs() {
        let k = kv.key_str().map_err(|e| short(&e))?;
        let epoch = k[keys.epochs.len()..]
            .parse::<u64>()
            .map_err(|e| format!("bad epoch key {k}: {e}"))?;
        let rec: EpochRecord =
            serde_json::from_slice(kv.value()).map_err(|e| format!("bad record {k}: {e}"))?;
        out.push((epoch, rec));
    }
    out.sort_by_key(|(e, _)| *e);
    Ok(out)
}
