//! `pwctl read` and `pwctl write`: pages of the cluster's file through a
//! [`ClusterClient`], the way any client process reads and writes them.
//!
//! The client is synchronous and blocks on a runtime of its own (so does
//! the [`MapFollower`]'s thread), so `main` runs these two commands before
//! and outside pwctl's tokio runtime.
//!
//! * `read` checks PAGES and where the bytes go before it touches the
//!   network (page bytes are never written to a terminal), reads one page
//!   with `read_page` and a range in runs with `read_run`, streams each
//!   page's valid length to the output, and reports for each page the node
//!   that answered, the path (one-sided over shm, tcp or verbs; the owner's
//!   `FaultIn` after a one-sided miss; its gRPC `Read`), the frame
//!   generation and the attempts. Consecutive pages that agree on all of
//!   these share a row, so the report is lossless. The report goes to
//!   stdout, or to stderr when the bytes do.
//! * `write` takes the page's valid length, or a whole page with zeros past
//!   it, and prints the acknowledged frame generation and the owner.
//!
//! Exit status: 2 for what the user can fix in the command (PAGES, a page
//! past the end of the file, a file of the wrong length, bytes to a
//! terminal, bad token or addresses), 1 when the cluster could not do it.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use pagewire_client::cluster::{
    ClientConfig, ClientError, ClusterClient, FollowerConfig, MapFollower, ReadInfo, ReadPath,
    Transport, TransportChoice, Via, write_owner,
};
use pagewire_proto::lazy::LazyMap;
use pagewire_proto::state_name;
use pagewire_proto::v1::MapNode;
use serde_json::{Value, json};

use super::{
    Cli, Cmd, Usage, client_tls, error_chain, human_bytes, parse_count, table, token_text,
};

/// `--transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TransportArg {
    /// shm for an owner on this host, else tcp.
    Auto,
    /// shm only (owners on this host).
    Shm,
    /// tcp only, even for an owner on this host.
    Tcp,
}

impl TransportArg {
    fn choice(self) -> TransportChoice {
        match self {
            Self::Auto => TransportChoice::Auto,
            Self::Shm => TransportChoice::Shm,
            Self::Tcp => TransportChoice::Tcp,
        }
    }
}

/// Bytes asked of the client per `read_run` (whole pages, at least one).
const RUN_BYTES: usize = 1 << 20;

/// A `--from` file larger than this is refused before it is read.
const MAX_WRITE_FILE: u64 = 1 << 30;

/// Parses PAGES: `N`, `A..B` (B excluded) or `A+COUNT`, in pages, into
/// (first page, count).
pub(crate) fn parse_pages(s: &str) -> Result<(u64, u64), String> {
    let page = |t: &str| {
        let t = t.trim();
        parse_count(t.strip_prefix(['p', 'P']).unwrap_or(t))
    };
    if let Some((a, b)) = s.split_once("..") {
        let (a, b) = (page(a)?, page(b)?);
        if b <= a {
            return Err("in A..B, B must be above A (B is excluded)".into());
        }
        return Ok((a, b - a));
    }
    if let Some((a, n)) = s.split_once('+') {
        let n = page(n)?;
        if n == 0 {
            return Err("COUNT must be > 0".into());
        }
        let a = page(a)?;
        a.checked_add(n).ok_or("A+COUNT overflows")?;
        return Ok((a, n));
    }
    Ok((page(s)?, 1))
}

/// A page number (K/M/G/T suffixes, an optional `p`).
fn parse_page(s: &str) -> Result<u64, String> {
    let t = s.trim();
    parse_count(t.strip_prefix(['p', 'P']).unwrap_or(t))
}

/// A client error as pwctl's: the ones the command line can fix are usage
/// errors (exit 2), the rest failures (exit 1).
fn client_error(e: ClientError, what: &str) -> anyhow::Error {
    let usage = matches!(
        e,
        ClientError::BeyondEnd { .. }
            | ClientError::BufferSize { .. }
            | ClientError::WriteLength { .. }
            | ClientError::Addresses(_)
            | ClientError::Token(_)
    );
    let msg = format!("{what}: {}", error_chain(&e));
    if usage {
        Usage(msg).into()
    } else {
        anyhow!(msg)
    }
}

