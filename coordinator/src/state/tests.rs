//! The state machine's unit tests: input checks, register, heartbeat,
//! drain and expiry, restore and old-format conversion, the compact map
//! against its expansion (randomized), and policy changes.

use super::*;
use pagewire_proto::v1::RegisterRequest;

fn params(dir: &std::path::Path) -> Params {
    Params {
        cluster_name: "t".into(),
        extent_size: 1 << 16,
        page_size: 4096,
        lease: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(100),
        state_file: dir.join("state"),
    }
}

fn reg(id: &str) -> RegisterRequest {
    RegisterRequest {
        node_id: id.into(),
        grpc_address: "127.0.0.1:9".into(),
        capacity_bytes: 1 << 30,
        file_size: 4096 << 16,
        page_size: 4096,
        ..Default::default()
    }
}

fn open(dir: &std::path::Path) -> ClusterState {
    ClusterState::open(
        params(dir),
        0,
        crate::config::Config::default().policy().unwrap(),
        Arc::new(Metrics::new()),
    )
    .unwrap()
}

fn count(c: &ClusterState, index: u32) -> usize {
    c.owner.iter().filter(|&&o| o == index).count()
}

#[test]
fn join_hands_off_then_commits_and_restart_restores() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let a = c.register(reg("a")).unwrap();
    assert_eq!(count(&c, a.node_index), 4096);
    assert!(c.previous.is_empty(), "nothing to hand off from nobody");
    let b = c.register(reg("b")).unwrap();
    let e = c.epoch;
    assert!(c.previous.contains(&a.node_index));
    assert!(c.released.is_empty(), "a still serves what it hands off");
    let moving = c.previous.clone();
    // b has not applied yet: the handoff stays.
    c.heartbeat(HeartbeatRequest {
        node_id: "a".into(),
        incarnation: a.incarnation,
        applied_epoch: e,
        stats: None,
    })
    .unwrap();
    assert_eq!(c.epoch, e);
    c.heartbeat(HeartbeatRequest {
        node_id: "b".into(),
        incarnation: b.incarnation,
        applied_epoch: e,
        stats: None,
    })
    .unwrap();
    assert_eq!(c.epoch, e + 1);
    assert!(c.previous.is_empty());
    // The map names a as having released exactly what it handed off.
    assert_eq!(c.released, moving);
    assert_eq!(c.map().released_by, moving);
    let (owner, epoch) = (c.owner.clone(), c.epoch);
    drop(c);
    let c = open(dir.path());
    assert_eq!((c.owner.clone(), c.epoch), (owner, epoch));
    assert_eq!(c.members.len(), 2);
}

#[test]
fn a_handoff_waits_for_the_previous_owner_and_a_release_for_its_node() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let a = c.register(reg("a")).unwrap();
    let b = c.register(reg("b")).unwrap();
    let hb = |c: &mut ClusterState, id: &str, incarnation: u64, applied_epoch: u64| {
        c.heartbeat(HeartbeatRequest {
            node_id: id.into(),
            incarnation,
            applied_epoch,
            stats: None,
        })
        .unwrap();
    };
    let e = c.epoch;
    // The new owner applied, the previous one not yet: a may still be at
    // the epoch where it owned (and wrote) the moving extents.
    hb(&mut c, "b", b.incarnation, e);
    assert_eq!(c.epoch, e);
    hb(&mut c, "a", a.incarnation, e - 1);
    assert_eq!(c.epoch, e);
    hb(&mut c, "a", a.incarnation, e);
    assert_eq!(c.epoch, e + 1);
    assert!(c.released.contains(&a.node_index));
    // a applies the release; the entry goes at the next epoch.
    hb(&mut c, "a", a.incarnation, e + 1);
    c.register(reg("c")).unwrap();
    assert!(
        !c.released.contains(&a.node_index),
        "a applied the epoch that released it: {:?}",
        c.released.iter().filter(|&&r| r != 0).count()
    );
}

