//! Reduce kernels over byte slices.
//!
//! One entry point, [`reduce`], combines any number of source slices into a destination:
//! `dst = dst ⊕ s0 ⊕ s1 ⊕ …` ([`Init::Accumulate`]) or `dst = s0 ⊕ s1 ⊕ …` ([`Init::Overwrite`]),
//! optionally followed by a division (the last step of `Mean`). The `DType` and the op are matched
//! once per call; the inner loops are plain element-wise loops over typed slices that LLVM
//! vectorizes (`vaddps`/`vminps`/`vpaddd`... on x86-64, checked with `cargo asm`-style disassembly).
//!
//! With more than one source the work is blocked so that the destination block stays in L1 while
//! every source streams through it once: memory traffic is one read of each source and one write
//! of the destination, whatever the number of sources.
//!
//! ## f16 and bf16
//! Half-precision inputs are widened to f32 block by block (F16C when the CPU has it, detected at
//! run time), combined in f32 across *all* sources of the call, divided (for `Mean`) in f32, and
//! rounded back to half precision once, at the end. A reduction of P buffers in one call therefore
//! rounds once, not P-1 times. Algorithms that combine partial results hop by hop (the ring) round
//! once per hop, as every ring implementation that sends partial sums in the wire type does.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::{Apply, DType, Element, ReduceOp};

/// What the destination holds before a [`reduce`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Init {
    /// The destination is an input: `dst = dst ⊕ srcs…`.
    Accumulate,
    /// The destination is overwritten: `dst = srcs…` (at least one source).
    Overwrite,
}

/// Elements per block when the destination is revisited by several sources: 8 KiB of f64 or
/// 4 KiB of f32 accumulators, well inside L1.
const BLOCK: usize = 1024;

/// Combine `srcs` into `dst` with `op` (see [`Init`]), then divide by `divide_by` if given.
///
/// `op` must be a combining op: pass `ReduceOp::Sum` with `divide_by = Some(n)` for a mean (a
/// `Mean` passed here is treated as `Sum`). Every slice must have the same length, a multiple of
/// `dtype.size()`; slices of other lengths are a bug in the caller and panic.
///
/// The bitwise ops (`BAnd`, `BOr`, `BXor`) are for the integer types; the communicator rejects
/// them on a float type before a call starts ([`ReduceOp::check`]). Given a float type anyway,
/// they combine the bit patterns of its elements (as the unsigned integer of the same size),
/// never widened, so that the result is still defined.
pub fn reduce(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &[&[u8]],
    init: Init,
    divide_by: Option<usize>,
) {
    let op = op.combining();
    for s in srcs {
        assert_eq!(
            s.len(),
            dst.len(),
            "reduce: source and destination lengths differ"
        );
    }
    assert!(
        init == Init::Accumulate || !srcs.is_empty(),
        "reduce: Overwrite needs a source"
    );
    macro_rules! native {
        ($t:ty) => {{
            let d: &mut [$t] = bytemuck::cast_slice_mut(dst);
            let mut typed: [&[$t]; 16] = [&[]; 16];
            if srcs.len() <= typed.len() {
                for (t, s) in typed.iter_mut().zip(srcs) {
                    *t = bytemuck::cast_slice(s);
                }
                reduce_native::<$t>(op, d, &typed[..srcs.len()], init, divide_by)
            } else {
                let typed: Vec<&[$t]> = srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
                reduce_native::<$t>(op, d, &typed, init, divide_by)
            }
        }};
    }
    match dtype {
        // Bitwise ops on a float type: on the bits (see above), never through f32 widening.
        DType::F32 if op.is_bitwise() => native!(u32),
        DType::F64 if op.is_bitwise() => native!(u64),
        DType::F16 | DType::BF16 if op.is_bitwise() => native!(u16),
        DType::F32 => native!(f32),
        DType::F64 => native!(f64),
        DType::I8 => native!(i8),
        DType::U8 => native!(u8),
        DType::I32 => native!(i32),
        DType::U32 => native!(u32),
        DType::I64 => native!(i64),
        DType::U64 => native!(u64),
        DType::F16 => reduce_half::<f16>(op, dst, srcs, init, divide_by),
        DType::BF16 => reduce_half::<bf16>(op, dst, srcs, init, divide_by),
    }
}

