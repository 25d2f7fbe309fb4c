//! pagewire-node: the lockless local page cache (in progress).
