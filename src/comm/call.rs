//! One call as this rank issues it: the local checks of every collective's arguments, the
//! buffers as raw parts, and what runs once the ranks have met (the host algorithms, or a
//! group engine).

use super::work::{Runnable, Shared};
use super::{Communicator, RawCall};
use crate::algorithm::{self, Algorithm, Ctx, Plan};
use crate::device::DeviceTensor;
use crate::dtype::{Apply, DType, ReduceOp};
use crate::engine::{GroupCall, GroupEngine, StreamMark};
use crate::error::{Collective, Error, Result, Site};
use crate::transport::{CallBuffers, CallHeader, Held, NativeCall, Transport};

/// Leaves the call on every exit, a panic included, so that peers never read freed memory.
struct CallGuard<'a> {
    transport: &'a dyn Transport,
    rank: usize,
    failed: Option<Error>,
    finished: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.failed = Some(Error::Aborted {
                rank: self.rank,
                reason: "a panic inside a collective".to_string(),
            });
        }
        self.transport.end(self.failed.as_ref());
    }
}

/// One call, checked on this rank when it is issued; its buffers as raw parts, which the
/// issuer keeps valid until the call completes (a blocking call by waiting, a safe
/// non-blocking one by owning them, an unsafe one by its caller's promise).
pub(super) struct Call {
    collective: Collective,
    rank: usize,
    dtype: DType,
    pub(super) count: usize,
    op: Option<ReduceOp>,
    root: Option<usize>,
    algorithm: Algorithm,
    pub(super) check: std::result::Result<(), String>,
    buffers: CallBuffers,
    /// The input is the output (`input` of the collective's body is `None`).
    in_place: bool,
    /// Where each rank's block lies, in elements, for the collectives with a count per rank:
    /// P + 1 offsets (all_gather_v: of the output; reduce_scatter_v: of the input), or for
    /// all_to_all_v those of the input, then those of the output. Empty for the others.
    offsets: Vec<usize>,
    /// The digest of the count per rank that every rank must agree on ([`Collective::has_counts`]).
    counts: Option<u64>,
    /// The mark of the call on the caller's stream (`buffers.after` and `end`), held
    /// until the call completes.
    _after: Option<Box<dyn StreamMark>>,
}

impl Call {
    /// The 16-bit type this call's f32 ring carries on the wire ([`crate::Compression`]): only
    /// for all-reduce and reduce-scatter of f32, on the host algorithms, where some peer is
    /// over TCP. Every rank decides alike (the header check compares the setting).
    fn wire(&self, shared: &Shared) -> Option<DType> {
        let reduction = matches!(
            self.collective,
            Collective::AllReduce | Collective::ReduceScatter | Collective::ReduceScatterV
        );
        let carried = reduction
            && self.dtype == DType::F32
            && shared.engine.is_none()
            && shared.transport.over_network();
        shared.compression.wire_dtype().filter(|_| carried)
    }

    /// The call with another algorithm (for calls a communicator makes for itself, which must
    /// not depend on the algorithm its user chose).
    pub(super) fn with_algorithm(mut self, algorithm: Algorithm) -> Call {
        self.algorithm = algorithm;
        self
    }

    /// Make the call's device work wait for `mark`, and the caller's stream for the call.
    pub(super) fn wait_for(&mut self, mark: Box<dyn StreamMark>) {
        self.buffers.after = mark.raw();
        self.buffers.end = mark.end();
        self._after = Some(mark);
    }

    /// True when the call runs on a caller's stream (it was given a mark).
    pub(super) fn on_stream(&self) -> bool {
        self._after.is_some()
    }

    /// The mark, once the call ran: its device work's handle holds it from then on.
    pub(super) fn take_mark(&mut self) -> Option<Box<dyn StreamMark>> {
        self._after.take()
    }
}

/// The device work of a call that ran on a caller's stream: the engine waits for its end
/// event. Past the call's deadline the communicator is aborted too, so that the peers, whose
/// later calls would wait for this rank, hear why.
pub(super) struct OnStream {
    pub(super) engine: std::sync::Arc<dyn GroupEngine>,
    pub(super) transport: std::sync::Arc<dyn Transport>,
    pub(super) mark: Box<dyn StreamMark>,
    pub(super) site: Site,
    pub(super) deadline: std::time::Instant,
}

impl super::work::DeviceWork for OnStream {
    fn wait(&self, until: Option<std::time::Instant>) -> Result<bool> {
        let until = until.unwrap_or(self.deadline);
        let r =
            self.engine
                .stream_done(self.site, self.site.rank, &*self.mark, until, self.deadline);
        if let Err(e) = &r {
            self.transport
                .abort(&format!("rank {}: {e}", self.site.rank));
        }
        r
    }
}

/// A slice from raw parts that may be empty. An empty one is made at a dangling address
/// aligned for every element type (kernels cast even empty slices to elements), not at `ptr`,
/// which may be NULL: a buffer a rank does not pass (scatter's input and gather's output off
/// the root) is NULL with length 0, and `from_raw_parts` needs a non-null pointer even then.
///
/// # Safety
///
/// `ptr` is valid for `len` bytes for the life the caller picks.
unsafe fn raw<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        // SAFETY: zero bytes at a non-null, aligned address.
        return unsafe { std::slice::from_raw_parts(empty(), 0) };
    }
    // SAFETY: as the caller promises.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// A non-null address aligned for every element type, for empty slices.
fn empty() -> *mut u8 {
    std::ptr::NonNull::<u128>::dangling().as_ptr().cast()
}

/// # Safety
///
/// As [`raw`], and nothing else reads or writes the bytes meanwhile.
unsafe fn raw_mut<'a>(ptr: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        // SAFETY: zero bytes at a non-null, aligned address.
        return unsafe { std::slice::from_raw_parts_mut(empty(), 0) };
    }
    // SAFETY: as the caller promises.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}

/// A buffer by address and length in bytes: a borrowed slice's parts, or memory Rust cannot
/// borrow (a device's, a C caller's). Its methods mirror a slice's.
#[derive(Copy, Clone)]
pub(super) struct Bytes {
    ptr: *const u8,
    len: usize,
}