#[test]
fn expiry_moves_extents_and_drain_empties_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let a = c.register(reg("a")).unwrap();
    let b = c.register(reg("b")).unwrap();
    c.register(reg("c")).unwrap();
    // Only a's lease is renewed far in the future by expiring at "now + 1s".
    let later = Instant::now() + Duration::from_secs(1);
    c.members.get_mut("a").unwrap().lease_deadline = Some(later + Duration::from_secs(10));
    c.members.get_mut("c").unwrap().lease_deadline = Some(later + Duration::from_secs(10));
    let dead = c.expire_leases(later).unwrap();
    assert_eq!(dead, vec!["b".to_owned()]);
    assert_eq!(count(&c, b.node_index), 0);
    assert!(!c.previous.contains(&b.node_index));
    let (_, owned) = c.drain("a", 0).unwrap();
    assert!(owned > 0);
    assert_eq!(count(&c, a.node_index), 0);
    assert!(matches!(
        c.heartbeat(HeartbeatRequest {
            node_id: "b".into(),
            incarnation: b.incarnation,
            ..Default::default()
        }),
        Err(CoordError::NotAlive { .. })
    ));
}

/// The state file, failing the next `fail` saves as a store that did
/// not answer.
struct Flaky {
    file: FileStore,
    fail: std::sync::atomic::AtomicUsize,
}

impl Flaky {
    fn fail_next(&self, n: usize) {
        self.fail.store(n, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Store for Flaky {
    fn save(
        &self,
        state: &PersistedState,
        new_epoch: Option<(u64, &str)>,
    ) -> Result<(), crate::store::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        if self
            .fail
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(crate::store::StoreError::Unavailable("injected".into()));
        }
        self.file.save(state, new_epoch)
    }
}

fn open_flaky(dir: &std::path::Path) -> (ClusterState, Arc<Flaky>) {
    let store = Arc::new(Flaky {
        file: FileStore {
            path: dir.join("state"),
        },
        fail: 0.into(),
    });
    let c = ClusterState::new(
        params(dir),
        0,
        crate::config::Config::default().policy().unwrap(),
        Arc::new(Metrics::new()),
        store.clone(),
    );
    (c, store)
}

/// Two members, handoffs finished; returns their incarnations.
fn two_settled(c: &mut ClusterState) -> (RegisterResponse, RegisterResponse) {
    let a = c.register(reg("a")).unwrap();
    let b = c.register(reg("b")).unwrap();
    for _ in 0..2 {
        hb(c, "a", a.incarnation).unwrap();
        hb(c, "b", b.incarnation).unwrap();
    }
    assert!(c.previous.is_empty());
    (a, b)
}

/// A lease expiry whose map could not be saved is found again at the
/// next tick and retried: the dead node does not keep its extents.
#[test]
fn a_lease_expiry_whose_save_failed_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let (mut c, store) = open_flaky(dir.path());
    let (_, b) = two_settled(&mut c);
    let epoch = c.epoch;
    let now = Instant::now() + Duration::from_secs(1);
    c.members.get_mut("a").unwrap().lease_deadline = Some(now + Duration::from_secs(60));
    store.fail_next(1);
    assert!(c.expire_leases(now).is_err());
    assert_eq!(c.epoch, epoch);
    assert_eq!(
        c.members["b"].info.state(),
        NodeState::Alive,
        "half a change"
    );
    // The next tick.
    let dead = c.expire_leases(now + Duration::from_millis(10)).unwrap();
    assert_eq!(dead, vec!["b".to_owned()], "the expiry was not retried");
    assert_eq!(c.epoch, epoch + 1);
    assert_eq!(count(&c, b.node_index), 0, "the dead node kept extents");
    assert!(!c.map().owner.contains(&b.node_index));
}

/// A leave, a drain and a registration whose save failed change no
/// member: each can be asked again, and no member is left that never
/// got its answer.
#[test]
fn changes_whose_save_failed_leave_the_members_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let (mut c, store) = open_flaky(dir.path());
    let (a, b) = two_settled(&mut c);
    let (epoch, next_inc) = (c.epoch, c.next_incarnation);

    store.fail_next(1);
    assert!(c.register(reg("c")).is_err());
    assert!(
        !c.members.contains_key("c"),
        "a refused registration stayed"
    );
    assert_eq!(c.next_incarnation, next_inc);

    store.fail_next(1);
    assert!(c.leave("b", b.incarnation).is_err());
    assert_eq!(c.members["b"].info.state(), NodeState::Alive);
    c.leave("b", b.incarnation).expect("the leave asked again");
    assert_eq!(count(&c, b.node_index), 0);
    assert_eq!(c.epoch, epoch + 1);

    let c2 = c.register(reg("c")).unwrap();
    for _ in 0..2 {
        hb(&mut c, "a", a.incarnation).unwrap();
        hb(&mut c, "c", c2.incarnation).unwrap();
    }
    store.fail_next(1);
    assert!(c.drain("c", 0).is_err());
    assert_eq!(c.members["c"].info.state(), NodeState::Alive);
    // A drain that starts, and whose handoff's completion cannot be
    // saved: the node stays Draining while the map still names it.
    c.drain("c", 0).unwrap();
    assert!(c.previous.contains(&c2.node_index));
    hb(&mut c, "a", a.incarnation).unwrap();
    store.fail_next(1);
    assert!(hb(&mut c, "c", c2.incarnation).is_err());
    assert!(c.previous.contains(&c2.node_index));
    assert_eq!(
        c.members["c"].info.state(),
        NodeState::Draining,
        "drained while the map still hands its extents off"
    );
    hb(&mut c, "c", c2.incarnation).unwrap();
    assert!(c.previous.is_empty());
    assert_eq!(c.members["c"].info.state(), NodeState::Drained);
}

