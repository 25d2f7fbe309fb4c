//! The calls nodes and operators make on the cluster: register, heartbeat,
//! leave, lease expiry, drain and undrain, the policy, and the listings;
//! with the checks of what they send.

use super::*;

fn validate_node_id(id: &str) -> Result<(), CoordError> {
    if id.is_empty() || id.len() > 128 {
        return Err(CoordError::InvalidArgument(
            "node_id must be 1 to 128 bytes".into(),
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(CoordError::InvalidArgument(format!(
            "node_id {} may only hold letters, digits, '.', '_' and '-'",
            quoted(id)
        )));
    }
    Ok(())
}

/// A free-form string field of a request: at most `max` bytes.
fn validate_len(field: &str, value: &str, max: usize) -> Result<(), CoordError> {
    if value.len() > max {
        return Err(CoordError::InvalidArgument(format!(
            "{field} is {} bytes, at most {max} are allowed: {}",
            value.len(),
            quoted(value)
        )));
    }
    Ok(())
}

fn validate_address(field: &str, addr: &str, required: bool) -> Result<(), CoordError> {
    if addr.is_empty() {
        return if required {
            Err(CoordError::InvalidArgument(format!("{field} is required")))
        } else {
            Ok(())
        };
    }
    let ok = addr.len() <= 256
        && addr.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
        });
    if ok {
        Ok(())
    } else {
        Err(CoordError::InvalidArgument(format!(
            "{field} {} is not host:port",
            quoted(addr)
        )))
    }
}

impl ClusterState {
    pub(crate) fn register(
        &mut self,
        req: RegisterRequest,
    ) -> Result<RegisterResponse, CoordError> {
        validate_node_id(&req.node_id)?;
        validate_address("grpc_address", &req.grpc_address, true)?;
        validate_address("metrics_address", &req.metrics_address, false)?;
        if req.capacity_bytes == 0 {
            return Err(CoordError::InvalidArgument(
                "capacity_bytes must be > 0".into(),
            ));
        }
        if req.page_size != self.params.page_size {
            return Err(CoordError::PageSizeMismatch {
                cluster: self.params.page_size,
                node: req.page_size,
            });
        }
        if req.file_size == 0 {
            return Err(CoordError::InvalidArgument(
                "file_size must be > 0 (the node's backing file is empty?)".into(),
            ));
        }
        if req.transports.len() > 64 {
            return Err(CoordError::InvalidArgument(
                "at most 64 transport descriptors".into(),
            ));
        }
        for t in &req.transports {
            validate_len("transport kind", &t.kind, 64)?;
            validate_len("transport endpoint", &t.endpoint, 1024)?;
            if t.opaque.len() > 4096 {
                return Err(CoordError::InvalidArgument(
                    "a transport's opaque field is limited to 4096 bytes".into(),
                ));
            }
        }
        if let Some(t) = &req.topology {
            if t.numa_nodes.len() > 4096 {
                return Err(CoordError::InvalidArgument(
                    "at most 4096 NUMA nodes".into(),
                ));
            }
            if t.numa_nodes.iter().map(|n| n.cpus.len()).sum::<usize>() > 1 << 20 {
                return Err(CoordError::InvalidArgument("at most 1 Mi CPUs".into()));
            }
            validate_len("topology source", &t.source, 64)?;
            validate_len("topology hostname", &t.hostname, 256)?;
        }
        self.check_identity(&req, Instant::now())?;
        self.transact(|c| c.admit(req))
    }

