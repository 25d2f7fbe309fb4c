//! The cache's admission and eviction policies: what a node implements of
//! what the coordinator's API names (`pagewire.v1.Policy`). The daemon maps
//! a pushed policy onto these (`daemon/policy.rs`, whose test checks that
//! every policy `pagewire_proto::policy` lists as implemented maps here, by
//! the same name) and refuses (logs, keeps its current one) any part it does
//! not implement; the coordinator refuses the same policies before they are
//! ever pushed.

/// Which faulted pages enter the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Admission {
    /// Every faulted page is inserted.
    #[default]
    Always,
    /// A page is inserted on its second miss within the ghost set's window
    /// (about as many misses as the cache has frames; see the cache's
    /// `ghost` module). A first miss is served from the backing file and
    /// not inserted; readahead is off under this policy.
    SecondHit,
}

/// Which frame a full cache frees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Eviction {
    /// CLOCK (second chance): a shared hand, a referenced bit per frame.
    #[default]
    Clock,
    /// Approximate LRU: each hit stores the logical time (one tick per
    /// fault) in the frame's stamp; the victim is the oldest stamp among
    /// [`SAMPLE`] frames sampled at random (Redis-style), not the globally
    /// least recent page.
    Lru,
    /// Approximate FIFO: the stamp is the logical time of insertion, hits
    /// leave it; the victim is the oldest stamp among [`SAMPLE`] sampled
    /// frames.
    Fifo,
}

/// Frames sampled per `lru`/`fifo` victim choice (all of them in a cache of
/// at most this many frames). The victim's stamp is the smallest of the
/// sample, so it lies in the oldest fraction `q` of published frames with
/// probability `1 − (1 − q)^SAMPLE` (about 90% for q = 25%).
pub const SAMPLE: usize = 8;

impl Admission {
    /// Every admission policy this cache implements.
    pub const ALL: &'static [Admission] = &[Admission::Always, Admission::SecondHit];

    /// The name config files and `pwctl` use.
    pub fn name(self) -> &'static str {
        match self {
            Admission::Always => "always",
            Admission::SecondHit => "second-hit",
        }
    }
}

impl Eviction {
    /// Every eviction policy this cache implements.
    pub const ALL: &'static [Eviction] = &[Eviction::Clock, Eviction::Lru, Eviction::Fifo];

    /// The name config files and `pwctl` use.
    pub fn name(self) -> &'static str {
        match self {
            Eviction::Clock => "clock",
            Eviction::Lru => "lru",
            Eviction::Fifo => "fifo",
        }
    }
}

/// A cache's policy pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CachePolicy {
    pub admission: Admission,
    pub eviction: Eviction,
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "admission {}, eviction {}",
            self.admission.name(),
            self.eviction.name()
        )
    }
}
