//! The one-sided remote reader: finds and reads a page in another node's
//! registered region with READs alone, no code running on the owner.
//!
//! The bytes it reads are laid out as [`pagewire_layout`] documents, and it
//! accepts a copy only through [`RawHeader::validate`], whose soundness for a
//! copy made word by word in any order is argued in `raw/frames.rs` (and in
//! ARCHITECTURE.md, "Remote hit"), or, on a connection whose READs are
//! ordered (`shm`), through [`RawHeader::validate_bracketed`]: a seqlock
//! over the frame's generation, READ before and after the header and the
//! frame, which spares the checksum (ARCHITECTURE.md, "Ordered readers").
//! Everything it reads from a bucket is a hint: a torn bucket or a chain
//! changed under it can only cost a retry or a fallback, never a wrong
//! byte, and an absent page is never taken as authoritative: the caller
//! falls back to the owner.
//!
//! # The read of one page
//!
//! 1. **Warm** (the client-side index cache knows `page → (frame,
//!    generation)`): READ the frame's header (64 B) and the frame
//!    (`page_size` B), both posted under one doorbell (on an ordered
//!    connection between two READs of the generation): **one round trip**.
//!    Validate; on success the read is done.
//! 2. **Cold, or the warm copy failed validation**: READ the page's head
//!    bucket; scan its 3 slots for `page + 1`. Not there: follow the
//!    overflow links, one READ each, at most `max_hops` of them, each index
//!    checked against the overflow count. A head whose lock bit is set is
//!    being changed: back off and retry.
//! 3. Found `(frame, gen32)`: READ header and frame as in 1 and validate
//!    (a cold hit is two round trips when the page sits in its head bucket).
//!    A frame index out of range, a failed validation or a generation whose
//!    low half is not `gen32` means the slot was torn or stale: retry.
//! 4. Not found: report [`Outcome::Absent`]. The caller asks the owner (a
//!    fault call on its `tcp` transport, or gRPC `FaultIn`), which faults
//!    the page in and is authoritative. A walk that raced a change of the
//!    chain may miss a page that is there: that costs the owner's request,
//!    never a wrong byte, so no READ is spent confirming the absence (a
//!    second READ of the head's `ctrl` could not make it authoritative
//!    either: the page may be evicted or inserted right after).
//! 5. Retries are bounded (`max_retries`), with exponential backoff; when
//!    they run out the read reports [`Outcome::GaveUp`] and the caller
//!    falls back to the owner as for an absent page.
//!
//! Every READ is bounds-checked twice: here against the layout decoded from
//! the superblock (and checked against the descriptor's length), and by the
//! transport against the registered region. A descriptor of an earlier
//! incarnation of the owner is refused by the transport (stale epoch or
//! unknown key): [`RemoteError::Stale`], and the caller refetches the
//! descriptor.

use crate::locations::Locations;
use pagewire_layout::{IndexCode, LINE, RawBucket, RawHeader, SUPERBLOCK_HEAD, Superblock};
use pagewire_rdma::{
    AccessFault, Connection, PostError, ReadError as WireError, ReadRequest, RegionDescriptor,
};
use std::time::Duration;

/// How a [`RemoteReader`] retries.
#[derive(Clone, Debug)]
pub struct ReaderConfig {
    /// Bucket walks after a failed validation, a locked or torn bucket,
    /// before the read gives up (and the caller falls back).
    pub max_retries: u32,
    /// Overflow buckets followed in one walk, at most (a chain recycled into
    /// another under the reader can otherwise loop it).
    pub max_hops: u32,
    /// First backoff between retries; doubles each time.
    pub backoff: Duration,
    /// Largest backoff.
    pub backoff_max: Duration,
    /// Validate frames by bracketing their copy with two READs of their
    /// generation (a seqlock) where the connection's READs are ordered
    /// ([`Connection::ordered_reads`]: `shm`), instead of computing their
    /// checksum. Off: every copy is validated by checksum, as on `tcp` and
    /// `verbs` (which ignore this).
    pub ordered_validation: bool,
}

impl Default for ReaderConfig {
    fn default() -> Self {
        Self {
            max_retries: 8,
            max_hops: 16,
            backoff: Duration::from_micros(1),
            backoff_max: Duration::from_micros(256),
            ordered_validation: true,
        }
    }
}

