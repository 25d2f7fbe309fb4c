//! NUMA topology and placement.
//!
//! With feature `numa`, hwloc (through hwlocality) discovers the NUMA nodes,
//! binds a cache's region to one of them before its frames are first touched,
//! and pins threads. Without it the machine is treated as one NUMA node
//! holding every CPU, threads are pinned with `sched_setaffinity`, and one log
//! line says so.

use std::sync::OnceLock;

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    /// The OS's number for the node.
    pub os_index: usize,
    /// OS numbers of the CPUs (processing units) near it.
    pub cpus: Vec<usize>,
    /// Bytes of memory local to it (0 when unknown).
    pub memory_bytes: u64,
}

/// The machine as this process sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub nodes: Vec<NumaNode>,
    /// `"hwloc"`, or `"fallback"` when hwloc is not available.
    pub source: &'static str,
}

impl Topology {
    /// All CPUs, node by node.
    pub fn cpus(&self) -> Vec<usize> {
        self.nodes
            .iter()
            .flat_map(|n| n.cpus.iter().copied())
            .collect()
    }
}

/// Where a region's memory went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The NUMA node it is bound to, if any.
    pub node: Option<usize>,
    /// What happened, for humans (`"bound to node 0"`, `"first touch"`, …).
    pub how: String,
}

fn fallback() -> Topology {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    // SAFETY: as above.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) }.max(0) as u64;
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64;
    Topology {
        nodes: vec![NumaNode {
            os_index: 0,
            cpus: (0..n).collect(),
            memory_bytes: pages * page,
        }],
        source: "fallback",
    }
}

#[cfg(feature = "numa")]
mod hw {
    use super::{NumaNode, Topology};
    use hwlocality::object::types::ObjectType;

    pub(super) fn topology() -> Option<&'static hwlocality::Topology> {
        static TOPO: std::sync::OnceLock<Option<hwlocality::Topology>> = std::sync::OnceLock::new();
        TOPO.get_or_init(|| match hwlocality::Topology::new() {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "hwloc could not load the topology; treating the machine as one NUMA node");
                None
            }
        })
        .as_ref()
    }

    pub(super) fn discover() -> Option<Topology> {
        let topo = topology()?;
        let nodes: Vec<NumaNode> = topo
            .objects_with_type(ObjectType::NUMANode)
            .map(|obj| NumaNode {
                os_index: obj.os_index().unwrap_or(0),
                cpus: obj
                    .cpuset()
                    .map(|s| s.iter_set().map(usize::from).collect())
                    .unwrap_or_default(),
                memory_bytes: obj.total_memory(),
            })
            .collect();
        if nodes.is_empty() {
            return None;
        }
        Some(Topology {
            nodes,
            source: "hwloc",
        })
    }

    pub(super) fn bind(addr: *const u8, len: usize, node: usize) -> Result<(), String> {
        use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
        let topo = topology().ok_or("no hwloc topology")?;
        let obj = topo
            .objects_with_type(ObjectType::NUMANode)
            .find(|o| o.os_index() == Some(node))
            .ok_or_else(|| format!("no NUMA node {node}"))?;
        let set = obj.nodeset().ok_or("NUMA node without a nodeset")?;
        // SAFETY: `addr..addr + len` is one live mapping owned by the caller's
        // region for at least this call; hwloc only changes its policy.
        let area: &[u8] = unsafe { std::slice::from_raw_parts(addr, len) };
        topo.bind_memory_area::<[u8], _>(
            area,
            set,
            MemoryBindingPolicy::Bind,
            MemoryBindingFlags::MIGRATE,
        )
        .map_err(|e| e.to_string())
    }

    pub(super) fn pin(cpu: usize) -> Result<(), String> {
        use hwlocality::cpu::binding::CpuBindingFlags;
        use hwlocality::cpu::cpuset::CpuSet;
        let topo = topology().ok_or("no hwloc topology")?;
        let idx =
            hwlocality::ffi::PositiveInt::try_from(cpu).map_err(|e| format!("cpu {cpu}: {e}"))?;
        let mut set = CpuSet::new();
        set.set(idx);
        topo.bind_cpu(&set, CpuBindingFlags::THREAD)
            .map_err(|e| e.to_string())
    }
}

/// The machine's NUMA layout (discovered once).
pub fn discover() -> &'static Topology {
    static TOPO: OnceLock<Topology> = OnceLock::new();
    TOPO.get_or_init(|| {
        #[cfg(feature = "numa")]
        if let Some(t) = hw::discover() {
            tracing::info!(nodes = t.nodes.len(), "NUMA topology from hwloc");
            return t;
        }
        #[cfg(not(feature = "numa"))]
        tracing::info!("NUMA: built without feature `numa`; treating the machine as one NUMA node");
        fallback()
    })
}

/// Pin the calling thread to `cpu` (hwloc with feature `numa`, else
/// `sched_setaffinity`).
pub fn pin_current_thread(cpu: usize) -> Result<(), String> {
    #[cfg(feature = "numa")]
    if discover().source == "hwloc" {
        return hw::pin(cpu);
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it
    // for cpu < CPU_SETSIZE, which we check.
    unsafe {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(format!("cpu {cpu} out of range"));
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
    }
    Ok(())
}

/// Bind a fresh region to `node` if asked and possible.
pub(crate) fn place(addr: *const u8, len: usize, node: Option<usize>) -> Placement {
    let Some(node) = node else {
        return Placement {
            node: None,
            how: "first touch (no NUMA node configured)".into(),
        };
    };
    #[cfg(feature = "numa")]
    {
        match hw::bind(addr, len, node) {
            Ok(()) => Placement {
                node: Some(node),
                how: format!("bound to NUMA node {node} by hwloc"),
            },
            Err(e) => {
                tracing::warn!(node, error = %e, "could not bind the cache region; using first touch");
                Placement {
                    node: None,
                    how: format!("first touch (binding to node {node} failed: {e})"),
                }
            }
        }
    }
    #[cfg(not(feature = "numa"))]
    {
        let _ = (addr, len);
        tracing::info!(
            node,
            "NUMA binding asked for, but built without feature `numa`: using first touch"
        );
        Placement {
            node: None,
            how: format!("first touch (node {node} asked; built without feature `numa`)"),
        }
    }
}