#[test]
fn a_shutdown_drain_ends_with_its_process_and_an_operators_drain_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let a = c.register(reg("a")).unwrap();
    c.register(reg("b")).unwrap();
    let state = |c: &ClusterState| c.members["a"].info.state();
    // Only the current incarnation may start its own shutdown drain.
    assert!(matches!(
        c.drain("a", a.incarnation + 100),
        Err(CoordError::StaleIncarnation { .. })
    ));
    c.drain("a", a.incarnation).unwrap();
    assert_eq!(state(&c), NodeState::Draining);
    // Killed mid-drain and started again: the new process serves again.
    let a2 = c.register(reg("a")).unwrap();
    assert_eq!(state(&c), NodeState::Alive);
    assert!(
        count(&c, a2.node_index) > 0,
        "the restarted node got no extents"
    );
    // The operator's drain outlives the process, and an operator's drain
    // of a node draining for its shutdown becomes the operator's.
    c.drain("a", a2.incarnation).unwrap();
    c.drain("a", 0).unwrap();
    c.register(reg("a")).unwrap();
    assert_ne!(
        state(&c),
        NodeState::Alive,
        "the operator's drain was dropped"
    );
    c.undrain("a").unwrap();
    assert_eq!(state(&c), NodeState::Alive);
}

#[test]
fn a_registration_may_ask_for_the_map_compact() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    c.register(reg("a")).unwrap();
    let full = c.register(reg("b")).unwrap().map.unwrap();
    assert!(!full.owner.is_empty() && full.compact.is_none());
    let compact = c
        .register(RegisterRequest {
            compact_map: true,
            ..reg("c")
        })
        .unwrap()
        .map
        .unwrap();
    assert!(
        compact.owner.is_empty(),
        "the expanded arrays were sent too"
    );
    let expanded = pagewire_proto::map::MapApplier::new()
        .apply(compact)
        .unwrap();
    let now = c.map();
    assert_eq!(
        (expanded.epoch, &expanded.owner, &expanded.previous_owner),
        (now.epoch, &now.owner, &now.previous_owner)
    );
}

#[test]
fn bad_registrations_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let mut r = reg("bad id");
    assert!(matches!(
        c.register(r.clone()),
        Err(CoordError::InvalidArgument(_))
    ));
    r = reg("x");
    r.grpc_address = "nowhere".into();
    assert!(matches!(c.register(r), Err(CoordError::InvalidArgument(_))));
    r = reg("x");
    r.page_size = 512;
    assert!(matches!(
        c.register(r),
        Err(CoordError::PageSizeMismatch { .. })
    ));
    c.register(reg("x")).unwrap();
    r = reg("y");
    r.file_size = 5;
    assert!(matches!(
        c.register(r),
        Err(CoordError::FileSizeMismatch { .. })
    ));
}

fn hb(c: &mut ClusterState, id: &str, incarnation: u64) -> Result<HeartbeatResponse, CoordError> {
    c.heartbeat(HeartbeatRequest {
        node_id: id.into(),
        incarnation,
        applied_epoch: c.epoch,
        stats: None,
    })
}