/// What one read achieved.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `out` holds the page's bytes (the valid length, zero past it) as of
    /// an instant during the read; `generation` is the frame's.
    Hit {
        frame: u32,
        generation: u64,
        /// Round trips this read took (1 for a warm hit).
        round_trips: u32,
    },
    /// The owner's index does not hold the page (as far as a consistent walk
    /// can tell): ask the owner.
    Absent,
    /// Retries ran out (the page keeps moving, or the owner runs an index the
    /// region does not expose): ask the owner.
    GaveUp,
}

/// Why a remote read failed outright (not a miss: an error to act on).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The descriptor is of an earlier incarnation of the owner, or revoked:
    /// fetch the owner's current descriptor and reconnect.
    #[error("the owner's region descriptor is stale: {0}")]
    Stale(WireError),
    #[error("READ failed: {0}")]
    Wire(WireError),
    #[error("READ not posted: {0}")]
    Post(#[from] PostError),
    #[error("the owner's superblock: {0}")]
    Superblock(#[from] pagewire_layout::SuperblockError),
    #[error("the superblock is of incarnation {found}, the descriptor of {expected}")]
    EpochMismatch { expected: u64, found: u64 },
    #[error("the region needs {need} bytes, the descriptor grants {granted}")]
    RegionTooSmall { need: u64, granted: u64 },
    #[error("page {page} is past the end of the file ({pages} pages)")]
    BeyondEnd { page: u64, pages: u64 },
    #[error("buffer of {got} bytes where {need} are needed")]
    BufferSize { need: usize, got: usize },
    /// The reader's map lease ran out (see [`RemoteReader::trust_until`]):
    /// confirm the map is current (and the descriptors with it), renew, and
    /// retry.
    #[error("the reader's map lease ran out {0:?} ago: refresh the map and renew")]
    LeaseExpired(std::time::Duration),
}

/// Counters of one reader.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderStats {
    pub reads: u64,
    /// Reads that validated from the index cache in one round trip.
    pub warm_hits: u64,
    /// Reads that found the page through the bucket index.
    pub cold_hits: u64,
    pub bucket_reads: u64,
    pub overflow_hops: u64,
    pub retries: u64,
    /// Copies that failed validation (the frame changed under the READ).
    pub validation_failures: u64,
    /// Buckets seen locked, torn or changed during a walk.
    pub torn_buckets: u64,
    pub absent: u64,
    pub gave_up: u64,
    pub round_trips: u64,
    pub bytes: u64,
}

impl ReaderStats {
    /// Adds `other`'s counters to these (totals over several readers, or
    /// over connections since closed).
    pub fn add(&mut self, other: &ReaderStats) {
        self.reads += other.reads;
        self.warm_hits += other.warm_hits;
        self.cold_hits += other.cold_hits;
        self.bucket_reads += other.bucket_reads;
        self.overflow_hops += other.overflow_hops;
        self.retries += other.retries;
        self.validation_failures += other.validation_failures;
        self.torn_buckets += other.torn_buckets;
        self.absent += other.absent;
        self.gave_up += other.gave_up;
        self.round_trips += other.round_trips;
        self.bytes += other.bytes;
    }
    /// Raises each counter to `other`'s where that is larger: a total that
    /// must only grow, kept from sums that can miss a part for a while.
    pub fn max_each(&mut self, other: &ReaderStats) {
        self.reads = self.reads.max(other.reads);
        self.warm_hits = self.warm_hits.max(other.warm_hits);
        self.cold_hits = self.cold_hits.max(other.cold_hits);
        self.bucket_reads = self.bucket_reads.max(other.bucket_reads);
        self.overflow_hops = self.overflow_hops.max(other.overflow_hops);
        self.retries = self.retries.max(other.retries);
        self.validation_failures = self.validation_failures.max(other.validation_failures);
        self.torn_buckets = self.torn_buckets.max(other.torn_buckets);
        self.absent = self.absent.max(other.absent);
        self.gave_up = self.gave_up.max(other.gave_up);
        self.round_trips = self.round_trips.max(other.round_trips);
        self.bytes = self.bytes.max(other.bytes);
    }
}

/// Checks that a buffer of `got` bytes holds a run of `n` pages of `ps`
/// bytes. `n` comes from the caller and `ps` from the owner's superblock
/// (bytes read from another process): their product must not wrap.
fn run_buffer(n: usize, ps: usize, got: usize) -> Result<(), RemoteError> {
    match n.checked_mul(ps) {
        Some(need) if got >= need => Ok(()),
        need => Err(RemoteError::BufferSize {
            need: need.unwrap_or(usize::MAX),
            got,
        }),
    }
}

