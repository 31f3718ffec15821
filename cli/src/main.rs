//! The `tutti` command: `tutti devices`, `tutti perf`.

mod launch;

/// Print a line to stdout; a reader that went away (`tutti perf | head -1`) ends the command
/// quietly, as it ends other Unix tools, instead of a panic.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::say(format_args!($($arg)*))
    };
}

fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{line}") {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
    }
}

mod devices;
mod perf_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::time::Duration;

use tutti::perf::{self, Options, Placement};
use tutti::{
    Algorithm, ClusterSpec, Collective, Communicator, Config, DType, DeviceKind, ReduceOp,
    TransportKind,
};

#[derive(Parser)]
#[command(
    name = "tutti",
    version,
    about = "tutti: collective communication for data-parallel training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what device discovery found.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Measure a collective over a sweep of sizes, like nccl-tests (each row checked for errors).
    /// Under a launcher (TF_CONFIG, TUTTI_*, torchrun, mpirun, srun) it runs as one rank of that
    /// world and rank 0 prints.
    Perf(PerfArgs),
    /// Check every collective and algorithm against the reference, on threads or, under a
    /// launcher, on this world.
    Check(CheckArgs),
    /// Start N processes of a program with the job's environment set (--tag-output prefixes
    /// each line with its rank).
    Launch(LaunchArgs),
    /// Measure the cost model's figures on a launched world (each carrier's latency and
    /// bandwidth, the rate of reduction) and write them for TUTTI_TUNING (rank 0 writes).
    Tune(TuneArgs),
}

#[derive(clap::Args)]
struct TuneArgs {
    /// Transport: auto, tcp, shm, mpi (under mpirun, with the `mpi` feature).
    #[arg(long, value_parser = parse::<TransportKind>)]
    transport: Option<TransportKind>,
    /// The file rank 0 writes (JSON), for TUTTI_TUNING=PATH.
    #[arg(short = 'o', long, default_value = "tutti-tuning.json")]
    output: std::path::PathBuf,
    /// Timeout of every wait, in seconds.
    #[arg(long)]
    timeout: Option<f64>,
}

#[derive(clap::Args)]
struct LaunchArgs {
    /// Number of processes (default 2; `-np` is accepted too, as mpirun spells it).
    #[arg(short = 'n', long = "nprocs", conflicts_with = "workers")]
    nprocs: Option<usize>,
    /// Worker tasks: write TF_CONFIG (with --ps) instead of TUTTI_* variables.
    #[arg(long)]
    workers: Option<usize>,
    /// Parameter-server tasks (needs --workers).
    #[arg(long, requires = "workers")]
    ps: Option<usize>,
    /// Prefix every line a process prints with its rank or task (`[1] ...`); off by default,
    /// so that output such as `tutti perf --json` passes through as it is.
    #[arg(long)]
    tag_output: bool,
    /// Hosts in the job, each running `tutti launch` with the same options but its own
    /// --node-rank (as torchrun spells them); ranks are node-rank × -n + local rank.
    #[arg(long, default_value_t = 1, conflicts_with = "workers")]
    nnodes: usize,
    /// This host's index in 0..--nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// The host where rank 0 (on --node-rank 0) serves the rendezvous (required with --nnodes
    /// above 1; default: a loopback port of this host).
    #[arg(long, requires = "master_port")]
    master_addr: Option<String>,
    /// The rendezvous port on --master-addr.
    #[arg(long, requires = "master_addr", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// Transport for every process: auto, tcp, shm.
    #[arg(long, value_parser = parse::<TransportKind>)]
    transport: Option<TransportKind>,
    /// Seconds a stopped process gets between SIGTERM and SIGKILL (and, after a failure, at
    /// most the moment the others get to end on their own, 2 s by default).
    #[arg(long, default_value_t = 3.0)]
    grace: f64,
    /// A process that fails does not stop the others (they may shrink and go on without it:
    /// Communicator::shrink); the launch succeeds when at least one process succeeds, and
    /// names every one that failed.
    #[arg(long)]
    elastic: bool,
    /// The program and its arguments (`tutti` means this executable).
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    program: Vec<OsString>,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// Ranks (threads), when not under a launcher.
    #[arg(short = 'n', long)]
    ranks: Option<usize>,
    /// Transport under a launcher: auto, tcp, shm, mpi (under mpirun, with the `mpi` feature).
    #[arg(long, value_parser = parse::<TransportKind>)]
    transport: Option<TransportKind>,
    /// Element counts to check (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0,1,7,1000,70001")]
    counts: Vec<usize>,
    /// Timeout of every wait, in seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// After checking, keep running 4 MiB all-reduces for this many seconds (fault drills).
    #[arg(long, hide = true)]
    busy_secs: Option<f64>,
    /// The busy all-reduces on a shared buffer (Communicator::alloc_shared).
    #[arg(long, hide = true)]
    busy_shared: bool,
    /// When a busy all-reduce fails (a rank was lost), shrink to the survivors and check the
    /// collectives on them.
    #[arg(long, hide = true)]
    shrink: bool,
    /// Before checking, make one call on rank --inject-rank differ (count, dtype, op or
    /// collective) and require every rank to see the error.
    #[arg(long, hide = true)]
    inject: Option<String>,
    #[arg(long, hide = true, default_value_t = 1)]
    inject_rank: usize,
    /// After checking, split the ranks into K groups (color rank % K, in descending rank order)
    /// and check every collective on each group.
    #[arg(long, hide = true, value_name = "K")]
    split: Option<usize>,
}

