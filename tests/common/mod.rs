//! Shared helpers of the integration tests.
#![allow(dead_code)]

use tutti::{bf16, f16, DType, Element};

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

/// Run `$body` with `T` bound to each element type.
#[macro_export]
macro_rules! for_each_dtype {
    ($dtype:expr, $T:ident => $body:block) => {
        match $dtype {
            tutti::DType::F32 => {
                type $T = f32;
                $body
            }
            tutti::DType::F64 => {
                type $T = f64;
                $body
            }
            tutti::DType::F16 => {
                type $T = tutti::f16;
                $body
            }
            tutti::DType::BF16 => {
                type $T = tutti::bf16;
                $body
            }
            tutti::DType::I8 => {
                type $T = i8;
                $body
            }
            tutti::DType::U8 => {
                type $T = u8;
                $body
            }
            tutti::DType::I32 => {
                type $T = i32;
                $body
            }
            tutti::DType::U32 => {
                type $T = u32;
                $body
            }
            tutti::DType::I64 => {
                type $T = i64;
                $body
            }
            tutti::DType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

pub fn _types(_: f16, _: bf16) {}
