//! Element types and reduce operations.
//!
//! The public API is generic over [`Element`]; inside, buffers travel as bytes plus a [`DType`] so
//! that the algorithms and transports are written once, not once per type. The reduce kernels in
//! [`kernels`] switch on the `DType` once per call and then run a monomorphic, vectorizable loop.

pub mod kernels;

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

/// The runtime tag of an element type.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary64.
    F64 = 1,
    /// IEEE 754 binary16 (`half::f16`).
    F16 = 2,
    /// bfloat16 (`half::bf16`).
    BF16 = 3,
    /// Signed 8-bit integer.
    I8 = 4,
    /// Unsigned 8-bit integer.
    U8 = 5,
    /// Signed 32-bit integer.
    I32 = 6,
    /// Unsigned 32-bit integer.
    U32 = 7,
    /// Signed 64-bit integer.
    I64 = 8,
    /// Unsigned 64-bit integer.
    U64 = 9,
}

impl DType {
    /// Every element type, in tag order.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The name used on the command line and in JSON (`f32`, `bf16`, `i64`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The tag with this numeric value (as used by the C ABI).
    pub fn from_u32(v: u32) -> Option<DType> {
        DType::ALL.get(v as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.to_ascii_lowercase();
        let alias = match l.as_str() {
            "float" | "float32" => "f32",
            "double" | "float64" => "f64",
            "half" | "float16" => "f16",
            "bfloat16" => "bf16",
            "int8" => "i8",
            "uint8" => "u8",
            "int32" | "int" => "i32",
            "uint32" => "u32",
            "int64" => "i64",
            "uint64" => "u64",
            other => other,
        };
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == alias)
            .ok_or_else(|| {
                format!("unknown dtype '{s}' (expected one of f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64)")
            })
    }
}

/// A reduce operation.
///
/// * `Sum`, `Prod`: integers wrap on overflow (two's complement), as in C and NCCL.
/// * `Min`, `Max`: for floats, IEEE 754 `minNum`/`maxNum`: a NaN loses against a number.
/// * `Mean`: `Sum` divided by the number of ranks taking part. Integer `Mean` divides the wrapped
///   sum and truncates toward zero (`-7 / 2 == -3`); float `Mean` divides once, after the sum.
///   `avg` (torch's and NCCL's name) parses as `Mean`.
/// * `BAnd`, `BOr`, `BXor`: bitwise AND, OR and XOR, on the integer types only (as MPI's
///   `MPI_BAND`... and torch's `ReduceOp.BAND`...). On a float type they are an argument error
///   ([`ReduceOp::check`]), raised before anything is sent.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum = 0,
    /// Element-wise product.
    Prod = 1,
    /// Element-wise minimum.
    Min = 2,
    /// Element-wise maximum.
    Max = 3,
    /// Element-wise sum divided by the number of ranks.
    Mean = 4,
    /// Element-wise bitwise AND (integer types only).
    BAnd = 5,
    /// Element-wise bitwise OR (integer types only).
    BOr = 6,
    /// Element-wise bitwise XOR (integer types only).
    BXor = 7,
}

impl ReduceOp {
    /// [`ReduceOp::Mean`] by the name torch and NCCL give it (`ReduceOp.AVG`, `ncclAvg`).
    ///
    /// ```
    /// assert_eq!(tutti::ReduceOp::AVG, tutti::ReduceOp::Mean);
    /// ```
    pub const AVG: ReduceOp = ReduceOp::Mean;

    /// Every op, in tag order.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Mean,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// The name used on the command line and in JSON.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Mean => "mean",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// True for the bitwise ops (`BAnd`, `BOr`, `BXor`), which only the integer types have.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Whether `self` is defined on `dtype`: every op is, on the integer types; the bitwise ops
    /// are not on the float types. The error names the op and the type
    /// (`band is defined on integer types only, not f32`).
    pub fn check(self, dtype: DType) -> Result<(), String> {
        if self.is_bitwise() && dtype.is_float() {
            return Err(format!(
                "{self} is defined on integer types only, not {dtype}"
            ));
        }
        Ok(())
    }

    /// The op with this numeric value (as used by the C ABI).
    pub fn from_u32(v: u32) -> Option<ReduceOp> {
        ReduceOp::ALL.get(v as usize).copied()
    }