#[derive(clap::Args)]
struct PerfArgs {
    /// Collective: all-reduce, broadcast, all-gather, reduce, reduce-scatter.
    #[arg(short = 'c', long, default_value = "all-reduce", value_parser = parse::<Collective>)]
    collective: Collective,
    /// Algorithm: auto, direct, ring, hierarchical-copy[:GROUP], reduce-to-one[:ROOT],
    /// recursive-doubling, rabenseifner, hosts, mpi (MPI's own, with --transport mpi); with
    /// --device gpu: auto, nccl, hierarchical-copy[:GROUP], reduce-to-one[:ROOT]. Several
    /// (comma-separated) are measured one after the other.
    #[arg(short = 'a', long, default_value = "auto")]
    algo: String,
    /// Number of ranks (default: the number of cores, at least 2).
    #[arg(short = 'n', long)]
    ranks: Option<usize>,
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "1K", value_parser = perf::parse_size)]
    min_bytes: usize,
    /// Largest size in bytes (K, M, G suffixes).
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = perf::parse_size)]
    max_bytes: usize,
    /// Multiplier between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    factor: usize,
    /// Element type: f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64.
    #[arg(short = 'd', long, default_value = "f32", value_parser = parse::<DType>)]
    dtype: DType,
    /// Reduce op: sum, prod, min, max, mean (or avg); band, bor, bxor on the integer types.
    #[arg(short = 'o', long, default_value = "sum", value_parser = parse::<ReduceOp>)]
    op: ReduceOp,
    /// Device kind: cpu (gpu and xla with their features).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: DeviceKind,
    /// Measure in place only (default: out of place and in place, side by side).
    #[arg(long, conflicts_with = "out_of_place")]
    in_place: bool,
    /// Measure out of place only.
    #[arg(long)]
    out_of_place: bool,
    /// Put CPU ranks' buffers in shared buffers (Communicator::alloc_shared, tutti_mem_alloc),
    /// mapped by every process of the host: collectives on them run `direct` between processes.
    #[arg(long)]
    shared_buffers: bool,
    /// Root of broadcast and reduce.
    #[arg(short = 'r', long)]
    root: Option<usize>,
    /// Iterations per size (default: about 0.25 s per size).
    #[arg(long)]
    iters: Option<usize>,
    /// Timeout of every wait, in seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Transport under a launcher: auto, tcp, shm, mpi (under mpirun, in a build with the `mpi`
    /// feature); several (comma-separated) measure each.
    #[arg(long, value_parser = parse::<TransportKind>, value_delimiter = ',')]
    transport: Vec<TransportKind>,
    /// Print JSON Lines: a machine line, then a line per size.
    #[arg(long)]
    json: bool,
    /// Draw busbw against size into this SVG file, a line per algorithm (-a ring,direct) or
    /// transport (--transport tcp,shm) measured.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<String>,
    /// Measure overlap instead: a non-blocking f32 all-reduce with computation on the caller's
    /// thread meanwhile, against the two one after the other (ratio 1.0: no overlap).
    #[arg(long)]
    overlap: bool,
    /// Bitwise-deterministic reductions (as TUTTI_DETERMINISTIC=1), to measure what the mode
    /// costs (`tutti check` under it compares the bits on random floats).
    #[arg(long)]
    deterministic: bool,
    /// Carry f32 all-reduce and reduce-scatter between hosts as bf16 or f16 (as
    /// TUTTI_COMPRESSION; reducing in f32): a sweep over TCP measures what it saves, and the
    /// footer gives the error it adds on random data.
    #[arg(long, value_name = "none|bf16|f16")]
    compression: Option<tutti::Compression>,
}

