//! Index variants behind one trait, so the benchmarks compare the lockless
//! index with the locking designs that came before it:
//!
//! | variant    | readers                          | writers                         | history |
//! |------------|----------------------------------|---------------------------------|---------|
//! | `lockless` | no lock: get-unless-zero+recheck | per-bucket bit lock             | Piggin 2006, Zijlstra 2007 |
//! | `rwlock`   | shared lock on one tree          | exclusive lock on the same tree | 2.6.12's `tree_lock` |
//! | `mutex`    | one lock for everyone            | the same lock                   | the spinlock before it |
//! | `sharded`  | shared lock on 1 of 64 trees     | exclusive lock on that tree     | the "multiple radix trees" proposal |
//!
//! All four keep the same frames and refcount protocol ([`crate::raw::frames`]);
//! only how the page → frame map is found and changed differs. Only the
//! lockless index lives in the registered region and can be read remotely.

use crate::raw::frames::{Frames, Freeze};
use crate::raw::index::{Insert as RawInsert, RawIndex, Remove as RawRemove};
use crate::sync::{Mutex, RwLock};
use rustc_hash::FxHashMap;

pub use crate::raw::frames::Frames as FrameTable;

/// Which index a cache uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IndexKind {
    Lockless,
    RwLock,
    Mutex,
    Sharded,
}

impl IndexKind {
    pub const ALL: [IndexKind; 4] = [
        IndexKind::Lockless,
        IndexKind::RwLock,
        IndexKind::Mutex,
        IndexKind::Sharded,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            IndexKind::Lockless => "lockless",
            IndexKind::RwLock => "rwlock",
            IndexKind::Mutex => "mutex",
            IndexKind::Sharded => "sharded",
        }
    }
}

impl std::fmt::Display for IndexKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for IndexKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!("unknown index {s:?}: expected lockless, rwlock, mutex or sharded")
            })
    }
}

/// What linking an entry does to its frame.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Make the prepared frame visible with this many references (the
    /// cache's inserts: 1 for the index, 2 when the caller keeps one).
    Publish { refs: u32 },
    /// Link the entry only; the frame's header is not touched (index-only
    /// benchmarks and tests, whose frames hold no page).
    EntryOnly,
}

impl Link {
    pub(crate) fn apply(self, frames: &Frames, frame: u32, generation: u64) {
        if let Link::Publish { refs } = self {
            frames.make_visible(frame, generation, refs);
        }
    }
}

/// The outcome of inserting an entry.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Inserted {
    Yes,
    /// The page was already indexed; the new frame was not linked.
    AlreadyPresent,
    /// The index has no room (lockless overflow pool exhausted).
    NoRoom,
}

/// What removing an entry does when readers hold its frame.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfHeld {
    /// Leave the entry in place ([`Removed::Busy`]): eviction to make room.
    Skip,
    /// Unlink it all the same ([`Removed::Unlinked`]): the frame is
    /// invalidated and leaves the index like a copy-on-write's old copy, and
    /// its last reader frees it. Dropping pages that must go (an extent the
    /// node no longer answers for).
    Unlink,
}

/// The outcome of removing an entry.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Removed {
    /// Unlinked, and the frame frozen: the caller frees it.
    Yes,
    /// Unlinked and invalidated while readers held the frame
    /// ([`IfHeld::Unlink`]): the caller drops the index's reference.
    Unlinked,
    /// A reader holds the frame ([`IfHeld::Skip`]); nothing changed.
    Busy,
    /// The index maps the page elsewhere or not at all.
    Absent,
}

