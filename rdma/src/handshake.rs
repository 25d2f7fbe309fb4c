//! Mutual authentication of a stream with a shared cluster token, used by the
//! `tcp` responder and by the `verbs` endpoint exchange.
//!
//! ```text
//! client -> server  magic[8] | client_nonce[16]
//! server -> client  magic[8] | server_nonce[16] | HMAC(token, "pagewire server" | cn | sn)[32]
//! client -> server  HMAC(token, "pagewire client" | sn | cn)[32]
//! server -> client  status[1]          0 = accepted, 1 = refused (then close)
//! ```
//!
//! HMAC is HMAC-SHA256; MACs are compared in constant time. Fresh 16-byte
//! nonces on both sides prevent replay; the labels keep one side's answer
//! from serving as the other side's. The token never crosses the wire.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::ConnectError;

type HmacSha256 = Hmac<Sha256>;

const NONCE: usize = 16;
const MAC: usize = 32;

fn mac(token: &[u8], label: &[u8], a: &[u8], b: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(token).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(a);
    m.update(b);
    m
}

fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(std::io::Error::other)?;
    Ok(n)
}

/// Client side; returns once both sides proved they hold `token`.
pub(crate) fn client<S: Read + Write>(
    s: &mut S,
    magic: &[u8; 8],
    token: &[u8],
) -> Result<(), ConnectError> {
    let cn = nonce()?;
    let mut hello = [0u8; 8 + NONCE];
    hello[..8].copy_from_slice(magic);
    hello[8..].copy_from_slice(&cn);
    s.write_all(&hello)?;
    let mut reply = [0u8; 8 + NONCE + MAC];
    s.read_exact(&mut reply)?;
    if &reply[..8] != magic {
        return Err(ConnectError::Protocol(
            "the peer does not speak this protocol version",
        ));
    }
    let sn = &reply[8..8 + NONCE];
    mac(token, b"pagewire server", &cn, sn)
        .verify_slice(&reply[8 + NONCE..])
        .map_err(|_| ConnectError::AuthFailed)?;
    s.write_all(
        &mac(token, b"pagewire client", sn, &cn)
            .finalize()
            .into_bytes(),
    )?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status)?;
    match status[0] {
        0 => Ok(()),
        _ => Err(ConnectError::AuthFailed),
    }
}

/// Server side; `Ok(true)` when the client proved it holds `token`.
pub(crate) fn server<S: Read + Write>(
    s: &mut S,
    magic: &[u8; 8],
    token: &[u8],
) -> std::io::Result<bool> {
    let mut hello = [0u8; 8 + NONCE];
    s.read_exact(&mut hello)?;
    if &hello[..8] != magic {
        return Ok(false);
    }
    let cn = &hello[8..];
    let sn = nonce()?;
    let mut reply = [0u8; 8 + NONCE + MAC];
    reply[..8].copy_from_slice(magic);
    reply[8..8 + NONCE].copy_from_slice(&sn);
    reply[8 + NONCE..].copy_from_slice(
        &mac(token, b"pagewire server", cn, &sn)
            .finalize()
            .into_bytes(),
    );
    s.write_all(&reply)?;
    let mut answer = [0u8; MAC];
    s.read_exact(&mut answer)?;
    let ok = mac(token, b"pagewire client", &sn, cn)
        .verify_slice(&answer)
        .is_ok();
    s.write_all(&[u8::from(!ok)])?;
    Ok(ok)
}

/// Connects to the first address `addr` resolves to that answers within
/// `limit` each (at least 1 ms): the control channel of `tcp` and `verbs`.
pub(crate) fn connect_stream(
    addr: impl ToSocketAddrs,
    limit: Duration,
) -> std::io::Result<TcpStream> {
    let limit = limit.max(Duration::from_millis(1));
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, limit) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolved to nothing",
        )
    }))
}
