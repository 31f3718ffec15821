//! The harness behind `tutti perf`: sizes × one collective, timed and checked, like nccl-tests.
//!
//! For each size every rank runs the collective once on fresh data and counts the elements that
//! differ from the reference, then the timed iterations follow (their number chosen by rank 0 from
//! a warm-up so each size takes about a quarter of a second). The time of a size is the slowest
//! rank's mean per iteration.
//!
//! Sizes follow nccl-tests: `bytes` is the buffer of all-reduce, broadcast and reduce, the larger
//! buffer of the others: the whole output of all-gather(-v) and gather, the whole input of
//! reduce-scatter(-v) and scatter, each rank's input of all-to-all(-v). The collectives with a
//! count per rank split `bytes` unevenly ([`v_counts`], [`pair_counts`]). `algbw = bytes /
//! time`; `busbw` scales it by 2(n-1)/n (all-reduce), (n-1)/n (all-gather, reduce-scatter, their
//! `-v` forms, all-to-all(-v), gather, scatter) or 1 (broadcast, reduce). `mem_ratio` divides the
//! least memory traffic the collective needs (every input byte read once and every output byte
//! written once: all-reduce and all-to-all 2·n·S, gather and scatter 2·S) per second by a copy
//! bandwidth measured like the collective: on CPU ranks, right after a size is timed, every rank
//! copies its input into its output at once, as many times as the collective ran, and the rate
//! is the bytes read and written by all of them over the slowest rank's mean time (for an
//! all-reduce or an all-to-all, `mem_ratio` is the copies' time over the collective's). The
//! machine's best copy rate (the header line) is no yardstick on a shared host: it swings by 2x
//! from one second to the next, and a mean compared with a best says more about the noise than
//! about tutti.
//!
//! One harness times every device: a size on CPU ranks (one per thread or process), on the GPUs
//! of this process (`gpu.rs`, feature `cuda`) or on its XLA devices (`xla.rs`, feature `xla`) is
//! a `Bench` (a checked call, a timed call, and how the ranks agree), and `measure` warms it up,
//! times it and builds the row the same way for all of them. The device modules never import
//! this one back.

mod check;
#[cfg(feature = "cuda")]
pub mod gpu;
mod overlap;
#[cfg(feature = "xla")]
mod xla;
pub use check::{check, compression_error, CompressionError};
pub use overlap::{overlap_one, OverlapRow};

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::algorithm::Algorithm;
use crate::comm::{run_local, Communicator, Config};
use crate::device::{self, DeviceKind};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Collective, Error, Result};
use crate::reference;

/// What to measure.
#[derive(Clone, Debug)]
pub struct Options {
    /// The collective.
    pub collective: Collective,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Number of ranks.
    pub ranks: usize,
    /// Smallest size in bytes.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Size multiplier between rows.
    pub factor: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduce op (reducing collectives).
    pub op: ReduceOp,
    /// Device kind.
    pub device: DeviceKind,
    /// Out of place, in place, or both (a row for each, out of place first).
    pub placement: Placement,
    /// The root of broadcast, reduce, gather and scatter.
    pub root: usize,
    /// Fixed iteration count per size (default: about 0.25 s per size).
    pub iters: Option<usize>,
    /// CPU ranks' buffers from [`Communicator::alloc_shared`] (else plain heap memory).
    pub shared_buffers: bool,
    /// Communicator settings.
    pub config: Config,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            collective: Collective::AllReduce,
            algorithm: Algorithm::Auto,
            ranks: device::host().cores.max(2),
            min_bytes: 1024,
            max_bytes: 64 << 20,
            factor: 4,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            device: DeviceKind::Cpu,
            placement: Placement::OutOfPlace,
            root: 0,
            iters: None,
            shared_buffers: false,
            config: Config::default(),
        }
    }
}

/// Where a collective writes: a separate output buffer, the input buffer, or both measured one
/// after the other (as nccl-tests prints them side by side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Placement {
    /// Into a separate output buffer.
    #[default]
    OutOfPlace,
    /// Into the input buffer.
    InPlace,
    /// Out of place, then in place, for every size.
    Both,
}

impl Placement {
    /// The runs of each size: `false` out of place, `true` in place.
    pub fn runs(self) -> &'static [bool] {
        match self {
            Placement::OutOfPlace => &[false],
            Placement::InPlace => &[true],
            Placement::Both => &[false, true],
        }
    }
}

impl Options {
    /// These options for one run of each size: out of place, or in place.
    pub fn run_of(&self, in_place: bool) -> Options {
        Options {
            placement: if in_place {
                Placement::InPlace
            } else {
                Placement::OutOfPlace
            },
            ..self.clone()
        }
    }

    /// Whether a run of these options is in place.
    pub fn in_place(&self) -> bool {
        self.placement == Placement::InPlace
    }

    /// An error unless the root is one of `ranks` ranks (checked before anything is measured).
    pub fn check_root(&self, ranks: usize) -> Result<()> {
        if self.root >= ranks {
            return Err(Error::config(format!(
                "root {} is out of range for {ranks} ranks",
                self.root
            )));
        }
        Ok(())
    }

    /// The root of the collective, for the collectives that have one.
    pub fn rooted(&self) -> Option<usize> {
        rooted(self.collective).then_some(self.root)
    }
}

/// Whether `c` has a root: broadcast, reduce, gather, scatter.
pub fn rooted(c: Collective) -> bool {
    matches!(
        c,
        Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
    )
}

/// Whether `c` reduces (takes an op): all-reduce, reduce, reduce-scatter and reduce-scatter-v.
pub fn reduces(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::Reduce
            | Collective::ReduceScatter
            | Collective::ReduceScatterV
    )
}

/// Whether perf measures `c` in place too (`--in-place`): the collectives that existed before
/// all-to-all; all-to-all(-v), gather, scatter and the `-v` forms have no in-place call.
pub fn has_in_place(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::Broadcast
            | Collective::AllGather
            | Collective::Reduce
            | Collective::ReduceScatter
    )
}

