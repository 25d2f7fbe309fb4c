//! A `pagewire-mount` process serving the bench's mount point, unmounted
//! on drop (on error too), and the checks that find and detach a mount
//! point left behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::stopped;
use crate::storm::procs;

/// Whether `dir` is a mount point now.
fn is_mounted(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.to_string_lossy();
    info.lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m == d))
}

/// The last resort: a lazy unmount of whatever is still mounted on `dir`.
pub(super) fn detach_if_mounted(dir: &Path) {
    if !is_mounted(dir) {
        return;
    }
    let ok = Command::new("fusermount3")
        .args(["-u", "-z"])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok && let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) {
        // SAFETY: umount2 with a valid NUL-terminated path; it touches no
        // memory of ours.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    if is_mounted(dir) {
        eprintln!(
            "mount: {} is still mounted: run fusermount3 -u -z on it",
            dir.display()
        );
    }
}

/// Waits (at most `limit`) until `file` exists with `size` bytes; `alive`
/// fails the wait early (the server died).
pub(super) fn wait_for_file(
    file: &Path,
    size: u64,
    limit: Duration,
    mut alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        alive()?;
        let dir = file.parent().unwrap_or(file);
        if is_mounted(dir) && std::fs::metadata(file).is_ok_and(|m| m.len() == size) {
            return Ok(());
        }
        if stopped() {
            bail!("interrupted");
        }
        if start.elapsed() > limit {
            bail!(
                "{} did not show {size} bytes within {limit:?}",
                file.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `pagewire-mount` process; on drop: SIGTERM (it unmounts and exits),
/// SIGKILL after 10 s, then a lazy unmount if the mount is still there.
pub(super) struct PwMount {
    pub(super) child: Child,
    pub(super) dir: PathBuf,
    pub(super) log: PathBuf,
    pub(super) transport: &'static str,
    pub(super) flavor: Flavor,
}

/// How a mount is started, beside its transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flavor {
    /// The defaults: direct I/O, read-ahead of sequential readers.
    Default,
    /// `--no-read-ahead`.
    NoAhead,
    /// `--cached 1`: the kernel page cache, changed pages dropped every
    /// second.
    Cached,
}

impl Flavor {
    /// What its name adds to the transport's.
    fn suffix(self) -> &'static str {
        match self {
            Flavor::Default => "",
            Flavor::NoAhead => "-noahead",
            Flavor::Cached => "-cached",
        }
    }

    fn args(self) -> &'static [&'static str] {
        match self {
            Flavor::Default => &[],
            Flavor::NoAhead => &["--no-read-ahead"],
            Flavor::Cached => &["--cached", "1"],
        }
    }
}

/// A mount's name: its transport, with its flavour's suffix.
pub(super) fn name(transport: &str, flavor: Flavor) -> String {
    format!("{transport}{}", flavor.suffix())
}

impl PwMount {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        bin: &Path,
        coordinator: &str,
        token_file: &Path,
        (transport, flavor): (&'static str, Flavor),
        workers: u32,
        dir: &Path,
        log: &Path,
        size: u64,
    ) -> anyhow::Result<Self> {
        let mut c = Command::new(bin);
        c.arg("--coordinator")
            .arg(coordinator)
            .arg("--token-file")
            .arg(token_file)
            .args(["--transport", transport])
            .args(["--workers", &workers.to_string()])
            .args(flavor.args())
            .arg(dir)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?);
        procs::die_with_parent(&mut c);
        let child = c
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut m = PwMount {
            child,
            dir: dir.to_owned(),
            log: log.to_owned(),
            transport,
            flavor,
        };
        let file = m.file();
        wait_for_file(&file, size, Duration::from_secs(60), || m.check_alive())?;
        Ok(m)
    }

    /// Its name in folders, logs and messages ([`name`]).
    pub(super) fn name(&self) -> String {
        name(self.transport, self.flavor)
    }

    pub(super) fn file(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub(super) fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(st) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            bail!(
                "pagewire-mount {} exited ({st}):\n{}",
                self.name(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }
}

impl Drop for PwMount {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while self.child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(10) {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        detach_if_mounted(&self.dir);
    }
}
