//! The harness behind `tutti perf`: sizes × one collective, timed and checked, like nccl-tests.
//!
//! For each size every rank runs the collective once on fresh data and counts the elements that
//! differ from the reference, then the timed iterations follow (their number chosen by rank 0 from
//! a warm-up so each size takes about a quarter of a second). The time of a size is the slowest
//! rank's mean per iteration.
//!
//! Sizes follow nccl-tests: `bytes` is the buffer of all-reduce, broadcast and reduce, the whole
//! output of all-gather and the whole input of reduce-scatter. `algbw = bytes / time`; `busbw`
//! scales it by 2(n-1)/n (all-reduce), (n-1)/n (all-gather, reduce-scatter) or 1 (broadcast,
//! reduce). `mem_ratio` divides the least memory traffic the collective needs (every input byte
//! read once and every output byte written once: all-reduce 2·n·S) per second by a copy
//! bandwidth measured like the collective: on CPU ranks, right after a size is timed, every rank
//! copies its input into its output at once, as many times as the collective ran, and the rate
//! is the bytes read and written by all of them over the slowest rank's mean time (for an
//! all-reduce, `mem_ratio` is the copies' time over the collective's). The machine's best copy
//! rate (the header line) is no yardstick on a shared host: it swings by 2x from one second to
//! the next, and a mean compared with a best says more about the noise than about tutti.
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
pub use check::check;
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
    /// The root of broadcast and reduce.
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
        matches!(self.collective, Collective::Broadcast | Collective::Reduce).then_some(self.root)
    }
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
    /// Ranks.
    pub ranks: usize,
    /// Element type.
    pub dtype: String,
    /// Reduce op (`none` for broadcast and all-gather).
    pub op: String,
    /// The root (broadcast and reduce).
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

