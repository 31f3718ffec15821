//! The enums of the C ABI: element types, reduce ops, algorithms, device kinds.
//!
//! Each enum is declared twice for C: `enum tutti_dtype { TUTTI_DTYPE_F32, ... }` for the names,
//! and `typedef uint32_t tutti_dtype` for what crosses the boundary, so that a value C passes is
//! always a plain integer here and is range-checked before use (an out-of-range value never
//! becomes a Rust enum).

use tutti::{Algorithm, DType, ReduceOp};

use crate::error::Failure;

/// Element types. Every collective takes a count of elements of one of these.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[allow(dead_code)] // Named for C in the header; values arrive here as integers.
pub enum TuttiDtype {
    /// IEEE 754 binary32 (`float`).
    TUTTI_DTYPE_F32 = 0,
    /// IEEE 754 binary64 (`double`).
    TUTTI_DTYPE_F64 = 1,
    /// IEEE 754 binary16 (`_Float16`), stored as `uint16_t` bits.
    TUTTI_DTYPE_F16 = 2,
    /// bfloat16, stored as `uint16_t` bits (the upper half of a `float`).
    TUTTI_DTYPE_BF16 = 3,
    /// `int8_t`.
    TUTTI_DTYPE_I8 = 4,
    /// `uint8_t`.
    TUTTI_DTYPE_U8 = 5,
    /// `int32_t`.
    TUTTI_DTYPE_I32 = 6,
    /// `uint32_t`.
    TUTTI_DTYPE_U32 = 7,
    /// `int64_t`.
    TUTTI_DTYPE_I64 = 8,
    /// `uint64_t`.
    TUTTI_DTYPE_U64 = 9,
}

/// A `tutti_dtype` as it crosses the C boundary: one of the `TUTTI_DTYPE_*` values.
pub type tutti_dtype = u32;

/// Reduce operations. Integers wrap on overflow; float `MIN`/`MAX` follow IEEE `minNum`/`maxNum`
/// (a NaN loses against a number); `MEAN` is the sum divided by the number of ranks (integers
/// truncate toward zero). `BAND`, `BOR`, `BXOR` are bitwise, on the integer dtypes only: on a
/// float dtype the call fails with `TUTTI_ERROR_INVALID_ARGUMENT` naming the op and the dtype,
/// before anything is sent (where only some ranks pass such a pair, the others' calls fail with
/// `TUTTI_ERROR_PEER_REJECTED` naming the rank); a GPU group on NCCL refuses them (NCCL has no
/// bitwise ops).
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[allow(dead_code)] // Named for C in the header; values arrive here as integers.
pub enum TuttiOp {
    /// Element-wise sum.
    TUTTI_OP_SUM = 0,
    /// Element-wise product.
    TUTTI_OP_PROD = 1,
    /// Element-wise minimum.
    TUTTI_OP_MIN = 2,
    /// Element-wise maximum.
    TUTTI_OP_MAX = 3,
    /// Element-wise sum divided by the number of ranks.
    TUTTI_OP_MEAN = 4,
    /// Element-wise bitwise AND (integer dtypes only).
    TUTTI_OP_BAND = 5,
    /// Element-wise bitwise OR (integer dtypes only).
    TUTTI_OP_BOR = 6,
    /// Element-wise bitwise XOR (integer dtypes only).
    TUTTI_OP_BXOR = 7,
}

/// A `tutti_op` as it crosses the C boundary: one of the `TUTTI_OP_*` values.
pub type tutti_op = u32;