#[test]
fn a_live_node_id_is_not_taken_by_another_process() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let real = c.register(reg("n")).unwrap();
    let epoch = c.epoch;
    // A second process with the same id at another address.
    let mut dup = reg("n");
    dup.grpc_address = "127.0.0.1:10".into();
    let e = c.register(dup.clone()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, CoordError::NodeIdInUse { .. }), "{msg}");
    assert!(msg.contains("127.0.0.1:9") && msg.contains("ms"), "{msg}");
    let status = tonic::Status::from(e);
    assert_eq!(status.code(), tonic::Code::AlreadyExists);
    let remaining: u64 = status
        .metadata()
        .get(crate::error::LEASE_REMAINING_KEY)
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=500).contains(&remaining), "{remaining}");
    assert_eq!(c.epoch, epoch, "a refused registration changed the map");
    assert_eq!(c.members["n"].info.incarnation, real.incarnation);
    hb(&mut c, "n", real.incarnation).unwrap();

    // The same process, after losing its own lease, takes over.
    let mut again = reg("n");
    again.previous_incarnation = real.incarnation;
    let second = c.register(again).unwrap();
    assert_ne!(second.incarnation, real.incarnation);
    // A restart in place (same address, a new process) takes over.
    let third = c.register(reg("n")).unwrap();
    assert_eq!(third.node_index, real.node_index);
    // Once the lease ran out, a process at a new address takes over.
    c.expire_leases(Instant::now() + Duration::from_secs(1))
        .unwrap();
    let moved = c.register(dup).unwrap();
    assert_eq!(moved.node_index, real.node_index);
    assert_eq!(c.members["n"].info.grpc_address, "127.0.0.1:10");
}

#[test]
fn an_incarnation_that_left_never_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    c.register(reg("a")).unwrap();
    let b = c.register(reg("b")).unwrap();
    c.leave("b", b.incarnation).unwrap();
    let epoch = c.epoch;
    assert!(matches!(
        hb(&mut c, "b", b.incarnation),
        Err(CoordError::NotAlive { .. })
    ));
    let mut again = reg("b");
    again.previous_incarnation = b.incarnation;
    let e = c.register(again).unwrap_err();
    assert!(matches!(e, CoordError::Left { .. }), "{e}");
    assert_eq!(
        tonic::Status::from(e).code(),
        tonic::Code::FailedPrecondition
    );
    assert_eq!(c.epoch, epoch);
    assert_eq!(c.members["b"].info.state(), NodeState::Left);
    assert_eq!(count(&c, b.node_index), 0);
    // A new process with that id joins.
    c.register(reg("b")).unwrap();
    assert_eq!(c.members["b"].info.state(), NodeState::Alive);
}

#[test]
fn draining_the_last_alive_node_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let a = c.register(reg("a")).unwrap();
    let e = c.drain("a", 0).unwrap_err();
    assert!(
        matches!(e, CoordError::NoNodeLeft { extents: 4096, .. }),
        "{e}"
    );
    assert_eq!(c.members["a"].info.state(), NodeState::Alive);
    assert_eq!(count(&c, a.node_index), 4096);
    c.register(reg("b")).unwrap();
    c.drain("a", 0).unwrap();
    let e = c.drain("b", 0).unwrap_err();
    assert!(e.to_string().contains("no alive node"), "{e}");
    assert_eq!(
        tonic::Status::from(e).code(),
        tonic::Code::FailedPrecondition
    );
    c.undrain("a").unwrap();
    c.drain("b", 0).unwrap();
}

#[test]
fn huge_ids_and_fields_are_refused_with_short_messages() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let a = c.register(reg("a")).unwrap();
    let huge = "x".repeat(70_000);
    let errors = [
        hb(&mut c, &huge, a.incarnation).unwrap_err(),
        c.leave(&huge, a.incarnation).unwrap_err(),
        c.drain(&huge, 0).unwrap_err(),
        c.undrain(&huge).unwrap_err(),
        c.register(reg(&huge)).unwrap_err(),
        c.register(reg(&format!("{huge}!"))).unwrap_err(),
        c.register(RegisterRequest {
            grpc_address: huge.clone(),
            ..reg("b")
        })
        .unwrap_err(),
        c.register(RegisterRequest {
            topology: Some(pagewire_proto::v1::Topology {
                hostname: huge.clone(),
                ..Default::default()
            }),
            ..reg("b")
        })
        .unwrap_err(),
        c.register(RegisterRequest {
            transports: vec![pagewire_proto::v1::TransportDescriptor {
                kind: "tcp".into(),
                endpoint: huge.clone(),
                ..Default::default()
            }],
            ..reg("b")
        })
        .unwrap_err(),
    ];
    for e in errors {
        let s = tonic::Status::from(e);
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{}", s.message());
        assert!(s.message().len() < 300, "{} bytes", s.message().len());
    }
    // An unknown (valid) id is echoed whole; nothing longer than 64
    // characters of any input is.
    let e = tonic::Status::from(c.drain(&"y".repeat(128), 0).unwrap_err());
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(
        e.message().contains(&format!("{}…", "y".repeat(64))),
        "{}",
        e.message()
    );
    assert!(!e.message().contains(&"y".repeat(65)));
}

