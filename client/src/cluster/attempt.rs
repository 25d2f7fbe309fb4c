//! One attempt of a read, by path (one-sided with the `FaultIn` fallback,
//! or the gRPC `Read`), one RPC to a node, and the loop that retries
//! attempts until a deadline: each failure is classified into a [`Step`]
//! as the module doc's "Fallback and failover" table says.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pagewire_proto::v1::{MapNode, PageRun, ReadRequest};

use super::follower::Snapshot;
use super::owner::{self, NodeRpc};
use super::routing::{reader_of, same_reader};
use super::{ClientError, ClusterClient, ReadInfo, Via, bump, lock};
use crate::pool::{PoolError, RunOptions};

/// What to do after an attempt that did not succeed.
pub(super) enum Step {
    /// Wait for a poll (bounded), then retry.
    Refresh(String),
    /// The map is past its trust window: wait for a poll, then retry.
    LeaseExpired(String),
    /// Ask for a poll, back off, retry.
    Backoff(String),
    /// Give up now.
    Fatal(ClientError),
}

impl Step {
    /// What to do about a node's own refusal (`code`, from
    /// [`owner::refusal`]) of a call for `page`: `FailedPrecondition` (not
    /// the owner, map moved on) refreshes the map; `Unavailable`,
    /// `ResourceExhausted` and `Aborted` (fenced, moving, no frame, lease
    /// expired) back off and retry; anything else (a bad token, a page past
    /// the end) is final.
    fn of_refusal(code: tonic::Code, why: String, node: &str, page: u64, message: &str) -> Self {
        use tonic::Code;
        match code {
            Code::FailedPrecondition => Step::Refresh(why),
            Code::Unavailable | Code::ResourceExhausted | Code::Aborted => Step::Backoff(why),
            code => Step::Fatal(ClientError::Rejected {
                node: node.to_owned(),
                page,
                code,
                message: message.to_owned(),
            }),
        }
    }
}

impl ClusterClient {
    /// Runs `attempt` until it succeeds, fails for good, or `deadline`
    /// passes (the module doc's table). Returns its value and the attempts.
    pub(super) fn retrying<T>(
        &self,
        page: u64,
        deadline: Instant,
        mut attempt: impl FnMut(&Snapshot, Duration) -> Result<T, Step>,
    ) -> Result<(T, u32), ClientError> {
        // The operation began when its caller set the deadline: `waited`
        // counts from there, so an operation that gave up at its deadline
        // never reports less than `op_deadline` (the instants between the
        // caller's clock read and this one used to be left out).
        let start = deadline
            .checked_sub(self.cfg.op_deadline)
            .unwrap_or_else(Instant::now);
        let c = self.counters();
        let mut attempts = 0u32;
        let mut backoff = self.cfg.backoff_min;
        let mut epoch = None;
        loop {
            attempts += 1;
            if attempts > 1 {
                bump(&c.retries, 1);
            }
            let (step, snap_epoch, was_trusted) = self.with_snapshot(|snap| {
                let now = Instant::now();
                let trusted = snap.trusted(crate::clock::now());
                let step = if trusted {
                    attempt(snap, deadline.saturating_duration_since(now))
                } else {
                    Err(Step::LeaseExpired(format!(
                        "the map (epoch {}) is past its trust window{}",
                        snap.map.epoch,
                        self.follower
                            .last_error()
                            .map(|e| format!(" and the coordinator does not answer ({e})"))
                            .unwrap_or_default()
                    )))
                };
                (step, snap.map.epoch, snap.trust_until)
            });
            let step = match step {
                Ok(v) => return Ok((v, attempts)),
                Err(s) => s,
            };
            let (why, refresh) = match step {
                Step::Fatal(e) => return Err(e),
                Step::LeaseExpired(why) => {
                    bump(&c.lease_waits, 1);
                    (why, true)
                }
                Step::Refresh(why) => (why, true),
                Step::Backoff(why) => (why, false),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bump(&c.unavailable, 1);
                return Err(ClientError::Unavailable {
                    page,
                    waited: start.elapsed(),
                    last: why,
                });
            }
            bump(&c.map_refreshes, 1);
            if epoch != Some(snap_epoch) {
                // A new map: its owners get a fresh series of backoffs.
                epoch = Some(snap_epoch);
                backoff = self.cfg.backoff_min;
            }
            let pause = if refresh {
                // A poll that started after this point; no sleep when it
                // brought a trusted, newer map.
                let trusted = self.follower.refresh(left);
                let now_epoch = self.follower.shared.snapshot().map.epoch;
                let still = was_trusted.is_some_and(|t| crate::clock::now() < t);
                if trusted && (now_epoch != snap_epoch || !still) {
                    Duration::ZERO
                } else {
                    backoff
                }
            } else {
                self.follower.refresh_soon();
                backoff
            };
            if !pause.is_zero() {
                let pause = pause.min(deadline.saturating_duration_since(Instant::now()));
                self.follower.shared.wait_epoch_change(snap_epoch, pause);
                backoff = (backoff * 2).min(self.cfg.backoff_max);
            }
        }
    }

