//! The storm's workloads: which page a reader touches next.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

/// What the readers read.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Each reader reads its own slice of the file in order (the seed's).
    Partitioned,
    /// Pages uniformly at random over the whole file.
    Uniform,
    /// Zipfian over the whole file (`--theta`), ranks scattered over the
    /// file so that hot pages fall on every node.
    Zipfian,
    /// Every reader reads the same few pages (`--hot-pages`) at random.
    HotPage,
    /// will-it-scale's page_fault4 shape: touch one byte of each page of a
    /// run of `--touch-run` pages of the reader's own slice, then the next
    /// run (each page still read and verified whole).
    PageTouch,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Partitioned => "partitioned",
            Workload::Uniform => "uniform",
            Workload::Zipfian => "zipfian",
            Workload::HotPage => "hot-page",
            Workload::PageTouch => "page-touch",
        }
    }
}

/// The shape of a workload, as every reader process gets it.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Shape {
    pub workload: Workload,
    pub pages: u64,
    pub theta: f64,
    pub hot_pages: u64,
    pub touch_run: u64,
}

/// One client's page sequence.
pub struct Chooser {
    shape: Shape,
    rng: SmallRng,
    zipf: Option<Zipf<f64>>,
    lo: u64,
    span: u64,
    next: u64,
}

/// A multiplier coprime to `n` near `n / φ`: `rank * it mod n` scatters
/// consecutive ranks over the file (a permutation, so no page gets two ranks).
fn scatter_step(n: u64) -> u64 {
    if n <= 2 {
        return 1;
    }
    let mut m = ((n as f64) * 0.618_033_988_7) as u64 | 1;
    while gcd(m, n) != 1 {
        m += 2;
    }
    m
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Chooser {
    /// Client `client` of `clients` (the partitioned slices), seeded by
    /// `seed`.
    pub fn new(shape: Shape, client: u64, clients: u64, seed: u64) -> anyhow::Result<Self> {
        let clients = clients.max(1);
        let per = (shape.pages / clients).max(1);
        let lo = (per * client).min(shape.pages.saturating_sub(1));
        let zipf = match shape.workload {
            Workload::Zipfian => Some(
                Zipf::new(shape.pages as f64, shape.theta)
                    .map_err(|e| anyhow::anyhow!("zipfian theta {}: {e}", shape.theta))?,
            ),
            _ => None,
        };
        Ok(Self {
            shape,
            rng: SmallRng::seed_from_u64(seed ^ client.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            zipf,
            lo,
            span: per.min(shape.pages - lo),
            next: 0,
        })
    }

    /// The next operation: `(first page, pages)`; runs only for page-touch.
    pub fn next(&mut self) -> (u64, u64) {
        let n = self.shape.pages;
        match self.shape.workload {
            Workload::Partitioned => {
                let p = self.lo + self.next;
                self.next = (self.next + 1) % self.span;
                (p, 1)
            }
            Workload::Uniform => (self.rng.random_range(0..n), 1),
            Workload::Zipfian => {
                let rank = self.zipf.as_ref().map_or(1.0, |z| z.sample(&mut self.rng)) as u64;
                let rank = rank.clamp(1, n) - 1;
                (
                    ((rank as u128 * scatter_step(n) as u128) % n as u128) as u64,
                    1,
                )
            }
            Workload::HotPage => (
                self.rng.random_range(0..self.shape.hot_pages.clamp(1, n)),
                1,
            ),
            Workload::PageTouch => {
                let run = self.shape.touch_run.clamp(1, self.span);
                let first = self.lo + self.next;
                let run = run.min(self.lo + self.span - first);
                self.next = (self.next + run) % self.span;
                (first, run)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(w: Workload) -> Shape {
        Shape {
            workload: w,
            pages: 1000,
            theta: 0.99,
            hot_pages: 8,
            touch_run: 64,
        }
    }

    #[test]
    fn every_workload_stays_in_the_file() {
        for w in [
            Workload::Partitioned,
            Workload::Uniform,
            Workload::Zipfian,
            Workload::HotPage,
            Workload::PageTouch,
        ] {
            for c in 0..3 {
                let mut ch = Chooser::new(shape(w), c, 3, 7).unwrap();
                for _ in 0..5000 {
                    let (p, r) = ch.next();
                    assert!(r >= 1 && p + r <= 1000, "{w:?}: {p}+{r}");
                }
            }
        }
    }

    #[test]
    fn zipfian_is_skewed_and_scattered() {
        let mut ch = Chooser::new(shape(Workload::Zipfian), 0, 1, 1).unwrap();
        let mut counts = vec![0u32; 1000];
        for _ in 0..100_000 {
            counts[ch.next().0 as usize] += 1;
        }
        let mut sorted = counts.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let top10: u32 = sorted[..10].iter().sum();
        // theta 0.99 over 1000 pages: the 10 hottest take about 40 %.
        assert!(top10 > 30_000 && top10 < 55_000, "top10 {top10}");
        // The hottest pages are spread over the file, not packed at its
        // start (ranks are scattered): the 10 hottest span over half of it.
        let mut by_heat: Vec<usize> = (0..1000).collect();
        by_heat.sort_unstable_by_key(|&p| std::cmp::Reverse(counts[p]));
        let hot = &by_heat[..10];
        let span = hot.iter().max().unwrap() - hot.iter().min().unwrap();
        assert!(span > 500, "the 10 hottest pages {hot:?}");
    }

    #[test]
    fn partitioned_and_touch_stay_in_their_slice() {
        let mut ch = Chooser::new(shape(Workload::PageTouch), 1, 3, 0).unwrap();
        for _ in 0..100 {
            let (p, r) = ch.next();
            assert!(p >= 333 && p + r <= 666, "{p}+{r}");
        }
        let mut ch = Chooser::new(shape(Workload::Partitioned), 2, 3, 0).unwrap();
        for _ in 0..1000 {
            let (p, _) = ch.next();
            assert!((666..1000).contains(&p), "{p}");
        }
    }

    #[test]
    fn the_scatter_step_is_a_permutation() {
        for n in [1u64, 2, 3, 10, 512, 1000, 262_144] {
            let m = scatter_step(n);
            assert_eq!(gcd(m, n), 1, "{n}");
        }
    }
}
