//! Restoring the cluster from the store: the state file at start, or a
//! state etcd holds (a follower, a new leader), with the conversion of the
//! state file's format 1 (the expanded map) to format 2.

use super::*;

impl ClusterState {
    /// Loads the state file (or starts empty) and checks it against `params`.
    pub(crate) fn open(
        params: Params,
        config_file_size: u64,
        config_policy: Policy,
        metrics: Arc<Metrics>,
    ) -> Result<Self, crate::StartError> {
        let file = FileStore {
            path: params.state_file.clone(),
        };
        let loaded = file.load()?;
        let what = format!("state file {}", params.state_file.display());
        let mut c = Self::new(
            params,
            config_file_size,
            config_policy,
            metrics,
            Arc::new(file),
        );
        if let Some(st) = loaded {
            c.load_state(st, &what)?;
        }
        Ok(c)
    }

    /// Replaces everything with `st` (read from the store; `what` names it
    /// in errors) and publishes its map. Every member that held a lease gets
    /// a fresh one: it had no chance to heartbeat to this coordinator (a
    /// restart, or a follower taking over the leadership).
    pub(crate) fn load_state(
        &mut self,
        st: PersistedState,
        what: &str,
    ) -> Result<(), crate::StartError> {
        let config_file_size = self.config_file_size;
        self.policy = self.config_policy;
        self.members.clear();
        self.handoff_nodes = None;
        // Format 2 files hold the compact map, format 1 files the
        // expanded one (converted here; the next save writes format 2).
        let compact = st.compact.clone();
        let map = match &compact {
            Some(cm) => Expander::default()
                .expand(cm)
                .map_err(|e| crate::StartError::StateMismatch(format!("{}: {e}", what)))?,
            None => st.map.clone().unwrap_or_default(),
        };
        if map.extent_size != self.params.extent_size || map.page_size != self.params.page_size {
            return Err(crate::StartError::StateMismatch(format!(
                "{} was written with extent_size {} and page_size {}, the config \
                 says {} and {}; keep the old values or start with a new state",
                what,
                map.extent_size,
                map.page_size,
                self.params.extent_size,
                self.params.page_size
            )));
        }
        if config_file_size != 0 && map.file_size != 0 && map.file_size != config_file_size {
            return Err(crate::StartError::StateMismatch(format!(
                "{} is for a {} byte file, the config says {}",
                what, map.file_size, config_file_size
            )));
        }
        self.file_size = map.file_size.max(config_file_size);
        self.epoch = map.epoch;
        self.owner = map.owner;
        self.previous = map.previous_owner;
        // The release epochs are not saved: count them from now, which
        // only keeps an entry longer.
        self.released_epoch = vec![map.epoch; map.released_by.len()];
        self.released = map.released_by;
        self.desc = match &compact {
            Some(cm) => MapDesc::of(cm)
                .map_err(|e| crate::StartError::StateMismatch(format!("{}: {e}", what)))?,
            None => {
                // No history: the owner set from the members, the rest
                // as overrides until the handoff and releases pass.
                let owner_set = st
                    .members
                    .iter()
                    .filter(|m| m.state() == NodeState::Alive)
                    .map(|m| (m.index, m.capacity_bytes))
                    .collect::<BTreeMap<_, _>>()
                    .into_iter()
                    .collect();
                MapDesc {
                    sets: BTreeMap::from([(self.epoch, owner_set)]),
                    owner_set: self.epoch,
                    ..MapDesc::default()
                }
            }
        };
        if let Some(p) = st.policy {
            // A policy saved by an older coordinator may name what the
            // nodes do not implement: the config's replaces it, with a
            // higher version so nodes that applied the old one switch.
            match pagewire_proto::policy::check_implemented(&p) {
                Ok(()) => self.policy = p,
                Err(why) => {
                    tracing::warn!(saved_version = p.version, %why, "saved policy refused; using the config's");
                    self.policy.version = p.version + 1;
                }
            }
        }
        self.next_index = st.next_index.max(1);
        self.next_incarnation = st.next_incarnation.max(1);
        let now = Instant::now();
        for info in st.members {
            // Every member that held a lease gets a fresh one: it had no
            // chance to heartbeat while the coordinator was down.
            let lease_deadline = holds_lease(info.state()).then(|| now + self.params.lease);
            self.members.insert(
                info.node_id.clone(),
                Member {
                    info,
                    lease_deadline,
                },
            );
        }
        tracing::info!(
            epoch = self.epoch,
            members = self.members.len(),
            from = %what,
            "state restored"
        );
        self.compact = Arc::new(self.encode());
        // A state saved without a new epoch (a registration, a policy) may
        // carry the same map: watchers get a map once.
        if *self.map() != self.build_map() {
            self.publish_current();
        }
        self.refresh_status();
        Ok(())
    }
}
