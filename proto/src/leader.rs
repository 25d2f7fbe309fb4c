//! Finding the leading coordinator among several.
//!
//! Coordinators that share an etcd store elect one leader; the others refuse
//! writes with `UNAVAILABLE` and name the leader in the [`LEADER_KEY`]
//! metadata entry (see `coordinator.proto`). Clients hold a list of
//! coordinator addresses ([`parse_addresses`]) and follow that hint
//! ([`leader_hint`]), or move to the next address when there is none.

/// Metadata entry of an `UNAVAILABLE` refusal by a coordinator that does not
/// lead: the gRPC address (host:port) of the one that does.
pub const LEADER_KEY: &str = "pagewire-leader";

/// The leader a refusal names, if it is a not-leading refusal that names one.
pub fn leader_hint(status: &tonic::Status) -> Option<String> {
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    let v = status.metadata().get(LEADER_KEY)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// The not-leading refusal, naming `leader` when it is known.
pub fn not_leading(message: impl Into<String>, leader: Option<&str>) -> tonic::Status {
    let mut s = tonic::Status::unavailable(message);
    if let Some(v) = leader.and_then(|l| l.parse().ok()) {
        s.metadata_mut().insert(LEADER_KEY, v);
    }
    s
}

/// A comma-separated list of coordinator addresses (`a:1,b:2`), trimmed,
/// without empty entries or repeats, in the order given.
pub fn parse_addresses(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        if !out.iter().any(|o| o == a) {
            out.push(a.to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_round_trip_and_lists_parse() {
        let s = not_leading("follower", Some("10.0.0.1:7400"));
        assert_eq!(leader_hint(&s).as_deref(), Some("10.0.0.1:7400"));
        assert_eq!(leader_hint(&not_leading("none", None)), None);
        assert_eq!(leader_hint(&tonic::Status::internal("x")), None);
        assert_eq!(
            parse_addresses(" a:1, b:2,,a:1 ,c:3"),
            vec!["a:1", "b:2", "c:3"]
        );
        assert!(parse_addresses(" , ").is_empty());
    }
}
