//! `tutti_checkpoint`: a step and named tensors saved to a directory and restored from it
//! (TensorFlow's `tf.train.Checkpoint` and `CheckpointManager`), in tutti's versioned file
//! format (the README's "Checkpoints"); with a multi-worker strategy the chief writes and reads
//! and every worker learns the outcome.

use std::ffi::{c_char, c_void, CStr};

use tutti::strategy::{Checkpoint, CheckpointManager};

use crate::buffers::{byte_len, check};
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::strategy::{strategy_opt, tutti_strategy};
use crate::types::{self, tutti_dtype};

/// A checkpoint (opaque): a step and named tensors. Created by `tutti_checkpoint_create` or
/// `tutti_checkpoint_restore`, released by `tutti_checkpoint_destroy`.
pub struct tutti_checkpoint {
    pub(crate) inner: Checkpoint,
}

/// # Safety
///
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn text<'a>(s: *const c_char, name: &str) -> Result<&'a str, Failure> {
    if s.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    // SAFETY: the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| Failure::invalid(format!("{name} is not UTF-8")))
}

/// The most dimensions a variable may have (numpy's limit).
const MAX_NDIM: usize = 64;

/// `ptr`, named `name`, can hold `ndim` dimensions: not NULL unless `ndim` is 0, aligned for
/// `size_t`.
fn shape_ok(ptr: *const usize, ndim: usize, name: &str) -> Result<(), Failure> {
    if ndim == 0 {
        return Ok(());
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!(
            "{name} is NULL but ndim is {ndim}"
        )));
    }
    if (ptr as usize) % std::mem::align_of::<usize>() != 0 {
        return Err(Failure::invalid(format!(
            "{name} ({ptr:p}) is not aligned to {} bytes, the alignment of size_t",
            std::mem::align_of::<usize>()
        )));
    }
    Ok(())
}

/// The `ndim` dimensions at `ptr` (at most [`MAX_NDIM`]).
///
/// # Safety
///
/// `ptr` is NULL or holds `ndim` readable values.
unsafe fn dims<'a>(ptr: *const usize, ndim: usize, name: &str) -> Result<&'a [usize], Failure> {
    if ndim > MAX_NDIM {
        return Err(Failure::invalid(format!(
            "ndim {ndim}: at most {MAX_NDIM} dimensions"
        )));
    }
    shape_ok(ptr, ndim, name)?;
    if ndim == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-NULL, aligned, at most MAX_NDIM values, which the caller promises.
    Ok(unsafe { std::slice::from_raw_parts(ptr, ndim) })
}

/// # Safety
///
/// `c` is NULL or a live handle.
unsafe fn checkpoint_ref<'a>(c: *const tutti_checkpoint) -> Result<&'a Checkpoint, Failure> {
    // SAFETY: as the caller promises.
    unsafe { c.as_ref() }
        .map(|c| &c.inner)
        .ok_or_else(|| Failure::invalid("checkpoint is NULL"))
}

/// # Safety
///
/// `out` is NULL or writable.
unsafe fn give(out: *mut *mut tutti_checkpoint, inner: Checkpoint) {
    // SAFETY: checked non-NULL by the caller of this function; writable as promised.
    unsafe { out.write(Box::into_raw(Box::new(tutti_checkpoint { inner }))) };
}

/// Create an empty checkpoint of `step` (the steps trained so far) and write it to
/// `*checkpoint`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `checkpoint` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_create(
    step: u64,
    checkpoint: *mut *mut tutti_checkpoint,
) -> tutti_result {
    boundary("tutti_checkpoint_create", || {
        if checkpoint.is_null() {
            return Err(Failure::invalid("checkpoint is NULL"));
        }
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { give(checkpoint, Checkpoint::new(step)) };
        Ok(())
    })
}

/// Release a checkpoint. NULL is accepted and ignored.
///
/// Thread-safety: no other call may be using `checkpoint`, nor use it afterwards.
///
/// # Safety
///
/// `checkpoint` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_destroy(checkpoint: *mut tutti_checkpoint) {
    boundary_void("tutti_checkpoint_destroy", || {
        if !checkpoint.is_null() {
            // SAFETY: a live handle from Box::into_raw, released once.
            drop(unsafe { Box::from_raw(checkpoint) });
        }
    })
}

