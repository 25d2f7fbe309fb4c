//! The `pagewire-mount` command line: mounts a directory holding one file,
//! the pagewire cluster's (mount/README.md). Unmounts on SIGTERM, SIGINT or
//! SIGHUP and returns 0; a mount point left by a crashed run is cleaned at
//! the next start. `src/main.rs` is [`main_from`] over the process's
//! arguments; the end-to-end tests (`e2e/`) build the same entry point as
//! their own binary.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::deadline::SPARE_THREADS;
use crate::revalidate::Invalidate;
use crate::{Consistency, MAX_READ, MountConfig, PageFs, Source, fs::FILE, mountpoint};
use anyhow::Context;
use clap::Parser;
use fuser::{MountOption, Session};
use pagewire_client::{ClientConfig, ClusterClient, FollowerConfig, MapFollower, TransportChoice};
use pagewire_proto::net::ClientTls;
use tracing::{debug, error, info, warn};

/// Mounts the pagewire cluster's file as MOUNTPOINT/NAME.
#[derive(Parser, Debug)]
#[command(name = "pagewire-mount", version)]
struct Args {
    /// The coordinators, host:port, comma separated.
    #[arg(long, value_name = "HOST:PORT[,..]")]
    coordinator: String,
    /// A file holding the cluster token.
    #[arg(long, value_name = "F")]
    token_file: PathBuf,
    /// Transport of one-sided reads: auto, shm, tcp (verbs when built with it).
    #[arg(long, default_value = "auto")]
    transport: TransportChoice,
    /// CA certificate (PEM) the coordinators' and nodes' gRPC TLS must chain to.
    #[arg(long, value_name = "F", requires = "tls_domain")]
    tls_ca: Option<PathBuf>,
    /// The name their TLS certificates are checked against.
    #[arg(long, value_name = "D", requires = "tls_ca")]
    tls_domain: Option<String>,
    /// Let the kernel cache pages, attributes and the entry; every SECS
    /// seconds the cached runs are checked and those that changed dropped
    /// (default: direct I/O, no page cache).
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=86_400))]
    cached: Option<u64>,
    /// Allow writes (write-through to the cluster's backing file).
    #[arg(long)]
    writable: bool,
    /// Every read and write is answered within this many milliseconds
    /// (EIO after it); also the client's per-operation deadline.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    deadline_ms: u64,
    /// The file's name in the mounted directory.
    #[arg(long, default_value = "data")]
    name: String,
    /// Reads and writes that run at once on FUSE threads (the mount starts
    /// two more FUSE threads, and as many overflow workers).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// Do not read ahead of sequential readers (by default a read that
    /// continues an earlier one has the next run read ahead, and that run
    /// is used only after a check that no page of it changed since).
    #[arg(long)]
    no_read_ahead: bool,
    /// The directory to mount on.
    mountpoint: PathBuf,
}

