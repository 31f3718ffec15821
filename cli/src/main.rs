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

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::time::Duration;

use tutti::perf::{self, Options, Placement};
use tutti::{
    device, Algorithm, ClusterSpec, Collective, Communicator, Config, DType, DeviceKind, ReduceOp,
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
    /// Start N processes of a program with the job's environment set, prefixing their output.
    Launch(LaunchArgs),
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
    /// Seconds a stopped process gets between SIGTERM and SIGKILL.
    #[arg(long, default_value_t = 3.0)]
    grace: f64,
    /// The program and its arguments (`tutti` means this executable).
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    program: Vec<OsString>,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// Ranks (threads), when not under a launcher.
    #[arg(short = 'n', long)]
    ranks: Option<usize>,
    /// Transport under a launcher: auto, tcp, shm.
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
    /// Before checking, make one call on rank --inject-rank differ (count, dtype, op or
    /// collective) and require every rank to see the error.
    #[arg(long, hide = true)]
    inject: Option<String>,
    #[arg(long, hide = true, default_value_t = 1)]
    inject_rank: usize,
}

#[derive(clap::Args)]
struct PerfArgs {
    /// Collective: all-reduce, broadcast, all-gather, reduce, reduce-scatter.
    #[arg(short = 'c', long, default_value = "all-reduce", value_parser = parse::<Collective>)]
    collective: Collective,
    /// Algorithm: auto, direct, ring, hierarchical-copy[:GROUP], reduce-to-one[:ROOT]; with
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
    /// Reduce op: sum, prod, min, max, mean.
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
    /// Root of broadcast and reduce.
    #[arg(short = 'r', long)]
    root: Option<usize>,
    /// Iterations per size (default: about 0.25 s per size).
    #[arg(long)]
    iters: Option<usize>,
    /// Timeout of every wait, in seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Transport under a launcher: auto, tcp, shm; several (comma-separated) measure each.
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
            .filter(|d| *d <= tutti::comm::MAX_TIMEOUT)
            .ok_or_else(|| {
                tutti::Error::config(format!("--timeout {t}: longer than tutti allows (30 days)"))
            })?;
    }
    Ok(config)
}

/// The communicator of this process when it runs under a launcher, else `None`.
fn launched_comm(
    transport: Option<TransportKind>,
    config: &Config,
) -> Result<Option<Communicator>, tutti::Error> {
    let Some(spec) = ClusterSpec::from_env()? else {
        return Ok(None);
    };
    let kind = match transport {
        Some(k) => k,
        None => match std::env::var("TUTTI_TRANSPORT") {
            Ok(v) => v
                .parse()
                .map_err(|e: String| tutti::Error::config(format!("TUTTI_TRANSPORT: {e}")))?,
            Err(_) => TransportKind::Auto,
        },
    };
    Communicator::from_cluster(&spec, kind, config).map(Some)
}

