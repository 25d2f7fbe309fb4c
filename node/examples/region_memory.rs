//! Private anonymous memory (transparent huge pages where the kernel gives
//! them) against an shm file mapping (what the daemon uses so that readers
//! on the host map the region) for the same cache: random zero-copy and
//! copy-out hits over a preloaded file, interleaved, medians printed, with
//! the AnonHugePages / ShmemPmdMapped the kernel actually gave.
//!
//! `cargo run --release -p pagewire-node --example region_memory -- [MiB] [rounds] [SHM_DIR]`
//!
//! SHM_DIR (default /dev/shm) holds the region file: a tmpfs mounted with
//! `huge=always` (or `within_size`) gives the shared mapping huge pages
//! whatever `/sys/kernel/mm/transparent_hugepage/shmem_enabled` says; a
//! hugetlbfs mount puts it on the reserved pool (`vm.nr_hugepages` must
//! hold the region: 129 pages of 2 MiB for 256 MiB).

use pagewire_node::index::Lockless;
use pagewire_node::{CacheConfig, PageCache, pattern};
use pagewire_rdma::shm::ShmOwner;
use std::time::Instant;

fn smaps_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let shm_dir = args.next().map(std::path::PathBuf::from);
    let dir = std::env::temp_dir().join(format!("pagewire-regmem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data");
    pattern::generate_file(&path, mib << 20, 4096).unwrap();
    let pages = (mib << 20) / 4096;
    let cfg = CacheConfig {
        frames: pages as usize + 64,
        ..Default::default()
    };
    let private = PageCache::<Lockless>::open_on(&path, cfg.clone(), None).unwrap();
    let owner = match &shm_dir {
        Some(d) => ShmOwner::create_in(d, "pagewire-regmem").unwrap(),
        None => ShmOwner::create("pagewire-regmem").unwrap(),
    };
    let region = owner
        .register(PageCache::<Lockless>::region_len(4096, cfg.frames))
        .unwrap();
    let shared = PageCache::<Lockless>::open_on(&path, cfg, Some(Box::new(region))).unwrap();
    for c in [&private, &shared] {
        c.preload(0, pages).unwrap();
    }
    // hugetlbfs pages are not in smaps_rollup: the pool's use says it.
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let pool = |field: &str| -> u64 {
        meminfo
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    println!(
        "AnonHugePages {} KiB, ShmemPmdMapped {} KiB, hugetlbfs pages in use {} (huge pages the kernel gave)",
        smaps_kib("AnonHugePages:"),
        smaps_kib("ShmemPmdMapped:"),
        pool("HugePages_Total:").saturating_sub(pool("HugePages_Free:"))
    );
    let n = 2_000_000u64;
    let mut buf = vec![0u8; 4096];
    let mut res: [[Vec<f64>; 2]; 2] = Default::default();
    for _ in 0..rounds {
        for (k, c) in [&private, &shared].into_iter().enumerate() {
            let mut x = 0x1234_5678u64;
            let t = Instant::now();
            let mut sum = 0u64;
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let r = c.lookup(x % pages).unwrap();
                sum = sum.wrapping_add(r[0] as u64);
            }
            res[k][0].push(t.elapsed().as_nanos() as f64 / n as f64);
            let t = Instant::now();
            for _ in 0..n / 4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.read_into(x % pages, &mut buf).unwrap();
                sum = sum.wrapping_add(buf[0] as u64);
            }
            res[k][1].push(t.elapsed().as_nanos() as f64 / (n / 4) as f64);
            std::hint::black_box(sum);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let shm_name = format!(
        "shm file in {}",
        shm_dir.as_deref().unwrap_or("/dev/shm".as_ref()).display()
    );
    for (k, name) in ["private (THP)", shm_name.as_str()].iter().enumerate() {
        println!(
            "{name:>14}: zero-copy {:.0} ns, copy-out {:.0} ns per random hit ({mib} MiB, median of {rounds})",
            med(&mut res[k][0]),
            med(&mut res[k][1])
        );
    }
    drop(shared);
    drop(owner);
    let _ = std::fs::remove_dir_all(&dir);
}
