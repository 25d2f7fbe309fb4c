//! The `tcp` wire format, and the encoders of its requests and response headers.
//!
//! # Wire format (all integers little-endian)
//!
//! Handshake, once per connection, magic `PWTCP\0\0\x01`:
//!
//! ```text
//! client -> server  magic[8] | client_nonce[16]
//! server -> client  magic[8] | server_nonce[16] | HMAC-SHA256(token, "pagewire server" | cn | sn)[32]
//! client -> server  HMAC-SHA256(token, "pagewire client" | sn | cn)[32]
//! server -> client  status[1]   0 = accepted; anything else, then close
//! ```
//!
//! Then requests, 40 bytes each, any number back to back:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | opcode: 1 = READ, 4 = CALL (2 = compare-and-swap, 3 = fetch-and-add reserved) |
//! | 1 | 1 | flags, 0 |
//! | 2 | 2 | reserved, 0 |
//! | 4 | 4 | length in bytes |
//! | 8 | 8 | request id (opaque to the responder, echoed) |
//! | 16 | 8 | remote address |
//! | 24 | 4 | rkey |
//! | 28 | 4 | reserved, 0 |
//! | 32 | 8 | epoch of the region descriptor |
//!
//! Responses, in request order, a 16-byte header then the payload:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | status: 0 = ok, 1 = unknown rkey, 2 = stale epoch, 3 = out of bounds, 4 = bad request, 5 = no handler (CALL) |
//! | 1 | 3 | reserved, 0 |
//! | 4 | 4 | payload length: the request's length when ok (a CALL: the reply's), else 0 |
//! | 8 | 8 | request id |
//! | 16 | len | the bytes read |
//!
//! A CALL (opcode 4) is a request of the same 40 bytes followed by
//! `length` bytes of argument (at most [`MAX_CALL_ARG`]); its address and
//! rkey are 0 and its epoch is the owner's (a call meant for an earlier
//! incarnation of the owner gets `stale epoch`). The owner hands the
//! argument to the handler its process installed
//! ([`TcpOwner::set_call_handler`](super::TcpOwner::set_call_handler)) and
//! answers with status ok and the handler's reply as the payload (any
//! length up to the owner's `max_read_len` plus 1 MiB), or `no handler`
//! (status 5) when none is installed. The transport does not look inside
//! either: pagewire's node daemon answers a page fault there
//! (`pagewire_proto::call`). Calls are answered in request order like
//! READs, so a call holds up the READs behind it on its connection for as
//! long as its handler runs.
//!
//! A READ is valid when its rkey names a live region of this responder, its
//! epoch is that region's, `1 <= length <= max_read_len` and `[address,
//! address + length)` lies inside the region. The responder copies with
//! word-sized atomic loads (the owner may be rewriting the bytes: the reader
//! validates what it gets). Flow control: a client keeps at most
//! `max_outstanding` requests in flight (40 KiB of requests at the default
//! 1024), so neither side can block the other's progress.

pub(super) const MAGIC: &[u8; 8] = b"PWTCP\0\0\x01";
/// Size of one request on the wire.
pub const REQUEST_LEN: usize = 40;
/// Size of one response header on the wire.
pub const RESPONSE_HEADER_LEN: usize = 16;
/// The largest argument of one CALL, in bytes.
pub const MAX_CALL_ARG: usize = 16 << 10;
/// How much longer than `max_read_len` a CALL's reply may be (its
/// metadata beside the pages it carries).
pub(super) const CALL_REPLY_SLACK: usize = 1 << 20;
pub(super) const OP_READ: u8 = 1;
pub(super) const OP_CALL: u8 = 4;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_UNKNOWN_KEY: u8 = 1;
pub(super) const ST_STALE_EPOCH: u8 = 2;
pub(super) const ST_OUT_OF_BOUNDS: u8 = 3;
pub(super) const ST_BAD_REQUEST: u8 = 4;
pub(super) const ST_NO_HANDLER: u8 = 5;

