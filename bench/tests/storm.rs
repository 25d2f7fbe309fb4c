//! `pagewire-bench storm` end to end, small: a coordinator, 3 nodes and 2
//! reader processes (all this one binary), a 16 MiB file with caches for
//! half of it, the compare phases, then a storm with writes in which node-2
//! is killed and restarted. Every read is verified by the readers; here the
//! report must show no wrong or stale read, the cache missing (FaultIn
//! fallbacks), writes acknowledged, and the kill recovered from within the
//! run. Bad fault schedules and transports are refused before anything
//! starts. No timing is asserted.

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagewire-bench"))
}

#[test]
fn a_small_storm_with_a_kill_reads_only_right_pages() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = bench()
        .args([
            "storm",
            "--file-mib",
            "16",
            "--readers",
            "2",
            "--nodes",
            "3",
        ])
        .args([
            "--compare",
            "one-sided,grpc,pread",
            "--compare-duration",
            "1s",
        ])
        .args(["--duration", "8s", "--writer-fraction", "0.05"])
        .args(["--kill", "node-2@2s", "--restart", "node-2@5s"])
        .args(["--lease-ms", "1500", "--json", "--out"])
        .arg(out_dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "storm failed: {stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bench"], "storm");
    let rows = doc["results"].as_array().unwrap();
    let paths: Vec<&str> = rows.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert_eq!(
        paths,
        ["one-sided", "grpc", "pread", "one-sided"],
        "{rows:#?}"
    );
    for r in rows {
        assert_eq!(r["wrong_reads"], 0, "{r}");
        assert_eq!(r["stale_reads"], 0, "{r}");
        assert!(r["pages"].as_u64().unwrap() > 0, "{r}");
    }
    let storm = &rows[3];
    assert_eq!(storm["phase"], "storm");
    assert!(storm["writes"].as_u64().unwrap() > 0, "{storm}");
    assert!(
        storm["fallbacks"].as_u64().unwrap() > 0,
        "a cache of half the file must miss: {storm}"
    );
    let events = doc["events"].as_array().unwrap();
    assert_eq!(events.len(), 2, "{events:#?}");
    assert_eq!(events[0]["event"], "kill -9 node-2");
    assert!(
        events[0]["recovered_after_s"].as_f64().is_some(),
        "every extent served again after the kill, within the run: {events:#?}\n{stderr}"
    );
    assert!(out_dir.path().join("storm.json").exists());
}

#[test]
fn bad_schedules_and_transports_are_refused_up_front() {
    for (args, want) in [
        (&["--kill", "node-9@1s"][..], "the storm has 3 nodes"),
        (&["--kill", "node-2"][..], "expected TARGET@TIME"),
        (&["--pause", "node-1@1s"][..], "TARGET@TIME+LENGTH"),
        (&["--cut", "node-1@1s"][..], "needs --hosts"),
        (&["--kill", "node-1@99s"][..], "after the storm's end"),
        (&["--transport", "udp"][..], "one of shm, tcp, auto, verbs"),
        (&["--storm-path", "redis"][..], "must be one-sided or grpc"),
        (&["--writer-fraction", "2"][..], "is not in 0..=1"),
    ]
    .into_iter()
    .chain(
        // Built without verbs, a verbs storm is refused before it starts
        // anything; with it, the nodes refuse to start without a device
        // (node/tests/verbs_start.rs).
        (!cfg!(feature = "verbs"))
            .then_some((&["--transport", "verbs"][..], "built without RDMA support")),
    ) {
        let out = bench()
            .args(["storm", "--duration", "10s"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
