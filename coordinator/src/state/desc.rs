//! The compact map's description ([`MapDesc`]): how the map's arrays came
//! about, kept in O(members) terms, and its encoding as the `CompactMap`
//! every commit stores and streams ("The compact map" in [`super`]).

use super::*;

impl MapDesc {
    /// No owner yet: the empty set as owner set (id `epoch`).
    pub(super) fn empty(epoch: u64) -> Self {
        MapDesc {
            sets: BTreeMap::from([(epoch, Vec::new())]),
            owner_set: epoch,
            ..MapDesc::default()
        }
    }

    /// The description a compact map carries (release epochs: its epoch,
    /// as for the arrays restored with it).
    pub(super) fn of(cm: &CompactMap) -> Result<Self, cmap::MapError> {
        let layer = |l: &Layer| LayerDesc {
            set: l.set,
            except: l
                .except
                .iter()
                .enumerate()
                .map(|(k, &v)| (v, l.resume.get(k).map_or(0, |&r| r as usize)))
                .collect(),
        };
        Ok(MapDesc {
            sets: cmap::resolve(cm)?,
            owner_set: cm.owner_set,
            handoff: cm.handoff.iter().map(layer).collect(),
            groups: cm
                .releases
                .iter()
                .map(|g| GroupDesc {
                    layers: g.layers.iter().map(layer).collect(),
                    except: g.except.iter().copied().collect(),
                    dropped_by: g.dropped_by.clone(),
                    at: cm.epoch,
                    gave: None,
                })
                .collect(),
        })
    }

    /// The compact map of this description, without overrides.
    fn to_proto(&self, nodes: Vec<MapNode>, epoch: u64, file_size: u64, p: &Params) -> CompactMap {
        let base = cmap::base_set(&nodes);
        let layer = |l: &LayerDesc| Layer {
            set: l.set,
            except: l.except.keys().copied().collect(),
            resume: l
                .except
                .values()
                .map(|&r| u32::try_from(r).unwrap_or(u32::MAX))
                .collect(),
        };
        CompactMap {
            base_epoch: 0,
            epoch,
            file_size,
            extent_size: p.extent_size,
            page_size: p.page_size,
            nodes,
            sets: self
                .sets
                .iter()
                .map(|(&id, s)| cmap::relative(id, s, &base))
                .collect(),
            owner_set: self.owner_set,
            handoff: self.handoff.iter().map(layer).collect(),
            releases: self
                .groups
                .iter()
                .map(|g| ReleaseGroup {
                    layers: g.layers.iter().map(layer).collect(),
                    except: g.except.iter().copied().collect(),
                    dropped_by: g.dropped_by.clone(),
                    released_at: g.at,
                })
                .collect(),
            overrides: None,
        }
    }
}

impl ClusterState {
    /// The compact map of the current state: the description, with its
    /// unused layers, groups and sets dropped, plus overrides wherever its
    /// expansion differs from the arrays.
    pub(super) fn encode(&mut self) -> CompactMap {
        let cm = self
            .desc
            .to_proto(self.map_nodes(), self.epoch, self.file_size, &self.params);
        let arrays = match self.expander.arrays(&cm) {
            Ok(a) => a,
            Err(e) => {
                // Cannot happen (every set the description names is in it);
                // start over from an empty owner set, with the arrays as
                // overrides: still exact.
                tracing::error!(error = %e, "map description unusable; sending overrides");
                self.desc = MapDesc::empty(self.epoch);
                let mut cm =
                    self.desc
                        .to_proto(self.map_nodes(), self.epoch, self.file_size, &self.params);
                let n = self.owner.len();
                let (owner_extent, owner_node) = cmap::sparse_diff(&self.owner, &[], n);
                let (previous_extent, previous_node) = cmap::sparse_diff(&self.previous, &[], n);
                let (released_extent, released_node) = cmap::sparse_diff(&self.released, &[], n);
                cm.overrides = Some(SparseOverrides {
                    owner_extent,
                    owner_node,
                    previous_extent,
                    previous_node,
                    released_extent,
                    released_node,
                });
                return cm;
            }
        };
        // Drop the release groups that give no value: that changes none.
        // (Layers stay: a resume names its target by position.)
        let d = &mut self.desc;
        for (g, gave) in d.groups.iter_mut().zip(&arrays.group_values) {
            g.gave = Some(gave.clone());
        }
        let mut g = 0;
        d.groups.retain(|_| {
            g += 1;
            arrays.group_hits[g - 1] > 0
        });
        let used: BTreeSet<u64> = std::iter::once(d.owner_set)
            .chain(d.handoff.iter().map(|l| l.set))
            .chain(d.groups.iter().flat_map(|g| g.layers.iter().map(|l| l.set)))
            .chain(d.groups.iter().flat_map(|g| g.dropped_by.iter().copied()))
            .collect();
        d.sets.retain(|id, _| used.contains(id));
        let mut cm = self
            .desc
            .to_proto(self.map_nodes(), self.epoch, self.file_size, &self.params);
        // `cm` has no overrides: the arrays expanded are the rules' values.
        let n = self.owner.len();
        let (owner_extent, owner_node) = cmap::sparse_diff(&self.owner, &arrays.owner, n);
        let (previous_extent, previous_node) =
            cmap::sparse_diff(&self.previous, &arrays.previous, n);
        let (released_extent, released_node) =
            cmap::sparse_diff(&self.released, &arrays.released, n);
        let o = SparseOverrides {
            owner_extent,
            owner_node,
            previous_extent,
            previous_node,
            released_extent,
            released_node,
        };
        cm.overrides = (cmap::override_count(Some(&o)) > 0).then_some(o);
        cm
    }

