//! The self-describing page format of every test and bench file.
//!
//! Bytes 0..8 hold the page number and 8..16 the generation (u64
//! little-endian). The rest of the page is the output of SplitMix64 seeded
//! with `page * 0x9E3779B97F4A7C15 ^ generation` (wrapping multiply), each
//! u64 written little-endian; a last partial word takes the low bytes.
//! Generation 0 is the file as generated; each write of a page increments
//! it. Any tool can check a page from its bytes alone, so every read in a
//! test or bench is verified: one wrong byte fails the run.

use std::io::Write;
use std::path::Path;

/// The SplitMix64 increment (2^64 / φ).
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    #[inline]
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The seed of a page's pattern.
pub const fn seed(page: u64, generation: u64) -> u64 {
    page.wrapping_mul(GOLDEN) ^ generation
}

/// Fill `buf` (a page, or the first bytes of the last page) with the content
/// of `page` at `generation`.
pub fn fill(page: u64, generation: u64, buf: &mut [u8]) {
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&page.to_le_bytes());
    head[8..].copy_from_slice(&generation.to_le_bytes());
    let n = buf.len().min(16);
    buf[..n].copy_from_slice(&head[..n]);
    if buf.len() <= 16 {
        return;
    }
    let mut rng = SplitMix64(seed(page, generation));
    let mut chunks = buf[16..].chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let w = rng.next().to_le_bytes();
        let k = rest.len();
        rest.copy_from_slice(&w[..k]);
    }
}

/// A page that is not what it should be.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    #[error("page {expected} holds the header of page {found}")]
    WrongPage { expected: u64, found: u64 },
    #[error(
        "page {page} generation {generation}: byte {offset} is {got:#04x}, expected {want:#04x}"
    )]
    Byte {
        page: u64,
        generation: u64,
        offset: usize,
        want: u8,
        got: u8,
    },
    #[error("page {page} is {len} bytes, too short for its header")]
    Short { page: u64, len: usize },
}

/// Check the 16-byte header only; returns the generation.
#[inline]
pub fn check_header(page: u64, buf: &[u8]) -> Result<u64, Mismatch> {
    if buf.len() < 16 {
        return Err(Mismatch::Short {
            page,
            len: buf.len(),
        });
    }
    let found = u64::from_le_bytes(buf[..8].try_into().unwrap_or_default());
    if found != page {
        return Err(Mismatch::WrongPage {
            expected: page,
            found,
        });
    }
    Ok(u64::from_le_bytes(
        buf[8..16].try_into().unwrap_or_default(),
    ))
}

/// Check every byte of `buf` as page `page`; returns its generation.
pub fn verify(page: u64, buf: &[u8]) -> Result<u64, Mismatch> {
    let generation = check_header(page, buf)?;
    let mut rng = SplitMix64(seed(page, generation));
    let body = &buf[16..];
    let mut words = body.chunks_exact(8);
    // Whole words compared as u64s (no memcmp call per word); the first
    // mismatch is located byte by byte below.
    for (k, w) in (&mut words).enumerate() {
        let want = rng.next();
        let got = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        if got != want {
            return Err(first_diff(
                page,
                generation,
                16 + k * 8,
                w,
                &want.to_le_bytes(),
            ));
        }
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let want = rng.next().to_le_bytes();
        if rest != &want[..rest.len()] {
            return Err(first_diff(
                page,
                generation,
                buf.len() - rest.len(),
                rest,
                &want,
            ));
        }
    }
    Ok(generation)
}

fn first_diff(page: u64, generation: u64, off: usize, got: &[u8], want: &[u8]) -> Mismatch {
    let i = (0..got.len()).find(|&i| got[i] != want[i]).unwrap_or(0);
    Mismatch::Byte {
        page,
        generation,
        offset: off + i,
        want: want[i],
        got: got[i],
    }
}

/// Write a test file of `len` bytes at generation 0, `page_size` per page.
pub fn generate_file(path: &Path, len: u64, page_size: usize) -> std::io::Result<()> {
    let f = std::fs::File::create(path)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut buf = vec![0u8; page_size];
    let pages = len.div_ceil(page_size as u64);
    for p in 0..pages {
        let n = (len - p * page_size as u64).min(page_size as u64) as usize;
        fill(p, 0, &mut buf[..n]);
        w.write_all(&buf[..n])?;
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_detects_one_wrong_byte() {
        let mut page = vec![0u8; 4096];
        fill(77, 3, &mut page);
        assert_eq!(verify(77, &page), Ok(3));
        assert_eq!(&page[..8], &77u64.to_le_bytes());
        for off in [0, 9, 16, 100, 4095] {
            let mut bad = page.clone();
            bad[off] ^= 1;
            assert!(verify(77, &bad).is_err(), "flip at {off} went unnoticed");
        }
        assert!(matches!(verify(78, &page), Err(Mismatch::WrongPage { .. })));
    }

    #[test]
    fn a_mismatch_names_its_byte() {
        let mut page = vec![0u8; 4096 - 3];
        fill(9, 2, &mut page);
        for off in [16, 23, 1000, page.len() - 1] {
            let mut bad = page.clone();
            bad[off] ^= 0x40;
            match verify(9, &bad) {
                Err(Mismatch::Byte {
                    offset, got, want, ..
                }) => {
                    assert_eq!(offset, off);
                    assert_eq!(got ^ want, 0x40);
                }
                other => panic!("flip at {off}: {other:?}"),
            }
        }
    }

    #[test]
    fn partial_last_word_takes_low_bytes() {
        let mut full = vec![0u8; 64];
        fill(5, 1, &mut full);
        let mut short = vec![0u8; 29];
        fill(5, 1, &mut short);
        assert_eq!(&full[..29], &short[..]);
        assert_eq!(verify(5, &short), Ok(1));
    }

    #[test]
    fn first_word_matches_splitmix_definition() {
        let mut page = vec![0u8; 24];
        fill(1, 0, &mut page);
        // seed = 1 * GOLDEN ^ 0; first output mixes seed + GOLDEN.
        let mut z = GOLDEN.wrapping_add(GOLDEN);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        assert_eq!(&page[16..24], &z.to_le_bytes());
    }
}
