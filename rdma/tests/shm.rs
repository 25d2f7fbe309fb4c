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

impl conformance::EpochHarness for Shm {
    fn with_epoch(epoch: u64) -> Self {
        let name = format!(
            "conformance-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let owner = ShmOwner::create_in_with_epoch(
            std::path::Path::new(pagewire_rdma::shm::DEFAULT_DIR),
            &name,
            epoch,
        )
        .expect("create owner");
        assert_eq!(owner.epoch(), epoch);
        Self {
            owner: Arc::new(owner),
            chaos: None,
        }
    }
}

conformance_tests!(Shm);

/// The suite again with every connection a handle of one shared connection
/// (how a reader process shares one per owner among its threads).
mod shared {
    use super::{Shm, conformance};
    crate::conformance_tests!(conformance::Shared<Shm>);
}
epoch_tests!(Shm);

#[test]
fn epoch_zero_is_refused() {
    let e = ShmOwner::create_in_with_epoch(
        std::path::Path::new(pagewire_rdma::shm::DEFAULT_DIR),
        &format!("conformance-zero-{}", std::process::id()),
        0,
    );
    assert!(
        matches!(e, Err(pagewire_rdma::OwnerError::ZeroEpoch)),
        "{:?}",
        e.err()
    );
}

/// The data area starts on a page boundary (the node puts page frames there).
#[test]
fn region_data_is_page_aligned() {
    use pagewire_rdma::LocalRegion;
    let h = <Shm as conformance::Harness>::new(None);
    for len in [1, 4096, 3 << 20] {
        let r = <Shm as conformance::Harness>::register(&h, len);
        assert_eq!(r.as_ptr() as usize % 4096, 0, "len {len}");
    }
}

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

/// Environment variable that turns [`shm_writer_child`] into the writer.
const WRITER_ENV: &str = "PAGEWIRE_SHM_WRITER_CHILD";

/// The writer process of [`rewritten_by_another_process`]: publishes four
/// self-validating pages and rewrites them until its stdin closes.
#[test]
#[ignore = "helper: run by rewritten_by_another_process as a child process"]
fn shm_writer_child() {
    let Ok(name) = std::env::var(WRITER_ENV) else {
        return;
    };
    use pagewire_rdma::LocalRegion;
    use std::io::Read;
    let owner = ShmOwner::create(&name).expect("create owner");
    let r = owner.register(4 * conformance::PAGE).expect("register");
    for p in 0..4u64 {
        r.write_bytes(
            p as usize * conformance::PAGE,
            &conformance::torn_page(p, 0),
        );
    }
    let hex: String = r
        .descriptor()
        .to_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("DESCRIPTOR {hex}");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = Arc::clone(&stop);
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        let _ = std::io::stdin().read(&mut b);
        s.store(true, Ordering::Relaxed);
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut g = 1;
    while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
        for p in 0..4u64 {
            r.write_bytes(
                p as usize * conformance::PAGE,
                &conformance::torn_page(p, g),
            );
        }
        g += 1;
        std::thread::sleep(Duration::from_micros(300));
    }
}

/// Starts `shm_writer_child` as owner `name` in a child process; returns it
/// and its region's descriptor.
fn spawn_writer(name: &str) -> (std::process::Child, pagewire_rdma::RegionDescriptor) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "shm_writer_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WRITER_ENV, name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the writer");
    let out = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(out).lines().map_while(Result::ok);
    let line = lines
        .find(|l| l.contains("DESCRIPTOR "))
        .expect("the writer's descriptor");
    // Read the rest of its output until it exits: libtest prints the
    // test's result after it returns, and a closed pipe made that print
    // fail ("error: io error when listing tests: Broken pipe" in the log).
    std::thread::spawn(move || lines.for_each(drop));
    // libtest prints "test shm_writer_child ... " before it on the same line.
    let hex = line.split("DESCRIPTOR ").nth(1).expect("descriptor").trim();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    let d = pagewire_rdma::RegionDescriptor::from_bytes(&bytes).expect("descriptor");
    (child, d)
}

