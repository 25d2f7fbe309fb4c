//! The conformance suite on the `verbs` backend.
//!
//! Needs an RDMA device (RoCE, or soft-RoCE: `rdma link add rxe0 type rxe
//! netdev eth0`), named by `PAGEWIRE_RDMA_DEVICE` (the first device when
//! unset). The development and CI kernels have no RDMA, so these tests are
//! ignored by default; `rdma/scripts/softroce-test.sh` runs them inside a
//! soft-RoCE VM with `--ignored`.

#![cfg(feature = "verbs")]

mod conformance;

use std::ptr::NonNull;
use std::sync::Arc;

use pagewire_rdma::verbs::{VerbsConfig, VerbsConnection, VerbsOwner, VerbsRegion};
use pagewire_rdma::{Chaos, MemoryOwner, OwnerError};

const TOKEN: &[u8] = b"conformance cluster token";

struct Verbs {
    owner: Arc<VerbsOwner>,
}

impl conformance::Harness for Verbs {
    type Region = VerbsRegion;
    type Conn = VerbsConnection;
    const CHAOS: bool = false;

    fn new(_chaos: Option<Chaos>) -> Self {
        Self {
            owner: Arc::new(
                VerbsOwner::bind("127.0.0.1:0", VerbsConfig::new(TOKEN))
                    .expect("open the RDMA device"),
            ),
        }
    }

    fn register(&self, len: usize) -> VerbsRegion {
        self.owner.register(len).expect("register")
    }

    fn connect(&self) -> VerbsConnection {
        VerbsConnection::connect(self.owner.local_addr(), VerbsConfig::new(TOKEN)).expect("connect")
    }

    fn kill(&self) {
        self.owner.shutdown();
    }
}

impl conformance::EpochHarness for Verbs {
    fn with_epoch(epoch: u64) -> Self {
        let mut config = VerbsConfig::new(TOKEN);
        config.epoch = Some(epoch);
        let owner = VerbsOwner::bind("127.0.0.1:0", config).expect("open the RDMA device");
        assert_eq!(owner.epoch(), epoch);
        Self {
            owner: Arc::new(owner),
        }
    }
}

impl conformance::ExternalHarness for Verbs {
    unsafe fn register_external(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        owner: MemoryOwner,
    ) -> VerbsRegion {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.owner.register_external(ptr, len, owner) }.expect("register external")
    }
}

conformance_tests!(Verbs, #[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]);

/// The suite again with every connection a handle of one shared connection
/// (how a reader process shares one per owner among its threads).
mod shared {
    use super::{Verbs, conformance};
    crate::conformance_tests!(conformance::Shared<Verbs>, #[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]);
}
epoch_tests!(Verbs, #[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]);
external_memory_tests!(Verbs, #[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]);

/// Refused before the device is opened, so this runs everywhere.
#[test]
fn epoch_zero_is_refused() {
    let mut config = VerbsConfig::new(TOKEN);
    config.epoch = Some(0);
    let e = VerbsOwner::bind("127.0.0.1:0", config);
    assert!(matches!(e, Err(OwnerError::ZeroEpoch)), "{:?}", e.err());
}

#[test]
#[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]
fn stale_epoch_is_refused() {
    conformance::bounded(30, conformance::stale_epoch_is_refused::<Verbs>);
}

#[test]
#[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]
fn wrong_token_is_refused() {
    conformance::bounded(30, || {
        let h = <Verbs as conformance::Harness>::new(None);
        let e = VerbsConnection::connect(
            h.owner.local_addr(),
            VerbsConfig::new(b"not the token".to_vec()),
        );
        assert!(
            matches!(e, Err(pagewire_rdma::ConnectError::AuthFailed)),
            "{:?}",
            e.err()
        );
    });
}

/// The completion channel really wakes a sleeper: after `arm`, a READ's
/// completion makes the readiness descriptor readable (no timeout fallback
/// involved), and `poll` then returns it.
#[test]
#[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]
fn completion_channel_wakes_a_sleeper() {
    conformance::bounded(60, || {
        use pagewire_rdma::{Connection, LocalRegion, ReadRequest};
        let h = <Verbs as conformance::Harness>::new(None);
        let r = <Verbs as conformance::Harness>::register(&h, 4096);
        r.write_bytes(0, &[7u8; 4096]);
        let d = r.descriptor();
        let mut c = <Verbs as conformance::Harness>::connect(&h);
        let fd = c.readiness_fd().expect("verbs has a readiness descriptor");
        for round in 0..5u64 {
            let mut buf = vec![0u8; 4096];
            c.arm();
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let early = unsafe { libc::poll(&mut pfd, 1, 0) };
            assert_eq!(early, 0, "round {round}: readable before any completion");
            // SAFETY: `buf` lives until the completion below is returned.
            unsafe { c.post_reads(&[ReadRequest::new(round, d, 0, &mut buf)]) }.expect("post");
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, 5000) };
            assert_eq!(
                ready, 1,
                "round {round}: no channel event within 5 s of a completion"
            );
            let mut out = Vec::new();
            while out.is_empty() {
                c.poll(&mut out);
            }
            assert_eq!(out.len(), 1);
            assert_eq!(out[0].result, Ok(()));
            assert_eq!(buf, vec![7u8; 4096]);
        }
    });
}

/// An owner at its queue-pair cap refuses the next reader with an error
/// naming the cap, counts it, and takes a reader again once one left.
#[test]
#[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]
fn readers_past_the_queue_pair_cap_are_refused() {
    conformance::bounded(60, || {
        let mut config = VerbsConfig::new(TOKEN);
        config.max_queue_pairs = 1;
        let owner = VerbsOwner::bind("127.0.0.1:0", config).expect("open the RDMA device");
        let first =
            VerbsConnection::connect(owner.local_addr(), VerbsConfig::new(TOKEN)).expect("first");
        assert_eq!(owner.queue_pairs(), 1);
        let e = VerbsConnection::connect(owner.local_addr(), VerbsConfig::new(TOKEN));
        match e {
            Err(pagewire_rdma::ConnectError::Refused(why)) => {
                assert!(
                    why.contains("(1)") && why.contains("verbs_max_queue_pairs"),
                    "{why}"
                );
            }
            other => panic!("expected a refusal: {:?}", other.err()),
        }
        assert_eq!(owner.refused(), 1);
        drop(first);
        // The owner notices the control channel closing.
        let t0 = std::time::Instant::now();
        while owner.queue_pairs() > 0 {
            assert!(
                t0.elapsed().as_secs() < 30,
                "the place was never given back"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        VerbsConnection::connect(owner.local_addr(), VerbsConfig::new(TOKEN))
            .expect("a place is free again");
    });
}
