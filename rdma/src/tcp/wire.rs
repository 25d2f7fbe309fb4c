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
//! | 0 | 1 | opcode: 1 = READ (2 = compare-and-swap, 3 = fetch-and-add reserved) |
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
//! | 0 | 1 | status: 0 = ok, 1 = unknown rkey, 2 = stale epoch, 3 = out of bounds, 4 = bad request |
//! | 1 | 3 | reserved, 0 |
//! | 4 | 4 | payload length: the request's length when ok, else 0 |
//! | 8 | 8 | request id |
//! | 16 | len | the bytes read |
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
pub(super) const OP_READ: u8 = 1;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_UNKNOWN_KEY: u8 = 1;
pub(super) const ST_STALE_EPOCH: u8 = 2;
pub(super) const ST_OUT_OF_BOUNDS: u8 = 3;
pub(super) const ST_BAD_REQUEST: u8 = 4;

/// Appends one READ request (see the table above) to `out`; `id` is the
/// request id the responder echoes.
pub(super) fn push_read(out: &mut Vec<u8>, len: u32, id: u64, addr: u64, rkey: u32, epoch: u64) {
    out.extend_from_slice(&[OP_READ, 0, 0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&rkey.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&epoch.to_le_bytes());
}

/// Appends one response header (see the table above) to `out`.
pub(super) fn push_header(out: &mut Vec<u8>, status: u8, len: u32, id: u64) {
    out.extend_from_slice(&[status, 0, 0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
}