    /// The rest of [`ClusterState::register`], once the request is valid: may
    /// change members before it fails (see [`ClusterState::transact`]).
    fn admit(&mut self, req: RegisterRequest) -> Result<RegisterResponse, CoordError> {
        if self.file_size == 0 {
            if req.file_size.div_ceil(self.params.extent_size) > 1 << 24 {
                return Err(CoordError::InvalidArgument(
                    "file too large for the extent size: more than 16 Mi extents".into(),
                ));
            }
            tracing::info!(file_size = req.file_size, node = %req.node_id, "cluster file size set by first node");
            self.file_size = req.file_size;
        } else if req.file_size != self.file_size {
            return Err(CoordError::FileSizeMismatch {
                cluster: self.file_size,
                node: req.file_size,
            });
        }

        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let now = Instant::now();
        let lease = self.params.lease;
        let next_index = &mut self.next_index;
        let m = self.members.entry(req.node_id.clone()).or_insert_with(|| {
            let index = *next_index;
            *next_index += 1;
            Member {
                info: NodeInfo {
                    node_id: req.node_id.clone(),
                    index,
                    ..Default::default()
                },
                lease_deadline: None,
            }
        });
        // A restarted node keeps an operator's drain, not the one its
        // previous process started for its own shutdown (which a kill in
        // the middle of it would otherwise leave behind for good).
        let state = match m.info.state() {
            s @ (NodeState::Draining | NodeState::Drained) if m.info.drain_incarnation == 0 => s,
            _ => NodeState::Alive,
        };
        m.info.drain_incarnation = 0;
        m.info.grpc_address = req.grpc_address;
        m.info.metrics_address = req.metrics_address;
        m.info.capacity_bytes = req.capacity_bytes;
        m.info.topology = req.topology;
        m.info.transports = req.transports;
        m.info.set_state(state);
        m.info.incarnation = incarnation;
        m.info.applied_epoch = 0;
        m.lease_deadline = Some(now + lease);
        let index = m.info.index;
        let compact_map = req.compact_map;
        tracing::info!(node = %req.node_id, index, incarnation, "node registered");
        self.metrics.registrations.inc();
        if !self.rebalance("node registered")? {
            // Even with the same map, the registration must be durable.
            self.save()?;
        }
        Ok(RegisterResponse {
            node_index: index,
            incarnation,
            lease_ms: self.lease_ms(),
            heartbeat_interval_ms: self.heartbeat_interval_ms(),
            map: Some(if compact_map {
                let compact = self.compact_map();
                OwnershipMap {
                    epoch: compact.epoch,
                    compact: Some((*compact).clone()),
                    ..Default::default()
                }
            } else {
                (*self.map()).clone()
            }),
            policy: Some(self.policy),
        })
    }

