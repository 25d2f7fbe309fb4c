//! Finding the leading coordinator among several.
//!
//! Coordinators that share an etcd store elect one leader; the others refuse
//! writes with `UNAVAILABLE` and name the leader in the [`LEADER_KEY`]
//! metadata entry (see `coordinator.proto`). Clients hold a list of
//! coordinator addresses ([`parse_addresses`], checked by
//! [`parse_address_list`]) and follow that hint ([`leader_hint`]), or move
//! to the next address when there is none.
//!
//! [`Coordinators`] is that rule, shared by every client of the coordinator
//! (the node daemon, the cluster client's map follower, `pwctl`):
//!
//! 1. One channel per address, connecting on first use; calls go to the
//!    *current* one ([`Coordinators::pick`]).
//! 2. A call that fails with a transport error, a timeout or `UNAVAILABLE`
//!    ([`is_failover`]) moves the current address: to the leader the
//!    refusal names when it names one (added to the list when it is not in
//!    it), else to the configured address after the last configured one
//!    current (a leader learnt from a hint is visited only when a hint
//!    names it, so one this process cannot reach, such as a name that
//!    resolves only on the coordinators' network, never keeps it from the
//!    rest of the list). Each switch is logged at
//!    info (`switching coordinator from=.. to=..`). Any other error is the
//!    coordinator's answer, and the caller's to handle.
//! 3. The caller retries at once, until every configured address has
//!    failed since the last success (a round), or twice as many calls as
//!    addresses have (hints naming dead or unreachable leaders, or two
//!    coordinators naming each other): then it backs off first
//!    ([`AfterFailure`]). With one address every failure ends a round (but
//!    one naming a leader outside the list, tried at once), so a
//!    one-address list behaves as a single channel with the caller's backoff.
//! 4. A failure seen on a pick made before another caller switched (the
//!    node's heartbeat and its map stream share one list) switches nothing:
//!    it retries on the new current address.

use std::sync::Mutex;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::auth::AttachToken;
use crate::net::{self, ClientTls, NetError};
use crate::v1::coordinator_client::CoordinatorClient;

/// Metadata entry of an `UNAVAILABLE` refusal by a coordinator that does not
/// lead: the gRPC address (host:port) of the one that does.
pub const LEADER_KEY: &str = "pagewire-leader";

/// The leader a refusal names, if it is a not-leading refusal that names one.
pub fn leader_hint(status: &tonic::Status) -> Option<String> {
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    let v = status.metadata().get(LEADER_KEY)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// The not-leading refusal, naming `leader` when it is known.
pub fn not_leading(message: impl Into<String>, leader: Option<&str>) -> tonic::Status {
    let mut s = tonic::Status::unavailable(message);
    if let Some(v) = leader.and_then(|l| l.parse().ok()) {
        s.metadata_mut().insert(LEADER_KEY, v);
    }
    s
}

/// A comma-separated list of coordinator addresses (`a:1,b:2`), trimmed,
/// without empty entries or repeats, in the order given.
pub fn parse_addresses(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        if !out.iter().any(|o| o == a) {
            out.push(a.to_owned());
        }
    }
    out
}

/// Most coordinator addresses a list may hold.
pub const MAX_ADDRESSES: usize = 16;

/// Most leader addresses learnt from hints that a [`Coordinators`] keeps
/// beside the configured ones (the oldest goes first).
const MAX_HINTED: usize = 16;

/// Why a list of coordinator addresses cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressListError {
    #[error("no coordinator address given (expected host:port[,host:port...])")]
    Empty,
    #[error("{count} coordinator addresses given; at most {max}")]
    TooMany { count: usize, max: usize },
    #[error(
        "coordinator address {address:?} is not host:port (or an http(s)://host:port URL): {reason}"
    )]
    NotHostPort {
        address: String,
        reason: &'static str,
    },
}

/// `host:port` of an address given as `host:port` or an `http(s)://` URL.
pub fn host_port(address: &str) -> &str {
    let a = address
        .strip_prefix("http://")
        .or_else(|| address.strip_prefix("https://"))
        .unwrap_or(address);
    a.split('/').next().unwrap_or(a)
}

