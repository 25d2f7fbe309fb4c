//! The cache policies of the contract by name: every admission and eviction
//! policy `pagewire.v1` names (`AdmissionPolicy`, `EvictionPolicy` in
//! `common.proto`), the names config files, flags, `pwctl` and the bench
//! write, parsing those names, and which policies the nodes implement.
//!
//! This is the one list. The coordinator (config validation, `SetPolicy`),
//! `pwctl` (flags, help, output) and the bench derive theirs from it; the
//! node maps each implemented policy onto its cache and tests that every
//! one listed here maps (`node/src/daemon/policy.rs`). Adding a policy
//! touches the `.proto` enum, this module, and the node's implementation
//! and its test: nothing else.

use crate::v1::{AdmissionPolicy, EvictionPolicy, Policy};

/// Every admission policy the API names (all but `Unspecified`).
pub const ADMISSION: &[AdmissionPolicy] = &[AdmissionPolicy::Always, AdmissionPolicy::SecondHit];

/// Every eviction policy the API names (all but `Unspecified`).
pub const EVICTION: &[EvictionPolicy] = &[
    EvictionPolicy::Clock,
    EvictionPolicy::Lru,
    EvictionPolicy::Fifo,
];

/// The admission policies the nodes implement. The API may name more; a
/// policy outside these lists is refused (config validation, `SetPolicy`
/// with `UNIMPLEMENTED`), never acknowledged and ignored. Grow a list in the
/// same change that makes the node apply the policy.
pub const IMPLEMENTED_ADMISSION: &[AdmissionPolicy] =
    &[AdmissionPolicy::Always, AdmissionPolicy::SecondHit];

/// The eviction policies the nodes implement (see [`IMPLEMENTED_ADMISSION`]).
pub const IMPLEMENTED_EVICTION: &[EvictionPolicy] = &[
    EvictionPolicy::Clock,
    EvictionPolicy::Lru,
    EvictionPolicy::Fifo,
];

/// An admission policy's name as config files and flags write it.
pub fn admission_name(a: AdmissionPolicy) -> &'static str {
    match a {
        AdmissionPolicy::Unspecified => "unspecified",
        AdmissionPolicy::Always => "always",
        AdmissionPolicy::SecondHit => "second-hit",
    }
}

/// An eviction policy's name as config files and flags write it.
pub fn eviction_name(e: EvictionPolicy) -> &'static str {
    match e {
        EvictionPolicy::Unspecified => "unspecified",
        EvictionPolicy::Clock => "clock",
        EvictionPolicy::Lru => "lru",
        EvictionPolicy::Fifo => "fifo",
    }
}

/// Parses an admission policy name (one of [`ADMISSION`]'s) as written in
/// config files and flags.
pub fn parse_admission(s: &str) -> Option<AdmissionPolicy> {
    ADMISSION.iter().copied().find(|&a| admission_name(a) == s)
}

/// Parses an eviction policy name (one of [`EVICTION`]'s) as written in
/// config files and flags.
pub fn parse_eviction(s: &str) -> Option<EvictionPolicy> {
    EVICTION.iter().copied().find(|&e| eviction_name(e) == s)
}

/// The names of `list` joined by `sep` (`names(EVICTION, eviction_name,
/// ", ")` is `clock, lru, fifo`).
pub fn names<T: Copy>(list: &[T], name: fn(T) -> &'static str, sep: &str) -> String {
    list.iter().map(|&x| name(x)).collect::<Vec<_>>().join(sep)
}

/// The names of `list` as a choice in words: `clock, lru or fifo`.
pub fn one_of<T: Copy>(list: &[T], name: fn(T) -> &'static str) -> String {
    match list.split_last() {
        None => String::new(),
        Some((last, [])) => name(*last).to_owned(),
        Some((last, rest)) => format!("{} or {}", names(rest, name, ", "), name(*last)),
    }
}

/// Checks that the nodes implement `p`'s admission and eviction policies
/// (call after the coordinator's `validate_policy`); the error names what
/// is implemented.
pub fn check_implemented(p: &Policy) -> Result<(), String> {
    if !IMPLEMENTED_ADMISSION.contains(&p.admission()) {
        return Err(format!(
            "admission policy {} is not implemented by the nodes (implemented: {})",
            admission_name(p.admission()),
            names(IMPLEMENTED_ADMISSION, admission_name, ", ")
        ));
    }
    if !IMPLEMENTED_EVICTION.contains(&p.eviction()) {
        return Err(format!(
            "eviction policy {} is not implemented by the nodes (implemented: {})",
            eviction_name(p.eviction()),
            names(IMPLEMENTED_EVICTION, eviction_name, ", ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lists name every value of the generated enums but `Unspecified`,
    /// each once, and the implemented lists are part of them.
    #[test]
    fn the_lists_cover_the_proto_enums() {
        let admission: Vec<_> = (1..256)
            .filter_map(|i| AdmissionPolicy::try_from(i).ok())
            .collect();
        assert_eq!(admission, ADMISSION);
        let eviction: Vec<_> = (1..256)
            .filter_map(|i| EvictionPolicy::try_from(i).ok())
            .collect();
        assert_eq!(eviction, EVICTION);
        assert!(IMPLEMENTED_ADMISSION.iter().all(|a| ADMISSION.contains(a)));
        assert!(IMPLEMENTED_EVICTION.iter().all(|e| EVICTION.contains(e)));
    }

    #[test]
    fn names_parse_back() {
        for &a in ADMISSION {
            assert_eq!(parse_admission(admission_name(a)), Some(a));
        }
        for &e in EVICTION {
            assert_eq!(parse_eviction(eviction_name(e)), Some(e));
        }
        assert_eq!(parse_admission("unspecified"), None);
        assert_eq!(parse_eviction("unspecified"), None);
        assert_eq!(parse_eviction("random"), None);
    }

    #[test]
    fn choices_read_as_words() {
        let same = |s: &'static str| s;
        assert_eq!(one_of(&["a", "b", "c"], same), "a, b or c");
        assert_eq!(one_of(&["a", "b"], same), "a or b");
        assert_eq!(one_of(&["a"], same), "a");
        assert_eq!(names(&["a", "b", "c"], same, " | "), "a | b | c");
    }
}
