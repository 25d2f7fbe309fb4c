//! The etcd store's own tasks: the election (rules 1 to 5 of the header of
//! [`super`]: session, campaign, won, lost, stepping down) and the watch of
//! the state that followers load ("Followers" there).

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use prost::Message;

use super::{EtcdStore, secs, short};
use crate::follow::Event;
use crate::persist::PersistedState;

impl EtcdStore {
    pub(super) async fn elect(self: Arc<Self>) {
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
    pub(super) async fn follow_state(self: Arc<Self>) {
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
}
