//! The FUSE file system: a root directory holding one file, the cluster's.
//!
//! Inode 1 is the directory, inode 2 the file. Directory operations and
//! attributes are answered on the FUSE thread from what the mount knows
//! (the file's size is fixed); reads and writes run on the FUSE thread too
//! while a permit is free, else on the overflow workers, always under the
//! watchdog's deadline ([`crate::deadline`]).

use std::ffi::OsStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
    WriteFlags,
};
use tracing::{info, trace, warn};

use crate::deadline::{Dispatcher, Done, Reply, What};
use crate::prefetch::{PrefetchStats, Prefetcher};
use crate::range::{PageWrite, read_span, write_pages};
use crate::revalidate::{RevalidateStats, Revalidator};
use crate::source::Source;
use crate::{Consistency, MAX_READ, MountConfig};

const ROOT: INodeNo = INodeNo(1);
/// The file's inode.
pub const FILE: INodeNo = INodeNo(2);
/// Threads that read ahead of sequential readers.
const READ_AHEAD_THREADS: usize = 2;
/// Partial-page writes of pages that hash to one stripe run one at a time.
const STRIPES: usize = 64;

/// The file system the session serves.
pub struct PageFs {
    inner: Arc<Inner>,
}

struct Inner {
    source: Arc<Source>,
    cfg: MountConfig,
    dispatch: Dispatcher,
    /// Read-ahead of sequential readers (`cfg.read_ahead`).
    ahead: Option<Prefetcher>,
    /// The cached mode's records of what the kernel may hold.
    revalidate: Option<Arc<Revalidator>>,
    /// The cores this process may run on.
    cores: usize,
    file: FileAttr,
    dir: FileAttr,
    /// Serializes writes to pages of one stripe within this process (a
    /// read-modify-write of a page must not interleave with another write
    /// of it from this mount).
    stripes: Vec<Mutex<()>>,
}

impl PageFs {
    /// A file system over `source`; starts `cfg.workers` worker threads.
    pub fn new(source: Arc<Source>, cfg: MountConfig) -> std::io::Result<Self> {
        let now = SystemTime::now();
        // SAFETY: getuid and getgid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let size = source.file_size();
        let ps = source.page_size().max(1);
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
            // A hint for programs' buffer sizes: whole pages, up to max_read.
            blksize: ((MAX_READ as usize / ps).max(1) * ps).min(u32::MAX as usize) as u32,
            flags: 0,
        };
        let perm = if cfg.writable { 0o644 } else { 0o444 };
        let file = attr(FILE, FileType::RegularFile, perm, size, 1);
        let dir = attr(ROOT, FileType::Directory, 0o555, 0, 2);
        let dispatch = Dispatcher::start(cfg.workers, cfg.deadline)?;
        let ahead = match cfg.read_ahead {
            true => Some(Prefetcher::start(source.clone(), READ_AHEAD_THREADS)?),
            false => None,
        };
        let revalidate = match cfg.consistency {
            Consistency::Cached(_) => Some(Arc::new(Revalidator::default())),
            Consistency::Direct => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                source,
                dispatch,
                ahead,
                revalidate,
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
                file,
                dir,
                stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
                cfg,
            }),
        })
    }
}

impl Inner {
    fn ttl(&self) -> Duration {
        match self.cfg.consistency {
            // The attributes never change (the size is fixed): a second
            // saves the kernel a GETATTR per stat.
            Consistency::Direct => Duration::from_secs(1),
            Consistency::Cached(secs) => secs,
        }
    }

    fn attr_of(&self, ino: INodeNo) -> Option<&FileAttr> {
        match ino {
            ROOT => Some(&self.dir),
            FILE => Some(&self.file),
            _ => None,
        }
    }

    /// Writes `data` at `offset` ([`Inner::write_parts`]); in the cached
    /// mode, then records the pages it touched as written, for the next
    /// tick to drop from the kernel's cache.
    fn write(&self, offset: u64, data: &[u8], buf: &mut Vec<u8>) -> Result<Done, Errno> {
        let src = &self.source;
        let Some(parts) = write_pages(offset, data.len(), src.file_size(), src.page_size()) else {
            return Err(Errno::EFBIG);
        };
        let r = self.write_parts(offset, data, &parts, buf);
        if let (Some(rv), Some(first), Some(last)) = (&self.revalidate, parts.first(), parts.last())
        {
            // After the writes and before the reply, whatever the outcome:
            // the kernel keeps the whole pages written through its cache
            // once the reply reaches it (a tick before the writes ended
            // could drop them too early).
            rv.record_written(first.page, last.page - first.page + 1);
        }
        r
    }