/// Whether a size of `c` is cut into one equal block per rank (so `count` is a multiple of the
/// ranks): all-gather, reduce-scatter, all-to-all, gather, scatter.
pub fn splits(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::Gather
            | Collective::Scatter
    )
}

/// An error unless perf measures `c` on `device`: GPUs measure every collective their group
/// runs; XLA devices every collective (all-reduce, broadcast, all-gather, reduce-scatter and
/// all-to-all as programs on device buffers; the others through an XLA group's communicators,
/// on host buffers).
pub fn device_measures(device: DeviceKind, c: Collective) -> Result<()> {
    let (ok, list, what) = match device {
        DeviceKind::Cpu | DeviceKind::Xla => return Ok(()),
        DeviceKind::Gpu => (
            crate::engine::cuda_runs(c),
            "all-reduce, broadcast, all-gather, reduce, reduce-scatter, all-to-all, \
             all-to-all-v, gather, scatter, all-gather-v and reduce-scatter-v",
            "GPU ranks",
        ),
    };
    if ok || c == Collective::Barrier {
        return Ok(());
    }
    Err(Error::config(format!(
        "-c {} --device {device}: not available on {what} (perf measures {list} there; \
         measure {} on CPU ranks: --device cpu)",
        c.cli_name(),
        c.cli_name()
    )))
}

/// The count per rank of an all-gather-v or reduce-scatter-v of `count` elements over `ranks`
/// ranks: rank k's share in proportion to k + 1 (rounded down), the remainder to the last rank,
/// so the counts sum to `count` and the last rank holds the most.
pub fn v_counts(count: usize, ranks: usize) -> Vec<usize> {
    weighted(count, (0..ranks).map(|k| k + 1))
}

/// The counts rank `from` sends each rank in an all-to-all-v of `count` elements per rank over
/// `ranks` ranks: to rank j in proportion to ((from + j) mod ranks) + 1, the remainder to the
/// rank of the largest weight. Every rank sends `count` elements; every rank receives about
/// `count` (each weight, the largest too, is one sender's for each receiver), from pairs of
/// different sizes.
pub fn pair_counts(count: usize, ranks: usize, from: usize) -> Vec<usize> {
    weighted(count, (0..ranks).map(|j| (from + j) % ranks + 1))
}

/// `count` split in proportion to `weights` (rounded down), the remainder to the part of the
/// largest weight (the first such).
fn weighted(count: usize, weights: impl Iterator<Item = usize> + Clone) -> Vec<usize> {
    let total: u128 = weights.clone().map(|w| w as u128).sum();
    let heaviest = weights
        .clone()
        .enumerate()
        .fold(
            (0, 0),
            |best, (k, w)| if w > best.1 { (k, w) } else { best },
        )
        .0;
    let mut v: Vec<usize> = weights
        .map(|w| (count as u128 * w as u128 / total.max(1)) as usize)
        .collect();
    let rest = count - v.iter().sum::<usize>();
    if let Some(x) = v.get_mut(heaviest) {
        *x += rest;
    }
    v
}

/// P + 1 offsets from a count per rank.
fn offsets(counts: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(counts.iter().scan(0, |at, &c| {
            *at += c;
            Some(*at)
        }))
        .collect()
}

/// The machine line of `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Memory bandwidth: bytes read plus written per second by a large memcpy split across all
    /// cores, in GB/s (10^9 bytes).
    pub copy_gbps: f64,
    /// Cores used.
    pub cores: usize,
    /// CPU model.
    pub cpu: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Loopback TCP rate, GB/s per direction: two endpoints each sending large messages to the
    /// other while receiving from it (plain sockets, no reduction). Measured for process runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_gbps: Option<f64>,
    /// Device-to-device copy bandwidth of GPU 0: bytes read plus written per second by 256 MiB
    /// copies within its memory, GB/s. Measured for `--device gpu` runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_copy_gbps: Option<f64>,
}

/// One row: one size.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Collective (`all-reduce`, ...).
    pub collective: String,
    /// Algorithm asked for.
    pub algo: String,
    /// What the timed calls ran as: the algorithm `auto` became, or the path a named one took
    /// (`Communicator::last_algorithm`); CPU ranks only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ran: Option<String>,
    /// Ranks.
    pub ranks: usize,
    /// Element type.
    pub dtype: String,
    /// Reduce op (`none` for the collectives that do not reduce).
    pub op: String,
    /// The root (broadcast, reduce, gather, scatter).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<usize>,
    /// Measured in place (else out of place).
    pub in_place: bool,
    /// Size in bytes (see the module docs).
    pub bytes: usize,
    /// Elements in `bytes`.
    pub count: usize,
    /// Mean time per collective, µs (slowest rank).
    pub time_us: f64,
    /// bytes / time, GB/s.
    pub algbw_gbps: f64,
    /// algbw × the collective's bus factor, GB/s.
    pub busbw_gbps: f64,
    /// Least memory traffic per second over the copy bandwidth (see the module docs).
    pub mem_ratio: f64,
    /// The copy bandwidth `mem_ratio` divides by, GB/s: on CPU ranks every rank's copy of its
    /// input to its output timed right after this row; on GPUs and XLA devices the machine's.
    pub copy_gbps: f64,
    /// Elements that differ from the reference (must be 0).
    pub errors: u64,
    /// The buffers came from `alloc_shared` (`--shared-buffers`).
    pub shared_buffers: bool,
    /// Bitwise-deterministic reductions (`--deterministic`, `TUTTI_DETERMINISTIC=1`).
    pub deterministic: bool,
}

/// Measure the copy bandwidth: a 256 MiB memcpy split across every core, best of six, counted
/// as bytes read plus bytes written per second (GB/s).
pub fn copy_gbps() -> f64 {
    const BYTES: usize = 256 << 20;
    let cores = device::host().cores.max(1);
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let part = BYTES.div_ceil(cores);
    let mut best = f64::MAX;
    for _ in 0..6 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, s_) in dst.chunks_mut(part).zip(src.chunks(part)) {
                s.spawn(move || d.copy_from_slice(s_));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * BYTES as f64 / best / 1e9
}

