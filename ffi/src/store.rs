//! `tutti_store`: a key-value store the caller provides, as callbacks, through which the ranks
//! of `tutti_comm_create_store` meet (a framework's own store, such as the one
//! torch.distributed hands a backend).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::mem::size_of;
use std::time::Duration;

use tutti::{Communicator, Error, Store};

use crate::comm::{out_ptr, transport_for, tutti_comm};
use crate::config::{self, tutti_config};
use crate::error::{boundary, tutti_result, Failure};

/// What a `tutti_store` `get` callback returns when the key was not set within its
/// `timeout_ms` (any other nonzero value is a failure of the store).
pub const TUTTI_STORE_TIMEOUT: c_int = 1;

/// The most bytes tutti reads of one value from a `tutti_store` (a longer one is an error
/// naming its key). Every value tutti stores is far smaller.
pub const TUTTI_STORE_VALUE_MAX: usize = 64 << 10;

/// A key-value store the caller provides, through which the ranks of
/// `tutti_comm_create_store` meet: every rank of the job must see the same store (or the same
/// keys under the same prefix). Keys are NUL-terminated UTF-8 strings that start with
/// `tutti/`; values are bytes. Each callback gets `ctx` first and returns 0 on success,
/// nonzero on failure (tutti's error then names the callback and the key). They are called
/// only during `tutti_comm_create_store`, and only from the thread that calls it.
///
/// ```c
/// tutti_store store = { sizeof(tutti_store), my_ctx, my_set, my_get, my_add };
/// ```
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct tutti_store {
    /// `sizeof(tutti_store)` as the caller compiled it.
    pub struct_size: usize,
    /// Passed as the first argument of every callback.
    pub ctx: *mut c_void,
    /// Set `key` to the `len` bytes at `value` (overwriting any value), and return at once.
    pub set: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: *const c_char,
            value: *const u8,
            len: usize,
        ) -> c_int,
    >,
    /// Wait up to `timeout_ms` milliseconds for `key` to be set (0: look once), then write up
    /// to `cap` bytes of its value to `buf` and the value's full length to `*len`. Returns
    /// `TUTTI_STORE_TIMEOUT` when the key was not set in time. tutti gives a buffer of
    /// `TUTTI_STORE_VALUE_MAX` bytes; a longer value is an error naming the key.
    pub get: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: *const c_char,
            timeout_ms: u64,
            buf: *mut u8,
            cap: usize,
            len: *mut usize,
        ) -> c_int,
    >,
    /// Add `delta` to the integer at `key` (0 when unset) and write the new value to
    /// `*value`.
    pub add: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: *const c_char,
            delta: i64,
            value: *mut i64,
        ) -> c_int,
    >,
}

/// The size of the first version of `tutti_store`; a smaller `struct_size` is an error.
const FIRST_SIZE: usize = size_of::<tutti_store>();

type SetFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const u8, usize) -> c_int;
type GetFn =
    unsafe extern "C" fn(*mut c_void, *const c_char, u64, *mut u8, usize, *mut usize) -> c_int;
type AddFn = unsafe extern "C" fn(*mut c_void, *const c_char, i64, *mut i64) -> c_int;

/// A caller's `tutti_store`, read and checked: the core's [`Store`] over its callbacks.
struct Callbacks {
    ctx: *mut c_void,
    set: SetFn,
    get: GetFn,
    add: AddFn,
}

// SAFETY: `Store` asks for Send + Sync, but a `Callbacks` lives only inside one
// `tutti_comm_create_store` call, on its stack, and the core calls a store given to
// `Communicator::from_store` only from the thread that called it: the callbacks and `ctx` are
// never used from another thread.
unsafe impl Send for Callbacks {}
// SAFETY: as for Send.
unsafe impl Sync for Callbacks {}

/// Read the caller's store.
///
/// # Safety
///
/// `store` is NULL or points to at least `store->struct_size` readable bytes.
unsafe fn read(store: *const tutti_store) -> Result<Callbacks, Failure> {
    if store.is_null() {
        return Err(Failure::invalid("store is NULL"));
    }
    // SAFETY: the first field is always there.
    let size = unsafe { std::ptr::addr_of!((*store).struct_size).read_unaligned() };
    // SAFETY: the caller promises `size` readable bytes.
    unsafe {
        config::check_struct_size(
            store.cast(),
            size,
            FIRST_SIZE,
            FIRST_SIZE,
            "store",
            "tutti_store",
            "set it to sizeof(tutti_store)",
        )
    }?;
    // SAFETY: at least FIRST_SIZE bytes are readable; the struct may be under-aligned.
    let s = unsafe { store.read_unaligned() };
    let missing = |name: &str| Failure::invalid(format!("store->{name} is NULL"));
    Ok(Callbacks {
        ctx: s.ctx,
        set: s.set.ok_or_else(|| missing("set"))?,
        get: s.get.ok_or_else(|| missing("get"))?,
        add: s.add.ok_or_else(|| missing("add"))?,
    })
}

/// The C string of a key tutti made (never with a NUL inside).
fn c_key(key: &str) -> tutti::Result<CString> {
    CString::new(key).map_err(|_| Error::config(format!("store key '{key}' contains a NUL byte")))
}

