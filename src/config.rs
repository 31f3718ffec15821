//! The settings of a communicator ([`Config`]), shared by every engine below the communicator:
//! the host algorithms, the GPU group and the PJRT client read the same timeout and algorithm.

use std::time::Duration;

use crate::algorithm::{self, Algorithm};
pub use crate::call::Compression;
use crate::error::{Error, Result};
use crate::sync::{default_timeout, timeout_from_env, MAX_TIMEOUT};
pub use crate::tuning::{cost_model_from_env, CostModel};

/// Settings of a communicator.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Bound on every wait for a peer (default 300 s, or `TUTTI_TIMEOUT` in seconds).
    pub timeout: Duration,
    /// All-reduce algorithm, and the choice for the other collectives (default `auto`).
    pub algorithm: Algorithm,
    /// Largest piece one step of a chunked algorithm handles (default 256 KiB; from 1 byte to
    /// [`Config::MAX_CHUNK_BYTES`], 1 GiB). A chunk at least as large as a buffer runs it in
    /// one piece.
    pub chunk_bytes: usize,
    /// Check every call between processes in a round of its own before any data moves
    /// (`TUTTI_CHECK=full`; default `fast`). Either way a mismatched call is an error naming both
    /// ranks and the field that differs. `fast` checks each call's identity as its data arrives,
    /// so a small call costs one round trip instead of two; a mismatch found that way aborts the
    /// communicator (peers may be mid-step), where `full` leaves it usable. `full` costs one
    /// all-to-all of small frames per call (a few microseconds over shared memory).
    pub full_check: bool,
    /// Bitwise-deterministic reductions (`TUTTI_DETERMINISTIC=1`; default off): every reducing
    /// collective gives, on every rank, the bits of the reduction of the inputs in rank order
    /// (one kernel pass over rank 0's, rank 1's, ... element: `((x0 + x1) + x2) ...`, the
    /// 16-bit floats summed in f32 and rounded once), whatever the algorithm, chunk size,
    /// transport or placement of ranks on hosts. Each element is reduced by one rank from
    /// every input (a reduce-scatter in rank order, then an all-gather): the same bytes sent as
    /// the ring's, with every rank's slices arriving in one step. Device engines (CUDA groups,
    /// XLA) do not offer it: their reducing calls are refused.
    pub deterministic: bool,
    /// How f32 travels between hosts in all-reduce and reduce-scatter (`TUTTI_COMPRESSION`;
    /// default [`Compression::None`]): see [`Compression`].
    pub compression: Compression,
    /// Where the figures of the cost model by which `auto` chooses between processes come from
    /// (`TUTTI_TUNING`; default [`CostModel::BuiltIn`]): see [`crate::tuning`].
    pub cost_model: CostModel,
}

/// `TUTTI_COMPRESSION`: `none` (the default when unset), `bf16` or `f16` ([`Compression`]).
pub fn compression_from_env() -> Result<Compression> {
    match std::env::var("TUTTI_COMPRESSION") {
        Err(_) => Ok(Compression::None),
        Ok(v) => v
            .parse()
            .map_err(|e| Error::config(format!("TUTTI_COMPRESSION: {e}"))),
    }
}

/// `TUTTI_DETERMINISTIC`: `1`/`true`/`on` or `0`/`false`/`off` (the default when unset).
pub fn deterministic_from_env() -> Result<bool> {
    match std::env::var("TUTTI_DETERMINISTIC") {
        Err(_) => Ok(false),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "false" | "off" | "no" => Ok(false),
            "1" | "true" | "on" | "yes" => Ok(true),
            _ => Err(Error::config(format!(
                "TUTTI_DETERMINISTIC='{v}': expected 1 (bitwise-deterministic reductions) or 0"
            ))),
        },
    }
}

/// `TUTTI_CHECK`: `full` or `fast` (the default when unset).
pub fn full_check_from_env() -> Result<bool> {
    match std::env::var("TUTTI_CHECK") {
        Err(_) => Ok(false),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "fast" => Ok(false),
            "full" => Ok(true),
            _ => Err(Error::config(format!(
                "TUTTI_CHECK='{v}': expected full (a check round before every call) or fast"
            ))),
        },
    }
}

