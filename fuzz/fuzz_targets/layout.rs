//! The region layout's decoders on raw bytes (what a remote reader copies):
//! the superblock at the start; then, when it decodes, every bucket and
//! frame header the input holds at the offsets it names.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagewire_node::layout::{
    LINE, RawBucket, RawHeader, RegionLayout, SUPERBLOCK_HEAD, Superblock, ctrl,
};

fuzz_target!(|data: &[u8]| {
    // A bucket and a header at offset 0, whatever the bytes are.
    if let Some(b) = RawBucket::decode(data) {
        let _ = (b.next(), b.find(b.slots[0].0.wrapping_sub(1)));
        assert_eq!(b.next(), ctrl::next(b.ctrl));
    }
    if let Some(h) = RawHeader::decode(data) {
        let _ = h.validates(h.page, h.generation, &data[data.len().min(LINE)..]);
    }
    let Ok(sb) = Superblock::decode(data) else {
        return;
    };
    assert!(data.len() >= SUPERBLOCK_HEAD);
    let l = sb.layout;
    // The decoded layout is the one its counts imply, and every part of it
    // lies inside its length: a reader that trusts it stays in the region.
    assert_eq!(l, RegionLayout::new(l.page_size, l.frame_count));
    assert!(l.page_size.is_power_of_two());
    assert!(l.bucket(l.bucket_count) <= l.overflow_offset);
    assert!(l.overflow(l.overflow_count) <= l.headers_offset);
    assert!(l.header(l.frame_count) <= l.arena_offset);
    assert_eq!(l.frame(l.frame_count), l.len);
    assert_eq!(sb.file_len.div_ceil(l.page_size as u64), sb.file_pages);
    for b in 0..l.bucket_count + l.overflow_count {
        let off = l.bucket(b);
        let Some(line) = data.get(off..off + LINE) else {
            break;
        };
        let bucket = RawBucket::decode(line).expect("a whole line decodes");
        for &(key, val) in &bucket.slots {
            if key != 0 {
                // The first slot with this key answers for its page.
                let first = bucket.slots.iter().find(|s| s.0 == key).expect("present");
                assert_eq!(bucket.find(key - 1), Some(first.1));
                let _ = val;
            }
        }
    }
    for f in 0..l.frame_count {
        let (h, fr) = (l.header(f), l.frame(f));
        let (Some(line), Some(frame)) = (data.get(h..h + LINE), data.get(fr..fr + l.page_size))
        else {
            break;
        };
        let hdr = RawHeader::decode(line).expect("a whole line decodes");
        let _ = hdr.validate(hdr.page, frame);
    }
});