fn config_with_timeout(timeout: Option<f64>) -> Result<Config, tutti::Error> {
    let mut config = Config::default();
    if let Some(t) = timeout {
        if !(t.is_finite() && t > 0.0) {
            return Err(tutti::Error::config(format!(
                "--timeout {t}: must be a positive number of seconds"
            )));
        }
        config.timeout = Duration::try_from_secs_f64(t)
            .ok()
            .filter(|d| *d <= tutti::MAX_TIMEOUT)
            .ok_or_else(|| {
                tutti::Error::config(format!("--timeout {t}: longer than tutti allows (30 days)"))
            })?;
    }
    Ok(config)
}

/// `tutti tune`: measure the figures on this world, write them, and show what `auto` would run.
fn tune_cmd(a: TuneArgs) -> Result<(), tutti::Error> {
    // Measured from the built-in figures, whatever TUTTI_TUNING names (perhaps the very file
    // being replaced).
    std::env::remove_var("TUTTI_TUNING");
    let config = config_with_timeout(a.timeout)?;
    let comm = launched_comm(a.transport, &config)?.ok_or_else(|| {
        tutti::Error::config(
            "tutti tune measures the ranks of a launched job: run it under a launcher (tutti \
             launch -n 4 -- tutti tune, mpirun, scripts/sim_cluster.sh)",
        )
    })?;
    if comm.world_size() < 2 {
        return Err(tutti::Error::config(
            "tutti tune needs at least 2 ranks: there is nothing between one rank's peers to measure",
        ));
    }
    let figures = comm.measure_tuning()?;
    if comm.rank() != 0 {
        return Ok(());
    }
    let mut json = serde_json::to_value(figures)
        .map_err(|e| tutti::Error::config(format!("cannot write the figures: {e}")))?;
    json["measured_on"] = serde_json::json!({
        "world": comm.world_size(),
        "hosts": comm.num_hosts(),
        "transport": a.transport.map_or_else(|| "auto".to_string(), |k| k.to_string()),
    });
    let text = serde_json::to_string_pretty(&json)
        .map_err(|e| tutti::Error::config(format!("cannot write the figures: {e}")))?;
    // Written beside and renamed into place: a job starting meanwhile reads the old file or
    // the new one, never half of one.
    let mut part = a.output.clone().into_os_string();
    part.push(format!(".{}.part", std::process::id()));
    let part = std::path::PathBuf::from(part);
    std::fs::write(&part, text + "\n")
        .and_then(|_| std::fs::rename(&part, &a.output))
        .map_err(|e| {
            std::fs::remove_file(&part).ok();
            tutti::Error::config(format!("cannot write {}: {e}", a.output.display()))
        })?;
    say!(
        "# tutti tune: {} ranks on {} host(s), at most {} per host, {} cores",
        comm.world_size(),
        comm.num_hosts(),
        figures.ranks_per_host,
        figures.cores
    );
    say!("#   carrier  latency_us  per_message_us  GB/s");
    for (name, l) in [("shm", figures.shm), ("net", figures.net)] {
        say!(
            "#   {name:<7} {:>11.2} {:>15.2} {:>5.2}",
            l.latency_us,
            l.per_message_us,
            l.gbytes_per_s
        );
    }
    say!("#   reduce: {:.2} GB/s", figures.reduce_gbytes_per_s);
    say!("# what auto runs for an all-reduce on these ranks with these figures:");
    say!("#        bytes  algorithm           predicted_us");
    let mut bytes = 8usize;
    while bytes <= 64 << 20 {
        let (algo, time) = comm.predict_all_reduce(&figures, bytes);
        say!(
            "  {bytes:>12}  {algo:<18}  {}",
            time.map_or_else(|| "-".to_string(), |t| format!("{t:.1}"))
        );
        bytes *= 8;
    }
    say!(
        "# wrote {} (use it with TUTTI_TUNING={})",
        a.output.display(),
        a.output.display()
    );
    Ok(())
}

/// The communicator of this process when it runs under a launcher, else `None`.
fn launched_comm(
    transport: Option<TransportKind>,
    config: &Config,
) -> Result<Option<Communicator>, tutti::Error> {
    let kind = match transport {
        Some(k) => k,
        None => match std::env::var("TUTTI_TRANSPORT") {
            Ok(v) => v
                .parse()
                .map_err(|e: String| tutti::Error::config(format!("TUTTI_TRANSPORT: {e}")))?,
            Err(_) => TransportKind::Auto,
        },
    };
    if kind.is_mpi_here() {
        // The ranks are the MPI job's (mpirun gives no meeting point of tutti's).
        return Communicator::from_env_over(kind, config).map(Some);
    }
    let Some(spec) = ClusterSpec::from_env()? else {
        return Ok(None);
    };
    Communicator::from_cluster(&spec, kind, config).map(Some)
}

