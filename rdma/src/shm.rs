//! `shm`: one-sided READs between processes of one host, with no owner CPU.
//!
//! An [`ShmOwner`] publishes a control file and one file per region in a
//! directory (by default `/dev/shm`, i.e. memory). A reader opens a
//! [`ShmConnection`] by the owner's name, maps each region file it READs
//! **read-only**, and copies with word-sized atomic loads: the owner may be
//! rewriting the bytes, so a READ may be torn and the reader validates it, as
//! with a NIC. Access control is the files' permissions (the process umask).
//!
//! The memory served is the region file's shared mapping itself, so unlike
//! `tcp` and `verbs` there is no `register_external`: whatever the owner
//! wants readers to see (for the node, its whole page-cache region) must be
//! allocated with [`ShmOwner::register`] and used in place. Its data starts
//! one 4 KiB header page into the file, so it is page-aligned on 4 KiB-page
//! kernels (x86-64; only 4 KiB-aligned under 16 or 64 KiB pages). The owner
//! asks for transparent huge pages on each region mapping
//! (`madvise(MADV_HUGEPAGE)`), a hint: for files on a tmpfs such as
//! `/dev/shm` the mount's `huge=` option decides (`advise` and
//! `within_size` honour it, `always` needs none, `never`, the default,
//! ignores it), overridden by `deny` or `force` in
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled`; the owner logs at
//! debug level when the hint will be ignored.
//!
//! Files are sized in the directory's granule ([`file_granule`]): on a
//! hugetlbfs mount (for example a Kubernetes `emptyDir` of medium
//! `HugePages-2Mi`) the huge page size, which hugetlbfs requires of every
//! file length (`ftruncate` refuses others with `EINVAL`), so a region lives
//! on huge pages from the pool; on a tmpfs whose policy gives shared memory
//! transparent huge pages, 2 MiB, so the file's tail can be mapped by a huge
//! page too. The region's own length (header word `len`) is unchanged;
//! readers already accept a file longer than header + `len`. A hugetlbfs
//! pool too small for a file fails its mapping (`ENOMEM` at `mmap`, which
//! reserves the pages), not a later touch.
//!
//! Every region of an owner carries the owner's incarnation as its epoch:
//! random ([`ShmOwner::create_in`]) or the caller's
//! ([`ShmOwner::create_in_with_epoch`], e.g. the node's incarnation, so that
//! `shm`, `tcp` and `verbs` descriptors of one node carry one epoch).
//!
//! # Files (integers little-endian, native word atomics)
//!
//! Control file `pagewire-{name}`, one page:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `PWSHMCTL` |
//! | 8 | 4 | layout version, 1 |
//! | 12 | 4 | owner pid |
//! | 16 | 8 | incarnation (the epoch of every region of this owner; never 0) |
//! | 24 | 8 | state: 1 = live, 2 = closed |
//!
//! Region file `pagewire-{name}-{rkey:08x}`: a header page, then the data:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `PWSHMREG` |
//! | 8 | 4 | layout version, 1 |
//! | 12 | 4 | rkey |
//! | 16 | 8 | epoch |
//! | 24 | 8 | length of the data |
//! | 32 | 8 | address of the data in the owner's mapping (descriptor `addr`) |
//! | 40 | 8 | state: 1 = live, 2 = revoked |
//! | 4096 | len | data |
//!
//! Files are written under a temporary name and renamed into place, so a
//! reader never sees a half-written header. Deregistering a region (drop)
//! marks it revoked and unlinks it; closing the owner marks the control file
//! closed and unlinks it. A reader checks both states before and after each
//! copy: READs of a revoked region fail with [`AccessFault::UnknownKey`],
//! READs after the owner closed with [`ReadError::ConnectionLost`]. An owner
//! that dies without closing is noticed when a connection opens or maps a new
//! region (its pid is gone), or when a successor of the same name starts and
//! marks its files DEAD; mapped bytes stay readable (frozen) until then.
//! A new owner of the same name replaces a control file only when no process
//! holds the `flock` every owner keeps on it for its lifetime (the pid alone
//! cannot say: a restarted container's owner is PID 1 again).
//!
//! # Protocol
//!
//! **State.** Each file's header has a state word: `LIVE = 1`, `DEAD = 2`
//! (closed owner / revoked region). The magic word is written last.
//!
//! **Fields.** The owner writes every header field once, before the rename
//! publishes the file, and afterwards only the state word (LIVE → DEAD,
//! once). Readers only load. Data bytes are written by the owner and read by
//! readers concurrently, always with atomic word accesses.
//!
//! **Transitions.** 1. create: fields, then magic (Release), then rename.
//! 2. revoke/close: state := DEAD (Release), then unlink. Nothing returns to
//! LIVE; a new registration is a new file with a new rkey. An owner that
//! died without closing cannot do this itself: its successor (the next
//! owner of the name, which finds the control file unlocked) stores DEAD in
//! the dead owner's control file and in each of its region files before it
//! unlinks them, so readers still mapping them stop at their next check
//! rather than copying frozen bytes for as long as their connection lives.
//!
//! **Ordering.** The Release store of the magic pairs with the reader's
//! Acquire load of it (so the fields are visible); the Release store of DEAD
//! pairs with the reader's Acquire loads of the state before and after its
//! copy. After each READ's copy the reader fences (Acquire), so the READs of
//! one batch are ordered as its thread's own loads would be
//! ([`Connection::ordered_reads`]): a reader may bracket a frame's copy with
//! two READs of its generation, a seqlock, instead of checking its checksum.
//!
//! **Critical interleavings.** (a) The owner revokes or closes during a
//! copy: the reader's mapping stays valid (the file's pages live until the
//! last mapping goes), so the copy reads stale-but-mapped bytes, and the
//! state load after the copy turns it into an error. (b) The owner rewrites
//! data during a copy: a torn READ, caught by the reader's validation (the
//! generation READ after the copy, or the checksum).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::time::Duration;

use memmap2::{Mmap, MmapMut};

use crate::copy::{Chaos, copy_from_shared_raw};
use crate::memory::choose_epoch;
use crate::{
    AccessFault, Completion, ConnectError, Connection, Limits, LocalRegion, OwnerError, PostError,
    ReadError, ReadRequest, RegionDescriptor, RegisterError,
};

const CTL_MAGIC: u64 = u64::from_le_bytes(*b"PWSHMCTL");
const REG_MAGIC: u64 = u64::from_le_bytes(*b"PWSHMREG");
const VERSION: u32 = 1;
const HEADER: usize = 4096;
const LIVE: u64 = 1;
const DEAD: u64 = 2;

// Word offsets (in u64 units) of the header fields.
const W_MAGIC: usize = 0;
const W_VERSION_PID: usize = 1; // version | pid << 32 (control); version | rkey << 32 (region)
const W_EPOCH: usize = 2;
const W_CTL_STATE: usize = 3;
const W_LEN: usize = 3;
const W_ADDR: usize = 4;
const W_REG_STATE: usize = 5;

/// The default directory: memory-backed on Linux.
pub const DEFAULT_DIR: &str = "/dev/shm";

/// Atomic view of header word `w` of a mapping.
///
/// # Safety
/// `base` is the start of a live, page-aligned mapping of at least one page.
unsafe fn word<'a>(base: *const u8, w: usize) -> &'a AtomicU64 {
    // SAFETY: `w * 8 < HEADER` for every field above, the mapping is
    // page-aligned (so 8-aligned) and outlives the borrow by the caller's
    // contract; all accesses to header words are atomic.
    unsafe { AtomicU64::from_ptr(base.add(w * 8).cast::<u64>().cast_mut()) }
}

fn check_name(name: &str) -> io::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "shm owner names are [A-Za-z0-9_.-]{1,64}",
        ))
    }
}

fn ctl_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("pagewire-{name}"))
}

fn region_path(dir: &Path, name: &str, rkey: u32) -> PathBuf {
    dir.join(format!("pagewire-{name}-{rkey:08x}"))
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Whether a live owner holds the control file at `path`: every owner keeps
/// an exclusive `flock` on it for its lifetime, and the kernel drops the
/// lock when the process dies, however it dies. The pid in the file cannot
/// tell alone: in a container the owner is often PID 1 in every
/// incarnation, so a successor in a restarted container (with the shm
/// directory kept, as a Kubernetes emptyDir is) would see its own pid and
/// take the dead owner for a live one.
fn ctl_locked(path: &Path) -> bool {
    let Ok(f) = File::open(path) else {
        return false;
    };
    // SAFETY: flock on a descriptor we own; no memory is involved. A shared
    // lock we get is released when `f` closes, at the end of this function.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
}

/// Marks the dead owner's file at `path` DEAD (its state word at word
/// `state`, when its magic is `magic`), so that a reader that mapped it
/// before its owner died stops copying from it at its next state check
/// instead of reading the frozen bytes until it notices on its own (which
/// it never does while the connection stays open). Best effort: a file that
/// is gone, short, foreign or not writable is left as it is (logged).
fn mark_dead(path: &Path, magic: u64, state: usize) {
    let res = (|| -> io::Result<bool> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() < HEADER as u64 {
            return Ok(false);
        }
        // SAFETY: a shared mapping of at least one page (checked above);
        // every access to the header words is atomic, and the data beyond
        // them is not touched.
        let map = unsafe { MmapMut::map_mut(&file)? };
        let base = map.as_ptr();
        // SAFETY: one page at least, checked above.
        let (m, st) = unsafe { (word(base, W_MAGIC), word(base, state)) };
        if m.load(Ordering::Acquire) != magic {
            return Ok(false);
        }
        // Release: pairs with the Acquire loads of the state that readers
        // make before and after each copy (rule 2 of the protocol: a dead
        // owner's successor performs its transition to DEAD).
        st.store(DEAD, Ordering::Release);
        Ok(true)
    })();
    match res {
        Ok(true) => tracing::info!(
            file = %path.display(),
            "shm owner: marked a dead owner's file DEAD for the readers still mapping it"
        ),
        Ok(false) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            file = %path.display(),
            error = %e,
            "shm owner: cannot mark a dead owner's file DEAD; readers mapping it see it frozen until they reconnect"
        ),
    }
}

/// Removes the region files a dead owner of `name` left behind (exactly
/// `pagewire-{name}-` followed by eight hex digits: names may contain `-`),
/// each marked DEAD first.
fn remove_stale_regions(dir: &Path, name: &str) {
    let prefix = format!("pagewire-{name}-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(f) = file.to_str() else { continue };
        if let Some(rest) = f.strip_prefix(&prefix)
            && rest.len() == 8
            && rest.bytes().all(|b| b.is_ascii_hexdigit())
        {
            tracing::info!(
                file = f,
                "shm owner: removing a region file left by a dead owner"
            );
            mark_dead(&e.path(), REG_MAGIC, W_REG_STATE);
            let _ = fs::remove_file(e.path());
        }
    }
}

/// The transparent-huge-page policy for shmem files in `dir`: `deny` or
/// `force` from `shmem_enabled`, else the `huge=` option of the tmpfs mount
/// holding `dir` (`never` when absent). `None` when `dir` is not on a tmpfs
/// or the system does not say.
fn huge_page_policy(dir: &Path) -> Option<String> {
    let sys = fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let selected = sys
        .split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))?;
    if selected == "deny" || selected == "force" {
        return Some(format!("{selected} (shmem_enabled)"));
    }
    let dir = fs::canonicalize(dir).ok()?;
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    let (_, fstype, opts) = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && dir.starts_with(f[1])).then(|| (f[1], f[2], f[3]))
        })
        .max_by_key(|(mount, _, _)| mount.len())?;
    if fstype != "tmpfs" {
        return None;
    }
    let huge = opts
        .split(',')
        .find_map(|o| o.strip_prefix("huge="))
        .unwrap_or("never");
    Some(format!("{huge} (tmpfs huge=)"))
}

/// What a file in `dir` is sized a multiple of: the huge page size on a
/// hugetlbfs mount (required there), 2 MiB on a tmpfs whose huge page
/// policy is `always`, `within_size`, `advise` or `force` (so the last
/// part of a region can be a huge page too), else 1 (no rounding).
pub fn file_granule(dir: &Path) -> usize {
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    if let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) {
        // SAFETY: `statfs` writes only into the zeroed struct we pass, and
        // reads the NUL-terminated path we own.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0
            && st.f_type as i64 == HUGETLBFS_MAGIC
            && st.f_bsize > 0
        {
            return st.f_bsize as usize;
        }
    }
    match huge_page_policy(dir) {
        Some(p)
            if ["always", "within_size", "advise", "force"]
                .iter()
                .any(|w| p.starts_with(w)) =>
        {
            2 << 20
        }
        _ => 1,
    }
}

/// Asks for transparent huge pages on a region mapping (before its pages
/// are touched); a hint, so a refusal is only logged.
fn advise_huge(map: &MmapMut) {
    if let Err(e) = map.advise(memmap2::Advice::HugePage) {
        tracing::debug!(error = %e, "shm owner: madvise(MADV_HUGEPAGE) refused");
    }
}

/// Creates `path` with `len` bytes through a temporary name; `init` fills the
/// mapping before the rename publishes it. `huge`: ask for huge pages first.
fn publish(
    path: &Path,
    len: usize,
    huge: bool,
    init: impl FnOnce(&mut MmapMut),
) -> io::Result<(MmapMut, File)> {
    let tmp = path.with_extension(format!("tmp{}", fastrand::u64(..)));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    let res = (|| {
        file.set_len(len as u64)?;
        // SAFETY: a fresh file of ours; nobody else maps it yet (temporary name).
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        if huge {
            advise_huge(&map);
        }
        init(&mut map);
        fs::rename(&tmp, path)?;
        Ok(map)
    })();
    match res {
        Ok(map) => Ok((map, file)),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The owner's side of `shm`: publishes regions for other processes to READ.
pub struct ShmOwner {
    dir: PathBuf,
    name: String,
    /// Every file's length is a multiple of this ([`file_granule`]).
    granule: usize,
    ctl: MmapMut,
    /// The control file, open with an exclusive `flock` for as long as this
    /// owner lives: what tells a successor that it is alive (see
    /// [`ctl_locked`]).
    _lock: File,
    incarnation: u64,
    closed: AtomicBool,
}

impl ShmOwner {
    /// Publishes owner `name` under [`DEFAULT_DIR`]. An existing owner of the
    /// same name whose process is gone is replaced.
    ///
    /// # Errors
    /// A bad name, a live owner of the same name, or a file error.
    pub fn create(name: &str) -> io::Result<Self> {
        Self::create_in(Path::new(DEFAULT_DIR), name)
    }

    /// As [`ShmOwner::create`], in directory `dir`, with a random incarnation.
    ///
    /// # Errors
    /// A bad name, a live owner of the same name, or a file error.
    pub fn create_in(dir: &Path, name: &str) -> io::Result<Self> {
        let incarnation = choose_epoch(None).map_err(|e| match e {
            OwnerError::Io(e) => e,
            other => io::Error::other(other),
        })?;
        Self::create_inner(dir, name, incarnation)
    }

    /// As [`ShmOwner::create_in`], with incarnation `epoch`: every region's
    /// descriptor carries it (the node passes its own incarnation, so that
    /// all its backends' descriptors agree).
    ///
    /// # Errors
    /// [`OwnerError::ZeroEpoch`] for epoch 0 (reserved); otherwise
    /// [`OwnerError::Io`]: a bad name, a live owner of the same name, or a
    /// file error.
    pub fn create_in_with_epoch(dir: &Path, name: &str, epoch: u64) -> Result<Self, OwnerError> {
        let incarnation = choose_epoch(Some(epoch))?;
        Ok(Self::create_inner(dir, name, incarnation)?)
    }

    fn create_inner(dir: &Path, name: &str, incarnation: u64) -> io::Result<Self> {
        check_name(name)?;
        let path = ctl_path(dir, name);
        if let Ok(old) = open_ctl(&path)
            && old.live
            && ctl_locked(&path)
        {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("a live shm owner {name:?} exists"),
            ));
        }
        // The predecessor is dead (no lock): its readers may still map its
        // control file and copy its frozen regions. DEAD ends that now.
        mark_dead(&path, CTL_MAGIC, W_CTL_STATE);
        remove_stale_regions(dir, name);
        match huge_page_policy(dir) {
            Some(p) if p.starts_with("never") || p.starts_with("deny") => tracing::debug!(
                policy = %p,
                dir = %dir.display(),
                "shm owner: huge pages refused for region files, MADV_HUGEPAGE has no effect"
            ),
            Some(p) => {
                tracing::debug!(policy = %p, dir = %dir.display(), "shm owner: huge page policy")
            }
            None => tracing::debug!(
                dir = %dir.display(),
                "shm owner: not a tmpfs (or no THP): MADV_HUGEPAGE may have no effect"
            ),
        }
        let granule = file_granule(dir);
        if granule > 1 {
            tracing::debug!(granule, dir = %dir.display(), "shm owner: files sized in huge pages");
        }
        let pid = std::process::id();
        let (ctl, file) = publish(&path, HEADER.next_multiple_of(granule), false, |m| {
            let base = m.as_mut_ptr();
            // SAFETY: `base` is a fresh one-page mapping.
            unsafe {
                word(base, W_VERSION_PID).store(
                    u64::from(VERSION) | (u64::from(pid) << 32),
                    Ordering::Relaxed,
                );
                word(base, W_EPOCH).store(incarnation, Ordering::Relaxed);
                word(base, W_CTL_STATE).store(LIVE, Ordering::Relaxed);
                word(base, W_MAGIC).store(CTL_MAGIC, Ordering::Release);
            }
        })?;
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "a live shm owner {name:?} exists (its control file is locked: {})",
                    io::Error::last_os_error()
                ),
            ));
        }
        Ok(Self {
            dir: dir.to_owned(),
            name: name.to_owned(),
            granule,
            ctl,
            _lock: file,
            incarnation,
            closed: AtomicBool::new(false),
        })
    }

    /// Allocates and publishes a region of `len` zeroed bytes: the region
    /// file's mapping, which readers map too, so the owner keeps its data
    /// (e.g. its whole page cache) in place there. The data is page-aligned
    /// (4 KiB pages) and the mapping is advised to use huge pages.
    ///
    /// # Errors
    /// Zero length, a closed owner, or a file error.
    pub fn register(&self, len: usize) -> Result<ShmRegion, RegisterError> {
        if len == 0 || len > (isize::MAX as usize) - HEADER - self.granule {
            return Err(RegisterError::InvalidLength(len));
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(RegisterError::Closed);
        }
        loop {
            let rkey = fastrand::u32(1..);
            let path = region_path(&self.dir, &self.name, rkey);
            if path.exists() {
                continue;
            }
            let epoch = self.incarnation;
            let file_len = (HEADER + len).next_multiple_of(self.granule);
            let res = publish(&path, file_len, true, |m| {
                let base = m.as_mut_ptr();
                // SAFETY: a fresh mapping of `HEADER + len` bytes.
                unsafe {
                    word(base, W_VERSION_PID).store(
                        u64::from(VERSION) | (u64::from(rkey) << 32),
                        Ordering::Relaxed,
                    );
                    word(base, W_EPOCH).store(epoch, Ordering::Relaxed);
                    word(base, W_LEN).store(len as u64, Ordering::Relaxed);
                    word(base, W_ADDR).store(base.add(HEADER) as u64, Ordering::Relaxed);
                    word(base, W_REG_STATE).store(LIVE, Ordering::Relaxed);
                    word(base, W_MAGIC).store(REG_MAGIC, Ordering::Release);
                }
            });
            match res {
                Ok((map, _file)) => {
                    return Ok(ShmRegion {
                        map,
                        path,
                        len,
                        rkey,
                        epoch,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Marks the owner closed: READs through existing connections fail with
    /// [`ReadError::ConnectionLost`] and new connections are refused.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: `ctl` is our live one-page mapping. Release pairs with the
        // Acquire load of the state in `ShmConnection::owner_live`.
        unsafe { word(self.ctl.as_ptr(), W_CTL_STATE) }.store(DEAD, Ordering::Release);
        let _ = fs::remove_file(ctl_path(&self.dir, &self.name));
    }

    /// The incarnation: the epoch of every region of this owner.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.incarnation
    }

    /// The owner's name, for [`ShmConnection::connect`].
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ShmOwner {
    fn drop(&mut self) {
        self.close();
    }
}

/// A region published by an [`ShmOwner`]; revoked and unlinked on drop.
pub struct ShmRegion {
    map: MmapMut,
    path: PathBuf,
    len: usize,
    rkey: u32,
    epoch: u64,
}

impl LocalRegion for ShmRegion {
    fn descriptor(&self) -> RegionDescriptor {
        RegionDescriptor {
            addr: self.as_ptr() as u64,
            len: self.len as u64,
            rkey: self.rkey,
            epoch: self.epoch,
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is `HEADER + len` bytes long.
        unsafe { self.map.as_ptr().add(HEADER).cast_mut() }
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        // SAFETY: our live mapping. Release pairs with the Acquire load of
        // the state in `ShmConnection::read_one`.
        unsafe { word(self.map.as_ptr(), W_REG_STATE) }.store(DEAD, Ordering::Release);
        let _ = fs::remove_file(&self.path);
    }
}

struct CtlView {
    map: Mmap,
    live: bool,
    incarnation: u64,
}

fn open_ctl(path: &Path) -> io::Result<CtlView> {
    let file = File::open(path)?;
    if file.metadata()?.len() < HEADER as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "short shm control file",
        ));
    }
    // SAFETY: a read-only shared mapping; every access to it is atomic.
    let map = unsafe { Mmap::map(&file)? };
    let base = map.as_ptr();
    // SAFETY: one page at least, checked above.
    let (magic, vp, inc, state) = unsafe {
        (
            word(base, W_MAGIC).load(Ordering::Acquire),
            word(base, W_VERSION_PID).load(Ordering::Relaxed),
            word(base, W_EPOCH).load(Ordering::Relaxed),
            word(base, W_CTL_STATE).load(Ordering::Acquire),
        )
    };
    if magic != CTL_MAGIC || (vp & 0xffff_ffff) as u32 != VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a pagewire shm control file of this version",
        ));
    }
    let live = state == LIVE && pid_alive((vp >> 32) as u32);
    Ok(CtlView {
        map,
        live,
        incarnation: inc,
    })
}

/// Settings of a [`ShmConnection`].
#[derive(Debug, Clone, Default)]
pub struct ShmConfig {
    /// Directory of the owner's files; [`DEFAULT_DIR`] when `None`.
    pub dir: Option<PathBuf>,
    /// Test mode: chaotic copies (see [`Chaos`]).
    pub chaos: Option<Chaos>,
}

/// A reader's connection to an [`ShmOwner`]. READs are copies made by the
/// reader itself at post time; their completions wait in a queue for `poll`.
pub struct ShmConnection {
    dir: PathBuf,
    name: String,
    ctl: Mmap,
    maps: HashMap<u32, Mmap>,
    /// The last region read: (rkey, header address); skips the map lookup.
    last: Option<(u32, *const u8)>,
    ready: Vec<Completion>,
    chaos: Option<Chaos>,
    lost: bool,
}

const MAX_OUTSTANDING: usize = 1 << 16;
const MAX_READ: usize = 1 << 30;

impl ShmConnection {
    /// Opens owner `name`.
    ///
    /// # Errors
    /// [`ConnectError::NoSuchPeer`] when no live owner has that name.
    pub fn connect(name: &str, config: ShmConfig) -> Result<Self, ConnectError> {
        check_name(name)?;
        let dir = config.dir.unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
        let ctl = match open_ctl(&ctl_path(&dir, name)) {
            Ok(c) if c.live => c,
            Ok(_) => return Err(ConnectError::NoSuchPeer(name.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ConnectError::NoSuchPeer(name.to_owned()));
            }
            Err(e) => return Err(e.into()),
        };
        let _ = ctl.incarnation;
        Ok(Self {
            dir,
            name: name.to_owned(),
            ctl: ctl.map,
            maps: HashMap::new(),
            last: None,
            ready: Vec::new(),
            chaos: config.chaos,
            lost: false,
        })
    }

    fn owner_live(&self) -> bool {
        // SAFETY: `ctl` is a live mapping of one page. Acquire pairs with the
        // Release store in `ShmOwner::close`.
        unsafe { word(self.ctl.as_ptr(), W_CTL_STATE) }.load(Ordering::Acquire) == LIVE
    }

    fn map_region(&mut self, rkey: u32) -> Result<&Mmap, AccessFault> {
        if !self.maps.contains_key(&rkey) {
            let file = File::open(region_path(&self.dir, &self.name, rkey))
                .map_err(|_| AccessFault::UnknownKey)?;
            let size = file.metadata().map_err(|_| AccessFault::UnknownKey)?.len();
            if size < HEADER as u64 {
                return Err(AccessFault::UnknownKey);
            }
            // SAFETY: a read-only shared mapping; every access to it is atomic.
            let map = unsafe { Mmap::map(&file) }.map_err(|_| AccessFault::UnknownKey)?;
            // Huge pages for the reader's mapping too (a hint; see the module doc).
            if let Err(e) = map.advise(memmap2::Advice::HugePage) {
                tracing::debug!(error = %e, "shm connection: madvise(MADV_HUGEPAGE) refused");
            }
            let base = map.as_ptr();
            // SAFETY: at least one page, checked above.
            let (magic, vr, len) = unsafe {
                (
                    word(base, W_MAGIC).load(Ordering::Acquire),
                    word(base, W_VERSION_PID).load(Ordering::Relaxed),
                    word(base, W_LEN).load(Ordering::Relaxed),
                )
            };
            if magic != REG_MAGIC
                || (vr & 0xffff_ffff) as u32 != VERSION
                || (vr >> 32) as u32 != rkey
                || len
                    .checked_add(HEADER as u64)
                    .is_none_or(|n| n > map.len() as u64)
            {
                return Err(AccessFault::UnknownKey);
            }
            self.maps.insert(rkey, map);
        }
        Ok(&self.maps[&rkey])
    }

    /// One READ, copied now.
    ///
    /// # Safety
    /// `r.local..r.local + r.len` is valid for writes and exclusively ours.
    unsafe fn read_one(&mut self, r: &ReadRequest) -> Result<(), ReadError> {
        if !self.owner_live() {
            self.lost = true;
            return Err(ReadError::ConnectionLost);
        }
        let chaos = self.chaos;
        let base = match self.last {
            Some((k, base)) if k == r.region.rkey => base,
            _ => {
                let map = self
                    .map_region(r.region.rkey)
                    .map_err(ReadError::RemoteAccess)?;
                let base = map.as_ptr();
                self.last = Some((r.region.rkey, base));
                base
            }
        };
        // SAFETY: `base` is a mapping in `self.maps` (never removed), checked
        // to be at least one page when mapped. Acquire on the
        // state pairs with the Release store in `ShmRegion::drop`.
        let (state, epoch, len, addr) = unsafe {
            (
                word(base, W_REG_STATE).load(Ordering::Acquire),
                word(base, W_EPOCH).load(Ordering::Relaxed),
                word(base, W_LEN).load(Ordering::Relaxed),
                word(base, W_ADDR).load(Ordering::Relaxed),
            )
        };
        if state != LIVE {
            return Err(ReadError::RemoteAccess(AccessFault::UnknownKey));
        }
        if epoch != r.region.epoch {
            return Err(ReadError::RemoteAccess(AccessFault::StaleEpoch));
        }
        let off = r.remote_addr.wrapping_sub(addr);
        if r.remote_addr < addr || off.checked_add(r.len as u64).is_none_or(|end| end > len) {
            return Err(ReadError::RemoteAccess(AccessFault::OutOfBounds));
        }
        // SAFETY:
        // * source: `HEADER + off .. + len` lies inside the mapping (checked
        //   against the header's length, itself checked against the mapping's
        //   size when mapped), which `self.maps` keeps alive;
        // * destination: the caller's contract.
        unsafe {
            copy_from_shared_raw(
                base.add(HEADER + off as usize),
                r.local,
                r.len,
                chaos.as_ref(),
            )
        };
        // Acquire: every load of this copy is ordered before every load
        // that follows, the next READ's included (`ordered_reads`). A copy
        // that read a store of a frame's refill thus synchronises with the
        // refill's Release fence (the owner's `alloc`) before the READ of
        // the frame's generation that brackets it.
        fence(Ordering::Acquire);
        if !self.owner_live() {
            self.lost = true;
            return Err(ReadError::ConnectionLost);
        }
        Ok(())
    }
}

// SAFETY: the raw pointer in `last` points into a mapping owned by `maps`,
// which moves with the connection; nothing is thread-bound.
unsafe impl Send for ShmConnection {}

// SAFETY: `post_reads` completes every READ before it returns (the copy is
// made there) and queues exactly one completion per request; buffers are never
// touched after `post_reads` returns.
unsafe impl Connection for ShmConnection {
    unsafe fn post_reads(&mut self, reads: &[ReadRequest]) -> Result<(), PostError> {
        if self.lost {
            return Err(PostError::ConnectionLost);
        }
        if self.ready.len() + reads.len() > MAX_OUTSTANDING {
            return Err(PostError::QueueFull {
                outstanding: self.ready.len(),
                requested: reads.len(),
                limit: MAX_OUTSTANDING,
            });
        }
        if let Some(r) = reads.iter().find(|r| r.len == 0 || r.len > MAX_READ) {
            return Err(PostError::InvalidLength {
                len: r.len,
                limit: MAX_READ,
            });
        }
        for r in reads {
            let result = if self.lost {
                Err(ReadError::ConnectionLost)
            } else {
                // SAFETY: forwarded from this function's contract.
                unsafe { self.read_one(r) }
            };
            self.ready.push(Completion { id: r.id, result });
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let n = self.ready.len();
        out.append(&mut self.ready);
        n
    }

    fn wait(&mut self, out: &mut Vec<Completion>, _timeout: Duration) -> usize {
        self.poll(out)
    }

    fn outstanding(&self) -> usize {
        self.ready.len()
    }

    fn limits(&self) -> Limits {
        Limits {
            max_outstanding: MAX_OUTSTANDING,
            max_read_len: MAX_READ,
        }
    }

    fn ordered_reads(&self) -> bool {
        // `post_reads` copies each READ in this thread, in order, with an
        // Acquire fence after each (`read_one`).
        true
    }
}
