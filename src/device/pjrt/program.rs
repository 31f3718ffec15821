//! The XLA programs behind the collectives: StableHLO text for each (collective, dtype, shape,
//! op, root), and the serialized `xla.CompileOptionsProto` they are compiled with.
//!
//! Every program runs on N replicas (one per device, `num_partitions = 1`) and takes one 1-D
//! argument per replica:
//!
//! * all-reduce: `stablehlo.all_reduce` over the replica group `[0..N)` with `add`, `multiply`,
//!   `minimum` or `maximum`; `Mean` is `add` followed by a division by N (integers truncate
//!   toward zero, as tutti's kernels do).
//! * reduce-scatter: `stablehlo.reduce_scatter` along dimension 0 (the argument holds N × the
//!   result), the same combiners and the same `Mean`.
//! * all-gather: `stablehlo.all_gather` along dimension 0.
//! * all-to-all: `stablehlo.all_to_all` splitting and concatenating dimension 0 in N blocks
//!   (block j of replica i's argument becomes block i of replica j's result).
//! * in rank order (the bitwise-deterministic mode, `Config::deterministic`): reduce-scatter as
//!   `stablehlo.all_to_all` (replica r gets block r of every input, in replica order), then one
//!   chain of the op over the N blocks, `((x0 ⊕ x1) ⊕ x2) ...`; all-reduce as
//!   `stablehlo.all_gather` of every input, then the same chain over the N slices, or (large
//!   inputs, more than 2 replicas: see `scatter_first`) as that reduce-scatter of the input
//!   padded with zeros to N equal blocks (`stablehlo.pad`), then `stablehlo.all_gather` of the
//!   blocks, cut back to the count. f16 and bf16 are widened to
//!   f32 first and rounded once at the end, `Mean` divided in f32: the bits of tutti's kernels'
//!   reduction of the inputs in rank order, whatever the plugin's own collectives would give.
//! * broadcast: a binomial tree of `stablehlo.collective_permute`s. With `q = (replica - root)
//!   mod N`, step k (k = 1, 2, 4, ...) sends from every `q < k` to `q + k`, and the replicas with
//!   `k <= q < 2k` keep what they received (selected by `stablehlo.replica_id`). Every element
//!   is copied bit for bit (NaN payloads and signed zeros included) in ceil(log2 N) steps, each
//!   replica receiving the buffer once.

use std::fmt::Write;

pub use crate::dtype::Apply;
use crate::dtype::{DType, ReduceOp};

/// A collective as compiled: what, with which op or root.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// All-reduce with an op.
    AllReduce(ReduceOp),
    /// Broadcast from a root replica.
    Broadcast(usize),
    /// All-gather.
    AllGather,
    /// Reduce-scatter with an op.
    ReduceScatter(ReduceOp),
    /// All-to-all of equal blocks.
    AllToAll,
    /// All-reduce with an op, reduced in rank order (see the module docs).
    OrderedAllReduce(ReduceOp),
    /// Reduce-scatter with an op, reduced in rank order.
    OrderedReduceScatter(ReduceOp),
    /// A variable's update: two arguments per replica, the variable's copy and the replica's
    /// update. The updates are combined across the replicas (an all-reduce with an op, or a
    /// broadcast from a root), then applied to the copy.
    Update {
        /// How the replicas' updates combine.
        combine: Combine,
        /// How the combined update applies to the copy.
        apply: Apply,
    },
}

/// How a [`Kind::Update`] combines the replicas' updates.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Combine {
    /// An all-reduce with this op.
    Reduce(ReduceOp),
    /// The update of this replica, broadcast.
    From(usize),
}

impl Kind {
    /// The collective's API name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) | Kind::OrderedAllReduce(_) => "all_reduce",
            Kind::Broadcast(_) => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter(_) | Kind::OrderedReduceScatter(_) => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
            Kind::Update { .. } => "update",
        }
    }

    /// The collective as tutti names it in errors.
    pub fn collective(self) -> crate::error::Collective {
        use crate::error::Collective;
        match self {
            Kind::AllReduce(_) | Kind::OrderedAllReduce(_) => Collective::AllReduce,
            Kind::Broadcast(_) => Collective::Broadcast,
            Kind::AllGather => Collective::AllGather,
            Kind::ReduceScatter(_) | Kind::OrderedReduceScatter(_) => Collective::ReduceScatter,
            Kind::AllToAll => Collective::AllToAll,
            Kind::Update {
                combine: Combine::Reduce(_),
                ..
            } => Collective::AllReduce,
            Kind::Update {
                combine: Combine::From(_),
                ..
            } => Collective::Broadcast,
        }
    }

    /// The op of a reducing kind.
    pub fn op(self) -> Option<ReduceOp> {
        match self {
            Kind::AllReduce(op)
            | Kind::ReduceScatter(op)
            | Kind::OrderedAllReduce(op)
            | Kind::OrderedReduceScatter(op)
            | Kind::Update {
                combine: Combine::Reduce(op),
                ..
            } => Some(op),
            _ => None,
        }
    }

    /// The collective that combines the inputs: the kind itself, or an update's combine.
    pub fn combining(self) -> Kind {
        match self {
            Kind::Update {
                combine: Combine::Reduce(op),
                ..
            } => Kind::AllReduce(op),
            Kind::Update {
                combine: Combine::From(root),
                ..
            } => Kind::Broadcast(root),
            k => k,
        }
    }

    /// Elements of each replica's output for `count` input elements on `n` replicas.
    pub fn out_count(self, count: usize, n: usize) -> usize {
        match self {
            Kind::AllGather => count * n,
            Kind::ReduceScatter(_) | Kind::OrderedReduceScatter(_) => count / n.max(1),
            _ => count,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) => write!(f, "{} {op}", self.name()),
            Kind::OrderedAllReduce(op) | Kind::OrderedReduceScatter(op) => {
                write!(f, "{} {op} in rank order", self.name())
            }
            Kind::Broadcast(root) => write!(f, "broadcast from {root}"),
            Kind::AllGather => f.write_str("all_gather"),
            Kind::AllToAll => f.write_str("all_to_all"),
            Kind::Update { apply, .. } => write!(f, "{apply:?} of the {}", self.combining()),
        }
    }
}

