//! Three etcd members on loopback ports for the coordinators' failover
//! (started as e2e/tests/etcd.rs starts them), killed on drop.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::storm::procs::{Proc, free_port};

pub struct Etcd {
    members: Vec<Proc>,
    client_ports: Vec<u16>,
}

impl Etcd {
    pub fn start(dir: &Path, stop: &dyn Fn() -> bool) -> anyhow::Result<Self> {
        if Command::new("etcd").arg("--version").output().is_err() {
            bail!("--etcd: no etcd on the PATH (Debian: apt install etcd-server etcd-client)");
        }
        let client_ports = (0..3)
            .map(|_| free_port("127.0.0.1"))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let peer_ports = (0..3)
            .map(|_| free_port("127.0.0.1"))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let cluster = (0..3)
            .map(|j| format!("e{j}=http://127.0.0.1:{}", peer_ports[j]))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for i in 0..3 {
            let (c, p) = (client_ports[i], peer_ports[i]);
            let mut cmd = Command::new("etcd");
            cmd.arg("--name")
                .arg(format!("e{i}"))
                .arg("--data-dir")
                .arg(dir.join(format!("etcd-{i}")))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{c}"))
                .arg(format!("--advertise-client-urls=http://127.0.0.1:{c}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{p}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{p}"
                ))
                .arg(format!("--initial-cluster={cluster}"))
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "pagewire-nemesis"]);
            members.push(Proc::spawn(
                &format!("etcd-{i}"),
                cmd,
                dir.join(format!("etcd-{i}.log")),
            )?);
        }
        let e = Self {
            members,
            client_ports,
        };
        // Healthy when etcdctl answers through every endpoint.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if stop() {
                bail!("interrupted");
            }
            let ok = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .arg(format!("--endpoints={}", e.endpoints()))
                .args(["endpoint", "health"])
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return Ok(e);
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd did not become healthy in 30 s (logs in {})",
                    dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn endpoints(&self) -> String {
        self.client_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
    }
}
