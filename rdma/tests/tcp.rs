//! The conformance suite on the `tcp` backend, plus its own wire checks.

mod conformance;

use std::sync::Arc;
use std::time::Duration;

use pagewire_rdma::tcp::{
    ConnectionConfig, ResponderConfig, TcpConnection, TcpRegion, TcpResponder,
};
use pagewire_rdma::{Chaos, ConnectError};

const TOKEN: &[u8] = b"conformance cluster token";

struct Tcp {
    responder: Arc<TcpResponder>,
}

impl conformance::Harness for Tcp {
    type Region = TcpRegion;
    type Conn = TcpConnection;
    const CHAOS: bool = true;

    fn new(chaos: Option<Chaos>) -> Self {
        let mut config = ResponderConfig::new(TOKEN);
        config.chaos = chaos;
        Self {
            responder: Arc::new(TcpResponder::bind("127.0.0.1:0", config).expect("bind")),
        }
    }

    fn register(&self, len: usize) -> TcpRegion {
        self.responder.register(len).expect("register")
    }

    fn connect(&self) -> TcpConnection {
        TcpConnection::connect(self.responder.local_addr(), ConnectionConfig::new(TOKEN))
            .expect("connect")
    }

    fn kill(&self) {
        self.responder.shutdown();
    }
}

conformance_tests!(Tcp);

#[test]
fn torn_reads_happen_in_chaos_mode() {
    conformance::bounded(60, || {
        conformance::concurrent_rewrites_are_detectable::<Tcp>(Some(Chaos {
            pause: Some(Duration::from_micros(500)),
        }))
    });
}

#[test]
fn stale_epoch_is_refused() {
    conformance::bounded(30, conformance::stale_epoch_is_refused::<Tcp>);
}

#[test]
fn wrong_token_is_refused() {
    conformance::bounded(30, || {
        let h = <Tcp as conformance::Harness>::new(None);
        let e = TcpConnection::connect(
            h.responder.local_addr(),
            ConnectionConfig::new(b"not the token".to_vec()),
        );
        assert!(matches!(e, Err(ConnectError::AuthFailed)), "{:?}", e.err());
        // The responder still serves clients that hold the token.
        let _ok = <Tcp as conformance::Harness>::connect(&h);
    });
}
