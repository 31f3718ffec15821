//! `tutti_xla_client`: collectives across XLA devices (TPU cores, or any PJRT plugin's devices)
//! from C. Every function is in every build; a libtutti built without the `xla` feature answers
//! `TUTTI_ERROR_UNAVAILABLE`.

use std::ffi::{c_char, c_void, CStr};

use crate::buffers::{self, byte_len, check};
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::types::{self, tutti_dtype, tutti_op};

/// A PJRT client and its devices (opaque). Created by `tutti_xla_client_create`, released by
/// `tutti_xla_client_destroy`.
pub struct tutti_xla_client {
    #[cfg(feature = "xla")]
    inner: tutti::xla::Client,
}

/// # Safety
///
/// `s` is NULL or a NUL-terminated string.
unsafe fn text<'a>(s: *const c_char, name: &str) -> Result<Option<&'a str>, Failure> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map(Some)
        .map_err(|_| Failure::invalid(format!("{name} is not UTF-8")))
}

/// Why a libtutti without the `xla` feature has no XLA devices, and how to get one that has.
#[cfg(not(feature = "xla"))]
pub(crate) const NO_XLA: &str = "this libtutti was built without the xla feature (the Python \
    package's has it: pip install ./bindings/python, with TUTTI_FEATURES unset or naming xla; \
    for C: cargo build --release -p tutti-ffi --features xla)";

#[cfg(not(feature = "xla"))]
fn unavailable() -> Failure {
    Failure::from(tutti::Error::Unavailable {
        what: "XLA".into(),
        why: NO_XLA.into(),
    })
}

/// Create a client for the PJRT plugin at `plugin_path` (NULL: discover one, as
/// `TUTTI_PJRT_PLUGIN`, libtpu's usual places and Python site-packages) with client options
/// `options`: comma-separated `key=value` pairs such as `"cpu_device_count=4"` (NULL: the
/// `TUTTI_PJRT_OPTIONS` variable). Writes the handle to `*client`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `plugin_path` and `options` are NULL or NUL-terminated strings; `client` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_xla_client_create(
    plugin_path: *const c_char,
    options: *const c_char,
    client: *mut *mut tutti_xla_client,
) -> tutti_result {
    boundary("tutti_xla_client_create", || {
        // SAFETY: as the caller promises.
        let (path, opts) =
            unsafe { (text(plugin_path, "plugin_path")?, text(options, "options")?) };
        if client.is_null() {
            return Err(Failure::invalid("client is NULL"));
        }
        #[cfg(feature = "xla")]
        {
            use tutti::xla::{Client, ClientOptions, Plugin};
            let opts = match opts {
                Some(o) => ClientOptions::parse(o)?,
                None => ClientOptions::from_env()?,
            };
            let inner = match path {
                Some(p) => Client::new(Plugin::load(p)?, &opts)?,
                None => Client::discover(&opts)?,
            };
            // SAFETY: checked non-NULL; the caller promises it is writable.
            unsafe { client.write(Box::into_raw(Box::new(tutti_xla_client { inner }))) };
            Ok(())
        }
        #[cfg(not(feature = "xla"))]
        {
            let _ = (path, opts);
            Err(unavailable())
        }
    })
}

/// Release a client. NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `client`, nor use it afterwards.
///
/// # Safety
///
/// `client` is NULL or a live handle from `tutti_xla_client_create`, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_xla_client_destroy(client: *mut tutti_xla_client) {
    boundary_void("tutti_xla_client_destroy", || {
        if !client.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(client) });
        }
    })
}

#[cfg(feature = "xla")]
unsafe fn client_ref<'a>(
    client: *const tutti_xla_client,
) -> Result<&'a tutti::xla::Client, Failure> {
    // SAFETY: as the caller promises.
    unsafe { client.as_ref() }
        .map(|c| &c.inner)
        .ok_or_else(|| Failure::invalid("client is NULL"))
}

