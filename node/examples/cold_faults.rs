//! Cold sequential faults: a fresh cache over a generated file (the file in
//! the kernel's page cache, pagewire's cache empty), then every page read in
//! order, so each readahead run is one `preadv` and one gang insertion.
//! Prints the median time per page over several fresh caches.
//!
//! `cargo run --release -p pagewire-node --example cold_faults -- [MiB] [repeats]`

use pagewire_node::{CacheConfig, PageCache, pattern};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let repeats: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(7);
    let dir = tempfile_dir();
    let path = dir.join("data");
    pattern::generate_file(&path, mib << 20, 4096).expect("generate");
    let pages = (mib << 20) / 4096;
    let mut per_page = Vec::new();
    for _ in 0..repeats {
        let c = PageCache::open(
            &path,
            CacheConfig {
                frames: pages as usize,
                ..Default::default()
            },
        )
        .expect("open");
        let t = Instant::now();
        for p in 0..pages {
            let r = c.get(p).expect("fault");
            assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), p);
        }
        per_page.push(t.elapsed().as_nanos() as f64 / pages as f64);
    }
    per_page.sort_by(f64::total_cmp);
    println!(
        "cold sequential faults: {mib} MiB, {pages} pages, {repeats} fresh caches: median {:.0} ns per page (min {:.0}, max {:.0})",
        per_page[repeats / 2],
        per_page[0],
        per_page[repeats - 1]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pagewire-cold-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}
