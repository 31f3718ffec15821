//! The `tutti` command: `tutti devices`, `tutti perf`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tutti::perf::{self, Options};
use tutti::{device, Algorithm, Collective, Config, DType, DeviceKind, ReduceOp};

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
    Perf(PerfArgs),
}

#[derive(clap::Args)]
struct PerfArgs {
    /// Collective: all-reduce, broadcast, all-gather, reduce, reduce-scatter.
    #[arg(short = 'c', long, default_value = "all-reduce", value_parser = parse::<Collective>)]
    collective: Collective,
    /// Algorithm: auto, direct, ring, hierarchical-copy[:GROUP], reduce-to-one[:ROOT].
    #[arg(short = 'a', long, default_value = "auto", value_parser = parse::<Algorithm>)]
    algo: Algorithm,
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
    /// Run in place instead of out of place.
    #[arg(long)]
    in_place: bool,
    /// Iterations per size (default: about 0.25 s per size).
    #[arg(long)]
    iters: Option<usize>,
    /// Timeout of every wait, in seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Print JSON Lines: a machine line, then a line per size.
    #[arg(long)]
    json: bool,
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
        println!("{}", serde_json::json!({ "host": host, "devices": devs }));
        return Ok(());
    }
    println!(
        "host: {} cores, {:.1} GiB memory ({:.1} GiB available), {}",
        host.cores,
        gib(host.memory_total_bytes),
        gib(host.memory_available_bytes),
        host.cpu_model
    );
    println!("{:<8} {:<6} {:>12}  name", "device", "kind", "memory");
    for d in devs {
        let mem = d
            .memory_bytes
            .map_or("-".into(), |m| format!("{:.1} GiB", gib(m)));
        println!("{:<8} {:<6} {:>12}  {}", d.spec(), d.kind, mem, d.name);
    }
    println!("(GPU: not built with CUDA support; XLA: not built with PJRT support)");
    Ok(())
}

fn perf_cmd(a: PerfArgs) -> Result<(), tutti::Error> {
    let mut config = Config::default();
    if let Some(t) = a.timeout {
        if !(t.is_finite() && t > 0.0) {
            return Err(tutti::Error::config(format!(
                "--timeout {t}: must be a positive number of seconds"
            )));
        }
        config.timeout = std::time::Duration::from_secs_f64(t);
    }
    if a.min_bytes > a.max_bytes {
        return Err(tutti::Error::config(format!(
            "-b {} is larger than -e {}: nothing to measure",
            a.min_bytes, a.max_bytes
        )));
    }
    let defaults = Options::default();
    let opts = Options {
        collective: a.collective,
        algorithm: a.algo,
        ranks: a.ranks.unwrap_or(defaults.ranks),
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        dtype: a.dtype,
        op: a.op,
        device: a.device,
        in_place: a.in_place,
        iters: a.iters,
        config,
    };
    let machine = perf::machine();
    if a.json {
        println!("{}", serde_json::json!({ "machine": machine }));
    } else {
        println!(
            "# tutti perf: {} algo {} on {} ranks (threads), {} {}, {}, device {}",
            opts.collective.cli_name(),
            opts.algorithm,
            opts.ranks,
            opts.dtype,
            opts.op,
            if opts.in_place {
                "in place"
            } else {
                "out of place"
            },
            opts.device
        );
        println!(
            "# machine: copy bandwidth {:.1} GB/s (read + write, {} cores), {}",
            machine.copy_gbps, machine.cores, machine.cpu
        );
        println!(
            "# {:>12} {:>12} {:>11} {:>11} {:>11} {:>9} {:>7}",
            "bytes", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "mem_ratio", "errors"
        );
    }
    let json = a.json;
    let rows = perf::run(&opts, &machine, &|row| {
        if json {
            println!("{}", serde_json::to_string(row).expect("a row serializes"));
        } else {
            println!(
                "  {:>12} {:>12} {:>11.1} {:>11.2} {:>11.2} {:>9.2} {:>7}",
                row.bytes,
                row.count,
                row.time_us,
                row.algbw_gbps,
                row.busbw_gbps,
                row.mem_ratio,
                row.errors
            );
        }
    })?;
    let wrong: u64 = rows.iter().map(|r| r.errors).sum();
    if wrong > 0 {
        return Err(tutti::Error::System {
            what: "perf".into(),
            message: format!("{wrong} elements differed from the reference"),
        });
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Devices { json } => devices(json),
        Command::Perf(a) => perf_cmd(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tutti: {e}");
            ExitCode::FAILURE
        }
    }
}