/// The machine line, with the copy bandwidth (and for process runs, the TCP rate) measured now.
pub fn machine(with_tcp: bool) -> Result<Machine> {
    let h = device::host();
    let tcp_gbps = if with_tcp { Some(tcp_gbps()?) } else { None };
    Ok(Machine {
        copy_gbps: copy_gbps(),
        cores: h.cores,
        cpu: h.cpu_model,
        memory_bytes: h.memory_total_bytes,
        tcp_gbps,
        gpu_copy_gbps: None,
    })
}

/// Full-duplex loopback TCP: two endpoints on two threads each send 64 MiB messages to the other
/// while receiving the other's, through non-blocking sockets with the transport's buffer sizes;
/// the best of three rounds, GB/s per direction.
pub fn tcp_gbps() -> Result<f64> {
    use std::io::{ErrorKind, Read, Write};
    const BYTES: usize = 64 << 20;
    let io = |e: std::io::Error| Error::io("measuring loopback TCP", e);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let a = std::net::TcpStream::connect(listener.local_addr().map_err(io)?).map_err(io)?;
    let (b, _) = listener.accept().map_err(io)?;
    for s in [&a, &b] {
        s.set_nodelay(true).map_err(io)?;
        let r = socket2::SockRef::from(s);
        r.set_send_buffer_size(4 << 20).map_err(io)?;
        r.set_recv_buffer_size(4 << 20).map_err(io)?;
        s.set_nonblocking(true).map_err(io)?;
    }
    let side = |mut s: &std::net::TcpStream| -> std::io::Result<f64> {
        let out = vec![1u8; BYTES];
        let mut inp = vec![0u8; BYTES];
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let (mut sent, mut got) = (0, 0);
            while sent < BYTES || got < BYTES {
                let mut moved = false;
                if sent < BYTES {
                    match s.write(&out[sent..]) {
                        Ok(n) => (sent, moved) = (sent + n, true),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                if got < BYTES {
                    match s.read(&mut inp[got..]) {
                        Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                        Ok(n) => (got, moved) = (got + n, true),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                if !moved {
                    let ev = if sent < BYTES {
                        libc::POLLIN | libc::POLLOUT
                    } else {
                        libc::POLLIN
                    };
                    let mut p = libc::pollfd {
                        fd: std::os::fd::AsRawFd::as_raw_fd(s),
                        events: ev,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut p, 1, 1000) };
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(BYTES as f64 / best / 1e9)
    };
    let (ra, rb) = std::thread::scope(|sc| {
        let h = sc.spawn(|| side(&b));
        (
            side(&a),
            h.join().unwrap_or_else(|_| Err(ErrorKind::Other.into())),
        )
    });
    Ok(ra.map_err(io)?.min(rb.map_err(io)?))
}

/// The sizes of a sweep: min, min·f, … up to max.
pub fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        if factor <= 1 {
            break;
        }
        s = s.saturating_mul(factor);
    }
    v
}

/// Parse a size: `1024`, `1K`, `64M`, `1G` (binary multiples).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("'{s}' is not a size (e.g. 1024, 4K, 64M, 1G)"))
}

/// Bus bandwidth factor, as nccl-tests (whose alltoall, gather and scatter tests use (n-1)/n;
/// the `-v` forms take their even form's).
pub fn bus_factor(c: Collective, n: usize) -> f64 {
    let n = n as f64;
    match c {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather
        | Collective::ReduceScatter
        | Collective::AllGatherV
        | Collective::ReduceScatterV
        | Collective::AllToAll
        | Collective::AllToAllV
        | Collective::Gather
        | Collective::Scatter => (n - 1.0) / n,
        Collective::Broadcast
        | Collective::Reduce
        | Collective::Barrier
        | Collective::Send
        | Collective::Recv
        | Collective::SendRecv => 1.0,
    }
}

/// Least bytes read plus written by a collective of size `bytes` over `n` ranks: every input
/// byte read once, every output byte written once.
pub fn min_traffic(c: Collective, n: usize, bytes: usize) -> f64 {
    let (n, s) = (n as f64, bytes as f64);
    match c {
        // Every rank reads S and writes S.
        Collective::AllReduce
        | Collective::AllToAll
        | Collective::AllToAllV
        | Collective::SendRecv => 2.0 * n * s,
        // One rank reads S, one writes S.
        Collective::Send | Collective::Recv => 2.0 * s,
        Collective::Broadcast => n * s,
        Collective::Reduce => (n + 1.0) * s,
        // S read in all (a share per rank), S written by every rank; or the reverse.
        Collective::AllGather
        | Collective::ReduceScatter
        | Collective::AllGatherV
        | Collective::ReduceScatterV => (n + 1.0) * s,
        // S read (a share per rank, or the root's), S written (the root's, or a share each).
        Collective::Gather | Collective::Scatter => 2.0 * s,
        Collective::Barrier => 0.0,
    }
}

/// The test pattern: element i of rank r. Period 5 in i, so the reference is five values.
pub fn pattern<T: Element>(r: usize, i: usize) -> T {
    T::from_f64(
        ((i * 7 + r * 3 + 1) % 5) as f64
            - if T::DTYPE.is_float() || signed(T::DTYPE) {
                2.0
            } else {
                0.0
            },
    )
}

fn signed(d: DType) -> bool {
    matches!(d, DType::I8 | DType::I32 | DType::I64)
}

/// Run the sweep on `opts.ranks` threads, calling `emit` with each row as it is measured.
pub fn run(opts: &Options, machine: &Machine, emit: &(dyn Fn(&Row) + Sync)) -> Result<Vec<Row>> {
    // CPU rows time their own copies (see the module docs); the machine's rate is the devices'.
    #[cfg(not(any(feature = "cuda", feature = "xla")))]
    let _ = machine;
    device_measures(opts.device, opts.collective)?;
    match opts.device {
        DeviceKind::Cpu => {}
        #[cfg(feature = "cuda")]
        DeviceKind::Gpu => {
            let algorithm = crate::gpu::GpuAlgorithm::from_core(opts.algorithm)?;
            let gbps = match machine.gpu_copy_gbps {
                Some(g) => g,
                None => crate::gpu::device_copy_gbps(0)?,
            };
            return gpu::run(opts, algorithm, gbps, emit);
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Gpu => {
            return Err(Error::Unavailable {
                what: "GPU".into(),
                why: "this build of tutti has no CUDA support".into(),
            })
        }
        #[cfg(feature = "xla")]
        DeviceKind::Xla => return xla::run(opts, machine, emit),
        #[cfg(not(feature = "xla"))]
        DeviceKind::Xla => {
            return Err(Error::Unavailable {
                what: "XLA".into(),
                why: "this build of tutti has no PJRT support".into(),
            })
        }
    }
    if opts.collective == Collective::Barrier {
        return Err(Error::config(
            "perf measures data collectives; barrier moves no bytes",
        ));
    }
    if opts.ranks == 0 {
        return Err(Error::config("perf needs at least one rank (-n)"));
    }
    let config = opts.config.clone().with_algorithm(opts.algorithm);
    let rows = run_local(opts.ranks, &config, |comm| run_on(comm, opts, emit))?;
    rows.into_iter().next().expect("at least one rank")
}

/// Run the sweep as this communicator's rank (every rank of the world calls it); rank 0 emits.
pub fn run_on(
    comm: &Communicator,
    opts: &Options,
    emit: &(dyn Fn(&Row) + Sync),
) -> Result<Vec<Row>> {
    if opts.device != DeviceKind::Cpu {
        return Err(Error::config(format!(
            "--device {}: a launched world measures CPU ranks; run perf for {} devices without a launcher",
            opts.device, opts.device
        )));
    }
    sweep(comm, opts, emit)
}

/// The sweep of `opts` on this rank's host buffers, over `comm` whatever its ranks' devices
/// (an XLA group's stage them to the devices per call); rank 0 emits.
fn sweep(comm: &Communicator, opts: &Options, emit: &(dyn Fn(&Row) + Sync)) -> Result<Vec<Row>> {
    opts.check_root(comm.world_size())?;
    if opts.placement != Placement::OutOfPlace && !has_in_place(opts.collective) {
        return Err(Error::config(format!(
            "--in-place: {} has no in-place form; it is measured out of place only",
            opts.collective.cli_name()
        )));
    }
    let mut rows = Vec::new();
    for bytes in sizes(opts.min_bytes, opts.max_bytes, opts.factor) {
        for &in_place in opts.placement.runs() {
            let opts = opts.run_of(in_place);
            let row = crate::for_each_dtype!(opts.dtype, T => {
                one_size::<T>(comm, &opts, bytes)?
            });
            if let Some(row) = row {
                if comm.rank() == 0 {
                    emit(&row);
                }
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// The elements of one size of a sweep: `count` in `bytes` (a multiple of the ranks where the
/// collective splits it, [`splits`]), and each rank's input and output lengths.
struct Shape {
    collective: Collective,
    ranks: usize,
    count: usize,
    /// all-gather-v and reduce-scatter-v: the count per rank ([`v_counts`]); all-to-all-v: what
    /// each rank sends each rank, a row per sender ([`pair_counts`]).
    counts: Vec<Vec<usize>>,
}

impl Shape {
    /// `None` when the size holds no element (per rank, where the collective splits it).
    fn of(c: Collective, ranks: usize, bytes: usize, dtype: DType) -> Option<Shape> {
        let mut count = bytes / dtype.size();
        if splits(c) {
            count -= count % ranks.max(1);
        }
        if count == 0 || ranks == 0 {
            return None;
        }
        let counts = match c {
            Collective::AllGatherV | Collective::ReduceScatterV => vec![v_counts(count, ranks)],
            Collective::AllToAllV => (0..ranks).map(|i| pair_counts(count, ranks, i)).collect(),
            _ => Vec::new(),
        };
        Some(Shape {
            collective: c,
            ranks,
            count,
            counts,
        })
    }

    /// Rank `r`'s input length. Every rank has a root's buffer in gather and scatter (used at
    /// the root only), so every rank copies alike for `mem_ratio`.
    fn in_len(&self, r: usize) -> usize {
        let (c, p) = (self.count, self.ranks);
        match self.collective {
            Collective::AllGather | Collective::Gather => c / p,
            Collective::AllGatherV => self.counts[0][r],
            _ => c,
        }
    }

    /// Rank `r`'s output length.
    fn out_len(&self, r: usize) -> usize {
        let (c, p) = (self.count, self.ranks);
        match self.collective {
            Collective::ReduceScatter | Collective::Scatter => c / p,
            Collective::ReduceScatterV => self.counts[0][r],
            Collective::AllToAllV => self.counts.iter().map(|row| row[r]).sum(),
            _ => c,
        }
    }

    /// The longest input and output of any rank: what a shared buffer holds on every rank
    /// (every rank allocates alike).
    fn caps(&self) -> (usize, usize) {
        (0..self.ranks).fold((0, 0), |(i, o), r| {
            (i.max(self.in_len(r)), o.max(self.out_len(r)))
        })
    }

    /// Rank `r`'s counts for the call: the count per rank (all-gather-v, reduce-scatter-v) or
    /// the counts it sends (all-to-all-v), and those it receives (all-to-all-v).
    fn counts_of(&self, r: usize) -> (Vec<usize>, Vec<usize>) {
        match self.collective {
            Collective::AllGatherV | Collective::ReduceScatterV => {
                (self.counts[0].clone(), Vec::new())
            }
            Collective::AllToAllV => (
                self.counts[r].clone(),
                self.counts.iter().map(|row| row[r]).collect(),
            ),
            _ => (Vec::new(), Vec::new()),
        }
    }
}

/// Rank `r`'s buffers on fresh data: the [`pattern`] as input; as output the pattern where the
/// call reads it (in place, the broadcast root), else zeros (an in-place all-gather: its own
/// slice only).
fn fresh<T: Element>(opts: &Options, shape: &Shape, r: usize) -> (Vec<T>, Vec<T>) {
    let c = opts.collective;
    let in_len = shape.in_len(r);
    let input = (0..in_len).map(|i| pattern(r, i)).collect();
    let mut output = vec![T::from_f64(0.0); shape.out_len(r)];
    if opts.in_place() && c == Collective::AllGather {
        let own = r * in_len;
        for i in 0..in_len {
            output[own + i] = pattern(r, i);
        }
    } else if opts.in_place() || (c == Collective::Broadcast && r == opts.root) {
        output
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = pattern(r, i));
    }
    (input, output)
}

/// One size of a sweep on some device, as the harness ([`measure`]) drives it: every device
/// kind's rows are timed and checked the same way.
trait Bench {
    /// One call on fresh data, then the elements that differ from the reference, summed over
    /// every rank (see [`wrong_elements`]).
    fn check(&mut self) -> Result<u64>;
    /// One timed call.
    fn call(&mut self) -> Result<()>;
    /// The iteration count every rank uses: rank 0's (where one process drives every rank,
    /// its own).
    fn agree(&mut self, iters: u64) -> Result<u64> {
        Ok(iters)
    }
    /// Wait for every rank before the timed calls.
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
    /// The slowest rank's seconds.
    fn slowest(&mut self, secs: f64) -> Result<f64> {
        Ok(secs)
    }
    /// Copy this rank's input into its output, the yardstick of `mem_ratio`; the bytes copied.
    /// Only benches whose row measures no bandwidth of its own are asked.
    fn copy(&mut self) -> usize {
        0
    }
    /// The bytes every rank copied, given this rank's (where one process drives every rank,
    /// `copied` by each of the `ranks`).
    fn all_copied(&mut self, copied: usize, ranks: usize) -> Result<usize> {
        Ok(copied * ranks)
    }
    /// What the last call ran as (see [`Row::ran`]).
    fn ran(&self) -> Option<String> {
        None
    }
}

/// What a row says besides its time.
struct RowOf<'a> {
    opts: &'a Options,
    algo: String,
    ranks: usize,
    dtype: DType,
    count: usize,
    /// The copy bandwidth that `mem_ratio` divides by, GB/s; `None`: time the bench's copies.
    bandwidth: Option<f64>,
}

/// Check `bench` once, then time it: warm up (caches, pages, the peers' pace), time a few calls
/// to choose the iteration count (about a quarter of a second, or `opts.iters`), warm up again
/// for a quarter of that (ranks that slept while rank 0 measured take a while to be back at full
/// speed), and time the iterations; the time is the slowest rank's mean. Where the row has no
/// bandwidth, the bench's copies are timed the same way next (see the module docs).
fn measure(bench: &mut dyn Bench, row: RowOf<'_>) -> Result<Row> {
    const WARM_UP: u32 = 5;
    let errors = bench.check()?;
    for _ in 0..WARM_UP {
        bench.call()?;
    }
    let t = Instant::now();
    for _ in 0..WARM_UP {
        bench.call()?;
    }
    let iters = bench.agree(row.opts.iters.unwrap_or_else(|| {
        let per = (t.elapsed() / WARM_UP).max(Duration::from_nanos(200));
        (Duration::from_millis(250).as_secs_f64() / per.as_secs_f64()).clamp(3.0, 20000.0) as usize
    }) as u64)?;
    for _ in 0..iters / 4 {
        bench.call()?;
    }
    bench.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        bench.call()?;
    }
    let elapsed = t.elapsed().as_secs_f64();
    let ran = bench.ran();
    let time = bench.slowest(elapsed)? / iters as f64;
    let copy_gbps = match row.bandwidth {
        Some(b) => b,
        None => {
            let mut copied = bench.copy();
            bench.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                copied = bench.copy();
            }
            let secs = bench.slowest(t.elapsed().as_secs_f64())? / iters as f64;
            // Ranks of a collective with a count per rank copy different amounts.
            let copied = bench.all_copied(copied, row.ranks)?;
            2.0 * copied as f64 / secs.max(1e-12) / 1e9
        }
    };
    let c = row.opts.collective;
    let bytes = row.count * row.dtype.size();
    let algbw = bytes as f64 / time / 1e9;
    Ok(Row {
        collective: c.cli_name().into(),
        algo: row.algo,
        ran,
        ranks: row.ranks,
        dtype: row.dtype.name().into(),
        op: if reduces(c) {
            row.opts.op.name().into()
        } else {
            "none".into()
        },
        root: row.opts.rooted(),
        in_place: row.opts.in_place(),
        bytes,
        count: row.count,
        time_us: time * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * bus_factor(c, row.ranks),
        mem_ratio: min_traffic(c, row.ranks, bytes) / time / 1e9 / copy_gbps,
        copy_gbps,
        errors,
        shared_buffers: row.opts.shared_buffers,
        deterministic: row.opts.config.deterministic,
    })
}

/// A CPU rank's buffer: heap memory, or a shared buffer (`Options::shared_buffers`).
enum HostBuf<T> {
    Heap(Vec<T>),
    Shared(crate::comm::SharedBuffer, usize),
}

impl<T: Element> HostBuf<T> {
    /// `data` in heap memory, or at the start of a shared buffer of `cap` elements (`cap` the
    /// same on every rank, which allocate together; at least `data.len()`).
    fn new(comm: &Communicator, shared: bool, data: Vec<T>, cap: usize) -> Result<HostBuf<T>> {
        if !shared {
            return Ok(HostBuf::Heap(data));
        }
        let mut b = comm.alloc_shared(cap.max(data.len()) * std::mem::size_of::<T>())?;
        b.as_mut_slice::<T>()[..data.len()].copy_from_slice(&data);
        Ok(HostBuf::Shared(b, data.len()))
    }
}

impl<T: Element> std::ops::Deref for HostBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            HostBuf::Heap(v) => v,
            HostBuf::Shared(b, n) => &b.as_slice()[..*n],
        }
    }
}

