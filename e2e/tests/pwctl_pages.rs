//! `pwctl owner`, `pwctl read` and `pwctl write` against real processes on
//! loopback: a coordinator and two `pagewire-node` daemons over a
//! self-describing file with a partial last page, and the real `pwctl`
//! binary (this package builds all three). Every byte pwctl reads is
//! compared with the backing file.

mod common;

use std::ops::Deref;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};

use common::pwctl_bin;
use pagewire_proto::v1::OwnershipMap;
use serde_json::Value;

const TOKEN: &str = "pwctl-pages-token";
const PS: u64 = 4096;
/// 40 pages, the last one 3096 bytes long.
const FILE_LEN: u64 = 40 * PS - 1000;
const PAGES: u64 = FILE_LEN.div_ceil(PS);
/// 4 pages per extent: 10 extents, over both nodes.
const EXTENT: u64 = 4 * PS;

static SERIAL: Mutex<()> = Mutex::new(());

/// One cluster at a time (three processes each, on two cores in CI).
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Page `page` of generation `generation` in the self-describing format,
/// `len` bytes long.
fn pattern(page: u64, generation: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    pagewire_node::pattern::fill(page, generation, &mut v);
    v
}

fn page_len(page: u64) -> usize {
    (FILE_LEN - page * PS).min(PS) as usize
}

/// The kit's loopback cluster (a coordinator, nodes n1 and n2), driven by
/// `pwctl`.
struct Cluster(pagewire_testkit::cluster::Cluster);

