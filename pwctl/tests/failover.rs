//! `pwctl --coordinator a,b,...` against fake coordinators in this process
//! (`pagewire_testkit::fake_coordinator`): reads are answered by the
//! first coordinator that answers, writes reach the leader the followers
//! name, and `pwctl status` shows the coordinators and the store.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pagewire_proto::v1::CoordinatorRole;
use pagewire_testkit::fake_coordinator::{Fake, Role};
use pagewire_testkit::free_port;
use serde_json::Value;

const TOKEN: &str = "pwctl-failover-token";

fn runtime() -> tokio::runtime::Runtime {
    pagewire_testkit::rt_multi(1)
}

fn pwctl(token: &Path, coordinators: &str, args: &[&str]) -> Output {
    Command::new(PathBuf::from(env!("CARGO_BIN_EXE_pwctl")))
        .args(["--coordinator", coordinators, "--timeout-ms", "3000"])
        .arg("--token-file")
        .arg(token)
        .args(args)
        .env_remove("PAGEWIRE_COORDINATOR")
        .output()
        .expect("run pwctl")
}

struct Setup {
    _rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
    follower: Fake,
    leader: Fake,
}

impl Setup {
    /// A follower naming the leader, and the leader; both say so in Status.
    fn new() -> Self {
        let rt = runtime();
        let leader = Fake::start(&rt, TOKEN, Role::Leader);
        let follower = Fake::start(
            &rt,
            TOKEN,
            Role::Follower {
                hint: Some(leader.address.clone()),
            },
        );
        for f in [&leader, &follower] {
            let mut st = f.state();
            st.leader = leader.address.clone();
            st.coordinators = vec![
                (follower.address.clone(), CoordinatorRole::Follower),
                (leader.address.clone(), CoordinatorRole::Leader),
            ];
        }
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), TOKEN).expect("token");
        Setup {
            _rt: rt,
            dir,
            follower,
            leader,
        }
    }

    fn token(&self) -> PathBuf {
        self.dir.path().join("token")
    }
}

#[test]
fn status_is_read_from_the_first_follower_and_shows_the_coordinators() {
    let s = Setup::new();
    // Nothing listens on the first address: the next one answers.
    let dead = format!("127.0.0.1:{}", free_port());
    let list = format!("{dead},{},{}", s.follower.address, s.leader.address);
    let out = pwctl(&s.token(), &list, &["--json", "status"]);
    assert!(out.status.success(), "{out:?}");
    let j: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(j["coordinator"], s.follower.address.as_str(), "{j}");
    assert_eq!(j["role"], "follower", "{j}");
    assert_eq!(j["store"], "etcd://127.0.0.1:2379", "{j}");
    assert_eq!(j["leader"], s.leader.address.as_str(), "{j}");
    assert_eq!(j["coordinators"][1]["address"], s.leader.address.as_str());
    assert_eq!(j["coordinators"][1]["role"], "leader");
    assert_eq!(j["coordinators"][0]["role"], "follower");
    assert!(j["store_problem"].is_null(), "{j}");
    // A read stays on the follower: the leader was not asked.
    assert_eq!(s.follower.count("Status"), 1);
    assert_eq!(s.leader.count("Status"), 0);

    // No leader, and the store says why: the table says so.
    {
        let mut st = s.follower.state();
        st.role = Role::Candidate;
        st.leader.clear();
        st.store_problem = "etcd has no quorum: for 3 s".into();
    }
    // A candidate refuses reads too: the leader's own answer is shown...
    let out = pwctl(&s.token(), &list, &["status"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{} (leader,", s.leader.address)),
        "{text}"
    );
    // ...and a follower without a leader shows none, with the reason.
    s.follower.set_role(Role::Follower { hint: None });
    let out = pwctl(&s.token(), &list, &["status"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("none: etcd has no quorum: for 3 s"), "{text}");
    assert!(text.contains("store problem"), "{text}");
    assert!(
        text.contains(&format!("{} (follower)", s.follower.address)),
        "{text}"
    );
}

#[test]
fn writes_reach_the_leader_the_follower_names() {
    let s = Setup::new();
    // The leader is not even in the list: the follower's hint names it.
    let out = pwctl(&s.token(), &s.follower.address, &["--json", "drain", "n1"]);
    assert!(out.status.success(), "{out:?}");
    let j: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(j["extents_moved"], 3, "{j}");
    assert_eq!(s.leader.state().drained, vec!["n1".to_owned()]);
    assert_eq!(s.follower.count("Drain"), 1, "refused there first");

    // Followers that know no leader, then the leader later in the list.
    s.follower.set_role(Role::Follower { hint: None });
    let list = format!("{},{}", s.follower.address, s.leader.address);
    let out = pwctl(&s.token(), &list, &["undrain", "n1"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(s.leader.count("Undrain"), 1);

    // Nobody leads: the error names each coordinator's refusal; exit 1.
    s.leader.set_role(Role::Candidate);
    let out = pwctl(&s.token(), &list, &["drain", "n2"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("drain failed") && err.contains(&s.follower.address),
        "{err}"
    );

    // A bad list is a usage error (exit 2) before any call.
    let out = pwctl(&s.token(), "a:1,b", &["status"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad --coordinator"),
        "{out:?}"
    );
}