impl<T: Element> std::ops::DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            HostBuf::Heap(v) => v,
            HostBuf::Shared(b, n) => &mut b.as_mut_slice()[..*n],
        }
    }
}

/// This rank's side of a size on CPU ranks.
struct CpuBench<'a, T> {
    comm: &'a Communicator,
    opts: &'a Options,
    input: HostBuf<T>,
    output: HostBuf<T>,
    /// The row's count (see [`wrong_elements`]).
    count: usize,
    /// The counts of the collectives with a count per rank ([`Shape::counts_of`]), made once,
    /// not in the timed loop.
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
}

impl<T: Element> Bench for CpuBench<'_, T> {
    fn check(&mut self) -> Result<u64> {
        self.call()?;
        let (comm, opts) = (self.comm, self.opts);
        let (p, r) = (comm.world_size(), comm.rank());
        let shape = (opts.collective, opts.op, opts.root, p, r, self.count);
        let mine = wrong_elements_rounded(shape, rounded_in(comm, T::DTYPE), &self.output);
        let mut errors = [mine as u64];
        comm.all_reduce_auto(&mut errors, ReduceOp::Sum)?;
        Ok(errors[0])
    }
    fn call(&mut self) -> Result<()> {
        let counts = (&self.send_counts[..], &self.recv_counts[..]);
        run_once(self.comm, self.opts, &self.input, &mut self.output, counts)
    }
    fn agree(&mut self, iters: u64) -> Result<u64> {
        let mut v = [iters];
        self.comm.broadcast_auto(&mut v, 0)?;
        Ok(v[0])
    }
    fn barrier(&mut self) -> Result<()> {
        self.comm.barrier()
    }
    fn slowest(&mut self, secs: f64) -> Result<f64> {
        let mut v = [secs];
        self.comm.all_reduce_auto(&mut v, ReduceOp::Max)?;
        Ok(v[0])
    }
    fn copy(&mut self) -> usize {
        let n = self.input.len().min(self.output.len());
        self.output[..n].copy_from_slice(&self.input[..n]);
        std::hint::black_box(&mut self.output[..]);
        n * std::mem::size_of::<T>()
    }
    fn all_copied(&mut self, copied: usize, _ranks: usize) -> Result<usize> {
        let mut v = [copied as u64];
        self.comm.all_reduce_auto(&mut v, ReduceOp::Sum)?;
        Ok(v[0] as usize)
    }
    fn ran(&self) -> Option<String> {
        // The bench's own calls (agreeing on the iterations) run too: only the measured
        // collective's counts (point-to-point notes none).
        let c = self.opts.collective;
        self.comm
            .last_algorithm()
            .filter(|&(ran, _)| ran == c)
            .map(|(_, ran)| ran.to_string())
    }
}

