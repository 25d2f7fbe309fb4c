//! Which RDMA device, port and GID the node serves verbs on, read from sysfs.
//!
//! A RoCE queue pair addresses its peer by GID, and a port's GID table has
//! one entry per (address, RoCE version) of the network interfaces under it,
//! in an order that differs from host to host and from pod to pod. So the
//! node never assumes an index: by default it takes the **RoCE v2** GID whose
//! network interface (`gid_attrs/ndevs/N`) carries the node's advertised
//! address and whose value is that address (IPv4-mapped for IPv4), the one
//! a reader on another host routes to. An index set in the config is
//! checked to exist instead. Layout read (the kernel's):
//!
//! ```text
//! /sys/class/infiniband/<dev>/ports/<port>/gids/<N>             GID, "fe80:0000:..."
//! /sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<N>  "RoCE v2" | "IB/RoCE v1"
//! /sys/class/infiniband/<dev>/ports/<port>/gid_attrs/ndevs/<N>  "eth0"
//! ```
//!
//! Unused entries read as all zeros (and their attribute files fail to
//! read): they do not exist.

use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};

/// The sysfs folder of RDMA devices.
pub(crate) const SYSFS_IB: &str = "/sys/class/infiniband";

/// What the node serves verbs on, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GidChoice {
    pub(crate) device: String,
    pub(crate) port: u8,
    pub(crate) index: u8,
    pub(crate) gid: Ipv6Addr,
    /// The GID's type as sysfs names it.
    pub(crate) kind: String,
    /// The network interface the GID belongs to (empty if sysfs names none).
    pub(crate) netdev: String,
    /// Why this one, for the log.
    pub(crate) why: String,
}

/// One existing GID table entry.
#[derive(Debug, Clone)]
struct Entry {
    index: u8,
    gid: Ipv6Addr,
    kind: String,
    netdev: String,
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

/// The existing entries of one port's GID table.
fn entries(port_dir: &Path) -> Vec<Entry> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(port_dir.join("gids")) else {
        return out;
    };
    for e in rd.flatten() {
        let Some(index) = e.file_name().to_str().and_then(|n| n.parse::<u8>().ok()) else {
            continue;
        };
        let Some(gid) = read_trim(&e.path()).and_then(|g| g.parse::<Ipv6Addr>().ok()) else {
            continue;
        };
        if gid.is_unspecified() {
            continue;
        }
        let attr = |what: &str| {
            read_trim(
                &port_dir
                    .join("gid_attrs")
                    .join(what)
                    .join(index.to_string()),
            )
            .unwrap_or_default()
        };
        out.push(Entry {
            index,
            gid,
            kind: attr("types"),
            netdev: attr("ndevs"),
        });
    }
    out.sort_by_key(|e| e.index);
    out
}