/// Connects the follower and the client with pwctl's global flags.
fn connect(
    cli: &Cli,
    path: ReadPath,
    transport: TransportChoice,
) -> anyhow::Result<(ClusterClient, Arc<MapFollower>)> {
    let (token, _) = token_text(cli)?;
    let tls = client_tls(cli);
    let follower = MapFollower::start_with(
        &cli.coordinator,
        &token,
        FollowerConfig {
            tls: tls.clone(),
            ..FollowerConfig::default()
        },
    )
    .map_err(|e| match e {
        ClientError::Addresses(e) => Usage(format!("bad --coordinator: {e}")).into(),
        e => client_error(e, "cannot follow the ownership map"),
    })?;
    let cfg = ClientConfig {
        transport,
        path,
        op_deadline: Duration::from_millis(cli.timeout_ms.max(1)),
        tls,
        ..ClientConfig::default()
    };
    let client = ClusterClient::new(follower.clone(), &token, cfg)
        .map_err(|e| client_error(e, "cannot start the client"))?;
    Ok((client, follower))
}

pub(crate) fn run(cli: &Cli) -> anyhow::Result<bool> {
    match &cli.cmd {
        Cmd::Read {
            pages,
            out,
            transport,
            grpc,
        } => read(cli, pages, out.as_deref(), *transport, *grpc),
        Cmd::Write { page, from } => write(cli, page, from),
        _ => unreachable!("only read and write run here"),
    }
}

/// Where the page bytes go.
enum Sink {
    File(PathBuf, std::fs::File),
    Stdout,
}

impl Sink {
    fn name(&self) -> String {
        match self {
            Sink::File(p, _) => p.display().to_string(),
            Sink::Stdout => "stdout".into(),
        }
    }
}

fn read(
    cli: &Cli,
    spec: &str,
    out: Option<&Path>,
    transport: TransportArg,
    grpc: bool,
) -> anyhow::Result<bool> {
    // Everything the command line can get wrong, before the network.
    let (first, count) = parse_pages(spec).map_err(|e| {
        Usage(format!(
            "bad PAGES {spec:?}: {e} (N, A..B or A+COUNT, in pages)"
        ))
    })?;
    if out.is_none() && std::io::stdout().is_terminal() {
        return Err(Usage(
            "refusing to write page bytes to a terminal: pass --out FILE or redirect stdout".into(),
        )
        .into());
    }
    let _ = token_text(cli)?;
    let path = if grpc {
        ReadPath::Grpc
    } else {
        ReadPath::OneSided
    };
    let (client, follower) = connect(cli, path, transport.choice())?;
    let pages = client.file_pages();
    let end = first.saturating_add(count);
    if end > pages {
        let what = if count == 1 {
            format!("page {first} is")
        } else {
            format!("pages {first}..{end} reach")
        };
        return Err(Usage(format!(
            "{what} past the end of the file ({pages} pages of {} bytes, pages 0..{pages}; {} bytes)",
            client.page_size(),
            client.file_size()
        ))
        .into());
    }
    // Created only now: a bad PAGES leaves an existing FILE as it was.
    let mut sink = match out {
        Some(p) => Sink::File(
            p.to_owned(),
            std::fs::File::create(p)
                .map_err(|e| Usage(format!("cannot create --out {}: {e}", p.display())))?,
        ),
        None => Sink::Stdout,
    };
    let ps = client.page_size();
    let per_run = (RUN_BYTES / ps).max(1) as u64;
    let mut buf = vec![0u8; ps * per_run.min(count) as usize];
    let mut report = Report::default();
    let mut page = first;
    let mut bytes = 0u64;
    while page < end {
        let n = per_run.min(end - page) as usize;
        let got = if n == 1 {
            client
                .read_page(page, &mut buf[..ps])
                .map(|info| vec![info])
        } else {
            client
                .read_run(page, n, &mut buf[..n * ps])
                .map(|run| run.pages)
        };
        let infos = match got {
            Ok(i) => i,
            Err(e) => {
                let e = client_error(e, &format!("reading page {page}"));
                if page > first {
                    return Err(e.context(format!(
                        "{} holds the {bytes} bytes of pages {first}..{page} read before",
                        sink.name()
                    )));
                }
                return Err(e);
            }
        };
        if infos.len() != n {
            return Err(anyhow!(
                "the client answered {} pages of a read of {n} from page {page}",
                infos.len()
            ));
        }
        let mut chunk = Vec::with_capacity(n * ps);
        for (i, info) in infos.iter().enumerate() {
            let p = page + i as u64;
            chunk.extend_from_slice(&buf[i * ps..i * ps + client.page_len(p)]);
            report.add(p, info);
        }
        let written = match &mut sink {
            Sink::File(_, f) => f.write_all(&chunk),
            Sink::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(&chunk).and_then(|()| o.flush())
            }
        };
        if let Err(e) = written {
            if matches!(sink, Sink::Stdout) && e.kind() == std::io::ErrorKind::BrokenPipe {
                // `pwctl read ... | head -c N`: the reader has all it wanted.
                return Ok(true);
            }
            return Err(anyhow!("cannot write to {}: {e}", sink.name()));
        }
        bytes += chunk.len() as u64;
        page += n as u64;
    }
    if let Sink::File(p, f) = &sink {
        f.sync_all()
            .map_err(|e| anyhow!("cannot write to {}: {e}", p.display()))?;
    }
    let map = follower.map();
    let text = if cli.json {
        serde_json::to_string_pretty(&report.json(&map, first, count, bytes, out))
            .unwrap_or_default()
            + "\n"
    } else {
        report.text(&map, first, count, bytes, &sink.name())
    };
    match sink {
        Sink::Stdout => eprint!("{text}"),
        Sink::File(..) => out!("{text}"),
    }
    Ok(true)
}