    /// Writes `parts` of `data` (a write at `offset`), page by page; the
    /// bytes written (short when a later page failed), or the first page's
    /// error.
    fn write_parts(
        &self,
        offset: u64,
        data: &[u8],
        parts: &[PageWrite],
        buf: &mut Vec<u8>,
    ) -> Result<Done, Errno> {
        let src = &self.source;
        let ps = src.page_size();
        let mut written = 0usize;
        for p in parts {
            let len = src.page_len(p.page);
            let stripe = &self.stripes[(p.page % STRIPES as u64) as usize];
            let _one_writer = stripe.lock().unwrap_or_else(|e| e.into_inner());
            let r = if p.whole {
                src.write_page(p.page, &data[p.data.clone()])
            } else {
                // Read-modify-write: the page as the cluster has it now,
                // with the written bytes over it.
                buf.clear();
                buf.resize(ps, 0);
                src.read_run(p.page, 1, buf).and_then(|()| {
                    buf[p.at..p.at + p.data.len()].copy_from_slice(&data[p.data.clone()]);
                    src.write_page(p.page, &buf[..len])
                })
            };
            if let Err(e) = r {
                warn!(
                    "write of page {} ({} bytes at offset {offset}): {e}: {}",
                    p.page,
                    data.len(),
                    if written == 0 { "EIO" } else { "short write" }
                );
                if written == 0 {
                    return Err(Errno::EIO);
                }
                break;
            }
            written += p.data.len();
        }
        Ok(Done::Written(written as u32))
    }
}