/// Whether two addresses name the same coordinator (scheme and a trailing
/// path aside).
fn same_address(a: &str, b: &str) -> bool {
    host_port(a) == host_port(b)
}

fn check_host_port(address: &str) -> Result<(), &'static str> {
    if address.contains("://")
        && !address.starts_with("http://")
        && !address.starts_with("https://")
    {
        return Err("the only URL schemes are http:// and https://");
    }
    let hp = host_port(address);
    let Some((host, port)) = hp.rsplit_once(':') else {
        return Err("no :port");
    };
    if host.is_empty() {
        return Err("no host");
    }
    if host.chars().any(|c| c.is_whitespace() || c == '@') {
        return Err("the host holds a space or '@'");
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err("an IPv6 host goes in brackets ([::1]:7400)");
    }
    match port.parse::<u16>() {
        Ok(0) => Err("port 0 cannot be dialled"),
        Ok(_) => Ok(()),
        Err(_) => Err("the port is not a number in 1..=65535"),
    }
}

/// [`parse_addresses`], checked: at least one and at most [`MAX_ADDRESSES`]
/// entries, each `host:port` or an `http(s)://host:port` URL.
pub fn parse_address_list(list: &str) -> Result<Vec<String>, AddressListError> {
    let out = parse_addresses(list);
    if out.is_empty() {
        return Err(AddressListError::Empty);
    }
    if out.len() > MAX_ADDRESSES {
        return Err(AddressListError::TooMany {
            count: out.len(),
            max: MAX_ADDRESSES,
        });
    }
    for a in &out {
        check_host_port(a).map_err(|reason| AddressListError::NotHostPort {
            address: a.clone(),
            reason,
        })?;
    }
    Ok(out)
}

/// Whether a failed call should move to another coordinator: a transport
/// error or refused connection (tonic reports them as `UNAVAILABLE`), a
/// not-leading refusal (`UNAVAILABLE`, with or without a hint), or a
/// timeout (`DEADLINE_EXCEEDED`; `CANCELLED` is what tonic says when the
/// client's own deadline ran out).
pub fn is_failover(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
    )
}

/// A coordinator client carrying the cluster token.
pub type CoordinatorRpc = CoordinatorClient<InterceptedService<Channel, AttachToken>>;

/// What to do after a call to a coordinator failed.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailure {
    /// Not a failover condition: the coordinator answered; handle the error.
    Refused,
    /// Retry now, on [`Coordinators::pick`].
    RetryNow,
    /// Every address failed since the last success: back off, then retry
    /// on [`Coordinators::pick`].
    BackOff,
}

/// The coordinator a call goes to: its address, and a client for it.
#[derive(Clone)]
pub struct Pick {
    address: String,
    generation: u64,
    client: CoordinatorRpc,
}

impl Pick {
    pub fn address(&self) -> &str {
        &self.address
    }

    /// A client of this coordinator (cheap: channels are shared).
    pub fn client(&self) -> CoordinatorRpc {
        self.client.clone()
    }
}

impl std::fmt::Debug for Pick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pick")
            .field("address", &self.address)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// A list of coordinators and the current one; the failover rule of the
/// module header. Shared by reference between tasks (`&self` methods).
pub struct Coordinators {
    state: Mutex<State>,
    token: AttachToken,
    tls: Option<ClientTls>,
    connect_timeout: Duration,
}

struct Entry {
    address: String,
    channel: Channel,
}

struct State {
    /// The configured addresses first (`configured` of them), then leaders
    /// learnt from hints.
    entries: Vec<Entry>,
    configured: usize,
    current: usize,
    /// The configured entry last current: a failure without a hint moves
    /// to the configured entry after it, also from a learnt leader, so
    /// that every configured address is tried in a round even when a hint
    /// names a leader this process cannot reach (a name that resolves
    /// only on the coordinators' network).
    last_configured: usize,
    /// Bumped at each switch.
    generation: u64,
    /// Failures since the last success or the last full round.
    failures: usize,
    /// The configured entries (bit i: entry i) that failed in this round.
    failed_configured: u32,
}