fn write(cli: &Cli, spec: &str, from: &Path) -> anyhow::Result<bool> {
    let page =
        parse_page(spec).map_err(|e| Usage(format!("bad PAGE {spec:?}: {e} (a page number)")))?;
    let _ = token_text(cli)?;
    let meta = std::fs::metadata(from)
        .map_err(|e| Usage(format!("cannot read --from {}: {e}", from.display())))?;
    if meta.len() > MAX_WRITE_FILE {
        return Err(Usage(format!(
            "--from {} holds {} bytes ({}): write takes one page",
            from.display(),
            meta.len(),
            human_bytes(meta.len())
        ))
        .into());
    }
    let data = std::fs::read(from)
        .map_err(|e| Usage(format!("cannot read --from {}: {e}", from.display())))?;
    let (client, follower) = connect(cli, ReadPath::OneSided, TransportChoice::Auto)?;
    let pages = client.file_pages();
    if page >= pages {
        return Err(Usage(format!(
            "page {page} is past the end of the file ({pages} pages of {} bytes, pages 0..{pages})",
            client.page_size()
        ))
        .into());
    }
    let (ps, len) = (client.page_size(), client.page_len(page));
    if data.len() != len && data.len() != ps {
        let whole = if len == ps {
            String::new()
        } else {
            format!(", or {ps} (the page size) with zeros past byte {len}")
        };
        return Err(Usage(format!(
            "--from {} holds {} bytes; page {page} takes {len}{whole}",
            from.display(),
            data.len()
        ))
        .into());
    }
    if data.len() != len
        && let Some(i) = data[len..].iter().position(|&b| b != 0)
    {
        return Err(Usage(format!(
            "--from {} holds {ps} bytes, but page {page} is {len} bytes long (the file's last \
             page) and byte {} past its end is not zero: give {len} bytes, or zeros past them",
            from.display(),
            len + i
        ))
        .into());
    }
    let generation = client
        .write_page(page, &data)
        .map_err(|e| client_error(e, &format!("writing page {page}")))?;
    // The owner that acknowledged it, as the map names it now (a map change
    // during the write may have moved the extent since).
    let map = follower.map();
    let owner = write_owner(&map, page);
    let node = owner.and_then(|i| map.nodes.iter().find(|n| n.index == i));
    if cli.json {
        super::print_json(&json!({
            "page": page, "bytes": len, "generation": generation, "epoch": map.epoch,
            "owner": node_json(node, owner),
        }));
    } else {
        outln!(
            "page {page}: wrote {len} bytes, acknowledged at frame generation {generation}; \
             owner {} at map epoch {}",
            node_text(node, owner),
            map.epoch
        );
    }
    Ok(true)
}

