//! Smoke test of `pagewire-bench policy --quick`: every eviction × admission
//! combination ran, read only verified pages, and reports a hit ratio in
//! 0..=1. No timing is asserted.

use std::process::Command;

#[test]
fn policy_quick_runs_every_combination() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pagewire-bench"))
        .args(["policy", "--quick", "--json", "--threads", "2", "--out"])
        .arg(out_dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "policy --quick failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bench"], "policy");
    let rows = doc["results"].as_array().unwrap();
    let mut seen: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["eviction"].as_str().unwrap().to_owned(),
                r["admission"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    seen.sort();
    // Every combination of the policies the nodes implement (the
    // contract's list).
    use pagewire_proto::policy::{
        IMPLEMENTED_ADMISSION, IMPLEMENTED_EVICTION, admission_name, eviction_name,
    };
    let mut want = Vec::new();
    for &e in IMPLEMENTED_EVICTION {
        for &a in IMPLEMENTED_ADMISSION {
            want.push((eviction_name(e).to_owned(), admission_name(a).to_owned()));
        }
    }
    want.sort();
    assert_eq!(seen, want, "{rows:#?}");
    for r in rows {
        assert_eq!(r["wrong_reads"], 0, "{r}");
        let h = r["hit_ratio"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&h), "{r}");
        assert!(r["pages_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        // A zipfian storm over a cache of a quarter of the file misses.
        assert!(r["pages_read"].as_u64().unwrap() > 0, "{r}");
        if r["admission"] == "always" {
            assert_eq!(r["admissions_skipped"], 0, "{r}");
        }
    }
    assert!(out_dir.path().join("policy.json").exists());
}
