//! The conformance suite on the `shm` backend.

mod conformance;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pagewire_rdma::Chaos;
use pagewire_rdma::shm::{ShmConfig, ShmConnection, ShmOwner, ShmRegion};

struct Shm {
    owner: Arc<ShmOwner>,
    chaos: Option<Chaos>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl conformance::Harness for Shm {
    type Region = ShmRegion;
    type Conn = ShmConnection;
    const CHAOS: bool = true;

    fn new(chaos: Option<Chaos>) -> Self {
        let name = format!(
            "conformance-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Self {
            owner: Arc::new(ShmOwner::create(&name).expect("create owner")),
            chaos,
        }
    }

    fn register(&self, len: usize) -> ShmRegion {
        self.owner.register(len).expect("register")
    }

    fn connect(&self) -> ShmConnection {
        ShmConnection::connect(
            self.owner.name(),
            ShmConfig {
                dir: None,
                chaos: self.chaos,
            },
        )
        .expect("connect")
    }

    fn kill(&self) {
        self.owner.close();
    }
}

conformance_tests!(Shm);

#[test]
fn torn_reads_happen_in_chaos_mode() {
    conformance::bounded(60, || {
        conformance::concurrent_rewrites_are_detectable::<Shm>(Some(Chaos {
            pause: Some(Duration::from_micros(500)),
        }))
    });
}

#[test]
fn stale_epoch_is_refused() {
    conformance::bounded(30, conformance::stale_epoch_is_refused::<Shm>);
}
