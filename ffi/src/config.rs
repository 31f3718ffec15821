//! `tutti_config`: the settings of a new group, in a struct that starts with its own size so
//! that later versions can add fields without breaking programs built against this one.

use std::mem::size_of;
use std::time::Duration;

use tutti::Config;

use crate::error::Failure;
use crate::types::{self, tutti_algorithm, tutti_compression, tutti_transport};

/// Settings of a new group. Start from `TUTTI_CONFIG_INIT`, which sets `struct_size` and the
/// defaults, then change the fields you need:
///
/// ```c
/// tutti_config config = TUTTI_CONFIG_INIT;
/// config.timeout_ms = 30000;
/// config.algorithm = TUTTI_ALGORITHM_RING;
/// ```
///
/// A zero field means the default. A program built against an older, shorter `tutti_config`
/// gets the defaults for the fields it does not know; a newer, longer one is accepted as long
/// as the fields this library does not know are zero.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct tutti_config {
    /// `sizeof(tutti_config)` as the caller compiled it (`TUTTI_CONFIG_INIT` sets it).
    pub struct_size: usize,
    /// Bound on every wait for a peer, in milliseconds; 0: the `TUTTI_TIMEOUT` environment
    /// variable (seconds) or 300 s.
    pub timeout_ms: u64,
    /// Largest piece, in bytes, that one step of a chunked algorithm moves; 0: 256 KiB.
    pub chunk_bytes: usize,
    /// The algorithm of every collective (`TUTTI_ALGORITHM_AUTO` by default).
    pub algorithm: tutti_algorithm,
    /// The algorithm's argument: the group size of `TUTTI_ALGORITHM_HIERARCHICAL_COPY` (0: 2),
    /// the root of `TUTTI_ALGORITHM_REDUCE_TO_ONE`; 0 for the others.
    pub algorithm_arg: u32,
    /// How the ranks of a multi-process communicator reach each other
    /// (`TUTTI_TRANSPORT_AUTO` by default); in-process groups share memory and need
    /// `TUTTI_TRANSPORT_AUTO`.
    pub transport: tutti_transport,
    /// Bitwise-deterministic reductions: every reducing collective gives, on every rank, the
    /// bits of the reduction of the inputs in rank order, whatever the algorithm, chunk size or
    /// transport. 0: the `TUTTI_DETERMINISTIC` environment variable (off when unset); 1: on;
    /// 2: off.
    pub deterministic: u32,
    /// How f32 all-reduce and reduce-scatter travel between hosts, reducing in f32 at every
    /// step (README, "Compressed wire"): `TUTTI_COMPRESSION_ENV` (0, the `TUTTI_COMPRESSION`
    /// environment variable, none when unset), `_NONE`, `_BF16` or `_F16`. A program built
    /// against a `tutti_config` without this field gets 0.
    pub compression: tutti_compression,
    /// Must be 0 (it keeps the struct free of padding, so that every byte a caller passes is a
    /// field's).
    pub reserved: u32,
}

/// A caller's config, read and checked.
#[derive(Debug)]
pub(crate) struct Settings {
    /// The core's settings.
    pub core: Config,
    /// The transport the caller chose; `None` for `TUTTI_TRANSPORT_AUTO`.
    pub transport: Option<tutti::TransportKind>,
}

/// The size of the first version of `tutti_config` (up to `deterministic`); a smaller
/// `struct_size` is an error, and the fields a caller's shorter struct lacks take defaults.
const FIRST_SIZE: usize = std::mem::offset_of!(tutti_config, compression);

/// The size of the `tutti_config` this library knows: bytes past it must be zero. The struct
/// has no padding (`reserved` fills what would be), so every byte up to here is a field's.
const KNOWN_SIZE: usize = size_of::<tutti_config>();
const _: () = assert!(KNOWN_SIZE == std::mem::offset_of!(tutti_config, reserved) + 4);

/// A `struct_size` beyond this is garbage (an uninitialized struct), not a newer version.
pub(crate) const MAX_STRUCT_SIZE: usize = 4096;

