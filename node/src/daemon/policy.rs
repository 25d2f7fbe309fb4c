//! Maps a pushed `pagewire.v1.Policy` onto the cache: the parts the node
//! implements are applied, any other part is refused (the cache keeps what
//! it has) and reported, never acknowledged and ignored.

use pagewire_proto::v1::{AdmissionPolicy, EvictionPolicy, Policy};

use crate::PageCache;
use crate::policy::{Admission, CachePolicy, Eviction};

fn admission(a: AdmissionPolicy) -> Option<Admission> {
    match a {
        AdmissionPolicy::Always => Some(Admission::Always),
        AdmissionPolicy::SecondHit => Some(Admission::SecondHit),
        AdmissionPolicy::Unspecified => None,
    }
}

fn eviction(e: EvictionPolicy) -> Option<Eviction> {
    match e {
        EvictionPolicy::Clock => Some(Eviction::Clock),
        EvictionPolicy::Lru => Some(Eviction::Lru),
        EvictionPolicy::Fifo => Some(Eviction::Fifo),
        EvictionPolicy::Unspecified => None,
    }
}

/// `p` as the node applies it: the policy pair set on the cache, and `p`
/// with its admission and eviction replaced by what was applied (what the
/// node reports), plus why a part was refused.
pub(crate) fn apply(cache: &PageCache, p: &Policy) -> (CachePolicy, Policy, Option<String>) {
    let cur = cache.policy();
    let mut refused = Vec::new();
    let a = admission(p.admission()).unwrap_or_else(|| {
        refused.push(format!(
            "admission {:?} is not implemented by this node",
            p.admission()
        ));
        cur.admission
    });
    let e = eviction(p.eviction()).unwrap_or_else(|| {
        refused.push(format!(
            "eviction {:?} is not implemented by this node",
            p.eviction()
        ));
        cur.eviction
    });
    let applied = CachePolicy {
        admission: a,
        eviction: e,
    };
    cache.set_policy(applied);
    let mut reported = *p;
    reported.set_admission(match a {
        Admission::Always => AdmissionPolicy::Always,
        Admission::SecondHit => AdmissionPolicy::SecondHit,
    });
    reported.set_eviction(match e {
        Eviction::Clock => EvictionPolicy::Clock,
        Eviction::Lru => EvictionPolicy::Lru,
        Eviction::Fifo => EvictionPolicy::Fifo,
    });
    let why = (!refused.is_empty()).then(|| refused.join("; "));
    (applied, reported, why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CacheConfig;

    fn cache() -> (tempfile::TempDir, PageCache) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(64 * 4096)
            .unwrap();
        let cfg = CacheConfig {
            frames: 16,
            readahead_max: 0,
            ..Default::default()
        };
        (dir, PageCache::open(&path, cfg).unwrap())
    }

    fn policy(a: AdmissionPolicy, e: EvictionPolicy) -> Policy {
        let mut p = Policy {
            version: 2,
            high_watermark_percent: 95,
            low_watermark_percent: 85,
            ..Default::default()
        };
        p.set_admission(a);
        p.set_eviction(e);
        p
    }

    #[test]
    fn unimplemented_parts_are_refused_and_reported_as_kept() {
        let (_dir, c) = cache();
        for a in [AdmissionPolicy::Always, AdmissionPolicy::SecondHit] {
            for e in [
                EvictionPolicy::Clock,
                EvictionPolicy::Lru,
                EvictionPolicy::Fifo,
            ] {
                let before = c.policy();
                let (applied, reported, why) = apply(&c, &policy(a, e));
                assert_eq!(c.policy(), applied);
                let a_ok = admission(a).is_some();
                let e_ok = eviction(e).is_some();
                assert_eq!(why.is_none(), a_ok && e_ok, "{a:?}/{e:?}: {why:?}");
                if !a_ok {
                    assert_eq!(applied.admission, before.admission);
                    assert!(why.as_deref().unwrap().contains("admission"));
                } else {
                    assert_eq!(reported.admission(), a);
                }
                if !e_ok {
                    assert_eq!(applied.eviction, before.eviction);
                    assert!(why.as_deref().unwrap().contains("eviction"));
                } else {
                    assert_eq!(reported.eviction(), e);
                }
                assert_eq!(reported.high_watermark_percent, 95);
            }
        }
    }

    #[test]
    fn second_hit_changes_what_a_miss_does() {
        let (_dir, c) = cache();
        let clock = EvictionPolicy::Clock;
        let _ = apply(&c, &policy(AdmissionPolicy::SecondHit, clock));
        assert!(!c.get(3).unwrap().is_cached(), "first miss admitted");
        assert!(c.get(3).unwrap().is_cached(), "second miss not admitted");
        assert_eq!(c.stats().admissions_skipped, 1);
        let _ = apply(&c, &policy(AdmissionPolicy::Always, clock));
        assert!(c.get(4).unwrap().is_cached(), "always skipped a page");
        assert_eq!(c.stats().admissions_skipped, 1);
    }
}