/// Collective algorithms. Some take an argument (`algorithm_arg` in `tutti_config`, `arg` in
/// `tutti_comm_set_algorithm`); the others require it to be 0.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiAlgorithm {
    /// `direct` where ranks share memory (threads of one process), `ring` elsewhere.
    TUTTI_ALGORITHM_AUTO = 0,
    /// Each rank reduces one slice of every rank's buffer in place; peers copy it out.
    TUTTI_ALGORITHM_DIRECT = 1,
    /// Reduce-scatter then all-gather around a ring, chunked.
    TUTTI_ALGORITHM_RING = 2,
    /// TensorFlow's HierarchicalCopyAllReduce; the argument is the group size (0 means 2).
    TUTTI_ALGORITHM_HIERARCHICAL_COPY = 3,
    /// TensorFlow's ReductionToOneDevice; the argument is the root rank.
    TUTTI_ALGORITHM_REDUCE_TO_ONE = 4,
    /// Recursive doubling: log2 P whole-buffer exchanges (all-reduce; the other collectives
    /// run `auto`).
    TUTTI_ALGORITHM_RECURSIVE_DOUBLING = 5,
    /// Rabenseifner's: recursive-halving reduce-scatter, recursive-doubling all-gather
    /// (all-reduce; the other collectives run `auto`).
    TUTTI_ALGORITHM_RABENSEIFNER = 6,
    /// MPI's own collective (`MPI_Iallreduce`, ...) on the MPI transport, where MPI has the
    /// collective, dtype and op; the others (and every call elsewhere) run `AUTO`.
    TUTTI_ALGORITHM_MPI = 7,
    /// Across hosts: a reduce-scatter within each host, a ring among the hosts for each slice
    /// (a host's ranks share its link), an all-gather within each host; for small buffers, one
    /// step within each host and recursive doubling among the hosts (all-reduce; the other
    /// collectives run `auto`). On one host, the ring within it.
    TUTTI_ALGORITHM_HOSTS = 8,
}

/// A `tutti_algorithm` as it crosses the C boundary: one of the `TUTTI_ALGORITHM_*` values.
pub type tutti_algorithm = u32;

/// How the ranks of a multi-process communicator reach each other.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[allow(dead_code)] // Named for C in the header; values arrive here as integers.
pub enum TuttiTransport {
    /// The `TUTTI_TRANSPORT` environment variable (`auto`, `tcp`, `shm`, `mpi`) when set;
    /// otherwise MPI under an MPI launcher in a build with the `mpi` feature, else shared
    /// memory for peers on this host and TCP for the others.
    TUTTI_TRANSPORT_AUTO = 0,
    /// TCP to every peer.
    TUTTI_TRANSPORT_TCP = 1,
    /// Shared memory to every peer (every rank on this host).
    TUTTI_TRANSPORT_SHM = 2,
    /// MPI point-to-point to every peer, the ranks those of the MPI job (`mpirun`, `srun`):
    /// only `tutti_comm_create_from_env` joins over it, and only in a build with the `mpi`
    /// feature (else `TUTTI_ERROR_UNAVAILABLE`).
    TUTTI_TRANSPORT_MPI = 3,
}

/// A `tutti_transport` as it crosses the C boundary: one of the `TUTTI_TRANSPORT_*` values.
pub type tutti_transport = u32;

/// How f32 all-reduce and reduce-scatter travel between hosts (`tutti_config.compression`).
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[allow(dead_code)] // Named for C in the header; values arrive here as integers.
pub enum TuttiCompression {
    /// The `TUTTI_COMPRESSION` environment variable (`none`, `bf16`, `f16`); none when unset.
    TUTTI_COMPRESSION_ENV = 0,
    /// As f32.
    TUTTI_COMPRESSION_NONE = 1,
    /// As bfloat16 (f32's range, 8 significant bits), reduced in f32.
    TUTTI_COMPRESSION_BF16 = 2,
    /// As IEEE half precision (11 significant bits, overflows past 65504), reduced in f32.
    TUTTI_COMPRESSION_F16 = 3,
}

/// A `tutti_compression` as it crosses the C boundary: one of the `TUTTI_COMPRESSION_*` values.
pub type tutti_compression = u32;

/// Device kinds.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TuttiDeviceKind {
    /// The host CPU.
    TUTTI_DEVICE_CPU = 0,
    /// A CUDA GPU.
    TUTTI_DEVICE_GPU = 1,
    /// An XLA device reached through a PJRT plugin.
    TUTTI_DEVICE_XLA = 2,
}

