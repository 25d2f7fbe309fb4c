//! The etcd store: several coordinators over one etcd cluster, one leading.
//!
//! This file holds the store itself (connecting, the fenced save, the
//! follower's confirmation, the peer list, resigning); `election.rs` its
//! tasks (the election and the state watch); `tls.rs` the TLS check that
//! explains a refused connection. The protocol below covers all three.
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
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, TlsOptions, Txn,
    TxnOp, TxnOpResponse,
};
use prost::Message;
use tokio::runtime::Handle;
use tokio::sync::{Notify, mpsc};

mod election;
mod tls;

use self::tls::TlsCheck;
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
