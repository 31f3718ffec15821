//! Checks on the buffers C hands in, before any of them becomes a Rust slice.

use std::ffi::c_void;

use tutti::DType;

/// The byte length of `count × times` elements of `dtype`, or an error when it overflows or
/// exceeds what one buffer can hold.
pub(crate) fn byte_len(count: usize, times: usize, dtype: DType) -> Result<usize, String> {
    count
        .checked_mul(times)
        .and_then(|n| n.checked_mul(dtype.size()))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| {
            if times == 1 {
                format!("count {count} of {dtype} is more bytes than a buffer can hold")
            } else {
                format!("{times} × count {count} of {dtype} is more bytes than a buffer can hold")
            }
        })
}

/// The byte length of the elements `counts` lists (one count per rank) of `dtype`, or an
/// error naming `name` when their sum overflows or exceeds what one buffer can hold.
pub(crate) fn counts_len(counts: &[usize], dtype: DType, name: &str) -> Result<usize, String> {
    counts
        .iter()
        .try_fold(0usize, |sum, &n| sum.checked_add(n))
        .and_then(|n| n.checked_mul(dtype.size()))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| {
            format!("the entries of {name} sum to more {dtype} elements than a buffer can hold")
        })
}

/// A copy of the `world` counts at `ptr`, named `name`: one per rank of the communicator,
/// read when the call is issued. NULL is an error unless `world` is 0.
///
/// # Safety
///
/// `ptr` is NULL or points to `world` readable `size_t` values.
pub(crate) unsafe fn read_counts(
    ptr: *const usize,
    world: usize,
    name: &str,
) -> Result<Vec<usize>, String> {
    if world == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(format!(
            "{name} is NULL but must hold one count per rank ({world} size_t values)"
        ));
    }
    if (ptr as usize) % std::mem::align_of::<usize>() != 0 {
        return Err(format!(
            "{name} ({ptr:p}) is not aligned to {} bytes, the alignment of size_t",
            std::mem::align_of::<usize>()
        ));
    }
    // SAFETY: non-NULL and aligned; the caller promises `world` readable values.
    Ok(unsafe { std::slice::from_raw_parts(ptr, world) }.to_vec())
}

/// Check that `ptr`, named `name`, can hold `len` bytes of `dtype`: not NULL unless `len` is 0,
/// and aligned to the element size.
pub(crate) fn check(
    ptr: *const c_void,
    len: usize,
    dtype: DType,
    name: &str,
) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    if ptr.is_null() {
        return Err(format!(
            "{name} is NULL but must hold {} {dtype} elements",
            len / dtype.size()
        ));
    }
    if (ptr as usize) % dtype.size() != 0 {
        return Err(format!(
            "{name} ({ptr:p}) is not aligned to {} bytes, the size of a {dtype} element",
            dtype.size()
        ));
    }
    Ok(())
}

/// True when the byte ranges `[a, a + a_len)` and `[b, b + b_len)` share a byte.
pub(crate) fn overlap(a: *const c_void, a_len: usize, b: *const c_void, b_len: usize) -> bool {
    let (a, b) = (a as usize, b as usize);
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// True when any two of `regions` (pointer, length) share a byte.
pub(crate) fn any_overlap(regions: &[(*const c_void, usize)]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..regions.len()).filter(|&i| regions[i].1 > 0).collect();
    order.sort_by_key(|&i| regions[i].0 as usize);
    order.windows(2).find_map(|w| {
        let (a, b) = (regions[w[0]], regions[w[1]]);
        overlap(a.0, a.1, b.0, b.1).then(|| (w[0].min(w[1]), w[0].max(w[1])))
    })
}

/// The bytes at `ptr`.
///
/// # Safety
///
/// `ptr` passed [`check`] for `len` and points to `len` readable bytes that nothing writes while
/// the slice lives.
pub(crate) unsafe fn slice<'a>(ptr: *const c_void, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: as the caller promises.
    unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
}

