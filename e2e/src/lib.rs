//! pagewire's end-to-end tests (`tests/`): the coordinator, the node
//! daemons, pwctl and the FUSE mount as real processes on loopback. This
//! package builds them itself, as its own binaries (`src/bin/`, thin
//! wrappers of their entry points), so `cargo test -p pagewire-e2e` needs
//! no separate build step. No library code: this file only documents the
//! package.
