//! The conformance suite on the `verbs` backend.
//!
//! Needs an RDMA device (RoCE, or soft-RoCE: `rdma link add rxe0 type rxe
//! netdev eth0`), named by `PAGEWIRE_RDMA_DEVICE` (the first device when
//! unset). The development and CI kernels have no RDMA, so these tests are
//! ignored by default; `rdma/scripts/softroce-test.sh` runs them inside a
//! soft-RoCE VM with `--ignored`.

#![cfg(feature = "verbs")]

mod conformance;

use std::sync::Arc;

use pagewire_rdma::Chaos;
use pagewire_rdma::verbs::{VerbsConfig, VerbsConnection, VerbsOwner, VerbsRegion};

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

conformance_tests!(Verbs, #[ignore = "needs an RDMA device: run rdma/scripts/softroce-test.sh"]);

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