fn node_json(node: Option<&MapNode>, index: Option<u32>) -> Value {
    match (node, index) {
        (Some(n), _) => json!({
            "index": n.index, "node_id": n.node_id, "grpc_address": n.grpc_address,
            "state": state_name(n.state()),
        }),
        (None, Some(i)) => {
            json!({"index": i, "node_id": null, "grpc_address": null, "state": null})
        }
        (None, None) => Value::Null,
    }
}

fn node_text(node: Option<&MapNode>, index: Option<u32>) -> String {
    match (node, index) {
        (Some(n), _) => format!(
            "{} (index {}, {}, {})",
            n.node_id,
            n.index,
            n.grpc_address,
            state_name(n.state())
        ),
        (None, Some(i)) => format!("node index {i} (no longer in the map)"),
        (None, None) => "unknown (no node owns the page at this epoch)".into(),
    }
}

/// The path of a read in words.
fn path_name(via: Via, transport: Option<Transport>) -> &'static str {
    match (via, transport) {
        (Via::OneSided, Some(Transport::Shm)) => "one-sided/shm",
        (Via::OneSided, Some(Transport::Tcp)) => "one-sided/tcp",
        (Via::OneSided, Some(Transport::Verbs)) => "one-sided/verbs",
        (Via::OneSided, None) => "one-sided",
        (Via::FaultIn, _) => "fault-in",
        (Via::Grpc, _) => "grpc-read",
    }
}

/// Consecutive pages read the same way (node, path, generation, attempts).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    first: u64,
    last: u64,
    owner: u32,
    path: &'static str,
    generation: u64,
    attempts: u32,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    one_sided: u64,
    fault_ins: u64,
    grpc: u64,
    retries: u64,
}

impl Report {
    fn add(&mut self, page: u64, info: &ReadInfo) {
        self.push(
            page,
            info.owner,
            info.via,
            info.transport,
            info.generation,
            info.attempts,
        );
    }

    fn push(
        &mut self,
        page: u64,
        owner: u32,
        via: Via,
        transport: Option<Transport>,
        generation: u64,
        attempts: u32,
    ) {
        match via {
            Via::OneSided => self.one_sided += 1,
            Via::FaultIn => self.fault_ins += 1,
            Via::Grpc => self.grpc += 1,
        }
        self.retries += u64::from(attempts.saturating_sub(1));
        let row = Row {
            first: page,
            last: page,
            owner,
            path: path_name(via, transport),
            generation,
            attempts,
        };
        match self.rows.last_mut() {
            Some(r)
                if r.last + 1 == page
                    && (r.owner, r.path, r.generation, r.attempts)
                        == (row.owner, row.path, row.generation, row.attempts) =>
            {
                r.last = page;
            }
            _ => self.rows.push(row),
        }
    }

    fn node(map: &LazyMap, index: u32) -> Option<&MapNode> {
        map.nodes.iter().find(|n| n.index == index)
    }

