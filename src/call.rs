//! What identifies a call: the algorithm asked for, and the header every rank states before a
//! call runs and compares with its peers'.
//!
//! This sits below the transports, which carry and compare headers, and the algorithms, which
//! run what the header names.

use std::fmt;
use std::str::FromStr;

use crate::dtype::{DType, ReduceOp};
use crate::error::Collective;

/// An algorithm, chosen by name (`auto`, `direct`, `ring`, `hierarchical-copy[:G]`,
/// `reduce-to-one[:ROOT]`, `recursive-doubling`, `rabenseifner`, `hosts`, `mpi`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// The fastest for the transport: `direct` with peer memory, `ring` otherwise.
    #[default]
    Auto,
    /// Ranks read and reduce peers' buffers in place, each owning one slice (peer memory only).
    Direct,
    /// Reduce-scatter then all-gather around a ring, chunked.
    Ring,
    /// TensorFlow's HierarchicalCopyAllReduce: groups of `group_size` ranks reduce onto their
    /// leader, leaders reduce onto the first leader, and the result comes back the same way.
    HierarchicalCopy {
        /// Ranks per group (TensorFlow's default is 2).
        group_size: usize,
    },
    /// TensorFlow's ReductionToOneDevice: reduce onto `root`, broadcast back.
    ReduceToOne {
        /// The rank that reduces.
        root: usize,
    },
    /// Recursive doubling: log2 P steps, each exchanging the whole buffer with one partner
    /// (what `auto` runs for small buffers from 4 processes over TCP). All-reduce only.
    RecursiveDoubling,
    /// Rabenseifner's: a reduce-scatter by recursive halving, then an all-gather by recursive
    /// doubling; the ring's bytes in 2·log2 P steps. All-reduce only.
    Rabenseifner,
    /// Across hosts: a reduce-scatter within each host, a ring among the hosts for each slice
    /// (the i-th rank of every host leads slice i, so a host's ranks share its link), and an
    /// all-gather within each host: 2(H-1)/H of the buffer crosses each host's link for H
    /// hosts. For small buffers, where the cost model predicts it faster, one step within each
    /// host each way and recursive doubling among the hosts on each slice. What `auto` runs
    /// across hosts where it pays; on one host, the ring within it. All-reduce only.
    Hosts,
    /// MPI's own collective (`MPI_Iallreduce`, `MPI_Ibcast`, ...) on the MPI transport (feature
    /// `mpi`), for the collectives, element types and ops MPI has; the others run `auto`. Every
    /// call has a check round first (MPI's collective carries no tutti header).
    Mpi,
}

impl Algorithm {
    /// The all-reduce algorithms that `tutti perf` and the tests sweep.
    pub const ALL_REDUCE: [Algorithm; 5] = [
        Algorithm::Auto,
        Algorithm::Direct,
        Algorithm::Ring,
        Algorithm::HierarchicalCopy { group_size: 2 },
        Algorithm::ReduceToOne { root: 0 },
    ];
}

impl Algorithm {
    /// A number and a parameter for the wire (see [`Algorithm::from_code`]).
    pub(crate) fn code(self) -> (u8, u64) {
        match self {
            Algorithm::Auto => (0, 0),
            Algorithm::Direct => (1, 0),
            Algorithm::Ring => (2, 0),
            Algorithm::HierarchicalCopy { group_size } => (3, group_size as u64),
            Algorithm::ReduceToOne { root } => (4, root as u64),
            Algorithm::RecursiveDoubling => (5, 0),
            Algorithm::Rabenseifner => (6, 0),
            Algorithm::Mpi => (7, 0),
            Algorithm::Hosts => (8, 0),
        }
    }