/// Divide every element of `buf` by `n` (the last step of `Mean` when it is not fused into a
/// [`reduce`]). Integers truncate toward zero.
pub fn divide(dtype: DType, buf: &mut [u8], n: usize) {
    reduce(dtype, ReduceOp::Sum, buf, &[], Init::Accumulate, Some(n));
}

/// A variable's update, element-wise: `var + update`, `var - update` or `update` as `apply`
/// says, as the element type adds and subtracts (the sum as [`reduce`] adds; a difference of
/// f16 or bf16 in f32, rounded once; integers wrap), as XLA's `add` and `subtract` do. `var`
/// and `update` have one length (the callers check it).
pub(crate) fn apply_update(dtype: DType, var: &mut [u8], update: &[u8], apply: Apply) {
    debug_assert_eq!(var.len(), update.len());
    macro_rules! sub {
        ($t:ty, |$x:ident, $y:ident| $e:expr) => {{
            let u = bytemuck::cast_slice::<u8, $t>(update);
            for ($x, &$y) in bytemuck::cast_slice_mut::<u8, $t>(var).iter_mut().zip(u) {
                *$x = $e;
            }
        }};
    }
    match (apply, dtype) {
        (Apply::Assign, _) => var.copy_from_slice(update),
        (Apply::Add, _) => reduce(dtype, ReduceOp::Sum, var, &[update], Init::Accumulate, None),
        (Apply::Subtract, DType::F32) => sub!(f32, |x, y| *x - y),
        (Apply::Subtract, DType::F64) => sub!(f64, |x, y| *x - y),
        (Apply::Subtract, DType::F16) => {
            sub!(f16, |x, y| f16::from_f32(x.to_f32() - y.to_f32()))
        }
        (Apply::Subtract, DType::BF16) => {
            sub!(bf16, |x, y| bf16::from_f32(x.to_f32() - y.to_f32()))
        }
        (Apply::Subtract, DType::I8) => sub!(i8, |x, y| x.wrapping_sub(y)),
        (Apply::Subtract, DType::U8) => sub!(u8, |x, y| x.wrapping_sub(y)),
        (Apply::Subtract, DType::I32) => sub!(i32, |x, y| x.wrapping_sub(y)),
        (Apply::Subtract, DType::U32) => sub!(u32, |x, y| x.wrapping_sub(y)),
        (Apply::Subtract, DType::I64) => sub!(i64, |x, y| x.wrapping_sub(y)),
        (Apply::Subtract, DType::U64) => sub!(u64, |x, y| x.wrapping_sub(y)),
    }
}

/// Whether `factor` can scale `dtype` elements ([`scale`]): any finite number for the float
/// types; for the integer types a whole number the type holds. The error says why not.
pub fn check_scale(dtype: DType, factor: f64) -> Result<(), String> {
    if !factor.is_finite() {
        return Err(format!("the factor {factor} is not a finite number"));
    }
    if dtype.is_float() {
        return Ok(());
    }
    let held = crate::for_each_dtype!(dtype, T => { T::from_f64(factor).to_f64() == factor });
    if factor.fract() != 0.0 || !held {
        return Err(format!(
            "the factor {factor} is not a whole number {dtype} holds (integer elements scale by \
             integers)"
        ));
    }
    Ok(())
}

/// Multiply every element of `buf` by `factor` as the element type multiplies: the factor is
/// first made a `dtype` value, floats then round the product once (f16 and bf16 as f32
/// multiplies them), integers wrap. [`check_scale`] must accept the factor.
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) {
    macro_rules! floats {
        ($t:ty) => {{
            let f = <$t as Element>::from_f64(factor).to_f64();
            for x in bytemuck::cast_slice_mut::<u8, $t>(buf) {
                // Exact in f64 for every type but f64 itself, whose product is its own.
                *x = <$t as Element>::from_f64(x.to_f64() * f);
            }
        }};
    }
    macro_rules! ints {
        ($t:ty) => {{
            let f = <$t as Element>::from_f64(factor);
            for x in bytemuck::cast_slice_mut::<u8, $t>(buf) {
                *x = x.wrapping_mul(f);
            }
        }};
    }
    match dtype {
        DType::F32 => floats!(f32),
        DType::F64 => floats!(f64),
        DType::F16 => floats!(f16),
        DType::BF16 => floats!(bf16),
        DType::I8 => ints!(i8),
        DType::U8 => ints!(u8),
        DType::I32 => ints!(i32),
        DType::U32 => ints!(u32),
        DType::I64 => ints!(i64),
        DType::U64 => ints!(u64),
    }
}

