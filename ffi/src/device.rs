//! Device discovery.

use std::ffi::c_char;
use std::mem::size_of;

use crate::config::MAX_STRUCT_SIZE;
use crate::error::{boundary, floor_char_boundary, tutti_result, Failure};
use crate::types::{device_kind_to_c, tutti_device_kind};

/// Room for a device's name in `tutti_device_info`, the NUL included.
pub const TUTTI_DEVICE_NAME_LEN: usize = 256;
/// Room for a device's spec in `tutti_device_info`, the NUL included.
pub const TUTTI_DEVICE_SPEC_LEN: usize = 64;

/// What `tutti_device_get` says about one device. Set `struct_size` (`TUTTI_DEVICE_INFO_INIT`
/// does) before the call; a library newer than the program fills only the fields the program
/// knows.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct tutti_device_info {
    /// `sizeof(tutti_device_info)` as the caller compiled it.
    pub struct_size: usize,
    /// Index among the devices of its kind (`cpu:1` has index 1).
    pub index: usize,
    /// For a logical device, the index of the physical device it lives on.
    pub physical_index: usize,
    /// Memory the device may use, in bytes; 0 when unknown.
    pub memory_bytes: u64,
    /// Its kind, a `TUTTI_DEVICE_*` value.
    pub kind: tutti_device_kind,
    /// Human-readable name (CPU model, GPU name), NUL-terminated, cut short if longer.
    pub name: [c_char; TUTTI_DEVICE_NAME_LEN],
    /// The device spec, e.g. `cpu:0`, NUL-terminated.
    pub spec: [c_char; TUTTI_DEVICE_SPEC_LEN],
}

fn c_text<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    let n = floor_char_boundary(s, N - 1);
    for (o, b) in out.iter_mut().zip(&s.as_bytes()[..n]) {
        *o = *b as c_char;
    }
    out
}

/// Write the number of devices this build can see (the host CPU, plus GPUs and XLA devices in
/// builds that support them) to `*count`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_device_count(count: *mut usize) -> tutti_result {
    boundary("tutti_device_count", || {
        if count.is_null() {
            return Err(Failure::invalid("count is NULL"));
        }
        let n = tutti::discover_devices().len();
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { count.write(n) };
        Ok(())
    })
}

/// Describe device `index` (in `0 .. count - 1`, see `tutti_device_count`) in `*info`, whose
/// `struct_size` the caller has set.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `info` is NULL or points to `info->struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tutti_device_get(
    index: usize,
    info: *mut tutti_device_info,
) -> tutti_result {
    boundary("tutti_device_get", || {
        if info.is_null() {
            return Err(Failure::invalid("info is NULL"));
        }
        // SAFETY: the first field is always there.
        let size = unsafe { std::ptr::addr_of!((*info).struct_size).read_unaligned() };
        let known = size_of::<tutti_device_info>();
        if size < known {
            return Err(Failure::invalid(format!(
                "info->struct_size is {size}, smaller than any tutti_device_info ({known} bytes); \
                 initialize it with TUTTI_DEVICE_INFO_INIT"
            )));
        }
        if size > MAX_STRUCT_SIZE {
            return Err(Failure::invalid(format!(
                "info->struct_size is {size}, more than any tutti_device_info will ever need; \
                 initialize it with TUTTI_DEVICE_INFO_INIT"
            )));
        }
        let devices = tutti::discover_devices();
        let d = devices.get(index).ok_or_else(|| {
            Failure::invalid(format!(
                "index {index} is out of range: this build sees {} device(s)",
                devices.len()
            ))
        })?;
        let out = tutti_device_info {
            struct_size: size,
            index: d.index,
            physical_index: d.physical_index,
            memory_bytes: d.memory_bytes.unwrap_or(0),
            kind: device_kind_to_c(d.kind),
            name: c_text(&d.name),
            spec: c_text(&d.spec()),
        };
        // SAFETY: the caller promises `size` writable bytes; fields this library does not know
        // are zeroed.
        unsafe {
            info.cast::<u8>().add(known).write_bytes(0, size - known);
            info.write_unaligned(out);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn the_host_cpu_is_device_zero() {
        let mut n = 0;
        assert_eq!(unsafe { tutti_device_count(&mut n) }, 0);
        assert!(n >= 1);
        let mut info: tutti_device_info = unsafe { std::mem::zeroed() };
        assert_eq!(
            unsafe { tutti_device_get(0, &mut info) },
            1,
            "struct_size unset"
        );
        info.struct_size = size_of::<tutti_device_info>();
        assert_eq!(unsafe { tutti_device_get(0, &mut info) }, 0);
        let spec = unsafe { CStr::from_ptr(info.spec.as_ptr()) };
        assert_eq!(spec.to_str().unwrap(), "cpu:0");
        assert_eq!(unsafe { tutti_device_get(n, &mut info) }, 1);
        let t: [c_char; 4] = c_text("abcdef");
        assert_eq!(t, [97, 98, 99, 0]);
    }
}