    /// Refuses a registration that would take `req.node_id` from another
    /// live process, or bring back an incarnation that left.
    ///
    /// The restart rule: a registration for an id whose lease another
    /// incarnation holds is accepted only from that incarnation itself (it
    /// sends it as `previous_incarnation` after losing its own lease) or at
    /// the same `grpc_address` (two live processes cannot listen on one
    /// address, so that is a restart in place). A process restarted at
    /// another address is refused until the old lease runs out, at most one
    /// lease; the node waits that long once and registers again.
    fn check_identity(&self, req: &RegisterRequest, now: Instant) -> Result<(), CoordError> {
        let Some(m) = self.members.get(&req.node_id) else {
            return Ok(());
        };
        let same_incarnation =
            req.previous_incarnation != 0 && req.previous_incarnation == m.info.incarnation;
        if same_incarnation && m.info.state() == NodeState::Left {
            return Err(CoordError::Left {
                node_id: req.node_id.clone(),
                incarnation: m.info.incarnation,
            });
        }
        let remaining = m
            .lease_deadline
            .filter(|_| holds_lease(m.info.state()))
            .map(|d| d.saturating_duration_since(now))
            .filter(|r| !r.is_zero());
        match remaining {
            Some(r) if !same_incarnation && m.info.grpc_address != req.grpc_address => {
                Err(CoordError::NodeIdInUse {
                    node_id: req.node_id.clone(),
                    address: m.info.grpc_address.clone(),
                    incarnation: m.info.incarnation,
                    lease_remaining_ms: u64::try_from(r.as_millis()).unwrap_or(u64::MAX).max(1),
                })
            }
            _ => Ok(()),
        }
    }

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.params.lease.as_millis()).unwrap_or(u64::MAX)
    }

    fn heartbeat_interval_ms(&self) -> u64 {
        u64::try_from(self.params.heartbeat_interval.as_millis()).unwrap_or(u64::MAX)
    }

    fn member_checked(
        &mut self,
        node_id: &str,
        incarnation: u64,
    ) -> Result<&mut Member, CoordError> {
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        if m.info.incarnation != incarnation {
            return Err(CoordError::StaleIncarnation {
                node_id: node_id.to_owned(),
            });
        }
        if !holds_lease(m.info.state()) {
            return Err(CoordError::NotAlive {
                node_id: node_id.to_owned(),
                state: state_name(m.info.state()),
            });
        }
        Ok(m)
    }

    pub(crate) fn heartbeat(
        &mut self,
        req: HeartbeatRequest,
    ) -> Result<HeartbeatResponse, CoordError> {
        validate_node_id(&req.node_id)?;
        let lease = self.params.lease;
        let epoch = self.epoch;
        let m = self.member_checked(&req.node_id, req.incarnation)?;
        m.lease_deadline = Some(Instant::now() + lease);
        m.info.applied_epoch = req.applied_epoch.min(epoch);
        if let Some(stats) = req.stats {
            m.info.stats = Some(stats);
        }
        self.metrics.heartbeats.inc();
        self.maybe_finish_handoff()?;
        Ok(HeartbeatResponse {
            lease_ms: self.lease_ms(),
            map_epoch: self.epoch,
            policy: Some(self.policy),
        })
    }

    /// Whether a heartbeat may save now: only one that completes a
    /// handoff does ([`ClusterState::maybe_finish_handoff`]).
    pub(crate) fn heartbeat_may_save(&self) -> bool {
        !self.previous.is_empty()
    }

    pub(crate) fn leave(&mut self, node_id: &str, incarnation: u64) -> Result<u64, CoordError> {
        validate_node_id(node_id)?;
        self.transact(|c| {
            let m = c.member_checked(node_id, incarnation)?;
            m.info.set_state(NodeState::Left);
            m.lease_deadline = None;
            tracing::info!(node = %node_id, "node left");
            c.rebalance("node left")?;
            Ok(c.epoch)
        })
    }

    /// Declares dead every node whose lease ran out; returns their ids.
    /// When the new map cannot be saved nobody is declared dead: the next
    /// call finds the same expired leases and tries again.
    pub(crate) fn expire_leases(&mut self, now: Instant) -> Result<Vec<String>, CoordError> {
        let expired = |m: &Member| m.lease_deadline.is_some_and(|d| d <= now);
        if !self.members.values().any(expired) {
            return Ok(Vec::new());
        }
        self.transact(|c| {
            let mut dead = Vec::new();
            for m in c.members.values_mut() {
                if expired(m) {
                    m.lease_deadline = None;
                    m.info.set_state(NodeState::Dead);
                    m.info.applied_epoch = 0;
                    dead.push(m.info.node_id.clone());
                }
            }
            c.rebalance("lease expired")?;
            for id in &dead {
                tracing::warn!(node = %id, lease_ms = c.lease_ms(), "node missed its lease: declared dead");
                c.metrics.deaths.inc();
            }
            Ok(dead)
        })
    }

    /// Starts moving every extent off `node_id`. Returns the new epoch and
    /// how many extents the node owned.
    /// Refused when no other alive node would be left to take its extents.
    /// `incarnation` 0: an operator's drain, kept across the node's
    /// restarts; else the node's own shutdown drain, which only that
    /// incarnation may ask for and which ends when another registers.
    pub(crate) fn drain(
        &mut self,
        node_id: &str,
        incarnation: u64,
    ) -> Result<(u64, u64), CoordError> {
        self.transact(|c| c.start_drain(node_id, incarnation))
    }

    /// [`ClusterState::drain`], which puts back what this changed if it fails.
    fn start_drain(&mut self, node_id: &str, incarnation: u64) -> Result<(u64, u64), CoordError> {
        validate_node_id(node_id)?;
        if incarnation != 0 {
            self.member_checked(node_id, incarnation)?;
        }
        let others_alive = self
            .members
            .values()
            .any(|m| m.info.node_id != node_id && m.info.state() == NodeState::Alive);
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        let index = m.info.index;
        match m.info.state() {
            NodeState::Alive if !others_alive => {
                return Err(CoordError::NoNodeLeft {
                    node_id: node_id.to_owned(),
                    extents: self.owner.iter().filter(|&&o| o == index).count() as u64,
                });
            }
            NodeState::Alive => {
                m.info.set_state(NodeState::Draining);
                m.info.drain_incarnation = incarnation;
            }
            NodeState::Draining | NodeState::Drained => {
                if incarnation == 0 {
                    // The operator's now: it outlives the process.
                    m.info.drain_incarnation = 0;
                }
            }
            s => {
                return Err(CoordError::NotAlive {
                    node_id: node_id.to_owned(),
                    state: state_name(s),
                });
            }
        }
        let owned = self.owner.iter().filter(|&&o| o == index).count() as u64;
        tracing::info!(node = %node_id, extents = owned, "draining node");
        if !self.rebalance("drain")? {
            self.settle_drains();
            self.save()?;
        }
        Ok((self.epoch, owned))
    }

    pub(crate) fn undrain(&mut self, node_id: &str) -> Result<u64, CoordError> {
        self.transact(|c| c.end_drain(node_id))
    }

    /// [`ClusterState::undrain`], which puts back what this changed if it fails.
    fn end_drain(&mut self, node_id: &str) -> Result<u64, CoordError> {
        validate_node_id(node_id)?;
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        m.info.drain_incarnation = 0;
        match m.info.state() {
            NodeState::Draining | NodeState::Drained => m.info.set_state(NodeState::Alive),
            NodeState::Alive => {}
            s => {
                return Err(CoordError::NotAlive {
                    node_id: node_id.to_owned(),
                    state: state_name(s),
                });
            }
        }
        if !self.rebalance("undrain")? {
            self.save()?;
        }
        Ok(self.epoch)
    }

    pub(crate) fn set_policy(&mut self, mut p: Policy) -> Result<Policy, CoordError> {
        crate::config::validate_policy(&p).map_err(CoordError::InvalidArgument)?;
        pagewire_proto::policy::check_implemented(&p).map_err(CoordError::Unimplemented)?;
        p.version = self.policy.version + 1;
        let old = std::mem::replace(&mut self.policy, p);
        if let Err(e) = self.save() {
            self.policy = old;
            return Err(e);
        }
        tracing::info!(
            version = p.version,
            admission = pagewire_proto::policy::admission_name(p.admission()),
            eviction = pagewire_proto::policy::eviction_name(p.eviction()),
            high = p.high_watermark_percent,
            low = p.low_watermark_percent,
            "policy changed"
        );
        Ok(p)
    }

    pub(crate) fn nodes(&self) -> Vec<NodeInfo> {
        let now = Instant::now();
        let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
        for &o in &self.owner {
            *counts.entry(o).or_default() += 1;
        }
        let mut out: Vec<NodeInfo> = self
            .members
            .values()
            .map(|m| {
                let mut info = m.info.clone();
                info.lease_remaining_ms = m
                    .lease_deadline
                    .map(|d| {
                        u64::try_from(d.saturating_duration_since(now).as_millis()).unwrap_or(0)
                    })
                    .unwrap_or(0);
                info.extents_owned = counts.get(&info.index).copied().unwrap_or(0);
                info
            })
            .collect();
        out.sort_by_key(|n| n.index);
        out
    }

    /// The status of the state as it is now (saved or not: see
    /// [`StatusView`]).
    pub(super) fn status(&self) -> StatusResponse {
        let alive = self
            .members
            .values()
            .filter(|m| holds_lease(m.info.state()))
            .count();
        StatusResponse {
            cluster_name: self.params.cluster_name.clone(),
            epoch: self.epoch,
            file_size: self.file_size,
            extent_size: self.params.extent_size,
            page_size: self.params.page_size,
            extent_count: self.extent_count(),
            nodes_alive: u32::try_from(alive).unwrap_or(u32::MAX),
            nodes_total: u32::try_from(self.members.len()).unwrap_or(u32::MAX),
            extents_unowned: self
                .extent_count()
                .saturating_sub(self.owner.iter().filter(|&&o| o != 0).count() as u64),
            extents_in_handoff: self.previous.iter().filter(|&&p| p != 0).count() as u64,
            lease_ms: self.lease_ms(),
            policy: Some(self.policy),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Default::default()
        }
    }
}