fn one_size<T: Element>(comm: &Communicator, opts: &Options, bytes: usize) -> Result<Option<Row>> {
    let p = comm.world_size();
    let Some(shape) = Shape::of(opts.collective, p, bytes, T::DTYPE) else {
        return Ok(None);
    };
    let r = comm.rank();
    let (input, output) = fresh::<T>(opts, &shape, r);
    let (in_cap, out_cap) = shape.caps();
    let (send_counts, recv_counts) = shape.counts_of(r);
    let mut bench = CpuBench {
        comm,
        opts,
        input: HostBuf::new(comm, opts.shared_buffers, input, in_cap)?,
        output: HostBuf::new(comm, opts.shared_buffers, output, out_cap)?,
        count: shape.count,
        send_counts,
        recv_counts,
    };
    let row = RowOf {
        opts,
        algo: opts.algorithm.to_string(),
        ranks: p,
        dtype: T::DTYPE,
        count: shape.count,
        bandwidth: None,
    };
    measure(&mut bench, row).map(Some)
}

/// One call of the collective on this rank's buffers; `counts`: the send (or per rank) and
/// receive counts of the collectives with a count per rank.
fn run_once<T: Element>(
    comm: &Communicator,
    opts: &Options,
    input: &[T],
    output: &mut [T],
    counts: (&[usize], &[usize]),
) -> Result<()> {
    let (op, root, is_root) = (opts.op, opts.root, comm.rank() == opts.root);
    match (opts.collective, opts.in_place()) {
        (Collective::AllReduce, false) => comm.all_reduce_into(input, output, op),
        (Collective::AllReduce, true) => comm.all_reduce(output, op),
        (Collective::Broadcast, _) => comm.broadcast(output, root),
        (Collective::AllGather, false) => comm.all_gather(input, output),
        (Collective::AllGather, true) => comm.all_gather_in_place(output),
        (Collective::ReduceScatter, _) => comm.reduce_scatter(input, output, op),
        (Collective::Reduce, false) => {
            let out = (comm.rank() == root).then_some(output);
            comm.reduce(input, out, op, root)
        }
        (Collective::Reduce, true) => comm.reduce_in_place(output, op, root),
        (Collective::Barrier, _) => comm.barrier(),
        (Collective::AllToAll, false) => comm.all_to_all(input, output),
        (Collective::AllToAllV, false) => comm.all_to_all_v(input, counts.0, output, counts.1),
        (Collective::Gather, false) => comm.gather(input, is_root.then_some(output), root),
        (Collective::Scatter, false) => comm.scatter(is_root.then_some(input), output, root),
        (Collective::AllGatherV, false) => comm.all_gather_v(input, output, counts.0),
        (Collective::ReduceScatterV, false) => comm.reduce_scatter_v(input, output, counts.0, op),
        // nccl-tests' sendrecv: each rank sends to the next and receives from the previous.
        (Collective::SendRecv, false) => {
            let (r, p) = (comm.rank(), comm.world_size());
            comm.send_recv(&mut [
                crate::PeerOp::send(input, (r + 1) % p),
                crate::PeerOp::recv(output, (r + p - 1) % p),
            ])
        }
        (c @ (Collective::Send | Collective::Recv), _) => Err(Error::config(format!(
            "-c {}: measure point-to-point with -c send-recv",
            c.cli_name()
        ))),
        (
            c @ (Collective::AllToAll
            | Collective::AllToAllV
            | Collective::Gather
            | Collective::Scatter
            | Collective::AllGatherV
            | Collective::ReduceScatterV
            | Collective::SendRecv),
            true,
        ) => Err(Error::config(format!(
            "--in-place: {} has no in-place form",
            c.cli_name()
        ))),
    }
}

