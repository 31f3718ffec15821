//! The C ABI of tutti: `libtutti.so` and `libtutti.a`, declared by `include/tutti.h`, which
//! cbindgen generates from this crate and `ffi/cbindgen.toml`.
//!
//! Conventions (see the README's "C API conventions"): every function is `tutti_*`; handles are
//! opaque; the object comes first, then inputs, outputs last; outputs are written only on
//! success; every function that can fail returns a `tutti_result` and records a thread-local
//! message (`tutti_last_error`); every pointer is NULL-checked and every enum value
//! range-checked; every function body runs inside one panic boundary ([`error::boundary`]).
#![allow(non_camel_case_types, clippy::enum_variant_names)]
#![deny(unsafe_op_in_unsafe_fn)]

mod buffers;
mod checkpoint;
mod collectives;
mod comm;
mod config;
mod device;
mod device_variables;
mod error;
mod handle;
mod log;
mod p2p;
mod ps;
mod replicas;
mod store;
mod strategy;
mod tensor;
mod types;
mod variables;
mod work;
mod xla;

use std::ffi::c_char;

use error::{boundary, tutti_result, Failure};

/// The library's version, as `"MAJOR.MINOR.PATCH"`; compare with `TUTTI_VERSION_STRING` to
/// catch a program running against another libtutti than it was built with. Never NULL.
///
/// Thread-safety: callable from any thread at any time. Does not touch the last error.
#[no_mangle]
pub extern "C" fn tutti_version_string() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Write the library's version numbers to `*major`, `*minor` and `*patch`.
///
/// Thread-safety: callable from any thread at any time.
///
/// # Safety
///
/// `major`, `minor` and `patch` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_version(
    major: *mut u32,
    minor: *mut u32,
    patch: *mut u32,
) -> tutti_result {
    boundary("tutti_version", || {
        for (p, name) in [(major, "major"), (minor, "minor"), (patch, "patch")] {
            if p.is_null() {
                return Err(Failure::invalid(format!("{name} is NULL")));
            }
        }
        let v = |s: &str| s.parse::<u32>().unwrap_or(0);
        // SAFETY: checked non-NULL; the caller promises they are writable.
        unsafe {
            major.write(v(env!("CARGO_PKG_VERSION_MAJOR")));
            minor.write(v(env!("CARGO_PKG_VERSION_MINOR")));
            patch.write(v(env!("CARGO_PKG_VERSION_PATCH")));
        }
        Ok(())
    })
}
