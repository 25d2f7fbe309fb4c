//! pagewire-proto: work in progress (see the open issue for this crate).