/// A one-sided reader of one owner's region over one connection.
pub struct RemoteReader<C: Connection> {
    conn: C,
    desc: RegionDescriptor,
    sb: Superblock,
    cfg: ReaderConfig,
    /// The client-side index cache: page → (frame, generation), bounded
    /// ([`crate::locations`]).
    locations: Locations,
    stats: ReaderStats,
    /// Until when the map that named this owner may be trusted (None: the
    /// caller bounds it itself, as the node daemon does with its own lease).
    trust_until: Option<std::time::Instant>,
    /// Frames are validated by generation brackets, not checksums
    /// (`cfg.ordered_validation` on an ordered connection).
    ordered: bool,
}

impl<C: Connection> RemoteReader<C> {
    /// READ the owner's superblock through `conn` and check it: magic,
    /// version, a layout consistent with its counts, the descriptor's epoch,
    /// and a region the descriptor covers.
    pub fn connect(
        mut conn: C,
        desc: RegionDescriptor,
        cfg: ReaderConfig,
    ) -> Result<Self, RemoteError> {
        let mut head = [0u8; SUPERBLOCK_HEAD];
        read_all(&mut conn, desc, &mut [(0, &mut head[..])])?;
        let sb = Superblock::decode(&head)?;
        if sb.epoch != desc.epoch {
            return Err(RemoteError::EpochMismatch {
                expected: desc.epoch,
                found: sb.epoch,
            });
        }
        if sb.layout.len as u64 > desc.len {
            return Err(RemoteError::RegionTooSmall {
                need: sb.layout.len as u64,
                granted: desc.len,
            });
        }
        let ordered = cfg.ordered_validation && conn.ordered_reads();
        Ok(Self {
            conn,
            desc,
            sb,
            cfg,
            ordered,
            locations: Locations::new(sb.layout.frame_count),
            stats: ReaderStats::default(),
            trust_until: None,
        })
    }

    /// The most pages one [`RemoteReader::read_run`] batch should hold:
    /// a warm batch is two READs per page (header and frame; four on an
    /// ordered connection, with the two generation READs) under one
    /// doorbell, which must fit the connection's queue (at most
    /// [`crate::pool::RUN_CHUNK`]).
    pub fn batch_pages(&self) -> usize {
        (self.conn.limits().max_outstanding / reads_per_frame(self.ordered))
            .clamp(1, crate::pool::RUN_CHUNK)
    }

    /// The connection the reader reads over (for what its backend offers
    /// beside READs: a `tcp` CALL). Leave no request of yours outstanding
    /// on it: the reader expects an idle connection.
    pub fn connection_mut(&mut self) -> &mut C {
        &mut self.conn
    }

    /// The owner's superblock as read at connect.
    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// Trust the map that named this owner (and its descriptor) only until
    /// `until`: a read that starts or ends later fails with
    /// [`RemoteError::LeaseExpired`], and its bytes are not returned. One-
    /// sided reads bypass the owner's CPU, so an owner that lost its extents
    /// while frozen or cut off cannot refuse them; a reader that stops
    /// trusting its map one lease after it last confirmed it (less a drift
    /// margin) never reads an extent a new owner may already write (new
    /// owners fence writes for a lease plus the margin). Call it again each
    /// time the map is confirmed current (a `WatchMap` message, a
    /// heartbeat reply). `until` is checked against a clock that counts the
    /// time the machine spends suspended, as [`crate::cluster::MapFollower::trusted_until`]'s
    /// is; a deadline taken from `Instant::now()` only ends earlier.
    pub fn trust_until(&mut self, until: std::time::Instant) {
        self.trust_until = Some(until);
    }

    /// [`RemoteReader::trust_until`] with `Some`; `None`: no bound here
    /// (the caller bounds its trust itself, as the node daemon does).
    pub fn set_trust(&mut self, until: Option<std::time::Instant>) {
        self.trust_until = until;
    }

    fn check_lease(&self) -> Result<(), RemoteError> {
        match self.trust_until {
            Some(t) => {
                // The clock the trust window was computed with (it counts
                // suspend: `MapFollower::trusted_until`).
                let now = crate::clock::now();
                if now > t {
                    Err(RemoteError::LeaseExpired(now - t))
                } else {
                    Ok(())
                }
            }
            None => Ok(()),
        }
    }

    /// This reader's counters.
    pub fn stats(&self) -> ReaderStats {
        self.stats
    }

    /// Forget what the index cache knows of `page` (e.g. after the owner
    /// said where it faulted it in; see [`RemoteReader::learn`]).
    pub fn forget(&mut self, page: u64) {
        self.locations.remove(page);
    }

