//! `pagewire-bench genfile`: writes the cluster's backing file in the
//! self-describing format ([`pagewire_node::pattern`]), for a cluster whose
//! readers verify every byte (the compose cluster's init step).
//!
//! Idempotent: a file that already has the size asked for and whose first
//! and last pages verify is kept (`--force` writes it again). The file is
//! written beside its final path and renamed into place, so a run cut
//! short leaves no half-written file behind the name.

use std::path::PathBuf;

use anyhow::{Context, bail};
use pagewire_node::pattern;

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The file to write.
    #[arg(long)]
    pub path: PathBuf,
    /// Its size in MiB.
    #[arg(long, default_value_t = 256)]
    pub mib: u64,
    /// Bytes per page (the cluster's page size).
    #[arg(long, default_value_t = 4096)]
    pub page_size: usize,
    /// Write it even when a matching file is there.
    #[arg(long)]
    pub force: bool,
}

/// True when `path` is `len` bytes and its first and last pages verify.
fn matches(path: &std::path::Path, len: u64, page_size: usize) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    if f.metadata().map(|m| m.len()).ok() != Some(len) || len == 0 {
        return false;
    }
    let pages = len.div_ceil(page_size as u64);
    let mut buf = vec![0u8; page_size];
    [0, pages - 1].iter().all(|&p| {
        let off = p * page_size as u64;
        let n = (len - off).min(page_size as u64) as usize;
        f.read_exact_at(&mut buf[..n], off).is_ok() && pattern::verify(p, &buf[..n]).is_ok()
    })
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    if !a.page_size.is_power_of_two() || a.page_size < 512 {
        bail!(
            "--page-size {} is not a power of two of at least 512",
            a.page_size
        );
    }
    let len = a.mib << 20;
    if len == 0 {
        bail!("--mib must be at least 1");
    }
    if !a.force && matches(&a.path, len, a.page_size) {
        eprintln!(
            "genfile: {} is already a {} MiB self-describing file; kept",
            a.path.display(),
            a.mib
        );
        return Ok(());
    }
    let mut tmp = a.path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let t = std::time::Instant::now();
    pattern::generate_file(&tmp, len, a.page_size)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), a.path.display()))?;
    eprintln!(
        "genfile: wrote {} ({} MiB, {} B pages) in {:.1} s",
        a.path.display(),
        a.mib,
        a.page_size,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