#[test]
fn set_policy_refuses_what_the_nodes_do_not_implement() {
    use pagewire_proto::policy::{
        ADMISSION, EVICTION, IMPLEMENTED_ADMISSION, IMPLEMENTED_EVICTION,
    };
    use pagewire_proto::v1::EvictionPolicy;
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    let base = c.policy;
    for &a in ADMISSION {
        for &e in EVICTION {
            let before = c.policy;
            let mut p = base;
            p.admission = a.into();
            p.eviction = e.into();
            let r = c.set_policy(p);
            if IMPLEMENTED_ADMISSION.contains(&a) && IMPLEMENTED_EVICTION.contains(&e) {
                let got = r.unwrap();
                assert_eq!(got.version, before.version + 1);
                assert_eq!((got.admission(), got.eviction()), (a, e));
            } else {
                let s = tonic::Status::from(r.unwrap_err());
                assert_eq!(s.code(), tonic::Code::Unimplemented, "{a:?}/{e:?}");
                assert!(s.message().contains("implemented: "), "{}", s.message());
                assert_eq!(c.policy, before, "a refused policy changes nothing");
            }
        }
    }
    let mut p = base;
    p.eviction = EvictionPolicy::Unspecified.into();
    let s = tonic::Status::from(c.set_policy(p).unwrap_err());
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
}

