//! The coordinators pwctl talks to: `--coordinator a:7400,b:7400,c:7400`
//! (or `PAGEWIRE_COORDINATOR`), with the failover rule every client of the
//! coordinator follows ([`pagewire_proto::leader::Coordinators`]).
//!
//! Every call goes to the current address, the first one at start. A
//! transport error, a timeout or `UNAVAILABLE` moves it: to the leader the
//! refusal names (a write sent to a follower), else to the next address;
//! pwctl tries each address at most once per call before it gives up. So a
//! read is answered by the first coordinator that answers (followers serve
//! reads), and a write reaches the leader wherever it is in the list. An
//! address is connected before its first call, so one that cannot be
//! reached at all is named as such ("cannot reach the coordinator at ...").

use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use anyhow::anyhow;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::leader::{
    AfterFailure, CoordinatorRpc, Coordinators, CoordinatorsError, parse_address_list,
};
use pagewire_proto::net::{ClientTls, NetError};

use super::diagnose::CallFailed;
use super::{Usage, error_chain};

/// The coordinators of `--coordinator`, and which of them answers now.
pub(crate) struct Coord {
    set: Coordinators,
    /// Addresses connected before their first call.
    connected: HashSet<String>,
}

/// Why a call could not be made at all: no coordinator could be reached.
#[derive(Debug)]
pub(crate) struct Unreachable {
    /// Each address tried, with why it failed.
    pub(crate) tried: Vec<(String, String)>,
}

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.tried.as_slice() {
            [(address, cause)] => write!(f, "cannot reach the coordinator at {address}: {cause}")?,
            tried => {
                f.write_str("cannot reach the coordinator at any of its addresses: ")?;
                let all: Vec<String> = tried.iter().map(|(a, c)| format!("{a}: {c}")).collect();
                f.write_str(&all.join("; "))?;
            }
        }
        f.write_str("; is it running? (set --coordinator or PAGEWIRE_COORDINATOR)")
    }
}

impl std::error::Error for Unreachable {}

impl Coord {
    /// The coordinators of `list` (a usage error when it is not a list of
    /// host:port).
    pub(crate) fn new(
        list: &str,
        token: AttachToken,
        tls: Option<ClientTls>,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let addresses =
            parse_address_list(list).map_err(|e| Usage(format!("bad --coordinator: {e}")))?;
        let set = Coordinators::new(&addresses, token, tls, timeout).map_err(|e| match e {
            CoordinatorsError::List(e) => Usage(format!("bad --coordinator: {e}")).into(),
            other => anyhow::Error::from(other),
        })?;
        Ok(Self {
            set,
            connected: HashSet::new(),
        })
    }

    /// Calls `f` on a client of the current coordinator, failing over as
    /// the module header says; the answer.
    pub(crate) async fn call<T, F, Fut>(&mut self, what: &str, f: F) -> anyhow::Result<T>
    where
        F: FnMut(CoordinatorRpc) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        Ok(self.call_at(what, f).await?.0)
    }

    /// [`Coord::call`], and the address of the coordinator that answered.
    pub(crate) async fn call_at<T, F, Fut>(
        &mut self,
        what: &str,
        mut f: F,
    ) -> anyhow::Result<(T, String)>
    where
        F: FnMut(CoordinatorRpc) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut unreachable: Vec<(String, String)> = Vec::new();
        let mut tried: Vec<String> = Vec::new();
        loop {
            let mut pick = self.set.pick();
            let address = pick.address().to_owned();
            if !self.connected.contains(&address) {
                match self.set.connect(&pick).await {
                    Ok(p) => {
                        self.connected.insert(address.clone());
                        pick = p;
                    }
                    Err(e) => {
                        let cause = match &e {
                            NetError::Connect { source, .. } => error_chain(source),
                            other => error_chain(other),
                        };
                        let status = tonic::Status::unavailable(cause.clone());
                        unreachable.push((address, cause));
                        if self.set.failed(&pick, &status) == AfterFailure::RetryNow {
                            continue;
                        }
                        if tried.is_empty() {
                            return Err(Unreachable { tried: unreachable }.into());
                        }
                        return Err(anyhow!(
                            "{what} failed on every coordinator: {}; {}",
                            tried.join("; "),
                            Unreachable { tried: unreachable }
                        ));
                    }
                }
            }
            match f(pick.client()).await {
                Ok(r) => {
                    self.set.succeeded(&pick);
                    return Ok((r.into_inner(), address));
                }
                Err(status) => {
                    let next = self.set.failed(&pick, &status);
                    if next == AfterFailure::RetryNow {
                        tried.push(format!(
                            "{address}: {:?}: {}",
                            status.code(),
                            status.message()
                        ));
                        continue;
                    }
                    tried.extend(
                        unreachable
                            .drain(..)
                            .map(|(a, c)| format!("{a}: cannot connect: {c}")),
                    );
                    return Err(CallFailed {
                        what: what.to_owned(),
                        address,
                        status,
                        tried,
                    }
                    .into());
                }
            }
        }
    }
}