/// The elements of rank `rank`'s `output` that differ from the reference after one run of
/// `collective` with `op` (and `root`, for the rooted collectives) over `ranks` ranks whose
/// inputs are the test [`pattern`], in a row of `count` elements (see the module docs; the
/// counts per rank of the `-v` forms follow from it: [`v_counts`], [`pair_counts`]). The output
/// off the root of a reduce is not checked; off the root of a gather, which receives nothing,
/// it must still be the zeros it started as. An output of another length than the collective
/// writes counts every element it lacks or has too many. Shared by every device's harness.
pub fn wrong_elements<T: Element>(
    collective: Collective,
    op: ReduceOp,
    root: usize,
    ranks: usize,
    rank: usize,
    count: usize,
    output: &[T],
) -> usize {
    let shape = (collective, op, root, ranks, rank, count);
    wrong_elements_rounded(shape, T::DTYPE, output)
}

/// The type a reduction of `dtype` elements is rounded in on `comm`: the wire's for f32 on a
/// compressed wire ([`crate::Compression`]), else `dtype` itself.
pub(crate) fn rounded_in(comm: &Communicator, dtype: DType) -> DType {
    match comm.compression().wire_dtype() {
        Some(wire) if dtype == DType::F32 => wire,
        _ => dtype,
    }
}