    /// Where the index cache says `page` is: `(frame, generation)`.
    pub fn location(&self, page: u64) -> Option<(u32, u64)> {
        self.locations.get(page)
    }

    /// Tell the index cache where the owner put `page` (the reply of a
    /// fault-in): the next read of it is one round trip.
    pub fn learn(&mut self, page: u64, frame: u32, generation: u64) {
        if (frame as usize) < self.sb.layout.frame_count {
            self.locations.insert(page, frame, generation);
        }
    }

    /// Pages the index cache holds now, and the most it can hold (its
    /// memory is bounded by the owner's frame count, whatever the file's
    /// size).
    pub fn index_cache(&self) -> (usize, usize) {
        (self.locations.len(), self.locations.capacity())
    }

    /// Whether each `(frame, generation)`, the frame and generation of a
    /// copy this owner's region gave earlier (an [`Outcome::Hit`], or a
    /// fault-in's location), is still that frame's live incarnation: one
    /// READ of each frame's generation word, under one doorbell per
    /// [`Connection::limits`] batch, each word equal to its `generation`.
    ///
    /// `true` means the earlier copies are the pages' content now, at the
    /// instant each word was copied: an incarnation's page and bytes never
    /// change while its generation is live (frames are refilled only after
    /// `invalidate` moves the generation to an even value, and generations
    /// never repeat in one region incarnation; a copy-on-write writes a new
    /// frame), and a write acknowledged before this call invalidated the
    /// old copy first, so the word would differ. That is the acceptance
    /// rule of a warm read, which takes any odd generation of the page in
    /// the cached frame, made stricter: the same generation, so the same
    /// bytes. The word is one aligned 8-byte word, which the transports
    /// copy whole, in any order with the others: each is checked alone.
    /// Copies from another incarnation of the owner's region cannot be
    /// checked here; the caller keeps them apart by region epoch.
    ///
    /// `false`: some frame moved on (or is out of range, or a generation is
    /// not a live one): read the pages again. Errors are a read's (the
    /// trust window checked before and after, as for a read).
    pub fn still_current(&mut self, frames: &[(u32, u64)]) -> Result<bool, RemoteError> {
        Ok(self.current_each(frames)?.iter().all(|&c| c))
    }

    /// [`RemoteReader::still_current`] for each `(frame, generation)` on
    /// its own: one answer per entry, in order, from the same READs (one
    /// per frame, under one doorbell per [`Connection::limits`] batch), so
    /// a caller checking several copies at once learns which moved on.
    /// An entry out of range or with an even (not live) generation is
    /// `false` without a READ. Errors are a read's and cover every entry.
    pub fn current_each(&mut self, frames: &[(u32, u64)]) -> Result<Vec<bool>, RemoteError> {
        let l = self.sb.layout;
        let checkable = |&(f, g): &(u32, u64)| (f as usize) < l.frame_count && g % 2 == 1;
        if !frames.iter().any(checkable) {
            return Ok(vec![false; frames.len()]);
        }
        self.check_lease()?;
        let mut words = vec![0u8; frames.len() * 8];
        let batch = self.conn.limits().max_outstanding.max(1);
        for (chunk, buf) in frames.chunks(batch).zip(words.chunks_mut(batch * 8)) {
            let mut reads: Vec<(u64, &mut [u8])> = chunk
                .iter()
                .zip(buf.chunks_exact_mut(8))
                .filter(|(e, _)| checkable(e))
                .map(|(&(f, _), w)| {
                    let at = l.header(f as usize) + pagewire_layout::hdr::GENERATION;
                    (at as u64, w)
                })
                .collect();
            if !reads.is_empty() {
                read_all(&mut self.conn, self.desc, &mut reads)?;
                self.stats.round_trips += 1;
            }
        }
        // The words are good only if the map still was when they arrived.
        self.check_lease()?;
        Ok(frames
            .iter()
            .zip(words.chunks_exact(8))
            .map(|(e, w)| checkable(e) && u64::from_le_bytes(w.try_into().expect("8 bytes")) == e.1)
            .collect())
    }

    /// Read `page` into `out` (at least `page_size` bytes; the bytes past
    /// the page's valid length are zero).
    pub fn read_page(&mut self, page: u64, out: &mut [u8]) -> Result<Outcome, RemoteError> {
        let ps = self.sb.layout.page_size;
        if page >= self.sb.file_pages {
            return Err(RemoteError::BeyondEnd {
                page,
                pages: self.sb.file_pages,
            });
        }
        if out.len() < ps {
            return Err(RemoteError::BufferSize {
                need: ps,
                got: out.len(),
            });
        }
        self.check_lease()?;
        self.stats.reads += 1;
        let o = self.read_one(page, &mut out[..ps])?;
        // The bytes are good only if the map still was when they arrived.
        self.check_lease()?;
        Ok(o)
    }

