//! A real `tcp` responder fed the input as requests (READs, and CALLs
//! with their arguments), on an authenticated connection. The input is in
//! relative form (see `pagewire_fuzz::seeds::relativize`, which transforms
//! every 40-byte chunk): rkey and epoch XORed with the live region's, the
//! address an offset from its start, so that inputs reach the region
//! whatever key and address this process drew. Every whole request (a
//! CALL with its whole argument; an oversized CALL as soon as its 40
//! bytes are in) gets exactly one answer, in order, with its id; a READ's
//! bytes are exactly the region's at the requested place, a CALL's reply
//! its argument (the responder's handler echoes).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pagewire_fuzz::seeds::{Responder, relativize};
use pagewire_rdma::LocalRegion;
use pagewire_rdma::tcp::{MAX_CALL_ARG, REQUEST_LEN, RESPONSE_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    static R: OnceLock<Responder> = OnceLock::new();
    let r = R.get_or_init(Responder::start);
    let desc = r.region.descriptor();
    let mut req = data[..data.len().min(64 * REQUEST_LEN)].to_vec();
    relativize(&mut req, &desc, false);
    let answers = r.exchange(&req);
    let mut at = 0;
    let mut next = 0;
    while req.len().saturating_sub(next) >= REQUEST_LEN {
        let q = &req[next..next + REQUEST_LEN];
        let qlen = u32::from_le_bytes(q[4..8].try_into().unwrap()) as usize;
        let call = q[0] == 4;
        if call && qlen <= MAX_CALL_ARG && req.len() - next < REQUEST_LEN + qlen {
            break; // a CALL whose argument never came in whole: no answer
        }
        let h = answers
            .get(at..at + RESPONSE_HEADER_LEN)
            .expect("one answer per whole request");
        let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        assert_eq!(h[8..16], q[8..16], "the answer echoes the request id");
        assert_eq!(h[1..4], [0, 0, 0]);
        at += RESPONSE_HEADER_LEN;
        if call {
            next += REQUEST_LEN;
            if qlen > MAX_CALL_ARG {
                assert_eq!((h[0], len), (4, 0), "an oversized CALL is a bad request");
                next = next.saturating_add(qlen); // its argument is skipped
                continue;
            }
            let arg = &req[next..next + qlen];
            next += qlen;
            let epoch = u64::from_le_bytes(q[32..40].try_into().unwrap());
            if epoch == desc.epoch {
                assert_eq!(h[0], 0, "a CALL for this epoch is answered");
                assert_eq!(&answers[at..at + len], arg, "the handler echoes");
                at += len;
            } else {
                assert_eq!((h[0], len), (2, 0), "a CALL for another epoch is stale");
            }
            continue;
        }
        next += REQUEST_LEN;
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