fn failed(callback: &str, key: &str, rc: c_int) -> Error {
    Error::System {
        what: format!("store callback '{callback}' failed for key '{key}'"),
        message: format!("it returned {rc}"),
    }
}

impl Store for Callbacks {
    fn set(&self, key: &str, value: &[u8]) -> tutti::Result<()> {
        let k = c_key(key)?;
        // SAFETY: the caller of tutti_comm_create_store promises a callable `set`; the key and
        // value live across the call.
        let rc = unsafe { (self.set)(self.ctx, k.as_ptr(), value.as_ptr(), value.len()) };
        match rc {
            0 => Ok(()),
            rc => Err(failed("set", key, rc)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> tutti::Result<Vec<u8>> {
        let k = c_key(key)?;
        let mut buf = vec![0u8; TUTTI_STORE_VALUE_MAX];
        let mut len = 0usize;
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // SAFETY: as for set; `buf` has `cap` writable bytes and `len` is writable.
        let rc = unsafe {
            (self.get)(
                self.ctx,
                k.as_ptr(),
                ms,
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
            )
        };
        match rc {
            0 if len > buf.len() => Err(Error::config(format!(
                "store callback 'get' gave a value of {len} bytes for key '{key}', more than \
                 tutti reads ({TUTTI_STORE_VALUE_MAX}): is another program using these keys?"
            ))),
            0 => {
                buf.truncate(len);
                Ok(buf)
            }
            TUTTI_STORE_TIMEOUT => Err(Error::JoinTimeout {
                message: format!(
                    "rendezvous: key '{key}' was not set within {timeout:?} (a rank has not \
                     started, or cannot reach the store)"
                ),
                timeout,
            }),
            rc => Err(failed("get", key, rc)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> tutti::Result<i64> {
        let k = c_key(key)?;
        let mut value = 0i64;
        // SAFETY: as for set; `value` is writable.
        let rc = unsafe { (self.add)(self.ctx, k.as_ptr(), delta, &mut value) };
        match rc {
            0 => Ok(value),
            rc => Err(failed("add", key, rc)),
        }
    }
}

/// Join a multi-process job as rank `rank` of `world_size`, meeting the other ranks through
/// `store`, a key-value store this program provides (a framework's own: no rendezvous port of
/// tutti's to configure), and write the communicator to `*comm`. Each rank listens on
/// `listen_host` (NULL: `"127.0.0.1"`; `"0.0.0.0"` for ranks on several hosts) at a port the
/// OS chooses, publishes its address in the store, and connects to every peer; every
/// connection proves `token`, the job's secret (at least 16 bytes, the same on every rank).
/// Peers on the same host use shared memory under `TUTTI_TRANSPORT_AUTO`, as with
/// `tutti_comm_create_rank`. Several communicators may meet through one store, created in the
/// same order on every rank. Blocks until every rank has joined or the timeout runs out.
/// `config` may be NULL for every default. Released with `tutti_comm_destroy`.
///
/// The store's callbacks are called only during this call, from the calling thread; `set` and
/// `add` must return without waiting long, `get` within its `timeout_ms`.
///
/// Errors: `TUTTI_ERROR_INVALID_ARGUMENT` naming the argument or field that is wrong (a NULL
/// store or callback, a bad `struct_size`, a short token, a rank out of range);
/// `TUTTI_ERROR_TIMEOUT` naming the rank that did not publish its address in time;
/// `TUTTI_ERROR_SYSTEM` when a callback failed (the message names it and its key) or a
/// connection could not be made.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `store` is NULL or points to a `tutti_store` of `store->struct_size` bytes whose callbacks
/// may be called with its `ctx` during this call; `token` and `listen_host` are NULL or
/// NUL-terminated strings; `config` is NULL or points to a `tutti_config` of
/// `config->struct_size` bytes; `comm` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_create_store(
    rank: usize,
    world_size: usize,
    store: *const tutti_store,
    token: *const c_char,
    listen_host: *const c_char,
    config: *const tutti_config,
    comm: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_create_store", || {
        // SAFETY: as the caller promises.
        let settings = unsafe { config::read(config) }?;
        // SAFETY: as the caller promises.
        let callbacks = unsafe { read(store) }?;
        if token.is_null() {
            return Err(Failure::invalid("token is NULL"));
        }
        // SAFETY: the caller promises a NUL-terminated string.
        let token = unsafe { CStr::from_ptr(token) }
            .to_str()
            .map_err(|_| Failure::invalid("token is not UTF-8"))?;
        let host = if listen_host.is_null() {
            "127.0.0.1"
        } else {
            // SAFETY: the caller promises a NUL-terminated string.
            unsafe { CStr::from_ptr(listen_host) }
                .to_str()
                .map_err(|_| Failure::invalid("listen_host is not UTF-8"))?
        };
        let out = out_ptr(comm, "comm")?;
        let kind = transport_for(&settings)?;
        let c = Communicator::from_store(
            rank,
            world_size,
            &callbacks,
            token,
            host,
            kind,
            &settings.core,
        )?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(tutti_comm::into_raw(c)) };
        Ok(())
    })
}
