//! Maps a pushed `pagewire.v1.Policy` onto the cache: the parts the node
//! implements are applied, any other part is refused (the cache keeps what
//! it has) and reported, never acknowledged and ignored. The tests check
//! that every policy `pagewire_proto::policy` lists as implemented maps onto
//! the cache, by the same name, and that nothing else does.

use pagewire_proto::v1::{AdmissionPolicy, EvictionPolicy, Policy};

use crate::PageCache;
use crate::policy::{Admission, CachePolicy, Eviction};

/// The API's admission policy as the cache implements it; `Err` (the
/// policy back) when it does not.
impl TryFrom<AdmissionPolicy> for Admission {
    type Error = AdmissionPolicy;

    fn try_from(a: AdmissionPolicy) -> Result<Self, AdmissionPolicy> {
        match a {
            AdmissionPolicy::Always => Ok(Admission::Always),
            AdmissionPolicy::SecondHit => Ok(Admission::SecondHit),
            AdmissionPolicy::Unspecified => Err(a),
        }
    }
}

/// The API's eviction policy as the cache implements it; `Err` (the policy
/// back) when it does not.
impl TryFrom<EvictionPolicy> for Eviction {
    type Error = EvictionPolicy;

    fn try_from(e: EvictionPolicy) -> Result<Self, EvictionPolicy> {
        match e {
            EvictionPolicy::Clock => Ok(Eviction::Clock),
            EvictionPolicy::Lru => Ok(Eviction::Lru),
            EvictionPolicy::Fifo => Ok(Eviction::Fifo),
            EvictionPolicy::Unspecified => Err(e),
        }
    }
}

impl From<Admission> for AdmissionPolicy {
    fn from(a: Admission) -> Self {
        match a {
            Admission::Always => AdmissionPolicy::Always,
            Admission::SecondHit => AdmissionPolicy::SecondHit,
        }
    }
}

impl From<Eviction> for EvictionPolicy {
    fn from(e: Eviction) -> Self {
        match e {
            Eviction::Clock => EvictionPolicy::Clock,
            Eviction::Lru => EvictionPolicy::Lru,
            Eviction::Fifo => EvictionPolicy::Fifo,
        }
    }
}

/// `p` as the node applies it: the policy pair set on the cache, and `p`
/// with its admission and eviction replaced by what was applied (what the
/// node reports), plus why a part was refused.
pub(crate) fn apply(cache: &PageCache, p: &Policy) -> (CachePolicy, Policy, Option<String>) {
    let cur = cache.policy();
    let mut refused = Vec::new();
    let a = Admission::try_from(p.admission()).unwrap_or_else(|_| {
        refused.push(format!(
            "admission {:?} is not implemented by this node",
            p.admission()
        ));
        cur.admission
    });
    let e = Eviction::try_from(p.eviction()).unwrap_or_else(|_| {
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
    reported.set_admission(a.into());
    reported.set_eviction(e.into());
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

    /// Every policy the contract lists as implemented maps onto the cache
    /// and back, by the same name; every policy the cache implements is so
    /// listed; no other policy maps.
    #[test]
    fn every_implemented_policy_maps_to_the_cache() {
        use pagewire_proto::policy as pp;
        for &a in pp::ADMISSION {
            let listed = pp::IMPLEMENTED_ADMISSION.contains(&a);
            match Admission::try_from(a) {
                Ok(mine) => {
                    assert!(listed, "{a:?} maps but is not listed as implemented");
                    assert_eq!(AdmissionPolicy::from(mine), a);
                    assert_eq!(mine.name(), pp::admission_name(a));
                }
                Err(_) => assert!(!listed, "{a:?} is listed but does not map"),
            }
        }
        for &e in pp::EVICTION {
            let listed = pp::IMPLEMENTED_EVICTION.contains(&e);
            match Eviction::try_from(e) {
                Ok(mine) => {
                    assert!(listed, "{e:?} maps but is not listed as implemented");
                    assert_eq!(EvictionPolicy::from(mine), e);
                    assert_eq!(mine.name(), pp::eviction_name(e));
                }
                Err(_) => assert!(!listed, "{e:?} is listed but does not map"),
            }
        }
        for &mine in Admission::ALL {
            assert!(pp::IMPLEMENTED_ADMISSION.contains(&mine.into()), "{mine:?}");
        }
        for &mine in Eviction::ALL {
            assert!(pp::IMPLEMENTED_EVICTION.contains(&mine.into()), "{mine:?}");
        }
        assert_eq!(Admission::ALL.len(), pp::IMPLEMENTED_ADMISSION.len());
        assert_eq!(Eviction::ALL.len(), pp::IMPLEMENTED_EVICTION.len());
        assert!(Admission::try_from(AdmissionPolicy::Unspecified).is_err());
        assert!(Eviction::try_from(EvictionPolicy::Unspecified).is_err());
    }

    #[test]
    fn unimplemented_parts_are_refused_and_reported_as_kept() {
        let (_dir, c) = cache();
        for &a in pagewire_proto::policy::ADMISSION {
            for &e in pagewire_proto::policy::EVICTION {
                let before = c.policy();
                let (applied, reported, why) = apply(&c, &policy(a, e));
                assert_eq!(c.policy(), applied);
                let a_ok = Admission::try_from(a).is_ok();
                let e_ok = Eviction::try_from(e).is_ok();
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
