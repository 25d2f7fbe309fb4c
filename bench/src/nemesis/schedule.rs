//! The nemesis's fault schedule: seeded choices, made one step at a time
//! against the cluster's state as the schedule itself left it (which nodes
//! are drained, which joined), so that a seed and the arguments give the
//! same sequence of faults; only the instants move with the machine.
//!
//! Steps (each leaves every process running again before the next, except
//! drains, which last until an undrain step):
//! - `kill9`: kill -9 a node, restart it (same id and address) 0.3 to 2
//!   leases later;
//! - `restart-in-place`: kill -9 and start again at once, within the lease,
//!   while the workers' shm connections to it are open;
//! - `pause-past-lease`: SIGSTOP a node, wait until the coordinator
//!   declares it dead (its extents are taken over), then optionally a
//!   tight follow-up (`followup-drain`, `followup-undrain`,
//!   `followup-join`: another map change 0 to 10 ms after the takeover is
//!   seen), SIGCONT 0.2 to 0.8 s later;
//! - `cut` (with `--hosts`): the node's host off the network for 0.5 to 2
//!   leases, then healed;
//! - `failover` (with `--etcd`): kill -9 the leading coordinator, start it
//!   again 0.5 to 2 s later;
//! - `evict-all` (one time in four) then `drain`: every cache emptied, the
//!   workers' runs up to extents' last pages read for 0.1 to 0.6 s (each
//!   miss at the owner reads ahead), then a node drained: extents move right
//!   after reads of the runs that end at their neighbours' last pages;
//! - `drain`, `undrain`, `join`: through the coordinator's admin API (as
//!   `pwctl drain` / `undrain`), a join starts a spare node.

use std::time::{Duration, Instant};

use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::{CoordinatorRole, NodeState, OwnershipMap, StatusRequest};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{FaultRec, Focus};
use crate::storm::procs::{self, Cluster};

#[derive(Clone, Debug)]
enum Followup {
    Drain(String),
    Undrain(String),
    Join,
}

#[derive(Clone, Debug)]
enum Step {
    Kill9(String),
    RestartInPlace(String),
    Pause(String, Option<(Followup, u64)>),
    Cut(String),
    Failover,
    Drain(String),
    Undrain(String),
    Join,
    /// Evict every cache, let the workers read runs up to extents' last
    /// pages (the owners' readahead crosses into the next extents), then
    /// drain a node: the next extents move.
    EvictRunsDrain(String),
}

pub struct Schedule {
    rng: SmallRng,
    focus: Focus,
    token: String,
    lease: Duration,
    cuts: bool,
    etcd: bool,
    t0: Instant,
    drained: Vec<String>,
    pub done: Vec<FaultRec>,
}