impl Coordinators {
    /// One lazy channel per address of `addresses` (not empty; see
    /// [`parse_address_list`]), the first current.
    pub fn new(
        addresses: &[String],
        token: AttachToken,
        tls: Option<ClientTls>,
        connect_timeout: Duration,
    ) -> Result<Self, CoordinatorsError> {
        if addresses.is_empty() {
            return Err(CoordinatorsError::List(AddressListError::Empty));
        }
        if addresses.len() > MAX_ADDRESSES {
            return Err(CoordinatorsError::List(AddressListError::TooMany {
                count: addresses.len(),
                max: MAX_ADDRESSES,
            }));
        }
        let mut entries = Vec::with_capacity(addresses.len());
        for a in addresses {
            entries.push(Entry {
                address: a.clone(),
                channel: net::connect_lazy(a, tls.as_ref(), connect_timeout)?,
            });
        }
        Ok(Self {
            state: Mutex::new(State {
                configured: entries.len(),
                entries,
                current: 0,
                last_configured: 0,
                generation: 0,
                failures: 0,
                failed_configured: 0,
            }),
            token,
            tls,
            connect_timeout,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn client(&self, channel: Channel) -> CoordinatorRpc {
        CoordinatorClient::with_interceptor(channel, self.token.clone())
            .max_decoding_message_size(256 << 20)
    }

    /// The current coordinator.
    pub fn pick(&self) -> Pick {
        let st = self.lock();
        let e = &st.entries[st.current];
        Pick {
            address: e.address.clone(),
            generation: st.generation,
            client: self.client(e.channel.clone()),
        }
    }

    /// Every address held now: the configured ones, then learnt leaders.
    pub fn addresses(&self) -> Vec<String> {
        self.lock()
            .entries
            .iter()
            .map(|e| e.address.clone())
            .collect()
    }

    /// Connects `pick`'s channel now (a lazy one connects on its first
    /// call, and a refused connection then reads like any `UNAVAILABLE`),
    /// so a caller can say that an address cannot be reached at all.
    pub async fn connect(&self, pick: &Pick) -> Result<Pick, NetError> {
        let channel = net::connect(&pick.address, self.tls.as_ref(), self.connect_timeout).await?;
        let mut st = self.lock();
        if let Some(e) = st.entries.iter_mut().find(|e| e.address == pick.address) {
            e.channel = channel.clone();
        }
        Ok(Pick {
            address: pick.address.clone(),
            generation: pick.generation,
            client: self.client(channel),
        })
    }

    /// A call on `pick` succeeded: a new round of failures starts.
    pub fn succeeded(&self, pick: &Pick) {
        let mut st = self.lock();
        if st.generation == pick.generation {
            st.failures = 0;
            st.failed_configured = 0;
        }
    }

    /// A call on `pick` failed with `status`: switches as the module header
    /// says, and tells the caller what to do next.
    pub fn failed(&self, pick: &Pick, status: &tonic::Status) -> AfterFailure {
        if !is_failover(status) {
            return AfterFailure::Refused;
        }
        let mut st = self.lock();
        if st.generation != pick.generation {
            // Another caller switched since this pick: try the new one.
            return AfterFailure::RetryNow;
        }
        st.failures += 1;
        if st.current < st.configured {
            st.failed_configured |= 1 << st.current;
        }
        let all_configured = (1u32 << st.configured) - 1;
        let from = st.entries[st.current].address.clone();
        let hint = leader_hint(status).filter(|h| !same_address(h, &from));
        let hinted = hint.is_some();
        let target = match hint {
            Some(h) => match st.entries.iter().position(|e| same_address(&e.address, &h)) {
                Some(i) => Some(i),
                None => self.add_hinted(&mut st, h),
            },
            // The next configured entry that has not failed in this round.
            None => Some(
                (1..=st.configured)
                    .map(|k| (st.last_configured + k) % st.configured)
                    .find(|&i| st.failed_configured & (1 << i) == 0)
                    .unwrap_or((st.last_configured + 1) % st.configured),
            ),
        };
        if let Some(t) = target.filter(|&t| t != st.current) {
            st.current = t;
            if t < st.configured {
                st.last_configured = t;
            }
            st.generation += 1;
            let to = &st.entries[t].address;
            tracing::info!(
                from = %from,
                to = %to,
                code = ?status.code(),
                leader_hint = hinted,
                "switching coordinator"
            );
        }
        // A round ends when every configured address has failed (unless a
        // hint just named a leader outside the list: tried at once), or
        // after twice as many failures as addresses (hints naming dead or
        // unreachable leaders, coordinators naming each other).
        // A leader just learnt from a hint is tried at once.
        if (st.failed_configured & all_configured == all_configured && st.current < st.configured)
            || st.failures >= 2 * st.entries.len()
        {
            st.failures = 0;
            st.failed_configured = 0;
            AfterFailure::BackOff
        } else {
            AfterFailure::RetryNow
        }
    }

    /// Adds a leader learnt from a hint; its index (None: its address
    /// cannot be dialled, and the hint is ignored).
    fn add_hinted(&self, st: &mut State, address: String) -> Option<usize> {
        let channel = match net::connect_lazy(&address, self.tls.as_ref(), self.connect_timeout) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(leader = %address, error = %e, "ignoring a leader hint that cannot be dialled");
                return None;
            }
        };
        if st.entries.len() - st.configured >= MAX_HINTED {
            // Drop the oldest learnt leader; the current one moves down with it.
            st.entries.remove(st.configured);
            if st.current > st.configured {
                st.current -= 1;
            }
        }
        st.entries.push(Entry { address, channel });
        Some(st.entries.len() - 1)
    }
}

impl std::fmt::Debug for Coordinators {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("Coordinators")
            .field(
                "addresses",
                &st.entries.iter().map(|e| &e.address).collect::<Vec<_>>(),
            )
            .field("current", &st.current)
            .finish_non_exhaustive()
    }
}