    /// The algorithm of a [`Algorithm::code`], or `None` when it is not one.
    pub(crate) fn from_code(code: u8, param: u64) -> Option<Algorithm> {
        let param = usize::try_from(param).ok();
        Some(match code {
            0 => Algorithm::Auto,
            1 => Algorithm::Direct,
            2 => Algorithm::Ring,
            3 => Algorithm::HierarchicalCopy { group_size: param? },
            4 => Algorithm::ReduceToOne { root: param? },
            5 => Algorithm::RecursiveDoubling,
            6 => Algorithm::Rabenseifner,
            7 => Algorithm::Mpi,
            8 => Algorithm::Hosts,
            _ => return None,
        })
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::Auto => f.write_str("auto"),
            Algorithm::Direct => f.write_str("direct"),
            Algorithm::Ring => f.write_str("ring"),
            Algorithm::HierarchicalCopy { group_size: 2 } => f.write_str("hierarchical-copy"),
            Algorithm::HierarchicalCopy { group_size } => {
                write!(f, "hierarchical-copy:{group_size}")
            }
            Algorithm::ReduceToOne { root: 0 } => f.write_str("reduce-to-one"),
            Algorithm::ReduceToOne { root } => write!(f, "reduce-to-one:{root}"),
            Algorithm::RecursiveDoubling => f.write_str("recursive-doubling"),
            Algorithm::Rabenseifner => f.write_str("rabenseifner"),
            Algorithm::Mpi => f.write_str("mpi"),
            Algorithm::Hosts => f.write_str("hosts"),
        }
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.to_ascii_lowercase().replace('_', "-");
        let (name, arg) = match l.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (l.as_str(), None),
        };
        let num = |default: usize| -> Result<usize, String> {
            arg.map_or(Ok(default), |a| {
                a.parse()
                    .map_err(|_| format!("algorithm '{s}': '{a}' is not a number"))
            })
        };
        let algo = match name {
            "auto" => Algorithm::Auto,
            "direct" => Algorithm::Direct,
            "ring" => Algorithm::Ring,
            "hierarchical-copy" | "hierarchical" => {
                let group_size = num(2)?;
                if group_size == 0 {
                    return Err(format!("algorithm '{s}': group size must be at least 1"));
                }
                Algorithm::HierarchicalCopy { group_size }
            }
            "reduce-to-one" | "reduction-to-one-device" => Algorithm::ReduceToOne { root: num(0)? },
            "recursive-doubling" | "doubling" => Algorithm::RecursiveDoubling,
            "rabenseifner" => Algorithm::Rabenseifner,
            "mpi" => Algorithm::Mpi,
            "hosts" => Algorithm::Hosts,
            _ => {
                return Err(format!(
                    "unknown algorithm '{s}' (expected auto, direct, ring, hierarchical-copy[:GROUP], reduce-to-one[:ROOT], recursive-doubling, rabenseifner, hosts or mpi)"
                ))
            }
        };
        if arg.is_some()
            && matches!(
                algo,
                Algorithm::Auto
                    | Algorithm::Direct
                    | Algorithm::Ring
                    | Algorithm::RecursiveDoubling
                    | Algorithm::Rabenseifner
                    | Algorithm::Hosts
                    | Algorithm::Mpi
            )
        {
            return Err(format!("algorithm '{name}' takes no ':' argument"));
        }
        Ok(algo)
    }
}

/// A compressed wire for f32 reductions between hosts (`TUTTI_COMPRESSION=bf16|f16|none`,
/// `Config::with_compression`), as Horovod's `Compression.fp16` and PyTorch's
/// `bf16_compress_hook` offer: the ring of an f32 all-reduce or reduce-scatter sends every
/// piece as 16-bit floats, halving the bytes on the network, while every step still reduces in
/// f32: each partial sum is rounded once per hop, as it leaves a rank. An all-reduce's pieces
/// are rounded to the 16-bit type once more, by the rank that finished each, so that every
/// rank ends with the same bits (a mean across hosts is then divided in f32).
///
/// It applies on communicators where some peer is reached over TCP, on the host algorithms
/// (not device engines), to f32 only:
/// * all-reduce: the ring, forced or `auto`'s above its small sizes (up to 128 KiB `auto` may
///   run one all-to-all step or recursive doubling, whose time is latency, not bytes; above,
///   with compression on, its cost model chooses only the ring or the hierarchy), and the
///   ring among hosts' leaders when `auto` reduces within each host first (then shared memory
///   carries f32 within a host). A ring forced across hosts narrows on every link.
///   `hierarchical-copy`, `reduce-to-one`, `recursive-doubling` and `rabenseifner` send f32.
/// * reduce-scatter and reduce-scatter-v: every size and algorithm but `direct`.
///
/// `Bf16` keeps f32's range with 8 significant bits (relative error up to 2^-9 per rounding);
/// `F16` keeps 11 bits (2^-12) but overflows past 65504 to infinity: for values known to be
/// small, such as normalised gradients. It cannot be combined with deterministic mode, whose
/// promise is the bits of the f32 reduction.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Compression {
    /// f32 travels as f32.
    #[default]
    None,
    /// f32 travels as bfloat16.
    Bf16,
    /// f32 travels as IEEE half precision.
    F16,
}

impl Compression {
    /// The element type f32 travels as, when compressed.
    pub fn wire_dtype(self) -> Option<DType> {
        match self {
            Compression::None => None,
            Compression::Bf16 => Some(DType::BF16),
            Compression::F16 => Some(DType::F16),
        }
    }
    /// The code that call headers carry between ranks.
    pub(crate) fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Bf16 => 1,
            Compression::F16 => 2,
        }
    }
    /// The compression of a code, `None` for a code that names none.
    pub(crate) fn from_code(code: u8) -> Option<Compression> {
        [Compression::None, Compression::Bf16, Compression::F16]
            .into_iter()
            .find(|c| c.code() == code)
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
            Compression::F16 => "f16",
        })
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Compression, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "none" | "off" | "f32" => Ok(Compression::None),
            "bf16" | "bfloat16" => Ok(Compression::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(Compression::F16),
            _ => Err(format!(
                "unknown compression '{s}' (expected none, bf16 or f16)"
            )),
        }
    }
}