fn parse<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<DeviceKind, String> {
    s.parse().map_err(|e: tutti::Error| e.to_string())
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn devices(json: bool) -> Result<(), tutti::Error> {
    let host = device::host();
    let devs = device::discover();
    if json {
        #[allow(unused_mut)]
        let mut v = serde_json::json!({ "host": host, "devices": devs });
        #[cfg(feature = "xla")]
        {
            v["xla"] = xla_json();
        }
        #[cfg(feature = "cuda")]
        {
            v["gpu"] = tutti::gpu::status().to_json();
        }
        say!("{v}");
        return Ok(());
    }
    say!(
        "host: {} cores, {:.1} GiB memory ({:.1} GiB available), {}",
        host.cores,
        gib(host.memory_total_bytes),
        gib(host.memory_available_bytes),
        host.cpu_model
    );
    say!("{:<8} {:<6} {:>12}  name", "device", "kind", "memory");
    for d in devs {
        let mem = d
            .memory_bytes
            .map_or("-".into(), |m| format!("{:.1} GiB", gib(m)));
        say!("{:<8} {:<6} {:>12}  {}", d.spec(), d.kind, mem, d.name);
    }
    #[cfg(feature = "cuda")]
    gpu_text();
    #[cfg(all(not(feature = "xla"), not(feature = "cuda")))]
    say!("(GPU: not built with CUDA support; XLA: not built with PJRT support)");
    #[cfg(all(not(feature = "xla"), feature = "cuda"))]
    say!("(XLA: not built with PJRT support)");
    #[cfg(feature = "xla")]
    xla_text();
    Ok(())
}

/// The GPU part of `tutti devices`: the driver, NCCL and NVRTC (or why each is missing), then
/// each GPU's details.
#[cfg(feature = "cuda")]
fn gpu_text() {
    let s = tutti::gpu::status();
    say!("GPU: {}", s.lines().join("; "));
    for g in s.gpus.as_deref().unwrap_or_default() {
        let visible = g.visible_as.as_ref().map_or(String::new(), |v| {
            format!(", CUDA_VISIBLE_DEVICES entry {v}")
        });
        // Listing reads no free memory (that would open a context on every GPU).
        let free = if g.free_memory > 0 {
            format!(" ({:.1} GiB free)", gib(g.free_memory))
        } else {
            String::new()
        };
        say!(
            "gpu:{:<4} compute capability {}.{}, {} SMs, {:.1} GiB{free}, PCI {}, {}{visible}",
            g.ordinal,
            g.compute_capability.0,
            g.compute_capability.1,
            g.multiprocessors,
            gib(g.total_memory),
            g.pci_bus_id,
            g.uuid
        );
    }
}

/// The `xla` section of `tutti devices --json`: the plugin and its devices, or why there are
/// none.
#[cfg(feature = "xla")]
fn xla_json() -> serde_json::Value {
    match tutti::xla::discovery() {
        Ok(d) => serde_json::json!({
            "plugin": d.plugin,
            "api_version": [d.api_version.0, d.api_version.1],
            "platform": d.platform,
            "platform_version": d.platform_version,
            "devices": d.devices,
        }),
        Err(e) => serde_json::json!({ "error": e.to_string(), "api_version": null }),
    }
}

#[cfg(feature = "xla")]
fn xla_text() {
    match tutti::xla::discovery() {
        Ok(d) => {
            say!(
                "XLA: PJRT plugin {} (C API {}.{}), platform {} {}",
                d.plugin.display(),
                d.api_version.0,
                d.api_version.1,
                d.platform,
                d.platform_version
            );
            say!(
                "{:<8} {:>6} {:>8} {:<16} description",
                "device",
                "id",
                "process",
                "kind"
            );
            for x in &d.devices {
                say!(
                    "{:<8} {:>6} {:>8} {:<16} {}",
                    format!("xla:{}", x.index),
                    x.id,
                    x.process_index,
                    x.kind,
                    x.description
                );
            }
            #[cfg(not(feature = "cuda"))]
            say!("(GPU: not built with CUDA support)");
        }
        Err(e) if cfg!(feature = "cuda") => say!("({e})"),
        Err(e) => say!("(GPU: not built with CUDA support; {e})"),
    }
}

/// Everything about `tutti perf`'s arguments that can be wrong, checked before anything is
/// printed or measured.
fn check_perf_args(a: &PerfArgs) -> Result<(), tutti::Error> {
    let bad = |m: String| Err(tutti::Error::config(m));
    if a.factor < 2 {
        return bad(format!(
            "-f {}: the step factor between sizes must be at least 2",
            a.factor
        ));
    }
    if a.iters == Some(0) {
        return bad("--iters 0: measure at least one iteration".into());
    }
    if a.ranks == Some(0) {
        return bad("-n 0: perf needs at least one rank".into());
    }
    if a.collective == Collective::Barrier {
        return bad("-c barrier: perf measures collectives that move data".into());
    }
    if let Some(root) = a.root {
        if !matches!(a.collective, Collective::Broadcast | Collective::Reduce) {
            return bad(format!(
                "-r {root}: {} has no root (broadcast and reduce do)",
                a.collective.cli_name()
            ));
        }
        if let Some(n) = a.ranks.filter(|&n| root >= n) {
            return bad(format!("-r {root}: out of range for {n} ranks (-n {n})"));
        }
    }
    if a.device == DeviceKind::Xla && a.in_place {
        return bad(
            "--in-place: XLA collectives write new device buffers (drop --in-place)".into(),
        );
    }
    let esize = a.dtype.size();
    let split = matches!(
        a.collective,
        Collective::AllGather | Collective::ReduceScatter
    );
    let least = if split {
        esize * a.ranks.unwrap_or(1)
    } else {
        esize
    };
    if !perf::sizes(a.min_bytes, a.max_bytes, a.factor)
        .iter()
        .any(|&b| b >= least)
    {
        return bad(format!(
            "-b {} -e {}: no size holds {}; nothing to measure",
            a.min_bytes,
            a.max_bytes,
            if split {
                format!("one {} element per rank", a.dtype)
            } else {
                format!("one {} element", a.dtype)
            }
        ));
    }
    match a.device {
        DeviceKind::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        DeviceKind::Gpu => tutti::gpu::devices().map(drop),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Gpu => Err(tutti::Error::Unavailable {
            what: "GPU".into(),
            why: "this build of tutti has no CUDA support (build with --features cuda)".into(),
        }),
        #[cfg(feature = "xla")]
        DeviceKind::Xla => Ok(()),
        #[cfg(not(feature = "xla"))]
        DeviceKind::Xla => Err(tutti::Error::Unavailable {
            what: "XLA".into(),
            why: "this build of tutti has no PJRT support (build with --features xla)".into(),
        }),
    }
}

fn perf_cmd(a: PerfArgs) -> Result<(), tutti::Error> {
    let config = config_with_timeout(a.timeout)?;
    if a.min_bytes > a.max_bytes {
        return Err(tutti::Error::config(format!(
            "-b {} is larger than -e {}: nothing to measure",
            a.min_bytes, a.max_bytes
        )));
    }
    // `-a ring,direct`: one sweep per algorithm (and per transport given), one line each in
    // the plot.
    let algos = a
        .algo
        .split(',')
        .map(|name| perf_algorithm(&a, name.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    check_perf_args(&a)?;
    let transports: Vec<Option<TransportKind>> = if a.transport.is_empty() {
        vec![None]
    } else {
        a.transport.iter().copied().map(Some).collect()
    };
    if a.overlap && algos.len() * transports.len() > 1 {
        return Err(tutti::Error::config(
            "--overlap measures one algorithm on one transport (one -a, one --transport)",
        ));
    }
    let mut machine = None;
    let mut series: Vec<(String, Vec<perf::Row>)> = Vec::new();
    let mut lead = true;
    for &transport in &transports {
        let mut comm = launched_comm(transport, &config.clone().with_algorithm(algos[0].core))?;
        if comm.is_none() && transport.is_some() {
            return Err(tutti::Error::config(
                "--transport applies to the processes of a launched job (tutti launch -n 2 -- \
                 tutti perf --transport tcp); without a launcher the ranks are threads",
            ));
        }
        if a.overlap {
            return overlap_cmd(&a, comm, config.with_algorithm(algos[0].core));
        }
        lead = comm.as_ref().is_none_or(|c| c.rank() == 0);
        for algo in &algos {
            if let Some(c) = &mut comm {
                c.set_algorithm(algo.core)?;
            }
            let rows = sweep(&a, comm.as_ref(), algo, transport, &config, &mut machine)?;
            let label = match (algos.len() > 1, transports.len() > 1, transport) {
                (true, true, Some(t)) => format!("{}, {t}", algo.name),
                (false, true, Some(t)) => t.to_string(),
                _ => algo.name.clone(),
            };
            series.push((label, rows));
        }
    }
    if let (Some(path), true) = (&a.plot, lead) {
        plot(path, &a, &series)?;
    }
    let wrong: u64 = series.iter().flat_map(|(_, r)| r).map(|r| r.errors).sum();
    if wrong > 0 {
        return Err(tutti::Error::System {
            what: "perf".into(),
            message: format!("{wrong} elements differed from the reference"),
        });
    }
    Ok(())
}

/// One algorithm of `-a`, as the core and (with CUDA) the GPU harness take it.
struct PerfAlgorithm {
    name: String,
    core: Algorithm,
    #[cfg(feature = "cuda")]
    gpu: tutti::gpu::GpuAlgorithm,
}

fn perf_algorithm(a: &PerfArgs, name: &str) -> Result<PerfAlgorithm, tutti::Error> {
    // `nccl` names a GPU algorithm only; the other names are the core algorithms.
    let gpu = a.device == DeviceKind::Gpu;
    let core: Algorithm = match name.parse() {
        Ok(x) => x,
        // GPU names (nccl among them) are checked with the GPU algorithms.
        Err(_) if gpu => Algorithm::Auto,
        Err(_) if name.eq_ignore_ascii_case("nccl") => {
            return Err(tutti::Error::config(
                "-a nccl: NCCL runs on GPUs (--device gpu)",
            ))
        }
        Err(e) => return Err(tutti::Error::config(format!("-a: {e}"))),
    };
    #[cfg(feature = "cuda")]
    let gpu_algo: tutti::gpu::GpuAlgorithm = name
        .parse()
        .map_err(|e| tutti::Error::config(format!("-a: {e}")))
        .or_else(|e| if gpu { Err(e) } else { Ok(Default::default()) })?;
    Ok(PerfAlgorithm {
        name: if gpu {
            name.to_ascii_lowercase()
        } else {
            core.to_string()
        },
        core,
        #[cfg(feature = "cuda")]
        gpu: gpu_algo,
    })
}

/// `tutti perf --plot FILE.svg`: busbw against size, a line per algorithm or transport.
fn plot(path: &str, a: &PerfArgs, series: &[(String, Vec<perf::Row>)]) -> Result<(), tutti::Error> {
    use plotters::prelude::*;
    let fail = |e: String| tutti::Error::System {
        what: format!("--plot {path}"),
        message: e,
    };
    // Out of place where both were measured: one line per series.
    let points: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(label, rows)| {
            let any_out = rows.iter().any(|r| !r.in_place);
            let pts = rows
                .iter()
                .filter(|r| r.in_place != any_out)
                .map(|r| (r.bytes as f64, r.busbw_gbps))
                .collect();
            (label.as_str(), pts)
        })
        .collect();
    let all = || points.iter().flat_map(|(_, p)| p.iter());
    let (lo, hi) = all().fold((f64::MAX, 0f64), |(lo, hi), &(x, _)| (lo.min(x), hi.max(x)));
    let top = all().fold(0f64, |m, &(_, y)| m.max(y)).max(1e-3) * 1.1;
    if points.iter().all(|(_, p)| p.is_empty()) {
        return Err(fail("nothing was measured".into()));
    }
    let rows = &series[0].1;
    let title = format!(
        "tutti perf: {} {} on {} ranks",
        a.collective.cli_name(),
        a.dtype,
        rows.first().map_or(0, |r| r.ranks)
    );
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d((lo..hi.max(lo * 2.0)).log_scale(), 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("bytes")
            .y_desc("busbw (GB/s)")
            .x_label_formatter(&|b| size_label(*b))
            .draw()?;
        for (i, (label, pts)) in points.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.85))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| fail(e.to_string()))
}