impl Bytes {
    pub(super) fn of(s: &[u8]) -> Bytes {
        Bytes {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }
    fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A writable [`Bytes`].
#[derive(Copy, Clone)]
pub(super) struct BytesMut {
    ptr: *mut u8,
    len: usize,
}

impl BytesMut {
    pub(super) fn of(s: &mut [u8]) -> BytesMut {
        BytesMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }
    fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Call {
    /// The algorithm's part of the call, over the buffers the issuer published.
    fn body(&self, ctx: &Ctx<'_>) -> Result<()> {
        let b = self.buffers;
        if self.algorithm == Algorithm::Mpi {
            // MPI's own collective where it has this one (reductions in rank order are tutti's
            // promise alone: deterministic calls run the algorithms).
            let reduces = matches!(
                self.collective,
                Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter
            );
            if !(ctx.deterministic && reduces) {
                let call = NativeCall {
                    collective: self.collective,
                    dtype: self.dtype,
                    op: self.op,
                    root: self.root.unwrap_or(0),
                    buffers: b,
                };
                if let Some(done) = ctx.t.native(ctx.site, &call) {
                    ctx.ran("mpi");
                    return done;
                }
            }
        }
        let algo = match self.algorithm {
            Algorithm::Mpi => Algorithm::Auto,
            a => a,
        };
        // SAFETY: the buffers are valid and untouched by the caller until the call completes
        // (see `Call`); input and output are distinct unless the call is in place, when the
        // input is not formed.
        unsafe {
            // Scatter off the root has no input (null), gather off the root no output.
            let input = (!self.in_place && !b.input.is_null()).then(|| raw(b.input, b.input_len));
            match self.collective {
                Collective::AllReduce => {
                    algorithm::all_reduce(ctx, algo, input, raw_mut(b.output, b.output_len))
                }
                Collective::Broadcast => algorithm::broadcast(
                    ctx,
                    algo,
                    self.root.unwrap_or(0),
                    raw_mut(b.output, b.output_len),
                ),
                Collective::AllGather | Collective::AllGatherV => algorithm::all_gather(
                    ctx,
                    algo,
                    input,
                    raw_mut(b.output, b.output_len),
                    self.blocks(0, b.output_len),
                ),
                Collective::ReduceScatter | Collective::ReduceScatterV => {
                    algorithm::reduce_scatter(
                        ctx,
                        algo,
                        raw(b.input, b.input_len),
                        raw_mut(b.output, b.output_len),
                        self.blocks(0, b.input_len),
                    )
                }
                Collective::AllToAll | Collective::AllToAllV => {
                    let p = ctx.world();
                    algorithm::all_to_all(
                        ctx,
                        algo,
                        raw(b.input, b.input_len),
                        self.blocks(0, b.input_len),
                        raw_mut(b.output, b.output_len),
                        self.blocks(p + 1, b.output_len),
                    )
                }
                Collective::Gather => {
                    let output = (!b.output.is_null()).then(|| raw_mut(b.output, b.output_len));
                    let input = raw(b.input, b.input_len);
                    algorithm::gather(ctx, algo, self.root.unwrap_or(0), input, output)
                }
                Collective::Scatter => {
                    let input = (!b.input.is_null()).then(|| raw(b.input, b.input_len));
                    let output = raw_mut(b.output, b.output_len);
                    algorithm::scatter(ctx, algo, self.root.unwrap_or(0), input, output)
                }
                Collective::Reduce => {
                    let output = (!b.output.is_null()).then(|| raw_mut(b.output, b.output_len));
                    algorithm::reduce(
                        ctx,
                        algo,
                        self.root.unwrap_or(0),
                        input,
                        output,
                        b.input_len,
                    )
                }
                Collective::Barrier => Ok(()),
                // Refused when the call was made (see `raw_call_of`).
                Collective::Send | Collective::Recv | Collective::SendRecv => Ok(()),
            }
        }
    }
}

impl Call {
    /// The blocks of a buffer of `len` bytes: from the offsets at `from` where the call has
    /// a count per rank, else cut evenly.
    fn blocks(&self, from: usize, len: usize) -> algorithm::Blocks<'_> {
        // One list of P + 1 offsets, or all_to_all_v's two.
        let n = match self.collective {
            Collective::AllToAllV => self.offsets.len() / 2,
            _ => self.offsets.len(),
        };
        match self.offsets.get(from..from + n) {
            Some(o) if !o.is_empty() => algorithm::Blocks::At(o),
            _ => algorithm::Blocks::Even(len / self.dtype.size()),
        }
    }

    /// A group engine's part: rank 0 runs the call once over every rank's published buffers;
    /// the others wait until it has (the transport bounds the wait and carries aborts).
    fn group_body(&self, ctx: &Ctx<'_>, engine: &dyn GroupEngine) -> Result<()> {
        // An engine's error comes after the ranks met: whatever its kind, the others must not
        // wait for this rank, and they should hear why (the transport carries the reason).
        let failed = |e: Error| {
            ctx.t.abort(&format!(
                "rank {} could not run {}: {e}",
                ctx.rank(),
                ctx.site
            ));
            e
        };
        if engine.per_rank() {
            // Every rank runs its own part; the engine's own group meets the ranks.
            return engine
                .run(ctx.site, &self.group_call(ctx), &[self.published()])
                .map_err(failed);
        }
        let pm = ctx.peer_memory("a device group")?;
        // Group engines make the only progress values of their transport: one per call,
        // increasing with the call number.
        let done = ctx.site.call + 1;
        if ctx.rank() != 0 {
            return pm.wait_progress(ctx.site, 0, done, "run the call on the group's devices");
        }
        let mut bufs = ctx.plan.list::<CallBuffers>();
        bufs.extend((0..ctx.world()).map(|k| {
            if k == 0 {
                self.published()
            } else {
                pm.buffers(k)
            }
        }));
        engine
            .run(ctx.site, &self.group_call(ctx), &bufs)
            .map_err(failed)?;
        pm.set_progress(done);
        Ok(())
    }
}

impl Call {
    /// The call with `input` and `held` in place of its own (a call on tensors whose input is
    /// something else the engine takes, as [`Held`] says).
    #[cfg(feature = "xla")]
    pub(super) fn holding(mut self, input: *const u8, held: Held) -> Call {
        self.buffers.input = input;
        self.buffers.held = held;
        self
    }
}

impl Call {
    /// This rank's buffers as it publishes them for the call: with its block offsets, which a
    /// group engine reads (rank 0 runs the call for every rank).
    fn published(&self) -> CallBuffers {
        CallBuffers {
            offsets: self.offsets.as_ptr(),
            offsets_len: self.offsets.len(),
            ..self.buffers
        }
    }

    fn group_call(&self, ctx: &Ctx<'_>) -> GroupCall {
        GroupCall {
            collective: self.collective,
            dtype: self.dtype,
            count: self.count,
            op: self.op.unwrap_or(ReduceOp::Sum),
            root: self.root.unwrap_or(0),
            deterministic: ctx.deterministic,
        }
    }
}

impl Runnable for Call {
    fn site(&self, number: u64) -> Site {
        Site {
            collective: self.collective,
            rank: self.rank,
            call: number,
        }
    }

    fn run(&self, shared: &Shared, number: u64, plan: &Plan) -> Result<()> {
        let site = self.site(number);
        let transport = &*shared.transport;
        let mut guard = CallGuard {
            transport,
            rank: self.rank,
            failed: None,
            finished: false,
        };
        let (tuning, digest) = *shared.tuning.lock();
        let header = CallHeader {
            call: number,
            collective: self.collective,
            dtype: self.dtype,
            count: self.count,
            op: self.op,
            root: self.root,
            counts: self.counts,
            algorithm: self.algorithm,
            chunk_bytes: shared.chunk_bytes as u64,
            full_check: shared.full_check,
            deterministic: shared.deterministic,
            compression: shared.compression,
            tuning: digest,
            rejected: self.check.clone().err(),
        };
        let buffers = if self.check.is_ok() {
            self.published()
        } else {
            CallBuffers::NONE
        };
        let tracer = crate::trace::tracer();
        if let Some(t) = tracer {
            t.begin(
                site,
                self.dtype,
                self.count.saturating_mul(self.dtype.size()),
                self.algorithm,
            );
        }
        let begun = transport.begin(site, &header, buffers);
        let result = match (&self.check, begun) {
            (Err(message), _) => Err(Error::invalid(site, message.clone())),
            (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(())) => {
                let ctx = Ctx {
                    t: transport,
                    site,
                    dtype: self.dtype,
                    op: self.op.unwrap_or(ReduceOp::Sum),
                    chunk_bytes: shared.chunk_bytes,
                    deterministic: shared.deterministic,
                    wire: self.wire(shared),
                    tuning,
                    layout: shared.layout,
                    plan,
                };
                match &shared.engine {
                    None => {
                        plan.take_ran();
                        let done = self.body(&ctx);
                        if let (Ok(()), Some(ran)) = (&done, plan.take_ran()) {
                            *shared.ran.lock() = Some((self.collective, ran));
                        }
                        done
                    }
                    Some(engine) => self.group_body(&ctx, &**engine),
                }
            }
        };
        guard.failed = result.as_ref().err().cloned();
        guard.finished = true;
        if let Some(t) = tracer {
            t.end(site, &result);
        }
        result
    }
}

fn elems(dtype: DType, name: &str, len: usize) -> std::result::Result<usize, String> {
    if len % dtype.size() != 0 {
        return Err(format!(
            "{name} holds {len} bytes, not a whole number of {dtype} elements"
        ));
    }
    Ok(len / dtype.size())
}

/// Every buffer of a call of `count` elements (per rank) must be aligned for its element type
/// (the kernels read typed slices); with no elements, any address will do.
fn aligned(
    dtype: DType,
    count: usize,
    bufs: &[(&str, *const u8)],
) -> std::result::Result<(), String> {
    if count == 0 {
        return Ok(());
    }
    match bufs.iter().find(|(_, p)| (*p as usize) % dtype.size() != 0) {
        Some((name, p)) => Err(format!(
            "{name} at {p:?} is not aligned to {} bytes for {dtype} elements",
            dtype.size()
        )),
        None => Ok(()),
    }
}

/// `n × p` for a message: the product, or that it is more than a count can hold.
fn times(n: usize, p: usize) -> String {
    n.checked_mul(p)
        .map_or_else(|| "more than a usize holds".to_string(), |x| x.to_string())
}

/// P + 1 offsets (in elements) from a count per rank; an error naming the list when it does
/// not have one count per rank or its sum is more elements than a buffer can hold.
fn offsets(
    dtype: DType,
    name: &str,
    counts: &[usize],
    world: usize,
) -> std::result::Result<Vec<usize>, String> {
    if counts.len() != world {
        return Err(format!(
            "{name} has {} entries for a world of {world} ranks; it needs one per rank",
            counts.len()
        ));
    }
    let mut o = Vec::with_capacity(world + 1);
    let mut at = 0usize;
    o.push(0);
    for (k, &c) in counts.iter().enumerate() {
        at = at
            .checked_add(c)
            .filter(|&a| {
                a.checked_mul(dtype.size())
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| {
                format!("{name} up to rank {k} sum to more {dtype} elements than a buffer can hold")
            })?;
        o.push(at);
    }
    Ok(o)
}

/// `len` bytes hold exactly the `n` elements that `what` says.
fn fits(
    dtype: DType,
    buffer: &str,
    len: usize,
    what: &str,
    n: usize,
) -> std::result::Result<(), String> {
    let have = elems(dtype, buffer, len)?;
    if have != n {
        return Err(format!(
            "{buffer} holds {have} elements but {what} says {n}; they must be equal"
        ));
    }
    Ok(())
}

/// The input and output of a call that cannot run in place do not share a byte.
fn disjoint(input: Bytes, output: BytesMut) -> std::result::Result<(), String> {
    let (a, b) = (input.as_ptr() as usize, output.as_ptr() as usize);
    if input.len() > 0 && output.len() > 0 && a < b + output.len() && b < a + input.len() {
        return Err(
            "the input and output overlap; this collective cannot run in place".to_string(),
        );
    }
    Ok(())
}

/// A checked count and offsets as the parts of a call.
fn split(
    r: std::result::Result<(usize, Vec<usize>), String>,
) -> (std::result::Result<usize, String>, Vec<usize>) {
    match r {
        Ok((n, o)) => (Ok(n), o),
        Err(e) => (Err(e), Vec::new()),
    }
}

fn check_root(root: usize, world: usize) -> std::result::Result<(), String> {
    if root >= world {
        return Err(format!(
            "root {root} is out of range for a world of {world} ranks"
        ));
    }
    Ok(())
}

impl Communicator {
    /// `op` is defined on `dtype` (the bitwise ops on the integer types only) and the group's
    /// engine can run it (NCCL has no bitwise ops).
    fn check_op(&self, dtype: DType, op: ReduceOp) -> std::result::Result<(), String> {
        op.check(dtype)?;
        match self
            .progress
            .shared()
            .engine
            .as_ref()
            .and_then(|e| e.op_unavailable(op))
        {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// `call` as this rank's argument error where the group's engine does not run its
    /// collective (every rank of a group has the same engine, so every rank refuses alike).
    pub(super) fn engine_runs(&self, mut call: Call) -> Call {
        let shared = self.progress.shared();
        if let Some(engine) = shared.engine.as_ref() {
            if call.check.is_ok() && !engine.runs(call.collective) {
                call.check = Err(format!(
                    "{} is not available on {}: its device engine runs {}",
                    call.collective,
                    self.device_spec(),
                    engine.runs_list()
                ));
            }
            if call.check.is_ok()
                && shared.deterministic
                && call.op.is_some()
                && !engine.orders(call.collective)
            {
                call.check = Err(format!(
                    "deterministic mode (TUTTI_DETERMINISTIC) is not available for {} on {}: \
                     its device engine does not reduce in rank order; turn the mode off for \
                     device ranks",
                    call.collective,
                    self.device_spec()
                ));
            }
        }
        call
    }

    /// All-reduce of raw bytes holding `dtype` elements: `output = ⊕ over ranks of input`, or in
    /// place in `output` when `input` is `None`.
    pub(super) fn all_reduce_call(
        &self,
        dtype: DType,
        input: Option<Bytes>,
        output: BytesMut,
        op: ReduceOp,
    ) -> Call {
        let check = self.check_op(dtype, op);
        let check = check
            .and_then(|_| elems(dtype, "the buffer", output.len()))
            .and_then(|n| match input {
                Some(i) if i.len() != output.len() => Err(format!(
                    "the input holds {} elements but the output {n}; they must be equal",
                    i.len() / dtype.size()
                )),
                _ => {
                    let i = input.map_or(output.as_ptr(), |i| i.as_ptr());
                    aligned(
                        dtype,
                        n,
                        &[("the input", i), ("the output", output.as_ptr())],
                    )
                    .map(|_| n)
                }
            });
        let count = *check.as_ref().unwrap_or(&0);
        let buffers = CallBuffers {
            input: input.map_or(output.as_ptr(), |i| i.as_ptr()),
            input_len: output.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            after: 0,
            end: 0,
            offsets: std::ptr::null(),
            offsets_len: 0,
            held: Held::Bytes,
        };
        Call {
            collective: Collective::AllReduce,
            dtype,
            count,
            op: Some(op),
            root: None,
            check: check.map(drop),
            buffers,
            rank: self.rank(),
            algorithm: self.algorithm,
            in_place: input.is_none(),
            offsets: Vec::new(),
            counts: None,
            _after: None,
        }
    }

    /// Broadcast raw bytes from `root` into every rank's `buf`.
    pub(super) fn broadcast_call(&self, dtype: DType, buf: BytesMut, root: usize) -> Call {
        let check = elems(dtype, "the buffer", buf.len());
        let count = *check.as_ref().unwrap_or(&0);
        let check = check
            .and_then(|_| check_root(root, self.world_size()))
            .and_then(|_| aligned(dtype, count, &[("the buffer", buf.as_ptr())]));
        let ptr = buf.as_mut_ptr();
        let buffers = CallBuffers {
            input: ptr,
            input_len: buf.len(),
            output: ptr,
            output_len: buf.len(),
            after: 0,
            end: 0,
            offsets: std::ptr::null(),
            offsets_len: 0,
            held: Held::Bytes,
        };
        Call {
            collective: Collective::Broadcast,
            dtype,
            count,
            op: None,
            root: Some(root),
            check,
            buffers,
            rank: self.rank(),
            algorithm: self.algorithm,
            in_place: true,
            offsets: Vec::new(),
            counts: None,
            _after: None,
        }
    }

    /// All-gather of raw bytes: rank r's `input` lands in slice r of every rank's `output`
    /// (`world_size` times as long). `input = None`: in place, slice `rank` of `output` is the input.
    pub(super) fn all_gather_call(
        &self,
        dtype: DType,
        input: Option<Bytes>,
        output: BytesMut,
    ) -> Call {
        let p = self.world_size();
        let in_len = input.map_or(output.len() / p, |i| i.len());
        let check = elems(dtype, "the input", in_len).and_then(|n| {
            // Checked: world × a huge input must not wrap round to the output's length.
            if in_len.checked_mul(p) != Some(output.len())
                || (input.is_none() && output.len() % p != 0)
            {
                Err(format!(
                    "the output holds {} elements; all_gather needs world size × input = {p} × {n} = {}",
                    output.len() / dtype.size(),
                    times(n, p)
                ))
            } else {
                let i = input.map_or(output.as_ptr(), |i| i.as_ptr());
                aligned(dtype, n, &[("the input", i), ("the output", output.as_ptr())]).map(|_| n)
            }
        });
        let count = *check.as_ref().unwrap_or(&0);
        // In place, the input is this rank's slice of the output (in_len = output / world).
        let own = || output.as_ptr().wrapping_add(self.rank() * in_len);
        let buffers = CallBuffers {
            input: input.map_or_else(own, |i| i.as_ptr()),
            input_len: in_len,
            output: output.as_mut_ptr(),
            output_len: output.len(),
            after: 0,
            end: 0,
            offsets: std::ptr::null(),
            offsets_len: 0,
            held: Held::Bytes,
        };
        Call {
            collective: Collective::AllGather,
            dtype,
            count,
            op: None,
            root: None,
            check: check.map(drop),
            buffers,
            rank: self.rank(),
            algorithm: self.algorithm,
            in_place: input.is_none(),
            offsets: Vec::new(),
            counts: None,
            _after: None,
        }
    }

    /// Reduce-scatter of raw bytes: `output` (one slice) = slice `rank` of the reduction of every
    /// rank's `input` (`world_size` slices).
    pub(super) fn reduce_scatter_call(
        &self,
        dtype: DType,
        input: Bytes,
        output: BytesMut,
        op: ReduceOp,
    ) -> Call {
        let p = self.world_size();
        let check = self.check_op(dtype, op);
        let check = check.and_then(|_| elems(dtype, "the output", output.len())).and_then(|n| {
            // Checked: world × a huge output must not wrap round to the input's length.
            if output.len().checked_mul(p) != Some(input.len()) {
                Err(format!(
                    "the input holds {} elements; reduce_scatter needs world size × output = {p} × {n} = {}",
                    input.len() / dtype.size(),
                    times(n, p)
                ))
            } else {
                aligned(dtype, n, &[("the input", input.as_ptr()), ("the output", output.as_ptr())]).map(|_| n)
            }
        });
        let count = *check.as_ref().unwrap_or(&0);
        let buffers = CallBuffers {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            after: 0,
            end: 0,
            offsets: std::ptr::null(),
            offsets_len: 0,
            held: Held::Bytes,
        };
        Call {
            collective: Collective::ReduceScatter,
            dtype,
            count,
            op: Some(op),
            root: None,
            check: check.map(drop),
            buffers,
            rank: self.rank(),
            algorithm: self.algorithm,
            in_place: false,
            offsets: Vec::new(),
            counts: None,
            _after: None,
        }
    }

    /// Reduce of raw bytes onto `root`. Off the root `output` is ignored and may be `None`; at the
    /// root it is required, and `input = None` means in place in `output`.
    pub(super) fn reduce_call(
        &self,
        dtype: DType,
        input: Option<Bytes>,
        output: Option<BytesMut>,
        op: ReduceOp,
        root: usize,
    ) -> Call {
        let is_root = self.rank() == root;
        let output = output.filter(|_| is_root);
        let len = input
            .map(|i| i.len())
            .or(output.as_ref().map(|o| o.len()))
            .unwrap_or(0);
        let check = self.check_op(dtype, op);
        let check = check
            .and_then(|_| elems(dtype, "the buffer", len))
            .and_then(|n| {
                check_root(root, self.world_size())?;
                match (input, &output) {
                    (None, None) if is_root => Err("the root needs an output buffer".to_string()),
                    (None, None) => {
                        Err("ranks other than the root need an input buffer".to_string())
                    }
                    (Some(i), Some(o)) if i.len() != o.len() => Err(format!(
                        "the input holds {} elements but the output {}; they must be equal",
                        i.len() / dtype.size(),
                        o.len() / dtype.size()
                    )),
                    (Some(_), None) if is_root => {
                        Err("the root needs an output buffer".to_string())
                    }
                    _ => {
                        let i = input.map(|i| i.as_ptr()).unwrap_or(std::ptr::null());
                        let o = output
                            .as_ref()
                            .map(|o| o.as_ptr())
                            .unwrap_or(std::ptr::null());
                        aligned(dtype, n, &[("the input", i), ("the output", o)]).map(|_| n)
                    }
                }
            });
        let count = *check.as_ref().unwrap_or(&0);
        let (out_ptr, out_len) = match &output {
            Some(o) => (o.as_ptr() as *mut u8, o.len()),
            None => (std::ptr::null_mut(), 0),
        };
        let buffers = CallBuffers {
            input: input.map_or(out_ptr as *const u8, |i| i.as_ptr()),
            input_len: len,
            output: out_ptr,
            output_len: out_len,
            after: 0,
            end: 0,
            offsets: std::ptr::null(),
            offsets_len: 0,
            held: Held::Bytes,
        };
        Call {
            collective: Collective::Reduce,
            dtype,
            count,
            op: Some(op),
            root: Some(root),
            check: check.map(drop),
            buffers,
            rank: self.rank(),
            algorithm: self.algorithm,
            in_place: input.is_none(),
            offsets: Vec::new(),
            counts: None,
            _after: None,
        }
    }

    /// All-to-all of equal blocks: block j of `input` goes to rank j, block k of `output`
    /// comes from rank k (each `world_size` blocks).
    pub(super) fn all_to_all_call(&self, dtype: DType, input: Bytes, output: BytesMut) -> Call {
        let p = self.world_size();
        let check = elems(dtype, "the input", input.len()).and_then(|n| {
            if output.len() != input.len() {
                return Err(format!(
                    "the input holds {n} elements but the output {}; all_to_all needs them equal",
                    output.len() / dtype.size()
                ));
            }
            if n % p != 0 {
                return Err(format!(
                    "the input holds {n} elements, not a whole number of blocks for {p} ranks"
                ));
            }
            disjoint(input, output)?;
            aligned(
                dtype,
                n,
                &[
                    ("the input", input.as_ptr()),
                    ("the output", output.as_ptr()),
                ],
            )
            .map(|_| n / p)
        });
        self.blocks_call(
            Collective::AllToAll,
            dtype,
            input,
            output,
            check,
            Vec::new(),
        )
    }

    /// All-to-all with a count per block: `send_counts[j]` elements of `input` (in rank
    /// order) go to rank j, and `recv_counts[k]` elements of `output` come from rank k.
    pub(super) fn all_to_all_v_call(
        &self,
        dtype: DType,
        input: Bytes,
        send_counts: &[usize],
        output: BytesMut,
        recv_counts: &[usize],
    ) -> Call {
        let r = self.rank();
        let check = (|| {
            let mut o = offsets(dtype, "send_counts", send_counts, self.world_size())?;
            fits(
                dtype,
                "the input",
                input.len(),
                "send_counts",
                o[o.len() - 1],
            )?;
            let recv = offsets(dtype, "recv_counts", recv_counts, self.world_size())?;
            fits(
                dtype,
                "the output",
                output.len(),
                "recv_counts",
                recv[recv.len() - 1],
            )?;
            if send_counts[r] != recv_counts[r] {
                return Err(format!(
                    "send_counts[{r}] = {} but recv_counts[{r}] = {}: this rank's block to \
                     itself must be as long as the one it receives",
                    send_counts[r], recv_counts[r]
                ));
            }
            disjoint(input, output)?;
            let n = input.len().max(output.len());
            aligned(
                dtype,
                n,
                &[
                    ("the input", input.as_ptr()),
                    ("the output", output.as_ptr()),
                ],
            )?;
            o.extend(recv);
            // Counts differ from rank to rank: each pair's agree, which the exchange checks.
            Ok((0, o))
        })();
        let (check, offsets) = split(check);
        self.blocks_call(Collective::AllToAllV, dtype, input, output, check, offsets)
    }

    /// All-gather with a count per rank: rank r's `input` (`counts[r]` elements) lands at
    /// offset `counts[0] + ... + counts[r-1]` of every rank's `output`.
    pub(super) fn all_gather_v_call(
        &self,
        dtype: DType,
        input: Bytes,
        output: BytesMut,
        counts: &[usize],
    ) -> Call {
        let r = self.rank();
        let check = (|| {
            let o = offsets(dtype, "counts", counts, self.world_size())?;
            let total = o[o.len() - 1];
            fits(
                dtype,
                "the input",
                input.len(),
                &format!("counts[{r}]"),
                counts[r],
            )?;
            fits(dtype, "the output", output.len(), "counts", total)?;
            disjoint(input, output)?;
            aligned(
                dtype,
                total,
                &[
                    ("the input", input.as_ptr()),
                    ("the output", output.as_ptr()),
                ],
            )?;
            Ok((total, o))
        })();
        let (check, offsets) = split(check);
        let mut call =
            self.blocks_call(Collective::AllGatherV, dtype, input, output, check, offsets);
        call.counts = Some(crate::call::counts_digest(counts));
        call
    }

    /// Reduce-scatter with a count per rank: `output` (`counts[rank]` elements) = this rank's
    /// block of the reduction of every rank's `input` (the sum of the counts).
    pub(super) fn reduce_scatter_v_call(
        &self,
        dtype: DType,
        input: Bytes,
        output: BytesMut,
        counts: &[usize],
        op: ReduceOp,
    ) -> Call {
        let r = self.rank();
        let check = (|| {
            self.check_op(dtype, op)?;
            let o = offsets(dtype, "counts", counts, self.world_size())?;
            let total = o[o.len() - 1];
            fits(dtype, "the input", input.len(), "counts", total)?;
            fits(
                dtype,
                "the output",
                output.len(),
                &format!("counts[{r}]"),
                counts[r],
            )?;
            disjoint(input, output)?;
            aligned(
                dtype,
                total,
                &[
                    ("the input", input.as_ptr()),
                    ("the output", output.as_ptr()),
                ],
            )?;
            Ok((total, o))
        })();
        let (check, offsets) = split(check);
        let mut call = self.blocks_call(
            Collective::ReduceScatterV,
            dtype,
            input,
            output,
            check,
            offsets,
        );
        call.op = Some(op);
        call.counts = Some(crate::call::counts_digest(counts));
        call
    }

    /// A call over one input and one output cut into blocks.
    fn blocks_call(
        &self,
        collective: Collective,
        dtype: DType,
        input: Bytes,
        output: BytesMut,
        check: std::result::Result<usize, String>,
        offsets: Vec<usize>,
    ) -> Call {
        Call {
            collective,
            dtype,
            count: *check.as_ref().unwrap_or(&0),
            op: None,
            root: None,
            check: check.map(drop),
            buffers: CallBuffers {
                input: input.as_ptr(),
                input_len: input.len(),
                output: output.as_mut_ptr(),
                output_len: output.len(),
                after: 0,
                end: 0,
                offsets: std::ptr::null(),
                offsets_len: 0,
                held: Held::Bytes,
            },
            rank: self.rank(),
            algorithm: self.algorithm,
            in_place: false,
            offsets,
            counts: None,
            _after: None,
        }
    }

    /// Gather onto `root`: its `output` (`world_size` × the input) holds every rank's `input`
    /// in rank order. Off the root `output` is ignored and may be `None`.
    pub(super) fn gather_call(
        &self,
        dtype: DType,
        input: Bytes,
        output: Option<BytesMut>,
        root: usize,
    ) -> Call {
        let p = self.world_size();
        let output = output.filter(|_| self.rank() == root);
        let check = elems(dtype, "the input", input.len()).and_then(|n| {
            check_root(root, p)?;
            let o = output.as_ref().map_or(std::ptr::null(), |o| o.as_ptr());
            if self.rank() == root {
                let Some(out) = output else {
                    return Err("the root needs an output buffer".to_string());
                };
                if input.len().checked_mul(p) != Some(out.len()) {
                    return Err(format!(
                        "the output holds {} elements; gather needs world size × input = {p} × {n} = {}",
                        out.len() / dtype.size(),
                        times(n, p)
                    ));
                }
                disjoint(input, out)?;
            }
            aligned(dtype, n, &[("the input", input.as_ptr()), ("the output", o)]).map(|_| n)
        });
        // Off the root there is no output: a null one (the body forms no slice of it).
        let none = BytesMut {
            ptr: std::ptr::null_mut(),
            len: 0,
        };
        let output = output.unwrap_or(none);
        let mut call =
            self.blocks_call(Collective::Gather, dtype, input, output, check, Vec::new());
        call.root = Some(root);
        call
    }

    /// Scatter from `root`: every rank's `output` becomes block `rank` of the root's `input`
    /// (`world_size` × the output). Off the root `input` is ignored and may be `None`.
    pub(super) fn scatter_call(
        &self,
        dtype: DType,
        input: Option<Bytes>,
        output: BytesMut,
        root: usize,
    ) -> Call {
        let p = self.world_size();
        let input = input.filter(|_| self.rank() == root);
        let check = elems(dtype, "the output", output.len()).and_then(|n| {
            check_root(root, p)?;
            let i = input.as_ref().map_or(std::ptr::null(), |i| i.as_ptr());
            if self.rank() == root {
                let Some(inp) = input else {
                    return Err("the root needs an input buffer".to_string());
                };
                if output.len().checked_mul(p) != Some(inp.len()) {
                    return Err(format!(
                        "the input holds {} elements; scatter needs world size × output = {p} × {n} = {}",
                        inp.len() / dtype.size(),
                        times(n, p)
                    ));
                }
                disjoint(inp, output)?;
            }
            aligned(dtype, n, &[("the input", i), ("the output", output.as_ptr())]).map(|_| n)
        });
        // Off the root there is no input: a null one (the body forms no slice of it).
        let none = Bytes {
            ptr: std::ptr::null(),
            len: 0,
        };
        let input = input.unwrap_or(none);
        let mut call =
            self.blocks_call(Collective::Scatter, dtype, input, output, check, Vec::new());
        call.root = Some(root);
        call
    }

    /// `collective` (all-reduce with `op`, broadcast from `root`, or all-gather) over this
    /// rank's tensor `t` on its device, where it lies: the rank publishes the tensor itself
    /// ([`CallBuffers::held`]) for the group's engine, which replaces it with the result. With
    /// `update` (the rank's update tensor, and how it applies), `t` is a variable's copy: the
    /// collective combines the updates and the engine applies the result to each copy. A rank
    /// whose engine does not run the collective on tensors refuses, before the ranks meet.
    pub(super) fn tensor_call(
        &self,
        collective: Collective,
        t: &mut DeviceTensor,
        update: Option<(&DeviceTensor, Apply)>,
        op: ReduceOp,
        root: usize,
    ) -> Call {
        let dtype = t.dtype();
        let bytes = t.len().saturating_mul(dtype.size());
        let what = format!("{t:?}");
        // The lengths the ranks compare when they meet (an all-gather's output is the world's
        // inputs); nothing reads them as bytes.
        let ptr: *mut u8 = (t as *mut DeviceTensor).cast();
        let at = |len: usize| BytesMut { ptr, len };
        let mut call = match collective {
            Collective::Broadcast => self.broadcast_call(dtype, at(bytes), root),
            Collective::AllGather => {
                self.all_gather_call(dtype, None, at(bytes.saturating_mul(self.world_size())))
            }
            _ => self.all_reduce_call(dtype, None, at(bytes), op),
        };
        call.buffers.held = Held::Tensor;
        if let Some((u, apply)) = update {
            call.buffers.input = (u as *const DeviceTensor).cast();
            call.buffers.held = Held::Update(apply);
            if call.check.is_ok() && (u.dtype(), u.len()) != (dtype, bytes / dtype.size()) {
                call.check = Err(format!(
                    "the update {u:?} does not match the variable's copy {what}; they must have \
                     one dtype and length"
                ));
            }
        }
        let shared = self.progress.shared();
        let runs = shared
            .engine
            .as_ref()
            .is_some_and(|e| !e.per_rank() && e.runs_held(collective, call.buffers.held));
        if call.check.is_ok() && !runs {
            call.check = Err(format!(
                "rank {} is on {}, which does not run {collective} on {what}; make tensors with \
                 the rank's own communicator (Communicator::place)",
                self.rank(),
                self.device_spec()
            ));
        }
        call
    }

    pub(super) fn barrier_call(&self) -> Call {
        Call {
            collective: Collective::Barrier,
            rank: self.rank(),
            dtype: DType::U8,
            count: 0,
            op: None,
            root: None,
            algorithm: self.algorithm,
            check: Ok(()),
            buffers: CallBuffers::NONE,
            in_place: true,
            offsets: Vec::new(),
            counts: None,
            _after: None,
        }
    }

    /// This rank's place in a `collective` its peers make, as a rejection with `why` (see
    /// [`Communicator::reject`]).
    pub(super) fn rejected_call(&self, collective: Collective, why: &str) -> Call {
        let mut call = self.barrier_call();
        call.collective = collective;
        call.check = Err(why.to_string());
        call
    }

    /// Build the call `c` describes; lengths that overflow are this rank's argument error.
    pub(super) fn raw_call(&self, c: &RawCall<'_>) -> Call {
        self.engine_runs(self.raw_call_of(c))
    }

    fn raw_call_of(&self, c: &RawCall<'_>) -> Call {
        let p = self.world_size();
        let (in_times, out_times) = match c.collective {
            Collective::AllGather | Collective::Gather => (1, p),
            Collective::ReduceScatter | Collective::Scatter => (p, 1),
            Collective::AllToAll => (p, p),
            _ => (1, 1),
        };
        if c.collective.has_counts() || c.collective == Collective::AllToAllV {
            return self.raw_counts_call(c);
        }
        let bytes = |times: usize| {
            c.count
                .checked_mul(times)
                .and_then(|n| n.checked_mul(c.dtype.size()))
                .filter(|&n| n <= isize::MAX as usize)
        };
        let (Some(in_len), Some(out_len)) = (bytes(in_times), bytes(out_times)) else {
            let mut call = self.barrier_call();
            call.collective = c.collective;
            call.dtype = c.dtype;
            call.check = Err(format!(
                "{} × count {} of {} is more bytes than a buffer can hold",
                in_times.max(out_times),
                c.count,
                c.dtype
            ));
            return call;
        };
        // An empty buffer may have any address, NULL included; slices need one that is not.
        let fix = |p: *const u8, len: usize| {
            if len == 0 {
                std::ptr::NonNull::<u128>::dangling().as_ptr() as *const u8
            } else {
                p
            }
        };
        let input = Bytes {
            ptr: fix(c.input, in_len),
            len: in_len,
        };
        let output = BytesMut {
            ptr: fix(c.output, out_len) as *mut u8,
            len: out_len,
        };
        let same = |a: *const u8, b: *const u8| std::ptr::eq(a, b) || in_len == 0;
        match c.collective {
            Collective::AllReduce => {
                let input = (!same(c.input, c.output)).then_some(input);
                self.all_reduce_call(c.dtype, input, output, c.op)
            }
            Collective::Broadcast => self.broadcast_call(c.dtype, output, c.root),
            Collective::AllGather => {
                let own = c.output.wrapping_add(self.rank() * in_len);
                let input = (!same(c.input, own)).then_some(input);
                self.all_gather_call(c.dtype, input, output)
            }
            Collective::ReduceScatter => self.reduce_scatter_call(c.dtype, input, output, c.op),
            Collective::Reduce => {
                let at_root = self.rank() == c.root;
                let input = (!(at_root && same(c.input, c.output))).then_some(input);
                let output = at_root.then_some(output);
                self.reduce_call(c.dtype, input, output, c.op, c.root)
            }
            Collective::Barrier => self.barrier_call(),
            Collective::AllToAll => self.all_to_all_call(c.dtype, input, output),
            Collective::Gather => {
                let output = (self.rank() == c.root).then_some(output);
                self.gather_call(c.dtype, input, output, c.root)
            }
            Collective::Scatter => {
                let input = (self.rank() == c.root).then_some(input);
                self.scatter_call(c.dtype, input, output, c.root)
            }
            Collective::AllToAllV | Collective::AllGatherV | Collective::ReduceScatterV => {
                unreachable!("built by raw_counts_call")
            }
            Collective::Send | Collective::Recv | Collective::SendRecv => {
                let mut call = self.barrier_call();
                call.collective = c.collective;
                call.check = Err(format!(
                    "{} is point-to-point: run it with Communicator::send, recv or send_recv",
                    c.collective
                ));
                call
            }
        }
    }

    /// Build a call with a count per rank that `c` describes: the buffers are as long as the
    /// counts say (this rank's argument error when a list is not one count per rank or sums
    /// past what a buffer holds).
    fn raw_counts_call(&self, c: &RawCall<'_>) -> Call {
        let (p, r) = (self.world_size(), self.rank());
        let total = |counts: &[usize]| -> std::result::Result<usize, String> {
            let name = match c.collective {
                _ if std::ptr::eq(counts, c.recv_counts) => "recv_counts",
                Collective::AllToAllV => "send_counts",
                _ => "counts",
            };
            let o = offsets(c.dtype, name, counts, p)?;
            Ok(o[p] * c.dtype.size())
        };
        let lens = (|| {
            let sent = total(c.counts)?;
            Ok(match c.collective {
                Collective::AllGatherV => (c.counts[r] * c.dtype.size(), sent),
                Collective::ReduceScatterV => (sent, c.counts[r] * c.dtype.size()),
                _ => (sent, total(c.recv_counts)?),
            })
        })();
        let (in_len, out_len) = match lens {
            Ok(l) => l,
            Err(e) => {
                let mut call = self.barrier_call();
                call.collective = c.collective;
                call.dtype = c.dtype;
                call.check = Err(e);
                return call;
            }
        };
        let fix = |p: *const u8, len: usize| {
            if len == 0 {
                std::ptr::NonNull::<u128>::dangling().as_ptr() as *const u8
            } else {
                p
            }
        };
        let input = Bytes {
            ptr: fix(c.input, in_len),
            len: in_len,
        };
        let output = BytesMut {
            ptr: fix(c.output, out_len) as *mut u8,
            len: out_len,
        };
        match c.collective {
            Collective::AllGatherV => self.all_gather_v_call(c.dtype, input, output, c.counts),
            Collective::ReduceScatterV => {
                self.reduce_scatter_v_call(c.dtype, input, output, c.counts, c.op)
            }
            _ => self.all_to_all_v_call(c.dtype, input, c.counts, output, c.recv_counts),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::local::LocalTransport;
    use std::sync::Arc;

    /// Scatter's input and gather's output are not passed off the root: the call runs over
    /// a NULL, empty buffer there, never a slice made from NULL (a debug build's check aborts
    /// on that, through the C ABI too).
    #[test]
    fn scatter_and_gather_without_buffers_off_the_root() {
        let config = crate::Config::default();
        let out = crate::run_local(3, &config, |comm| {
            let r = comm.rank();
            let whole: Vec<u32> = (0..6).collect();
            let mut mine = [0u32; 2];
            comm.scatter((r == 1).then_some(&whole[..]), &mut mine, 1)
                .unwrap();
            let mut all = [0u32; 6];
            comm.gather(&mine, (r == 2).then_some(&mut all[..]), 2)
                .unwrap();
            (mine, all)
        })
        .unwrap();
        assert_eq!(out[0].0, [0, 1]);
        assert_eq!(out[2].0, [4, 5]);
        assert_eq!(out[2].1, [0, 1, 2, 3, 4, 5]);
        assert_eq!(out[0].1, [0; 6]);
    }

    /// Lengths whose product with the world size wraps round to the other buffer's length are
    /// an argument error, not a call over a wrapped length (issue 29, item 5). The buffers are
    /// never touched: a call is only built and checked here.
    #[test]
    fn world_times_a_length_never_wraps() {
        let config = crate::Config::default();
        let t = LocalTransport::group(4, config.timeout).remove(1);
        let comm = Communicator::new(Arc::new(t), &config);
        let huge = 1usize << 62; // × 4 = 2^64, which wraps to 0
        let far = std::ptr::NonNull::<u64>::dangling().as_ptr().cast::<u8>();
        let input = Bytes {
            ptr: far,
            len: huge,
        };
        let output = BytesMut { ptr: far, len: 0 };
        let call = comm.all_gather_call(DType::U8, Some(input), output);
        let e = call.check.unwrap_err();
        assert!(e.contains("all_gather needs world size × input = 4 × 4611686018427387904 = more than a usize holds"), "{e}");
        let input = Bytes { ptr: far, len: 0 };
        let output = BytesMut {
            ptr: far,
            len: huge,
        };
        let call = comm.reduce_scatter_call(DType::U8, input, output, ReduceOp::Sum);
        let e = call.check.unwrap_err();
        assert!(e.contains("reduce_scatter needs world size × output = 4 × 4611686018427387904 = more than a usize holds"), "{e}");
    }
}
