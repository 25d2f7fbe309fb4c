//! The mount point around the session: checks before mounting, cleaning
//! up a mount left by a crashed process, the device's readahead, and
//! detaching at exit.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use tracing::{info, warn};

/// Why the mount point cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MountPointError {
    #[error("/dev/fuse is missing (load the fuse module, or give the container the device)")]
    NoFuseDevice,
    #[error("the mount point {0} is not a directory")]
    NotADirectory(String),
    #[error("the mount point {path}: {source}")]
    Stat {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "{path} is a dead FUSE mount and `fusermount3 -u -z` could not remove it: {why} (is fusermount3 installed? Debian package fuse3)"
    )]
    Stale { path: String, why: String },
}

/// Checks that FUSE can be used and `path` is a directory; a mount point
/// left by a crashed FUSE daemon ("Transport endpoint is not connected")
/// is detached first with `fusermount3 -u -z`, with a log line.
pub fn prepare(path: &Path) -> Result<(), MountPointError> {
    if !Path::new("/dev/fuse").exists() {
        return Err(MountPointError::NoFuseDevice);
    }
    let shown = path.display().to_string();
    // A dead FUSE mount may answer stat from attributes the kernel still
    // caches; opening the directory always asks the daemon.
    let probe = std::fs::metadata(path).and_then(|m| {
        if m.is_dir() {
            std::fs::read_dir(path).map(|_| m)
        } else {
            Ok(m)
        }
    });
    match probe {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(MountPointError::NotADirectory(shown)),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            warn!(
                "{shown} is a FUSE mount whose daemon is gone (Transport endpoint is not connected), \
                 left by a crash: detaching it with `fusermount3 -u -z {shown}`"
            );
            lazy_unmount(path).map_err(|why| MountPointError::Stale {
                path: shown.clone(),
                why,
            })?;
            match std::fs::metadata(path) {
                Ok(m) if m.is_dir() => {
                    info!("{shown}: the dead mount is gone");
                    Ok(())
                }
                Ok(_) => Err(MountPointError::NotADirectory(shown)),
                Err(source) => Err(MountPointError::Stat {
                    path: shown,
                    source,
                }),
            }
        }
        Err(source) => Err(MountPointError::Stat {
            path: shown,
            source,
        }),
    }
}

/// `fusermount3 -u -z path` (the mount is detached now, and goes once the
/// last user closes it).
pub fn lazy_unmount(path: &Path) -> Result<(), String> {
    let out = Command::new("fusermount3")
        .args(["-u", "-z"])
        .arg(path)
        .output()
        .map_err(|e| format!("cannot run fusermount3: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "fusermount3 -u -z: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Forces the FUSE mount at `path` off: `umount2(MNT_FORCE)` aborts the
/// FUSE connection (every pending and later request fails with ENOTCONN,
/// so the session ends) and unmounts it unless it is busy; a busy mount is
/// then detached (`fusermount3 -u -z`). Needs root for the first step;
/// without it only the detach is done.
pub fn force_unmount(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("{} holds a NUL byte", path.display()))?;
    // SAFETY: `c` is a NUL-terminated path that lives across the call;
    // umount2 only reads it.
    let r = unsafe { libc::umount2(c.as_ptr(), libc::MNT_FORCE) };
    if r == 0 {
        return Ok(());
    }
    let forced = io::Error::last_os_error();
    match lazy_unmount(path) {
        Ok(()) => Ok(()),
        Err(why) => Err(format!("umount -f: {forced}; {why}")),
    }
}

/// The mounted file system's device number (st_dev of its root).
pub fn device_of(path: &Path) -> io::Result<u64> {
    Ok(std::fs::metadata(path)?.dev())
}

/// Sets the readahead of the FUSE device `dev` to `kb` KiB (through
/// /sys/class/bdi; needs root). The kernel offers FUSE at most its default
/// at init; reads that miss the page cache (`--cached`, and `mmap` faults)
/// then come in requests of up to `kb`.
pub fn set_readahead(dev: u64, kb: u32) -> io::Result<()> {
    let p = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    std::fs::write(&p, format!("{kb}\n"))
}

/// Aborts the FUSE connection of device `dev` (/sys/fs/fuse/connections,
/// needs the fusectl file system): every request then fails with ENOTCONN
/// and the session ends even while files are still open.
pub fn abort_connection(dev: u64) -> io::Result<()> {
    let p = format!("/sys/fs/fuse/connections/{}/abort", libc::minor(dev));
    std::fs::write(p, "1\n")
}