    /// The op applied while combining partial results: `Mean` combines as `Sum`.
    pub(crate) const fn combining(self) -> ReduceOp {
        match self {
            ReduceOp::Mean => ReduceOp::Sum,
            o => o,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.to_ascii_lowercase();
        let alias = match l.as_str() {
            "avg" | "average" => "mean",
            "product" => "prod",
            other => other,
        };
        ReduceOp::ALL
            .iter()
            .copied()
            .find(|o| o.name() == alias)
            .ok_or_else(|| {
                format!("unknown reduce op '{s}' (expected sum, prod, min, max, mean, avg, band, bor or bxor)")
            })
    }
}

/// How a variable's combined update applies to its copy.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Apply {
    /// `copy + update`.
    Add,
    /// `copy - update`.
    Subtract,
    /// `update`.
    Assign,
}

/// Run a block with a type alias bound to the Rust type of a runtime [`DType`]:
/// `for_each_dtype!(dtype, T => { size_of::<T>() })`.
#[macro_export]
macro_rules! for_each_dtype {
    ($dtype:expr, $T:ident => $body:block) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

mod sealed {
    /// Keeps [`Element`](super::Element) to the ten types tutti knows: unnameable on purpose.
    #[allow(unnameable_types)]
    pub trait Sealed {}
}

/// A Rust type that tutti can reduce and move: one of the ten [`DType`]s.
pub trait Element:
    bytemuck::Pod + PartialEq + PartialOrd + fmt::Debug + Send + Sync + sealed::Sealed + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// The value as an `f64` (exact for every type but the 64-bit integers beyond 2^53).
    fn to_f64(self) -> f64;
    /// The nearest value of this type to `v` (integers saturate).
    fn from_f64(v: f64) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr, |$x:ident| $to:expr, |$v:ident| $from:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn to_f64(self) -> f64 {
                let $x = self;
                $to
            }
            #[inline]
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}

element!(f32, DType::F32, |x| x as f64, |v| v as f32);
element!(f64, DType::F64, |x| x, |v| v);
element!(f16, DType::F16, |x| x.to_f64(), |v| f16::from_f64(v));
element!(bf16, DType::BF16, |x| x.to_f64(), |v| bf16::from_f64(v));
element!(i8, DType::I8, |x| x as f64, |v| v as i8);
element!(u8, DType::U8, |x| x as f64, |v| v as u8);
element!(i32, DType::I32, |x| x as f64, |v| v as i32);
element!(u32, DType::U32, |x| x as f64, |v| v as u32);
element!(i64, DType::I64, |x| x as f64, |v| v as i64);
element!(u64, DType::U64, |x| x as f64, |v| v as u64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_u32(d as u32), Some(d));
        }
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
        }
        assert!("f8".parse::<DType>().unwrap_err().contains("f8"));
        assert_eq!(DType::from_u32(10), None);
        assert_eq!(ReduceOp::from_u32(8), None);
        assert_eq!(ReduceOp::from_u32(5), Some(ReduceOp::BAnd));
        assert_eq!(ReduceOp::from_u32(7), Some(ReduceOp::BXor));
        assert_eq!("avg".parse::<ReduceOp>().unwrap(), ReduceOp::Mean);
        assert_eq!("BXOR".parse::<ReduceOp>().unwrap(), ReduceOp::BXor);
        let e = "nand".parse::<ReduceOp>().unwrap_err();
        assert!(e.contains("nand") && e.contains("band"), "{e}");
    }

    #[test]
    fn bitwise_ops_are_integer_only() {
        for d in DType::ALL {
            for o in ReduceOp::ALL {
                let r = o.check(d);
                assert_eq!(r.is_err(), o.is_bitwise() && d.is_float(), "{o} on {d}");
            }
        }
        assert_eq!(
            ReduceOp::BAnd.check(DType::F32).unwrap_err(),
            "band is defined on integer types only, not f32"
        );
        assert_eq!(
            ReduceOp::BXor.check(DType::BF16).unwrap_err(),
            "bxor is defined on integer types only, not bf16"
        );
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::U64.size(), std::mem::size_of::<u64>());
        assert_eq!(<i8 as Element>::DTYPE, DType::I8);
    }
}