impl Deref for Cluster {
    type Target = pagewire_testkit::cluster::Cluster;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Cluster {
    /// A coordinator and nodes n1 and n2, settled (both own extents, no
    /// handoff, both applied the epoch, the map covers the whole file).
    fn start() -> Self {
        let mut c =
            pagewire_testkit::cluster::Cluster::new(common::daemons(), TOKEN, 3000, EXTENT, "data");
        let data: Vec<u8> = (0..PAGES)
            .flat_map(|p| pattern(p, 0, page_len(p)))
            .collect();
        std::fs::write(&c.backing, &data).expect("data file");
        c.start_coordinator();
        for id in ["n1", "n2"] {
            c.start_node(id, 256);
        }
        c.wait_for("the map to cover the file", |c| {
            c.map().is_some_and(|m| m.file_size == FILE_LEN)
        });
        c.wait_stable(2);
        Cluster(c)
    }

    fn addr(&self) -> String {
        self.coord_addr()
    }

    fn map(&self) -> OwnershipMap {
        self.0.map().expect("the coordinator answers")
    }

    fn pwctl(&self, args: &[&str]) -> Output {
        Command::new(pwctl_bin())
            .arg("--coordinator")
            .arg(self.addr())
            .arg("--token-file")
            .arg(self.path("token"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run pwctl")
    }

    /// `pwctl ARGS`, which must succeed.
    fn ok(&self, args: &[&str]) -> Output {
        let out = self.pwctl(args);
        assert!(
            out.status.success(),
            "pwctl {args:?}: {:?}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `pwctl --json ARGS` parsed from stdout (the report of a read to a file).
    fn json(&self, args: &[&str]) -> Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        let out = self.ok(&a);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "pwctl {a:?}: not JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    fn file_bytes(&self, first: u64, count: u64) -> Vec<u8> {
        let all = std::fs::read(&self.backing).expect("read data");
        let end = ((first + count) * PS).min(FILE_LEN) as usize;
        all[(first * PS) as usize..end].to_vec()
    }
}

/// Fails unless `out` exited with `code` and its stderr says `needle`.
fn assert_fails(out: &Output, code: i32, needle: &str, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: exit status, stderr: {err}"
    );
    assert!(
        err.contains(needle),
        "{what}: stderr should say {needle:?}: {err}"
    );
}

/// The node the map names (index, id, address) for `index`.
fn map_node(map: &OwnershipMap, index: u32) -> (u64, String, String) {
    let n = map
        .nodes
        .iter()
        .find(|n| n.index == index)
        .expect("the map names its owners");
    (
        u64::from(n.index),
        n.node_id.clone(),
        n.grpc_address.clone(),
    )
}

fn json_node(v: &Value) -> (u64, String, String) {
    (
        v["index"].as_u64().expect("index"),
        v["node_id"].as_str().expect("node_id").to_owned(),
        v["grpc_address"].as_str().expect("grpc_address").to_owned(),
    )
}

#[test]
fn owner_names_the_node_the_map_does() {
    let _s = serial();
    let c = Cluster::start();
    let map = c.map();
    let mut seen = std::collections::HashSet::new();
    for page in [0, 3, 4, 17, PAGES - 1] {
        // Extents of 4 pages; no handoff: both roles are owner[extent].
        let want = map_node(&map, map.owner[(page * PS / EXTENT) as usize]);
        seen.insert(want.1.clone());
        for target in [format!("p{page}"), (page * PS + 5).to_string()] {
            let v = c.json(&["owner", &target]);
            assert_eq!(v["page"], page, "owner {target}");
            assert_eq!(v["extent"], page * PS / EXTENT, "owner {target}");
            assert_eq!(v["epoch"], map.epoch, "owner {target}");
            assert_eq!(v["in_handoff"], false);
            assert_eq!(json_node(&v["read_owner"]), want, "owner {target}");
            assert_eq!(json_node(&v["write_owner"]), want, "owner {target}");
            assert_eq!(v["read_owner"]["state"], "alive");
        }
    }
    assert_eq!(seen.len(), 2, "the pages checked span both nodes");
    assert_eq!(
        c.json(&["owner", "1K"])["page_bytes"],
        serde_json::json!({"start": 0, "end": PS})
    );
    assert_eq!(
        c.json(&["owner", &format!("p{}", PAGES - 1)])["page_bytes"]["end"],
        FILE_LEN
    );
    // The table names the node too.
    let want = map_node(&map, map.owner[0]);
    let out = c.ok(&["owner", "p1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&want.1) && text.contains(&want.2), "{text}");
    assert!(text.contains(&format!("map epoch {}", map.epoch)), "{text}");
}

#[test]
fn read_of_a_page_and_of_a_range_gives_the_files_bytes() {
    let _s = serial();
    let c = Cluster::start();
    let map = c.map();
    let ids = ["n1", "n2"];
    let out_file = c.path("out");
    let out = out_file.to_str().expect("utf-8 path");
    // One page, to a file: the report goes to stdout.
    let v = c.json(&["read", "5", "--out", out]);
    assert_eq!(std::fs::read(&out_file).unwrap(), c.file_bytes(5, 1));
    assert_eq!(v["pages"], 1);
    let run = &v["runs"][0];
    assert_eq!(run["first"], 5);
    let want = map_node(&map, map.owner[(5 * PS / EXTENT) as usize]);
    assert_eq!(run["node_id"], want.1.as_str(), "{v}");
    assert!(
        ["one-sided/shm", "fault-in"].contains(&run["path"].as_str().unwrap()),
        "{v}"
    );
    // The whole file (both nodes, the partial last page) in runs.
    let v = c.json(&["read", &format!("0..{PAGES}"), "--out", out]);
    assert_eq!(
        std::fs::read(&out_file).unwrap(),
        c.file_bytes(0, PAGES),
        "pwctl read 0..{PAGES}"
    );
    assert_eq!(v["bytes"], FILE_LEN);
    let runs = v["runs"].as_array().expect("runs");
    let mut next = 0;
    for r in runs {
        assert_eq!(r["first"], next, "runs cover every page once: {v}");
        next = r["last"].as_u64().unwrap() + 1;
        assert!(ids.contains(&r["node_id"].as_str().unwrap()), "{r}");
        assert!(r["attempts"].as_u64().unwrap() >= 1);
    }
    assert_eq!(next, PAGES);
    // To stdout (a pipe): the bytes on stdout, the table on stderr.
    let o = c.ok(&["read", "p6+9"]);
    assert_eq!(o.stdout, c.file_bytes(6, 9), "pwctl read p6+9 to stdout");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("PATH"), "{err}");
    for page in 6..15 {
        let id = map_node(&map, map.owner[(page * PS / EXTENT) as usize]).1;
        assert!(err.contains(&id), "page {page}'s owner {id}: {err}");
    }
    assert!(err.contains("pages 6..15"), "{err}");
    // Every page is cached now: over tcp they come one-sided.
    let v = c.json(&["read", "8..12", "--transport", "tcp", "--out", out]);
    assert_eq!(std::fs::read(&out_file).unwrap(), c.file_bytes(8, 4));
    assert_eq!(v["runs"][0]["path"], "one-sided/tcp", "{v}");
    // The owners' gRPC Read.
    let v = c.json(&["read", &format!("{}", PAGES - 1), "--grpc", "--out", out]);
    assert_eq!(
        std::fs::read(&out_file).unwrap(),
        c.file_bytes(PAGES - 1, 1)
    );
    assert_eq!(v["runs"][0]["path"], "grpc-read", "{v}");
}

#[test]
fn a_write_is_read_back_and_reaches_the_backing_file() {
    let _s = serial();
    let c = Cluster::start();
    let map = c.map();
    let from = c.path("new");
    let from_s = from.to_str().expect("utf-8 path");
    let out = c.path("out");
    let out_s = out.to_str().expect("utf-8 path");
    for (page, len) in [
        (9, PS as usize),
        (PAGES - 1, page_len(PAGES - 1)),
        (PAGES - 1, PS as usize),
    ] {
        let mut bytes = pattern(page, 1 + len as u64, page_len(page));
        bytes.resize(len, 0);
        std::fs::write(&from, &bytes).unwrap();
        let v = c.json(&["write", &page.to_string(), "--from", from_s]);
        assert!(v["generation"].as_u64().is_some(), "{v}");
        assert_eq!(v["page"], page);
        let want = map_node(&map, map.owner[(page * PS / EXTENT) as usize]);
        assert_eq!(json_node(&v["owner"]), want, "{v}");
        let written = &bytes[..page_len(page)];
        c.ok(&["read", &page.to_string(), "--out", out_s]);
        assert_eq!(
            std::fs::read(&out).unwrap(),
            written,
            "read back page {page}"
        );
        assert_eq!(c.file_bytes(page, 1), written, "backing file, page {page}");
    }
    // The neighbours are untouched.
    assert_eq!(c.file_bytes(8, 1), pattern(8, 0, PS as usize));
    let o = c.ok(&["write", "p3", "--from", from_s]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("frame generation") && text.contains("owner n"),
        "{text}"
    );
}

#[test]
fn bad_pages_files_and_terminals_are_clear_errors() {
    let _s = serial();
    let c = Cluster::start();
    let out = c.path("out");
    let out_s = out.to_str().expect("utf-8 path");
    let from = c.path("short");
    let from_s = from.to_str().expect("utf-8 path");
    let past = PAGES.to_string();
    assert_fails(
        &c.pwctl(&["read", &past, "--out", out_s]),
        2,
        "past the end of the file (40 pages",
        "read past the end",
    );
    assert_fails(
        &c.pwctl(&["read", "38..42", "--out", out_s]),
        2,
        "pages 38..42 reach past the end",
        "range past the end",
    );
    assert_fails(
        &c.pwctl(&["read", &u64::MAX.to_string(), "--out", out_s]),
        2,
        "past the end of the file",
        "the largest page number",
    );
    assert_fails(
        &c.pwctl(&["read", "4KB", "--out", out_s]),
        2,
        "not bytes",
        "PAGES in bytes",
    );
    assert_fails(
        &c.pwctl(&["owner", &format!("p{past}")]),
        2,
        "past the end",
        "owner past the end",
    );
    assert_fails(
        &c.pwctl(&["owner", &FILE_LEN.to_string()]),
        2,
        &format!("offset {FILE_LEN} is past the end"),
        "owner offset past the end",
    );
    std::fs::write(&from, [1u8; 100]).unwrap();
    assert_fails(
        &c.pwctl(&["write", "2", "--from", from_s]),
        2,
        "holds 100 bytes; page 2 takes 4096",
        "short write",
    );
    assert_fails(
        &c.pwctl(&["write", "39", "--from", from_s]),
        2,
        "page 39 takes 3096, or 4096 (the page size) with zeros past byte 3096",
        "short write of the last page",
    );
    let mut tail = vec![0u8; PS as usize];
    tail[3500] = 1;
    std::fs::write(&from, &tail).unwrap();
    assert_fails(
        &c.pwctl(&["write", "39", "--from", from_s]),
        2,
        "byte 3500 past its end is not zero",
        "a whole last page with bytes past its end",
    );
    std::fs::write(&from, [1u8; PS as usize]).unwrap();
    assert_fails(
        &c.pwctl(&["write", &past, "--from", from_s]),
        2,
        "page 40 is past the end",
        "write past the end",
    );
    assert_fails(
        &c.pwctl(&["write", "1", "--from", "/nonexistent/x"]),
        2,
        "cannot read --from /nonexistent/x",
        "missing --from",
    );
    assert_eq!(
        c.file_bytes(39, 1),
        pattern(39, 0, page_len(39)),
        "nothing written"
    );
    // A wrong token is the cluster refusing (exit 1), not a usage error.
    std::fs::write(c.path("wrong"), "not-the-token").unwrap();
    let o = Command::new(pwctl_bin())
        .arg("--coordinator")
        .arg(c.addr())
        .arg("--token-file")
        .arg(c.path("wrong"))
        .args(["read", "1", "--out", out_s])
        .output()
        .expect("run pwctl");
    assert_fails(&o, 1, "the coordinator at", "wrong token");
    // Page bytes to a terminal: `script` gives pwctl a pseudo-terminal.
    if has_script() {
        let o = in_terminal(&c, "read 1");
        // (What came out, cut short: page bytes when the check is missing.)
        let text: String = String::from_utf8_lossy(&o.stdout)
            .chars()
            .take(300)
            .collect();
        assert_eq!(o.status.code(), Some(2), "{text}");
        assert!(
            text.contains("refusing to write page bytes to a terminal"),
            "{text}"
        );
    } else {
        eprintln!("skipped the terminal check: no `script` (util-linux) here");
    }
}

fn has_script() -> bool {
    Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `pwctl ARGS` with stdout on a pseudo-terminal (util-linux
/// `script`, whose exit status is pwctl's with -e); its output.
fn in_terminal(c: &Cluster, args: &str) -> Output {
    let cmd = format!(
        "{} --coordinator {} --token-file {} {args}",
        shell_quote(&pwctl_bin()),
        c.addr(),
        shell_quote(&c.path("token"))
    );
    Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .expect("run script")
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', "'\\''"))
}
