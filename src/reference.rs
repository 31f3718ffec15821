//! A naive reference for every collective, used by `tutti perf` to count wrong elements and by
//! the tests.
//!
//! It computes in `f64` for floats (then rounds once to the element type) and in the element type
//! with wrapping arithmetic for integers, over the inputs in rank order. `Mean` is the sum divided
//! by the number of inputs (integers: wrapped sum, truncated toward zero). The bitwise ops are
//! computed on the integer types; on a float type (which the communicator rejects) on the bits, as
//! the kernels do.

use crate::dtype::{DType, Element, ReduceOp};

fn fold_f64(op: ReduceOp, vals: impl Iterator<Item = f64>, n: usize) -> f64 {
    let mut it = vals;
    let first = it.next().unwrap_or(0.0);
    let r = it.fold(first, |a, b| match op {
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        // Not reached: `reduce` runs the bitwise ops of the float types on their bits.
        ReduceOp::BAnd => f64::from_bits(a.to_bits() & b.to_bits()),
        ReduceOp::BOr => f64::from_bits(a.to_bits() | b.to_bits()),
        ReduceOp::BXor => f64::from_bits(a.to_bits() ^ b.to_bits()),
    });
    if op == ReduceOp::Mean {
        r / n as f64
    } else {
        r
    }
}

macro_rules! fold_int {
    ($t:ty, $wide:ty, $op:expr, $vals:expr, $n:expr) => {{
        let mut it = $vals;
        let first: $t = it.next().unwrap_or(0);
        let r = it.fold(first, |a: $t, b: $t| match $op {
            ReduceOp::Sum | ReduceOp::Mean => a.wrapping_add(b),
            ReduceOp::Prod => a.wrapping_mul(b),
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::BAnd => a & b,
            ReduceOp::BOr => a | b,
            ReduceOp::BXor => a ^ b,
        });
        if $op == ReduceOp::Mean {
            (r as $wide / $n as $wide) as $t
        } else {
            r
        }
    }};
}

/// Element-wise reduction of `inputs` (all the same length).
pub fn reduce<T: Element>(inputs: &[&[T]], op: ReduceOp) -> Vec<T> {
    let n = inputs.len();
    let len = inputs.first().map_or(0, |i| i.len());
    let col = move |i: usize| inputs.iter().map(move |x| x[i]);
    macro_rules! ints {
        ($t:ty, $wide:ty) => {
            (0..len)
                .map(|i| {
                    let v = fold_int!($t, $wide, op, col(i).map(|x| bytemuck::cast::<T, $t>(x)), n);
                    bytemuck::cast::<$t, T>(v)
                })
                .collect()
        };
    }
    match T::DTYPE {
        DType::I8 => ints!(i8, i64),
        DType::U8 => ints!(u8, u64),
        DType::I32 => ints!(i32, i64),
        DType::U32 => ints!(u32, u64),
        DType::I64 => ints!(i64, i64),
        DType::U64 => ints!(u64, u64),
        DType::F16 | DType::BF16 if op.is_bitwise() => ints!(u16, u64),
        DType::F32 if op.is_bitwise() => ints!(u32, u64),
        DType::F64 if op.is_bitwise() => ints!(u64, u64),
        _ => (0..len)
            .map(|i| T::from_f64(fold_f64(op, col(i).map(T::to_f64), n)))
            .collect(),
    }
}

/// The tolerance for a float result of `op` over `ranks` inputs whose magnitudes are at most
/// `scale`: algorithms may sum in another order and round per hop (f16, bf16 in the ring).
pub fn tolerance(dtype: DType, op: ReduceOp, ranks: usize, scale: f64) -> f64 {
    let eps = match dtype {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F32 => 2f64.powi(-23),
        DType::F64 => 2f64.powi(-52),
        _ => return 0.0,
    };
    let magnitude = match op {
        ReduceOp::Prod => scale.powi(ranks as i32),
        ReduceOp::Sum => scale * ranks as f64,
        _ => scale,
    };
    // One rounding per hop, plus the final rounding.
    magnitude.max(1.0) * eps * (ranks as f64 + 1.0)
}

/// Count the elements of `got` that differ from `want` by more than `tol` (exactly, for
/// integers; NaN matches NaN).
pub fn count_errors<T: Element>(got: &[T], want: &[T], tol: f64) -> usize {
    if got.len() != want.len() {
        return got.len().max(want.len());
    }
    got.iter()
        .zip(want)
        .filter(|(g, w)| {
            if !T::DTYPE.is_float() {
                return g != w;
            }
            let (g, w) = (g.to_f64(), w.to_f64());
            !(g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol)
        })
        .count()
}