/// Appends one READ request (see the table above) to `out`; `id` is the
/// request id the responder echoes.
pub(super) fn push_read(out: &mut Vec<u8>, len: u32, id: u64, addr: u64, rkey: u32, epoch: u64) {
    Request {
        op: OP_READ,
        len,
        id,
        addr,
        rkey,
        epoch,
    }
    .push(out);
}

/// Appends one response header (see the table above) to `out`.
pub(super) fn push_header(out: &mut Vec<u8>, status: u8, len: u32, id: u64) {
    out.extend_from_slice(&[status, 0, 0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
}

/// One response header's fields (see the table above): what the responder
/// writes ([`push_header`]) and a reader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ResponseHeader {
    pub(super) status: u8,
    pub(super) len: u32,
    pub(super) id: u64,
}

impl ResponseHeader {
    /// Decodes the first [`RESPONSE_HEADER_LEN`] bytes of `b`.
    ///
    /// # Panics
    /// When `b` is shorter than [`RESPONSE_HEADER_LEN`] (a reader decodes
    /// only whole headers).
    pub(super) fn decode(b: &[u8]) -> Self {
        Self {
            status: b[0],
            len: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            id: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        }
    }
}

/// One request's fields (see the table above): what a reader writes and
/// the responder reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Request {
    pub(super) op: u8,
    pub(super) len: u32,
    pub(super) id: u64,
    pub(super) addr: u64,
    pub(super) rkey: u32,
    pub(super) epoch: u64,
}

impl Request {
    /// Decodes the first [`REQUEST_LEN`] bytes of `b`.
    ///
    /// # Panics
    /// When `b` is shorter than [`REQUEST_LEN`] (the responder decodes only
    /// whole requests).
    pub(super) fn decode(b: &[u8]) -> Self {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Self {
            op: b[0],
            len: u32_at(4),
            id: u64_at(8),
            addr: u64_at(16),
            rkey: u32_at(24),
            epoch: u64_at(32),
        }
    }

    /// Appends the request's [`REQUEST_LEN`] bytes to `out` (flags and the
    /// reserved fields zero).
    pub(super) fn push(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[self.op, 0, 0, 0]);
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.epoch.to_le_bytes());
    }
}

/// Appends one CALL request with its argument (see above) to `out`.
pub(super) fn push_call(out: &mut Vec<u8>, id: u64, epoch: u64, arg: &[u8]) {
    let len = u32::try_from(arg.len()).expect("a call argument fits u32");
    Request {
        op: OP_CALL,
        len,
        id,
        addr: 0,
        rkey: 0,
        epoch,
    }
    .push(out);
    out.extend_from_slice(arg);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_decodes_to_what_was_pushed() {
        let mut out = Vec::new();
        push_read(&mut out, 4096, 7 << 32 | 3, 0x1000_2000, 0xabcd, 42);
        push_call(&mut out, 9, 43, b"arg");
        assert_eq!(out.len(), 2 * REQUEST_LEN + 3);
        assert_eq!(
            Request::decode(&out),
            Request {
                op: OP_READ,
                len: 4096,
                id: 7 << 32 | 3,
                addr: 0x1000_2000,
                rkey: 0xabcd,
                epoch: 42,
            }
        );
        let call = Request::decode(&out[REQUEST_LEN..]);
        assert_eq!(
            (call.op, call.len, call.id, call.addr, call.rkey, call.epoch),
            (OP_CALL, 3, 9, 0, 0, 43)
        );
        assert_eq!(&out[2 * REQUEST_LEN..], b"arg");
        // Flags and reserved bytes are zero.
        assert_eq!(&out[1..4], &[0, 0, 0]);
        assert_eq!(&out[28..32], &[0; 4]);
    }

    #[test]
    fn a_response_header_decodes_to_what_was_pushed() {
        let mut out = Vec::new();
        push_header(&mut out, ST_STALE_EPOCH, 4096, 5 << 32 | 17);
        assert_eq!(out.len(), RESPONSE_HEADER_LEN);
        assert_eq!(
            ResponseHeader::decode(&out),
            ResponseHeader {
                status: ST_STALE_EPOCH,
                len: 4096,
                id: 5 << 32 | 17,
            }
        );
        assert_eq!(&out[1..4], &[0, 0, 0], "reserved bytes are zero");
    }
}
