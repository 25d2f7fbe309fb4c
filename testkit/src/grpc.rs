//! gRPC clients that attach the cluster token to every call.

use std::time::Duration;

use pagewire_proto::auth::AttachToken;
use pagewire_proto::net::ClientTls;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::node_client::NodeClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A channel whose calls carry the cluster token.
pub type Authed = InterceptedService<Channel, AttachToken>;
pub type CoordinatorRpc = CoordinatorClient<Authed>;
pub type NodeRpc = NodeClient<Authed>;

fn token(t: &str) -> AttachToken {
    AttachToken::new(t).expect("a valid token")
}

/// A coordinator client on `addr` with `tls` (None: plain text); None when
/// it does not connect within `timeout`.
pub async fn coordinator(
    addr: &str,
    tls: Option<&ClientTls>,
    t: &str,
    timeout: Duration,
) -> Option<CoordinatorRpc> {
    let ch = pagewire_proto::net::connect(addr, tls, timeout)
        .await
        .ok()?;
    Some(CoordinatorClient::with_interceptor(ch, token(t)))
}

/// A node client on `addr` (plain text); None when it does not connect
/// within `timeout`.
pub async fn node(addr: &str, t: &str, timeout: Duration) -> Option<NodeRpc> {
    let ch = pagewire_proto::net::connect(addr, None, timeout)
        .await
        .ok()?;
    Some(NodeClient::with_interceptor(ch, token(t)))
}
