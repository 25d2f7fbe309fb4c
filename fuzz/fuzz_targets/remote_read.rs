//! The one-sided remote reader against a region whose bytes are the input
//! (served over `shm`, the rest of the region zero): the superblock it
//! checks at connect, the bucket chains it walks, the headers it validates
//! (by generation brackets or by checksum, as the input's length picks).
//! A hit must be the bytes of the frame it names, as the region holds them.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use pagewire_fuzz::{REGION_LEN, ShmTarget};
use pagewire_client::one_sided::{Outcome, ReaderConfig, RemoteReader};

fuzz_target!(|data: &[u8]| {
    let t = ShmTarget::get();
    t.load(data);
    let cfg = ReaderConfig {
        max_retries: 2,
        max_hops: 16,
        backoff: Duration::ZERO,
        backoff_max: Duration::ZERO,
        // Both validations, by the input: an ordered shm reader brackets
        // each frame with its generation (no checksum), the other checks
        // the checksum (as every tcp and verbs reader does).
        ordered_validation: data.len() % 2 == 0,
    };
    let Ok(mut r) = RemoteReader::connect(t.connect(), t.descriptor(), cfg) else {
        return;
    };
    let l = r.superblock().layout;
    assert!(l.len <= REGION_LEN);
    let ps = l.page_size;
    let pages = r.superblock().file_pages.min(8);
    let frame_bytes = |f: u32| -> Vec<u8> {
        let mut v = vec![0u8; ps];
        let at = l.frame(f as usize);
        if at < data.len() {
            let n = (data.len() - at).min(ps);
            v[..n].copy_from_slice(&data[at..at + n]);
        }
        v
    };
    let mut out = vec![0u8; ps * 8];
    for round in 0..2 {
        for p in 0..pages {
            match r.read_page(p, &mut out[..ps]) {
                Ok(Outcome::Hit { frame, .. }) => {
                    assert!((frame as usize) < l.frame_count);
                    assert!(
                        out[..ps] == frame_bytes(frame)[..],
                        "round {round} page {p}"
                    );
                }
                Ok(_) => {}
                Err(e) => panic!("read of page {p} failed: {e}"),
            }
        }
    }
    // The same pages as one batched run (warm now for those that hit).
    let n = pages as usize;
    match r.read_run(0, n, &mut out[..n * ps]) {
        Ok(outcomes) => {
            assert_eq!(outcomes.len(), n);
            for (i, o) in outcomes.iter().enumerate() {
                if let Outcome::Hit { frame, .. } = *o {
                    assert!(
                        out[i * ps..(i + 1) * ps] == frame_bytes(frame)[..],
                        "run page {i}"
                    );
                }
            }
        }
        Err(e) => panic!("run failed: {e}"),
    }
    // Past the end: an error, not a read.
    assert!(
        r.read_page(r.superblock().file_pages, &mut out[..ps])
            .is_err()
    );
});
