//! The conformance suite on the `tcp` backend, plus its own wire checks.

mod conformance;

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagewire_rdma::tcp::{ConnectionConfig, OwnerConfig, TcpConnection, TcpOwner, TcpRegion};
use pagewire_rdma::{
    Chaos, ConnectError, Connection, LocalRegion, MemoryOwner, OwnerError, ReadError,
};

const TOKEN: &[u8] = b"conformance cluster token";

struct Tcp {
    responder: Arc<TcpOwner>,
}

impl conformance::Harness for Tcp {
    type Region = TcpRegion;
    type Conn = TcpConnection;
    const CHAOS: bool = true;

    fn new(chaos: Option<Chaos>) -> Self {
        let mut config = OwnerConfig::new(TOKEN);
        config.chaos = chaos;
        Self {
            responder: Arc::new(TcpOwner::bind("127.0.0.1:0", config).expect("bind")),
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

impl conformance::EpochHarness for Tcp {
    fn with_epoch(epoch: u64) -> Self {
        let mut config = OwnerConfig::new(TOKEN);
        config.epoch = Some(epoch);
        let responder = TcpOwner::bind("127.0.0.1:0", config).expect("bind");
        assert_eq!(responder.epoch(), epoch);
        Self {
            responder: Arc::new(responder),
        }
    }
}

impl conformance::ExternalHarness for Tcp {
    unsafe fn register_external(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        owner: MemoryOwner,
    ) -> TcpRegion {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.responder.register_external(ptr, len, owner) }.expect("register external")
    }
}

conformance_tests!(Tcp);

/// The suite again with every connection a handle of one shared connection
/// (how a reader process shares one per owner among its threads).
mod shared {
    use super::{Tcp, conformance};
    crate::conformance_tests!(conformance::Shared<Tcp>);
}

/// And with the handles sleeping on the socket without the lock, as the
/// client's one tcp connection per owner does.
mod shared_fd {
    use super::{Tcp, conformance};
    crate::conformance_tests!(conformance::Shared<Tcp, true>);
}
epoch_tests!(Tcp);
external_memory_tests!(Tcp);

#[test]
fn epoch_zero_is_refused() {
    let mut config = OwnerConfig::new(TOKEN);
    config.epoch = Some(0);
    let e = TcpOwner::bind("127.0.0.1:0", config);
    assert!(matches!(e, Err(OwnerError::ZeroEpoch)), "{:?}", e.err());
}

/// Without spinning (spin 0 on both sides) READs are served as with it, and
/// with a huge spin a responder still shuts down promptly: a spinning
/// serving thread notices the close, a spinning reader its timeout.
#[test]
fn spinning_is_bounded_and_optional() {
    conformance::bounded(60, || {
        for spin in [Duration::ZERO, Duration::from_secs(30)] {
            let mut rc = OwnerConfig::new(TOKEN);
            rc.spin = spin;
            let resp = TcpOwner::bind("127.0.0.1:0", rc).expect("bind");
            let r = resp.register(64 << 10).expect("register");
            let p = conformance::pattern(64 << 10, 31);
            r.write_bytes(0, &p);
            let d = r.descriptor();
            let mut cc = ConnectionConfig::new(TOKEN);
            cc.spin = spin;
            let mut c = TcpConnection::connect(resp.local_addr(), cc).expect("connect");
            for i in 0..200u64 {
                let off = (i * 4096) % (60 << 10);
                let mut buf = vec![0u8; 4096];
                let res = pagewire_rdma::read_blocking(&mut c, d, &mut [(off, &mut buf[..])])
                    .expect("post");
                assert_eq!(res, vec![Ok(())]);
                assert!(
                    buf[..] == p[off as usize..off as usize + 4096],
                    "spin {spin:?}: wrong bytes"
                );
            }
            // An empty wait returns at once, spin or not.
            let t = Instant::now();
            assert_eq!(c.wait(&mut Vec::new(), Duration::from_secs(5)), 0);
            assert!(t.elapsed() < Duration::from_secs(1));
            // Shutdown while the serving thread may be spinning.
            let t = Instant::now();
            resp.shutdown();
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "spin {spin:?}: shutdown took {:?}",
                t.elapsed()
            );
            let mut buf = [0u8; 64];
            let res = pagewire_rdma::read_blocking(&mut c, d, &mut [(0, &mut buf[..])]);
            match res {
                Err(_) => {}
                Ok(v) => assert_eq!(v, vec![Err(ReadError::ConnectionLost)]),
            }
        }
    });
}

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

/// A responder whose process is frozen still completes the TCP handshake in
/// its kernel, but never answers the hello: the connect gives up after
/// `connect_timeout`, not the default 10 s.
#[test]
fn a_silent_responder_times_out_the_connect() {
    conformance::bounded(30, || {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let start = Instant::now();
        let e = TcpConnection::connect(
            silent.local_addr().expect("addr"),
            ConnectionConfig {
                connect_timeout: Duration::from_millis(200),
                ..ConnectionConfig::new(TOKEN)
            },
        );
        let took = start.elapsed();
        assert!(matches!(e, Err(ConnectError::Io(_))), "{:?}", e.err());
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_secs(3),
            "gave up after {took:?}"
        );
    });
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

/// CALLs share a connection with READs: the handler's reply comes back,
/// READs before and after it complete, and an owner without a handler, a
/// call for another epoch and an argument too long are refused while the
/// connection keeps working.
#[test]
fn calls_reach_the_handler_between_reads() {
    use pagewire_rdma::CallError;
    use pagewire_rdma::tcp::MAX_CALL_ARG;
    let owner = TcpOwner::bind("127.0.0.1:0", OwnerConfig::new(TOKEN)).expect("bind");
    let r = owner.register(8192).expect("register");
    r.write_bytes(0, &(0..=255u8).cycle().take(8192).collect::<Vec<_>>());
    let d = r.descriptor();
    let mut c =
        TcpConnection::connect(owner.local_addr(), ConnectionConfig::new(TOKEN)).expect("connect");
    let read = |c: &mut TcpConnection, off: u64| {
        let mut b = [0u8; 4];
        let res = pagewire_rdma::read_blocking(c, d, &mut [(off, &mut b[..])]).expect("post");
        assert_eq!(res, vec![Ok(())]);
        b
    };
    let t = Duration::from_secs(10);
    assert_eq!(c.call(d.epoch, b"ping", t), Err(CallError::NoHandler));
    assert_eq!(read(&mut c, 4), [4, 5, 6, 7]);
    owner.set_call_handler(Arc::new(|arg: &[u8], out: &mut Vec<u8>| {
        out.extend(arg.iter().rev());
        out.extend_from_slice(&(arg.len() as u64).to_le_bytes());
    }));
    let mut want: Vec<u8> = b"gnip".to_vec();
    want.extend_from_slice(&4u64.to_le_bytes());
    assert_eq!(c.call(d.epoch, b"ping", t), Ok(want));
    assert_eq!(read(&mut c, 8), [8, 9, 10, 11]);
    // Empty and largest arguments.
    assert_eq!(c.call(d.epoch, b"", t), Ok(0u64.to_le_bytes().to_vec()));
    let big: Vec<u8> = (0..MAX_CALL_ARG).map(|i| (i % 251) as u8).collect();
    let got = c.call(d.epoch, &big, t).expect("largest argument");
    assert_eq!(got.len(), MAX_CALL_ARG + 8);
    assert!(got[..MAX_CALL_ARG].iter().eq(big.iter().rev()));
    assert_eq!(
        c.call(d.epoch, &vec![0; MAX_CALL_ARG + 1], t),
        Err(CallError::TooLong {
            len: MAX_CALL_ARG + 1,
            limit: MAX_CALL_ARG
        })
    );
    assert_eq!(
        c.call(d.epoch ^ 1, b"x", t),
        Err(CallError::Refused(pagewire_rdma::AccessFault::StaleEpoch))
    );
    assert_eq!(read(&mut c, 8188), [252, 253, 254, 255]);
}

/// A call is refused while READs are outstanding (nothing sent), and one
/// whose handler outlives its timeout times out; its late reply is
/// skipped, and the next call and READ get their own answers.
#[test]
fn a_late_call_reply_is_skipped() {
    use pagewire_rdma::CallError;
    let owner = TcpOwner::bind("127.0.0.1:0", OwnerConfig::new(TOKEN)).expect("bind");
    let r = owner.register(4096).expect("register");
    r.write_bytes(0, &[7; 4096]);
    let d = r.descriptor();
    owner.set_call_handler(Arc::new(|arg: &[u8], out: &mut Vec<u8>| {
        if arg == b"slow" {
            std::thread::sleep(Duration::from_millis(300));
        }
        out.extend_from_slice(arg);
    }));
    let mut c =
        TcpConnection::connect(owner.local_addr(), ConnectionConfig::new(TOKEN)).expect("connect");
    let mut b = [0u8; 16];
    let req = pagewire_rdma::ReadRequest::new(1, d, 0, &mut b);
    // SAFETY: `b` lives and is untouched until its completion is waited for below.
    unsafe { c.post_reads(&[req]).expect("post") };
    assert_eq!(
        c.call(d.epoch, b"x", Duration::from_secs(1)),
        Err(CallError::Busy(1))
    );
    let mut done = Vec::new();
    while done.is_empty() {
        c.wait(&mut done, Duration::from_secs(1));
    }
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(b, [7; 16]);
    let t0 = Instant::now();
    assert_eq!(
        c.call(d.epoch, b"slow", Duration::from_millis(50)),
        Err(CallError::Timeout)
    );
    assert!(
        t0.elapsed() < Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        c.call(d.epoch, b"fast", Duration::from_secs(10)),
        Ok(b"fast".to_vec())
    );
    let res = pagewire_rdma::read_blocking(&mut c, d, &mut [(8, &mut b[..4])]).expect("post after");
    assert_eq!(res, vec![Ok(())]);
}

/// A call handler that drops the last owner of its responder (as the node
/// daemon's may at shutdown) runs to its end: the responder's shutdown, on
/// that handler's serving thread, does not try to join the thread itself.
#[test]
fn a_handler_may_drop_the_last_owner_of_its_responder() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    let owner = Arc::new(TcpOwner::bind("127.0.0.1:0", OwnerConfig::new(TOKEN)).expect("bind"));
    let region = owner.register(4096).expect("register");
    let d = region.descriptor();
    let keep = Arc::new(Mutex::new(Some(Arc::clone(&owner))));
    let finished = Arc::new(AtomicBool::new(false));
    {
        let (keep, finished) = (Arc::clone(&keep), Arc::clone(&finished));
        owner.set_call_handler(Arc::new(move |_: &[u8], out: &mut Vec<u8>| {
            let last = keep.lock().expect("keep").take();
            drop(last);
            finished.store(true, Ordering::SeqCst);
            out.push(1);
        }));
    }
    let mut c =
        TcpConnection::connect(owner.local_addr(), ConnectionConfig::new(TOKEN)).expect("connect");
    drop(region);
    drop(owner);
    // The owner answers or is gone; either way the handler ran to its end.
    let _ = c.call(d.epoch, b"x", Duration::from_secs(10));
    let t0 = Instant::now();
    while !finished.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the handler never finished: dropping the responder from it failed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(keep.lock().expect("keep").is_none());
}
