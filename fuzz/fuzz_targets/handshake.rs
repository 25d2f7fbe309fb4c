//! Both ends of the cluster-token handshake (shared by `tcp` and `verbs`,
//! which differ only in the magic) against a peer that sends the input:
//! byte 0 picks the end (even: the client, odd: the responder).
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use pagewire_fuzz::TOKEN;
use pagewire_rdma::tcp::{handshake_client, handshake_server};

/// A peer that sends `input` and swallows what it is sent.
struct Peer<'a> {
    input: &'a [u8],
    sent: usize,
}

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.sent += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&role, input)) = data.split_first() else {
        return;
    };
    let mut peer = Peer { input, sent: 0 };
    if role % 2 == 0 {
        // The responder's nonce is ours to answer, but its MAC covers our
        // fresh nonce: no input can pass.
        assert!(handshake_client(&mut peer, TOKEN).is_err());
    } else if let Ok(accepted) = handshake_server(&mut peer, TOKEN) {
        // Likewise the client's answer covers our fresh nonce.
        assert!(!accepted);
    }
});