/// Check the `struct_size` of a versioned struct the caller passes as `arg` (of C type `ty`):
/// at least `first` bytes (its first version), no more than [`MAX_STRUCT_SIZE`], and every
/// byte past the `known` bytes this libtutti knows zero (fields of a newer libtutti, which
/// this one would ignore). `fix` says how the caller sets it right.
///
/// # Safety
///
/// `ptr` points to at least `size` readable bytes.
pub(crate) unsafe fn check_struct_size(
    ptr: *const u8,
    size: usize,
    first: usize,
    known: usize,
    arg: &str,
    ty: &str,
    fix: &str,
) -> Result<(), Failure> {
    if size < first {
        return Err(Failure::invalid(format!(
            "{arg}->struct_size is {size}, smaller than any {ty} ({first} bytes); {fix}"
        )));
    }
    if size % std::mem::align_of::<usize>() != 0 {
        return Err(Failure::invalid(format!(
            "{arg}->struct_size is {size}, which is no sizeof({ty}); {fix}"
        )));
    }
    if size > MAX_STRUCT_SIZE {
        return Err(Failure::invalid(format!(
            "{arg}->struct_size is {size}, more than any {ty} will ever need; {fix}"
        )));
    }
    if size > known {
        // SAFETY: the caller promises `size` readable bytes.
        let extra = unsafe { std::slice::from_raw_parts(ptr.add(known), size - known) };
        if let Some(i) = extra.iter().position(|&b| b != 0) {
            return Err(Failure::invalid(format!(
                "{arg}->struct_size is {size} and byte {} is set, but this libtutti ({}) knows \
                 only the first {known} bytes of {ty}; leave newer fields zero or use a newer \
                 libtutti",
                known + i,
                env!("CARGO_PKG_VERSION"),
            )));
        }
    }
    Ok(())
}

/// Read the caller's config (`NULL`: every default) into a core `Config`.
///
/// # Safety
///
/// `config` is NULL or points to at least `config->struct_size` readable bytes.
pub(crate) unsafe fn read(config: *const tutti_config) -> Result<Settings, Failure> {
    let mut out = Config::default();
    if config.is_null() {
        return Ok(Settings {
            core: out,
            transport: None,
        });
    }
    // SAFETY: the first field is always there.
    let size = unsafe { std::ptr::addr_of!((*config).struct_size).read_unaligned() };
    // SAFETY: the caller promises `size` readable bytes.
    unsafe {
        check_struct_size(
            config.cast(),
            size,
            FIRST_SIZE,
            KNOWN_SIZE,
            "config",
            "tutti_config",
            "initialize the config with TUTTI_CONFIG_INIT",
        )
    }?;
    // The caller's bytes, as many as it has of this version; an older, shorter struct's
    // missing fields stay zero (their defaults).
    let mut c = tutti_config {
        struct_size: 0,
        timeout_ms: 0,
        chunk_bytes: 0,
        algorithm: 0,
        algorithm_arg: 0,
        transport: 0,
        deterministic: 0,
        compression: 0,
        reserved: 0,
    };
    // SAFETY: `size.min(KNOWN_SIZE)` bytes are readable at `config` and writable at `c`,
    // a plain struct of integers for which any bytes are valid; the source may be
    // under-aligned, which a byte copy does not mind.
    unsafe {
        std::ptr::copy_nonoverlapping(
            config.cast::<u8>(),
            std::ptr::addr_of_mut!(c).cast::<u8>(),
            size.min(KNOWN_SIZE),
        )
    };
    if c.timeout_ms != 0 {
        out.timeout = Duration::from_millis(c.timeout_ms);
    }
    if c.chunk_bytes != 0 {
        out.chunk_bytes = c.chunk_bytes;
    }
    out.algorithm = types::algorithm(c.algorithm, c.algorithm_arg)
        .map_err(|f| Failure::invalid(format!("config->algorithm: {}", f.message)))?;
    let transport = types::transport(c.transport)
        .map_err(|m| Failure::invalid(format!("config->transport: {m}")))?;
    match c.deterministic {
        0 => {}
        1 => out.deterministic = true,
        2 => out.deterministic = false,
        d => {
            return Err(Failure::invalid(format!(
            "config->deterministic is {d}; it must be 0 (TUTTI_DETERMINISTIC), 1 (on) or 2 (off)"
        )))
        }
    }
    if c.reserved != 0 {
        return Err(Failure::invalid(format!(
            "config->reserved is {}; it must be 0",
            c.reserved
        )));
    }
    out.compression = match c.compression {
        0 => out.compression,
        1 => tutti::Compression::None,
        2 => tutti::Compression::Bf16,
        3 => tutti::Compression::F16,
        v => {
            return Err(Failure::invalid(format!(
                "config->compression is {v}; it must be 0 (TUTTI_COMPRESSION), 1 (none), \
                 2 (bf16) or 3 (f16)"
            )))
        }
    };
    Ok(Settings {
        core: out,
        transport,
    })
}