/// The MLIR element type of a dtype.
pub fn mlir_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I8 => "i8",
        DType::U8 => "ui8",
        DType::I32 => "i32",
        DType::U32 => "ui32",
        DType::I64 => "i64",
        DType::U64 => "ui64",
    }
}

fn combiner(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => "stablehlo.add",
        ReduceOp::Prod => "stablehlo.multiply",
        ReduceOp::Min => "stablehlo.minimum",
        ReduceOp::Max => "stablehlo.maximum",
        // Integer types only: the client checks the op against the dtype before compiling.
        ReduceOp::BAnd => "stablehlo.and",
        ReduceOp::BOr => "stablehlo.or",
        ReduceOp::BXor => "stablehlo.xor",
    }
}

/// The reduction region of `all_reduce` / `reduce_scatter`.
fn region(op: ReduceOp, et: &str) -> String {
    format!(
        "({{\n    ^bb0(%a: tensor<{et}>, %b: tensor<{et}>):\n      %r = \"{}\"(%a, %b) : (tensor<{et}>, tensor<{et}>) -> tensor<{et}>\n      \"stablehlo.return\"(%r) : (tensor<{et}>) -> ()\n    }})",
        combiner(op)
    )
}

fn group(n: usize) -> String {
    let ids: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    format!("dense<[[{}]]> : tensor<1x{n}xi64>", ids.join(", "))
}

/// `%out = %in / n` for Mean (a splat constant of the element type).
fn divide(body: &mut String, input: &str, out: &str, n: usize, dtype: DType, ty: &str) {
    let lit = if dtype.is_float() {
        format!("{n}.0")
    } else {
        n.to_string()
    };
    let _ = writeln!(
        body,
        "    %divisor = \"stablehlo.constant\"() {{value = dense<{lit}> : {ty}}} : () -> {ty}"
    );
    let _ = writeln!(
        body,
        "    {out} = \"stablehlo.divide\"({input}, %divisor) : ({ty}, {ty}) -> {ty}"
    );
}

/// The StableHLO module of `kind` on `n` replicas, each with `count` input elements of `dtype`.
pub fn mlir(kind: Kind, dtype: DType, count: usize, n: usize) -> String {
    let et = mlir_type(dtype);
    let in_ty = format!("tensor<{count}x{et}>");
    let out_count = kind.out_count(count, n);
    let out_ty = format!("tensor<{out_count}x{et}>");
    let mut body = String::new();
    let (args, result) = match kind {
        Kind::Update { apply, .. } => {
            // %arg0 the variable's copy, %arg1 the update: the combined update goes onto it.
            let combined = combine_body(&mut body, kind, dtype, n, "%arg1", (&in_ty, &out_ty));
            let op = match apply {
                Apply::Add => "add",
                Apply::Subtract => "subtract",
                Apply::Assign => "",
            };
            let result = if op.is_empty() {
                combined
            } else {
                let _ = writeln!(
                    body,
                    "    %updated = \"stablehlo.{op}\"(%arg0, {combined}) : ({in_ty}, {in_ty}) -> {in_ty}"
                );
                "%updated".to_string()
            };
            (format!("%arg0: {in_ty}, %arg1: {in_ty}"), result)
        }
        _ => (
            format!("%arg0: {in_ty}"),
            combine_body(&mut body, kind, dtype, n, "%arg0", (&in_ty, &out_ty)),
        ),
    };
    let mut m = String::new();
    let _ = writeln!(
        m,
        "module @tutti_{} attributes {{mhlo.num_replicas = {n} : i32, mhlo.num_partitions = 1 : i32}} {{",
        kind.name()
    );
    let _ = writeln!(m, "  func.func public @main({args}) -> {out_ty} {{");
    m.push_str(&body);
    let _ = writeln!(m, "    \"func.return\"({result}) : ({out_ty}) -> ()");
    m.push_str("  }\n}\n");
    m
}

