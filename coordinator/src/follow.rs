//! Following the store: what the store's own tasks report (this
//! coordinator won an election; the store holds a new state) applied to the
//! service's cluster, under the cluster lock.
//!
//! Only a store shared by several coordinators reports anything (etcd:
//! [`crate::store::etcd`], whose header tells the whole protocol); on the
//! file store this coordinator leads for ever and nothing here runs. The
//! rules that make a late or stale event harmless are those of
//! [`apply_events`]; [`crate::ha::Leadership`] holds the role and term they
//! check.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::persist::PersistedState;

/// What the store tasks hand to the service (only the etcd store has
/// tasks).
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) enum Event {
    /// This coordinator won term `term`; `state` is the store's (with its
    /// mod revision), `None` when the store holds none yet.
    Lead {
        term: u64,
        state: Option<(PersistedState, i64)>,
    },
    /// The store holds this state now (mod revision `rev`).
    State { state: PersistedState, rev: i64 },
}

/// Applies the store's events to the service's cluster until the store goes
/// away; returns an error the coordinator cannot go on with (a state in etcd
/// written with other extent or page sizes than this coordinator's).
///
/// A state event is decided under the cluster lock, which a save holds from
/// before its write until it has either recorded the revision it wrote or
/// stepped down and rolled back. So the event of a save that committed in
/// etcd but whose answer came too late (the leader stepped down and rolled
/// its cluster back) is not skipped as the leader's own: by the time it is
/// decided, this coordinator no longer leads, and it loads what etcd holds.
/// A newer state seen while still leading (which fencing should make
/// impossible) is kept and loaded as soon as this coordinator stops leading.
pub(crate) async fn apply_events(
    shared: Arc<crate::service::Shared>,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<(), crate::StartError> {
    let mut unapplied: Option<(PersistedState, i64)> = None;
    loop {
        tokio::select! {
            ev = rx.recv() => match ev {
                None => return Ok(()),
                Some(Event::Lead { term, state }) => {
                    unapplied = None;
                    let mut c = shared.cluster().await;
                    let rev = match state {
                        Some((st, rev)) => {
                            c.load_state(st, "the state in etcd")?;
                            rev
                        }
                        None => 0,
                    };
                    // Heartbeats went to the old leader meanwhile.
                    c.renew_all_leases();
                    if shared.ha.lead(term, rev) {
                        shared.metrics.leading.set(1);
                        tracing::info!(
                            epoch = c.epoch(),
                            "leading: serving writes (every member got a fresh lease)"
                        );
                    }
                }
                Some(Event::State { state, rev }) => {
                    let mut c = shared.cluster().await;
                    if rev <= shared.ha.applied_rev() {
                        continue;
                    }
                    if shared.ha.is_leading() {
                        unapplied = Some((state, rev));
                        continue;
                    }
                    follow_state(&shared, &mut c, state, rev);
                }
            },
            () = shared.ha.stepped_down() => {}
        }
        if unapplied.is_some() && !shared.ha.is_leading() {
            let mut c = shared.cluster().await;
            if let Some((state, rev)) = unapplied.take()
                && !shared.ha.is_leading()
                && rev > shared.ha.applied_rev()
            {
                tracing::warn!(
                    rev,
                    "etcd holds a newer state than this coordinator kept while it led: loading it"
                );
                follow_state(&shared, &mut c, state, rev);
            }
        }
    }
}

/// Loads the state of revision `rev` into a follower's cluster.
fn follow_state(
    shared: &crate::service::Shared,
    c: &mut crate::state::ClusterState,
    state: PersistedState,
    rev: i64,
) {
    match c.load_state(state, "the state in etcd") {
        Ok(()) => shared.ha.applied(rev),
        Err(e) => tracing::error!(error = %e, "cannot follow the state in etcd"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
    use std::time::{Duration, Instant};

    use pagewire_proto::auth::AttachToken;
    use pagewire_proto::v1::DrainRequest;
    use pagewire_proto::v1::coordinator_server::Coordinator;
    use tonic::Request;

    use super::*;
    use crate::ha::Leadership;
    use crate::metrics::Metrics;
    use crate::service::{CoordinatorService, Shared};
    use crate::state::{ClusterState, Params};
    use crate::store::{Store, StoreError};

    /// etcd as the leader sees it: every save commits at the next revision
    /// and its watch delivers it at once. With `late` set, the answer to a
    /// save that committed never comes: the leader steps down (as
    /// the etcd store's save does) and the save fails.
    struct Etcd {
        ha: Arc<Leadership>,
        events: mpsc::UnboundedSender<Event>,
        rev: AtomicI64,
        late: AtomicBool,
        last: Mutex<Option<PersistedState>>,
    }

    impl Store for Etcd {
        fn save(&self, state: &PersistedState, _: Option<(u64, &str)>) -> Result<(), StoreError> {
            if !self.ha.is_leading() {
                return Err(StoreError::NotLeader { leader: None });
            }
            let rev = self.rev.fetch_add(1, Ordering::SeqCst) + 1;
            *self.last.lock().unwrap() = Some(state.clone());
            let _ = self.events.send(Event::State {
                state: state.clone(),
                rev,
            });
            if self.late.load(Ordering::SeqCst) {
                // The watch delivered the revision while the answer is
                // awaited; then the request timeout.
                std::thread::sleep(Duration::from_millis(300));
                self.ha.follow(None);
                return Err(StoreError::Unavailable("no answer within 2000 ms".into()));
            }
            self.ha.applied(rev);
            Ok(())
        }
    }

    async fn epoch_becomes(
        rx: &mut tokio::sync::watch::Receiver<Arc<crate::state::Published>>,
        epoch: u64,
    ) -> bool {
        tokio::time::timeout(
            Duration::from_secs(3),
            rx.wait_for(|p| p.map.epoch == epoch),
        )
        .await
        .is_ok()
    }

    /// A save that commits in etcd but whose answer times out: the leader
    /// steps down and rolls its cluster back to epoch N, while etcd holds
    /// N + 1, which its watch delivered while it still led. It must end up
    /// serving N + 1 (its watchers would otherwise wait for ever), without
    /// any later write to etcd.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_that_committed_after_its_answer_timed_out_is_followed() {
        let (tx, rx) = mpsc::unbounded_channel();
        let ha = Arc::new(Leadership::candidate("me:1".into(), "etcd://x:1".into()));
        let store = Arc::new(Etcd {
            ha: ha.clone(),
            events: tx.clone(),
            rev: AtomicI64::new(10),
            late: AtomicBool::new(false),
            last: Mutex::new(None),
        });
        let metrics = Arc::new(Metrics::new());
        let params = Params {
            cluster_name: "t".into(),
            extent_size: 1 << 16,
            page_size: 4096,
            lease: Duration::from_secs(60),
            heartbeat_interval: Duration::from_secs(1),
            state_file: "unused".into(),
        };
        let cluster = ClusterState::new(
            params,
            0,
            crate::config::Config::default().policy().unwrap(),
            metrics.clone(),
            store.clone(),
        );
        let mut published = cluster.subscribe();
        let shared = Arc::new(Shared::new(
            cluster,
            ha.clone(),
            metrics,
            AttachToken::new("a-test-token").unwrap(),
            None,
            Duration::from_secs(1),
        ));
        let term = ha.begin_term();
        ha.extend(Instant::now() + Duration::from_secs(600));
        assert!(ha.lead(term, 10));
        tokio::spawn(apply_events(shared.clone(), rx));
        let svc = CoordinatorService {
            shared: shared.clone(),
        };
        svc.register(crate::service::tests::reg("a")).await.unwrap();
        svc.register(crate::service::tests::reg("b")).await.unwrap();
        let n = published.borrow().map.epoch;
        assert!(n > 0);

        store.late.store(true, Ordering::SeqCst);
        let r = svc
            .drain(Request::new(DrainRequest {
                node_id: "b".into(),
                incarnation: 0,
            }))
            .await;
        assert!(r.is_err(), "the save got no answer: the drain must fail");
        assert!(!ha.is_leading());
        assert!(
            epoch_becomes(&mut published, n + 1).await,
            "stuck at epoch {} while etcd holds {}",
            published.borrow().map.epoch,
            n + 1
        );
        // The map is published inside the load, the revision recorded
        // right after it.
        let deadline = Instant::now() + Duration::from_secs(3);
        while ha.applied_rev() != store.rev.load(Ordering::SeqCst) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(ha.applied_rev(), store.rev.load(Ordering::SeqCst));

        // Leading again, a newer state seen is kept until it stops leading.
        let term = ha.begin_term();
        assert!(ha.lead(term, store.rev.load(Ordering::SeqCst)));
        let mut newer = store.last.lock().unwrap().clone().unwrap();
        newer.compact.as_mut().unwrap().epoch = n + 2;
        tx.send(Event::State {
            state: newer,
            rev: store.rev.load(Ordering::SeqCst) + 5,
        })
        .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(published.borrow().map.epoch, n + 1, "loaded while leading");
        ha.follow(None);
        assert!(
            epoch_becomes(&mut published, n + 2).await,
            "a newer state kept while leading was not loaded on stepping down"
        );
    }
}