/// `-n` under a launcher: the launched world's size, or not given.
pub(crate) fn launched_ranks(
    ranks: Option<usize>,
    comm: &Communicator,
) -> Result<(), tutti::Error> {
    match ranks {
        Some(n) if n != comm.world_size() => Err(tutti::Error::config(format!(
            "-n {n}: this job was launched with {} ranks (tutti launch -n); -n sets the threads \
             of a run without a launcher",
            comm.world_size()
        ))),
        _ => Ok(()),
    }
}

fn parse<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<DeviceKind, String> {
    s.parse().map_err(|e: tutti::Error| e.to_string())
}

/// One mismatched call on `inject_rank`; every rank must get an error, and the communicator must
/// stay usable.
fn inject(comm: &Communicator, kind: &str, inject_rank: usize) -> Result<(), tutti::Error> {
    let odd = comm.rank() == inject_rank;
    let r = match kind {
        "count" => comm.all_reduce(&mut vec![1.0f32; if odd { 5 } else { 4 }], ReduceOp::Sum),
        "dtype" if odd => comm.all_reduce(&mut [1.0f64; 4], ReduceOp::Sum),
        "dtype" => comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum),
        "op" => comm.all_reduce(
            &mut [1.0f32; 4],
            if odd { ReduceOp::Max } else { ReduceOp::Sum },
        ),
        "order" if odd => comm.broadcast(&mut [1.0f32; 4], 0),
        "order" => comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum),
        _ => {
            return Err(tutti::Error::config(format!(
                "--inject {kind}: expected count, dtype, op or order"
            )))
        }
    };
    match r {
        Err(e) => {
            eprintln!("injected mismatch detected: {e}");
            Ok(())
        }
        Ok(()) => Err(tutti::Error::System {
            what: "check".into(),
            message: format!("the injected {kind} mismatch went unnoticed"),
        }),
    }
}

fn check_one_rank(comm: &mut Communicator, a: &CheckArgs) -> Result<usize, tutti::Error> {
    if let Some(kind) = &a.inject {
        inject(comm, kind, a.inject_rank)?;
    }
    let mut calls = perf::check(comm, &a.counts)?;
    if let Some(k) = a.split {
        if k == 0 {
            return Err(tutti::Error::config("--split: 0 groups"));
        }
        let color = comm.rank() % k;
        let mut group = comm
            .split(Some(color as u32), -(comm.rank() as i64))?
            .ok_or_else(|| tutti::Error::config("--split: this rank was given no group"))?;
        let in_group = perf::check(&mut group, &a.counts)?;
        say!(
            "rank {}: group {color}: rank {} of {}, hosts {}: {in_group} calls checked, all correct",
            comm.rank(),
            group.rank(),
            group.world_size(),
            group.num_hosts()
        );
        calls += in_group;
    }
    if let Some(secs) = a.busy_secs {
        comm.set_algorithm(Algorithm::Auto)?;
        // Fault drills wait for this line before they stop or kill a rank.
        say!("rank {}: checked, now busy for {secs} s", comm.rank());
        let mut shared = match a.busy_shared {
            true => Some(comm.alloc_shared(4 << 20)?),
            false => None,
        };
        let mut heap = vec![1.0f32; 1 << 20];
        let t = std::time::Instant::now();
        while t.elapsed().as_secs_f64() < secs {
            let buf = match &mut shared {
                Some(b) => b.as_mut_slice::<f32>(),
                None => &mut heap[..],
            };
            buf.fill(1.0);
            match comm.all_reduce(buf, ReduceOp::Sum) {
                Err(e) if a.shrink => {
                    say!("rank {}: {e}", comm.rank());
                    drop(shared);
                    let (rank, world) = (comm.rank(), comm.world_size());
                    *comm = comm.shrink()?;
                    say!(
                        "rank {rank} of {world}: shrank to rank {} of {}",
                        comm.rank(),
                        comm.world_size()
                    );
                    return Ok(calls + perf::check(comm, &a.counts)?);
                }
                r => r?,
            }
        }
    }
    Ok(calls)
}