/// What every rank states about a call before it runs; compared field by field across ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallHeader {
    /// The communicator's call number.
    pub call: u64,
    /// Which collective.
    pub collective: Collective,
    /// Element type.
    pub dtype: DType,
    /// Elements per rank (all_gather: of the input; reduce_scatter: of the output).
    pub count: usize,
    /// The reduce op, for reducing collectives.
    pub op: Option<ReduceOp>,
    /// The root, for rooted collectives.
    pub root: Option<usize>,
    /// A digest of the count per rank, for the collectives that take one
    /// ([`Collective::has_counts`]).
    pub counts: Option<u64>,
    /// The algorithm asked for.
    pub algorithm: Algorithm,
    /// The chunk size of chunked algorithms (ranks must cut buffers alike).
    pub chunk_bytes: u64,
    /// Whether every call is checked in a round of its own before data moves (`TUTTI_CHECK=full`).
    pub full_check: bool,
    /// Whether reductions are bitwise-deterministic (`TUTTI_DETERMINISTIC=1`).
    pub deterministic: bool,
    /// How f32 travels between hosts in reductions (`TUTTI_COMPRESSION`).
    pub compression: Compression,
    /// The digest of the cost model's figures (`TUTTI_TUNING`), by which `auto` chooses.
    pub tuning: u16,
    /// Set when this rank rejected its own arguments: peers fail the call at once.
    pub rejected: Option<String>,
}

impl CallHeader {
    /// The first field in which `other` differs from `self`: (name, mine, theirs).
    pub fn first_difference(&self, other: &CallHeader) -> Option<(&'static str, String, String)> {
        if self == other {
            // The common case, without formatting every field.
            return None;
        }
        fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
            v.as_ref()
                .map_or_else(|| "none".to_string(), |x| x.to_string())
        }
        let tuning = (
            "cost model (TUTTI_TUNING)",
            format!("figures {:04x}", self.tuning),
            format!("figures {:04x}", other.tuning),
        );
        // First between collectives: ranks whose figures differ are set up apart, whatever
        // else their calls then differ in (a rank measuring them runs calls of its own
        // meanwhile). Point-to-point frames carry no figures.
        let p2p = [self.collective, other.collective].contains(&Collective::SendRecv);
        if self.tuning != other.tuning && !p2p {
            return Some(tuning);
        }
        let fields = [
            (
                "collective",
                self.collective.to_string(),
                other.collective.to_string(),
            ),
            ("call number", self.call.to_string(), other.call.to_string()),
            ("dtype", self.dtype.to_string(), other.dtype.to_string()),
            ("count", self.count.to_string(), other.count.to_string()),
            ("op", opt(&self.op), opt(&other.op)),
            ("root", opt(&self.root), opt(&other.root)),
            (
                "counts (digest)",
                self.counts
                    .map_or_else(|| "none".to_string(), |d| format!("{d:016x}")),
                other
                    .counts
                    .map_or_else(|| "none".to_string(), |d| format!("{d:016x}")),
            ),
            (
                "algorithm",
                self.algorithm.to_string(),
                other.algorithm.to_string(),
            ),
            (
                "chunk size",
                self.chunk_bytes.to_string(),
                other.chunk_bytes.to_string(),
            ),
            (
                "call check (TUTTI_CHECK)",
                check_name(self.full_check).to_string(),
                check_name(other.full_check).to_string(),
            ),
            (
                "deterministic mode (TUTTI_DETERMINISTIC)",
                on_off(self.deterministic).to_string(),
                on_off(other.deterministic).to_string(),
            ),
            (
                "wire compression (TUTTI_COMPRESSION)",
                self.compression.to_string(),
                other.compression.to_string(),
            ),
            tuning,
        ];
        fields.into_iter().find(|(_, a, b)| a != b)
    }
}

/// The digest of a count per rank that [`CallHeader::counts`] carries (FNV-1a over the counts
/// as 64-bit little-endian numbers): equal counts give equal digests on every host.
pub(crate) fn counts_digest(counts: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in counts {
        for b in (c as u64).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

fn check_name(full: bool) -> &'static str {
    if full {
        "full"
    } else {
        "fast"
    }
}

/// A point-to-point operation by address (for carriers such as the C ABI): see
/// [`crate::Communicator::send_recv_raw_async`].
#[derive(Copy, Clone, Debug)]
pub struct RawPeerOp {
    /// A send (else a receive).
    pub send: bool,
    /// The other rank.
    pub peer: usize,
    /// The element type.
    pub dtype: DType,
    /// The bytes: read by a send, written by a receive.
    pub ptr: *mut u8,
    /// Their length.
    pub len: usize,
}