/// Element arithmetic used by the kernels. Integers wrap.
trait Arith: Copy + bytemuck::Pod {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div_n(a: Self, n: usize) -> Self;
    /// Bitwise AND, OR, XOR (integers; a float's are on its bits, see [`reduce`]).
    fn and(a: Self, b: Self) -> Self;
    fn or(a: Self, b: Self) -> Self;
    fn xor(a: Self, b: Self) -> Self;
}

macro_rules! arith_float {
    ($t:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                a.min(b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                a.max(b)
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                a / n as $t
            }
            #[inline(always)]
            fn and(a: Self, b: Self) -> Self {
                <$t>::from_bits(a.to_bits() & b.to_bits())
            }
            #[inline(always)]
            fn or(a: Self, b: Self) -> Self {
                <$t>::from_bits(a.to_bits() | b.to_bits())
            }
            #[inline(always)]
            fn xor(a: Self, b: Self) -> Self {
                <$t>::from_bits(a.to_bits() ^ b.to_bits())
            }
        }
    };
}
arith_float!(f32);
arith_float!(f64);

macro_rules! arith_int {
    ($t:ty, $wide:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                // Divide in the wide type so that a world size above the type's range is right.
                (a as $wide / n as $wide) as $t
            }
            #[inline(always)]
            fn and(a: Self, b: Self) -> Self {
                a & b
            }
            #[inline(always)]
            fn or(a: Self, b: Self) -> Self {
                a | b
            }
            #[inline(always)]
            fn xor(a: Self, b: Self) -> Self {
                a ^ b
            }
        }
    };
}
arith_int!(i8, i64);
arith_int!(u8, u64);
arith_int!(u16, u64);
arith_int!(i32, i64);
arith_int!(u32, u64);
arith_int!(i64, i64);
arith_int!(u64, u64);

/// `d = d ⊕ s`, one monomorphic loop per op.
#[inline(always)]
fn combine2<T: Arith>(op: ReduceOp, d: &mut [T], s: &[T]) {
    let s = &s[..d.len()];
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            d.iter_mut().zip(s).for_each(|(x, y)| *x = T::add(*x, *y))
        }
        ReduceOp::Prod => d.iter_mut().zip(s).for_each(|(x, y)| *x = T::mul(*x, *y)),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(x, y)| *x = T::min(*x, *y)),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(x, y)| *x = T::max(*x, *y)),
        ReduceOp::BAnd => d.iter_mut().zip(s).for_each(|(x, y)| *x = T::and(*x, *y)),
        ReduceOp::BOr => d.iter_mut().zip(s).for_each(|(x, y)| *x = T::or(*x, *y)),
        ReduceOp::BXor => d.iter_mut().zip(s).for_each(|(x, y)| *x = T::xor(*x, *y)),
    }
}

/// `d = a ⊕ b`.
#[inline(always)]
fn combine3<T: Arith>(op: ReduceOp, d: &mut [T], a: &[T], b: &[T]) {
    let (a, b) = (&a[..d.len()], &b[..d.len()]);
    let it = d.iter_mut().zip(a.iter().zip(b));
    match op {
        ReduceOp::Sum | ReduceOp::Mean => it.for_each(|(x, (p, q))| *x = T::add(*p, *q)),
        ReduceOp::Prod => it.for_each(|(x, (p, q))| *x = T::mul(*p, *q)),
        ReduceOp::Min => it.for_each(|(x, (p, q))| *x = T::min(*p, *q)),
        ReduceOp::Max => it.for_each(|(x, (p, q))| *x = T::max(*p, *q)),
        ReduceOp::BAnd => it.for_each(|(x, (p, q))| *x = T::and(*p, *q)),
        ReduceOp::BOr => it.for_each(|(x, (p, q))| *x = T::or(*p, *q)),
        ReduceOp::BXor => it.for_each(|(x, (p, q))| *x = T::xor(*p, *q)),
    }
}