/// The GID a RoCE v2 entry of `ip` holds.
fn gid_of(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

fn devices(root: &Path, device: Option<&str>) -> Result<Vec<String>, String> {
    if let Some(d) = device {
        if !root.join(d).is_dir() {
            let have = devices(root, None).unwrap_or_default();
            return Err(format!(
                "no RDMA device named {d:?} ({} has {})",
                root.display(),
                if have.is_empty() {
                    "none".to_owned()
                } else {
                    have.join(", ")
                }
            ));
        }
        return Ok(vec![d.to_owned()]);
    }
    let mut v: Vec<String> = std::fs::read_dir(root)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    if v.is_empty() {
        return Err(format!(
            "no RDMA device on this host ({} is empty or missing; soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`)",
            root.display()
        ));
    }
    Ok(v)
}

/// Picks the device, port and GID: `gid_index` (when set) must exist on
/// `device` (or the only device) and `port`; otherwise the RoCE v2 entry of
/// `ip` on any device (or `device`), at `port`.
pub(crate) fn choose(
    root: &Path,
    device: Option<&str>,
    port: u8,
    gid_index: Option<u8>,
    ip: IpAddr,
) -> Result<GidChoice, String> {
    let devs = devices(root, device)?;
    let port_dir = |d: &str| -> PathBuf { root.join(d).join("ports").join(port.to_string()) };
    if let Some(index) = gid_index {
        let d = match devs.as_slice() {
            [one] => one,
            many => {
                return Err(format!(
                    "transports.verbs_gid_index {index} needs transports.verbs_device: this host has {}",
                    many.join(", ")
                ));
            }
        };
        if !port_dir(d).is_dir() {
            return Err(format!("device {d} has no port {port}"));
        }
        let table = entries(&port_dir(d));
        let Some(e) = table.iter().find(|e| e.index == index) else {
            return Err(format!(
                "GID index {index} does not exist on {d} port {port} (its GIDs: {})",
                describe(&table)
            ));
        };
        return Ok(GidChoice {
            device: d.clone(),
            port,
            index,
            gid: e.gid,
            kind: e.kind.clone(),
            netdev: e.netdev.clone(),
            why: "transports.verbs_gid_index".into(),
        });
    }
    let want = gid_of(ip);
    let mut seen = Vec::new();
    for d in &devs {
        let table = entries(&port_dir(d));
        if let Some(e) = table.iter().find(|e| e.kind == "RoCE v2" && e.gid == want) {
            return Ok(GidChoice {
                device: d.clone(),
                port,
                index: e.index,
                gid: e.gid,
                kind: e.kind.clone(),
                netdev: e.netdev.clone(),
                why: format!(
                    "the RoCE v2 GID of the advertised address {ip}{}",
                    if e.netdev.is_empty() {
                        String::new()
                    } else {
                        format!(" on {}", e.netdev)
                    }
                ),
            });
        }
        seen.push(format!("{d} port {port}: {}", describe(&table)));
    }
    Err(format!(
        "no RoCE v2 GID holds the advertised address {ip} ({}); give the interface carrying it an RDMA device, \
         advertise an address that has one, or set transports.verbs_gid_index",
        seen.join("; ")
    ))
}

fn describe(table: &[Entry]) -> String {
    if table.is_empty() {
        return "none".into();
    }
    table
        .iter()
        .map(|e| format!("{} {} {} {}", e.index, e.gid, e.kind, e.netdev))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs: `dev` port 1 with the given (index, gid, type, netdev).
    fn fake(root: &Path, dev: &str, gids: &[(u8, &str, &str, &str)]) {
        let p = root.join(dev).join("ports/1");
        for d in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
            std::fs::create_dir_all(p.join(d)).unwrap();
        }
        for i in 0..8u8 {
            std::fs::write(
                p.join("gids").join(i.to_string()),
                "0000:0000:0000:0000:0000:0000:0000:0000\n",
            )
            .unwrap();
        }
        for (i, gid, kind, ndev) in gids {
            std::fs::write(p.join("gids").join(i.to_string()), format!("{gid}\n")).unwrap();
            std::fs::write(
                p.join("gid_attrs/types").join(i.to_string()),
                format!("{kind}\n"),
            )
            .unwrap();
            std::fs::write(
                p.join("gid_attrs/ndevs").join(i.to_string()),
                format!("{ndev}\n"),
            )
            .unwrap();
        }
    }

    const LINK_LOCAL: &str = "fe80:0000:0000:0000:5054:00ff:fe12:3401";
    const V4_MAPPED: &str = "0000:0000:0000:0000:0000:ffff:0a00:0001";
    const OTHER_V4: &str = "0000:0000:0000:0000:0000:ffff:0a00:0063";

    #[test]
    fn picks_the_roce_v2_gid_of_the_advertised_address() {
        let dir = tempfile::tempdir().unwrap();
        // Pod-like: the v1 entry of the same address comes first, another
        // interface's address too; the index is not the usual 1 or 3.
        fake(
            dir.path(),
            "rxe0",
            &[
                (0, LINK_LOCAL, "IB/RoCE v1", "eth0"),
                (1, LINK_LOCAL, "RoCE v2", "eth0"),
                (2, OTHER_V4, "RoCE v2", "eth1"),
                (4, V4_MAPPED, "IB/RoCE v1", "eth0"),
                (5, V4_MAPPED, "RoCE v2", "eth0"),
            ],
        );
        let c = choose(dir.path(), None, 1, None, "10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!((c.device.as_str(), c.index), ("rxe0", 5));
        assert_eq!(c.netdev, "eth0");
        assert!(c.why.contains("10.0.0.1"), "{}", c.why);
        let c = choose(dir.path(), None, 1, None, "10.0.0.99".parse().unwrap()).unwrap();
        assert_eq!((c.index, c.netdev.as_str()), (2, "eth1"));
    }

    #[test]
    fn explains_every_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let e = choose(dir.path(), None, 1, None, "10.0.0.1".parse().unwrap()).unwrap_err();
        assert!(e.contains("no RDMA device"), "{e}");
        fake(
            dir.path(),
            "rxe0",
            &[
                (1, LINK_LOCAL, "RoCE v2", "eth0"),
                (3, OTHER_V4, "RoCE v2", "eth0"),
            ],
        );
        let e = choose(dir.path(), None, 1, None, "10.0.0.1".parse().unwrap()).unwrap_err();
        assert!(
            e.contains("no RoCE v2 GID holds the advertised address 10.0.0.1")
                && e.contains("verbs_gid_index"),
            "{e}"
        );
        let e = choose(dir.path(), None, 1, Some(7), "10.0.0.1".parse().unwrap()).unwrap_err();
        assert!(
            e.contains("GID index 7 does not exist on rxe0 port 1"),
            "{e}"
        );
        let c = choose(dir.path(), None, 1, Some(3), "10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(c.index, 3);
        let e = choose(
            dir.path(),
            Some("mlx5_0"),
            1,
            None,
            "10.0.0.1".parse().unwrap(),
        )
        .unwrap_err();
        assert!(
            e.contains("no RDMA device named \"mlx5_0\"") && e.contains("rxe0"),
            "{e}"
        );
        let e = choose(dir.path(), None, 2, Some(1), "10.0.0.1".parse().unwrap()).unwrap_err();
        assert!(e.contains("no port 2"), "{e}");
        fake(dir.path(), "rxe1", &[(1, V4_MAPPED, "RoCE v2", "eth1")]);
        let e = choose(dir.path(), None, 1, Some(1), "10.0.0.1".parse().unwrap()).unwrap_err();
        assert!(e.contains("needs transports.verbs_device"), "{e}");
        let c = choose(dir.path(), None, 1, None, "10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!((c.device.as_str(), c.index), ("rxe1", 1));
    }
}