/// A page → frame index. Implemented by the four variants of this module;
/// the methods are for [`crate::PageCache`], which owns the frames.
pub trait Index: Send + Sync + 'static {
    const KIND: IndexKind;

    #[doc(hidden)]
    fn create(frames: &FrameTable) -> Self;

    /// Find `page` and take a reference on its frame.
    #[doc(hidden)]
    fn get(&self, frames: &FrameTable, page: u64, retries: &mut u64) -> Option<u32>;

    /// Find `page` for a reader pinned with crossbeam-epoch's default
    /// collector (`guard`), leaving no reference held: the frame's bytes
    /// stay its published copy's until the guard drops, because a
    /// published frame is freed only after the grace period. This default
    /// takes a counted reference and drops it while pinned; the lockless
    /// index overrides it with a lookup that stores nothing.
    #[doc(hidden)]
    #[inline(always)]
    fn get_pinned(
        &self,
        frames: &FrameTable,
        page: u64,
        guard: &crossbeam_epoch::Guard,
        retries: &mut u64,
    ) -> Option<u32> {
        let _ = guard;
        let f = self.get(frames, page, retries)?;
        frames.put(f);
        Some(f)
    }

    /// Link `page → (frame, generation)` unless the page is present; `link`
    /// says whether the (prepared) frame is made visible as it goes in.
    #[doc(hidden)]
    fn insert(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Inserted;

    /// Link a run of pages starting at `first` (gang insertion). Reports each
    /// page's outcome through `done`; `link` applies to every frame.
    #[doc(hidden)]
    fn insert_run(
        &self,
        frames: &FrameTable,
        first: u64,
        run: &[(u32, u64)],
        link: Link,
        done: &mut dyn FnMut(usize, Inserted),
    ) {
        for (i, &(f, g)) in run.iter().enumerate() {
            done(i, self.insert(frames, first + i as u64, f, g, link));
        }
    }

    /// Point `page` at a new, prepared frame: the frame it replaces is
    /// invalidated, then the new one made visible, then the entry swapped,
    /// all under the index's lock. Returns the replaced frame, if any (the
    /// caller drops the index's reference on it).
    #[doc(hidden)]
    fn replace(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u32>, Inserted>;

    /// Unlink `page` if it maps to `frame` at `generation` and the frame
    /// can be frozen (or, held by readers, as `if_held` says); the frame is
    /// invalidated before the entry goes.
    #[doc(hidden)]
    fn remove(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        if_held: IfHeld,
    ) -> Removed;

    /// Copy `page` into `out` without taking a reference, if the variant
    /// can (a seqlock read of the frame). `Ok(Some((generation, len)))` on
    /// a hit, `Ok(None)` on a miss, `Err(len)` if `out` is shorter than the
    /// page; `None` (outer) if the variant has no such path.
    #[doc(hidden)]
    #[allow(clippy::type_complexity)]
    fn copy_out(
        &self,
        frames: &FrameTable,
        page: u64,
        out: &mut [u8],
        retries: &mut u64,
    ) -> Option<Result<Option<(u64, usize)>, usize>> {
        let _ = (frames, page, out, retries);
        None
    }

    /// The frame indexed for `page`, without taking a reference.
    #[doc(hidden)]
    fn peek(&self, frames: &FrameTable, page: u64) -> Option<(u32, u64)>;

    /// Fault in the index's memory for `entries` entries, as the lockless
    /// region's metadata is at creation (for benchmarks that compare
    /// insertion on warm memory).
    #[doc(hidden)]
    fn prewarm(&self, entries: u64) {
        let _ = entries;
    }
}

/// Fill a map with `entries` keys and clear it: capacity and touched memory
/// stay, so later inserts do not pay first-touch page faults.
fn prewarm_map(map: &mut Map, entries: u64) {
    for p in 0..entries {
        map.insert(p, (0, 0));
    }
    map.clear();
}

/// The lockless index (the default).
pub struct Lockless(RawIndex);

impl Index for Lockless {
    const KIND: IndexKind = IndexKind::Lockless;

    fn create(frames: &FrameTable) -> Self {
        Self(RawIndex::new(frames))
    }

    #[inline(always)]
    fn get(&self, frames: &FrameTable, page: u64, retries: &mut u64) -> Option<u32> {
        self.0.get(frames, page, retries)
    }

    #[inline(always)]
    fn get_pinned(
        &self,
        frames: &FrameTable,
        page: u64,
        _guard: &crossbeam_epoch::Guard,
        retries: &mut u64,
    ) -> Option<u32> {
        self.0.get_pinned(frames, page, retries)
    }

    fn insert(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Inserted {
        match self.0.insert(frames, page, frame, generation, link) {
            RawInsert::Inserted => Inserted::Yes,
            RawInsert::Exists(_) => Inserted::AlreadyPresent,
            RawInsert::Full => Inserted::NoRoom,
        }
    }

    /// Gang insertion: prefetch every bucket of the run first so their cache
    /// misses overlap, then lock and fill each bucket in turn.
    fn insert_run(
        &self,
        frames: &FrameTable,
        first: u64,
        run: &[(u32, u64)],
        link: Link,
        done: &mut dyn FnMut(usize, Inserted),
    ) {
        for i in 0..run.len() {
            RawIndex::prefetch(frames, first + i as u64);
        }
        for (i, &(f, g)) in run.iter().enumerate() {
            done(i, self.insert(frames, first + i as u64, f, g, link));
        }
    }

    fn replace(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u32>, Inserted> {
        self.0
            .replace(frames, page, frame, generation)
            .map(|old| old.map(crate::layout::val_frame))
            .map_err(|()| Inserted::NoRoom)
    }

    fn remove(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        if_held: IfHeld,
    ) -> Removed {
        match self.0.remove(
            frames,
            page,
            crate::layout::val_of(frame, generation),
            if_held,
        ) {
            RawRemove::Removed => Removed::Yes,
            RawRemove::Unlinked => Removed::Unlinked,
            RawRemove::Busy => Removed::Busy,
            RawRemove::Absent => Removed::Absent,
        }
    }

    fn peek(&self, frames: &FrameTable, page: u64) -> Option<(u32, u64)> {
        self.0.peek(frames, page)
    }

    #[inline]
    fn copy_out(
        &self,
        frames: &FrameTable,
        page: u64,
        out: &mut [u8],
        retries: &mut u64,
    ) -> Option<Result<Option<(u64, usize)>, usize>> {
        Some(self.0.copy_out(frames, page, out, retries))
    }
}

impl Lockless {
    /// Overflow buckets still in the pool.
    /// Whether overflow bucket `o` is in the pool (loom models only).
    #[cfg(loom)]
    pub(crate) fn overflow_pooled(&self, o: u32) -> bool {
        self.0.overflow_pooled(o)
    }

    pub fn overflow_free(&self) -> usize {
        self.0.overflow_free()
    }
}

type Map = FxHashMap<u64, (u32, u64)>;

/// Operations shared by the lock-based variants, over a plain map that the
/// caller has locked.
fn map_get(map: &Map, frames: &Frames, page: u64) -> Option<u32> {
    let &(f, _) = map.get(&page)?;
    // The lock keeps the entry (and so the index's reference) in place: the
    // refcount is at least 1 and may be raised without a CAS.
    frames.get_more(f);
    frames.touch(f);
    Some(f)
}

fn map_insert(
    map: &mut Map,
    frames: &Frames,
    page: u64,
    frame: u32,
    generation: u64,
    link: Link,
) -> Inserted {
    match map.entry(page) {
        std::collections::hash_map::Entry::Occupied(_) => Inserted::AlreadyPresent,
        std::collections::hash_map::Entry::Vacant(v) => {
            link.apply(frames, frame, generation);
            v.insert((frame, generation));
            Inserted::Yes
        }
    }
}

fn map_remove(
    map: &mut Map,
    frames: &Frames,
    page: u64,
    frame: u32,
    generation: u64,
    if_held: IfHeld,
) -> Removed {
    match map.get(&page) {
        Some(&(f, g)) if f == frame && g == generation => {
            let frozen = frames.freeze(f) == Freeze::Frozen;
            if !frozen && if_held == IfHeld::Skip {
                return Removed::Busy;
            }
            frames.invalidate(f);
            map.remove(&page);
            if frozen {
                Removed::Yes
            } else {
                Removed::Unlinked
            }
        }
        _ => Removed::Absent,
    }
}

/// Copy-on-write swap in a locked map: invalidate the old frame, make the
/// new one visible, then swap the entry.
fn map_replace(
    map: &mut Map,
    frames: &Frames,
    page: u64,
    frame: u32,
    generation: u64,
) -> Option<u32> {
    if let Some(&(old, _)) = map.get(&page) {
        frames.invalidate(old);
    }
    frames.make_visible(frame, generation, 1);
    map.insert(page, (frame, generation)).map(|(f, _)| f)
}

fn map_with_capacity(frames: &Frames) -> Map {
    let mut m = Map::default();
    m.reserve(frames.count());
    m
}

fn read<T>(l: &RwLock<T>) -> impl std::ops::Deref<Target = T> + '_ {
    match l.read() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn write<T>(l: &RwLock<T>) -> impl std::ops::DerefMut<Target = T> + '_ {
    match l.write() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// One tree under one reader-writer lock (2.6.12's `tree_lock`).
pub struct RwLocked(RwLock<Map>);

impl Index for RwLocked {
    const KIND: IndexKind = IndexKind::RwLock;

    fn create(frames: &FrameTable) -> Self {
        Self(RwLock::new(map_with_capacity(frames)))
    }

    fn get(&self, frames: &FrameTable, page: u64, _: &mut u64) -> Option<u32> {
        map_get(&read(&self.0), frames, page)
    }

    fn insert(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Inserted {
        map_insert(&mut write(&self.0), frames, page, frame, generation, link)
    }

    fn insert_run(
        &self,
        frames: &FrameTable,
        first: u64,
        run: &[(u32, u64)],
        link: Link,
        done: &mut dyn FnMut(usize, Inserted),
    ) {
        let mut map = write(&self.0);
        for (i, &(f, g)) in run.iter().enumerate() {
            done(
                i,
                map_insert(&mut map, frames, first + i as u64, f, g, link),
            );
        }
    }

    fn replace(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u32>, Inserted> {
        Ok(map_replace(
            &mut write(&self.0),
            frames,
            page,
            frame,
            generation,
        ))
    }

    fn remove(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        if_held: IfHeld,
    ) -> Removed {
        map_remove(
            &mut write(&self.0),
            frames,
            page,
            frame,
            generation,
            if_held,
        )
    }

    fn peek(&self, _: &FrameTable, page: u64) -> Option<(u32, u64)> {
        read(&self.0).get(&page).copied()
    }

    fn prewarm(&self, entries: u64) {
        prewarm_map(&mut write(&self.0), entries);
    }
}

/// One tree under one mutex (the spinlock before `tree_lock`).
pub struct Mutexed(Mutex<Map>);

impl Index for Mutexed {
    const KIND: IndexKind = IndexKind::Mutex;

    fn create(frames: &FrameTable) -> Self {
        Self(Mutex::new(map_with_capacity(frames)))
    }

    fn get(&self, frames: &FrameTable, page: u64, _: &mut u64) -> Option<u32> {
        map_get(&crate::sync::lock(&self.0), frames, page)
    }

    fn insert(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Inserted {
        map_insert(
            &mut crate::sync::lock(&self.0),
            frames,
            page,
            frame,
            generation,
            link,
        )
    }

    fn insert_run(
        &self,
        frames: &FrameTable,
        first: u64,
        run: &[(u32, u64)],
        link: Link,
        done: &mut dyn FnMut(usize, Inserted),
    ) {
        let mut map = crate::sync::lock(&self.0);
        for (i, &(f, g)) in run.iter().enumerate() {
            done(
                i,
                map_insert(&mut map, frames, first + i as u64, f, g, link),
            );
        }
    }

    fn replace(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u32>, Inserted> {
        Ok(map_replace(
            &mut crate::sync::lock(&self.0),
            frames,
            page,
            frame,
            generation,
        ))
    }

    fn remove(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        if_held: IfHeld,
    ) -> Removed {
        map_remove(
            &mut crate::sync::lock(&self.0),
            frames,
            page,
            frame,
            generation,
            if_held,
        )
    }

    fn peek(&self, _: &FrameTable, page: u64) -> Option<(u32, u64)> {
        crate::sync::lock(&self.0).get(&page).copied()
    }

    fn prewarm(&self, entries: u64) {
        prewarm_map(&mut crate::sync::lock(&self.0), entries);
    }
}

/// Shards of the sharded index.
pub const SHARDS: usize = 64;

/// 64 independent trees, each under its own reader-writer lock.
pub struct Sharded(Box<[crossbeam_utils::CachePadded<RwLock<Map>>]>);

impl Sharded {
    #[inline]
    fn shard(&self, page: u64) -> &RwLock<Map> {
        &self.0[crate::layout::bucket_of(page, SHARDS as u64) as usize]
    }
}

impl Index for Sharded {
    const KIND: IndexKind = IndexKind::Sharded;

    fn create(frames: &FrameTable) -> Self {
        let per = frames.count().div_ceil(SHARDS) * 2;
        Self(
            (0..SHARDS)
                .map(|_| {
                    let mut m = Map::default();
                    m.reserve(per);
                    crossbeam_utils::CachePadded::new(RwLock::new(m))
                })
                .collect(),
        )
    }

    fn get(&self, frames: &FrameTable, page: u64, _: &mut u64) -> Option<u32> {
        map_get(&read(self.shard(page)), frames, page)
    }

    fn insert(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Inserted {
        map_insert(
            &mut write(self.shard(page)),
            frames,
            page,
            frame,
            generation,
            link,
        )
    }

    fn replace(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u32>, Inserted> {
        Ok(map_replace(
            &mut write(self.shard(page)),
            frames,
            page,
            frame,
            generation,
        ))
    }

    fn remove(
        &self,
        frames: &FrameTable,
        page: u64,
        frame: u32,
        generation: u64,
        if_held: IfHeld,
    ) -> Removed {
        map_remove(
            &mut write(self.shard(page)),
            frames,
            page,
            frame,
            generation,
            if_held,
        )
    }

    fn peek(&self, _: &FrameTable, page: u64) -> Option<(u32, u64)> {
        read(self.shard(page)).get(&page).copied()
    }

    fn prewarm(&self, entries: u64) {
        let mut keys: Vec<Vec<u64>> = vec![Vec::new(); SHARDS];
        for p in 0..entries {
            keys[crate::layout::bucket_of(p, SHARDS as u64) as usize].push(p);
        }
        for (shard, keys) in self.0.iter().zip(keys) {
            let mut map = write(shard);
            for p in keys {
                map.insert(p, (0, 0));
            }
            map.clear();
        }
    }
}

/// An index over a frame table with no backing file and no page bytes: the
/// index operations alone, for benchmarks (the seed's insertion test) and
/// tests. Entries point at frames that are never published.
#[cfg(not(loom))]
pub struct Standalone<I: Index> {
    frames: Frames,
    index: I,
}

#[cfg(not(loom))]
impl<I: Index> Standalone<I> {
    /// An empty index sized for `frames` entries (pages of 512 bytes; the
    /// arena is reserved, never touched). Its memory is warm: the lockless
    /// region's metadata is faulted in at creation (as for every cache), and
    /// the hash maps of the lock-based variants are filled and cleared once,
    /// so insertion is compared on warm memory for every variant.
    pub fn new(frames: usize) -> std::io::Result<Self> {
        let layout = crate::layout::RegionLayout::new(512, frames);
        let frames_table = Frames::new(crate::raw::region::Region::new(layout, 0, 0)?);
        let index = I::create(&frames_table);
        index.prewarm(frames as u64);
        Ok(Self {
            frames: frames_table,
            index,
        })
    }

    /// Insert one entry `page → frame` (generation 1).
    pub fn insert(&self, page: u64, frame: u32) -> Inserted {
        self.index
            .insert(&self.frames, page, frame, 1, Link::EntryOnly)
    }

    /// Gang-insert `page + i → frames[i]`; returns how many went in.
    pub fn insert_run(&self, first: u64, run: &[(u32, u64)]) -> usize {
        let mut n = 0;
        self.index
            .insert_run(&self.frames, first, run, Link::EntryOnly, &mut |_, r| {
                n += usize::from(r == Inserted::Yes)
            });
        n
    }

    /// The frame indexed for `page`.
    pub fn frame_of(&self, page: u64) -> Option<u32> {
        self.index.peek(&self.frames, page).map(|(f, _)| f)
    }
}