/// A reader in this process, the owner rewriting its pages in another: torn
/// READs happen (chaos mode) and the checksum catches every one.
#[test]
fn rewritten_by_another_process() {
    conformance::bounded(60, || {
        let name = format!("xproc-{}", std::process::id());
        let (mut child, d) = spawn_writer(&name);
        let chaos = Some(Chaos {
            pause: Some(Duration::from_micros(500)),
        });
        let mut c = ShmConnection::connect(&name, ShmConfig { dir: None, chaos }).expect("connect");
        let (mut valid, mut torn) = (0, 0);
        let mut buf = vec![0u8; conformance::PAGE];
        for i in 0..2000u64 {
            let page = i % 4;
            let res = pagewire_rdma::read_blocking(
                &mut c,
                d,
                &mut [(page * conformance::PAGE as u64, &mut buf[..])],
            )
            .expect("post");
            assert_eq!(res[0], Ok(()));
            if conformance::validate(page, &buf) {
                valid += 1
            } else {
                torn += 1
            }
            if valid > 20 && torn > 20 {
                break;
            }
        }
        drop(child.stdin.take());
        let _ = child.wait();
        eprintln!(
            "across processes: {valid} valid reads, {torn} torn reads caught by the checksum"
        );
        assert!(valid > 0 && torn > 0, "valid {valid}, torn {torn}");
    });
}

/// An owner killed with SIGKILL cannot mark its files DEAD: a reader that
/// mapped them before goes on copying its frozen bytes. The next owner of
/// the same name (a restarted node) marks them DEAD, and that reader's next
/// READ fails instead of returning the dead process's bytes.
#[test]
fn a_successor_marks_its_dead_predecessor_dead_for_mapped_readers() {
    conformance::bounded(60, || {
        let name = format!("succ-{}", std::process::id());
        let (mut child, d) = spawn_writer(&name);
        let mut c = ShmConnection::connect(&name, ShmConfig::default()).expect("connect");
        let mut buf = vec![0u8; conformance::PAGE];
        let read = |c: &mut ShmConnection, buf: &mut [u8]| {
            pagewire_rdma::read_blocking(c, d, &mut [(0, buf)]).map(|r| r[0].clone())
        };
        assert_eq!(read(&mut c, &mut buf).expect("post"), Ok(()));
        child.kill().expect("SIGKILL the owner");
        child.wait().expect("reap");
        // Frozen, still mapped: nothing has told this reader yet.
        assert_eq!(
            read(&mut c, &mut buf).expect("post"),
            Ok(()),
            "before a successor exists the dead owner's bytes are readable (frozen)"
        );
        let successor = ShmOwner::create(&name).expect("the successor replaces the dead owner");
        match read(&mut c, &mut buf) {
            Err(_) | Ok(Err(_)) => {}
            Ok(Ok(())) => {
                panic!("a READ after the successor started returned the dead owner's bytes")
            }
        }
        drop(successor);
    });
}