/// A `tutti_device_kind` as it crosses the C boundary: one of the `TUTTI_DEVICE_*` values.
pub type tutti_device_kind = u32;

/// The element type for a C value, or an error naming the value and the valid range.
pub(crate) fn dtype(v: tutti_dtype) -> Result<DType, String> {
    DType::from_u32(v).ok_or_else(|| {
        format!(
            "dtype {v} is not a tutti_dtype (valid: 0..={}, TUTTI_DTYPE_F32 .. TUTTI_DTYPE_U64)",
            DType::ALL.len() - 1
        )
    })
}

/// The reduce op for a C value, or an error naming the value and the valid range.
pub(crate) fn op(v: tutti_op) -> Result<ReduceOp, String> {
    ReduceOp::from_u32(v).ok_or_else(|| {
        format!(
            "op {v} is not a tutti_op (valid: 0..={}, TUTTI_OP_SUM .. TUTTI_OP_BXOR)",
            ReduceOp::ALL.len() - 1
        )
    })
}

/// The C value of a reduce op (its place in `ReduceOp::ALL`, as `op` reads it).
pub(crate) fn op_code(op: ReduceOp) -> tutti_op {
    ReduceOp::ALL.iter().position(|o| *o == op).unwrap_or(0) as tutti_op
}

/// The C value of an element type (its place in `DType::ALL`, as `dtype` reads it).
pub(crate) fn dtype_code(d: DType) -> tutti_dtype {
    DType::ALL.iter().position(|x| *x == d).unwrap_or(0) as tutti_dtype
}

/// The algorithm for a C value and its argument.
pub(crate) fn algorithm(v: tutti_algorithm, arg: u32) -> Result<Algorithm, Failure> {
    let no_arg = |name: &str, a: Algorithm| {
        if arg == 0 {
            Ok(a)
        } else {
            Err(Failure::invalid(format!(
                "algorithm {name} takes no argument, but the argument is {arg}; pass 0"
            )))
        }
    };
    match v {
        0 => no_arg("auto", Algorithm::Auto),
        1 => no_arg("direct", Algorithm::Direct),
        2 => no_arg("ring", Algorithm::Ring),
        3 => Ok(Algorithm::HierarchicalCopy {
            group_size: if arg == 0 { 2 } else { arg as usize },
        }),
        4 => Ok(Algorithm::ReduceToOne { root: arg as usize }),
        5 => no_arg("recursive-doubling", Algorithm::RecursiveDoubling),
        6 => no_arg("rabenseifner", Algorithm::Rabenseifner),
        7 => no_arg("mpi", Algorithm::Mpi),
        8 => no_arg("hosts", Algorithm::Hosts),
        _ => Err(Failure::invalid(format!(
            "algorithm {v} is not a tutti_algorithm (valid: 0..=8, TUTTI_ALGORITHM_AUTO .. TUTTI_ALGORITHM_HOSTS)"
        ))),
    }
}

/// The C value and argument of an algorithm.
pub(crate) fn algorithm_to_c(a: Algorithm) -> Result<(tutti_algorithm, u32), Failure> {
    use TuttiAlgorithm::*;
    let arg = |n: usize| {
        u32::try_from(n).map_err(|_| {
            Failure::invalid(format!(
                "the algorithm's argument {n} does not fit a uint32_t"
            ))
        })
    };
    Ok(match a {
        Algorithm::Auto => (TUTTI_ALGORITHM_AUTO as u32, 0),
        Algorithm::Direct => (TUTTI_ALGORITHM_DIRECT as u32, 0),
        Algorithm::Ring => (TUTTI_ALGORITHM_RING as u32, 0),
        Algorithm::HierarchicalCopy { group_size } => {
            (TUTTI_ALGORITHM_HIERARCHICAL_COPY as u32, arg(group_size)?)
        }
        Algorithm::ReduceToOne { root } => (TUTTI_ALGORITHM_REDUCE_TO_ONE as u32, arg(root)?),
        Algorithm::RecursiveDoubling => (TUTTI_ALGORITHM_RECURSIVE_DOUBLING as u32, 0),
        Algorithm::Rabenseifner => (TUTTI_ALGORITHM_RABENSEIFNER as u32, 0),
        Algorithm::Mpi => (TUTTI_ALGORITHM_MPI as u32, 0),
        Algorithm::Hosts => (TUTTI_ALGORITHM_HOSTS as u32, 0),
    })
}