/// Runs `pagewire-mount` with `args` (the first is the program's name) until
/// the mount ends: parses them (clap exits on `--help` or an error), logs to
/// stderr, mounts, serves.
pub fn main_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = Args::parse_from(args);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if args.name.is_empty() || args.name.contains('/') || args.name == "." || args.name == ".." {
        anyhow::bail!("--name {:?}: one path component, not . or ..", args.name);
    }
    let mp = args.mountpoint.clone();
    mountpoint::prepare(&mp)?;
    let token = std::fs::read_to_string(&args.token_file)
        .with_context(|| format!("reading the token file {}", args.token_file.display()))?;
    let token = token.trim();
    let tls = match (args.tls_ca, args.tls_domain) {
        (Some(ca_file), Some(domain)) => Some(ClientTls { ca_file, domain }),
        _ => None,
    };
    let deadline = Duration::from_millis(args.deadline_ms);

    let follower = MapFollower::start_with(
        &args.coordinator,
        token,
        FollowerConfig {
            tls: tls.clone(),
            ..FollowerConfig::default()
        },
    )
    .context("following the coordinator's map")?;
    let client = ClusterClient::new(
        follower,
        token,
        ClientConfig {
            transport: args.transport,
            op_deadline: deadline,
            tls,
            ..ClientConfig::default()
        },
    )
    .context("opening the cluster's file")?;
    let source = Arc::new(Source::new(client));
    info!(
        "the cluster's file: {} bytes, {} pages of {} bytes",
        source.file_size(),
        source.file_size().div_ceil(source.page_size() as u64),
        source.page_size()
    );

    let consistency = match args.cached {
        Some(s) => Consistency::Cached(Duration::from_secs(s)),
        None => Consistency::Direct,
    };
    let cfg = MountConfig {
        name: args.name.clone(),
        consistency,
        writable: args.writable,
        deadline,
        workers: args.workers as usize,
        read_ahead: !args.no_read_ahead,
    };
    let fs = PageFs::new(source.clone(), cfg).context("starting the workers")?;
    let revalidator = fs.revalidator();

    let mut options = vec![
        MountOption::FSName("pagewire".into()),
        MountOption::Subtype("pagewire".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::CUSTOM(format!("max_read={MAX_READ}")),
        if args.writable {
            MountOption::RW
        } else {
            MountOption::RO
        },
    ];
    options.dedup();
    let mut config = fuser::Config::default();
    config.mount_options = options;
    // Threads that take requests from the kernel: up to `workers` of them
    // run reads and writes themselves, the spare ones answer the rest.
    config.n_threads = Some(args.workers as usize + SPARE_THREADS);
    config.clone_fd = true;
    let mut session =
        Session::new(fs, &mp, &config).with_context(|| format!("mounting on {}", mp.display()))?;
    let unmounter = Arc::new(Mutex::new(session.unmount_callable()));
    let notifier = session.notifier();
    let device: Arc<OnceLock<u64>> = Arc::new(OnceLock::new());

    {
        let (unmounter, device, mp) = (unmounter.clone(), device.clone(), mp.clone());
        ctrlc::set_handler(move || {
            info!("signal received: unmounting {}", mp.display());
            let r = unmounter.lock().unwrap_or_else(|e| e.into_inner()).unmount();
            if let Err(e) = r {
                // Busy (a process has it open or as its directory): abort
                // the connection and detach it, so the session ends now.
                warn!(
                    "unmounting {}: {e}: forcing it (open files then fail with ENOTCONN)",
                    mp.display()
                );
                if let Err(why) = mountpoint::force_unmount(&mp) {
                    warn!("{why}");
                    match device.get() {
                        Some(&dev) => {
                            if let Err(e) = mountpoint::abort_connection(dev) {
                                warn!(
                                    "cannot abort the FUSE connection ({e}); the session ends when the last open file is closed"
                                );
                            }
                        }
                        None => warn!(
                            "the mount's device is unknown; the session ends when the last open file is closed"
                        ),
                    }
                }
            }
        })
        .context("installing the signal handler")?;
    }

    {
        // After the session answers: the device number (for the readahead
        // and for aborting), then the cached mode's invalidation timer.
        let (device, mp) = (device.clone(), mp.clone());
        std::thread::Builder::new()
            .name("pw-mount-setup".into())
            .spawn(move || {
                match mountpoint::device_of(&mp) {
                    Ok(dev) => {
                        let _ = device.set(dev);
                        match mountpoint::set_readahead(dev, MAX_READ / 1024) {
                            Ok(()) => info!("readahead of the mount set to {} KiB", MAX_READ / 1024),
                            Err(e) => warn!("cannot raise the mount's readahead to {} KiB: {e} (the kernel's default stays)", MAX_READ / 1024),
                        }
                    }
                    Err(e) => warn!("cannot stat the mount {}: {e}", mp.display()),
                }
                if let (Consistency::Cached(every), Some(revalidator)) = (consistency, revalidator) {
                    let ps = source.page_size() as u64;
                    loop {
                        std::thread::sleep(every);
                        revalidator.tick(
                            |runs| source.still_current_runs(runs),
                            |what| {
                                // Offset 0, length 0: every cached page of the file.
                                let (offset, len) = match what {
                                    Invalidate::Run { first, count } => (first * ps, count * ps),
                                    Invalidate::All => (0, 0),
                                };
                                let r = notifier.inval_inode(
                                    FILE,
                                    i64::try_from(offset).unwrap_or(i64::MAX),
                                    i64::try_from(len).unwrap_or(i64::MAX),
                                );
                                // ENOENT: the kernel holds no inode (nothing cached).
                                if let Err(e) = r
                                    && e.raw_os_error() != Some(libc::ENOENT)
                                {
                                    warn!("dropping cached pages ({what:?}) of the file: {e}");
                                }
                            },
                        );
                        debug!(
                            "cached pages checked ({} pages recorded)",
                            revalidator.recorded_pages()
                        );
                    }
                }
            })
            .context("starting the setup thread")?;
    }

    info!(
        "mounted on {} ({}{}, deadline {deadline:?})",
        mp.display(),
        match consistency {
            Consistency::Direct => "direct I/O".to_owned(),
            Consistency::Cached(s) => format!("cached, changed pages dropped every {s:?}"),
        },
        if args.writable {
            ", writable"
        } else {
            ", read-only"
        },
    );
    session.run().context("serving the mount")?;
    info!("unmounted {}", mp.display());
    Ok(())
}