impl Filesystem for PageFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Reads and writes of up to 1 MiB per request (with the mount
        // option max_read; the kernel caps both at its max_pages).
        if let Err(max) = config.set_max_write(MAX_READ) {
            let _ = config.set_max_write(max);
        }
        // As much readahead as the kernel offers here (main raises the
        // device's read_ahead_kb to max_read after the mount).
        if let Err(max) = config.set_max_readahead(MAX_READ) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        let caps = config.capabilities();
        if caps.contains(InitFlags::FUSE_ASYNC_DIO) {
            // Asynchronous direct I/O (libaio, io_uring) stays asynchronous.
            let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        }
        if self.inner.cfg.consistency == Consistency::Direct {
            if config
                .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
                .is_ok()
            {
                info!(
                    "direct I/O with mmap: the kernel allows shared mappings of direct-I/O files"
                );
            } else {
                warn!(
                    "this kernel lacks FUSE_DIRECT_IO_ALLOW_MMAP (Linux < 6.6): \
                     mmap(MAP_SHARED) of the file fails with ENODEV in the default direct-I/O \
                     mode (MAP_PRIVATE works); mount with --cached SECS for shared mappings"
                );
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent != ROOT {
            return reply.error(Errno::ENOENT);
        }
        if name == OsStr::new(&self.inner.cfg.name) {
            reply.entry(&self.inner.ttl(), &self.inner.file, Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.inner.attr_of(ino) {
            Some(a) => reply.attr(&self.inner.ttl(), a),
            None => reply.error(Errno::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<fuser::TimeOrNow>,
        mtime: Option<fuser::TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.inner.attr_of(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if ino == FILE && !self.inner.cfg.writable && size.is_some() {
            return reply.error(Errno::EROFS);
        }
        match size {
            // The file's size is the cluster's: no truncate, no extend.
            Some(s) if s != attr.size => {
                warn!(
                    "refused to change the size of the file from {} to {s}: the cluster's file has a fixed size (EPERM)",
                    attr.size
                );
                return reply.error(Errno::EPERM);
            }
            _ => {}
        }
        if mode.is_some() || uid.is_some() || gid.is_some() {
            return reply.error(Errno::EPERM);
        }
        // Times are not kept (they are the mount's start); a touch of them
        // is accepted and changes nothing, so `touch` and `cp -p` work.
        let _ = (atime, mtime, ctime);
        reply.attr(&self.inner.ttl(), attr);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY && !self.inner.cfg.writable {
            return reply.error(Errno::EROFS);
        }
        let mut f = match self.inner.cfg.consistency {
            Consistency::Direct => FopenFlags::FOPEN_DIRECT_IO,
            // Cached pages live across opens; the invalidation timer bounds
            // their age (main.rs).
            Consistency::Cached(_) => FopenFlags::FOPEN_KEEP_CACHE,
        };
        if self.inner.cfg.writable && self.inner.cfg.consistency == Consistency::Direct {
            // Writes of different pages need not wait for each other (pages
            // of one stripe are ordered by the stripe lock).
            f |= FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
        }
        reply.opened(FileHandle(0), f);
    }

    #[allow(clippy::too_many_arguments)]
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
        trace!("read of {size} bytes at offset {offset}");
        let inner = self.inner.clone();
        let src = &self.inner.source;
        let ps = src.page_size();
        let Some(span) = read_span(offset, size, src.file_size(), ps) else {
            return reply.data(&[]);
        };
        let what = What {
            op: "read",
            offset,
            len: u64::from(size),
        };
        self.inner
            .dispatch
            .run(what, Reply::Data(reply), move |buf: &mut Vec<u8>| {
                // Into the thread's buffer, grown and never cleared
                // (`Source::read_run_into`).
                let r = match &inner.ahead {
                    Some(ahead) => {
                        // Read ahead only with a core to spare: with every
                        // core serving a request it only adds work (1 MiB
                        // reads at depth 16 on 2 cores lost 11% with it).
                        let spare = inner.dispatch.busy() < inner.cores;
                        let wait = inner.cfg.deadline / 2;
                        ahead.read(span.first, span.count, buf, wait, spare)
                    }
                    None => inner.source.read_run_into(span.first, span.count, buf),
                };
                match r {
                    Ok(pages) => {
                        // Before the reply: the kernel may cache these bytes
                        // only once it has them.
                        if let Some(r) = &inner.revalidate {
                            r.record(span.first, &pages);
                        }
                        Ok(Done::Data(span.skip..span.skip + span.len))
                    }
                    Err(e) => {
                        warn!("{what}: {e}: EIO");
                        Err(Errno::EIO)
                    }
                }
            });
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if !self.inner.cfg.writable {
            return reply.error(Errno::EROFS);
        }
        if offset >= self.inner.file.size && !data.is_empty() {
            return reply.error(Errno::EFBIG);
        }
        let inner = self.inner.clone();
        let data = data.to_vec();
        self.inner.dispatch.run(
            What {
                op: "write",
                offset,
                len: data.len() as u64,
            },
            Reply::Write(reply),
            move |buf: &mut Vec<u8>| inner.write(offset, &data, buf),
        );
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Writes are write-through: nothing is held back.
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Every acknowledged write is in the backing file already.
        reply.ok();
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
            (FILE, FileType::RegularFile, self.inner.cfg.name.as_str()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bsize = self.inner.file.blksize;
        let blocks = self.inner.file.size.div_ceil(u64::from(bsize.max(1)));
        reply.statfs(blocks, 0, 0, 2, 0, bsize, 255, bsize);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(self.no_new_names());
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(self.no_new_names());
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(self.no_new_names());
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(self.no_new_names());
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(self.no_new_names());
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(self.no_new_names());
    }

    #[allow(clippy::too_many_arguments)]
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        // Not a terminal, no other ioctls (isatty() asks TCGETS).
        reply.error(Errno::ENOTTY);
    }

    fn destroy(&mut self) {
        let expired = self.inner.dispatch.expired();
        if expired > 0 {
            warn!("{expired} request(s) were answered EIO at their deadline during this mount");
        }
        if let Some(s) = self.revalidate_stats() {
            info!(
                "cached pages: {} checks of {} runs: {} kept, {} dropped as changed or uncheckable, {} times the whole file (records full); checks took {:?} in all, {:?} at most",
                s.ticks, s.checked, s.kept, s.dropped, s.dropped_all, s.busy, s.longest
            );
        }
        if let Some(s) = self.read_ahead_stats() {
            info!(
                "read-ahead: {} runs read ahead, {} used, {} stale (read again), {} failed, {} reached first by their reader, {} unused",
                s.read, s.used, s.stale, s.failed, s.claimed, s.unused
            );
        }
    }
}

impl PageFs {
    /// What read-ahead did so far (None: off).
    pub fn read_ahead_stats(&self) -> Option<PrefetchStats> {
        self.inner.ahead.as_ref().map(Prefetcher::stats)
    }

    /// The cached mode's records (None in direct mode), for the mount's
    /// timer to [`Revalidator::tick`] every period.
    pub fn revalidator(&self) -> Option<Arc<Revalidator>> {
        self.inner.revalidate.clone()
    }

    /// What the cached mode's revalidation did so far (None: direct mode).
    pub fn revalidate_stats(&self) -> Option<RevalidateStats> {
        self.inner.revalidate.as_ref().map(|r| r.stats())
    }

    /// The directory holds exactly the one file.
    fn no_new_names(&self) -> Errno {
        if self.inner.cfg.writable {
            Errno::EPERM
        } else {
            Errno::EROFS
        }
    }
}
