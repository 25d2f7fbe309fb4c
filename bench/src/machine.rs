//! What machine a result came from.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub memory_bytes: u64,
    pub numa_nodes: usize,
    pub numa_source: &'static str,
    pub cpu: String,
    pub kernel: String,
}

pub fn describe() -> Machine {
    let topo = pagewire_node::numa::discover();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    Machine {
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        memory_bytes: mem_total()
            .unwrap_or_else(|| topo.nodes.iter().map(|n| n.memory_bytes).sum()),
        numa_nodes: topo.nodes.len(),
        numa_source: topo.source,
        cpu,
        kernel,
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} cores, {:.1} GiB, {} NUMA node(s) ({}), {}, Linux {}",
            self.cores,
            self.memory_bytes as f64 / (1u64 << 30) as f64,
            self.numa_nodes,
            self.numa_source,
            self.cpu,
            self.kernel
        )
    }
}

/// MemTotal from /proc/meminfo, in bytes.
fn mem_total() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}