/// The bytes at `ptr`, writable.
///
/// # Safety
///
/// `ptr` passed [`check`] for `len` and points to `len` writable bytes that nothing else reads
/// or writes while the slice lives.
pub(crate) unsafe fn slice_mut<'a>(ptr: *mut c_void, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: as the caller promises.
    unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) }
}

/// Storage for a copy of `len` bytes aligned for any element type.
pub(crate) struct AlignedCopy(Vec<u64>, usize);

impl AlignedCopy {
    #[cfg(test)]
    pub fn of(bytes: &[u8]) -> AlignedCopy {
        let mut v = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
        AlignedCopy(v, bytes.len())
    }
    /// `len` zero bytes, to copy into later through [`AlignedCopy::as_mut_ptr`].
    pub fn zeroed(len: usize) -> AlignedCopy {
        AlignedCopy(vec![0u64; len.div_ceil(8)], len)
    }
    /// The first byte, for writing the copy in (its heap bytes do not move with the value).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr().cast()
    }
    pub fn len(&self) -> usize {
        self.1
    }
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..self.1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_pointers_and_overlaps() {
        assert_eq!(byte_len(3, 4, DType::F64), Ok(96));
        assert!(byte_len(usize::MAX / 2, 1, DType::F32).is_err());
        assert!(byte_len(usize::MAX, 2, DType::U8)
            .unwrap_err()
            .contains('×'));
        let x = [0u32; 4];
        let p = x.as_ptr().cast::<c_void>();
        assert!(check(p, 16, DType::F32, "input").is_ok());
        assert!(check(std::ptr::null(), 0, DType::F32, "input").is_ok());
        let e = check(std::ptr::null(), 8, DType::F32, "output").unwrap_err();
        assert!(e.contains("output is NULL") && e.contains("2 f32"), "{e}");
        let odd = unsafe { p.cast::<u8>().add(1) }.cast::<c_void>();
        assert!(check(odd, 4, DType::F32, "input")
            .unwrap_err()
            .contains("aligned"));
        assert!(overlap(p, 8, odd, 1));
        assert!(!overlap(p, 1, odd, 1));
        assert!(!overlap(p, 0, p, 8));
        let q = unsafe { p.cast::<u8>().add(8) }.cast::<c_void>();
        assert_eq!(any_overlap(&[(q, 8), (p, 8)]), None);
        assert_eq!(any_overlap(&[(q, 8), (p, 8), (odd, 2)]), Some((1, 2)));
        assert_eq!(counts_len(&[3, 0, 2], DType::F64, "counts"), Ok(40));
        assert_eq!(counts_len(&[], DType::F64, "counts"), Ok(0));
        let e = counts_len(&[usize::MAX, 1], DType::U8, "recv_counts").unwrap_err();
        assert!(e.contains("recv_counts"), "{e}");
        assert!(counts_len(&[usize::MAX / 4, 1], DType::F32, "counts").is_err());
        let counts = [4usize, 0, 7];
        assert_eq!(
            unsafe { read_counts(counts.as_ptr(), 3, "counts") },
            Ok(vec![4, 0, 7])
        );
        assert_eq!(
            unsafe { read_counts(std::ptr::null(), 0, "counts") },
            Ok(vec![])
        );
        let e = unsafe { read_counts(std::ptr::null(), 2, "send_counts") }.unwrap_err();
        assert!(
            e.contains("send_counts is NULL") && e.contains("2 size_t"),
            "{e}"
        );
        let odd = unsafe { counts.as_ptr().cast::<u8>().add(1) }.cast::<usize>();
        let e = unsafe { read_counts(odd, 2, "counts") }.unwrap_err();
        assert!(e.contains("not aligned"), "{e}");
        let c = AlignedCopy::of(&[1, 2, 3]);
        assert_eq!(c.bytes(), &[1, 2, 3]);
        assert_eq!(c.bytes().as_ptr() as usize % 8, 0);
    }
}