fn check_cmd(a: CheckArgs) -> Result<(), tutti::Error> {
    let config = config_with_timeout(a.timeout)?;
    let comm = launched_comm(a.transport, &config)?;
    if comm.is_none() && a.transport.is_some() {
        return Err(tutti::Error::config(
            "--transport applies to the processes of a launched job (tutti launch -n 2 -- \
             tutti check --transport tcp); without a launcher the ranks are threads",
        ));
    }
    match comm {
        Some(mut comm) => {
            launched_ranks(a.ranks, &comm)?;
            let calls = check_one_rank(&mut comm, &a)?;
            say!(
                "rank {} of {}, hosts {}: {calls} calls checked, all correct{}",
                comm.rank(),
                comm.world_size(),
                comm.num_hosts(),
                match (comm.deterministic(), comm.compression()) {
                    (true, _) => {
                        ", reductions bit for bit in rank order (deterministic mode)".to_string()
                    }
                    (false, tutti::Compression::None) => String::new(),
                    (false, c) => format!(", f32 between hosts as {c} within its bound"),
                }
            );
        }
        None => {
            let n = a.ranks.unwrap_or_else(|| tutti::host_info().cores.max(2));
            let results = tutti::local_group(n, &config).and_then(|comms| {
                std::thread::scope(|s| {
                    let a = &a;
                    let hs: Vec<_> = comms
                        .into_iter()
                        .map(|mut c| s.spawn(move || check_one_rank(&mut c, a)))
                        .collect();
                    hs.into_iter()
                        .map(|h| {
                            h.join()
                                .unwrap_or_else(|_| Err(tutti::Error::config("a rank panicked")))
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
            })?;
            say!(
                "{n} ranks (threads): {} calls checked, all correct{}",
                results[0],
                if config.deterministic {
                    ", reductions bit for bit in rank order (deterministic mode)"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

fn launch_cmd(a: LaunchArgs) -> Result<i32, tutti::Error> {
    if !(a.grace.is_finite() && a.grace >= 0.0) {
        return Err(tutti::Error::config(
            "--grace must be a non-negative number of seconds",
        ));
    }
    launch::run(&launch::Launch {
        nprocs: a.nprocs.unwrap_or(2),
        workers: a.workers,
        ps: a.ps.unwrap_or(0),
        tag: a.tag_output,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master: a.master_addr.zip(a.master_port),
        transport: a.transport,
        program: a.program,
        grace: Duration::from_secs_f64(a.grace),
        elastic: a.elastic,
    })
}

/// The command line, with mpirun's `-np` read as `-n` in `tutti launch`'s own options (before
/// the program and its arguments).
fn args() -> Vec<OsString> {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "launch") {
        for a in args.iter_mut().skip(2) {
            if a == "--" {
                break;
            }
            if a == "-np" {
                *a = "-n".into();
            }
        }
    }
    args
}

/// The library's log records, on stderr as `tutti: ...`, up to the level `TUTTI_LOG` names
/// (`error`, `warn`, `info`, `debug`, `trace`, `off`; default `warn`).
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, meta: &log::Metadata<'_>) -> bool {
        meta.level() <= log::max_level()
    }
    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("tutti: {}", record.args());
        }
    }
    fn flush(&self) {}
}

fn init_log() -> Result<(), tutti::Error> {
    static LOG: StderrLog = StderrLog;
    let level = match std::env::var("TUTTI_LOG") {
        Err(_) => log::LevelFilter::Warn,
        Ok(v) => v.trim().parse::<log::LevelFilter>().map_err(|_| {
            tutti::Error::config(format!(
                "TUTTI_LOG='{v}': expected error, warn, info, debug, trace or off"
            ))
        })?,
    };
    let _ = log::set_logger(&LOG);
    log::set_max_level(level);
    Ok(())
}

fn main() -> ExitCode {
    if let Err(e) = init_log() {
        eprintln!("tutti: {e}");
        return ExitCode::FAILURE;
    }
    let cli = Cli::parse_from(args());
    let (name, r) = match cli.command {
        Command::Devices { json } => ("devices", devices::run(json).map(|_| 0)),
        Command::Perf(a) => ("perf", perf_cmd::run(a).map(|_| 0)),
        Command::Check(a) => ("check", check_cmd(a).map(|_| 0)),
        Command::Launch(a) => ("launch", launch_cmd(a)),
        Command::Tune(a) => ("tune", tune_cmd(a).map(|_| 0)),
    };
    // The trace's last events (how the last call ended) are written before the process goes.
    tutti::flush_trace();
    match r {
        Ok(0) => ExitCode::SUCCESS,
        Ok(code) => ExitCode::from(code.clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("tutti {name}: {e}");
            ExitCode::FAILURE
        }
    }
}