    /// [`RemoteReader::read_page`] after its checks, not counted in `reads`.
    fn read_one(&mut self, page: u64, out: &mut [u8]) -> Result<Outcome, RemoteError> {
        let mut trips = 0u32;
        if let Some((frame, _)) = self.locations.get(page) {
            trips += 1;
            if let Some(generation) = self.read_frame(page, frame, None, out)? {
                self.stats.warm_hits += 1;
                return Ok(self.hit(page, frame, generation, trips));
            }
            self.locations.remove(page);
        }
        if self.sb.index != IndexCode::Lockless {
            // The region's buckets are empty: only the owner can answer.
            self.stats.absent += 1;
            return Ok(Outcome::Absent);
        }
        let mut backoff = self.cfg.backoff;
        for attempt in 0..=self.cfg.max_retries {
            if attempt > 0 {
                self.stats.retries += 1;
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(self.cfg.backoff_max);
            }
            match self.walk(page, &mut trips)? {
                Walk::Found(frame, gen32) => {
                    trips += 1;
                    if let Some(generation) = self.read_frame(page, frame, Some(gen32), out)? {
                        self.stats.cold_hits += 1;
                        return Ok(self.hit(page, frame, generation, trips));
                    }
                }
                Walk::Absent => {
                    self.stats.absent += 1;
                    self.stats.round_trips += u64::from(trips);
                    return Ok(Outcome::Absent);
                }
                Walk::Torn => self.stats.torn_buckets += 1,
            }
        }
        self.stats.gave_up += 1;
        self.stats.round_trips += u64::from(trips);
        Ok(Outcome::GaveUp)
    }