    /// The description after a commit installing `previous` (non-empty only
    /// from a rebalance) with the owner set `next_set` (None: unchanged).
    pub(super) fn next_desc(&self, previous: &[u32], next_set: Option<Set>) -> MapDesc {
        let serving: BTreeSet<u32> = self
            .members
            .values()
            .filter(|m| holds_lease(m.info.state()))
            .map(|m| m.info.index)
            .collect();
        let applied: BTreeMap<u32, u64> = self
            .members
            .values()
            .map(|m| (m.info.index, m.info.applied_epoch))
            .collect();
        let old = &self.desc;
        let mut d = MapDesc {
            sets: old.sets.clone(),
            owner_set: old.owner_set,
            handoff: Vec::new(),
            groups: Vec::new(),
        };
        let not_serving = |set: u64| -> Vec<u32> {
            old.sets
                .get(&set)
                .into_iter()
                .flatten()
                .map(|&(i, _)| i)
                .filter(|i| !serving.contains(i))
                .collect()
        };
        if let Some(s) = next_set
            && old.sets.get(&old.owner_set) != Some(&s)
        {
            d.owner_set = self.epoch + 1;
            d.sets.insert(d.owner_set, s);
        }
        if !previous.is_empty() {
            // The server of each extent: the one serving since the handoff
            // began; where it stopped serving at a rebalance, the owner
            // before that rebalance (the layer added then) takes over.
            if !self.previous.is_empty() {
                let at = old.handoff.len();
                d.handoff = old.handoff.clone();
                for l in &mut d.handoff {
                    for v in not_serving(l.set) {
                        l.except.entry(v).or_insert(at);
                    }
                }
            }
            let next = d.handoff.len() + 1;
            d.handoff.push(LayerDesc {
                set: old.owner_set,
                except: not_serving(old.owner_set)
                    .into_iter()
                    .map(|v| (v, next))
                    .collect(),
            });
        }
        // What this commit releases: each extent's server at the current
        // epoch (its previous owner, else its owner).
        let mut layers = if self.previous.is_empty() {
            Vec::new()
        } else {
            old.handoff.clone()
        };
        layers.push(LayerDesc {
            set: old.owner_set,
            except: BTreeMap::new(),
        });
        d.groups.push(GroupDesc {
            layers,
            except: BTreeSet::new(),
            dropped_by: vec![d.owner_set],
            at: self.epoch + 1,
            gave: None,
        });
        // Older releases stay while their node holds a lease and has not
        // applied the epoch that released them.
        for g in &old.groups {
            let mut g = g.clone();
            let named: BTreeSet<u32> = match &g.gave {
                Some(gave) => gave.clone(),
                None => g
                    .layers
                    .iter()
                    .flat_map(|l| old.sets.get(&l.set).into_iter().flatten().map(|&(i, _)| i))
                    .collect(),
            };
            for i in named {
                if !serving.contains(&i) || applied.get(&i).is_some_and(|&a| a >= g.at) {
                    g.except.insert(i);
                }
            }
            if !g.dropped_by.contains(&d.owner_set) {
                g.dropped_by.push(d.owner_set);
            }
            d.groups.push(g);
        }
        d
    }
}
