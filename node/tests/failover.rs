//! Coordinator failover of the node daemon and of the cluster client's map
//! follower, against fake coordinators in this process
//! (`pagewire_testkit::fake_coordinator`): a candidate that refuses
//! everything naming no leader, a follower that serves reads and names the
//! leader on writes, and the leader.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use pagewire_client::cluster::{FollowerConfig, MapFollower};
use pagewire_proto::v1::OwnershipMap;
use pagewire_testkit::fake_coordinator::{Fake, Role};
use pagewire_testkit::process::Proc;
use pagewire_testkit::wait_for;

const TOKEN: &str = "failover-test-token";

fn runtime() -> tokio::runtime::Runtime {
    pagewire_testkit::rt_multi(1)
}

/// A node daemon process over a 1 MiB file in `dir`, registering with the
/// list `coordinators`.
fn start_node(dir: &Path, coordinators: &str) -> Proc {
    std::fs::write(dir.join("token"), TOKEN).expect("token file");
    std::fs::File::create(dir.join("data.bin"))
        .and_then(|f| f.set_len(1 << 20))
        .expect("backing file");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pagewire-node"));
    cmd.args(["--node-id", "n1"])
        .arg("--backing-file")
        .arg(dir.join("data.bin"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", ""])
        .args(["--coordinator", coordinators])
        .arg("--token-file")
        .arg(dir.join("token"))
        .args(["--frames", "64"])
        .arg("--shm-dir")
        .arg(dir)
        .env_remove("PAGEWIRE_COORDINATOR");
    Proc::start("node", &mut cmd, dir.join("node.log"))
}

#[test]
fn the_node_follows_refusals_to_the_leader_for_every_call() {
    let rt = runtime();
    let leader = Fake::start(&rt, TOKEN, Role::Leader);
    let follower = Fake::start(
        &rt,
        TOKEN,
        Role::Follower {
            hint: Some(leader.address.clone()),
        },
    );
    let candidate = Fake::start(&rt, TOKEN, Role::Candidate);
    let dir = tempfile::tempdir().expect("tempdir");
    // The leader is not in the list: only the follower's hint names it.
    let list = format!("{},{}", candidate.address, follower.address);
    let mut node = start_node(dir.path(), &list);

    wait_for("heartbeats on the leader", Duration::from_secs(20), || {
        leader.count("Heartbeat") >= 3
    });
    assert_eq!(leader.count("Register"), 1);
    // The candidate named no one: the node tried the next address, which
    // named the leader.
    assert!(candidate.count("Register") >= 1);
    assert!(follower.count("Register") >= 1);
    assert_eq!(
        candidate.count("Heartbeat") + follower.count("Heartbeat"),
        0
    );
    let log = node.log_text();
    for (from, to) in [
        (&candidate.address, &follower.address),
        (&follower.address, &leader.address),
    ] {
        let line = format!("switching coordinator from={from} to={to}");
        assert!(log.contains(&line), "no {line:?} in the log:\n{log}");
    }

    // Leadership moves to the follower: heartbeats follow the new hint.
    follower.set_role(Role::Leader);
    leader.set_role(Role::Follower {
        hint: Some(follower.address.clone()),
    });
    let before = follower.count("Heartbeat");
    wait_for(
        "heartbeats on the new leader",
        Duration::from_secs(10),
        || follower.count("Heartbeat") >= before + 3,
    );
    // One heartbeat refused, no new registration: the lease held.
    assert_eq!(leader.count("Register") + follower.count("Register"), 2);

    // Leaving on SIGTERM reaches the leader too.
    follower.set_role(Role::Follower {
        hint: Some(leader.address.clone()),
    });
    leader.set_role(Role::Leader);
    let ok = Command::new("kill")
        .args(["-TERM", &node.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(ok.success());
    let status = node.child.wait().expect("wait for the node");
    assert!(status.success(), "node exited with {status}");
    assert_eq!(leader.count("Leave"), 1, "{}", node.log_text());
}

fn map(epoch: u64) -> OwnershipMap {
    OwnershipMap {
        epoch,
        file_size: 1 << 20,
        extent_size: 64 << 10,
        page_size: 4096,
        owner: vec![0; 16],
        previous_owner: vec![0; 16],
        released_by: vec![0; 16],
        ..Default::default()
    }
}

/// Issue 18, finding 4: a coordinator whose copy of the map lags (a
/// follower that did not confirm it, an ex-leader rolled back) sends an
/// older epoch as the first message of a new map stream. The node must not
/// roll its map back to it: that map may give it extents that have since
/// moved and been written elsewhere.
#[test]
fn the_node_never_rolls_its_map_back_to_an_older_epoch_from_another_coordinator() {
    let rt = runtime();
    let ahead = Fake::start(&rt, TOKEN, Role::Leader);
    let behind = Fake::start(&rt, TOKEN, Role::Follower { hint: None });
    for (f, epoch) in [(&ahead, 5), (&behind, 3)] {
        let mut st = f.state();
        st.map = map(epoch);
        st.map.owner = vec![1; 16];
        st.stream_maps = true;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let list = format!("{},{}", ahead.address, behind.address);
    let node = start_node(dir.path(), &list);
    wait_for("epoch 5 applied", Duration::from_secs(20), || {
        ahead.state().heartbeat_epochs.last() == Some(&5)
    });
    // The coordinator holding epoch 5 goes away; the other one, which
    // leads now but holds epoch 3, serves heartbeats and the map stream.
    behind.set_role(Role::Leader);
    ahead.set_role(Role::Candidate);
    wait_for(
        "heartbeats on the other coordinator",
        Duration::from_secs(20),
        || behind.state().heartbeat_epochs.len() >= 5 && behind.count("WatchMap") >= 2,
    );
    let epochs = behind.state().heartbeat_epochs.clone();
    assert!(
        epochs.iter().all(|&e| e == 5),
        "the node rolled its map back: applied epochs {epochs:?}\n{}",
        node.log_text()
    );
}

#[test]
fn the_map_follower_confirms_through_any_coordinator_and_refetches_on_a_switch() {
    let rt = runtime();
    let candidate = Fake::start(&rt, TOKEN, Role::Candidate);
    let follower = Fake::start(&rt, TOKEN, Role::Follower { hint: None });
    for f in [&candidate, &follower] {
        let mut st = f.state();
        st.map = map(5);
        st.lease_ms = 2000;
    }
    let cfg = FollowerConfig {
        poll_interval: Some(Duration::from_millis(30)),
        ..FollowerConfig::default()
    };
    let list = format!("{},{}", candidate.address, follower.address);
    let mf = MapFollower::start_with(&list, TOKEN, cfg).expect("follower");
    assert_eq!(mf.epoch(), 5);
    assert!(mf.trusted_until().is_some_and(|t| t > Instant::now()));
    assert!(candidate.count("Status") >= 1);
    assert_eq!(follower.count("GetMap"), 1);

    // Later polls confirm through the follower's Status alone, and each
    // moves the trust window on.
    let first = mf.trusted_until().expect("trusted");
    wait_for("confirmations", Duration::from_secs(10), || {
        follower.count("Status") >= 5
    });
    assert_eq!(follower.count("GetMap"), 1, "the epoch did not move");
    assert!(mf.trusted_until().expect("trusted") > first);
    assert!(mf.last_error().is_none(), "{:?}", mf.last_error());

    // The follower stops answering; the other coordinator answers with the
    // same epoch and a smaller uptime. Another coordinator: fetch its map.
    candidate.state().uptime_ms = 10;
    candidate.set_role(Role::Follower { hint: None });
    follower.set_role(Role::Candidate);
    wait_for(
        "a map from the other coordinator",
        Duration::from_secs(10),
        || candidate.count("GetMap") == 1,
    );
    let statuses = candidate.count("Status");
    wait_for("confirmations there", Duration::from_secs(10), || {
        candidate.count("Status") >= statuses + 3
    });
    assert_eq!(candidate.count("GetMap"), 1, "its uptime only grew");
    assert_eq!(mf.epoch(), 5);

    // Its uptime goes back on the same address: it restarted.
    candidate.state().uptime_ms = 5;
    wait_for("a map after the restart", Duration::from_secs(10), || {
        candidate.count("GetMap") == 2
    });
    assert!(mf.trusted_until().is_some_and(|t| t > Instant::now()));
}

#[test]
fn the_map_follower_refuses_a_bad_address_list() {
    for bad in ["", "127.0.0.1", "a:1,b:99999"] {
        match MapFollower::start(bad, TOKEN) {
            Err(pagewire_client::cluster::ClientError::Addresses(e)) => {
                assert!(
                    e.to_string().contains("coordinator address"),
                    "{bad:?}: {e}"
                )
            }
            Err(e) => panic!("{bad:?}: another error: {e}"),
            Ok(_) => panic!("{bad:?} was accepted"),
        }
    }
}

/// While no coordinator takes its heartbeats (a leader failover), the node
/// retries well inside its interval, so a leader elected before the lease
/// lapses gets a heartbeat in time. With a 2 s interval the old loop tried
/// one round per interval: at most 2 rounds in these 4 s, and in a compose
/// failover the leases lapsed between two rounds with the new leader up.
#[test]
fn failing_heartbeats_are_retried_well_inside_the_interval() {
    let rt = runtime();
    let a = Fake::start(&rt, TOKEN, Role::Leader);
    let b = Fake::start(&rt, TOKEN, Role::Follower { hint: None });
    for f in [&a, &b] {
        let mut st = f.state();
        st.lease_ms = 10_000;
        st.heartbeat_interval_ms = 2000;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start_node(dir.path(), &format!("{},{}", a.address, b.address));
    wait_for("a heartbeat on the leader", Duration::from_secs(20), || {
        a.count("Heartbeat") >= 1
    });
    // Nobody leads for 4 s.
    a.set_role(Role::Candidate);
    b.set_role(Role::Candidate);
    let before = a.count("Heartbeat") + b.count("Heartbeat");
    std::thread::sleep(Duration::from_secs(4));
    let tries = a.count("Heartbeat") + b.count("Heartbeat") - before;
    // The first failure comes within an interval (2 s); then rounds of two
    // tries 100, 200, 400, 500, 500 ... ms apart: at least 4 more rounds.
    assert!(
        tries >= 8,
        "{tries} heartbeat tries in 4 s without a leader: {}",
        node.log_text()
    );
    // A new leader gets a heartbeat within the capped wait, and the node
    // keeps its registration.
    b.set_role(Role::Leader);
    let t0 = Instant::now();
    let before = b.count("Heartbeat");
    wait_for(
        "a heartbeat on the new leader",
        Duration::from_secs(5),
        || b.count("Heartbeat") > before,
    );
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(1500), "{took:?}");
    assert_eq!(a.count("Register") + b.count("Register"), 1);
}
