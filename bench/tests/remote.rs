//! Smoke test of `pagewire-bench remote --quick`: every path it can run here
//! (gRPC needs `pagewire-node` and `pagewire-coordinator` next to the bench
//! binary, as `cargo test --workspace` builds them; Redis needs
//! `redis-server`; either is skipped with a note otherwise) reads only
//! verified pages, and a warm index cache costs exactly one round trip per
//! page, a cold one at least two. No timing is asserted.

use std::process::Command;

#[test]
fn remote_quick_reads_only_right_pages() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pagewire-bench"))
        .args(["remote", "--quick", "--json", "--clients", "1,2", "--out"])
        .arg(out_dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "remote --quick failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bench"], "remote");
    let rows = doc["results"].as_array().unwrap();
    let one_sided: Vec<_> = rows.iter().filter(|r| r["path"] == "one_sided").collect();
    // shm and tcp, warm and cold, 2 client counts, runs of 1 and 16.
    assert_eq!(one_sided.len(), 16, "{rows:#?}");
    for r in rows {
        assert_eq!(r["wrong_reads"], 0, "{r}");
        assert!(r["ops_per_sec"].as_f64().unwrap() > 0.0, "{r}");
    }
    for r in &one_sided {
        // Round trips per op: a run of 16 shares its rounds (read_run).
        let rt = r["round_trips_per_read"].as_f64().unwrap() * r["run"].as_f64().unwrap();
        if r["index_cache"] == "warm" {
            assert!((rt - 1.0).abs() < 1e-9, "a warm op is one round trip: {r}");
        } else {
            assert!(rt >= 2.0 - 1e-9, "{r}");
        }
        assert_eq!(r["fallbacks"], 0, "{r}");
    }
    assert!(out_dir.path().join("remote.json").exists());
}