/// Bus bandwidth factor, as nccl-tests.
pub fn bus_factor(c: Collective, n: usize) -> f64 {
    let n = n as f64;
    match c {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Least bytes read plus written by a collective of size `bytes` over `n` ranks.
pub fn min_traffic(c: Collective, n: usize, bytes: usize) -> f64 {
    let (n, s) = (n as f64, bytes as f64);
    match c {
        Collective::AllReduce => 2.0 * n * s,
        Collective::Broadcast => n * s,
        Collective::Reduce => (n + 1.0) * s,
        Collective::AllGather | Collective::ReduceScatter => (n + 1.0) * s,
        Collective::Barrier => 0.0,
        _ => 0.0,
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
    opts.check_root(comm.world_size())?;
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
/// collective splits it), and each rank's input and output lengths.
struct Shape {
    count: usize,
    in_len: usize,
    out_len: usize,
}

impl Shape {
    /// `None` when the size holds no element (per rank, for all-gather and reduce-scatter).
    fn of(c: Collective, ranks: usize, bytes: usize, dtype: DType) -> Option<Shape> {
        let mut count = bytes / dtype.size();
        if matches!(c, Collective::AllGather | Collective::ReduceScatter) {
            count -= count % ranks;
        }
        if count == 0 {
            return None;
        }
        let (in_len, out_len) = match c {
            Collective::AllGather => (count / ranks, count),
            Collective::ReduceScatter => (count, count / ranks),
            _ => (count, count),
        };
        Some(Shape {
            count,
            in_len,
            out_len,
        })
    }
}

/// Rank `r`'s buffers on fresh data: the [`pattern`] as input; as output the pattern where the
/// call reads it (in place, the broadcast root), else zeros (an in-place all-gather: its own
/// slice only).
fn fresh<T: Element>(opts: &Options, shape: &Shape, r: usize) -> (Vec<T>, Vec<T>) {
    let c = opts.collective;
    let input = (0..shape.in_len).map(|i| pattern(r, i)).collect();
    let mut output = vec![T::from_f64(0.0); shape.out_len];
    if opts.in_place() && c == Collective::AllGather {
        let own = r * shape.in_len;
        for i in 0..shape.in_len {
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
    let time = bench.slowest(t.elapsed().as_secs_f64())? / iters as f64;
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
            2.0 * (copied * row.ranks) as f64 / secs.max(1e-12) / 1e9
        }
    };
    let c = row.opts.collective;
    let bytes = row.count * row.dtype.size();
    let algbw = bytes as f64 / time / 1e9;
    Ok(Row {
        collective: c.cli_name().into(),
        algo: row.algo,
        ranks: row.ranks,
        dtype: row.dtype.name().into(),
        op: if matches!(c, Collective::Broadcast | Collective::AllGather) {
            "none".into()
        } else {
            row.opts.op.name().into()
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
    })
}

/// A CPU rank's buffer: heap memory, or a shared buffer (`Options::shared_buffers`).
enum HostBuf<T> {
    Heap(Vec<T>),
    Shared(crate::comm::SharedBuffer, usize),
}

impl<T: Element> HostBuf<T> {
    fn new(comm: &Communicator, shared: bool, data: Vec<T>) -> Result<HostBuf<T>> {
        if !shared {
            return Ok(HostBuf::Heap(data));
        }
        let mut b = comm.alloc_shared(std::mem::size_of_val(&data[..]))?;
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
}

impl<T: Element> Bench for CpuBench<'_, T> {
    fn check(&mut self) -> Result<u64> {
        self.call()?;
        let (comm, opts) = (self.comm, self.opts);
        let (p, r) = (comm.world_size(), comm.rank());
        let mine = wrong_elements(opts.collective, opts.op, opts.root, p, r, &self.output);
        let mut errors = [mine as u64];
        comm.all_reduce_auto(&mut errors, ReduceOp::Sum)?;
        Ok(errors[0])
    }
    fn call(&mut self) -> Result<()> {
        run_once(self.comm, self.opts, &self.input, &mut self.output)
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
}

fn one_size<T: Element>(comm: &Communicator, opts: &Options, bytes: usize) -> Result<Option<Row>> {
    let p = comm.world_size();
    let Some(shape) = Shape::of(opts.collective, p, bytes, T::DTYPE) else {
        return Ok(None);
    };
    let (input, output) = fresh::<T>(opts, &shape, comm.rank());
    let mut bench = CpuBench {
        comm,
        opts,
        input: HostBuf::new(comm, opts.shared_buffers, input)?,
        output: HostBuf::new(comm, opts.shared_buffers, output)?,
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

fn run_once<T: Element>(
    comm: &Communicator,
    opts: &Options,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    let (op, root) = (opts.op, opts.root);
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
        (c, _) => Err(crate::Error::config(format!(
            "perf does not measure {c} yet"
        ))),
    }
}

/// The elements of rank `rank`'s `output` that differ from the reference after one run of
/// `collective` with `op` (and `root`, for broadcast and reduce) over `ranks` ranks whose inputs
/// are the test [`pattern`] (the output off the root of a reduce is not checked). Shared by
/// every device's harness.
pub fn wrong_elements<T: Element>(
    collective: Collective,
    op: ReduceOp,
    root: usize,
    ranks: usize,
    rank: usize,
    output: &[T],
) -> usize {
    let p = ranks;
    // The reduction of the pattern over every rank, for the five residues of i.
    let reduced: Vec<T> = (0..5)
        .map(|i| {
            let col: Vec<T> = (0..p).map(|k| pattern(k, i)).collect();
            let refs: Vec<&[T]> = col.iter().map(std::slice::from_ref).collect();
            reference::reduce(&refs, op)[0]
        })
        .collect();
    let tol = reference::tolerance(T::DTYPE, op, p, 2.0);
    let bad = |got: T, want: T| reference::count_errors(&[got], &[want], tol);
    let at = |base: usize| {
        output
            .iter()
            .enumerate()
            .map(|(i, x)| bad(*x, reduced[(base + i) % 5]))
            .sum()
    };
    match collective {
        Collective::AllReduce => at(0),
        Collective::Reduce if rank != root => 0,
        Collective::Reduce => at(0),
        Collective::Broadcast => output
            .iter()
            .enumerate()
            .map(|(i, x)| bad(*x, pattern(root, i)))
            .sum(),
        Collective::AllGather => {
            let n = output.len() / p;
            output
                .iter()
                .enumerate()
                .map(|(i, x)| bad(*x, pattern(i / n, i % n)))
                .sum()
        }
        Collective::ReduceScatter => at(rank * output.len()),
        Collective::Barrier => 0,
        _ => output.len(),
    }
}
