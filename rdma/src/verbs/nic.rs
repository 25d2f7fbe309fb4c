//! Device set-up and queue pairs, shared by the owner and the reader.

use std::net::Ipv6Addr;
use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};

use super::VerbsConfig;

/// An opened device: context, protection domain and the port's addressing.
pub(super) struct Nic {
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) ctx: Arc<DeviceContext>,
    pub(super) port: u8,
    pub(super) gid: Gid,
    pub(super) gid_index: u8,
    pub(super) lid: u16,
    pub(super) mtu: Mtu,
    pub(super) rd_atom: u8,
}

pub(super) fn dev_err(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

pub(super) fn open_nic(cfg: &VerbsConfig) -> Result<Nic, String> {
    let list = DeviceList::new().map_err(|e| dev_err("listing RDMA devices", e))?;
    let dev = match &cfg.device {
        Some(name) => list
            .iter()
            .find(|d| d.name() == *name)
            .ok_or_else(|| format!("no RDMA device named {name:?}"))?,
        None => list
            .iter()
            .next()
            .ok_or_else(|| "no RDMA device on this machine".to_owned())?,
    };
    let ctx = dev.open().map_err(|e| dev_err("opening the device", e))?;
    let pd = ctx
        .alloc_pd()
        .map_err(|e| dev_err("allocating a protection domain", e))?;
    let port_attr = ctx
        .query_port(cfg.port)
        .map_err(|e| dev_err("querying the port", e))?;
    let dev_attr = ctx
        .query_device()
        .map_err(|e| dev_err("querying the device", e))?;
    let gid_index = match cfg.gid_index {
        Some(i) => i,
        None => {
            let table = ctx
                .query_gid_table()
                .map_err(|e| dev_err("reading the GID table", e))?;
            let ours =
                |e: &&sideway::ibverbs::address::GidEntry| e.port_num() == u32::from(cfg.port);
            let v4 = table.iter().filter(ours).find(|e| {
                e.gid_type() == GidType::RoceV2
                    && Ipv6Addr::from(e.gid()).to_ipv4_mapped().is_some()
            });
            let any = table
                .iter()
                .filter(ours)
                .find(|e| !e.gid().is_unicast_link_local());
            let e = v4
                .or(any)
                .or_else(|| table.iter().find(ours))
                .ok_or("no GID on this port (no IP address?)")?;
            u8::try_from(e.gid_index()).map_err(|_| "GID index above 255".to_owned())?
        }
    };
    let gid = ctx
        .query_gid(cfg.port, u32::from(gid_index))
        .map_err(|e| dev_err("querying the GID", e))?;
    let rd_atom = dev_attr.max_qp_rd_atom().clamp(1, 16) as u8;
    Ok(Nic {
        pd,
        port: cfg.port,
        gid,
        gid_index,
        lid: port_attr.lid(),
        mtu: port_attr.active_mtu(),
        rd_atom,
        ctx,
    })
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Endpoint {
    pub(super) qpn: u32,
    pub(super) psn: u32,
    pub(super) lid: u16,
    pub(super) gid: [u8; 16],
}

impl Endpoint {
    pub(super) const LEN: usize = 28;

    pub(super) fn to_bytes(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[12..28].copy_from_slice(&self.gid);
        b
    }

    pub(super) fn from_bytes(b: &[u8]) -> Self {
        Self {
            qpn: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            psn: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            lid: u16::from_le_bytes(b[8..10].try_into().expect("2 bytes")),
            gid: b[12..28].try_into().expect("16 bytes"),
        }
    }
}

/// A new RC queue pair in RESET, its endpoint, and its PSN.
pub(super) fn create_qp(
    nic: &Nic,
    cq: &Arc<BasicCompletionQueue>,
    max_wr: u32,
) -> Result<(BasicQueuePair, Endpoint), String> {
    let mut b = nic.pd.create_qp_builder();
    b.setup_max_send_wr(max_wr)
        .setup_max_recv_wr(1)
        .setup_max_send_sge(1)
        .setup_max_recv_sge(1)
        .setup_max_inline_data(0)
        .setup_send_cq(GenericCompletionQueue::from(Arc::clone(cq)))
        .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(cq)));
    let qp = b.build().map_err(|e| dev_err("creating a queue pair", e))?;
    let ep = Endpoint {
        qpn: qp.qp_number(),
        psn: fastrand::u32(..) & 0x00ff_ffff,
        lid: nic.lid,
        gid: Ipv6Addr::from(nic.gid).octets(),
    };
    Ok((qp, ep))
}

/// Moves `qp` through INIT, RTR and RTS towards `remote`.
pub(super) fn connect_qp(
    qp: &mut BasicQueuePair,
    nic: &Nic,
    local: Endpoint,
    remote: Endpoint,
    cfg: &VerbsConfig,
    remote_read: bool,
) -> Result<(), String> {
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(nic.port)
        .setup_access_flags(if remote_read {
            AccessFlags::RemoteRead
        } else {
            AccessFlags::none()
        });
    qp.modify(&a)
        .map_err(|e| dev_err("queue pair to INIT", e))?;

    let mut av = AddressHandleAttribute::new();
    av.setup_dest_lid(remote.lid)
        .setup_port(nic.port)
        .setup_service_level(0)
        .setup_grh_src_gid_index(nic.gid_index)
        .setup_grh_dest_gid(&Gid::from(Ipv6Addr::from(remote.gid)))
        .setup_grh_hop_limit(64);
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(nic.mtu)
        .setup_dest_qp_num(remote.qpn)
        .setup_rq_psn(remote.psn)
        .setup_max_dest_read_atomic(nic.rd_atom)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&av);
    qp.modify(&a).map_err(|e| dev_err("queue pair to RTR", e))?;

    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(local.psn)
        .setup_timeout(cfg.ack_timeout)
        .setup_retry_cnt(cfg.retry_count.min(7))
        .setup_rnr_retry(7)
        .setup_max_read_atomic(nic.rd_atom);
    qp.modify(&a).map_err(|e| dev_err("queue pair to RTS", e))?;
    Ok(())
}
