//! Why etcd refuses this coordinator's connections: a TLS handshake of its
//! own with each endpoint ([`TlsCheck`]), for the store problem the
//! coordinator reports.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The coordinator's TLS settings towards etcd, to explain a refused
/// connection. etcd's client errors say little ("transport error", "broken
/// pipe", "connection closed"): the TLS alert etcd sent, or the certificate
/// check that failed, is lost inside the HTTP/2 client. A handshake of our
/// own, made the way the client makes it, sees them.
#[derive(Clone)]
pub(super) struct TlsCheck {
    /// host:port of each member.
    pub(super) endpoints: Vec<String>,
    /// `etcd.ca_file` and its contents; `None`: plain http.
    pub(super) ca: Option<(PathBuf, Vec<u8>)>,
    /// `etcd.cert_file`, the certificate chain and the key (PEM).
    pub(super) identity: Option<(PathBuf, Vec<u8>, Vec<u8>)>,
    /// `etcd.domain`: the name etcd's certificate must carry (empty: the
    /// endpoint's host).
    pub(super) domain: String,
    /// Time limit of each step (connect, handshake, the first read).
    pub(super) timeout: Duration,
}

/// The HTTP/2 client preface and an empty SETTINGS frame: etcd answers them
/// with its own SETTINGS once it has accepted the connection.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

impl TlsCheck {
    /// Connects to every endpoint (in parallel) as the client does and
    /// returns what is wrong with TLS, naming the endpoints, when something
    /// is: etcd serves TLS and the coordinator speaks plain http, or the
    /// reverse, etcd's certificate fails the check against `etcd.ca_file`,
    /// or etcd refuses the client certificate (or its absence). `None` when
    /// TLS is not the problem (an endpoint that is down is not a TLS
    /// problem).
    pub(super) fn explain(&self) -> Option<String> {
        let found: Vec<(String, Option<String>)> = std::thread::scope(|s| {
            let calls: Vec<_> = self
                .endpoints
                .iter()
                .map(|e| (e, s.spawn(move || self.check(e))))
                .collect();
            calls
                .into_iter()
                .map(|(e, h)| (e.clone(), h.join().unwrap_or(None)))
                .collect()
        });
        // One line per distinct reason, with the endpoints it applies to.
        let mut reasons: Vec<(String, Vec<String>)> = Vec::new();
        for (endpoint, why) in found {
            let Some(why) = why else { continue };
            match reasons.iter_mut().find(|(r, _)| *r == why) {
                Some((_, eps)) => eps.push(endpoint),
                None => reasons.push((why, vec![endpoint])),
            }
        }
        if reasons.is_empty() {
            return None;
        }
        Some(
            reasons
                .iter()
                .map(|(why, eps)| format!("etcd {}: {why}", eps.join(", ")))
                .collect::<Vec<_>>()
                .join("; "),
        )
    }

    /// What is wrong with TLS towards `endpoint` (host:port), if anything.
    fn check(&self, endpoint: &str) -> Option<String> {
        use std::io::{Read, Write};
        use std::net::ToSocketAddrs;

        let (host, _) = endpoint.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addr = endpoint.to_socket_addrs().ok()?.next()?;
        // Down or unreachable: not a TLS problem.
        let tcp = std::net::TcpStream::connect_timeout(&addr, self.timeout).ok()?;
        tcp.set_read_timeout(Some(self.timeout)).ok()?;
        tcp.set_write_timeout(Some(self.timeout)).ok()?;
        let name = if self.domain.is_empty() {
            host
        } else {
            &self.domain
        };
        let server_name = match rustls::pki_types::ServerName::try_from(name.to_owned()) {
            Ok(n) => n,
            Err(e) => return Some(format!("{name:?} is not a valid TLS server name: {e}")),
        };
        let config = match self.client_config() {
            Ok(c) => c,
            Err(e) => return Some(e),
        };
        let conn = rustls::ClientConnection::new(Arc::new(config), server_name).ok()?;
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        // The write drives the handshake; the read gets etcd's SETTINGS,
        // or the alert with which it refuses the client certificate (with
        // TLS 1.3 it sends that after the client's side of the handshake).
        let mut buf = [0u8; 64];
        let outcome = tls
            .write_all(H2_PREFACE)
            .and_then(|()| tls.flush())
            .and_then(|()| tls.read(&mut buf));
        let handshaken = !tls.conn.is_handshaking();
        let error = outcome.err();
        let tls_error = error
            .as_ref()
            .and_then(|e| e.get_ref())
            .and_then(|e| e.downcast_ref::<rustls::Error>());
        let Some((ca_file, _)) = &self.ca else {
            // Plain http: a server that shows a certificate or sends an
            // alert speaks TLS.
            return (handshaken
                || matches!(
                    tls_error,
                    Some(rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_))
                ))
            .then(|| {
                "etcd serves TLS (https) but this coordinator speaks plain http: set \
                 etcd.ca_file to the CA that signed etcd's certificate (and etcd.cert_file \
                 and etcd.key_file if etcd requires client certificates)"
                    .to_owned()
            });
        };
        match tls_error {
            None if handshaken => None,
            // Not TLS at all (or nothing came back).
            None | Some(rustls::Error::InvalidMessage(_)) => Some(format!(
                "no TLS answer ({}): does etcd serve plain http? TLS is on because \
                 etcd.ca_file is set; etcd serves TLS with --cert-file and --key-file and \
                 https:// client URLs",
                error.map_or_else(|| "the connection closed".to_owned(), |e| e.to_string())
            )),
            Some(rustls::Error::InvalidCertificate(e)) => Some(format!(
                "etcd's certificate fails the check: {e:?}; etcd.ca_file {} must hold the CA \
                 that signed it, and it must carry the name {name:?} (etcd.domain, else the \
                 endpoint's host) and be valid now",
                ca_file.display()
            )),
            Some(rustls::Error::AlertReceived(alert)) => Some(match &self.identity {
                None => format!(
                    "etcd refused the connection with the TLS alert {alert:?}: it requires a \
                     client certificate; set etcd.cert_file and etcd.key_file"
                ),
                Some((cert_file, _, _)) => format!(
                    "etcd refused this coordinator's client certificate etcd.cert_file {} \
                     with the TLS alert {alert:?}: it must be signed by a CA in etcd's \
                     --trusted-ca-file, allow client authentication, and be valid now",
                    cert_file.display()
                ),
            }),
            Some(e) => Some(format!("TLS with etcd failed: {e}")),
        }
    }

    /// rustls's client config as tonic builds it from the same files:
    /// `etcd.ca_file` the only root (none for plain http, where the check
    /// only asks whether etcd speaks TLS), the client certificate if set.
    fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let mut roots = rustls::RootCertStore::empty();
        if let Some((path, pem)) = &self.ca {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let added = cert
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|c| roots.add(c).map_err(|e| e.to_string()));
                if let Err(e) = added {
                    return Err(format!(
                        "etcd.ca_file {} holds no usable certificate: {e}",
                        path.display()
                    ));
                }
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
        match &self.identity {
            None => Ok(builder.with_no_client_auth()),
            Some((path, cert, key)) => {
                let bad = |e: String| {
                    format!(
                        "etcd.cert_file {} or etcd.key_file is not a usable PEM certificate \
                         and key: {e}",
                        path.display()
                    )
                };
                let chain = CertificateDer::pem_slice_iter(cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad(format!("{e:?}")))?;
                let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad(format!("{e:?}")))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| bad(e.to_string()))
            }
        }
    }
}
