//! The one place the mount touches the cluster: [`Source`] wraps the
//! process's one shared [`ClusterClient`] and turns its errors into what a
//! FUSE reply can carry.

use pagewire_client::{ClientError, ClusterClient, ReadInfo};

/// The cluster's file, in pages: one per process, shared by every worker.
pub struct Source {
    client: ClusterClient,
    page_size: usize,
    file_size: u64,
}

/// Why a read or write of the cluster failed (every case is `EIO` to the
/// caller, with this as the log line).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The client gave up (deadline passed, node refused, ...).
    #[error(transparent)]
    Client(#[from] ClientError),
}

impl Source {
    /// Wraps `client` (its `op_deadline` should be the mount's deadline).
    pub fn new(client: ClusterClient) -> Self {
        let page_size = client.page_size();
        let file_size = client.file_size();
        Self {
            client,
            page_size,
            file_size,
        }
    }

    /// The cluster's page size in bytes.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The file's size in bytes.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// The file's size in pages.
    pub fn file_pages(&self) -> u64 {
        self.client.file_pages()
    }

    /// The valid length of `page` (`page_size`, less for a partial last page).
    pub fn page_len(&self, page: u64) -> usize {
        let start = page.saturating_mul(self.page_size as u64);
        self.file_size
            .saturating_sub(start)
            .min(self.page_size as u64) as usize
    }

    /// Pages `first..first + count` into `out` (at least `count *
    /// page_size` bytes; each page's valid length, then zeros), as one
    /// batched run.
    pub fn read_run(&self, first: u64, count: usize, out: &mut [u8]) -> Result<(), SourceError> {
        self.client.read_run(first, count, out)?;
        Ok(())
    }

    /// [`Source::read_run`] into the first `count * page_size` bytes of
    /// `buf`, grown to that size if shorter and never cleared (the run
    /// writes every byte of them: each page's valid length, zeros past it;
    /// zeroing 1 MiB per read was 8% of a sequential reader's CPU), saying
    /// how each page was read (what [`Source::still_current`] checks
    /// later).
    pub fn read_run_into(
        &self,
        first: u64,
        count: usize,
        buf: &mut Vec<u8>,
    ) -> Result<Vec<ReadInfo>, SourceError> {
        let need = count.saturating_mul(self.page_size);
        if buf.len() < need {
            buf.resize(need, 0);
        }
        Ok(self.client.read_run(first, count, &mut buf[..need])?.pages)
    }

    /// Whether the bytes a [`Source::read_run_into`] of pages `first..`
    /// returned (`pages`) are still what a read would return now
    /// ([`ClusterClient::still_current`]).
    pub fn still_current(&self, first: u64, pages: &[ReadInfo]) -> bool {
        self.client.still_current(first, pages)
    }

    /// [`Source::still_current`] for several runs at once, one answer per
    /// run, each node's pages in one batch
    /// ([`ClusterClient::still_current_runs`]).
    pub fn still_current_runs(&self, runs: &[(u64, &[ReadInfo])]) -> Vec<bool> {
        self.client.still_current_runs(runs)
    }

    /// Writes `page` whole (`data` is its valid length) through its owner;
    /// returns once the backing file has it.
    pub fn write_page(&self, page: u64, data: &[u8]) -> Result<(), SourceError> {
        self.client.write_page(page, data)?;
        Ok(())
    }
}