/// Write the number of the client's addressable devices (the replicas of its collectives) to
/// `*count`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `client` is NULL or a live handle; `count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_xla_device_count(
    client: *const tutti_xla_client,
    count: *mut usize,
) -> tutti_result {
    boundary("tutti_xla_device_count", || {
        if count.is_null() {
            return Err(Failure::invalid("count is NULL"));
        }
        #[cfg(feature = "xla")]
        {
            // SAFETY: as the caller promises.
            let n = unsafe { client_ref(client) }?.devices().len();
            // SAFETY: checked non-NULL; the caller promises it is writable.
            unsafe { count.write(n) };
            Ok(())
        }
        #[cfg(not(feature = "xla"))]
        {
            if client.is_null() {
                return Err(Failure::invalid("client is NULL"));
            }
            Err(unavailable())
        }
    })
}

/// `num` buffers of `len` bytes each from a C array, checked; the error names the bad one.
#[cfg_attr(not(feature = "xla"), allow(dead_code))]
///
/// # Safety
///
/// `array` is NULL or holds `num` pointers.
unsafe fn per_device<'a>(
    array: *const *mut c_void,
    num: usize,
    len: usize,
    dtype: tutti::DType,
    name: &str,
) -> Result<Vec<&'a mut [u8]>, Failure> {
    if array.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    // SAFETY: as the caller promises.
    let ptrs = unsafe { std::slice::from_raw_parts(array, num) };
    let mut out = Vec::with_capacity(num);
    for (i, p) in ptrs.iter().enumerate() {
        check(*p, len, dtype, &format!("{name}[{i}]")).map_err(Failure::invalid)?;
        for (j, q) in ptrs[..i].iter().enumerate() {
            if len > 0 && buffers::overlap(*p, len, *q, len) {
                return Err(Failure::invalid(format!(
                    "{name}[{j}] and {name}[{i}] overlap; each device needs its own buffer"
                )));
            }
        }
        // SAFETY: checked; the caller promises `len` bytes at each, and they do not overlap.
        out.push(unsafe { buffers::slice_mut(*p, len) });
    }
    Ok(out)
}

/// All-reduce across the client's devices, in place: `buffers[i]` (host memory, `count`
/// elements of `dtype`) is replica i's input and output. Runs as one compiled XLA program on
/// every device.
///
/// Thread-safety: callable from several threads on one client (calls run one after another).
///
/// # Safety
///
/// `client` is NULL or a live handle; `buffers` is NULL or holds one pointer per device, each
/// to `count` readable and writable elements.
#[no_mangle]
pub unsafe extern "C" fn tutti_xla_all_reduce(
    client: *const tutti_xla_client,
    count: usize,
    dtype: tutti_dtype,
    op: tutti_op,
    buffers: *const *mut c_void,
) -> tutti_result {
    boundary("tutti_xla_all_reduce", || {
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let op = types::op(op).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        #[cfg(feature = "xla")]
        {
            // SAFETY: as the caller promises.
            let c = unsafe { client_ref(client) }?;
            let mut bufs =
                unsafe { per_device(buffers, c.devices().len(), len, dtype, "buffers") }?;
            c.all_reduce_raw(dtype, &mut bufs, op)?;
            Ok(())
        }
        #[cfg(not(feature = "xla"))]
        {
            let _ = (client, op, len, buffers);
            Err(unavailable())
        }
    })
}

/// Broadcast device `root`'s buffer into every device's (`buffers[i]`: `count` elements).
///
/// Thread-safety: as `tutti_xla_all_reduce`.
///
/// # Safety
///
/// As `tutti_xla_all_reduce`.
#[no_mangle]
pub unsafe extern "C" fn tutti_xla_broadcast(
    client: *const tutti_xla_client,
    count: usize,
    dtype: tutti_dtype,
    root: usize,
    buffers: *const *mut c_void,
) -> tutti_result {
    boundary("tutti_xla_broadcast", || {
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        #[cfg(feature = "xla")]
        {
            // SAFETY: as the caller promises.
            let c = unsafe { client_ref(client) }?;
            let mut bufs =
                unsafe { per_device(buffers, c.devices().len(), len, dtype, "buffers") }?;
            c.broadcast_raw(dtype, &mut bufs, root)?;
            Ok(())
        }
        #[cfg(not(feature = "xla"))]
        {
            let _ = (client, root, len, buffers);
            Err(unavailable())
        }
    })
}
