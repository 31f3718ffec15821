//! Reusing allocations from one call to the next (see `algorithm::Plan` and the network
//! transport's exchange state), so that a repeated call allocates nothing.

/// An empty vector with `v`'s allocation, for elements of another lifetime (the same type but
/// for its lifetimes: equal size and alignment, checked at compile time).
pub(crate) fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    const {
        assert!(std::mem::size_of::<T>() == std::mem::size_of::<U>());
        assert!(std::mem::align_of::<T>() == std::mem::align_of::<U>());
    }
    v.clear();
    let mut v = std::mem::ManuallyDrop::new(v);
    let (ptr, cap) = (v.as_mut_ptr(), v.capacity());
    // SAFETY: the allocation came from a `Vec<T>` of capacity `cap`, whose layout equals that
    // of a `Vec<U>` of the same capacity (equal size and alignment); no element is live.
    unsafe { Vec::from_raw_parts(ptr.cast::<U>(), 0, cap) }
}
