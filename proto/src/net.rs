//! Channels and server TLS settings shared by every pagewire endpoint.

use std::path::{Path, PathBuf};
use std::time::Duration;

#[cfg(feature = "server")]
use tokio::net::TcpListener;
#[cfg(feature = "server")]
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
#[cfg(feature = "server")]
use tonic::transport::{Identity, ServerTlsConfig};

/// Why a channel or a TLS setting could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    #[error("invalid address {address:?}: {source}")]
    BadAddress {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot connect to {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot read {path}: {source}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad TLS settings: {source}")]
    Tls {
        #[source]
        source: tonic::transport::Error,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, NetError> {
    std::fs::read(path).map_err(|source| NetError::ReadFile {
        path: path.to_owned(),
        source,
    })
}

/// How a client checks the server: a CA certificate (PEM) and the name the
/// server's certificate must carry.
#[derive(Debug, Clone)]
pub struct ClientTls {
    pub ca_file: PathBuf,
    pub domain: String,
}

/// How a server proves itself (feature `server`): certificate chain and key (PEM), and
/// optionally a CA that clients' certificates must chain to (mutual TLS).
#[cfg(feature = "server")]
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: Option<PathBuf>,
}

#[cfg(feature = "server")]
impl ServerTls {
    pub fn config(&self) -> Result<ServerTlsConfig, NetError> {
        let identity = Identity::from_pem(read(&self.cert_file)?, read(&self.key_file)?);
        let mut cfg = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca_file {
            cfg = cfg.client_ca_root(Certificate::from_pem(read(ca)?));
        }
        Ok(cfg)
    }
}

/// The connections a gRPC server accepts on `listener`, with `TCP_NODELAY`
/// set on each. tonic ignores `Server::tcp_nodelay` for a listener it did
/// not bind itself, and without it a small response can wait for the peer's
/// delayed ACK (about 40 ms on Linux) behind Nagle's algorithm.
#[cfg(feature = "server")]
pub fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// HTTP/2 PING interval while a call or stream is open. Short, because a
/// connection that silently lost its peer (a partition) otherwise outlives
/// the partition: TCP's retransmission backoff then delays the first reply
/// after the network heals by seconds, past the callers' timeouts, and a
/// node cut off for 10 s took 5 s more to rejoin (and re-registered twice).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// A PING unanswered this long closes the connection; the next call opens
/// a fresh one.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Builds an endpoint (`TCP_NODELAY` on) for `address` (`host:port` or a full `http(s)://` URL),
/// with TLS when `tls` is given.
pub fn endpoint(
    address: &str,
    tls: Option<&ClientTls>,
    connect_timeout: Duration,
) -> Result<Endpoint, NetError> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = if address.contains("://") {
        address.to_owned()
    } else {
        format!("{scheme}://{address}")
    };
    let mut ep = Endpoint::from_shared(url).map_err(|source| NetError::BadAddress {
        address: address.to_owned(),
        source,
    })?;
    ep = ep
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    if let Some(tls) = tls {
        let cfg = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&tls.ca_file)?))
            .domain_name(tls.domain.clone());
        ep = ep
            .tls_config(cfg)
            .map_err(|source| NetError::Tls { source })?;
    }
    Ok(ep)
}

/// Connects now (fails fast when nothing listens).
pub async fn connect(
    address: &str,
    tls: Option<&ClientTls>,
    connect_timeout: Duration,
) -> Result<Channel, NetError> {
    endpoint(address, tls, connect_timeout)?
        .connect()
        .await
        .map_err(|source| NetError::Connect {
            address: address.to_owned(),
            source,
        })
}

/// A channel that connects on first use and reconnects after failures.
pub fn connect_lazy(
    address: &str,
    tls: Option<&ClientTls>,
    connect_timeout: Duration,
) -> Result<Channel, NetError> {
    Ok(endpoint(address, tls, connect_timeout)?.connect_lazy())
}

#[cfg(all(test, feature = "server"))]
mod tests {
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(
            accepted.nodelay().unwrap(),
            "TCP_NODELAY is off on the server side"
        );
    }
}
