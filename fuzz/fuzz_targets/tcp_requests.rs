//! A real `tcp` responder fed the input as READ requests, on an
//! authenticated connection. The input is in relative form (see
//! `pagewire_fuzz::seeds::relativize`): rkey and epoch XORed with the live
//! region's, the address an offset from its start, so that inputs reach the
//! region whatever key and address this process drew. Every whole request
//! gets exactly one answer, in order, with its id; an answer with bytes
//! is exactly the region's bytes at the requested place.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pagewire_fuzz::seeds::{Responder, relativize};
use pagewire_rdma::LocalRegion;
use pagewire_rdma::tcp::{REQUEST_LEN, RESPONSE_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    static R: OnceLock<Responder> = OnceLock::new();
    let r = R.get_or_init(Responder::start);
    let desc = r.region.descriptor();
    let mut req = data[..data.len().min(64 * REQUEST_LEN)].to_vec();
    relativize(&mut req, &desc, false);
    let answers = r.exchange(&req);
    let mut at = 0;
    for q in req.chunks_exact(REQUEST_LEN) {
        let h = answers
            .get(at..at + RESPONSE_HEADER_LEN)
            .expect("one answer per whole request");
        let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        assert_eq!(h[8..16], q[8..16], "the answer echoes the request id");
        assert_eq!(h[1..4], [0, 0, 0]);
        at += RESPONSE_HEADER_LEN;
        if h[0] == 0 {
            assert_eq!(q[0], 1, "only READs succeed");
            assert_eq!(
                len,
                u32::from_le_bytes(q[4..8].try_into().unwrap()) as usize
            );
            let off = u64::from_le_bytes(q[16..24].try_into().unwrap()).wrapping_sub(desc.addr);
            let off = usize::try_from(off).expect("inside the region");
            assert!(answers[at..at + len] == r.bytes[off..off + len]);
            at += len;
        } else {
            assert!((1..=4).contains(&h[0]), "status {}", h[0]);
            assert_eq!(len, 0);
        }
    }
    assert_eq!(at, answers.len(), "nothing after the last answer");
});