/// The collective `kind` over `arg` (of type `in_ty`, giving `out_ty`); returns the name of
/// its result.
fn combine_body(
    body: &mut String,
    kind: Kind,
    dtype: DType,
    n: usize,
    arg: &str,
    (in_ty, out_ty): (&str, &str),
) -> String {
    let et = mlir_type(dtype);
    match kind {
        Kind::AllReduce(op) | Kind::ReduceScatter(op) => {
            let (name, attrs) = match kind {
                Kind::AllReduce(_) => ("stablehlo.all_reduce", String::new()),
                _ => (
                    "stablehlo.reduce_scatter",
                    ", scatter_dimension = 0 : i64".to_string(),
                ),
            };
            let _ = writeln!(
                body,
                "    %0 = \"{name}\"({arg}) {} {{replica_groups = {}{attrs}}} : ({in_ty}) -> {out_ty}",
                region(op, et),
                group(n)
            );
            if op == ReduceOp::Mean {
                divide(body, "%0", "%1", n, dtype, out_ty);
                "%1".into()
            } else {
                "%0".into()
            }
        }
        Kind::AllGather => {
            let _ = writeln!(
                body,
                "    %0 = \"stablehlo.all_gather\"({arg}) {{all_gather_dim = 0 : i64, replica_groups = {}}} : ({in_ty}) -> {out_ty}",
                group(n)
            );
            "%0".into()
        }
        Kind::AllToAll => {
            let _ = writeln!(
                body,
                "    %0 = \"stablehlo.all_to_all\"({arg}) {{split_dimension = 0 : i64, concat_dimension = 0 : i64, split_count = {n} : i64, replica_groups = {}}} : ({in_ty}) -> {out_ty}",
                group(n)
            );
            "%0".into()
        }
        Kind::OrderedReduceScatter(op) => {
            // Replica r gets block r of every replica's input, in replica order.
            let m = count_of(out_ty);
            let all_ty = format!("tensor<{}x{et}>", m * n);
            let _ = writeln!(
                body,
                "    %all = \"stablehlo.all_to_all\"({arg}) {{split_dimension = 0 : i64, concat_dimension = 0 : i64, split_count = {n} : i64, replica_groups = {}}} : ({in_ty}) -> {all_ty}",
                group(n)
            );
            ordered_chain(body, op, dtype, n, m, &all_ty)
        }
        Kind::OrderedAllReduce(op) => {
            let count = count_of(in_ty);
            if !scatter_first(count * dtype.size(), n) {
                // Every replica's input, in replica order, then one chain over them.
                let all_ty = format!("tensor<{}x{et}>", count * n);
                let _ = writeln!(
                    body,
                    "    %all = \"stablehlo.all_gather\"({arg}) {{all_gather_dim = 0 : i64, replica_groups = {}}} : ({in_ty}) -> {all_ty}",
                    group(n)
                );
                return ordered_chain(body, op, dtype, n, count, &all_ty);
            }
            // The ordered reduce-scatter of the input padded to N blocks, then an all-gather
            // of the blocks, cut back: each element is still reduced by one chain in replica
            // order, and each replica moves 2 (N-1)/N of the input, not (N-1) times it.
            let block = count.div_ceil(n).max(1);
            let padded = block * n;
            let padded_ty = format!("tensor<{padded}x{et}>");
            let mut x = arg.to_string();
            if padded != count {
                let zero = if dtype.is_float() { "0.0" } else { "0" };
                let _ = writeln!(
                    body,
                    "    %zero = \"stablehlo.constant\"() {{value = dense<{zero}> : tensor<{et}>}} : () -> tensor<{et}>"
                );
                let _ = writeln!(
                    body,
                    "    %padded = \"stablehlo.pad\"({arg}, %zero) {{edge_padding_low = array<i64: 0>, edge_padding_high = array<i64: {}>, interior_padding = array<i64: 0>}} : ({in_ty}, tensor<{et}>) -> {padded_ty}",
                    padded - count
                );
                x = "%padded".into();
            }
            let _ = writeln!(
                body,
                "    %all = \"stablehlo.all_to_all\"({x}) {{split_dimension = 0 : i64, concat_dimension = 0 : i64, split_count = {n} : i64, replica_groups = {}}} : ({padded_ty}) -> {padded_ty}",
                group(n)
            );
            let mine = ordered_chain(body, op, dtype, n, block, &padded_ty);
            let _ = writeln!(
                body,
                "    %gathered = \"stablehlo.all_gather\"({mine}) {{all_gather_dim = 0 : i64, replica_groups = {}}} : (tensor<{block}x{et}>) -> {padded_ty}",
                group(n)
            );
            if padded == count {
                return "%gathered".into();
            }
            let _ = writeln!(
                body,
                "    %result = \"stablehlo.slice\"(%gathered) {{start_indices = array<i64: 0>, limit_indices = array<i64: {count}>, strides = array<i64: 1>}} : ({padded_ty}) -> {out_ty}"
            );
            "%result".into()
        }
        Kind::Broadcast(root) => broadcast_body(body, root, n, in_ty, arg),
        // `mlir` writes an update around its combine.
        Kind::Update { .. } => combine_body(body, kind.combining(), dtype, n, arg, (in_ty, out_ty)),
    }
}

/// Whether the ordered all-reduce of `bytes` per replica on `n` replicas runs as an ordered
/// reduce-scatter and an all-gather (moving 2 (n-1)/n × `bytes` into each replica) rather than
/// one all-gather of every input ((n-1) × `bytes`, one collective fewer): once the bytes the
/// gather would move beyond the pair's pass 4 MiB, more than a collective's start costs on
/// any fabric measured (on the CPU plugin, 4 devices: 1 MiB inputs are 25% faster gathered,
/// 4 MiB alike, 16 MiB 4x faster scattered first). Never on 2 replicas, where both move
/// the same.
fn scatter_first(bytes: usize, n: usize) -> bool {
    n > 2 && bytes.saturating_mul(n - 1).saturating_mul(n - 2) / n >= 4 << 20
}