    /// Read the run of pages `first..first + n` into `out` (`n` pages of
    /// `page_size` bytes), batching READs under one doorbell per round:
    ///
    /// 1. pages the index cache knows: every header and frame READ at once;
    /// 2. the others: their head buckets, one READ per cluster of 8
    ///    adjacent buckets (one READ covers 8 consecutive pages), all at once;
    ///    a page missing from an unlocked head bucket without a chain is
    ///    absent;
    /// 3. the frames those buckets name: every header and frame READ at once.
    ///
    /// A warm run is one round trip, a cold run whose pages sit in their head
    /// buckets (or are absent from them) two. Pages that fail any step (in an
    /// overflow chain, a locked bucket, failed validation) are read one by
    /// one with [`RemoteReader::read_page`].
    /// Returns one outcome per page.
    pub fn read_run(
        &mut self,
        first: u64,
        n: usize,
        out: &mut [u8],
    ) -> Result<Vec<Outcome>, RemoteError> {
        let ps = self.sb.layout.page_size;
        let end = first.saturating_add(n as u64);
        if end > self.sb.file_pages {
            return Err(RemoteError::BeyondEnd {
                page: end - 1,
                pages: self.sb.file_pages,
            });
        }
        run_buffer(n, ps, out.len())?;
        self.check_lease()?;
        self.stats.reads += n as u64;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; n];
        // Round 1: the pages whose location is cached.
        let known: Vec<(usize, u32, Option<u32>)> = (0..n)
            .filter_map(|i| {
                self.locations
                    .get(first + i as u64)
                    .map(|(f, _)| (i, f, None))
            })
            .collect();
        if !known.is_empty() {
            let ok = self.read_frames(first, &known, out)?;
            self.stats.round_trips += 1;
            for (i, f, g) in ok {
                self.stats.warm_hits += 1;
                outcomes[i] = Some(self.record(first + i as u64, f, g, 1));
            }
            for &(i, _, _) in &known {
                if outcomes[i].is_none() {
                    self.locations.remove(first + i as u64);
                }
            }
        }
        // Round 2: the head buckets of the rest, a cluster per READ.
        let rest: Vec<usize> = (0..n).filter(|&i| outcomes[i].is_none()).collect();
        if !rest.is_empty() && self.sb.index == IndexCode::Lockless {
            let l = self.sb.layout;
            let mut spans: Vec<(usize, usize)> = Vec::new(); // (first bucket, count)
            for &i in &rest {
                let b =
                    pagewire_layout::bucket_of(first + i as u64, l.bucket_count as u64) as usize;
                match spans.last_mut() {
                    Some((s, c)) if *s + *c == b => *c += 1,
                    Some((s, c)) if b >= *s && b < *s + *c => {}
                    _ => spans.push((b, 1)),
                }
            }
            let mut bufs: Vec<Vec<u8>> = spans.iter().map(|&(_, c)| vec![0u8; c * LINE]).collect();
            {
                let mut reads: Vec<(u64, &mut [u8])> = spans
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(&(b, _), buf)| (l.bucket(b) as u64, &mut buf[..]))
                    .collect();
                self.stats.bucket_reads += reads.len() as u64;
                self.stats.round_trips += 1;
                read_all(&mut self.conn, self.desc, &mut reads)?;
            }
            let mut found = Vec::new();
            for &i in &rest {
                let page = first + i as u64;
                let b = pagewire_layout::bucket_of(page, l.bucket_count as u64) as usize;
                let Some((k, &(s, _))) = spans
                    .iter()
                    .enumerate()
                    .find(|(_, (s, c))| b >= *s && b < *s + *c)
                else {
                    continue;
                };
                let off = (b - s) * LINE;
                let bucket = RawBucket::decode(&bufs[k][off..off + LINE]).expect("64 bytes");
                if bucket.ctrl & pagewire_layout::ctrl::LOCKED != 0 {
                    continue;
                }
                if let Some(val) = bucket.find(page) {
                    found.push((
                        i,
                        pagewire_layout::val_frame(val),
                        Some(pagewire_layout::val_gen32(val)),
                    ));
                } else if bucket.next().is_none() {
                    // Absent from a head bucket with no chain: as the walk
                    // would report (step 4), without walking it again.
                    self.stats.absent += 1;
                    outcomes[i] = Some(Outcome::Absent);
                }
            }
            // Round 3: the frames found.
            if !found.is_empty() {
                let ok = self.read_frames(first, &found, out)?;
                self.stats.round_trips += 1;
                for (i, f, g) in ok {
                    self.stats.cold_hits += 1;
                    outcomes[i] = Some(self.record(first + i as u64, f, g, 2));
                }
            }
        }
        // The rest, one by one (overflow chains, torn buckets, absences).
        let mut result = Vec::with_capacity(n);
        for (i, o) in outcomes.into_iter().enumerate() {
            let o = match o {
                Some(o) => o,
                None => self.read_one(first + i as u64, &mut out[i * ps..(i + 1) * ps])?,
            };
            result.push(o);
        }
        self.check_lease()?;
        Ok(result)
    }

    /// READ the header and frame of every `(index in run, frame, gen32)`
    /// under one doorbell into `out[index * page_size..]`, and validate each
    /// as page `first + index`. Returns those that validated with their
    /// generation.
    fn read_frames(
        &mut self,
        first: u64,
        want: &[(usize, u32, Option<u32>)],
        out: &mut [u8],
    ) -> Result<Vec<(usize, u32, u64)>, RemoteError> {
        let l = self.sb.layout;
        let ps = l.page_size;
        let want: Vec<(usize, u32, Option<u32>)> = want
            .iter()
            .copied()
            .filter(|&(_, f, _)| (f as usize) < l.frame_count)
            .collect();
        let ordered = self.ordered;
        let mut headers = vec![0u8; want.len() * LINE];
        // The generation READ before and after each frame (ordered only).
        let mut gens = vec![0u8; if ordered { want.len() * 16 } else { 0 }];
        {
            let mut frames: Vec<&mut [u8]> = out.chunks_exact_mut(ps).collect();
            let mut reads: Vec<(u64, &mut [u8])> =
                Vec::with_capacity(reads_per_frame(ordered) * want.len());
            let mut hdrs = headers.chunks_exact_mut(LINE);
            let mut gen_words = gens.chunks_exact_mut(8);
            // Take each wanted frame's buffer out of `frames` (indices are
            // distinct and increasing).
            let mut taken: Vec<Option<&mut [u8]>> = frames.drain(..).map(Some).collect();
            for &(i, f, _) in &want {
                let frame = (
                    l.header(f as usize) as u64,
                    hdrs.next().expect("one per frame"),
                    l.frame(f as usize) as u64,
                    taken[i].take().expect("each page once"),
                );
                let (frame_reads, n) = frame_reads(
                    frame,
                    ordered.then(|| {
                        let before = gen_words.next().expect("two per frame");
                        (before, gen_words.next().expect("two per frame"))
                    }),
                );
                reads.extend(frame_reads.into_iter().take(n));
            }
            read_all(&mut self.conn, self.desc, &mut reads)?;
        }
        let mut ok = Vec::with_capacity(want.len());
        for (k, &(i, f, gen32)) in want.iter().enumerate() {
            let page = first + i as u64;
            let frame = &out[i * ps..(i + 1) * ps];
            let bracket = ordered.then(|| &gens[k * 16..(k + 1) * 16]);
            let valid = RawHeader::decode(&headers[k * LINE..(k + 1) * LINE]).filter(|h| {
                frame_valid(h, page, frame, bracket)
                    && gen32.is_none_or(|g| h.generation as u32 == g)
            });
            match valid {
                Some(h) => ok.push((i, f, h.generation)),
                None => self.stats.validation_failures += 1,
            }
        }
        Ok(ok)
    }

    fn hit(&mut self, page: u64, frame: u32, generation: u64, trips: u32) -> Outcome {
        self.stats.round_trips += u64::from(trips);
        self.record(page, frame, generation, trips)
    }

    /// A validated page: remember where it is; `trips` is what the caller
    /// reports (the rounds of a batch are counted once, by `read_run`).
    fn record(&mut self, page: u64, frame: u32, generation: u64, trips: u32) -> Outcome {
        self.locations.insert(page, frame, generation);
        self.stats.bytes += self.sb.layout.page_size as u64;
        Outcome::Hit {
            frame,
            generation,
            round_trips: trips,
        }
    }

    /// READ `frame`'s header and bytes under one doorbell and validate them
    /// as `page` (and, from a bucket, a generation whose low half is
    /// `gen32`). `Some(generation)` when the copy in `out` is good.
    fn read_frame(
        &mut self,
        page: u64,
        frame: u32,
        gen32: Option<u32>,
        out: &mut [u8],
    ) -> Result<Option<u64>, RemoteError> {
        let l = self.sb.layout;
        if frame as usize >= l.frame_count {
            return Ok(None);
        }
        let ordered = self.ordered;
        let (mut header, mut gens) = ([0u8; LINE], [0u8; 16]);
        {
            let (before, after) = gens.split_at_mut(8);
            let (mut reads, n) = frame_reads(
                (
                    l.header(frame as usize) as u64,
                    &mut header[..],
                    l.frame(frame as usize) as u64,
                    &mut *out,
                ),
                ordered.then_some((before, after)),
            );
            read_all(&mut self.conn, self.desc, &mut reads[..n])?;
        }
        let bracket = ordered.then_some(&gens[..]);
        let ok = RawHeader::decode(&header).filter(|h| {
            frame_valid(h, page, out, bracket) && gen32.is_none_or(|g| h.generation as u32 == g)
        });
        match ok {
            Some(h) => Ok(Some(h.generation)),
            None => {
                self.stats.validation_failures += 1;
                Ok(None)
            }
        }
    }

    /// Steps 2 and 4: find `page` in its bucket chain.
    fn walk(&mut self, page: u64, trips: &mut u32) -> Result<Walk, RemoteError> {
        let l = self.sb.layout;
        let key = pagewire_layout::key_of(page);
        let head_off = l.bucket(pagewire_layout::bucket_of(page, l.bucket_count as u64) as usize);
        let mut buf = [0u8; LINE];
        self.read_line(head_off, &mut buf, trips)?;
        let head = RawBucket::decode(&buf).expect("64 bytes");
        if head.ctrl & pagewire_layout::ctrl::LOCKED != 0 {
            return Ok(Walk::Torn);
        }
        let mut bucket = head;
        let mut hops = 0;
        loop {
            if let Some(val) = bucket.find(page) {
                debug_assert!(bucket.slots.iter().any(|s| s.0 == key));
                return Ok(Walk::Found(
                    pagewire_layout::val_frame(val),
                    pagewire_layout::val_gen32(val),
                ));
            }
            let Some(next) = bucket.next() else { break };
            hops += 1;
            if next as usize >= l.overflow_count || hops > self.cfg.max_hops {
                return Ok(Walk::Torn);
            }
            self.stats.overflow_hops += 1;
            self.read_line(l.overflow(next as usize), &mut buf, trips)?;
            bucket = RawBucket::decode(&buf).expect("64 bytes");
        }
        // Absent as far as this walk saw. A walk that raced a change of
        // the chain may have missed the page: no READ can confirm an
        // absence for good, and the caller asks the owner anyway, whose
        // answer is authoritative (a false absence costs that request,
        // never a wrong byte).
        Ok(Walk::Absent)
    }

    fn read_line(
        &mut self,
        offset: usize,
        buf: &mut [u8; LINE],
        trips: &mut u32,
    ) -> Result<(), RemoteError> {
        self.stats.bucket_reads += 1;
        *trips += 1;
        read_all(
            &mut self.conn,
            self.desc,
            &mut [(offset as u64, &mut buf[..])],
        )
    }
}