/// Write the step the checkpoint was made or saved at to `*step`.
///
/// Thread-safety: callable from any thread while no call modifies `checkpoint`.
///
/// # Safety
///
/// `checkpoint` is NULL or a live handle; `step` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_step(
    checkpoint: *const tutti_checkpoint,
    step: *mut u64,
) -> tutti_result {
    boundary("tutti_checkpoint_step", || {
        // SAFETY: as the caller promises.
        let c = unsafe { checkpoint_ref(checkpoint) }?;
        if step.is_null() {
            return Err(Failure::invalid("step is NULL"));
        }
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { step.write(c.step()) };
        Ok(())
    })
}

/// Add the variable `name`: `ndim` dimensions `shape[0..ndim]` of `dtype` elements at `data`
/// (row-major; copied). A name already present is an error.
///
/// Thread-safety: one call at a time per checkpoint.
///
/// # Safety
///
/// `checkpoint` is NULL or a live handle; `name` is NULL or NUL-terminated; `shape` is NULL or
/// holds `ndim` values; `data` is NULL or holds the product of the shape's elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_insert(
    checkpoint: *mut tutti_checkpoint,
    name: *const c_char,
    dtype: tutti_dtype,
    ndim: usize,
    shape: *const usize,
    data: *const c_void,
) -> tutti_result {
    boundary("tutti_checkpoint_insert", || {
        // SAFETY: as the caller promises.
        let c = unsafe { checkpoint.as_mut() }
            .map(|c| &mut c.inner)
            .ok_or_else(|| Failure::invalid("checkpoint is NULL"))?;
        // SAFETY: as the caller promises.
        let name = unsafe { text(name, "name") }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        // SAFETY: as the caller promises.
        let shape = unsafe { dims(shape, ndim, "shape") }?;
        let count = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Failure::invalid(format!("shape {shape:?} overflows")))?;
        let len = byte_len(count, 1, dtype).map_err(Failure::invalid)?;
        check(data, len, dtype, "data").map_err(Failure::invalid)?;
        let bytes = if len == 0 {
            &[][..]
        } else {
            // SAFETY: checked non-NULL and aligned; the caller promises `len` readable bytes.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        };
        c.insert_bytes(name, dtype, shape, bytes)?;
        Ok(())
    })
}

/// Describe the variable `name`: write its element type to `*dtype`, its number of dimensions
/// to `*ndim`, and its first `min(*ndim, max_ndim)` dimensions to `shape` (call with
/// `max_ndim` 0 to learn `ndim` first). An absent name is an error listing those present.
/// `dtype` and `ndim` may be NULL, and `shape` where `max_ndim` is 0.
///
/// Thread-safety: callable from any thread while no call modifies `checkpoint`.
///
/// # Safety
///
/// `checkpoint` is NULL or a live handle; `name` is NULL or NUL-terminated; `dtype` and `ndim`
/// are NULL or writable; `shape` is NULL or holds `max_ndim` writable values.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_variable(
    checkpoint: *const tutti_checkpoint,
    name: *const c_char,
    dtype: *mut tutti_dtype,
    ndim: *mut usize,
    shape: *mut usize,
    max_ndim: usize,
) -> tutti_result {
    boundary("tutti_checkpoint_variable", || {
        // SAFETY: as the caller promises.
        let c = unsafe { checkpoint_ref(checkpoint) }?;
        // SAFETY: as the caller promises.
        let name = unsafe { text(name, "name") }?;
        let (d, dims, _) = c.bytes(name)?;
        let shown = dims.len().min(max_ndim);
        if shown > 0 {
            shape_ok(shape, max_ndim, "shape")?;
        }
        // SAFETY: NULL-checked; the caller promises they are writable (shape: `max_ndim`).
        unsafe {
            if !dtype.is_null() {
                dtype.write(d as u32);
            }
            if !ndim.is_null() {
                ndim.write(dims.len());
            }
            if shown > 0 {
                std::ptr::copy_nonoverlapping(dims.as_ptr(), shape, shown);
            }
        }
        Ok(())
    })
}