/// `10k`, `1M`: a size on the plot's axis (whose ticks are powers of ten).
fn size_label(bytes: f64) -> String {
    match bytes {
        b if b >= 1e9 => format!("{}G", b / 1e9),
        b if b >= 1e6 => format!("{}M", b / 1e6),
        b if b >= 1e3 => format!("{}k", b / 1e3),
        b => format!("{b}"),
    }
}

/// One sweep of sizes with one algorithm: its table (or JSON lines) from rank 0, and its rows.
fn sweep(
    a: &PerfArgs,
    comm: Option<&Communicator>,
    algo: &PerfAlgorithm,
    transport: Option<TransportKind>,
    config: &Config,
    machine_out: &mut Option<perf::Machine>,
) -> Result<Vec<perf::Row>, tutti::Error> {
    let gpu = a.device == DeviceKind::Gpu;
    let config = config.clone();
    let defaults = Options::default();
    let opts = Options {
        collective: a.collective,
        algorithm: algo.core,
        ranks: comm
            .as_ref()
            .map_or(a.ranks.unwrap_or(defaults.ranks), |c| c.world_size()),
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        dtype: a.dtype,
        op: a.op,
        device: a.device,
        placement: if a.in_place {
            Placement::InPlace
        } else if a.out_of_place || a.device == DeviceKind::Xla {
            // XLA collectives write new buffers: out of place is all there is.
            Placement::OutOfPlace
        } else {
            Placement::Both
        },
        root: a.root.unwrap_or(0),
        iters: a.iters,
        config,
    };
    // The world size of a launched job is known only now, and before anything is measured.
    opts.check_root(opts.ranks)?;
    if opts.device == DeviceKind::Cpu {
        opts.config
            .clone()
            .with_algorithm(opts.algorithm)
            .check(opts.ranks)?;
    }
    let lead = comm.as_ref().is_none_or(|c| c.rank() == 0);
    // Rank 0 measures the machine once, while the others wait; they learn the copy bandwidth
    // from it.
    let mut machine = match machine_out {
        Some(m) => m.clone(),
        None if lead => perf::machine(comm.is_some())?,
        None => perf::Machine {
            copy_gbps: 0.0,
            cores: 0,
            cpu: String::new(),
            memory_bytes: 0,
            tcp_gbps: None,
            gpu_copy_gbps: None,
        },
    };
    #[cfg(feature = "cuda")]
    if gpu && comm.is_none() && machine.gpu_copy_gbps.is_none() {
        machine.gpu_copy_gbps = Some(tutti::gpu::device_copy_gbps(0)?);
    }
    if let Some(c) = comm {
        let mut bw = [machine.copy_gbps];
        c.broadcast(&mut bw, 0)?;
        machine.copy_gbps = bw[0];
    }
    *machine_out = Some(machine.clone());
    let carrier = match comm {
        Some(_) => format!(
            "processes, transport {}",
            transport.map_or_else(
                || std::env::var("TUTTI_TRANSPORT").unwrap_or_else(|_| "auto".into()),
                |t| t.to_string()
            )
        ),
        None if a.device == DeviceKind::Xla => "XLA devices through PJRT".to_string(),
        None if gpu => "GPUs of this process".to_string(),
        None => "threads".to_string(),
    };
    if lead && a.json {
        say!("{}", serde_json::json!({ "machine": machine }));
    } else if lead {
        say!(
            "# tutti perf: {} algo {} on {} ranks ({carrier}), {}{}{}, {}, device {}",
            opts.collective.cli_name(),
            algo.name,
            opts.ranks,
            opts.dtype,
            // The op only where the collective reduces (a broadcast has none).
            if matches!(
                opts.collective,
                Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter
            ) {
                format!(" {}", opts.op)
            } else {
                String::new()
            },
            opts.rooted()
                .map_or(String::new(), |r| format!(", root {r}")),
            match opts.placement {
                Placement::OutOfPlace => "out of place",
                Placement::InPlace => "in place",
                Placement::Both => "out of place and in place",
            },
            opts.device
        );
        let tcp = machine.tcp_gbps.map_or(String::new(), |t| {
            format!(", loopback TCP {t:.2} GB/s per direction")
        });
        let gpu_copy = machine.gpu_copy_gbps.map_or(String::new(), |g| {
            format!(", GPU 0 device copy {g:.1} GB/s (read + write)")
        });
        say!(
            "# machine: copy bandwidth {:.1} GB/s (read + write, {} cores){tcp}{gpu_copy}, {}",
            machine.copy_gbps,
            machine.cores,
            machine.cpu
        );
        // nccl-tests' layout: size, count and root, then a group of columns per placement.
        let group = format!(
            "{:>11} {:>11} {:>11} {:>9} {:>7}",
            "time(us)", "algbw(GB/s)", "busbw(GB/s)", "mem_ratio", "errors"
        );
        let runs = opts.placement.runs();
        let titles: Vec<String> = runs
            .iter()
            .map(|&p| format!("{:>52}", if p { "in place" } else { "out of place" }))
            .collect();
        say!("# {:>12} {:>12} {:>5}{}", "", "", "", titles.join(" "));
        say!(
            "# {:>12} {:>12} {:>5} {}",
            "bytes",
            "count",
            "root",
            vec![group; runs.len()].join(" ")
        );
    }
    let json = a.json;
    let both = opts.placement == Placement::Both;
    // With both placements a size's line waits for its in-place row.
    let out_of_place: std::sync::Mutex<Option<perf::Row>> = Default::default();
    let emit = |row: &perf::Row| {
        if json {
            say!("{}", serde_json::to_string(row).expect("a row serializes"));
            return;
        }
        let mut held = out_of_place.lock().unwrap_or_else(|e| e.into_inner());
        if both && !row.in_place {
            *held = Some(row.clone());
            return;
        }
        let group = |r: &perf::Row| {
            format!(
                "{:>11.1} {:>11.2} {:>11.2} {:>9.2} {:>7}",
                r.time_us, r.algbw_gbps, r.busbw_gbps, r.mem_ratio, r.errors
            )
        };
        let groups: Vec<String> = held.take().iter().chain([row]).map(group).collect();
        say!(
            "  {:>12} {:>12} {:>5} {}",
            row.bytes,
            row.count,
            row.root.map_or(-1, |r| r as i64),
            groups.join(" ")
        );
    };
    let rows = match comm {
        Some(c) => perf::run_on(c, &opts, &machine, &emit)?,
        #[cfg(feature = "cuda")]
        None if gpu => {
            let gbps = machine.gpu_copy_gbps.unwrap_or_default();
            tutti::perf::gpu::run(&opts, algo.gpu, gbps, &emit)?
        }
        None => perf::run(&opts, &machine, &emit)?,
    };
    if lead && !json && !rows.is_empty() {
        // nccl-tests' closing line: the mean bus bandwidth over the sizes measured.
        let avg = rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64;
        say!("# Avg bus bandwidth    : {avg:.3}");
    }
    Ok(rows)
}