    /// One one-sided attempt: READs of the answering node's region for the
    /// pages from `first` (up to `want`) that node answers, its `FaultIn`
    /// for those its index does not show. Returns how many pages it read.
    pub(super) fn one_sided(
        &self,
        snap: &Snapshot,
        first: u64,
        want: usize,
        out: &mut [u8],
        left: Duration,
    ) -> Result<(usize, Vec<ReadInfo>), Step> {
        let (index, node) = reader_of(&snap.map, first)?;
        let n = same_reader(&snap.map, first, want, index);
        let Some(trust) = snap.trust_until else {
            return Err(Step::LeaseExpired("the map has no trust window".into()));
        };
        let opts = RunOptions {
            trust_until: Some(trust),
            map_epoch: snap.map.epoch,
            deadline: Some(Instant::now() + left),
        };
        let ps = self.page_size;
        match self
            .pool
            .read_into(node, first, n, &mut out[..n * ps], &opts)
        {
            Ok(pages) => Ok((
                n,
                pages
                    .iter()
                    .map(|p| ReadInfo {
                        via: if p.fault_in {
                            Via::FaultIn
                        } else {
                            Via::OneSided
                        },
                        owner: index,
                        attempts: 1,
                        transport: Some(p.transport),
                        generation: p.generation(),
                        coalesced: false,
                        copy: p.copy,
                    })
                    .collect(),
            )),
            Err(e) => Err(match e {
                PoolError::LeaseExpired { .. } => Step::LeaseExpired(e.to_string()),
                PoolError::FaultIn {
                    refused: Some(code),
                    ref node,
                    page,
                    ref reason,
                } => Step::of_refusal(code, e.to_string(), node, page, reason),
                e => Step::Backoff(e.to_string()),
            }),
        }
    }

    /// One attempt over the answering node's `Read` RPC, for the pages from
    /// `first` (up to `want`) that node answers.
    pub(super) fn grpc_read(
        &self,
        snap: &Snapshot,
        first: u64,
        want: usize,
        out: &mut [u8],
        left: Duration,
    ) -> Result<(usize, Vec<ReadInfo>), Step> {
        let (index, node) = reader_of(&snap.map, first)?;
        let n = same_reader(&snap.map, first, want, index);
        let epoch = snap.map.epoch;
        let r = self.rpc(node, first, left, |mut c| async move {
            c.read(ReadRequest {
                run: Some(PageRun {
                    first_page: first,
                    page_count: n as u64,
                }),
                map_epoch: epoch,
            })
            .await
            .map(tonic::Response::into_inner)
        })?;
        let want_len: usize = (first..first + n as u64).map(|p| self.page_len(p)).sum();
        if r.data.len() != want_len || r.frame_generations.len() != n {
            return Err(Step::Backoff(format!(
                "node {}'s Read returned {} bytes and {} generations for pages {first}..+{n}, not {want_len} and {n}",
                node.node_id,
                r.data.len(),
                r.frame_generations.len()
            )));
        }
        let ps = self.page_size;
        let mut off = 0;
        let mut infos = Vec::with_capacity(n);
        for (k, &generation) in r.frame_generations.iter().enumerate() {
            let len = self.page_len(first + k as u64);
            let dst = &mut out[k * ps..(k + 1) * ps];
            dst[..len].copy_from_slice(&r.data[off..off + len]);
            dst[len..].fill(0);
            off += len;
            infos.push(ReadInfo {
                via: Via::Grpc,
                owner: index,
                attempts: 1,
                transport: None,
                generation,
                coalesced: false,
                copy: None,
            });
        }
        Ok((n, infos))
    }

    /// One RPC to `node`, within `rpc_timeout` (and `left`); classifies a
    /// failure as the module doc's table says.
    pub(super) fn rpc<T, F, Fut>(
        &self,
        node: &MapNode,
        page: u64,
        left: Duration,
        call: F,
    ) -> Result<T, Step>
    where
        F: FnOnce(NodeRpc) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let limit = self.cfg.rpc_timeout.min(left).max(Duration::from_millis(1));
        let addr = &node.grpc_address;
        let cached = lock(&self.channels).get(addr).cloned();
        let client = match cached {
            Some(c) => c,
            None => {
                let connect = self.cfg.connect_timeout.min(limit);
                let c = self
                    .rt
                    .block_on(owner::node_client(
                        addr,
                        &self.attach,
                        self.cfg.tls.as_ref(),
                        connect,
                    ))
                    .map_err(|why| {
                        Step::Backoff(format!(
                            "cannot connect to node {} at {addr}: {why}",
                            node.node_id
                        ))
                    })?;
                if !lock(&self.seen_channels).insert(addr.clone()) {
                    self.channel_reconnects.fetch_add(1, Ordering::Relaxed);
                }
                lock(&self.channels).insert(addr.clone(), c.clone());
                c
            }
        };
        // The timer is made inside the runtime (it needs its time driver).
        let fut = call(client);
        match self
            .rt
            .block_on(async move { tokio::time::timeout(limit, fut).await })
        {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(s)) => {
                let why = format!("node {}: {:?}: {}", node.node_id, s.code(), s.message());
                match owner::refusal(&s) {
                    // The node's own refusal (moving, fenced, lease
                    // expired, no frame, ...): the channel is fine.
                    Some(code) => Err(Step::of_refusal(
                        code,
                        why,
                        &node.node_id,
                        page,
                        s.message(),
                    )),
                    None => {
                        lock(&self.channels).remove(addr);
                        Err(Step::Backoff(why))
                    }
                }
            }
            Err(_) => {
                lock(&self.channels).remove(addr);
                Err(Step::Backoff(format!(
                    "node {} did not answer within {limit:?}",
                    node.node_id
                )))
            }
        }
    }
}