/// Check that settings suit an in-process group, whose ranks share memory.
pub(crate) fn in_process(s: &Settings) -> Result<(), Failure> {
    match s.transport {
        None => Ok(()),
        Some(t) => Err(Failure::invalid(format!(
            "config->transport asks for {t:?}, but the ranks of an in-process group share \
             memory; leave it TUTTI_TRANSPORT_AUTO"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutti::Algorithm;

    fn init() -> tutti_config {
        tutti_config {
            struct_size: size_of::<tutti_config>(),
            timeout_ms: 0,
            chunk_bytes: 0,
            algorithm: 0,
            algorithm_arg: 0,
            transport: 0,
            deterministic: 0,
            compression: 0,
            reserved: 0,
        }
    }

    #[test]
    fn zero_fields_are_defaults() {
        let c = unsafe { read(&init()) }.unwrap();
        assert_eq!(c.core, Config::default());
        assert!(c.transport.is_none());
        let c = unsafe { read(std::ptr::null()) }.unwrap();
        assert_eq!(c.core, Config::default());
        let mut cfg = init();
        cfg.timeout_ms = 1500;
        cfg.algorithm = 4;
        cfg.algorithm_arg = 2;
        cfg.transport = 1;
        let c = unsafe { read(&cfg) }.unwrap();
        assert_eq!(c.core.timeout, Duration::from_millis(1500));
        assert_eq!(c.core.algorithm, Algorithm::ReduceToOne { root: 2 });
        assert_eq!(c.transport, Some(tutti::TransportKind::Tcp));
        cfg.deterministic = 1;
        assert!(unsafe { read(&cfg) }.unwrap().core.deterministic);
        cfg.deterministic = 2;
        assert!(!unsafe { read(&cfg) }.unwrap().core.deterministic);
        cfg.deterministic = 3;
        assert!(unsafe { read(&cfg) }
            .unwrap_err()
            .message
            .contains("config->deterministic is 3"));
        cfg.deterministic = 0;
        for (v, want) in [
            (1, tutti::Compression::None),
            (2, tutti::Compression::Bf16),
            (3, tutti::Compression::F16),
        ] {
            cfg.compression = v;
            assert_eq!(unsafe { read(&cfg) }.unwrap().core.compression, want);
        }
        cfg.compression = 4;
        assert!(unsafe { read(&cfg) }
            .unwrap_err()
            .message
            .contains("config->compression is 4"));
    }

    /// A program built against the first `tutti_config` (up to `deterministic`) passes a
    /// shorter struct: accepted, the newer fields at their defaults, bytes past it unread.
    #[test]
    fn an_older_shorter_config_gets_the_defaults_for_newer_fields() {
        let mut cfg = init();
        cfg.struct_size = FIRST_SIZE;
        cfg.deterministic = 1;
        // What lies past the caller's struct is not its own: never read.
        cfg.compression = 99;
        let s = unsafe { read(&cfg) }.unwrap();
        assert!(s.core.deterministic);
        assert_eq!(s.core.compression, Config::default().compression);
        cfg.struct_size = FIRST_SIZE - 4;
        assert!(unsafe { read(&cfg) }.is_err());
        // A size that ends inside a field is no version's.
        cfg.struct_size = FIRST_SIZE + 4;
        let e = unsafe { read(&cfg) }.unwrap_err();
        assert!(
            e.message.contains("no sizeof(tutti_config)"),
            "{}",
            e.message
        );
        cfg.struct_size = KNOWN_SIZE;
        cfg.compression = 0;
        cfg.reserved = 1;
        let e = unsafe { read(&cfg) }.unwrap_err();
        assert!(e.message.contains("config->reserved is 1"), "{}", e.message);
    }

    #[test]
    fn sizes_are_checked() {
        let mut cfg = init();
        cfg.struct_size = 8;
        let e = unsafe { read(&cfg) }.unwrap_err();
        assert!(e.message.contains("TUTTI_CONFIG_INIT"), "{}", e.message);
        cfg.struct_size = 1 << 40;
        let e = unsafe { read(&cfg) }.unwrap_err();
        assert!(e.message.contains("more than any"), "{}", e.message);

        // A newer caller's longer struct: accepted while its extra fields are zero.
        #[repr(C)]
        struct Newer {
            base: tutti_config,
            more: u64,
        }
        let mut n = Newer {
            base: init(),
            more: 0,
        };
        n.base.struct_size = size_of::<Newer>();
        let p = std::ptr::addr_of!(n).cast::<tutti_config>();
        assert!(unsafe { read(p) }.is_ok());
        n.more = 1;
        let p = std::ptr::addr_of!(n).cast::<tutti_config>();
        let e = unsafe { read(p) }.unwrap_err();
        assert!(e.message.contains("newer"), "{}", e.message);
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// A caller's struct: the fields, then (for a longer, newer struct) trailing bytes, all in
    /// a buffer of `MAX_STRUCT_SIZE` bytes so that every `struct_size` read stays inside it.
    fn buffer(c: &tutti_config, extra: &[u8]) -> Vec<u64> {
        let mut buf = vec![0u64; MAX_STRUCT_SIZE / 8 + 1];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        // SAFETY: tutti_config is plain old data of KNOWN_SIZE bytes, with no padding.
        let raw = unsafe {
            std::slice::from_raw_parts((c as *const tutti_config).cast::<u8>(), KNOWN_SIZE)
        };
        bytes[..KNOWN_SIZE].copy_from_slice(raw);
        // Then a newer caller's trailing bytes.
        let n = extra.len().min(bytes.len() - KNOWN_SIZE);
        bytes[KNOWN_SIZE..KNOWN_SIZE + n].copy_from_slice(&extra[..n]);
        buf
    }

    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![
            Just(FIRST_SIZE),
            Just(KNOWN_SIZE),
            0..=MAX_STRUCT_SIZE + 64,
            any::<usize>(),
        ]
    }

    proptest! {
        /// Every field and size, arbitrary: the config reads, or fails naming the field or size
        /// that is wrong; what it reads is what the caller set.
        #[test]
        fn config_fields_read_or_name_the_field(
            struct_size in size(),
            timeout_ms in prop_oneof![Just(0u64), any::<u64>()],
            chunk_bytes in prop_oneof![Just(0usize), any::<usize>()],
            algorithm in prop_oneof![0u32..8, any::<u32>()],
            algorithm_arg in prop_oneof![0u32..4, any::<u32>()],
            transport in prop_oneof![0u32..4, any::<u32>()],
            deterministic in prop_oneof![0u32..3, any::<u32>()],
            compression in prop_oneof![0u32..5, any::<u32>()],
            extra in prop_oneof![Just(Vec::new()), proptest::collection::vec(any::<u8>(), 0..64)],
        ) {
            let c = tutti_config {
                struct_size,
                timeout_ms,
                chunk_bytes,
                algorithm,
                algorithm_arg,
                transport,
                deterministic,
                compression,
                reserved: 0,
            };
            let buf = buffer(&c, &extra);
            // SAFETY: the buffer holds MAX_STRUCT_SIZE readable bytes (plus some), and larger
            // sizes are refused before anything past the first field is read.
            match unsafe { read(buf.as_ptr().cast()) } {
                Ok(s) => {
                    prop_assert!((FIRST_SIZE..=MAX_STRUCT_SIZE).contains(&struct_size));
                    prop_assert!(deterministic < 3);
                    if deterministic != 0 {
                        prop_assert_eq!(s.core.deterministic, deterministic == 1);
                    }
                    if struct_size >= KNOWN_SIZE && compression != 0 {
                        prop_assert!(compression < 4);
                        let all = [tutti::Compression::None, tutti::Compression::Bf16, tutti::Compression::F16];
                        prop_assert_eq!(s.core.compression, all[compression as usize - 1]);
                    }
                    if timeout_ms != 0 {
                        prop_assert_eq!(s.core.timeout, Duration::from_millis(timeout_ms));
                    }
                    if chunk_bytes != 0 {
                        prop_assert_eq!(s.core.chunk_bytes, chunk_bytes);
                    }
                    let (a, arg) = types::algorithm_to_c(s.core.algorithm).unwrap();
                    prop_assert_eq!(a, algorithm);
                    prop_assert!(arg == algorithm_arg || (algorithm == 3 && algorithm_arg == 0));
                    prop_assert_eq!(s.transport.is_none(), transport == 0);
                }
                Err(f) => {
                    prop_assert_eq!(f.code, crate::error::TuttiResult::TUTTI_ERROR_INVALID_ARGUMENT);
                    prop_assert!(f.message.starts_with("config->"), "{}", f.message);
                }
            }
        }
    }
}