/// [`wrong_elements`] with the tolerance of results rounded in `rounded` (see [`rounded_in`]).
fn wrong_elements_rounded<T: Element>(
    (collective, op, root, ranks, rank, count): (Collective, ReduceOp, usize, usize, usize, usize),
    rounded: DType,
    output: &[T],
) -> usize {
    let p = ranks.max(1);
    // The reduction of the pattern over every rank, for the five residues of i.
    let reduced: Vec<T> = (0..5)
        .map(|i| {
            let col: Vec<T> = (0..p).map(|k| pattern(k, i)).collect();
            let refs: Vec<&[T]> = col.iter().map(std::slice::from_ref).collect();
            reference::reduce(&refs, op)[0]
        })
        .collect();
    let tol = reference::tolerance(rounded, op, p, 2.0);
    let bad = |got: T, want: T| reference::count_errors(&[got], &[want], tol);
    // Every element against `want(i)`, and a length other than `len` counted as wrong.
    let check = |len: usize, want: &dyn Fn(usize) -> T| -> usize {
        output
            .iter()
            .take(len)
            .enumerate()
            .map(|(i, x)| bad(*x, want(i)))
            .sum::<usize>()
            + len.abs_diff(output.len())
    };
    let at = |base: usize| check(output.len(), &|i| reduced[(base + i) % 5]);
    // The block of `offsets` (P + 1 of them) that holds element i, and i's place in it.
    let block = |offsets: &[usize], i: usize| {
        let k = offsets.partition_point(|&o| o <= i) - 1;
        (k, i - offsets[k])
    };
    // (At least 1: a count below the ranks is no row, but must not divide by zero here.)
    let block_len = (count / p).max(1);
    match collective {
        Collective::AllReduce => at(0),
        Collective::Reduce if rank != root => 0,
        Collective::Reduce => at(0),
        Collective::Broadcast => check(output.len(), &|i| pattern(root, i)),
        Collective::AllGather => {
            let n = output.len() / p;
            check(output.len(), &|i| pattern(i / n, i % n))
        }
        Collective::ReduceScatter => at(rank * output.len()),
        Collective::Barrier => 0,
        // Block k of the output is block `rank` of rank k's input.
        Collective::AllToAll => check(count, &|i| {
            pattern(i / block_len, rank * block_len + i % block_len)
        }),
        // From rank k: c(k, rank) elements, from where rank k's block for this rank starts.
        Collective::AllToAllV => {
            let rows: Vec<Vec<usize>> = (0..p).map(|k| pair_counts(count, p, k)).collect();
            let from: Vec<usize> = rows.iter().map(|row| row[..rank].iter().sum()).collect();
            let recv = offsets(&rows.iter().map(|row| row[rank]).collect::<Vec<_>>());
            check(recv[p], &|i| {
                let (k, j) = block(&recv, i);
                pattern(k, from[k] + j)
            })
        }
        Collective::Gather if rank != root => check(count, &|_| T::from_f64(0.0)),
        Collective::Gather => check(count, &|i| pattern(i / block_len, i % block_len)),
        // This rank's block of the root's input.
        Collective::Scatter => check(block_len, &|i| pattern(root, rank * block_len + i)),
        Collective::AllGatherV => {
            let o = offsets(&v_counts(count, p));
            check(count, &|i| {
                let (k, j) = block(&o, i);
                pattern(k, j)
            })
        }
        Collective::ReduceScatterV => {
            let o = offsets(&v_counts(count, p));
            let base = o[rank.min(p - 1)];
            check(o[rank.min(p - 1) + 1] - base, &|i| reduced[(base + i) % 5])
        }
        // The previous rank's input.
        Collective::SendRecv => check(count, &|i| pattern((rank + p - 1) % p, i)),
        Collective::Send | Collective::Recv => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The collectives with no in-place form, each measured out of place.
    const NEW: [Collective; 6] = [
        Collective::AllToAll,
        Collective::AllToAllV,
        Collective::Gather,
        Collective::Scatter,
        Collective::AllGatherV,
        Collective::ReduceScatterV,
    ];

    #[test]
    fn uneven_counts_sum_to_the_count_and_differ() {
        for p in 1..=5 {
            for count in [0, 1, 2, 7, 100, 12345, 1 << 24] {
                let v = v_counts(count, p);
                assert_eq!(
                    (v.len(), v.iter().sum::<usize>()),
                    (p, count),
                    "{p} {count}"
                );
                let rows: Vec<Vec<usize>> = (0..p).map(|i| pair_counts(count, p, i)).collect();
                for row in &rows {
                    assert_eq!((row.len(), row.iter().sum::<usize>()), (p, count));
                }
                // Each rank receives about what it sends (a rounding per sender off).
                for j in 0..p {
                    let got: usize = rows.iter().map(|row| row[j]).sum();
                    assert!(got.abs_diff(count) <= p, "{p} {count}: rank {j} gets {got}");
                }
                if p > 1 && count >= 100 {
                    // Uneven: the last rank holds the most, the pairs of a rank differ.
                    assert!(v[p - 1] > v[0], "{v:?}");
                    assert!(rows[0].iter().any(|&c| c != rows[0][0]), "{rows:?}");
                }
            }
        }
    }

    #[test]
    fn bus_factors_and_least_traffic_follow_nccl_tests() {
        let s = 1000;
        for c in NEW {
            assert_eq!(bus_factor(c, 4), 0.75, "{c}");
            assert_eq!(bus_factor(c, 1), 0.0, "{c}");
        }
        for c in [Collective::AllToAll, Collective::AllToAllV] {
            assert_eq!(min_traffic(c, 4, s), 8000.0);
        }
        for c in [Collective::Gather, Collective::Scatter] {
            assert_eq!(min_traffic(c, 4, s), 2000.0);
        }
        for c in [Collective::AllGatherV, Collective::ReduceScatterV] {
            assert_eq!(
                min_traffic(c, 4, s),
                min_traffic(Collective::AllGather, 4, s)
            );
        }
    }

    /// A real call of each collective on 1-3 threads, from the first and the last root: no
    /// element of any rank's output is wrong, and one changed element (scatter's ranks off
    /// the root and gather's untouched outputs included) or a missing one is one wrong element.
    #[test]
    fn the_check_reads_every_value_of_every_rank() {
        let op = ReduceOp::Sum;
        for c in NEW {
            for p in 1..=3 {
                for root in [0, p - 1] {
                    for bytes in [8, 4 * 30, 4 * 1001] {
                        let opts = Options {
                            collective: c,
                            ranks: p,
                            root,
                            placement: Placement::OutOfPlace,
                            ..Options::default()
                        };
                        let Some(shape) = Shape::of(c, p, bytes, DType::I32) else {
                            assert!(splits(c) && bytes / 4 < p);
                            continue;
                        };
                        let outs = run_local(p, &Config::default(), |comm| {
                            let r = comm.rank();
                            let (input, mut output) = fresh::<i32>(&opts, &shape, r);
                            let (send, recv) = shape.counts_of(r);
                            run_once(comm, &opts, &input, &mut output, (&send, &recv))
                                .map(|()| output)
                        })
                        .unwrap();
                        let at = format!("{c} on {p} ranks, root {root}, {bytes} bytes");
                        for (r, out) in outs.into_iter().enumerate() {
                            let out = out.unwrap();
                            let wrong =
                                |o: &[i32]| wrong_elements(c, op, root, p, r, shape.count, o);
                            assert_eq!(wrong(&out), 0, "{at}: rank {r}: {out:?}");
                            for i in [0, out.len() / 2, out.len().saturating_sub(1)] {
                                let Some(&x) = out.get(i) else { continue };
                                let mut bad = out.clone();
                                bad[i] = x + 7;
                                assert_eq!(wrong(&bad), 1, "{at}: rank {r}, element {i}");
                            }
                            if let Some((_, short)) = out.split_last() {
                                assert_eq!(wrong(short), 1, "{at}: rank {r}, one short");
                            }
                        }
                    }
                }
            }
        }
    }

    fn machine() -> Machine {
        Machine {
            copy_gbps: 1.0,
            cores: 2,
            cpu: String::new(),
            memory_bytes: 0,
            tcp_gbps: None,
            gpu_copy_gbps: None,
        }
    }

    /// The sweep on 1-3 threads, on heap and shared buffers: a row per size, none wrong, with
    /// the collective's op (or none) and root (or none).
    #[test]
    fn sweeps_of_each_collective_check_every_row() {
        for c in NEW {
            for p in 1..=3 {
                for shared_buffers in [false, true] {
                    let opts = Options {
                        collective: c,
                        ranks: p,
                        root: p - 1,
                        min_bytes: 8,
                        max_bytes: 64 << 10,
                        factor: 32,
                        iters: Some(2),
                        shared_buffers,
                        placement: Placement::OutOfPlace,
                        ..Options::default()
                    };
                    let rows = run(&opts, &machine(), &|_| {}).unwrap();
                    let want = if splits(c) && p == 3 { 2 } else { 3 };
                    assert_eq!(rows.len(), want, "{c} on {p}: {rows:?}");
                    for row in rows {
                        assert_eq!(row.errors, 0, "{c} on {p}: {row:?}");
                        assert_eq!(row.op, if reduces(c) { "sum" } else { "none" });
                        assert_eq!(row.root, rooted(c).then_some(p - 1));
                        assert!(row.mem_ratio.is_finite() && row.mem_ratio > 0.0, "{row:?}");
                        let f = bus_factor(c, p);
                        assert!(
                            (row.busbw_gbps - row.algbw_gbps * f).abs() < 1e-9,
                            "{row:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn what_perf_cannot_measure_is_refused_before_it_runs() {
        for c in NEW {
            // GPUs measure what their groups run (tests/gpu.rs); XLA devices every collective
            // (tests/xla.rs runs them).
            if crate::engine::cuda_runs(c) {
                assert!(device_measures(DeviceKind::Gpu, c).is_ok(), "{c}");
            } else {
                let opts = Options {
                    collective: c,
                    device: DeviceKind::Gpu,
                    ..Options::default()
                };
                let e = run(&opts, &machine(), &|_| {}).unwrap_err().to_string();
                let name = c.cli_name();
                assert!(
                    e.contains(&format!("-c {name} --device gpu: not available on")),
                    "{e}"
                );
            }
            let opts = Options {
                collective: c,
                ranks: 2,
                placement: Placement::Both,
                ..Options::default()
            };
            let e = run(&opts, &machine(), &|_| {}).unwrap_err().to_string();
            assert!(e.contains("has no in-place form"), "{e}");
        }
    }
}
