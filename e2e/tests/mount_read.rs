//! Reading the cluster's file through the mount with the programs people
//! use (stat, ls, cat, dd, pread, Python's mmap), in the default direct-I/O
//! mode and with `--cached`; every byte is compared with the backing file.

mod mount_common;

use mount_common::*;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const PAGES: u64 = 4096;
/// The last page holds 3096 bytes.
const FILE_LEN: u64 = PAGES * PS as u64 - 1000;
const T: Duration = Duration::from_secs(60);

const MMAP_CHECK: &str = r#"
import mmap, random, sys
path, backing = sys.argv[1], sys.argv[2]
with open(path, "rb") as a, open(backing, "rb") as b:
    want = mmap.mmap(b.fileno(), 0, prot=mmap.PROT_READ)
    shared = mmap.mmap(a.fileno(), 0, prot=mmap.PROT_READ)  # MAP_SHARED
    assert len(shared) == len(want), (len(shared), len(want))
    n = len(want)
    r = random.Random(7)
    for _ in range(300):
        page = r.randrange(0, (n + 4095) // 4096)
        off = page * 4096
        assert shared[off:off + 4096] == want[off:off + 4096], "page %d" % page
    assert shared[n - 5000:] == want[n - 5000:], "the tail"
    assert shared[:] == want[:], "the whole file"
    private = mmap.mmap(a.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    assert private[12345:99999] == want[12345:99999], "MAP_PRIVATE"
print("mmap ok", n)
"#;

#[test]
fn stat_cat_dd_pread_and_mmap_read_every_byte_in_both_modes() {
    let _s = serial();
    preflight(&["python3", "cmp", "dd"]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, FILE_LEN);
    let backing = cluster.backing();
    let want = std::fs::read(&backing).expect("backing");
    let script = cluster.path("mmap_check.py");
    std::fs::write(&script, MMAP_CHECK).expect("script");

    for (mnt, args) in [("direct", &[][..]), ("cached", &["--cached", "2"][..])] {
        let t = Instant::now();
        let mut m = Mount::start(&cluster, mnt, args);
        let f = m.file();
        let (fs, bs) = (f.display(), backing.display());

        // stat and ls.
        let md = std::fs::metadata(&f).expect("stat");
        assert!(md.is_file());
        assert_eq!(md.len(), FILE_LEN);
        assert_eq!(
            md.permissions().mode() & 0o777,
            0o444,
            "read-only by default"
        );
        let names: Vec<String> = std::fs::read_dir(&m.dir)
            .expect("readdir")
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["data"]);

        // cat, and dd with big and small blocks.
        let out = cluster.path("out");
        sh_ok(
            &format!("cat {fs} > {} && cmp {} {bs}", out.display(), out.display()),
            T,
        );
        sh_ok(&format!("dd if={fs} bs=1M status=none | cmp - {bs}"), T);
        let got = sh_bounded(
            &format!("dd if={fs} bs=4k skip=1001 count=37 status=none"),
            T,
        );
        assert!(got.status.success());
        assert_eq!(
            got.stdout[..],
            want[1001 * PS..1038 * PS],
            "dd bs=4k skip=1001 count=37"
        );
        let got = sh_bounded(
            &format!("dd if={fs} bs=4k skip={} count=10 status=none", PAGES - 2),
            T,
        );
        assert_eq!(
            got.stdout[..],
            want[(PAGES as usize - 2) * PS..],
            "the last two pages, the last one partial"
        );

        // pread at odd offsets and lengths, across pages and past the end.
        let file = std::fs::File::open(&f).expect("open");
        let mut rng = SmallRng::seed_from_u64(3);
        for _ in 0..300 {
            let off = rng.random_range(0..FILE_LEN + 100);
            let len = rng.random_range(1..3 * PS);
            let mut buf = vec![0u8; len];
            let n = file.read_at(&mut buf, off).expect("pread");
            let end = (off + len as u64).min(FILE_LEN);
            let expect = end.saturating_sub(off) as usize;
            assert_eq!(n, expect, "pread of {len} at {off}");
            assert!(
                buf[..n] == want[off as usize..off as usize + n],
                "pread of {len} at {off}"
            );
        }

        // mmap, shared and private.
        let py = sh_ok(&format!("python3 {} {fs} {bs}", script.display()), T);
        assert!(py.contains("mmap ok"), "{py}");

        // Read-only: no write, no truncate.
        let e = std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .expect_err("opened for writing on a read-only mount");
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");

        drop(file);
        let (st, unmounted) = m.stop();
        assert!(st.success(), "exit status after SIGTERM: {st}");
        assert!(unmounted, "still mounted after SIGTERM");
        eprintln!(
            "COVERED {mnt}: stat, ls, cat, dd, pread, mmap in {:?}",
            t.elapsed()
        );
    }
    eprintln!("COVERED reads in both modes: {:?}", t0.elapsed());
}