/// The transport for a C value: `None` for `TUTTI_TRANSPORT_AUTO`.
pub(crate) fn transport(v: tutti_transport) -> Result<Option<tutti::TransportKind>, String> {
    match v {
        0 => Ok(None),
        1 => Ok(Some(tutti::TransportKind::Tcp)),
        2 => Ok(Some(tutti::TransportKind::Shm)),
        3 => Ok(Some(tutti::TransportKind::Mpi)),
        _ => Err(format!(
            "transport {v} is not a tutti_transport (valid: 0..=3, TUTTI_TRANSPORT_AUTO .. TUTTI_TRANSPORT_MPI)"
        )),
    }
}

/// The C value of a device kind.
pub(crate) fn device_kind_to_c(k: tutti::DeviceKind) -> tutti_device_kind {
    match k {
        tutti::DeviceKind::Cpu => TuttiDeviceKind::TUTTI_DEVICE_CPU as u32,
        tutti::DeviceKind::Gpu => TuttiDeviceKind::TUTTI_DEVICE_GPU as u32,
        tutti::DeviceKind::Xla => TuttiDeviceKind::TUTTI_DEVICE_XLA as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_values_match_the_core() {
        assert_eq!(dtype(TuttiDtype::TUTTI_DTYPE_BF16 as u32), Ok(DType::BF16));
        assert_eq!(dtype(TuttiDtype::TUTTI_DTYPE_U64 as u32), Ok(DType::U64));
        assert!(dtype(10).unwrap_err().contains("dtype 10"));
        assert_eq!(op(TuttiOp::TUTTI_OP_MEAN as u32), Ok(ReduceOp::Mean));
        assert_eq!(op(TuttiOp::TUTTI_OP_BAND as u32), Ok(ReduceOp::BAnd));
        assert_eq!(op(TuttiOp::TUTTI_OP_BOR as u32), Ok(ReduceOp::BOr));
        assert_eq!(op(TuttiOp::TUTTI_OP_BXOR as u32), Ok(ReduceOp::BXor));
        let e = op(8).unwrap_err();
        assert!(e.contains("op 8") && e.contains("TUTTI_OP_BXOR"), "{e}");
        for a in Algorithm::ALL_REDUCE {
            let (v, arg) = algorithm_to_c(a).unwrap();
            assert_eq!(algorithm(v, arg).unwrap(), a);
        }
        assert_eq!(
            algorithm(3, 0).unwrap(),
            Algorithm::HierarchicalCopy { group_size: 2 }
        );
        assert!(algorithm(2, 1).unwrap_err().message.contains("ring"));
        for a in [
            Algorithm::RecursiveDoubling,
            Algorithm::Rabenseifner,
            Algorithm::Hosts,
        ] {
            let (v, arg) = algorithm_to_c(a).unwrap();
            assert_eq!(algorithm(v, arg).unwrap(), a);
        }
        assert!(algorithm(6, 1)
            .unwrap_err()
            .message
            .contains("rabenseifner"));
        assert_eq!(algorithm(7, 0).unwrap(), Algorithm::Mpi);
        assert!(algorithm(8, 1).unwrap_err().message.contains("hosts"));
        assert!(algorithm(9, 0).unwrap_err().message.contains("algorithm 9"));
        assert_eq!(transport(0), Ok(None));
        assert_eq!(transport(2), Ok(Some(tutti::TransportKind::Shm)));
        assert_eq!(transport(3), Ok(Some(tutti::TransportKind::Mpi)));
        assert!(transport(4).unwrap_err().contains("transport 4"));
    }
}
