//! Routing: which node answers reads of a page and which acknowledges
//! writes of it under a map (the module doc's "Routing"), and how many pages
//! from a first one the same node answers, so that one attempt reads them
//! together.

use pagewire_proto::lazy::Owners;
use pagewire_proto::v1::MapNode;

use super::attempt::Step;

/// The most pages one attempt reads from one node (a gRPC `Read` or a
/// run of one-sided batches); nodes take up to 1024 per call by default.
const MAX_ATTEMPT_PAGES: usize = 256;

/// The extent of `page` under `map` (None: a map without a usable extent
/// size, or a page whose offset overflows).
fn extent_of<M: Owners + ?Sized>(map: &M, page: u64) -> Option<u64> {
    if map.extent_size() == 0 {
        return None;
    }
    let offset = page.checked_mul(u64::from(map.page_size()))?;
    Some(offset / map.extent_size())
}

/// The node index that answers reads of `page` under `map`: the previous
/// owner while the extent is handed off, else the owner (None: no owner).
pub fn read_owner<M: Owners + ?Sized>(map: &M, page: u64) -> Option<u32> {
    let e = extent_of(map, page)?;
    match map.previous_owner(e) {
        0 => Some(map.owner(e)).filter(|&o| o != 0),
        prev => Some(prev),
    }
}

/// The node index that acknowledges writes of `page` under `map` (it
/// refuses them while the extent is handed off; None: no owner).
pub fn write_owner<M: Owners + ?Sized>(map: &M, page: u64) -> Option<u32> {
    Some(map.owner(extent_of(map, page)?)).filter(|&o| o != 0)
}

/// The node of `index` in `map`, or a reason to refresh.
pub(super) fn node_of<M: Owners + ?Sized>(
    map: &M,
    index: u32,
    page: u64,
) -> Result<&MapNode, Step> {
    map.nodes()
        .iter()
        .find(|n| n.index == index)
        .ok_or_else(|| {
            Step::Refresh(format!(
                "the map (epoch {}) names node index {index} for page {page} but not the node",
                map.epoch()
            ))
        })
}

/// The node that answers reads of `page` at `map` (its index and entry).
pub(super) fn reader_of<M: Owners + ?Sized>(map: &M, page: u64) -> Result<(u32, &MapNode), Step> {
    let index = read_owner(map, page).ok_or_else(|| {
        Step::Backoff(format!(
            "no node answers page {page} at epoch {}",
            map.epoch()
        ))
    })?;
    Ok((index, node_of(map, index, page)?))
}

/// How many pages from `first` (at most `want`, at most
/// [`MAX_ATTEMPT_PAGES`]) node `index` answers reads of under `map`.
pub(super) fn same_reader<M: Owners + ?Sized>(
    map: &M,
    first: u64,
    want: usize,
    index: u32,
) -> usize {
    let want = want.min(MAX_ATTEMPT_PAGES);
    let Some(e0) = extent_of(map, first) else {
        return 1;
    };
    let pages_per_extent = (map.extent_size() / u64::from(map.page_size()).max(1)).max(1);
    // Pages left in `first`'s extent, then whole extents while the reader
    // stays the same.
    let mut n = (pages_per_extent - first % pages_per_extent) as usize;
    let mut e = e0 + 1;
    while n < want {
        let page = e * pages_per_extent;
        if read_owner(map, page) != Some(index) {
            break;
        }
        n += pages_per_extent as usize;
        e += 1;
    }
    n.min(want)
}

#[cfg(test)]
mod tests {
    use super::{read_owner, write_owner};
    use pagewire_proto::lazy::LazyMap;
    use pagewire_proto::v1::OwnershipMap;

    /// Four extents of 4 pages of 4 KiB.
    fn map(owner: &[u32], prev: &[u32]) -> LazyMap {
        LazyMap::from_expanded(OwnershipMap {
            epoch: 7,
            file_size: 16 * 4096,
            extent_size: 4 * 4096,
            page_size: 4096,
            owner: owner.to_vec(),
            previous_owner: prev.to_vec(),
            ..Default::default()
        })
    }

    #[test]
    fn reads_go_to_the_previous_owner_during_a_handoff_and_writes_to_the_owner() {
        let m = map(&[1, 2, 3, 0], &[]);
        // extent = page * page_size / extent_size: pages 0..4 → 0, 4..8 → 1.
        assert_eq!(read_owner(&m, 0), Some(1));
        assert_eq!(read_owner(&m, 3), Some(1));
        assert_eq!(read_owner(&m, 4), Some(2));
        assert_eq!(read_owner(&m, 11), Some(3));
        assert_eq!(read_owner(&m, 12), None, "index 0: no owner");
        assert_eq!(read_owner(&m, 16), None, "past the map");
        assert_eq!(read_owner(&m, u64::MAX), None, "an offset that overflows");
        assert_eq!(write_owner(&m, 5), Some(2));
        assert_eq!(write_owner(&m, 13), None);
        // Extent 1 moves from 2 to 3 (handoff): reads stay with 2, writes
        // go to 3 (which refuses them until the handoff completes).
        let h = map(&[1, 3, 3, 0], &[0, 2, 0, 0]);
        assert_eq!(read_owner(&h, 4), Some(2));
        assert_eq!(write_owner(&h, 4), Some(3));
        assert_eq!(read_owner(&h, 8), Some(3), "no handoff for extent 2");
        assert_eq!(read_owner(&h, 0), Some(1));
        // A handoff to nobody yet (owner 0, previous owner set): reads still
        // go to the previous owner.
        let g = map(&[0, 0, 0, 0], &[4, 0, 0, 0]);
        assert_eq!(read_owner(&g, 1), Some(4));
        assert_eq!(write_owner(&g, 1), None);
        // A map without an extent size routes nothing.
        let mut z = map(&[1, 1, 1, 1], &[]);
        z.extent_size = 0;
        assert_eq!(read_owner(&z, 0), None);
    }
}
