//! What a failed coordinator call means when `--coordinator` names the wrong
//! kind of server: a node's gRPC port answers `Unimplemented` with an empty
//! message, a metrics (HTTP/1) port a protocol or transport error. pwctl
//! says which, in words, instead of passing those on.

use std::time::Duration;

use pagewire_proto::leader::host_port;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A coordinator call that failed, kept whole so `main` can explain it.
#[derive(Debug)]
pub(crate) struct CallFailed {
    pub(crate) what: String,
    /// The coordinator that gave `status`.
    pub(crate) address: String,
    pub(crate) status: tonic::Status,
    /// The other coordinators tried before, each with its failure.
    pub(crate) tried: Vec<String>,
}

impl std::fmt::Display for CallFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed: {:?}: {}",
            self.what,
            self.status.code(),
            self.status.message()
        )?;
        if !self.tried.is_empty() {
            write!(
                f,
                " (at {}; before: {})",
                self.address,
                self.tried.join("; ")
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for CallFailed {}

/// The kind of server at the coordinator address, judged from a failed call.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WrongServer {
    /// gRPC, without the Coordinator service: a pagewire node.
    Node,
    /// Not gRPC at all; `http1` when it answered an HTTP/1 request.
    NotGrpc { http1: bool },
}

impl std::fmt::Display for WrongServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WrongServer::Node => f.write_str(
                "this address is a pagewire node, not the coordinator (use the coordinator's \
                 address, e.g. the --coordinator the nodes were started with; `pwctl nodes` \
                 lists the nodes)",
            ),
            WrongServer::NotGrpc { http1: true } => f.write_str(
                "this address does not speak gRPC: it answers plain HTTP (is it a metrics port?)",
            ),
            WrongServer::NotGrpc { http1: false } => {
                f.write_str("this address does not speak gRPC (is it a metrics port?)")
            }
        }
    }
}

/// Whether `s` looks like the answer of something that is not the
/// coordinator. `Unimplemented` with no message is what a gRPC server says
/// about a service it does not have; protocol and transport errors on the
/// first call are what an HTTP/1 server gets us.
pub(crate) fn suspect(s: &tonic::Status) -> bool {
    match s.code() {
        tonic::Code::Unimplemented => true,
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Unavailable => {
            let m = s.message().to_ascii_lowercase();
            m.contains("protocol error") || m.contains("transport error") || m.contains("h2")
        }
        _ => false,
    }
}

/// Judges a failed call's status, probing `address` with one HTTP/1
/// request when the status says the transport broke.
pub(crate) async fn judge(address: &str, s: &tonic::Status) -> Option<WrongServer> {
    if !suspect(s) {
        return None;
    }
    if s.code() == tonic::Code::Unimplemented {
        return Some(WrongServer::Node);
    }
    let http1 = answers_http1(address, Duration::from_secs(1)).await;
    if http1 {
        return Some(WrongServer::NotGrpc { http1 });
    }
    // A transport error from a server that does not answer HTTP/1 either:
    // only a protocol error is sure to mean "not gRPC".
    s.message()
        .to_ascii_lowercase()
        .contains("protocol error")
        .then_some(WrongServer::NotGrpc { http1 })
}

/// Whether `address` answers `GET / HTTP/1.0` with an HTTP/1 status line.
async fn answers_http1(address: &str, limit: Duration) -> bool {
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(host_port(address)).await?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await?;
        let mut buf = [0u8; 8];
        s.read_exact(&mut buf).await?;
        std::io::Result::Ok(buf.starts_with(b"HTTP/1."))
    };
    matches!(tokio::time::timeout(limit, probe).await, Ok(Ok(true)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_of_other_servers_are_suspect() {
        assert!(suspect(&tonic::Status::unimplemented("")));
        assert!(suspect(&tonic::Status::unknown(
            "h2 protocol error: http2 error"
        )));
        assert!(suspect(&tonic::Status::unknown("transport error")));
        assert!(!suspect(&tonic::Status::not_found("unknown node \"x\"")));
        assert!(!suspect(&tonic::Status::unauthenticated(
            "wrong cluster token"
        )));
        assert_eq!(host_port("http://127.0.0.1:7400/"), "127.0.0.1:7400");
        assert_eq!(host_port("127.0.0.1:7400"), "127.0.0.1:7400");
    }
}