/// Copy the variable `name` into `out`, which holds `count` elements of `dtype`: the
/// variable's element type and element count, else an error naming both.
///
/// Thread-safety: callable from any thread while no call modifies `checkpoint`.
///
/// # Safety
///
/// `checkpoint` is NULL or a live handle; `name` is NULL or NUL-terminated; `out` is NULL or
/// holds `count` writable elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_read(
    checkpoint: *const tutti_checkpoint,
    name: *const c_char,
    dtype: tutti_dtype,
    count: usize,
    out: *mut c_void,
) -> tutti_result {
    boundary("tutti_checkpoint_read", || {
        // SAFETY: as the caller promises.
        let c = unsafe { checkpoint_ref(checkpoint) }?;
        // SAFETY: as the caller promises.
        let name = unsafe { text(name, "name") }?;
        let dtype = types::dtype(dtype).map_err(Failure::invalid)?;
        let (saved, dims, bytes) = c.bytes(name)?;
        let have = bytes.len() / saved.size();
        if saved != dtype || have != count {
            return Err(Failure::invalid(format!(
                "variable {name:?} holds {have} {saved} elements (shape {dims:?}); out is \
                 {count} {dtype} elements"
            )));
        }
        check(out, bytes.len(), dtype, "out").map_err(Failure::invalid)?;
        if !bytes.is_empty() {
            // SAFETY: checked non-NULL and aligned; the caller promises `count` elements.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len()) };
        }
        Ok(())
    })
}

/// Save `checkpoint` in `directory` (created if missing) as `ckpt-<step>.tutti`, keeping the
/// last `max_to_keep` (at least 1) by step. With a multi-worker `strategy` the chief writes
/// and every worker calls this and returns the chief's outcome; with any other strategy, or
/// NULL, this process writes.
///
/// Thread-safety: one call at a time per strategy; not during `tutti_strategy_run`.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `directory` is NULL or NUL-terminated; `checkpoint` is
/// NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_save(
    strategy: *const tutti_strategy,
    directory: *const c_char,
    max_to_keep: usize,
    checkpoint: *const tutti_checkpoint,
) -> tutti_result {
    boundary("tutti_checkpoint_save", || {
        // SAFETY: as the caller promises.
        let (s, dir, c) = unsafe {
            (
                strategy_opt(strategy),
                text(directory, "directory")?,
                checkpoint_ref(checkpoint)?,
            )
        };
        let m = CheckpointManager::new(dir, max_to_keep)?;
        match s {
            Some(s) => s.save_checkpoint(&m, c).map(drop)?,
            None => m.save(c).map(drop)?,
        }
        Ok(())
    })
}

/// Restore the latest checkpoint of `directory` into a new handle written to `*checkpoint`, or
/// write NULL there where the directory has none. With a multi-worker `strategy` the chief
/// reads and every worker receives it (no shared file system needed); a damaged file is the
/// same error on every worker, naming it.
///
/// Thread-safety: one call at a time per strategy; not during `tutti_strategy_run`.
///
/// # Safety
///
/// `strategy` is NULL or a live handle; `directory` is NULL or NUL-terminated; `checkpoint` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_checkpoint_restore(
    strategy: *const tutti_strategy,
    directory: *const c_char,
    checkpoint: *mut *mut tutti_checkpoint,
) -> tutti_result {
    boundary("tutti_checkpoint_restore", || {
        // SAFETY: as the caller promises.
        let (s, dir) = unsafe { (strategy_opt(strategy), text(directory, "directory")?) };
        if checkpoint.is_null() {
            return Err(Failure::invalid("checkpoint is NULL"));
        }
        // Reading keeps every checkpoint there: how many to keep does not matter.
        let m = CheckpointManager::new(dir, 1)?;
        let restored = match s {
            Some(s) => s.restore_checkpoint(&m)?,
            None => m.restore_latest()?,
        };
        match restored {
            // SAFETY: checked non-NULL; the caller promises it is writable.
            Some(c) => unsafe { give(checkpoint, c) },
            // SAFETY: as above.
            None => unsafe { checkpoint.write(std::ptr::null_mut()) },
        }
        Ok(())
    })
}
