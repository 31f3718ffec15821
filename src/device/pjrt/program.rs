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
            Kind::AllReduce(_) => "all_reduce",
            Kind::Broadcast(_) => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter(_) => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
            Kind::Update { .. } => "update",
        }
    }

    /// The collective as tutti names it in errors.
    pub fn collective(self) -> crate::error::Collective {
        use crate::error::Collective;
        match self {
            Kind::AllReduce(_) => Collective::AllReduce,
            Kind::Broadcast(_) => Collective::Broadcast,
            Kind::AllGather => Collective::AllGather,
            Kind::ReduceScatter(_) => Collective::ReduceScatter,
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
            Kind::ReduceScatter(_) => count / n.max(1),
            _ => count,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) => write!(f, "{} {op}", self.name()),
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
        Kind::Broadcast(root) => broadcast_body(body, root, n, in_ty, arg),
        // `mlir` writes an update around its combine.
        Kind::Update { .. } => combine_body(body, kind.combining(), dtype, n, arg, (in_ty, out_ty)),
    }
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