#[inline(always)]
fn divide_all<T: Arith>(d: &mut [T], n: usize) {
    d.iter_mut().for_each(|x| *x = T::div_n(*x, n));
}

/// Reduce one contiguous range (no blocking): used per block, or for the whole slice when the
/// destination is visited only once.
#[inline(always)]
fn reduce_range<T: Arith>(
    op: ReduceOp,
    d: &mut [T],
    srcs: &[&[T]],
    init: Init,
    div: Option<usize>,
    lo: usize,
) {
    let hi = lo + d.len();
    let rest = match (init, srcs) {
        (Init::Accumulate, _) => srcs,
        (Init::Overwrite, [a, b, rest @ ..]) => {
            combine3(op, d, &a[lo..hi], &b[lo..hi]);
            rest
        }
        (Init::Overwrite, [a, rest @ ..]) => {
            d.copy_from_slice(&a[lo..hi]);
            rest
        }
        (Init::Overwrite, []) => unreachable!("checked by reduce"),
    };
    for s in rest {
        combine2(op, d, &s[lo..hi]);
    }
    if let Some(n) = div {
        divide_all(d, n);
    }
}

/// Run `$body` compiled for AVX2 when the CPU has it (detected once, at run time), else for the
/// baseline target. The helpers it calls are `#[inline(always)]`, so they are compiled twice too.
macro_rules! dispatch {
    ($name:ident<$t:ident: $bound:ident>($($arg:ident: $ty:ty),*) $body:block) => {
        fn $name<$t: $bound>($($arg: $ty),*) {
            #[inline(always)]
            fn body<$t: $bound>($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2<$t: $bound>($($arg: $ty),*) {
                    body::<$t>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
                    // SAFETY: the CPU has the features `avx2` was compiled for.
                    return unsafe { avx2::<$t>($($arg),*) };
                }
            }
            body::<$t>($($arg),*)
        }
    };
}

dispatch!(reduce_native<T: Arith>(op: ReduceOp, dst: &mut [T], srcs: &[&[T]], init: Init, div: Option<usize>) {
    reduce_native_body(op, dst, srcs, init, div)
});

#[inline(always)]
fn reduce_native_body<T: Arith>(
    op: ReduceOp,
    dst: &mut [T],
    srcs: &[&[T]],
    init: Init,
    div: Option<usize>,
) {
    // Visits of the destination: one per source beyond the first pass, plus the division.
    let visits = srcs.len() + usize::from(div.is_some()) - usize::from(init == Init::Overwrite);
    if visits <= 1 {
        return reduce_range(op, dst, srcs, init, div, 0);
    }
    for (i, d) in dst.chunks_mut(BLOCK).enumerate() {
        reduce_range(op, d, srcs, init, div, i * BLOCK);
    }
}

/// Widening to f32 and back for the 16-bit float types.
trait Half: Copy + bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl Half for bf16 {
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which vectorizes.
        let bits: &[u16] = bytemuck::cast_slice(src);
        dst.iter_mut()
            .zip(bits)
            .for_each(|(d, b)| *d = f32::from_bits((*b as u32) << 16));
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        // Round to nearest even; NaNs stay quiet NaNs. Branch-free so that it vectorizes.
        let bits: &mut [u16] = bytemuck::cast_slice_mut(dst);
        bits.iter_mut().zip(src).for_each(|(b, f)| {
            let x = f.to_bits();
            let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
            let is_nan = (x & 0x7fff_ffff) > 0x7f80_0000;
            *b = if is_nan {
                ((x >> 16) | 0x40) as u16
            } else {
                rounded as u16
            };
        });
    }
}

dispatch!(reduce_half<H: Half>(op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]], init: Init, div: Option<usize>) {
    reduce_half_body::<H>(op, dst, srcs, init, div)
});

