//! Read-ahead never returns a page older than an acknowledged write: a
//! sequential reader over tcp (where the mount reads ahead) whose next run,
//! already read ahead, is written in between (through another client, and
//! through the mount itself) reads the new bytes; and the run read ahead
//! was really used where nothing changed. `ClusterClient::still_current`,
//! what the mount checks a run with, says the same at the client.

mod mount_common;

use mount_common::*;
use pagewire_node::pattern;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

const PAGES: u64 = 1024;
/// Pages per read: two extents, so a run can span two owners.
const RUN: u64 = 32;

#[test]
fn a_run_read_ahead_is_checked_against_writes_acknowledged_before_the_read() {
    let _s = serial();
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, PAGES * PS as u64);
    let mut m = Mount::start(
        &cluster,
        "mnt",
        &["--transport", "tcp", "--writable", "--deadline-ms", "20000"],
    );
    let f = m.open_rw();
    let client = cluster.client();
    let mut want = std::fs::read(cluster.backing()).unwrap();
    let run_bytes = RUN as usize * PS;
    let mut got = vec![0u8; run_bytes];
    let mut written = 0u64;
    let runs = PAGES / RUN;
    for r in 0..runs {
        let off = r as usize * run_bytes;
        f.read_exact_at(&mut got, off as u64).expect("read");
        for (i, (g, w)) in got.iter().zip(&want[off..off + run_bytes]).enumerate() {
            assert_eq!(
                g,
                w,
                "byte {} (page {}) of run {r}: read-ahead returned an older page",
                off + i,
                (off + i) / PS
            );
        }
        if r + 1 == runs || r % 2 == 0 {
            // Odd runs are read as read ahead, untouched.
            continue;
        }
        // Let the next run's read-ahead finish, then write one of its pages
        // (acknowledged before the next read starts).
        std::thread::sleep(Duration::from_millis(200));
        let page = (r + 1) * RUN + (r * 7) % RUN;
        let generation = 1 + r;
        let mut bytes = vec![0u8; PS];
        pattern::fill(page, generation, &mut bytes);
        if r % 4 == 1 {
            client.write_page(page, &bytes).expect("client write");
        } else {
            f.write_all_at(&bytes, page * PS as u64)
                .expect("write through the mount");
        }
        want[page as usize * PS..(page as usize + 1) * PS].copy_from_slice(&bytes);
        written += 1;
    }

    // The client's check of a run it read: still current until a page of
    // it is written.
    let mut buf = vec![0u8; 4 * PS];
    let info = client.read_run(100, 4, &mut buf).expect("client read");
    assert!(
        client.still_current(100, &info.pages),
        "a run nobody wrote is not current: {:?}",
        info.pages
    );
    let mut bytes = vec![0u8; PS];
    pattern::fill(102, 9, &mut bytes);
    client.write_page(102, &bytes).expect("client write");
    assert!(
        !client.still_current(100, &info.pages),
        "a run is still current after a write to one of its pages was acknowledged"
    );

    let line = m.stop_and_find("read-ahead: ");
    let count = |what: &str| -> u64 {
        let at = line
            .find(what)
            .unwrap_or_else(|| panic!("{what:?} in {line}"));
        line[..at]
            .split_whitespace()
            .last()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a count before {what:?} in {line}"))
    };
    let (used, stale) = (count(" used"), count(" stale"));
    eprintln!("MEASURE {line}");
    // Every written run was read ahead and then refused, unless the reader
    // reached it first (then it read the run itself); the untouched ones
    // were used.
    assert!(
        (stale >= 1 || used == 0) && stale <= written,
        "{stale} runs read ahead were stale, {written} written: {line}"
    );
    // The mount reads ahead only with a core to spare beside the read.
    if std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 {
        assert!(used >= 1, "no run read ahead was used: {line}");
    }
    eprintln!("COVERED read-ahead vs writes: {:?}", t0.elapsed());
}
