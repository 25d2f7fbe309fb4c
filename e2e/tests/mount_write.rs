//! `--writable`: whole pages, partial pages (read-modify-write), writes
//! across pages and at the end of the file, read back through the mount,
//! through a `ClusterClient` and from the backing file; the size is fixed;
//! partial writers of one page through one mount lose no bytes.

mod mount_common;

use mount_common::*;
use pagewire_node::pattern;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::sync::Arc;
use std::time::Instant;

const PAGES: u64 = 1024;
/// The last page holds 3096 bytes.
const FILE_LEN: u64 = PAGES * PS as u64 - 1000;

const MMAP_WRITE: &str = r#"
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
off = 60 * 4096
before = m[off:off + 4096]
assert before != b"\x5c" * 4096
os.pwrite(fd, b"\x5c" * 4096, off)
after = m[off:off + 4096]
assert after == b"\x5c" * 4096, "the mapping still holds the old page"
print("mmap sees the write")
"#;

#[test]
fn a_writable_mount_writes_whole_and_partial_pages_through_to_the_cluster() {
    let _s = serial();
    preflight(&["python3"]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, FILE_LEN);
    let m = Mount::start(&cluster, "mnt", &["--writable"]);
    let md = std::fs::metadata(m.file()).unwrap();
    assert_eq!(md.permissions().mode() & 0o777, 0o644);
    let f = m.open_rw();
    // What the file should hold, kept up to date with every write.
    let mut want = std::fs::read(cluster.backing()).unwrap();
    let mut put = |f: &std::fs::File, off: u64, data: &[u8]| {
        f.write_all_at(data, off).expect("write");
        want[off as usize..off as usize + data.len()].copy_from_slice(data);
    };

    // A whole page: page 10 at generation 1.
    let mut page = vec![0u8; PS];
    pattern::fill(10, 1, &mut page);
    put(&f, 10 * PS as u64, &page);
    // Part of a page, and a write across two pages.
    put(&f, 20 * PS as u64 + 10, &[0xab; 100]);
    put(&f, 31 * PS as u64 - 150, &[0xcd; 300]);
    // Two whole pages and a part of a third in one write.
    put(&f, 40 * PS as u64, &vec![0x11; 2 * PS + 7]);
    // The partial last page: a part, then its whole valid length.
    put(&f, (PAGES - 1) * PS as u64 + 100, &[0xee; 50]);
    f.sync_all().expect("fsync");

    // Through the mount.
    let mut got = vec![0u8; FILE_LEN as usize];
    f.read_exact_at(&mut got, 0).expect("read back");
    assert!(got == want, "the mount does not read back what was written");
    // Through a client of its own.
    let client = cluster.client();
    let mut buf = vec![0u8; PS];
    for p in [10u64, 20, 30, 31, 40, 41, 42, PAGES - 1] {
        client.read_page(p, &mut buf).expect("client read");
        let len = client.page_len(p);
        let off = p as usize * PS;
        assert!(
            buf[..len] == want[off..off + len],
            "page {p} through a ClusterClient"
        );
    }
    client.read_page(10, &mut buf).expect("client read");
    assert_eq!(
        pattern::verify(10, &buf),
        Ok(1),
        "page 10 is the pattern at generation 1"
    );
    // Write-through: the backing file has it.
    let backing = std::fs::read(cluster.backing()).unwrap();
    assert!(backing == want, "the backing file does not hold the writes");

    // The size is fixed.
    let e = f.set_len(FILE_LEN - 1).expect_err("truncated");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let e = f.set_len(FILE_LEN + 1).expect_err("extended");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let e = f.write_at(b"x", FILE_LEN).expect_err("wrote past the end");
    assert_eq!(e.raw_os_error(), Some(libc::EFBIG), "{e}");
    let n = f
        .write_at(&[0x77; 100], FILE_LEN - 10)
        .expect("a write across the end");
    assert_eq!(n, 10, "a write across the end is cut at the end");
    want[FILE_LEN as usize - 10..].fill(0x77);
    let e = std::fs::File::create(m.file()).expect_err("opened with O_TRUNC");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let e = std::fs::File::create(m.dir.join("other")).expect_err("created a file");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");

    // A shared mapping sees a write through the mount to a page it holds
    // (the kernel drops the mapped page on a direct write).
    let script = cluster.path("mmap_write.py");
    std::fs::write(&script, MMAP_WRITE).unwrap();
    let py = sh_ok(
        &format!("python3 {} {}", script.display(), m.file().display()),
        std::time::Duration::from_secs(60),
    );
    assert!(py.contains("mmap sees the write"), "{py}");
    let off = 60 * PS;
    want[off..off + PS].fill(0x5c);

    // Partial writers of one page through this mount: each writes its own
    // 64 bytes of page 50 over and over; none may lose another's bytes.
    let path = Arc::new(m.file());
    let writers: Vec<_> = (0..8u8)
        .map(|w| {
            let path = path.clone();
            std::thread::spawn(move || {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&*path)
                    .unwrap();
                for round in 0..20u8 {
                    let bytes = [w.wrapping_mul(31).wrapping_add(round); 64];
                    f.write_all_at(&bytes, 50 * PS as u64 + u64::from(w) * 64)
                        .expect("write");
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    for w in 0..8u8 {
        let off = 50 * PS + usize::from(w) * 64;
        want[off..off + 64].fill(w.wrapping_mul(31).wrapping_add(19));
    }
    f.read_exact_at(&mut got, 0).expect("read back");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g,
            w,
            "byte {i} (page {}) after concurrent partial writes",
            i / PS
        );
    }

    // A --cached 1 mount: a page it cached, written elsewhere (through the
    // client), is seen within the bound (1 s, plus the read itself).
    let cached = Mount::start(&cluster, "cached", &["--cached", "1"]);
    let cf = std::fs::File::open(cached.file()).unwrap();
    let mut page = vec![0u8; PS];
    cf.read_exact_at(&mut page, 70 * PS as u64).unwrap();
    assert!(page[..] == want[70 * PS..71 * PS]);
    let mut new = vec![0u8; PS];
    pattern::fill(70, 1, &mut new);
    client.write_page(70, &new).expect("client write");
    let written = Instant::now();
    cf.read_exact_at(&mut page, 70 * PS as u64).unwrap();
    let stale_at_once = page != new;
    while page != new {
        assert!(
            written.elapsed() < std::time::Duration::from_secs(3),
            "a --cached 1 mount still serves the old page after {:?}",
            written.elapsed()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
        cf.read_exact_at(&mut page, 70 * PS as u64).unwrap();
    }
    eprintln!(
        "MEASURE --cached 1: a write elsewhere seen after {:?} (the read right after it was {})",
        written.elapsed(),
        if stale_at_once {
            "stale, from the cache"
        } else {
            "already new"
        }
    );
    eprintln!("COVERED writable mount: {:?}", t0.elapsed());
}