enum Walk {
    Found(u32, u32),
    Absent,
    /// Locked, torn, or changed while walked: retry.
    Torn,
}

/// READs per frame: header and bytes, and on an ordered connection the
/// generation before and after them.
fn reads_per_frame(ordered: bool) -> usize {
    if ordered { 4 } else { 2 }
}

/// The READs of one frame, `(header offset, header buffer, frame offset,
/// frame buffer)`, in a fixed array (the first `n` are used, so a single
/// frame's read needs no heap): on an ordered connection (`bracket`: two
/// 8-byte buffers) bracketed by two READs of its generation word, a seqlock
/// read (ARCHITECTURE.md, "Ordered readers"); else header and bytes alone,
/// to be validated by checksum.
fn frame_reads<'a>(
    (header_at, header, frame_at, frame): (u64, &'a mut [u8], u64, &'a mut [u8]),
    bracket: Option<(&'a mut [u8], &'a mut [u8])>,
) -> ([(u64, &'a mut [u8]); 4], usize) {
    let generation_at = header_at + pagewire_layout::hdr::GENERATION as u64;
    match bracket {
        // In this order: the generation first (the READs after it see at
        // least its incarnation's stores), the generation last (any store
        // of a refill seen by the copies is seen by it too).
        Some((before, after)) => (
            [
                (generation_at, before),
                (header_at, header),
                (frame_at, frame),
                (generation_at, after),
            ],
            4,
        ),
        None => (
            [
                (header_at, header),
                (frame_at, frame),
                (0, &mut []),
                (0, &mut []),
            ],
            2,
        ),
    }
}

/// Whether the copy `h` + `frame` is page `page`: by the generation words
/// READ around it on an ordered connection (`bracket`: 16 bytes, before
/// then after), else by its checksum.
fn frame_valid(h: &RawHeader, page: u64, frame: &[u8], bracket: Option<&[u8]>) -> bool {
    match bracket {
        Some(b) => {
            let word = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
            h.validate_bracketed(page, word(0), word(8))
        }
        None => h.validate(page, frame),
    }
}

/// Post every `(offset, buffer)` READ under one doorbell and wait for all.
fn read_all<C: Connection>(
    conn: &mut C,
    desc: RegionDescriptor,
    reads: &mut [(u64, &mut [u8])],
) -> Result<(), RemoteError> {
    let reqs: Vec<ReadRequest> = reads
        .iter_mut()
        .enumerate()
        .map(|(i, (off, buf))| ReadRequest::new(i as u64, desc, *off, buf))
        .collect();
    // SAFETY: every buffer is exclusively borrowed through `reads` for this
    // whole call, and we return only after each request has completed: the
    // trait promises exactly one completion per accepted request, and each
    // backend's operation timeout bounds the wait.
    unsafe { conn.post_reads(&reqs)? };
    let mut pending = reqs.len();
    let mut done = Vec::with_capacity(reqs.len());
    let mut first_err = None;
    while pending > 0 {
        done.clear();
        if conn.poll(&mut done) == 0 {
            conn.wait(&mut done, Duration::from_millis(10));
        }
        for c in &done {
            pending -= 1;
            if let Err(e) = &c.result
                && first_err.is_none()
            {
                first_err = Some(e.clone());
            }
        }
    }
    match first_err {
        None => Ok(()),
        Some(e @ WireError::RemoteAccess(AccessFault::StaleEpoch | AccessFault::UnknownKey)) => {
            Err(RemoteError::Stale(e))
        }
        Some(e) => Err(RemoteError::Wire(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::{RemoteError, run_buffer};

    /// Issue 18, finding 8: `n * ps` wrapped (in release) for a run long
    /// enough, so a buffer far too small passed the check.
    #[test]
    fn a_run_whose_size_wraps_is_refused() {
        assert!(run_buffer(16, 4096, 16 * 4096).is_ok());
        assert!(matches!(
            run_buffer(16, 4096, 16 * 4096 - 1),
            Err(RemoteError::BufferSize { need: 65536, .. })
        ));
        let wraps = usize::MAX / 4096 + 2;
        assert_eq!(wraps.wrapping_mul(4096), 4096, "it wraps to one page");
        assert!(matches!(
            run_buffer(wraps, 4096, 4096),
            Err(RemoteError::BufferSize {
                need: usize::MAX,
                got: 4096
            })
        ));
    }
}
