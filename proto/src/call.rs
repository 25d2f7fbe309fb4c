//! A page fault sent as a CALL on a one-sided transport's own connection
//! (`tcp`'s opcode 4), instead of the gRPC `FaultIn`: the same request and
//! answer messages, without HTTP/2 and a second connection, so a reader's
//! miss costs one round trip of the transport it already reads over.
//!
//! The transport carries opaque bytes; this module gives them meaning.
//!
//! * **Argument**: one service byte ([`FAULT_IN`], the only one), then a
//!   prost-encoded [`FaultInRequest`].
//! * **Reply**: one status byte, then either (0) a prost-encoded
//!   [`FaultInResponse`], or (a gRPC code, 1–16) the refusal's message in
//!   UTF-8: the same code and message the node's gRPC `FaultIn` would have
//!   answered with, so a caller treats both paths alike.
//!
//! A node publishes `calls: true` on its `tcp` transport descriptor when it
//! answers them; a reader asks no other node.

use prost::Message;
use tonic::{Code, Status};

use crate::v1::{FaultInRequest, FaultInResponse};

/// The service byte of a fault-in call.
pub const FAULT_IN: u8 = 1;

/// The argument of a fault-in call.
#[must_use]
pub fn fault_in_request(req: &FaultInRequest) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + req.encoded_len());
    out.push(FAULT_IN);
    req.encode(&mut out).expect("a Vec grows");
    out
}

/// The request in a call's argument, as a node's handler got it.
///
/// # Errors
/// `Unimplemented` for another service byte (or none), `InvalidArgument`
/// for a request that does not decode.
pub fn decode_request(arg: &[u8]) -> Result<FaultInRequest, Status> {
    match arg.split_first() {
        Some((&FAULT_IN, body)) => FaultInRequest::decode(body)
            .map_err(|e| Status::invalid_argument(format!("malformed fault-in call: {e}"))),
        Some((&s, _)) => Err(Status::unimplemented(format!("no call service {s}"))),
        None => Err(Status::unimplemented("an empty call")),
    }
}

/// Appends the reply to a fault-in call: the response, or the refusal.
pub fn push_reply(out: &mut Vec<u8>, r: Result<&FaultInResponse, &Status>) {
    match r {
        Ok(resp) => {
            out.reserve(1 + resp.encoded_len());
            out.push(0);
            resp.encode(out).expect("a Vec grows");
        }
        Err(s) => {
            // A status's code is 1..=16: one byte, never 0.
            let code = u8::try_from(s.code() as i32).unwrap_or(2).max(1);
            out.push(code);
            out.extend_from_slice(s.message().as_bytes());
        }
    }
}

/// The response in a fault-in call's reply, or the node's refusal.
///
/// # Errors
/// The node's refusal (its code and message), or `Internal` for a reply
/// that does not decode.
pub fn decode_reply(reply: &[u8]) -> Result<FaultInResponse, Status> {
    match reply.split_first() {
        Some((0, body)) => FaultInResponse::decode(body)
            .map_err(|e| Status::internal(format!("malformed fault-in reply: {e}"))),
        Some((&code, msg)) if code <= 16 => Err(Status::new(
            Code::from_i32(i32::from(code)),
            String::from_utf8_lossy(msg).into_owned(),
        )),
        _ => Err(Status::internal("malformed fault-in reply")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{FrameLocation, PageRun};

    #[test]
    fn requests_and_replies_round_trip() {
        let req = FaultInRequest {
            run: Some(PageRun {
                first_page: 7,
                page_count: 3,
            }),
            want_data: true,
            map_epoch: 42,
            readahead: 16,
        };
        assert_eq!(
            decode_request(&fault_in_request(&req)).expect("decodes"),
            req
        );
        let resp = FaultInResponse {
            frames: vec![FrameLocation {
                page: 7,
                node_index: 1,
                frame_index: 9,
                frame_generation: 5,
            }],
            data: vec![1, 2, 3],
            map_epoch: 42,
        };
        let mut out = vec![0xEE];
        push_reply(&mut out, Ok(&resp));
        assert_eq!(decode_reply(&out[1..]).expect("decodes"), resp);
        let mut out = Vec::new();
        push_reply(
            &mut out,
            Err(&Status::failed_precondition("stale map epoch 3")),
        );
        let e = decode_reply(&out).expect_err("a refusal");
        assert_eq!(
            (e.code(), e.message()),
            (Code::FailedPrecondition, "stale map epoch 3")
        );
    }

    #[test]
    fn malformed_calls_and_replies_are_typed_errors() {
        assert_eq!(decode_request(&[]).unwrap_err().code(), Code::Unimplemented);
        assert_eq!(
            decode_request(&[9, 1]).unwrap_err().code(),
            Code::Unimplemented
        );
        assert_eq!(
            decode_request(&[FAULT_IN, 0xFF, 0xFF]).unwrap_err().code(),
            Code::InvalidArgument
        );
        assert_eq!(decode_reply(&[]).unwrap_err().code(), Code::Internal);
        assert_eq!(decode_reply(&[17]).unwrap_err().code(), Code::Internal);
        assert_eq!(decode_reply(&[0, 0xFF]).unwrap_err().code(), Code::Internal);
    }
}