impl Default for Config {
    /// The defaults, with `TUTTI_TIMEOUT`'s timeout when it is valid (an invalid one is
    /// reported by every communicator built with this config, see [`timeout_from_env`]).
    fn default() -> Config {
        Config {
            timeout: default_timeout(),
            algorithm: Algorithm::Auto,
            chunk_bytes: 256 * 1024,
            full_check: full_check_from_env().unwrap_or(false),
            deterministic: deterministic_from_env().unwrap_or(false),
            compression: compression_from_env().unwrap_or_default(),
            cost_model: cost_model_from_env().unwrap_or_default(),
        }
    }
}

impl Config {
    /// The largest `chunk_bytes` a communicator accepts (1 GiB): a piece that large no longer
    /// stays in any cache, so larger ones gain nothing, and every offset an algorithm computes
    /// from a chunk and a buffer's length stays far from overflowing.
    pub const MAX_CHUNK_BYTES: usize = 1 << 30;

    /// This config with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Config {
        self.timeout = timeout;
        self
    }
    /// This config with another algorithm.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Config {
        self.algorithm = algorithm;
        self
    }
    /// This config with the full call check on or off (see [`Config::full_check`]).
    pub fn with_full_check(mut self, full_check: bool) -> Config {
        self.full_check = full_check;
        self
    }
    /// This config with bitwise-deterministic reductions on or off (see
    /// [`Config::deterministic`]).
    pub fn with_deterministic(mut self, deterministic: bool) -> Config {
        self.deterministic = deterministic;
        self
    }
    /// This config with another wire for f32 between hosts (see [`Compression`]).
    pub fn with_compression(mut self, compression: Compression) -> Config {
        self.compression = compression;
        self
    }
    /// This config with the cost model's figures from elsewhere (see [`CostModel`]).
    pub fn with_cost_model(mut self, cost_model: CostModel) -> Config {
        self.cost_model = cost_model;
        self
    }
    /// This config with another chunk size (checked, with the rest, when a communicator is
    /// made: see [`Config::check`]).
    pub fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Config {
        self.chunk_bytes = chunk_bytes;
        self
    }
    /// The error creating a group of `world` ranks with this config would give, if any: its
    /// environment (`TUTTI_TIMEOUT`, `TUTTI_CHECK`, `TUTTI_DETERMINISTIC`,
    /// `TUTTI_COMPRESSION`), world size, timeout, chunk size and
    /// algorithm parameters (a root or group size the world cannot have). Every communicator,
    /// group and strategy is made through this check, from Rust, C, Python or the environment.
    pub fn check(&self, world: usize) -> Result<()> {
        timeout_from_env()?;
        full_check_from_env()?;
        deterministic_from_env()?;
        compression_from_env()?;
        match &self.cost_model {
            // Figures given (a split's, its parent's): the file is not read again.
            CostModel::Figures(t) => t
                .check()
                .map_err(|e| Error::config(format!("cost model figures: {e}")))?,
            CostModel::BuiltIn | CostModel::Measure => {
                cost_model_from_env()?;
            }
        }
        if self.deterministic && self.compression != Compression::None {
            return Err(Error::config(format!(
                "compression {} cannot be combined with deterministic mode, which promises the \
                 bits of the f32 reduction: turn one of them off",
                self.compression
            )));
        }
        if world == 0 {
            return Err(Error::config("a group needs at least one rank"));
        }
        if world > crate::cluster::MAX_WORLD_SIZE {
            return Err(Error::config(format!(
                "a group of {world} ranks is more than tutti supports ({})",
                crate::cluster::MAX_WORLD_SIZE
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::config("timeout must be positive"));
        }
        if self.timeout > MAX_TIMEOUT {
            return Err(Error::config(format!(
                "timeout {:?} is longer than the longest tutti allows ({MAX_TIMEOUT:?})",
                self.timeout
            )));
        }
        if self.chunk_bytes == 0 {
            return Err(Error::config("chunk_bytes must be positive"));
        }
        if self.chunk_bytes > Config::MAX_CHUNK_BYTES {
            return Err(Error::config(format!(
                "chunk_bytes {} is more than the largest chunk tutti allows ({} bytes, 1 GiB)",
                self.chunk_bytes,
                Config::MAX_CHUNK_BYTES
            )));
        }
        algorithm::check(self.algorithm, world).map_err(Error::config)
    }
}
