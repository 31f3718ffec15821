//! The collectives across a client's devices: checked arguments, the compiled-program path and
//! the host-staged path.
//!
//! Replica `r` of a call runs on device `r` of [`Client::devices`]; a call with N buffers uses
//! the first N devices. Each program is compiled once per (collective, dtype, element count,
//! op or root, number of replicas) and cached in the client.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::device::pjrt::client::{Client, Compiled, Executable, ProgramKey, Route, XlaBuffer};
use crate::device::pjrt::program::Kind;
use crate::dtype::kernels::{self, Init};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result, Site};

/// How one call runs.
enum Plan {
    Program(Arc<Executable>),
    Staged,
}

/// Host bytes aligned for every element type (the kernels read them as typed slices).
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        Aligned {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

/// The result of the host-staged path: what every replica gets, the buffer whose slice r
/// replica r gets, or each replica's own.
enum Staged {
    Same(Aligned),
    Sliced(Aligned),
    Each(Vec<Aligned>),
}

impl Staged {
    fn part(&self, r: usize, n: usize) -> &[u8] {
        match self {
            Staged::Same(v) => v.bytes(),
            Staged::Sliced(v) => {
                let each = v.len / n;
                &v.bytes()[r * each..(r + 1) * each]
            }
            Staged::Each(v) => v[r].bytes(),
        }
    }
}

/// Carry out `kind` on the host over `inputs` (one per replica, equal lengths) with tutti's
/// kernels: the reference semantics of every collective (f16/bf16 reduced in f32 and rounded
/// once, `Mean` divided once at the end).
fn host_collective(kind: Kind, dtype: DType, inputs: &[&[u8]]) -> Staged {
    let n = inputs.len();
    match kind {
        // The updates combined; the caller applies them.
        Kind::Update { .. } => host_collective(kind.combining(), dtype, inputs),
        // tutti's kernels reduce the inputs in rank order: the ordered kinds' bits already.
        Kind::AllReduce(op)
        | Kind::ReduceScatter(op)
        | Kind::OrderedAllReduce(op)
        | Kind::OrderedReduceScatter(op) => {
            let mut out = Aligned::zeroed(inputs[0].len());
            let divide = (op == ReduceOp::Mean).then_some(n);
            kernels::reduce(
                dtype,
                op.combining(),
                out.bytes_mut(),
                inputs,
                Init::Overwrite,
                divide,
            );
            if matches!(kind, Kind::AllReduce(_) | Kind::OrderedAllReduce(_)) {
                Staged::Same(out)
            } else {
                Staged::Sliced(out)
            }
        }
        Kind::Broadcast(root) => {
            let mut out = Aligned::zeroed(inputs[root].len());
            out.bytes_mut().copy_from_slice(inputs[root]);
            Staged::Same(out)
        }
        Kind::AllGather => {
            let each = inputs[0].len();
            let mut out = Aligned::zeroed(each * n);
            for (r, i) in inputs.iter().enumerate() {
                out.bytes_mut()[r * each..(r + 1) * each].copy_from_slice(i);
            }
            Staged::Same(out)
        }
        // Block j of replica i's input into block i of replica j's output.
        Kind::AllToAll => {
            let block = inputs[0].len() / n.max(1);
            Staged::Each(
                (0..n)
                    .map(|j| {
                        let mut out = Aligned::zeroed(block * n);
                        for (i, input) in inputs.iter().enumerate() {
                            out.bytes_mut()[i * block..(i + 1) * block]
                                .copy_from_slice(&input[j * block..(j + 1) * block]);
                        }
                        out
                    })
                    .collect(),
            )
        }
    }
}

impl Client {
    fn site(&self, kind: Kind, rank: usize) -> Site {
        Site {
            collective: kind.collective(),
            rank,
            call: self.inner.calls.load(Ordering::Relaxed),
        }
    }

    /// Check a call's shape: N replicas on N devices, equal input lengths, a root in range,
    /// a count that splits N ways for reduce-scatter. Returns the input count per replica.
    fn check_call(&self, kind: Kind, lens: &[usize]) -> Result<usize> {
        let n = lens.len();
        let devices = self.inner.device_count();
        if n == 0 {
            return Err(Error::config(format!(
                "XLA {}: needs one buffer per replica, got none",
                kind.name()
            )));
        }
        if n > devices {
            return Err(Error::config(format!(
                "XLA {}: {n} buffers (one per replica) but this client has {devices} device(s){}",
                kind.name(),
                if self.platform_name() == "cpu" {
                    format!(
                        " (the CPU plugin makes more with {}=cpu_device_count={n})",
                        crate::device::pjrt::client::OPTIONS_ENV
                    )
                } else {
                    String::new()
                }
            )));
        }
        let count = lens[0];
        if let Some(r) = lens.iter().position(|&l| l != count) {
            return Err(Error::invalid(
                self.site(kind, r),
                format!(
                    "buffer of replica {r} has {} elements but replica 0's has {count}; every replica must pass the same count",
                    lens[r]
                ),
            ));
        }
        if let Kind::Broadcast(root) = kind.combining() {
            if root >= n {
                return Err(Error::invalid(
                    self.site(kind, 0),
                    format!("root {root} is out of range for {n} replicas"),
                ));
            }
        }
        if matches!(
            kind,
            Kind::ReduceScatter(_) | Kind::OrderedReduceScatter(_) | Kind::AllToAll
        ) && count % n != 0
        {
            return Err(Error::invalid(
                self.site(kind, 0),
                format!("the input count {count} does not split into {n} equal slices"),
            ));
        }
        Ok(count)
    }

    /// A reduce op defined on `dtype` (the bitwise ones are on the integer types only).
    fn check_op(&self, kind: Kind, dtype: DType) -> Result<()> {
        match kind.op() {
            Some(op) => op
                .check(dtype)
                .map_err(|m| Error::invalid(self.site(kind, 0), m)),
            None => Ok(()),
        }
    }

    fn check_outputs(&self, kind: Kind, want: usize, lens: &[usize], n: usize) -> Result<()> {
        if lens.len() != n {
            return Err(Error::config(format!(
                "XLA {}: {n} inputs but {} outputs; pass one output per replica",
                kind.name(),
                lens.len()
            )));
        }
        if let Some(r) = lens.iter().position(|&l| l != want) {
            return Err(Error::invalid(
                self.site(kind, r),
                format!(
                    "output of replica {r} has {} elements; it must have {want}",
                    lens[r]
                ),
            ));
        }
        Ok(())
    }

    fn plan(&self, key: ProgramKey) -> Result<Plan> {
        if key.count == 0 {
            return Ok(Plan::Staged);
        }
        let mode = self.route();
        if mode == Route::HostStaged {
            return Ok(Plan::Staged);
        }
        match self.inner.program(key)? {
            Compiled::Ready(exe) => Ok(Plan::Program(exe)),
            Compiled::Refused(why) if mode == Route::Auto => {
                let _ = why;
                Ok(Plan::Staged)
            }
            Compiled::Refused(why) => Err(Error::System {
                what: format!(
                    "XLA: compiling the {} program for {} x {} on {} devices",
                    key.kind, key.dtype, key.count, key.replicas
                ),
                message: why,
            }),
        }
    }

    /// The host-buffer form of every collective: inputs in, results written to `outputs` (one
    /// per replica, or with `only`, the one replica's result alone).
    fn host_call(
        &self,
        kind: Kind,
        dtype: DType,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        only: Option<usize>,
    ) -> Result<()> {
        self.inner.check_usable()?;
        self.inner.count_host_call();
        let n = inputs.len();
        let count = inputs[0].len() / dtype.size();
        let key = ProgramKey {
            kind,
            dtype,
            count,
            replicas: n,
        };
        match self.plan(key)? {
            Plan::Staged => {
                self.inner.count_staged();
                let result = host_collective(kind, dtype, inputs);
                for (i, out) in outputs.iter_mut().enumerate() {
                    out.copy_from_slice(result.part(only.unwrap_or(i), n));
                }
                Ok(())
            }
            Plan::Program(exe) => {
                let bufs = inputs
                    .iter()
                    .enumerate()
                    .map(|(r, b)| self.upload_bytes(b, dtype, r))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&XlaBuffer> = bufs.iter().collect();
                let outs = self.run_program(&exe, kind, dtype, count, &refs)?;
                drop(bufs);
                // The other replicas' results stay on their devices and are freed.
                let out_refs: Vec<&XlaBuffer> = match only {
                    Some(r) => vec![&outs[r]],
                    None => outs.iter().collect(),
                };
                self.inner.download(&out_refs, outputs)
            }
        }
    }

    fn run_program(
        &self,
        exe: &Executable,
        kind: Kind,
        dtype: DType,
        count: usize,
        inputs: &[&XlaBuffer],
    ) -> Result<Vec<XlaBuffer>> {
        let args: Vec<Vec<&XlaBuffer>> = inputs.iter().map(|&b| vec![b]).collect();
        self.run_program_args(exe, kind, dtype, count, &args)
    }

    /// [`Client::run_program`] with `args[r]`, replica r's arguments.
    fn run_program_args(
        &self,
        exe: &Executable,
        kind: Kind,
        dtype: DType,
        count: usize,
        args: &[Vec<&XlaBuffer>],
    ) -> Result<Vec<XlaBuffer>> {
        let n = args.len();
        let what = format!("the {kind} program ({dtype} x {count}) on {n} devices");
        let ptrs = self.inner.execute(exe, args, &what)?;
        let out_count = kind.out_count(count, n);
        Ok(ptrs
            .into_iter()
            .enumerate()
            .map(|(r, p)| self.wrap(p, r, dtype, out_count))
            .collect())
    }

    /// The device-buffer form: checks, then the program or the host-staged path.
    fn device_call(&self, kind: Kind, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
        self.inner.check_usable()?;
        let result = self.check_buffers(kind, inputs).and_then(|(count, dtype)| {
            let n = inputs.len();
            let key = ProgramKey {
                kind,
                dtype,
                count,
                replicas: n,
            };
            match self.plan(key)? {
                Plan::Program(exe) => self.run_program(&exe, kind, dtype, count, inputs),
                Plan::Staged => {
                    self.inner.count_staged();
                    self.inner.count_host_call();
                    let host = self.download_all(inputs, count * dtype.size())?;
                    let srcs: Vec<&[u8]> = host.iter().map(|v| v.bytes()).collect();
                    let result = host_collective(kind, dtype, &srcs);
                    (0..n)
                        .map(|r| self.upload_bytes(result.part(r, n), dtype, r))
                        .collect()
                }
            }
        });
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// Every replica's buffer, `bytes` long, copied to the host.
    fn download_all(&self, bufs: &[&XlaBuffer], bytes: usize) -> Result<Vec<Aligned>> {
        let mut host: Vec<Aligned> = (0..bufs.len()).map(|_| Aligned::zeroed(bytes)).collect();
        let mut dsts: Vec<&mut [u8]> = host.iter_mut().map(|v| v.bytes_mut()).collect();
        self.inner.download(bufs, &mut dsts)?;
        Ok(host)
    }

    /// A variable's update on its copies (`vars[r]` on device r) by the replicas' `updates`:
    /// combined as `kind` says ([`Kind::Update`]), then added or subtracted, in one program.
    /// Returns the copies' new buffers; the old ones are left as they were.
    pub(crate) fn update_buffers(
        &self,
        kind: Kind,
        vars: &[&XlaBuffer],
        updates: &[&XlaBuffer],
    ) -> Result<Vec<XlaBuffer>> {
        self.inner.check_usable()?;
        let Kind::Update { apply, .. } = kind else {
            return Err(Error::config(format!("XLA: {kind} is not an update")));
        };
        let result = (|| {
            let (count, dtype) = self.check_buffers(kind, updates)?;
            let (var_count, var_dtype) = self.check_buffers(kind, vars)?;
            if (var_count, var_dtype) != (count, dtype) {
                return Err(Error::invalid(
                    self.site(kind, 0),
                    format!(
                        "the variable holds {var_count} {var_dtype} elements but its update \
                         {count} {dtype}; they must match"
                    ),
                ));
            }
            let n = updates.len();
            let key = ProgramKey {
                kind,
                dtype,
                count,
                replicas: n,
            };
            match self.plan(key)? {
                Plan::Program(exe) => {
                    let args: Vec<Vec<&XlaBuffer>> =
                        (0..n).map(|r| vec![vars[r], updates[r]]).collect();
                    self.run_program_args(&exe, kind, dtype, count, &args)
                }
                Plan::Staged => {
                    self.inner.count_staged();
                    self.inner.count_host_call();
                    let bytes = count * dtype.size();
                    let ups = self.download_all(updates, bytes)?;
                    let mut copies = self.download_all(vars, bytes)?;
                    let srcs: Vec<&[u8]> = ups.iter().map(|v| v.bytes()).collect();
                    let combined = host_collective(kind, dtype, &srcs);
                    (0..n)
                        .map(|r| {
                            let copy = copies[r].bytes_mut();
                            kernels::apply_update(dtype, copy, combined.part(r, n), apply);
                            self.upload_bytes(copy, dtype, r)
                        })
                        .collect()
                }
            }
        })();
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// The checks of a call on device buffers: its shape and op, and each buffer on its
    /// replica's device of this client, of one dtype. Returns the count and dtype.
    fn check_buffers(&self, kind: Kind, inputs: &[&XlaBuffer]) -> Result<(usize, DType)> {
        let lens: Vec<usize> = inputs.iter().map(|b| b.len()).collect();
        self.check_call(kind, &lens).and_then(|count| {
            let dtype = inputs[0].dtype();
            self.check_op(kind, dtype)?;
            for (r, b) in inputs.iter().enumerate() {
                if !b.same_client(self) {
                    return Err(Error::invalid(
                        self.site(kind, r),
                        format!("the buffer of replica {r} belongs to another client"),
                    ));
                }
                if b.device() != r {
                    return Err(Error::invalid(
                        self.site(kind, r),
                        format!(
                            "the buffer of replica {r} is on device {}; replica r's buffer must be on device r",
                            b.device()
                        ),
                    ));
                }
                if b.dtype() != dtype {
                    return Err(Error::invalid(
                        self.site(kind, r),
                        format!(
                            "the buffer of replica {r} holds {} but replica 0's holds {dtype}",
                            b.dtype()
                        ),
                    ));
                }
            }
            Ok((count, dtype))
        })
    }

    fn host_checked(
        &self,
        kind: Kind,
        dtype: DType,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
    ) -> Result<()> {
        let esize = dtype.size();
        let result = (|| {
            if let Some(r) = inputs
                .iter()
                .map(|b| b.len())
                .chain(outputs.iter().map(|b| b.len()))
                .position(|l| l % esize != 0)
            {
                return Err(Error::config(format!(
                    "XLA {}: buffer {r} is not a whole number of {dtype} elements",
                    kind.name()
                )));
            }
            let lens: Vec<usize> = inputs.iter().map(|b| b.len() / esize).collect();
            let count = self.check_call(kind, &lens)?;
            self.check_op(kind, dtype)?;
            let n = inputs.len();
            let out_lens: Vec<usize> = outputs.iter().map(|b| b.len() / esize).collect();
            self.check_outputs(kind, kind.out_count(count, n), &out_lens, n)?;
            self.host_call(kind, dtype, inputs, outputs, None)
        })();
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// In-place form: `bufs[r]` is replica r's input and output (all-reduce, broadcast).
    fn host_in_place(&self, kind: Kind, dtype: DType, bufs: &mut [&mut [u8]]) -> Result<()> {
        // The inputs are uploaded (or reduced on the host) before any output is written, so
        // reading and writing the same buffers is safe; the copies below only satisfy the
        // borrow rules when a program runs.
        let esize = dtype.size();
        let result = (|| {
            if bufs.iter().any(|b| b.len() % esize != 0) {
                return Err(Error::config(format!(
                    "XLA {}: a buffer is not a whole number of {dtype} elements",
                    kind.name()
                )));
            }
            let lens: Vec<usize> = bufs.iter().map(|b| b.len() / esize).collect();
            let count = self.check_call(kind, &lens)?;
            self.check_op(kind, dtype)?;
            let n = bufs.len();
            let key = ProgramKey {
                kind,
                dtype,
                count,
                replicas: n,
            };
            self.inner.count_host_call();
            match self.plan(key)? {
                Plan::Staged => {
                    self.inner.count_staged();
                    let result = {
                        let srcs: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
                        host_collective(kind, dtype, &srcs)
                    };
                    for (r, out) in bufs.iter_mut().enumerate() {
                        out.copy_from_slice(result.part(r, n));
                    }
                    Ok(())
                }
                Plan::Program(exe) => {
                    let dev = bufs
                        .iter()
                        .enumerate()
                        .map(|(r, b)| self.upload_bytes(b, dtype, r))
                        .collect::<Result<Vec<_>>>()?;
                    let refs: Vec<&XlaBuffer> = dev.iter().collect();
                    let outs = self.run_program(&exe, kind, dtype, count, &refs)?;
                    drop(dev);
                    let out_refs: Vec<&XlaBuffer> = outs.iter().collect();
                    self.inner.download(&out_refs, bufs)
                }
            }
        })();
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        result
    }

    // ------------------------------ host buffers ------------------------------

    /// All-reduce in place: `bufs[r]` is replica r's buffer (on device r), and every buffer
    /// ends as the element-wise `op` over all of them.
    pub fn all_reduce<T: Element>(&self, bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        let mut raw: Vec<&mut [u8]> = bufs
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut(b))
            .collect();
        self.host_in_place(Kind::AllReduce(op), T::DTYPE, &mut raw)
    }

    /// Broadcast in place: every buffer ends as `bufs[root]`.
    pub fn broadcast<T: Element>(&self, bufs: &mut [&mut [T]], root: usize) -> Result<()> {
        let mut raw: Vec<&mut [u8]> = bufs
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut(b))
            .collect();
        self.host_in_place(Kind::Broadcast(root), T::DTYPE, &mut raw)
    }

    /// All-gather: every `outputs[r]` (N × the input count) ends as the inputs in replica order.
    pub fn all_gather<T: Element>(&self, inputs: &[&[T]], outputs: &mut [&mut [T]]) -> Result<()> {
        let ins: Vec<&[u8]> = inputs.iter().map(|b| bytemuck::cast_slice(b)).collect();
        let mut outs: Vec<&mut [u8]> = outputs
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut(b))
            .collect();
        self.host_checked(Kind::AllGather, T::DTYPE, &ins, &mut outs)
    }

    /// Reduce-scatter: `outputs[r]` (input count / N) ends as slice r of the element-wise `op`
    /// over the inputs.
    pub fn reduce_scatter<T: Element>(
        &self,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let ins: Vec<&[u8]> = inputs.iter().map(|b| bytemuck::cast_slice(b)).collect();
        let mut outs: Vec<&mut [u8]> = outputs
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut(b))
            .collect();
        self.host_checked(Kind::ReduceScatter(op), T::DTYPE, &ins, &mut outs)
    }

    /// All-to-all: block j of `inputs[i]` (N equal blocks) lands in block i of `outputs[j]`
    /// (as long as the input).
    pub fn all_to_all<T: Element>(&self, inputs: &[&[T]], outputs: &mut [&mut [T]]) -> Result<()> {
        let ins: Vec<&[u8]> = inputs.iter().map(|b| bytemuck::cast_slice(b)).collect();
        let mut outs: Vec<&mut [u8]> = outputs
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut(b))
            .collect();
        self.host_checked(Kind::AllToAll, T::DTYPE, &ins, &mut outs)
    }

    /// [`Client::all_reduce`] over bytes holding `dtype` elements (for carriers such as the C
    /// ABI).
    pub fn all_reduce_raw(&self, dtype: DType, bufs: &mut [&mut [u8]], op: ReduceOp) -> Result<()> {
        self.all_reduce_in(dtype, bufs, op, false)
    }

    /// [`Client::all_reduce_raw`], reduced in rank order where `ordered`: the bits of tutti's
    /// kernels' one pass over the replicas' buffers in replica order (`((x0 + x1) + x2) ...`;
    /// f16 and bf16 in f32, rounded once), whatever the plugin's own all-reduce would give,
    /// by a program that all-gathers the inputs and reduces them in that order on every device.
    pub fn all_reduce_in(
        &self,
        dtype: DType,
        bufs: &mut [&mut [u8]],
        op: ReduceOp,
        ordered: bool,
    ) -> Result<()> {
        self.check_aligned(dtype, bufs.iter().map(|b| b.as_ptr()))?;
        let kind = if ordered {
            Kind::OrderedAllReduce(op)
        } else {
            Kind::AllReduce(op)
        };
        self.host_in_place(kind, dtype, bufs)
    }

    /// [`Client::broadcast`] over bytes.
    pub fn broadcast_raw(&self, dtype: DType, bufs: &mut [&mut [u8]], root: usize) -> Result<()> {
        self.check_aligned(dtype, bufs.iter().map(|b| b.as_ptr()))?;
        self.host_in_place(Kind::Broadcast(root), dtype, bufs)
    }

    /// [`Client::all_gather`] over bytes.
    pub fn all_gather_raw(
        &self,
        dtype: DType,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
    ) -> Result<()> {
        self.host_checked(Kind::AllGather, dtype, inputs, outputs)
    }

    /// [`Client::reduce_scatter`] over bytes.
    pub fn reduce_scatter_raw(
        &self,
        dtype: DType,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_in(dtype, inputs, outputs, op, false)
    }

    /// [`Client::reduce_scatter_raw`], reduced in rank order where `ordered` (an all-to-all
    /// of the blocks, then each device's block reduced in replica order).
    pub fn reduce_scatter_in(
        &self,
        dtype: DType,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
        op: ReduceOp,
        ordered: bool,
    ) -> Result<()> {
        self.check_aligned(dtype, inputs.iter().map(|b| b.as_ptr()))?;
        let kind = if ordered {
            Kind::OrderedReduceScatter(op)
        } else {
            Kind::ReduceScatter(op)
        };
        self.host_checked(kind, dtype, inputs, outputs)
    }

    /// Gather onto `root`: `output` (N × the input count) ends as the inputs in replica order.
    /// PJRT has no gather: an all-gather whose root's result alone is read back.
    pub(crate) fn gather_raw(
        &self,
        dtype: DType,
        inputs: &[&[u8]],
        root: usize,
        output: &mut [u8],
    ) -> Result<()> {
        let kind = Kind::AllGather;
        let esize = dtype.size();
        let result = (|| {
            let lens: Vec<usize> = inputs.iter().map(|b| b.len() / esize).collect();
            let count = self.check_call(kind, &lens)?;
            let n = inputs.len();
            if root >= n || output.len() != count * n * esize {
                return Err(Error::invalid(
                    self.site(kind, root),
                    format!(
                        "gather: root {root} of {n} replicas with an output of {} bytes, for \
                         {} bytes",
                        output.len(),
                        count * n * esize
                    ),
                ));
            }
            self.host_call(kind, dtype, inputs, &mut [output], Some(root))
        })();
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// [`Client::all_to_all`] over bytes.
    pub fn all_to_all_raw(
        &self,
        dtype: DType,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
    ) -> Result<()> {
        self.host_checked(Kind::AllToAll, dtype, inputs, outputs)
    }

    /// The host-staged path reduces in place with typed kernels, which need aligned elements.
    fn check_aligned(&self, dtype: DType, ptrs: impl Iterator<Item = *const u8>) -> Result<()> {
        for (r, p) in ptrs.enumerate() {
            if (p as usize) % dtype.size() != 0 {
                return Err(Error::config(format!(
                    "XLA: buffer {r} is not aligned to its {dtype} elements"
                )));
            }
        }
        Ok(())
    }

    // ----------------------------- device buffers -----------------------------

    /// All-reduce of device buffers (`inputs[r]` on device r); returns the results, one per
    /// device. The inputs are left as they were.
    pub fn all_reduce_buffers(
        &self,
        inputs: &[&XlaBuffer],
        op: ReduceOp,
    ) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::AllReduce(op), inputs)
    }

    /// [`Client::all_reduce_buffers`] reduced in rank order (see the program module).
    pub fn all_reduce_buffers_ordered(
        &self,
        inputs: &[&XlaBuffer],
        op: ReduceOp,
    ) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::OrderedAllReduce(op), inputs)
    }

    /// Broadcast of device buffers: every result holds `inputs[root]`.
    pub fn broadcast_buffers(&self, inputs: &[&XlaBuffer], root: usize) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::Broadcast(root), inputs)
    }

    /// All-gather of device buffers: every result holds the inputs in replica order.
    pub fn all_gather_buffers(&self, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::AllGather, inputs)
    }

    /// All-to-all of device buffers: result j holds block j of every input, in replica order.
    pub fn all_to_all_buffers(&self, inputs: &[&XlaBuffer]) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::AllToAll, inputs)
    }

    /// Reduce-scatter of device buffers: result r holds slice r of the reduction.
    pub fn reduce_scatter_buffers(
        &self,
        inputs: &[&XlaBuffer],
        op: ReduceOp,
    ) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::ReduceScatter(op), inputs)
    }

    /// [`Client::reduce_scatter_buffers`] reduced in rank order (see the program module).
    pub fn reduce_scatter_buffers_ordered(
        &self,
        inputs: &[&XlaBuffer],
        op: ReduceOp,
    ) -> Result<Vec<XlaBuffer>> {
        self.device_call(Kind::OrderedReduceScatter(op), inputs)
    }
}