/// Why a [`Coordinators`] could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordinatorsError {
    #[error(transparent)]
    List(#[from] AddressListError),
    #[error(transparent)]
    Net(#[from] NetError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_round_trip_and_lists_parse() {
        let s = not_leading("follower", Some("10.0.0.1:7400"));
        assert_eq!(leader_hint(&s).as_deref(), Some("10.0.0.1:7400"));
        assert_eq!(leader_hint(&not_leading("none", None)), None);
        assert_eq!(leader_hint(&tonic::Status::internal("x")), None);
        assert_eq!(
            parse_addresses(" a:1, b:2,,a:1 ,c:3"),
            vec!["a:1", "b:2", "c:3"]
        );
        assert!(parse_addresses(" , ").is_empty());
    }

    #[test]
    fn address_lists_are_checked() {
        assert_eq!(
            parse_address_list("a:1, https://b:2/,[::1]:7400").unwrap(),
            vec!["a:1", "https://b:2/", "[::1]:7400"]
        );
        assert_eq!(parse_address_list(" ,"), Err(AddressListError::Empty));
        let many = (1..=17).map(|i| format!("h{i}:7400")).collect::<Vec<_>>();
        assert_eq!(
            parse_address_list(&many.join(",")),
            Err(AddressListError::TooMany { count: 17, max: 16 })
        );
        assert!(parse_address_list(&many[..16].join(",")).is_ok());
        for bad in [
            "a",
            ":7400",
            "a:0",
            "a:x",
            "a:70000",
            "ftp://a:1",
            "::1:7400",
            "a b:1",
        ] {
            match parse_address_list(&format!("ok:1,{bad}")) {
                Err(AddressListError::NotHostPort { address, .. }) => assert_eq!(address, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    fn set(list: &str) -> Coordinators {
        Coordinators::new(
            &parse_address_list(list).unwrap(),
            AttachToken::new("t").unwrap(),
            None,
            Duration::from_millis(100),
        )
        .unwrap()
    }

    fn unavailable() -> tonic::Status {
        tonic::Status::unavailable("down")
    }

    #[tokio::test]
    async fn failures_move_to_the_hinted_leader_or_the_next_address() {
        let c = set("a:1,b:2,c:3");
        let a = c.pick();
        assert_eq!(a.address(), "a:1");
        // The coordinator's own answer is the caller's.
        assert_eq!(
            c.failed(&a, &tonic::Status::invalid_argument("no")),
            AfterFailure::Refused
        );
        assert_eq!(c.pick().address(), "a:1");
        // No hint: the next address, at once.
        assert_eq!(c.failed(&a, &unavailable()), AfterFailure::RetryNow);
        let b = c.pick();
        assert_eq!(b.address(), "b:2");
        // A failure seen on the old pick switches nothing more.
        assert_eq!(c.failed(&a, &unavailable()), AfterFailure::RetryNow);
        assert_eq!(c.pick().address(), "b:2");
        // A hint goes straight to the leader, even past the next address.
        assert_eq!(
            c.failed(&b, &not_leading("follower", Some("a:1"))),
            AfterFailure::RetryNow
        );
        assert_eq!(c.pick().address(), "a:1");
        // Without a hint: the address not yet failed in this round (c:3,
        // not b:2 again).
        let a2 = c.pick();
        assert_eq!(
            c.failed(&a2, &tonic::Status::deadline_exceeded("slow")),
            AfterFailure::RetryNow
        );
        let c3 = c.pick();
        assert_eq!(c3.address(), "c:3");
        // Every address failed in the round: back off (and start a new one).
        assert_eq!(c.failed(&c3, &unavailable()), AfterFailure::BackOff);
        let a3 = c.pick();
        assert_eq!(a3.address(), "a:1");
        // A success starts a new round.
        assert_eq!(c.failed(&a3, &unavailable()), AfterFailure::RetryNow);
        let b3 = c.pick();
        c.succeeded(&b3);
        assert_eq!(c.failed(&b3, &unavailable()), AfterFailure::RetryNow);
        assert_eq!(c.pick().address(), "c:3");
        let c4 = c.pick();
        assert_eq!(c.failed(&c4, &unavailable()), AfterFailure::RetryNow);
        assert_eq!(c.pick().address(), "a:1");
    }

    /// A hint naming a leader this process cannot reach (compose's service
    /// names, seen from the host) must not trap the caller between it and
    /// the coordinator that gave it: the next failure moves on through the
    /// configured list. Before, it went back to the hinting one for ever
    /// and the leader, third in the list, was never tried.
    #[tokio::test]
    async fn an_unreachable_hinted_leader_moves_on_through_the_list() {
        let c = set("a:1,b:2,c:3");
        let a = c.pick();
        let _ = c.failed(&a, &not_leading("follower", Some("x:9")));
        let x = c.pick();
        assert_eq!(x.address(), "x:9");
        let _ = c.failed(&x, &unavailable());
        let b = c.pick();
        assert_eq!(b.address(), "b:2");
        let _ = c.failed(&b, &not_leading("follower", Some("x:9")));
        let x = c.pick();
        assert_eq!(x.address(), "x:9");
        let _ = c.failed(&x, &unavailable());
        let c3 = c.pick();
        assert_eq!(c3.address(), "c:3");
        // The leader answers: the caller never backed off before reaching it.
        c.succeeded(&c3);
    }

    #[tokio::test]
    async fn an_unknown_leader_is_added_and_one_address_backs_off_every_time() {
        let c = set("a:1");
        let a = c.pick();
        assert_eq!(c.failed(&a, &unavailable()), AfterFailure::BackOff);
        assert_eq!(c.pick().address(), "a:1");
        assert_eq!(
            c.failed(&a, &not_leading("follower", Some("http://z:9/"))),
            AfterFailure::RetryNow
        );
        assert_eq!(c.pick().address(), "http://z:9/");
        assert_eq!(c.addresses(), vec!["a:1", "http://z:9/"]);
        // The same leader named again (another spelling) is not added twice.
        let z = c.pick();
        assert_eq!(
            c.failed(&z, &not_leading("follower", Some("a:1"))),
            AfterFailure::BackOff
        );
        let a = c.pick();
        assert_eq!(a.address(), "a:1");
        let _ = c.failed(&a, &not_leading("follower", Some("z:9")));
        assert_eq!(c.addresses().len(), 2);
        assert_eq!(c.pick().address(), "http://z:9/");
        // Learnt leaders are bounded; the configured address stays.
        for i in 0..40 {
            let p = c.pick();
            let _ = c.failed(&p, &not_leading("follower", Some(&format!("l{i}:1"))));
        }
        let all = c.addresses();
        assert_eq!(all.len(), 1 + MAX_HINTED);
        assert_eq!(all[0], "a:1");
        assert_eq!(c.pick().address(), "l39:1");
    }
}
