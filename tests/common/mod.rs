//! Shared helpers of the integration tests.
#![allow(dead_code)]

use tutti::{DType, Element};

/// Small integral values (exact in every type, even f16 products of 8 of them): rank r,
/// element i.
pub fn value<T: Element>(r: usize, i: usize) -> T {
    let v = ((i * 7 + r * 3 + 1) % 5) as f64;
    let signed = !matches!(T::DTYPE, DType::U8 | DType::U32 | DType::U64);
    T::from_f64(if signed { v - 2.0 } else { v })
}

/// Rank r's buffer of `count` elements.
pub fn data<T: Element>(r: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| value::<T>(r, i)).collect()
}