/// The elements of a 1-D tensor type `tensor<NxT>`.
fn count_of(ty: &str) -> usize {
    ty.trim_start_matches("tensor<")
        .split('x')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// `op` over the `n` consecutive slices of `m` elements of `%all` (of type `all_ty`), one at a
/// time in slice order (f16 and bf16 in f32, rounded once; `Mean` divided by `n` at the end);
/// returns the name of the result, `m` elements of `dtype`.
fn ordered_chain(
    body: &mut String,
    op: ReduceOp,
    dtype: DType,
    n: usize,
    m: usize,
    all_ty: &str,
) -> String {
    let et = mlir_type(dtype);
    let half = matches!(dtype, DType::F16 | DType::BF16);
    let ty = format!("tensor<{m}x{et}>");
    let wide = if half {
        format!("tensor<{m}xf32>")
    } else {
        ty.clone()
    };
    let mut acc = String::new();
    for r in 0..n {
        let _ = writeln!(
            body,
            "    %s{r} = \"stablehlo.slice\"(%all) {{start_indices = array<i64: {}>, limit_indices = array<i64: {}>, strides = array<i64: 1>}} : ({all_ty}) -> {ty}",
            r * m,
            (r + 1) * m
        );
        let mut x = format!("%s{r}");
        if half {
            let _ = writeln!(
                body,
                "    %w{r} = \"stablehlo.convert\"({x}) : ({ty}) -> {wide}"
            );
            x = format!("%w{r}");
        }
        if r == 0 {
            acc = x;
        } else {
            let _ = writeln!(
                body,
                "    %acc{r} = \"{}\"({acc}, {x}) : ({wide}, {wide}) -> {wide}",
                combiner(op)
            );
            acc = format!("%acc{r}");
        }
    }
    if op == ReduceOp::Mean {
        divide(
            body,
            &acc,
            "%mean",
            n,
            if half { DType::F32 } else { dtype },
            &wide,
        );
        acc = "%mean".into();
    }
    if half {
        let _ = writeln!(
            body,
            "    %ordered = \"stablehlo.convert\"({acc}) : ({wide}) -> {ty}"
        );
        acc = "%ordered".into();
    }
    acc
}

/// The binomial-tree broadcast (see the module docs); returns the name of the result. SSA
/// names are made unique per step by suffixes.
fn broadcast_body(body: &mut String, root: usize, n: usize, ty: &str, arg: &str) -> String {
    let u = "tensor<ui32>";
    let konst = |body: &mut String, name: &str, v: usize| {
        let _ = writeln!(
            body,
            "    {name} = \"stablehlo.constant\"() {{value = dense<{v}> : {u}}} : () -> {u}"
        );
    };
    if n <= 1 {
        return arg.to_string();
    }
    let _ = writeln!(body, "    %id = \"stablehlo.replica_id\"() : () -> {u}");
    konst(body, "%shift", n - root % n);
    konst(body, "%n", n);
    let _ = writeln!(
        body,
        "    %sum = \"stablehlo.add\"(%id, %shift) : ({u}, {u}) -> {u}"
    );
    let _ = writeln!(
        body,
        "    %q = \"stablehlo.remainder\"(%sum, %n) : ({u}, {u}) -> {u}"
    );
    let mut cur = arg.to_string();
    let mut k = 1;
    let mut step = 0;
    while k < n {
        let pairs: Vec<String> = (0..k)
            .filter(|q| q + k < n)
            .map(|q| format!("[{}, {}]", (root + q) % n, (root + q + k) % n))
            .collect();
        let _ = writeln!(
            body,
            "    %recv{step} = \"stablehlo.collective_permute\"({cur}) {{source_target_pairs = dense<[{}]> : tensor<{}x2xi64>}} : ({ty}) -> {ty}",
            pairs.join(", "),
            pairs.len()
        );
        konst(body, &format!("%lo{step}"), k);
        konst(body, &format!("%hi{step}"), 2 * k);
        for (name, dir, bound) in [("ge", "GE", "lo"), ("lt", "LT", "hi")] {
            let _ = writeln!(
                body,
                "    %{name}{step} = \"stablehlo.compare\"(%q, %{bound}{step}) {{comparison_direction = #stablehlo<comparison_direction {dir}>, compare_type = #stablehlo<comparison_type UNSIGNED>}} : ({u}, {u}) -> tensor<i1>"
            );
        }
        let _ = writeln!(
            body,
            "    %take{step} = \"stablehlo.and\"(%ge{step}, %lt{step}) : (tensor<i1>, tensor<i1>) -> tensor<i1>"
        );
        let next = if k * 2 >= n {
            "%cur".to_string()
        } else {
            format!("%cur{step}")
        };
        let _ = writeln!(
            body,
            "    {next} = \"stablehlo.select\"(%take{step}, %recv{step}, {cur}) : (tensor<i1>, {ty}, {ty}) -> {ty}"
        );
        cur = next;
        k *= 2;
        step += 1;
    }
    "%cur".to_string()
}

// ------------------------------- optimizer steps -------------------------------

/// An optimizer's update rule, run elementwise on one device by [`step_mlir`]'s program: its
/// hyper-parameters as the bits of their f32 values, so that programs are keyed by them. The
/// learning rate is not among them: it is the program's argument, so that a rate that changes
/// from step to step (a schedule) runs one program.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// `w -= lr * g`; with momentum `mu`, `v = mu * v - lr * g; w += v` (Nesterov:
    /// `w += mu * v - lr * g`).
    Sgd {
        /// Momentum (0: plain SGD, no slot).
        momentum: u32,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam: `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g g`, `w -= lr sqrt(1 - b2^t) /
    /// (1 - b1^t) m / (sqrt(v) + epsilon)`.
    Adam {
        /// First moment's decay.
        beta_1: u32,
        /// Second moment's decay.
        beta_2: u32,
        /// Added to the root of the second moment.
        epsilon: u32,
    },
}

impl Step {
    /// The slots it keeps beside the variable (momentum; Adam's `m` and `v`), each as long as
    /// the variable, in the step's arithmetic ([`step_arith`]).
    pub fn slots(self) -> usize {
        match self {
            Step::Sgd { momentum, .. } if f32::from_bits(momentum) == 0.0 => 0,
            Step::Sgd { .. } => 1,
            Step::Adam { .. } => 2,
        }
    }

    /// Whether it keeps Adam's powers `[b1^t, b2^t]` (two elements in the step's arithmetic,
    /// `[1, 1]` before the first step) after its slots.
    pub fn powers(self) -> bool {
        matches!(self, Step::Adam { .. })
    }
}

/// The arithmetic a step on a variable of `dtype` runs in: f64 for f64, f32 otherwise (f16 and
/// bf16 are widened, stepped, and rounded once).
pub fn step_arith(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The bits of `x` (an f32 hyper-parameter, or a value computed from them in the step's
/// arithmetic) as an MLIR hexadecimal float literal of `arith`: exact, where a decimal literal
/// might round.
fn literal(x: f64, arith: DType) -> String {
    if arith == DType::F64 {
        format!("0x{:016X}", x.to_bits())
    } else {
        format!("0x{:08X}", (x as f32).to_bits())
    }
}

/// The StableHLO module of `step` on one device for a variable of `count` elements of `dtype`
/// (a float type). Its arguments: the variable's copy, the gradient (both `dtype`), the learning
/// rate (one element of the step's arithmetic), then each slot and Adam's powers (the step's
/// arithmetic); its results: the new copy, slots and powers.
/// The operations are the host rule's, in its order, and a constant such as `1 - b1` is
/// computed as the host computes it and given bit for bit; but Adam's `b^t` is a running
/// product here (the host takes `powi`), and the compiler may fuse operations, so results agree
/// with the host's to rounding, not bit for bit.
pub fn step_mlir(step: Step, dtype: DType, count: usize) -> String {
    step_module(step, dtype, count, 1)
}

/// [`step_mlir`] fused with the gradient's all-reduce, on `replicas` replicas (one per
/// device): each replica's arguments as [`step_mlir`]'s, its gradient summed across the
/// replicas (in `dtype`, as the all-reduce of the gradient alone sums it) before the step; its
/// results [`step_mlir`]'s, then the summed gradient.
pub fn step_group_mlir(step: Step, dtype: DType, count: usize, replicas: usize) -> String {
    step_module(step, dtype, count, replicas.max(1))
}

/// [`step_mlir`] (one replica) or [`step_group_mlir`] (several).
fn step_module(step: Step, dtype: DType, count: usize, replicas: usize) -> String {
    let arith = step_arith(dtype);
    let (et, ct) = (mlir_type(dtype), mlir_type(arith));
    let (vt, wt) = (
        format!("tensor<{count}x{ct}>"),
        format!("tensor<{count}x{et}>"),
    );
    let wide = arith == DType::F64;
    // A hyper-parameter as the host rule reads it: f32, widened for f64 arithmetic.
    let hyper = |bits: u32| f64::from(f32::from_bits(bits));
    // `1 - x` in the step's arithmetic.
    let one_minus = |x: f64| {
        if wide {
            1.0 - x
        } else {
            f64::from(1.0f32 - x as f32)
        }
    };
    let mut b = String::new();
    // Several replicas: the gradient argument is this replica's, `%g` the replicas' sum.
    let grad_arg = if replicas > 1 {
        let _ = writeln!(
            b,
            "    %g = \"stablehlo.all_reduce\"(%g0) {} {{replica_groups = {}}} : ({wt}) -> {wt}",
            region(ReduceOp::Sum, mlir_type(dtype)),
            group(replicas)
        );
        "g0"
    } else {
        "g"
    };
    let konst = |b: &mut String, name: &str, x: f64| {
        let _ = writeln!(
            b,
            "    %{name} = \"stablehlo.constant\"() {{value = dense<{}> : {vt}}} : () -> {vt}",
            literal(x, arith)
        );
    };
    let bin = |b: &mut String, out: &str, op: &str, x: &str, y: &str, ty: &str| {
        let _ = writeln!(
            b,
            "    %{out} = \"stablehlo.{op}\"(%{x}, %{y}) : ({ty}, {ty}) -> {ty}"
        );
    };
    let (w, g) = if dtype == arith {
        ("w", "g")
    } else {
        for x in ["w", "g"] {
            let _ = writeln!(
                b,
                "    %{x}c = \"stablehlo.convert\"(%{x}) : ({wt}) -> {vt}"
            );
        }
        ("wc", "gc")
    };
    let t1 = format!("tensor<1x{ct}>");
    let mut args = vec![
        format!("%w: {wt}"),
        format!("%{grad_arg}: {wt}"),
        format!("%lr1: {t1}"),
    ];
    let mut results = vec![];
    match step {
        Step::Sgd { momentum, nesterov } => {
            let _ = writeln!(
                b,
                "    %lr = \"stablehlo.broadcast_in_dim\"(%lr1) {{broadcast_dimensions = array<i64: 0>}} : ({t1}) -> {vt}"
            );
            bin(&mut b, "lg", "multiply", "lr", g, &vt);
            if step.slots() == 0 {
                bin(&mut b, "w1", "subtract", w, "lg", &vt);
            } else {
                args.push(format!("%s0: {vt}"));
                konst(&mut b, "mu", hyper(momentum));
                bin(&mut b, "mv", "multiply", "mu", "s0", &vt);
                bin(&mut b, "v1", "subtract", "mv", "lg", &vt);
                if nesterov {
                    bin(&mut b, "mv1", "multiply", "mu", "v1", &vt);
                    bin(&mut b, "d", "subtract", "mv1", "lg", &vt);
                    bin(&mut b, "w1", "add", w, "d", &vt);
                } else {
                    bin(&mut b, "w1", "add", w, "v1", &vt);
                }
                results.push(("v1", vt.clone()));
            }
        }
        Step::Adam {
            beta_1,
            beta_2,
            epsilon,
        } => {
            args.extend([
                format!("%s0: {vt}"),
                format!("%s1: {vt}"),
                format!("%p: tensor<2x{ct}>"),
            ]);
            let (b1, b2) = (hyper(beta_1), hyper(beta_2));
            let t2 = format!("tensor<2x{ct}>");
            // The powers after this step, and lr * sqrt(1 - b2^t) / (1 - b1^t) from them.
            let _ = writeln!(
                b,
                "    %bb = \"stablehlo.constant\"() {{value = dense<[{}, {}]> : {t2}}} : () -> {t2}",
                literal(b1, arith),
                literal(b2, arith)
            );
            let _ = writeln!(
                b,
                "    %one2 = \"stablehlo.constant\"() {{value = dense<{}> : {t2}}} : () -> {t2}",
                literal(1.0, arith)
            );
            bin(&mut b, "p1", "multiply", "p", "bb", &t2);
            bin(&mut b, "q", "subtract", "one2", "p1", &t2);
            for (k, name) in ["q0", "q1"].iter().enumerate() {
                let _ = writeln!(
                    b,
                    "    %{name} = \"stablehlo.slice\"(%q) {{start_indices = array<i64: {k}>, limit_indices = array<i64: {}>, strides = array<i64: 1>}} : ({t2}) -> {t1}",
                    k + 1
                );
            }
            let _ = writeln!(b, "    %sq = \"stablehlo.sqrt\"(%q1) : ({t1}) -> {t1}");
            bin(&mut b, "a", "multiply", "lr1", "sq", &t1);
            bin(&mut b, "lrt1", "divide", "a", "q0", &t1);
            let _ = writeln!(
                b,
                "    %lrt = \"stablehlo.broadcast_in_dim\"(%lrt1) {{broadcast_dimensions = array<i64: 0>}} : ({t1}) -> {vt}"
            );
            konst(&mut b, "b1", b1);
            konst(&mut b, "c1", one_minus(b1));
            konst(&mut b, "b2", b2);
            konst(&mut b, "c2", one_minus(b2));
            konst(&mut b, "eps", hyper(epsilon));
            bin(&mut b, "ma", "multiply", "b1", "s0", &vt);
            bin(&mut b, "mb", "multiply", "c1", g, &vt);
            bin(&mut b, "m1", "add", "ma", "mb", &vt);
            bin(&mut b, "va", "multiply", "b2", "s1", &vt);
            bin(&mut b, "vb0", "multiply", "c2", g, &vt);
            bin(&mut b, "vb", "multiply", "vb0", g, &vt);
            bin(&mut b, "v1", "add", "va", "vb", &vt);
            bin(&mut b, "num", "multiply", "lrt", "m1", &vt);
            let _ = writeln!(b, "    %sv = \"stablehlo.sqrt\"(%v1) : ({vt}) -> {vt}");
            bin(&mut b, "den", "add", "sv", "eps", &vt);
            bin(&mut b, "u", "divide", "num", "den", &vt);
            bin(&mut b, "w1", "subtract", w, "u", &vt);
            results.extend([("m1", vt.clone()), ("v1", vt.clone()), ("p1", t2)]);
        }
    }
    let w_out = if dtype == arith {
        "w1"
    } else {
        let _ = writeln!(b, "    %wt = \"stablehlo.convert\"(%w1) : ({vt}) -> {wt}");
        "wt"
    };
    results.insert(0, (w_out, wt.clone()));
    if replicas > 1 {
        results.push(("g", wt.clone()));
    }
    let names: Vec<String> = results.iter().map(|(n, _)| format!("%{n}")).collect();
    let types: Vec<&str> = results.iter().map(|(_, t)| t.as_str()).collect();
    let mut m = String::new();
    let _ = writeln!(
        m,
        "module @tutti_step attributes {{mhlo.num_replicas = {replicas} : i32, mhlo.num_partitions = 1 : i32}} {{"
    );
    let _ = writeln!(
        m,
        "  func.func public @main({}) -> ({}) {{",
        args.join(", "),
        types.join(", ")
    );
    m.push_str(&b);
    let _ = writeln!(
        m,
        "    \"func.return\"({}) : ({}) -> ()",
        names.join(", "),
        types.join(", ")
    );
    m.push_str("  }\n}\n");
    m
}

// --------------------------- xla.CompileOptionsProto -------------------------

fn varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn field_varint(out: &mut Vec<u8>, field: u32, v: i64) {
    varint(out, u64::from(field) << 3);
    // int32/int64 fields encode negative values as their 64-bit two's complement.
    varint(out, v as u64);
}

fn field_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, (u64::from(field) << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A serialized `xla.CompileOptionsProto` for `device_ids.len()` replicas of one partition,
/// replica r on the device with PJRT id `device_ids[r]`:
///
/// ```text
/// CompileOptionsProto {
///   executable_build_options (3) {
///     device_ordinal (1): -1
///     num_replicas (4): N
///     num_partitions (5): 1
///     device_assignment (9) {          // DeviceAssignmentProto
///       replica_count (1): N
///       computation_count (2): 1
///       computation_devices (3) { replica_device_ids (1): [ids...] }
///     }
///   }
/// }
/// ```
pub fn compile_options(device_ids: &[i64]) -> Vec<u8> {
    let n = device_ids.len() as i64;
    let mut ids = Vec::new();
    for &id in device_ids {
        varint(&mut ids, id as u64);
    }
    let mut computation = Vec::new();
    field_bytes(&mut computation, 1, &ids);
    let mut assignment = Vec::new();
    field_varint(&mut assignment, 1, n);
    field_varint(&mut assignment, 2, 1);
    field_bytes(&mut assignment, 3, &computation);
    let mut build = Vec::new();
    field_varint(&mut build, 1, -1);
    field_varint(&mut build, 4, n);
    field_varint(&mut build, 5, 1);
    field_bytes(&mut build, 9, &assignment);
    let mut options = Vec::new();
    field_bytes(&mut options, 3, &build);
    options
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_encode_like_protobuf() {
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
        let mut v = Vec::new();
        field_varint(&mut v, 1, -1);
        assert_eq!(v.len(), 11);
        assert_eq!(v[0], 0x08);
        assert_eq!(
            &v[1..],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn compile_options_bytes() {
        let b = compile_options(&[0, 1]);
        // field 3, length-delimited
        assert_eq!(b[0], 0x1a);
        assert_eq!(b[1] as usize, b.len() - 2);
        let inner = &b[2..];
        // device_ordinal -1, num_replicas 2, num_partitions 1
        assert_eq!(inner[0], 0x08);
        assert_eq!(&inner[11..15], &[0x20, 2, 0x28, 1]);
        // device_assignment: replica_count 2, computation_count 1, devices [0, 1]
        assert_eq!(
            &inner[15..],
            &[0x4a, 10, 0x08, 2, 0x10, 1, 0x1a, 4, 0x0a, 2, 0, 1]
        );
    }

    #[test]
    fn step_programs_carry_their_state_and_exact_constants() {
        let adam = Step::Adam {
            beta_1: 0.9f32.to_bits(),
            beta_2: 0.999f32.to_bits(),
            epsilon: 1e-7f32.to_bits(),
        };
        assert_eq!((adam.slots(), adam.powers()), (2, true));
        let m = step_mlir(adam, DType::BF16, 5);
        assert!(
            m.contains("@main(%w: tensor<5xbf16>, %g: tensor<5xbf16>, %lr1: tensor<1xf32>, %s0: tensor<5xf32>, %s1: tensor<5xf32>, %p: tensor<2xf32>)")
                && m.contains("-> (tensor<5xbf16>, tensor<5xf32>, tensor<5xf32>, tensor<2xf32>)")
                && m.contains("\"stablehlo.convert\"(%w1)")
                && m.contains(&format!("dense<0x{:08X}>", (1.0f32 - 0.9).to_bits())),
            "{m}"
        );
        // f64 arithmetic: the f32 hyper-parameter widened, exactly; the learning rate in it.
        let m = step_mlir(adam, DType::F64, 3);
        assert!(
            m.contains(&format!("dense<0x{:016X}>", f64::from(0.9f32).to_bits()))
                && m.contains("%lr1: tensor<1xf64>")
                && !m.contains("convert"),
            "{m}"
        );
        let sgd = Step::Sgd {
            momentum: 0f32.to_bits(),
            nesterov: false,
        };
        assert_eq!((sgd.slots(), sgd.powers()), (0, false));
        // Fused with the gradient's all-reduce on 4 replicas: the sum steps, and is returned.
        let m = step_group_mlir(adam, DType::BF16, 5, 4);
        assert!(
            m.contains("mhlo.num_replicas = 4")
                && m.contains("@main(%w: tensor<5xbf16>, %g0: tensor<5xbf16>, %lr1: tensor<1xf32>,")
                && m.contains("%g = \"stablehlo.all_reduce\"(%g0)")
                && m.contains("dense<[[0, 1, 2, 3]]>")
                && m.contains("\"stablehlo.convert\"(%g)")
                && m.contains("-> (tensor<5xbf16>, tensor<5xf32>, tensor<5xf32>, tensor<2xf32>, tensor<5xbf16>)")
                && m.contains("\"func.return\"(%wt, %m1, %v1, %p1, %g)"),
            "{m}"
        );
        let m = step_mlir(sgd, DType::F32, 4);
        assert!(
            m.contains("-> (tensor<4xf32>)")
                && m.contains("\"stablehlo.subtract\"(%w, %lg)")
                && m.contains("(%lr1) {broadcast_dimensions = array<i64: 0>} : (tensor<1xf32>) -> tensor<4xf32>")
                && !m.contains("stablehlo.constant"),
            "{m}"
        );
    }

    #[test]
    fn programs_name_their_ops() {
        let m = mlir(Kind::AllReduce(ReduceOp::Mean), DType::BF16, 8, 4);
        assert!(m.contains("stablehlo.all_reduce"), "{m}");
        assert!(
            m.contains("tensor<8xbf16>") && m.contains("stablehlo.divide"),
            "{m}"
        );
        assert!(m.contains("dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>"), "{m}");
        let m = mlir(Kind::ReduceScatter(ReduceOp::Max), DType::U32, 8, 4);
        assert!(
            m.contains("-> tensor<2xui32>") && m.contains("stablehlo.maximum"),
            "{m}"
        );
        for (op, name) in [
            (ReduceOp::BAnd, "stablehlo.and"),
            (ReduceOp::BOr, "stablehlo.or"),
            (ReduceOp::BXor, "stablehlo.xor"),
        ] {
            let m = mlir(Kind::AllReduce(op), DType::I64, 8, 2);
            assert!(m.contains(&format!("\"{name}\"(%a, %b)")), "{m}");
            assert!(m.contains("tensor<8xi64>") && !m.contains("divide"), "{m}");
        }
        let m = mlir(Kind::AllGather, DType::I8, 3, 4);
        assert!(m.contains("(tensor<3xi8>) -> tensor<12xi8>"), "{m}");
        // In rank order: the inputs gathered (or their blocks exchanged), then one chain of
        // the op over the slices, in f32 for bf16, rounded once.
        let m = mlir(Kind::OrderedAllReduce(ReduceOp::Mean), DType::BF16, 8, 3);
        assert!(m.contains("(tensor<8xbf16>) -> tensor<24xbf16>"), "{m}");
        assert!(m.contains("start_indices = array<i64: 16>"), "{m}");
        assert!(
            m.contains("%acc2 = \"stablehlo.add\"(%acc1, %w2) : (tensor<8xf32>"),
            "{m}"
        );
        assert_eq!(m.matches("stablehlo.convert").count(), 4, "{m}");
        // A large one: 1000001 padded to 8 blocks of 125001, exchanged, chained, the blocks
        // gathered and cut back; 2 replicas always gather.
        let m = mlir(
            Kind::OrderedAllReduce(ReduceOp::Sum),
            DType::F32,
            1_000_001,
            8,
        );
        assert!(m.contains("edge_padding_high = array<i64: 7>"), "{m}");
        assert!(
            m.contains("(tensor<1000008xf32>) -> tensor<1000008xf32>"),
            "{m}"
        );
        assert!(m.contains("start_indices = array<i64: 875007>"), "{m}");
        assert!(
            m.contains("(tensor<125001xf32>) -> tensor<1000008xf32>"),
            "{m}"
        );
        assert!(
            m.contains("-> tensor<1000001xf32>\n") && m.contains("%result"),
            "{m}"
        );
        // 16 MiB on 4: exchanged first, in blocks that need no padding.
        let m = mlir(
            Kind::OrderedAllReduce(ReduceOp::Sum),
            DType::I32,
            1 << 22,
            4,
        );
        assert!(m.contains("all_to_all"), "{m}");
        assert!(!m.contains("pad") && !m.contains("%result"), "{m}");
        let m = mlir(
            Kind::OrderedAllReduce(ReduceOp::Sum),
            DType::I32,
            1 << 24,
            2,
        );
        assert!(!m.contains("all_to_all"), "{m}");
        let m = mlir(Kind::OrderedReduceScatter(ReduceOp::Prod), DType::F32, 8, 4);
        assert!(
            m.contains("stablehlo.all_to_all") && m.contains("-> tensor<8xf32>"),
            "{m}"
        );
        assert!(
            m.contains("%acc3 = \"stablehlo.multiply\"(%acc2, %s3) : (tensor<2xf32>"),
            "{m}"
        );
        // Broadcast from 2 on 5 replicas: steps 1, 2, 4 relative to the root.
        let m = mlir(Kind::Broadcast(2), DType::F32, 4, 5);
        assert!(m.contains("dense<[[2, 3]]> : tensor<1x2xi64>"), "{m}");
        assert!(
            m.contains("dense<[[2, 4], [3, 0]]> : tensor<2x2xi64>"),
            "{m}"
        );
        assert!(m.contains("dense<[[2, 1]]> : tensor<1x2xi64>"), "{m}");
        assert_eq!(m.matches("collective_permute").count(), 3);
        // An update: the variable and the update per replica, the updates combined, applied.
        let m = mlir(
            Kind::Update {
                combine: Combine::Reduce(ReduceOp::Mean),
                apply: Apply::Subtract,
            },
            DType::F32,
            6,
            2,
        );
        assert!(
            m.contains("@main(%arg0: tensor<6xf32>, %arg1: tensor<6xf32>)")
                && m.contains("\"stablehlo.all_reduce\"(%arg1)")
                && m.contains("stablehlo.divide")
                && m.contains("\"stablehlo.subtract\"(%arg0, %1)"),
            "{m}"
        );
        let m = mlir(
            Kind::Update {
                combine: Combine::From(1),
                apply: Apply::Assign,
            },
            DType::I32,
            4,
            3,
        );
        assert!(
            m.contains("collective_permute\"(%arg1)")
                && !m.contains("stablehlo.add\"(%arg0")
                && m.contains("\"func.return\"(%cur)"),
            "{m}"
        );
    }
}