#[inline(always)]
fn reduce_half_body<H: Half>(
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &[&[u8]],
    init: Init,
    div: Option<usize>,
) {
    let dst: &mut [H] = bytemuck::cast_slice_mut(dst);
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    for (i, d) in dst.chunks_mut(BLOCK).enumerate() {
        let (lo, n) = (i * BLOCK, d.len());
        let src = |k: usize| -> &[H] { &bytemuck::cast_slice(srcs[k])[lo..lo + n] };
        let acc = &mut acc[..n];
        let tmp = &mut tmp[..n];
        let first = match init {
            Init::Accumulate => {
                H::widen(d, acc);
                0
            }
            Init::Overwrite => {
                H::widen(src(0), acc);
                1
            }
        };
        for k in first..srcs.len() {
            H::widen(src(k), tmp);
            combine2(op, acc, tmp);
        }
        if let Some(n) = div {
            divide_all(acc, n);
        }
        H::narrow(acc, d);
    }
}

/// Narrow the f32 elements of `src` into `wire` (`F16` or `BF16`) elements in `dst` (half its
/// length), rounding to nearest even: what a compressed wire carries (`crate::Compression`).
pub fn narrow_f32(wire: DType, src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), 2 * dst.len(), "narrow_f32: lengths differ");
    let src: &[f32] = bytemuck::cast_slice(src);
    match wire {
        DType::F16 => narrow_all::<f16>(src, bytemuck::cast_slice_mut(dst)),
        DType::BF16 => narrow_all::<bf16>(src, bytemuck::cast_slice_mut(dst)),
        other => panic!("narrow_f32: {other} is not a 16-bit float type"),
    }
}

/// Widen the `wire` elements of `incoming` to f32 and combine them into the f32 elements of
/// `dst` (twice its length): `dst = base ⊕ incoming` with a base (as long as `dst`), else
/// `dst = dst ⊕ incoming`; with no op, `dst = incoming`. One pass, in f32.
pub fn widen_f32(
    wire: DType,
    op: Option<ReduceOp>,
    dst: &mut [u8],
    base: Option<&[u8]>,
    incoming: &[u8],
) {
    assert_eq!(dst.len(), 2 * incoming.len(), "widen_f32: lengths differ");
    let d: &mut [f32] = bytemuck::cast_slice_mut(dst);
    let b: Option<&[f32]> = base.map(|b| {
        assert_eq!(b.len(), 4 * d.len(), "widen_f32: base length differs");
        bytemuck::cast_slice(b)
    });
    let op = op.map(ReduceOp::combining);
    match wire {
        DType::F16 => widen_all::<f16>(op, d, b, bytemuck::cast_slice(incoming)),
        DType::BF16 => widen_all::<bf16>(op, d, b, bytemuck::cast_slice(incoming)),
        other => panic!("widen_f32: {other} is not a 16-bit float type"),
    }
}

dispatch!(narrow_all<H: Half>(src: &[f32], dst: &mut [H]) {
    H::narrow(src, dst)
});