/// A small deterministic generator for the randomized tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        pagewire_proto::rendezvous::splitmix64(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Expands what the coordinator publishes and stores, after a trip
/// through the wire encoding, and compares it with the arrays of the
/// state machine. Returns the number of overrides the map carries.
fn check_compact(
    c: &ClusterState,
    follower: &mut cmap::MapApplier,
    sent: &mut Option<Arc<CompactMap>>,
) -> usize {
    use prost::Message;
    let cm = c.compact_map();
    let wire = CompactMap::decode(cm.encode_to_vec().as_slice()).unwrap();
    let m = Expander::default().expand(&wire).unwrap();
    let at = format!("epoch {}", c.epoch);
    assert_eq!(m.epoch, c.epoch, "{at}");
    assert_eq!(m.owner, c.owner, "{at}: owner");
    assert_eq!(m.previous_owner, c.previous, "{at}: previous_owner");
    assert_eq!(m.released_by, c.released, "{at}: released_by");
    assert_eq!(
        m,
        *c.map(),
        "{at}: the expanded map differs from the published one"
    );
    // The stored form is the compact one.
    let st = c.persisted();
    assert!(st.map.is_none());
    assert_eq!(st.compact.as_ref(), Some(&*cm));
    // A watcher following deltas gets the same.
    let msg = match sent.as_ref() {
        Some(prev) if prev.epoch != cm.epoch || **prev != *cm => cmap::delta(prev, &cm),
        Some(_) => return cmap::override_count(cm.overrides.as_ref()),
        None => (*cm).clone(),
    };
    let followed = follower
        .apply(OwnershipMap {
            epoch: cm.epoch,
            compact: Some(msg),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(followed, *c.map(), "{at}: through deltas");
    *sent = Some(cm.clone());
    cmap::override_count(cm.overrides.as_ref())
}

/// Random joins, leaves, drains, undrains, lease expiries, heartbeats
/// (finishing handoffs, applying releases) and restarts: after every
/// step the compact map expands to exactly the arrays.
#[test]
fn the_compact_map_always_expands_to_the_arrays() {
    let (mut steps, mut handoffs, mut releases) = (0usize, 0usize, 0usize);
    // PAGEWIRE_MAP_SEEDS=500 for a longer soak.
    let seeds: u64 = std::env::var("PAGEWIRE_MAP_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    for seed in 0..seeds {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let mut rng = Rng(seed * 1_000_003);
        let mut follower = cmap::MapApplier::new();
        let mut sent = None;
        let ids: Vec<String> = (0..7).map(|i| format!("n{i}")).collect();
        for _ in 0..70 {
            let id = ids[rng.below(ids.len())].clone();
            let inc = c.members.get(&id).map_or(0, |m| m.info.incarnation);
            let op = rng.below(10);
            let e0 = c.epoch;
            match op {
                0 | 1 => {
                    let mut r = reg(&id);
                    r.capacity_bytes = (1 + rng.below(4) as u64) << 30;
                    r.previous_incarnation = inc;
                    let _ = c.register(r);
                }
                2 => {
                    let _ = c.leave(&id, inc);
                }
                3 => {
                    let _ = c.drain(&id, 0);
                }
                4 => {
                    let _ = c.undrain(&id);
                }
                5 => {
                    let now = Instant::now();
                    for m in c.members.values_mut() {
                        if m.lease_deadline.is_some() {
                            m.lease_deadline = Some(if m.info.node_id == id {
                                now
                            } else {
                                now + Duration::from_secs(60)
                            });
                        }
                    }
                    c.expire_leases(now + Duration::from_millis(1)).unwrap();
                }
                6 => {
                    // A round: every lease holder reports, most at the
                    // current epoch (finishing handoffs).
                    let live: Vec<(String, u64)> = c
                        .members
                        .values()
                        .filter(|m| holds_lease(m.info.state()))
                        .map(|m| (m.info.node_id.clone(), m.info.incarnation))
                        .collect();
                    for (id, inc) in live {
                        let lag = u64::from(rng.below(5) == 0);
                        let _ = c.heartbeat(HeartbeatRequest {
                            node_id: id,
                            incarnation: inc,
                            applied_epoch: c.epoch.saturating_sub(lag),
                            stats: None,
                        });
                    }
                }
                7 | 8 => {
                    // Most nodes apply the current epoch, some lag one.
                    let lag = u64::from(rng.below(4) == 0);
                    let epoch = c.epoch.saturating_sub(lag);
                    let _ = c.heartbeat(HeartbeatRequest {
                        node_id: id,
                        incarnation: inc,
                        applied_epoch: epoch,
                        stats: None,
                    });
                }
                _ => {
                    let before = (
                        c.epoch,
                        c.owner.clone(),
                        c.previous.clone(),
                        c.released.clone(),
                    );
                    drop(c);
                    c = open(dir.path());
                    assert_eq!(
                        (
                            c.epoch,
                            c.owner.clone(),
                            c.previous.clone(),
                            c.released.clone()
                        ),
                        before,
                        "a restart changed the map"
                    );
                    // A new stream after a restart starts with a full map.
                    follower.reset();
                    sent = None;
                }
            }
            let n = check_compact(&c, &mut follower, &mut sent);
            if n > 0 {
                let o = c.compact.overrides.clone().unwrap();
                let e = o
                    .released_extent
                    .first()
                    .or(o.previous_extent.first())
                    .copied()
                    .unwrap() as usize;
                let ids = c.ids();
                let per_set: Vec<(u64, u32)> = c
                    .desc
                    .sets
                    .iter()
                    .map(|(id, set)| {
                        let cands: Vec<_> = set
                            .iter()
                            .map(|&(index, weight)| pagewire_proto::rendezvous::Candidate {
                                index,
                                node_id: ids[&index],
                                weight,
                            })
                            .collect();
                        (*id, pagewire_proto::rendezvous::owner_of(e as u64, &cands))
                    })
                    .collect();
                panic!(
                    "seed {seed}, op {op}, epoch {e0} -> {}: prev {} rel {} overrides; extent {e}: owner {} prev {:?} rel {:?} (override {:?}), owners by set {per_set:?}, desc {:?}, members {:?}",
                    c.epoch,
                    o.previous_extent.len(),
                    o.released_extent.len(),
                    c.owner[e],
                    c.previous.get(e),
                    c.released.get(e),
                    o.released_node.first(),
                    c.desc,
                    c.members
                        .values()
                        .map(|m| (m.info.index, m.info.state, m.info.applied_epoch))
                        .collect::<Vec<_>>()
                );
            }
            steps += 1;
            handoffs += usize::from(!c.previous.is_empty());
            releases += usize::from(!c.released.is_empty());
        }
    }
    // The histories did exercise handoffs and releases.
    assert!(
        handoffs > steps / 10 && releases > steps / 10,
        "{steps} {handoffs} {releases}"
    );
}

/// A format 1 state file (expanded map, mid-handoff) loads into the
/// same arrays, and the compact map that replaces it expands to them.
#[test]
fn a_format_1_state_file_is_converted_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = open(dir.path());
    c.register(reg("a")).unwrap();
    c.register(reg("b")).unwrap();
    c.register(reg("c")).unwrap();
    assert!(!c.previous.is_empty(), "the map is mid-handoff");
    let mut old = c.persisted();
    old.compact = None;
    old.map = Some(c.build_map());
    let truth = (
        c.epoch,
        c.owner.clone(),
        c.previous.clone(),
        c.released.clone(),
    );
    drop(c);
    crate::persist::save_as(&dir.path().join("state"), &old, 1).unwrap();
    let mut c = open(dir.path());
    assert_eq!(
        (
            c.epoch,
            c.owner.clone(),
            c.previous.clone(),
            c.released.clone()
        ),
        truth
    );
    let mut follower = cmap::MapApplier::new();
    let mut sent = None;
    let n = check_compact(&c, &mut follower, &mut sent);
    assert_eq!(
        n,
        c.previous.iter().filter(|&&p| p != 0).count(),
        "without history, the handoff is carried as overrides"
    );
    // Finishing the handoff and one more epoch leave no override.
    for id in ["a", "b", "c"] {
        let inc = c.members[id].info.incarnation;
        hb(&mut c, id, inc).unwrap();
    }
    assert!(c.previous.is_empty());
    check_compact(&c, &mut follower, &mut sent);
    for id in ["a", "b", "c"] {
        let inc = c.members[id].info.incarnation;
        hb(&mut c, id, inc).unwrap();
    }
    c.register(reg("d")).unwrap();
    assert_eq!(check_compact(&c, &mut follower, &mut sent), 0);
    // Saved as format 2 now.
    let bytes = std::fs::read(dir.path().join("state")).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 2);
}

