//! fio through the mount, every block verified: the backing file is
//! written by fio first with a crc32c header in every 4 KiB block (its
//! offset, and a checksum over the whole block), and the reads through the
//! mount check every block they read (`--verify=crc32c`, fatal). Random 4k
//! reads with 16 jobs (16 reads outstanding), sequential 1 MiB reads, the
//! same with `--cached`, and random reads while a node is killed (-9) and
//! restarted. A first test proves that the fio invocation does catch one
//! wrong byte.

mod mount_common;

use mount_common::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// 32 MiB: 8192 pages.
const SIZE: u64 = 32 << 20;

/// Writes `path` with fio: 4k blocks, each with a verify header.
fn fio_write(path: &Path, size: u64) {
    sh_ok(
        &format!(
            "fio --name=fill --filename={} --rw=write --bs=4k --size={size} \
             --ioengine=psync --verify=crc32c --do_verify=0 --verify_state_save=0 \
             --output-format=terse",
            path.display()
        ),
        Duration::from_secs(60),
    );
}

/// Random 4k reads of the whole of `path` by 16 jobs (each its own
/// slice), every block verified once (fio ignores `--loops` when it
/// verifies reads).
fn fio_randread(path: &Path, size: u64) -> String {
    format!(
        "fio --name=rand --filename={} --rw=randread --bs=4k --size={} --offset_increment={} \
         --numjobs=16 --ioengine=psync --verify=crc32c --verify_fatal=1 \
         --group_reporting",
        path.display(),
        size / 16,
        size / 16
    )
}

/// [`fio_randread`] for `secs` seconds however fast the reads are (each
/// job starts its slice again when it has read it all; every block read
/// is verified): one pass of the file took under a second in a release
/// build, and so ended before the kill it was meant to overlap.
fn fio_randread_for(path: &Path, size: u64, secs: u32) -> String {
    format!("{} --time_based --runtime={secs}", fio_randread(path, size))
}

/// Sequential 1 MiB reads by 4 jobs, the 4k blocks in each verified.
fn fio_seqread(path: &Path, size: u64) -> String {
    format!(
        "fio --name=seq --filename={} --rw=read --bs=1M --size={} --offset_increment={} \
         --numjobs=4 --ioengine=psync --verify=crc32c --verify_interval=4096 --verify_fatal=1 \
         --group_reporting",
        path.display(),
        size / 4,
        size / 4
    )
}

/// Runs a fio command that must succeed with no verify error; the bandwidth
/// line.
fn fio_ok(cmd: &str, limit: Duration) -> String {
    let out = sh_bounded(cmd, limit);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "`{cmd}` failed ({}):\n{text}",
        out.status
    );
    assert!(
        !text.contains("verify failed") && !text.contains("bad ") && text.contains("err= 0"),
        "`{cmd}` reported errors:\n{text}"
    );
    text.lines()
        .filter(|l| l.contains("IOPS=") || l.contains("READ:"))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" | ")
}

#[test]
fn the_fio_verification_used_here_catches_one_wrong_byte() {
    let _s = serial();
    preflight(&["fio"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("f");
    let size = 4 << 20;
    fio_write(&f, size);
    fio_ok(&fio_randread(&f, size), Duration::from_secs(60));
    fio_ok(&fio_seqread(&f, size), Duration::from_secs(60));
    // One byte in the middle of a block, past its header.
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[3 * 1_048_576 + 5 * 4096 + 2000] ^= 0x5a;
    std::fs::write(&f, &bytes).unwrap();
    for cmd in [fio_randread(&f, size), fio_seqread(&f, size)] {
        let out = sh_bounded(&cmd, Duration::from_secs(60));
        assert!(!out.status.success(), "fio missed a wrong byte: `{cmd}`");
    }
}

#[test]
fn fio_random_4k_and_sequential_1m_reads_verify_every_block_in_both_modes() {
    let _s = serial();
    preflight(&["fio"]);
    let t0 = Instant::now();
    let cluster = Cluster::start(3, 2048, 1000, |p| fio_write(p, SIZE));
    for (mnt, args) in [("direct", &[][..]), ("cached", &["--cached", "5"][..])] {
        let m = Mount::start(&cluster, mnt, args);
        let f = m.file();
        let t = Instant::now();
        let rand = fio_ok(&fio_randread(&f, SIZE), Duration::from_secs(120));
        eprintln!(
            "MEASURE {mnt} fio randread 4k, 16 jobs, 32 MiB: {rand} ({:?})",
            t.elapsed()
        );
        let t = Instant::now();
        let seq = fio_ok(&fio_seqread(&f, SIZE), Duration::from_secs(120));
        eprintln!(
            "MEASURE {mnt} fio read 1M, 4 jobs, 32 MiB: {seq} ({:?})",
            t.elapsed()
        );
        drop(m);
    }
    eprintln!(
        "COVERED fio verified reads in both modes: {:?}",
        t0.elapsed()
    );
}

#[test]
fn fio_verifies_every_block_while_a_node_is_killed_and_restarted() {
    let _s = serial();
    preflight(&["fio"]);
    let t0 = Instant::now();
    let mut cluster = Cluster::start(3, 2048, 1000, |p| fio_write(p, SIZE));
    let m = Mount::start(&cluster, "mnt", &[]);
    // Killed at 1 s, restarted at 2.5 s: 5 s of reads cover both and the
    // rejoin after them.
    let cmd = fio_randread_for(&m.file(), SIZE, 5);
    let fio = std::thread::spawn(move || {
        let t = Instant::now();
        (fio_ok(&cmd, Duration::from_secs(120)), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        !fio.is_finished(),
        "fio finished before the kill: it was to run 5 s"
    );
    cluster.node("n2").kill9();
    let killed = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    cluster.start_node("n2");
    let (line, took) = fio.join().expect("fio");
    eprintln!(
        "MEASURE fio randread 4k through kill -9 and restart of a node: {line}; fio took {took:?}, \
         the kill was {:?} before its end",
        killed.elapsed()
    );
    cluster.wait_stable(3);
    assert!(
        !m.proc.log_text().contains("EIO"),
        "a read failed during the failover:\n{}",
        m.proc.log_text()
    );
    eprintln!("COVERED fio through a node kill: {:?}", t0.elapsed());
}