    fn json(&self, map: &LazyMap, first: u64, count: u64, bytes: u64, out: Option<&Path>) -> Value {
        json!({
            "first_page": first, "pages": count, "bytes": bytes,
            "out": out.map(|p| p.display().to_string()),
            "epoch": map.epoch, "page_size": map.page_size,
            "one_sided": self.one_sided, "fault_ins": self.fault_ins, "grpc_reads": self.grpc,
            "retries": self.retries,
            "runs": self.rows.iter().map(|r| {
                let n = Self::node(map, r.owner);
                json!({
                    "first": r.first, "last": r.last,
                    "node_index": r.owner,
                    "node_id": n.map(|n| n.node_id.clone()),
                    "grpc_address": n.map(|n| n.grpc_address.clone()),
                    "path": r.path, "generation": r.generation, "attempts": r.attempts,
                })
            }).collect::<Vec<_>>(),
        })
    }

    fn text(&self, map: &LazyMap, first: u64, count: u64, bytes: u64, to: &str) -> String {
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                let n = Self::node(map, r.owner);
                vec![
                    if r.first == r.last {
                        r.first.to_string()
                    } else {
                        format!("{}-{}", r.first, r.last)
                    },
                    n.map_or_else(|| "?".into(), |n| n.node_id.clone()),
                    r.owner.to_string(),
                    r.path.into(),
                    r.generation.to_string(),
                    r.attempts.to_string(),
                ]
            })
            .collect();
        let mut s = table(
            &["PAGES", "NODE", "INDEX", "PATH", "GENERATION", "ATTEMPTS"],
            &rows,
        );
        let range = if count == 1 {
            format!("page {first}")
        } else {
            format!("pages {first}..{}", first + count)
        };
        s.push_str(&format!(
            "read {range} ({bytes} bytes) to {to} at map epoch {}: {} one-sided, {} fault-in, \
             {} gRPC Read; {} retries\n",
            map.epoch, self.one_sided, self.fault_ins, self.grpc, self.retries
        ));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_parse_in_pages() {
        assert_eq!(parse_pages("7").unwrap(), (7, 1));
        assert_eq!(parse_pages("p7").unwrap(), (7, 1));
        assert_eq!(parse_pages("4..8").unwrap(), (4, 4));
        assert_eq!(parse_pages("p4..p8").unwrap(), (4, 4));
        assert_eq!(parse_pages("1K+2").unwrap(), (1024, 2));
        assert!(parse_pages("8..4").is_err());
        assert!(parse_pages("4..4").is_err());
        assert!(parse_pages("3+0").is_err());
        assert!(parse_pages("4KB").is_err(), "pages, not bytes");
        assert!(parse_pages("x").is_err());
        assert!(parse_pages(&format!("{}+2", u64::MAX)).is_err());
        assert_eq!(parse_page("p2").unwrap(), 2);
    }

    fn add(r: &mut Report, page: u64, owner: u32, via: Via, generation: u64, attempts: u32) {
        let t = (via == Via::OneSided).then_some(Transport::Shm);
        r.push(page, owner, via, t, generation, attempts);
    }

    #[test]
    fn the_report_joins_only_pages_read_alike() {
        let mut r = Report::default();
        add(&mut r, 0, 1, Via::OneSided, 4, 1);
        add(&mut r, 1, 1, Via::OneSided, 4, 1);
        add(&mut r, 2, 1, Via::OneSided, 6, 1);
        add(&mut r, 3, 2, Via::FaultIn, 6, 2);
        add(&mut r, 4, 2, Via::FaultIn, 6, 2);
        let rows: Vec<(u64, u64, &str)> =
            r.rows.iter().map(|r| (r.first, r.last, r.path)).collect();
        assert_eq!(
            rows,
            [
                (0, 1, "one-sided/shm"),
                (2, 2, "one-sided/shm"),
                (3, 4, "fault-in")
            ]
        );
        assert_eq!((r.one_sided, r.fault_ins, r.retries), (3, 2, 2));
        let map = LazyMap::from_expanded(pagewire_proto::v1::OwnershipMap {
            epoch: 3,
            nodes: vec![MapNode {
                index: 1,
                node_id: "a".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        let t = r.text(&map, 0, 5, 5 * 4096, "x");
        assert!(t.contains("0-1    a     1      one-sided/shm  4"), "{t}");
        assert!(t.contains("3-4    ?     2      fault-in"), "{t}");
    }
}
