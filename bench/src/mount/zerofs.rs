//! The do-nothing FUSE file system: one read-only file of a given size
//! whose every read is answered with zeros from memory, on the FUSE thread
//! that took it. It is the floor of any FUSE file system on this machine:
//! the kernel's round trip through `/dev/fuse` and the copy of the reply,
//! nothing else.
//!
//! It is mounted the way `pagewire-mount` mounts (mount/src/main.rs and
//! fs.rs): the same mount options (`default_permissions`, `noatime`,
//! `max_read=1048576`, `ro`), the same FUSE init (1 MiB `max_write`,
//! readahead, 64 background requests, async direct I/O, direct I/O with
//! mmap), the file opened with `FOPEN_DIRECT_IO`, four FUSE threads each
//! with its own cloned `/dev/fuse` descriptor. The differences: it runs as
//! threads of the bench's own process (`pagewire-mount` is its own
//! process), a read is answered on the FUSE thread (`pagewire-mount` hands
//! it to one of its `--workers` threads and answers from there), and the
//! device's readahead is left at the kernel's default (`pagewire-mount`
//! raises it to 1 MiB; with direct I/O the kernel does no readahead).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Context;
use fuser::{
    BackgroundSession, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenAccMode, OpenFlags, ReplyAttr,
    ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request, Session,
};

/// As pagewire-mount's `MAX_READ`.
const MAX_READ: u32 = 1 << 20;
const ROOT: INodeNo = INodeNo(1);
const FILE: INodeNo = INodeNo(2);
/// The file's name, as pagewire-mount's default.
pub const NAME: &str = "data";
static ZEROS: [u8; MAX_READ as usize] = [0; MAX_READ as usize];

struct ZeroFs {
    file: FileAttr,
    dir: FileAttr,
}

impl ZeroFs {
    fn new(size: u64) -> Self {
        let now = SystemTime::now();
        // SAFETY: getuid and getgid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let attr = |ino, kind, perm, size, nlink| FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind,
            perm,
            nlink,
            uid,
            gid,
            rdev: 0,
            blksize: MAX_READ,
            flags: 0,
        };
        Self {
            file: attr(FILE, FileType::RegularFile, 0o444, size, 1),
            dir: attr(ROOT, FileType::Directory, 0o555, 0, 2),
        }
    }
}

const TTL: Duration = Duration::from_secs(1);

impl Filesystem for ZeroFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_write(MAX_READ) {
            let _ = config.set_max_write(max);
        }
        if let Err(max) = config.set_max_readahead(MAX_READ) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        if config.capabilities().contains(InitFlags::FUSE_ASYNC_DIO) {
            let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        }
        let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT && name == OsStr::new(NAME) {
            reply.entry(&TTL, &self.file, Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino {
            ROOT => reply.attr(&TTL, &self.dir),
            FILE => reply.attr(&TTL, &self.file),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        let left = self.file.size.saturating_sub(offset);
        let n = left.min(u64::from(size)).min(ZEROS.len() as u64) as usize;
        reply.data(&ZEROS[..n]);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (FILE, FileType::RegularFile, NAME),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The mounted zero file system; unmounted on drop (lazily detached if
/// the unmount fails, e.g. busy).
pub struct ZeroMount {
    session: Option<BackgroundSession>,
    pub dir: PathBuf,
}

impl ZeroMount {
    /// Mounts a file of `size` bytes as `dir/data`, served by `threads`
    /// FUSE threads, and waits until it shows that size.
    pub fn start(dir: &Path, size: u64, threads: usize) -> anyhow::Result<Self> {
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            MountOption::FSName("pwbench-zero".into()),
            MountOption::Subtype("pwbench-zero".into()),
            MountOption::DefaultPermissions,
            MountOption::NoAtime,
            MountOption::CUSTOM(format!("max_read={MAX_READ}")),
            MountOption::RO,
        ];
        config.n_threads = Some(threads.max(1));
        config.clone_fd = true;
        let session = Session::new(ZeroFs::new(size), dir, &config)
            .with_context(|| format!("mounting the zero file system on {}", dir.display()))?;
        let m = ZeroMount {
            session: Some(session.spawn().context("starting the zero FS threads")?),
            dir: dir.to_owned(),
        };
        super::wait_for_file(&m.dir.join(NAME), size, Duration::from_secs(30), || Ok(()))?;
        Ok(m)
    }
}

impl Drop for ZeroMount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take()
            && let Err(e) = s.umount_and_join()
        {
            eprintln!("mount: unmounting the zero FS: {e}");
        }
        super::detach_if_mounted(&self.dir);
    }
}