/// `tutti perf --overlap`: each size's all-reduce, computation and both overlapped.
fn overlap_cmd(
    a: &PerfArgs,
    comm: Option<Communicator>,
    config: Config,
) -> Result<(), tutti::Error> {
    if a.collective != Collective::AllReduce || a.device != DeviceKind::Cpu {
        return Err(tutti::Error::config(
            "--overlap measures the f32 all-reduce on CPU ranks (-c all-reduce, --device cpu)",
        ));
    }
    let sizes = perf::sizes(a.min_bytes, a.max_bytes, a.factor);
    let iters = a.iters.unwrap_or(20);
    let json = a.json;
    let run = |c: &Communicator| -> Result<(), tutti::Error> {
        let lead = c.rank() == 0;
        if lead && !json {
            say!(
                "# tutti perf --overlap: all-reduce f32 sum, algo {}, {} ranks, {iters} iterations; ratio = overlapped / (compute + all-reduce), 1.0 = no overlap",
                c.algorithm(),
                c.world_size()
            );
            say!(
                "# {:>12} {:>14} {:>12} {:>15} {:>7}",
                "bytes",
                "all_reduce(us)",
                "compute(us)",
                "overlapped(us)",
                "ratio"
            );
        }
        for &bytes in &sizes {
            let row = perf::overlap_one(c, bytes, iters)?;
            if lead && json {
                say!("{}", serde_json::to_string(&row).expect("a row serializes"));
            } else if lead {
                say!(
                    "  {:>12} {:>14.1} {:>12.1} {:>15.1} {:>7.2}",
                    row.bytes,
                    row.all_reduce_us,
                    row.compute_us,
                    row.overlapped_us,
                    row.ratio
                );
            }
        }
        Ok(())
    };
    match comm {
        Some(c) => run(&c),
        None => tutti::run_local(a.ranks.unwrap_or(2), &config, run)?
            .into_iter()
            .collect(),
    }
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
    let calls = perf::check(comm, &a.counts)?;
    if let Some(secs) = a.busy_secs {
        comm.set_algorithm(Algorithm::Auto)?;
        // Fault drills wait for this line before they stop or kill a rank.
        say!("rank {}: checked, now busy for {secs} s", comm.rank());
        let t = std::time::Instant::now();
        let mut buf = vec![1.0f32; 1 << 20];
        while t.elapsed().as_secs_f64() < secs {
            buf.fill(1.0);
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
    }
    Ok(calls)
}

fn check_cmd(a: CheckArgs) -> Result<(), tutti::Error> {
    let config = config_with_timeout(a.timeout)?;
    match launched_comm(a.transport, &config)? {
        Some(mut comm) => {
            let calls = check_one_rank(&mut comm, &a)?;
            say!(
                "rank {} of {}, hosts {}: {calls} calls checked, all correct",
                comm.rank(),
                comm.world_size(),
                comm.num_hosts()
            );
        }
        None => {
            let n = a.ranks.unwrap_or_else(|| device::host().cores.max(2));
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
                "{n} ranks (threads): {} calls checked, all correct",
                results[0]
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
        Command::Devices { json } => ("devices", devices(json).map(|_| 0)),
        Command::Perf(a) => ("perf", perf_cmd(a).map(|_| 0)),
        Command::Check(a) => ("check", check_cmd(a).map(|_| 0)),
        Command::Launch(a) => ("launch", launch_cmd(a)),
    };
    match r {
        Ok(0) => ExitCode::SUCCESS,
        Ok(code) => ExitCode::from(code.clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("tutti {name}: {e}");
            ExitCode::FAILURE
        }
    }
}
