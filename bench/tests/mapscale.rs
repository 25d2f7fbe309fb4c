//! Smoke test of `pagewire-bench mapscale --quick`: every cell ran against
//! a real in-process coordinator, the compact map is smaller than the
//! expanded one and does not grow with the extents, a join reached the
//! watchers, and heartbeats were counted. No timing is asserted.

use std::process::Command;

#[test]
fn mapscale_quick_measures_every_cell() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pagewire-bench"))
        .args(["mapscale", "--quick", "--json", "--out"])
        .arg(out_dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mapscale --quick failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bench"], "mapscale");
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.path().join("mapscale.json")).unwrap())
            .unwrap();
    assert_eq!(written["results"], doc["results"]);
    let rows = doc["results"].as_array().unwrap();
    let mut cells: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["extents"].as_u64().unwrap(),
                r["members"].as_u64().unwrap(),
            )
        })
        .collect();
    cells.sort();
    assert_eq!(
        cells,
        vec![(1000, 10), (1000, 100), (10000, 10), (10000, 100)]
    );
    let get = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    for r in rows {
        assert_eq!(r["measured"], true, "{r}");
        let compact = get(r, "compact_full_bytes");
        assert!(compact > 0.0 && compact < get(r, "expanded_bytes"), "{r}");
        assert!(get(r, "delta_join_bytes") > 0.0, "{r}");
        assert!(get(r, "delta_join_bytes") < compact, "{r}");
        assert!(get(r, "join_to_all_watchers_ms") > 0.0, "{r}");
        assert!(get(r, "register_ms") > 0.0, "{r}");
        // No order between these: the coordinator publishes an epoch before
        // it answers Register, so watchers may apply it first.
        assert!(get(r, "join_to_all_readers_ms") > 0.0, "{r}");
        assert!(get(r, "heartbeats_in_window") > 0.0, "{r}");
        assert!(get(r, "coordinator_cpu_us_per_heartbeat") > 0.0, "{r}");
    }
    // The compact map depends on the members, not on the extents.
    let compact = |e: u64, m: u64| {
        rows.iter()
            .find(|r| r["extents"] == e && r["members"] == m)
            .map(|r| get(r, "compact_full_bytes"))
            .unwrap()
    };
    // (The file size is a varint: allow its length to differ.)
    assert!((compact(1000, 10) - compact(10000, 10)).abs() <= 4.0);
    assert!(compact(1000, 100) > compact(1000, 10));
}