/// A dead owner's control file that names a live pid (ours, as a restarted
/// container's PID 1 sees its predecessor's) is still replaced: no process
/// holds its lock.
#[test]
fn a_dead_owner_with_a_reused_pid_is_replaced() {
    conformance::bounded(30, || {
        let dir = std::env::temp_dir().join(format!("pw-shm-reused-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let mut ctl = vec![0u8; 4096];
        ctl[0..8].copy_from_slice(b"PWSHMCTL");
        ctl[8..12].copy_from_slice(&1u32.to_le_bytes());
        ctl[12..16].copy_from_slice(&std::process::id().to_le_bytes());
        ctl[24..32].copy_from_slice(&1u64.to_le_bytes());
        std::fs::write(dir.join("pagewire-node"), &ctl).expect("control file");
        let owner = ShmOwner::create_in(&dir, "node").expect("replace the dead owner");
        let again = ShmOwner::create_in(&dir, "node");
        assert!(
            again.is_err(),
            "a live owner of this very process is replaced"
        );
        drop(owner);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// An owner that died without closing leaves files; a new owner of the same
/// name replaces its control file and removes its region files, and only
/// those (another owner whose name extends this one keeps its files).
#[test]
fn dead_owner_files_are_replaced() {
    conformance::bounded(30, || {
        let dir = std::env::temp_dir().join(format!("pw-shm-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let stale = dir.join("pagewire-node-0000abcd");
        let other = dir.join("pagewire-node-b-0000abcd");
        std::fs::write(&stale, b"left by a dead owner").expect("stale region");
        std::fs::write(&other, b"another owner's region").expect("other region");
        // A control file whose pid cannot exist: a dead owner.
        let mut ctl = vec![0u8; 4096];
        ctl[0..8].copy_from_slice(b"PWSHMCTL");
        ctl[8..12].copy_from_slice(&1u32.to_le_bytes());
        ctl[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        ctl[24..32].copy_from_slice(&1u64.to_le_bytes());
        std::fs::write(dir.join("pagewire-node"), &ctl).expect("stale control file");
        let cfg = || ShmConfig {
            dir: Some(dir.clone()),
            chaos: None,
        };
        assert!(
            ShmConnection::connect("node", cfg()).is_err(),
            "a dead owner must not accept readers"
        );
        let owner = ShmOwner::create_in(&dir, "node").expect("replace the dead owner");
        assert!(!stale.exists(), "the dead owner's region file is removed");
        assert!(other.exists(), "another owner's region file is kept");
        let _c = ShmConnection::connect("node", cfg()).expect("the new owner accepts readers");
        assert!(
            ShmOwner::create_in(&dir, "node").is_err(),
            "a live owner is not replaced"
        );
        drop(owner);
        assert!(
            ShmConnection::connect("node", cfg()).is_err(),
            "a closed owner refuses readers"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// On hugetlbfs (`PAGEWIRE_HUGETLBFS_DIR`: `.ci/run` mounts one and gives
/// it a pool of 2 MiB pages) a region's file is sized in huge pages, which
/// hugetlbfs requires (`ftruncate` refuses other lengths with `EINVAL`, so
/// `register` failed there before); on a tmpfs mounted `huge=always`
/// (`PAGEWIRE_THP_TMPFS_DIR`) in 2 MiB too. Either way the region's length
/// is unchanged and its bytes are the file's at one header page in. A
/// variable left unset is said, not failed, for runs outside CI.
#[test]
fn region_files_are_sized_for_huge_pages() {
    use pagewire_rdma::LocalRegion;
    use pagewire_rdma::shm::file_granule;
    assert_eq!(
        file_granule(std::path::Path::new("/proc")),
        1,
        "not a tmpfs nor hugetlbfs: no rounding"
    );
    for var in ["PAGEWIRE_HUGETLBFS_DIR", "PAGEWIRE_THP_TMPFS_DIR"] {
        let Some(dir) = std::env::var_os(var) else {
            println!("{var} unset: not checked");
            continue;
        };
        let dir = std::path::PathBuf::from(dir);
        let granule = file_granule(&dir);
        assert_eq!(granule, 2 << 20, "{var}={}", dir.display());
        let name = format!(
            "huge-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let owner = ShmOwner::create_in(&dir, &name).expect("an owner on huge pages");
        let len = 3 * 4096 + 100;
        let region = owner.register(len).expect("a region on huge pages");
        assert_eq!(region.len(), len);
        // SAFETY: the region is ours and nothing reads it yet.
        let bytes = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let file = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .find(|e| {
                let f = e.file_name();
                let f = f.to_string_lossy();
                f.starts_with(&format!("pagewire-{name}-"))
            })
            .expect("the region's file");
        let size = file.metadata().unwrap().len() as usize;
        assert_eq!(size % granule, 0, "{}: {size} bytes", file.path().display());
        assert!(size >= 4096 + len);
        let f = std::fs::File::open(file.path()).unwrap();
        // SAFETY: a read-only mapping of a file this test's owner maps.
        let map = unsafe { memmap2::Mmap::map(&f) }.expect("a reader maps the file");
        assert!(
            map[4096..4096 + len]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i % 251) as u8),
            "the file does not hold the region's bytes one header page in"
        );
        println!(
            "{var}: region of {len} bytes in a file of {size} bytes on {}",
            dir.display()
        );
    }
}