impl Schedule {
    pub fn new(
        seed: u64,
        focus: Focus,
        token: &str,
        lease_ms: u64,
        cuts: bool,
        etcd: bool,
        t0: Instant,
    ) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
            focus,
            token: token.to_owned(),
            lease: Duration::from_millis(lease_ms),
            cuts,
            etcd,
            t0,
            drained: Vec::new(),
            done: Vec::new(),
        }
    }

    fn rec(&mut self, kind: &'static str, target: &str, note: String) {
        let at_s = self.t0.elapsed().as_secs_f64();
        eprintln!("nemesis: {at_s:>7.3} s  {kind:<18} {target:<14} {note}");
        self.done.push(FaultRec {
            kind,
            target: target.to_owned(),
            at_s,
            note,
        });
    }

    /// Runs steps until `end` (the last one may run a little past it).
    pub fn run(&mut self, c: &mut Cluster, end: Instant, stop: &dyn Fn() -> bool) {
        // Leave the last stretch quiet: every worker's last operations
        // complete against a settled cluster.
        let quiet = (self.lease * 3).min(Duration::from_secs(5));
        while self.focus != Focus::None && Instant::now() + quiet < end && !stop() {
            let step = self.pick(c);
            if let Err(e) = self.step(c, &step) {
                self.rec("error", "-", format!("{step:?}: {e:#}"));
            }
            self.settle(c, stop);
            let gap = self.rng.random_range(50..400);
            std::thread::sleep(Duration::from_millis(gap));
        }
        while Instant::now() < end && !stop() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn owners(&self, c: &Cluster) -> Vec<String> {
        c.nodes
            .iter()
            .map(|p| p.name.clone())
            .filter(|n| !self.drained.contains(n))
            .collect()
    }

    fn any(&mut self, v: &[String]) -> String {
        v[self.rng.random_range(0..v.len())].clone()
    }

    fn spare(&self, c: &Cluster) -> bool {
        c.nodes.len() < c.spec.hosts.node.len()
    }

    /// A map change other than `victim`'s, possible now.
    fn followup(&mut self, c: &Cluster, victim: &str) -> Option<Followup> {
        let owners: Vec<String> = self.owners(c).into_iter().filter(|n| n != victim).collect();
        let mut options = Vec::new();
        if let Some(d) = self.drained.first() {
            options.push(Followup::Undrain(d.clone()));
        }
        if self.spare(c) {
            options.push(Followup::Join);
        }
        if owners.len() >= 2 {
            let n = self.any(&owners);
            options.push(Followup::Drain(n));
        }
        if options.is_empty() {
            return None;
        }
        let k = self.rng.random_range(0..options.len());
        Some(options.swap_remove(k))
    }

    fn pick(&mut self, c: &Cluster) -> Step {
        let owners = self.owners(c);
        let nodes: Vec<String> = c.nodes.iter().map(|p| p.name.clone()).collect();
        match self.focus {
            Focus::TakeoverFollowup => {
                let v = self.any(&owners);
                let f = self.followup(c, &v);
                let delay = self.rng.random_range(0..=10);
                Step::Pause(v, f.map(|f| (f, delay)))
            }
            Focus::RestartInPlace => Step::RestartInPlace(self.any(&owners)),
            Focus::None => unreachable!("the control run has no steps"),
            Focus::ReadaheadBoundary => {
                if let Some(d) = self.drained.first() {
                    Step::Undrain(d.clone())
                } else {
                    Step::EvictRunsDrain(self.any(&owners))
                }
            }
            Focus::Mixed => loop {
                let k = self.rng.random_range(0..11);
                let s = match k {
                    0 => Step::Kill9(self.any(&nodes)),
                    1 => Step::RestartInPlace(self.any(&owners)),
                    2 => Step::Pause(self.any(&owners), None),
                    3 | 4 => {
                        let v = self.any(&owners);
                        let f = self.followup(c, &v);
                        let delay = self.rng.random_range(0..=10);
                        Step::Pause(v, f.map(|f| (f, delay)))
                    }
                    5 if self.cuts => Step::Cut(self.any(&nodes)),
                    6 if self.etcd => Step::Failover,
                    7 if owners.len() > 2 => Step::Drain(self.any(&owners)),
                    8 if !self.drained.is_empty() => Step::Undrain(self.drained[0].clone()),
                    9 if self.spare(c) => Step::Join,
                    10 if owners.len() > 2 => Step::EvictRunsDrain(self.any(&owners)),
                    _ => continue,
                };
                break s;
            },
        }
    }

    fn ms(&mut self, lo_leases: f64, hi_leases: f64) -> Duration {
        let x = self.rng.random_range(lo_leases..hi_leases);
        self.lease.mul_f64(x)
    }

    fn step(&mut self, c: &mut Cluster, s: &Step) -> anyhow::Result<()> {
        match s {
            Step::Kill9(n) => {
                let wait = self.ms(0.3, 2.0);
                c.proc_mut(n)?.kill();
                self.rec("kill9", n, format!("restart in {} ms", wait.as_millis()));
                std::thread::sleep(wait);
                c.restart(n)?;
                self.rec("restart", n, "same id and address".into());
            }
            Step::RestartInPlace(n) => {
                c.restart_in_place(n)?;
                // The map does not change (same id, lease live): hold a
                // while so the new process serves before the next step.
                let hold = self.ms(0.5, 2.0);
                self.rec(
                    "restart-in-place",
                    n,
                    format!(
                        "kill -9 and start again at once (same id, same address); hold {} ms",
                        hold.as_millis()
                    ),
                );
                std::thread::sleep(hold);
            }
            Step::Pause(n, follow) => {
                let hold = Duration::from_millis(self.rng.random_range(200..800));
                c.proc_mut(n)?.signal(libc::SIGSTOP)?;
                self.rec("sigstop", n, "until declared dead".into());
                let r = self.wait_dead(c, n);
                match r {
                    Ok(after) => {
                        self.rec(
                            "takeover",
                            n,
                            format!("declared dead {} ms after SIGSTOP", after.as_millis()),
                        );
                        if let Some((f, delay)) = follow {
                            std::thread::sleep(Duration::from_millis(*delay));
                            let r = self.do_followup(c, f);
                            if let Err(e) = r {
                                self.rec("error", n, format!("follow-up {f:?}: {e:#}"));
                            }
                        }
                    }
                    Err(e) => self.rec("error", n, format!("{e:#}")),
                }
                std::thread::sleep(hold);
                c.proc_mut(n)?.signal(libc::SIGCONT)?;
                self.rec("sigcont", n, String::new());
            }
            Step::Cut(n) => {
                let len = self.ms(0.5, 2.0);
                c.net(n, false)?;
                self.rec("cut", n, format!("heal in {} ms", len.as_millis()));
                std::thread::sleep(len);
                c.net(n, true)?;
                self.rec("heal", n, String::new());
            }
            Step::Failover => {
                let leader = self.leader(c).ok_or_else(|| anyhow::anyhow!("no leader"))?;
                let name = if leader == c.spec.coordinator_addr() {
                    "coordinator".to_owned()
                } else {
                    let i = c
                        .spec
                        .standby_ports
                        .iter()
                        .position(|p| leader.ends_with(&format!(":{p}")))
                        .ok_or_else(|| anyhow::anyhow!("leader {leader} is none of ours"))?;
                    format!("coordinator-{}", i + 2)
                };
                let back = Duration::from_millis(self.rng.random_range(500..2000));
                c.proc_mut(&name)?.kill();
                self.rec(
                    "failover",
                    &name,
                    format!("kill -9 the leader, back in {} ms", back.as_millis()),
                );
                std::thread::sleep(back);
                c.restart(&name)?;
                self.rec("coordinator-back", &name, String::new());
            }
            Step::Drain(n) => self.do_followup(c, &Followup::Drain(n.clone()))?,
            Step::Undrain(n) => self.do_followup(c, &Followup::Undrain(n.clone()))?,
            Step::Join => self.do_followup(c, &Followup::Join)?,
            Step::EvictRunsDrain(n) => {
                let read = Duration::from_millis(self.rng.random_range(100..600));
                // One time in four: caches emptied first, so the runs read
                // ahead afresh. The other times copies a node read ahead
                // into its neighbours' extents (finding 3) stay, as nothing
                // but CLOCK evicts them, until a move gives one of those
                // extents to that node: emptying every cache before every
                // drain left only the copies of the last 0.1-0.6 s, and hid
                // the finding once the fixed evict_range also dropped pages
                // readers held (the mutation check found nothing in 3 x 30 s).
                if self.rng.random_range(0..4) == 0 {
                    let addr = self.leader(c).unwrap_or_else(|| c.spec.coordinator_addr());
                    let size = self.map(c).map_or(0, |m| m.file_size);
                    let pages = procs::evict(&addr, &self.token, size)?;
                    self.rec(
                        "evict-all",
                        "-",
                        format!("{pages} pages; drain in {} ms", read.as_millis()),
                    );
                }
                std::thread::sleep(read);
                self.do_followup(c, &Followup::Drain(n.clone()))?;
            }
        }
        Ok(())
    }

    fn do_followup(&mut self, c: &mut Cluster, f: &Followup) -> anyhow::Result<()> {
        let tight = self
            .done
            .last()
            .is_some_and(|r| r.kind == "takeover")
            .then(|| {
                format!(
                    "{:.1} ms after the takeover was seen",
                    (self.t0.elapsed().as_secs_f64() - self.done.last().map_or(0.0, |r| r.at_s))
                        * 1e3
                )
            });
        let kind = |k: &'static str, t: &'static str| if tight.is_some() { t } else { k };
        let list = c.spec.coordinator_list();
        // The leader, or (a leader just elected, an answer naming another)
        // each coordinator in turn, for up to 3 s.
        let drain = |n: &str, undrain: bool| -> anyhow::Result<u64> {
            let t = Instant::now();
            let first = self.leader(c).unwrap_or_else(|| c.spec.coordinator_addr());
            let mut last = None;
            while t.elapsed() < Duration::from_secs(3) {
                for a in std::iter::once(first.as_str()).chain(list.split(',')) {
                    match procs::drain(a, &self.token, n, undrain) {
                        Ok(e) => return Ok(e),
                        Err(e) => last = Some(e),
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(last.unwrap_or_else(|| anyhow::anyhow!("no coordinator answered")))
        };
        match f {
            Followup::Drain(n) => {
                let e = drain(n, false)?;
                self.drained.push(n.clone());
                let note = format!("epoch {e} {}", tight.clone().unwrap_or_default());
                self.rec(kind("drain", "followup-drain"), n, note);
            }
            Followup::Undrain(n) => {
                let e = drain(n, true)?;
                self.drained.retain(|d| d != n);
                let note = format!("epoch {e} {}", tight.clone().unwrap_or_default());
                self.rec(kind("undrain", "followup-undrain"), n, note);
            }
            Followup::Join => {
                let n = c.join()?;
                self.rec(kind("join", "followup-join"), &n, tight.unwrap_or_default());
            }
        }
        Ok(())
    }

    fn map(&self, c: &Cluster) -> Option<OwnershipMap> {
        let list = c.spec.coordinator_list();
        list.split(',')
            .find_map(|a| procs::get_map(a, &self.token).ok())
    }

    /// The leading coordinator's address (the only one without etcd),
    /// waiting up to 3 s for an election.
    fn leader(&self, c: &Cluster) -> Option<String> {
        if !self.etcd {
            return Some(c.spec.coordinator_addr());
        }
        let t = Instant::now();
        loop {
            if let Some(a) = self.leader_now(c) {
                return Some(a);
            }
            if t.elapsed() > Duration::from_secs(3) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn leader_now(&self, c: &Cluster) -> Option<String> {
        let list = c.spec.coordinator_list();
        list.split(',').find_map(|a| {
            let rt = procs::rt().ok()?;
            rt.block_on(async {
                let ch = pagewire_proto::net::connect(a, None, Duration::from_millis(300))
                    .await
                    .ok()?;
                let mut cl =
                    CoordinatorClient::with_interceptor(ch, AttachToken::new(&self.token).ok()?);
                let s = tokio::time::timeout(
                    Duration::from_millis(500),
                    cl.status(StatusRequest::default()),
                )
                .await
                .ok()?
                .ok()?
                .into_inner();
                (s.role() == CoordinatorRole::Leader).then(|| a.to_owned())
            })
        })
    }

    fn state_of(m: &OwnershipMap, n: &str) -> Option<NodeState> {
        m.nodes
            .iter()
            .find(|x| x.node_id == n)
            .map(|x| NodeState::try_from(x.state).unwrap_or(NodeState::Unspecified))
    }

    /// Polls the map every 2 ms until `n` is declared dead; how long it took.
    fn wait_dead(&self, c: &Cluster, n: &str) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let limit = self.lease * 4 + Duration::from_secs(3);
        while t.elapsed() < limit {
            if let Some(m) = self.map(c)
                && Self::state_of(&m, n) == Some(NodeState::Dead)
            {
                return Ok(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        anyhow::bail!("{n} was not declared dead within {limit:?}")
    }

    /// Waits (bounded) until every node of the cluster holds a lease, the
    /// drained ones are drained, and no extent is unowned or in handoff.
    fn settle(&mut self, c: &mut Cluster, stop: &dyn Fn() -> bool) {
        let t = Instant::now();
        let limit = self.lease * 6 + Duration::from_secs(4);
        while t.elapsed() < limit && !stop() {
            if let Some(m) = self.map(c) {
                let nodes_ok = c.nodes.iter().all(|p| {
                    let want = if self.drained.contains(&p.name) {
                        NodeState::Drained
                    } else {
                        NodeState::Alive
                    };
                    Self::state_of(&m, &p.name) == Some(want)
                });
                let extents_ok = !m.owner.is_empty()
                    && m.owner.iter().all(|&o| o != 0)
                    && m.previous_owner.iter().all(|&o| o == 0);
                if nodes_ok && extents_ok {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.rec(
            "unsettled",
            "-",
            format!("the map did not settle within {limit:?}"),
        );
    }
}