dispatch!(widen_all<H: Half>(op: Option<ReduceOp>, d: &mut [f32], base: Option<&[f32]>, incoming: &[H]) {
    let mut tmp = [0f32; BLOCK];
    for (i, d) in d.chunks_mut(BLOCK).enumerate() {
        let (lo, n) = (i * BLOCK, d.len());
        let Some(op) = op else {
            H::widen(&incoming[lo..lo + n], d);
            continue;
        };
        let tmp = &mut tmp[..n];
        H::widen(&incoming[lo..lo + n], tmp);
        match base {
            Some(b) => combine3(op, d, &b[lo..lo + n], tmp),
            None => combine2(op, d, tmp),
        }
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn sum_many_sources_blocks_correctly() {
        let n = 3 * BLOCK + 5;
        let a: Vec<i32> = (0..n as i32).collect();
        let b: Vec<i32> = (0..n as i32).map(|x| 2 * x).collect();
        let c: Vec<i32> = vec![-1; n];
        let mut d = vec![0u8; n * 4];
        reduce(
            DType::I32,
            ReduceOp::Sum,
            &mut d,
            &[&bytes(&a), &bytes(&b), &bytes(&c)],
            Init::Overwrite,
            None,
        );
        let d: &[i32] = bytemuck::cast_slice(&d);
        for (i, x) in d.iter().enumerate() {
            assert_eq!(*x, 3 * i as i32 - 1);
        }
    }

    #[test]
    fn integer_mean_truncates_toward_zero_and_wraps() {
        let mut d = bytes(&[-7i8, 7, 127]);
        reduce(
            DType::I8,
            ReduceOp::Sum,
            &mut d,
            &[&bytes(&[0i8, 0, 1])],
            Init::Accumulate,
            Some(2),
        );
        // 127 + 1 wraps to -128, then -128 / 2 = -64.
        assert_eq!(bytemuck::cast_slice::<u8, i8>(&d), &[-3, 3, -64]);
        let mut d = bytes(&[10u8]);
        divide(DType::U8, &mut d, 300);
        assert_eq!(d, [0]);
    }

    #[test]
    fn half_types_round_once() {
        // 2048 + 1 + 1 is 2050 exactly; f16 spacing at 2048 is 2, so pairwise rounding
        // (2048 + 1 -> 2048, + 1 -> 2048) would lose both ones.
        let x = [f16::from_f32(2048.0)];
        let one = [f16::from_f32(1.0)];
        let mut d = vec![0u8; 2];
        reduce(
            DType::F16,
            ReduceOp::Sum,
            &mut d,
            &[&bytes(&x), &bytes(&one), &bytes(&one)],
            Init::Overwrite,
            None,
        );
        assert_eq!(bytemuck::cast_slice::<u8, f16>(&d)[0].to_f32(), 2050.0);
        let x = [bf16::from_f32(3.0), bf16::NAN, bf16::from_f32(-1.5)];
        let mut d = bytes(&x);
        reduce(
            DType::BF16,
            ReduceOp::Max,
            &mut d,
            &[&bytes(&[bf16::from_f32(4.0); 3])],
            Init::Accumulate,
            None,
        );
        let r: &[bf16] = bytemuck::cast_slice(&d);
        assert_eq!(r[0].to_f32(), 4.0);
        assert_eq!(r[1].to_f32(), 4.0, "maxNum: a NaN loses against a number");
        assert_eq!(r[2].to_f32(), 4.0);
    }

    #[test]
    fn bf16_narrow_rounds_to_nearest_even() {
        for v in [
            1.0f32,
            f32::from_bits(0x3f80_8000), // 1 + 2^-8: a tie, rounds down to even
            f32::from_bits(0x3f81_8000), // 1 + 3·2^-8: a tie, rounds up to even
            -3.3,
            65504.0,
            1e-30,
            f32::INFINITY,
        ] {
            let mut out = [bf16::ZERO];
            bf16::narrow(&[v], &mut out);
            assert_eq!(out[0], bf16::from_f32(v), "{v}");
        }
        let mut out = [bf16::ZERO];
        bf16::narrow(&[f32::NAN], &mut out);
        assert!(out[0].is_nan());
    }

    /// Every integer type, every bitwise op, one to many sources (blocked past `BLOCK`), both
    /// inits, against a plain fold.
    #[test]
    fn bitwise_ops_on_every_integer_type() {
        fn check<T>(dtype: DType, mk: impl Fn(u64) -> T)
        where
            T: bytemuck::Pod + PartialEq + std::fmt::Debug,
            T: std::ops::BitAnd<Output = T> + std::ops::BitOr<Output = T>,
            T: std::ops::BitXor<Output = T>,
        {
            let n = BLOCK + 7;
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
                for k in 1..5 {
                    let srcs: Vec<Vec<T>> = (0..k)
                        .map(|_| (0..n).map(|_| mk(next())).collect())
                        .collect();
                    let f = |a: T, b: T| match op {
                        ReduceOp::BAnd => a & b,
                        ReduceOp::BOr => a | b,
                        _ => a ^ b,
                    };
                    let want: Vec<T> = (0..n)
                        .map(|i| srcs[1..].iter().fold(srcs[0][i], |a, s| f(a, s[i])))
                        .collect();
                    let b: Vec<Vec<u8>> = srcs.iter().map(|s| bytes(s)).collect();
                    let refs: Vec<&[u8]> = b.iter().map(|v| v.as_slice()).collect();
                    let mut d = vec![0u8; n * size_of::<T>()];
                    reduce(dtype, op, &mut d, &refs, Init::Overwrite, None);
                    assert_eq!(bytemuck::cast_slice::<u8, T>(&d), want, "{op} {dtype} {k}");
                    let mut d = b[0].clone();
                    reduce(dtype, op, &mut d, &refs[1..], Init::Accumulate, None);
                    assert_eq!(bytemuck::cast_slice::<u8, T>(&d), want, "{op} {dtype} {k}");
                }
            }
        }
        check(DType::I8, |v| v as i8);
        check(DType::U8, |v| v as u8);
        check(DType::I32, |v| v as i32);
        check(DType::U32, |v| v as u32);
        check(DType::I64, |v| v as i64);
        check(DType::U64, |v| v);
    }

    /// A bitwise op on a float type (rejected before a call; see `reduce`) combines the bits.
    #[test]
    fn bitwise_ops_on_floats_combine_bits() {
        let mut d = bytes(&[f32::from_bits(0xff00_ff00)]);
        let s = bytes(&[f32::from_bits(0x0ff0_0ff0)]);
        reduce(
            DType::F32,
            ReduceOp::BXor,
            &mut d,
            &[&s],
            Init::Accumulate,
            None,
        );
        assert_eq!(bytemuck::cast_slice::<u8, u32>(&d), &[0xf0f0_f0f0]);
        let mut d = bytes(&[0xff00u16]);
        let s = bytes(&[0x0ff0u16]);
        reduce(
            DType::BF16,
            ReduceOp::BAnd,
            &mut d,
            &[&s],
            Init::Accumulate,
            None,
        );
        assert_eq!(bytemuck::cast_slice::<u8, u16>(&d), &[0x0f00]);
    }

    #[test]
    fn updates_add_subtract_and_assign_as_the_element_type() {
        let mut v = [3u8, 200];
        apply_update(DType::U8, &mut v, &[5, 100], Apply::Subtract);
        assert_eq!(v, [254, 100], "integers wrap, as XLA's subtract");
        apply_update(DType::U8, &mut v, &[2, 200], Apply::Add);
        assert_eq!(v, [0, 44]);
        let mut big = [i64::MAX - 1];
        apply_update(
            DType::I64,
            bytemuck::cast_slice_mut(&mut big),
            bytemuck::cast_slice(&[-3i64]),
            Apply::Subtract,
        );
        assert_eq!(big, [i64::MIN + 1]);
        let mut h = [f16::from_f32(1.0)];
        let d = [f16::from_f32(0.000_1)];
        apply_update(
            DType::F16,
            bytemuck::cast_slice_mut(&mut h),
            bytemuck::cast_slice(&d),
            Apply::Subtract,
        );
        assert_eq!(h[0], f16::from_f32(1.0 - f16::from_f32(0.000_1).to_f32()));
        let mut f = [1.5f32, -2.0];
        apply_update(
            DType::F32,
            bytemuck::cast_slice_mut(&mut f),
            bytemuck::cast_slice(&[0.25f32, 1.0]),
            Apply::Assign,
        );
        assert_eq!(f, [0.25, 1.0]);
    }

    #[test]
    fn float_min_max_prod() {
        let mut d = bytes(&[1.0f64, -2.0, 3.0]);
        reduce(
            DType::F64,
            ReduceOp::Prod,
            &mut d,
            &[&bytes(&[2.0f64, 2.0, 0.5])],
            Init::Accumulate,
            None,
        );
        assert_eq!(bytemuck::cast_slice::<u8, f64>(&d), &[2.0, -4.0, 1.5]);
        let mut d = vec![0u8; 12];
        reduce(
            DType::F32,
            ReduceOp::Min,
            &mut d,
            &[&bytes(&[1.0f32, 5.0, -1.0]), &bytes(&[2.0f32, 4.0, -2.0])],
            Init::Overwrite,
            None,
        );
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[1.0, 4.0, -2.0]);
    }
}