/// proto/testdata/rendezvous-vectors.json, through the coordinator's own
/// path: members in state Alive with their capacities, a rebalance, the
/// owners it commits (and the compact map they expand from).
#[test]
fn the_rendezvous_test_vectors_hold_on_the_coordinator() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../proto/testdata/rendezvous-vectors.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let sets = v["sets"].as_array().unwrap();
    assert!(sets.len() >= 5);
    for s in sets {
        let name = s["name"].as_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        c.file_size = s["extent_count"].as_u64().unwrap() * c.params.extent_size;
        for (k, cand) in s["candidates"].as_array().unwrap().iter().enumerate() {
            let id = cand["node_id"].as_str().unwrap().to_owned();
            let info = NodeInfo {
                node_id: id.clone(),
                index: cand["index"].as_u64().unwrap() as u32,
                capacity_bytes: cand["weight"].as_u64().unwrap(),
                // A member that is not alive is no candidate.
                state: NodeState::Alive.into(),
                ..Default::default()
            };
            c.members.insert(
                id,
                Member {
                    info,
                    lease_deadline: None,
                },
            );
            // A dead bystander changes nothing.
            if k == 0 {
                let info = NodeInfo {
                    node_id: "bystander".into(),
                    index: 999_999,
                    capacity_bytes: 1 << 40,
                    state: NodeState::Dead.into(),
                    ..Default::default()
                };
                c.members.insert(
                    "bystander".into(),
                    Member {
                        info,
                        lease_deadline: None,
                    },
                );
            }
        }
        c.rebalance("test vectors").unwrap();
        let owners = if c.owner.is_empty() {
            vec![0; s["extent_count"].as_u64().unwrap() as usize]
        } else {
            c.owner.clone()
        };
        let bytes: Vec<u8> = owners.iter().flat_map(|o| o.to_le_bytes()).collect();
        let want = u64::from_str_radix(
            s["owners_fnv1a64"]
                .as_str()
                .unwrap()
                .trim_start_matches("0x"),
            16,
        )
        .unwrap();
        assert_eq!(pagewire_proto::rendezvous::fnv1a(&bytes), want, "{name}");
        for x in s["expect"].as_array().unwrap() {
            let e = x["extent"].as_u64().unwrap() as usize;
            assert_eq!(
                u64::from(owners[e]),
                x["owner"].as_u64().unwrap(),
                "{name}: {e}"
            );
        }
        let m = Expander::default().expand(&c.compact_map()).unwrap();
        assert_eq!(m.owner, c.owner, "{name}: compact");
    }
}
