//! A real `tcp` connection whose responder answers with the input: after the
//! handshake the fake responder reads the connection's READ requests
//! (`pagewire_fuzz::seeds::READS`), sends the input and closes. Every READ
//! completes exactly once (`read_blocking` returns), and no answer writes
//! past a READ's buffer (canaries).
#![no_main]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use pagewire_fuzz::TOKEN;
use pagewire_fuzz::seeds::{READS, connection_config, post_fixed_reads};
use pagewire_rdma::tcp::{REQUEST_LEN, TcpConnection, handshake_server};

struct Fake {
    addr: std::net::SocketAddr,
    script: Mutex<SyncSender<Vec<u8>>>,
}

fn fake() -> &'static Fake {
    static F: OnceLock<Fake> = OnceLock::new();
    F.get_or_init(|| {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
        let addr = listener.local_addr().expect("address");
        let (tx, rx): (SyncSender<Vec<u8>>, Receiver<Vec<u8>>) = sync_channel(1);
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let mut s = s.expect("accept");
                let answer = rx.recv().expect("the input of this connection");
                if !handshake_server(&mut s, TOKEN).unwrap_or(false) {
                    continue;
                }
                let mut req = vec![0u8; READS.len() * REQUEST_LEN];
                if s.read_exact(&mut req).is_err() {
                    continue;
                }
                let _ = s.write_all(&answer);
                // Dropping `s` closes the connection: what is still pending
                // completes as lost.
            }
        });
        Fake {
            addr,
            script: Mutex::new(tx),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fake();
    f.script.lock().unwrap().send(data.to_vec()).unwrap();
    let mut conn = TcpConnection::connect(f.addr, connection_config()).expect("connect");
    let results = post_fixed_reads(&mut conn);
    assert_eq!(results.len(), READS.len());
});
