//! The mount's life: a dead cluster is EIO within the deadline (never a
//! hang) and the mount still unmounts on SIGTERM; a mount point left by a
//! crash (kill -9) is cleaned at the next start.

mod mount_common;

use mount_common::*;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

const FILE_LEN: u64 = 1024 * PS as u64;

#[test]
fn a_dead_cluster_is_eio_within_the_deadline_and_sigterm_still_unmounts() {
    let _s = serial();
    preflight(&["dd"]);
    let t0 = Instant::now();
    let mut cluster = Cluster::pattern(3, FILE_LEN);
    let deadline = Duration::from_millis(1500);
    // Two reads at a time on FUSE threads, two overflow workers: the
    // concurrent reads below fill both and queue more.
    let mut m = Mount::start(
        &cluster,
        "mnt",
        &["--deadline-ms", "1500", "--workers", "2"],
    );
    let want = std::fs::read(cluster.backing()).unwrap();
    let f = std::fs::File::open(m.file()).expect("open");
    let mut buf = vec![0u8; PS];
    f.read_exact_at(&mut buf, 5 * PS as u64)
        .expect("a read while the cluster is up");
    assert_eq!(buf[..], want[5 * PS..6 * PS]);

    cluster.kill_all();
    // Until the map's trust window closes (less than a lease) a one-sided
    // read of a dead node's shm region may still return its (right) bytes.
    std::thread::sleep(Duration::from_millis(cluster.lease_ms + 200));

    // Six reads at once: two run on FUSE threads, two on the overflow
    // workers, two wait in the queue. Each is EIO within the deadline, and
    // the spare FUSE threads answer a stat meanwhile at once.
    let reads: Vec<_> = (0..6u64)
        .map(|k| {
            let f = f.try_clone().expect("dup");
            std::thread::spawn(move || {
                let mut buf = vec![0u8; PS];
                let t = Instant::now();
                let r = f.read_exact_at(&mut buf, (100 + 50 * k) * PS as u64);
                (r.map_err(|e| e.raw_os_error()), t.elapsed())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // A directory listing is never cached by the kernel here (attributes
    // may be, for a second): it reaches the mount's threads.
    let t = Instant::now();
    let names: Vec<_> = std::fs::read_dir(m.file().parent().expect("the mount"))
        .expect("opendir")
        .map(|e| e.expect("readdir").file_name())
        .collect();
    let stat = t.elapsed();
    assert_eq!(names, [std::ffi::OsString::from("data")]);
    assert!(
        stat < Duration::from_millis(500),
        "listing the mount took {stat:?} while six reads waited on the dead cluster"
    );
    for r in reads {
        let (r, took) = r.join().expect("reader");
        assert_eq!(
            r,
            Err(Some(libc::EIO)),
            "a concurrent read of a dead cluster"
        );
        assert!(
            took < deadline + Duration::from_secs(2),
            "concurrent read: EIO after {took:?}, deadline {deadline:?}"
        );
    }
    eprintln!("MEASURE ls while six reads waited on the dead cluster: {stat:?}");

    for page in [7u64, 300, 1023] {
        let t = Instant::now();
        let e = f
            .read_exact_at(&mut buf, page * PS as u64)
            .expect_err("a read of a dead cluster returned bytes");
        let took = t.elapsed();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "page {page}: {e}");
        assert!(
            took < deadline + Duration::from_secs(2),
            "page {page}: EIO after {took:?}, deadline {deadline:?}"
        );
        eprintln!("MEASURE page {page}: EIO after {took:?} (deadline {deadline:?})");
    }
    // A program sees it the same way.
    let out = sh_bounded(
        &format!(
            "dd if={} bs=1M count=2 status=none of=/dev/null",
            m.file().display()
        ),
        deadline * 4 + Duration::from_secs(5),
    );
    assert!(!out.status.success(), "dd of a dead cluster succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Input/output error"), "dd said: {err}");
    // What needs no cluster still answers.
    assert_eq!(std::fs::metadata(m.file()).expect("stat").len(), FILE_LEN);
    let log = m.proc.log_text();
    assert!(log.contains("EIO"), "no log line for the EIO:\n{log}");

    drop(f);
    let t = Instant::now();
    let (st, unmounted) = m.stop();
    assert!(st.success(), "exit status after SIGTERM: {st}");
    assert!(unmounted, "still mounted after SIGTERM");
    eprintln!(
        "MEASURE SIGTERM with the cluster dead: unmounted and exited in {:?}",
        t.elapsed()
    );
    eprintln!("COVERED EIO, not a hang: {:?}", t0.elapsed());
}

#[test]
fn sigterm_unmounts_even_while_the_file_is_open_and_a_crashed_mount_is_cleaned_at_the_next_start() {
    let _s = serial();
    preflight(&[]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, FILE_LEN);
    let want = std::fs::read(cluster.backing()).unwrap();

    // SIGTERM while a process holds the file open: the mount is busy, so
    // it is detached and its connection aborted; the process exits 0.
    let mut m = Mount::start(&cluster, "mnt", &[]);
    let held = std::fs::File::open(m.file()).expect("open");
    let (st, unmounted) = m.stop();
    assert!(st.success(), "exit status after SIGTERM: {st}");
    assert!(unmounted, "still mounted after SIGTERM");
    let mut b = [0u8; 16];
    assert!(
        (&held).read(&mut b).is_err(),
        "a file open across the unmount still reads"
    );
    drop(held);

    // kill -9 leaves the mount point dead.
    let mut m = Mount::start(&cluster, "mnt", &[]);
    let dir = m.dir.clone();
    m.crash();
    drop(m);
    let e = std::fs::read_dir(&dir).expect_err("the dead mount answered");
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");

    // The next start cleans it, says so, and serves again.
    let mut m = Mount::start_on(&cluster, &dir, &[]);
    let log = m.proc.log_text();
    assert!(
        log.contains("Transport endpoint is not connected") && log.contains("fusermount3 -u -z"),
        "no log line about the dead mount:\n{log}"
    );
    let got = std::fs::read(m.file()).expect("read after the clean-up");
    assert!(got == want, "the file differs after the clean-up");
    // An unmount from outside ends the process, exit 0.
    sh_ok(
        &format!("fusermount3 -u {}", dir.display()),
        Duration::from_secs(10),
    );
    let st = m
        .proc
        .wait_for_exit(Duration::from_secs(10))
        .expect("pagewire-mount still runs after fusermount3 -u");
    assert!(st.success(), "exit status after fusermount3 -u: {st}");
    assert!(!is_mounted(&dir), "still mounted after fusermount3 -u");
    m.crash(); // gone already: nothing to clean up at drop
    eprintln!(
        "COVERED SIGTERM while open, crash clean-up, fusermount3 -u: {:?}",
        t0.elapsed()
    );
}
