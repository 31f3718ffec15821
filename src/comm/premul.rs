//! The pre-multiplied sum (NCCL's `ncclRedOpCreatePreMulSum`): each rank's input scaled by a
//! factor of its own, then summed, as a gradient pre-divided by its rank's share is.

use super::call::{Bytes, BytesMut};
use super::work::Owned;
use super::{Communicator, Work};
use crate::dtype::{kernels, DType, Element, ReduceOp};
use crate::error::Result;

impl Communicator {
    /// All-reduce of each rank's buffer scaled by that rank's own `factor`: every rank ends
    /// with Σ over ranks r of `factor_r · buf_r`. The factor becomes a `T` first (integers: it
    /// must be a whole number `T` holds, else an argument error every rank sees), each element
    /// is multiplied as `T` multiplies (f16 and bf16 as f32 does, rounded once; integers wrap),
    /// then summed as [`ReduceOp::Sum`] sums (bit for bit in rank order in deterministic
    /// mode). The scaled copy is made before the ranks meet, so an error leaves `buf` as it was.
    ///
    /// ```
    /// let sums = tutti::run_local(2, &tutti::Config::default(), |comm| {
    ///     let mut g = vec![1.0f32; 3];
    ///     comm.all_reduce_premul_sum(&mut g, 0.5 * (comm.rank() + 1) as f64).unwrap();
    ///     g
    /// })
    /// .unwrap();
    /// assert_eq!(sums[1], [1.5, 1.5, 1.5]);
    /// ```
    pub fn all_reduce_premul_sum<T: Element>(&self, buf: &mut [T], factor: f64) -> Result<()> {
        self.all_reduce_premul_sum_raw(T::DTYPE, None, bytemuck::cast_slice_mut(buf), factor)
    }

    /// [`Communicator::all_reduce_premul_sum`] over raw bytes holding `dtype` elements, out of
    /// place from `input`, or in place in `output` when `input` is `None`.
    pub fn all_reduce_premul_sum_raw(
        &self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        factor: f64,
    ) -> Result<()> {
        let (scaled, check) = scaled(dtype, input.unwrap_or(output), factor);
        let mut call = self.all_reduce_call(
            dtype,
            Some(Bytes::of(&scaled)),
            BytesMut::of(output),
            ReduceOp::Sum,
        );
        if let (Ok(()), Err(m)) = (&call.check, check) {
            call.check = Err(m);
        }
        self.blocking(call)
    }

    /// [`Communicator::all_reduce_premul_sum`] without waiting; [`Work::wait`] hands `buf`
    /// back holding the sum. The scaled copy is the call's until it completes.
    ///
    /// ```
    /// let sums = tutti::run_local(2, &tutti::Config::default(), |comm| {
    ///     let w = comm.all_reduce_premul_sum_async(vec![2.0f64; 3], comm.rank() as f64 + 1.0);
    ///     w.wait().unwrap()
    /// })
    /// .unwrap();
    /// assert_eq!(sums[0], [6.0, 6.0, 6.0]);
    /// ```
    pub fn all_reduce_premul_sum_async<T, B>(&self, buf: B, factor: f64) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let mut buf = Owned::new(buf);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.get().as_mut());
        let (scaled, check) = scaled(T::DTYPE, bytes, factor);
        let mut call = self.all_reduce_call(
            T::DTYPE,
            Some(Bytes::of(&scaled)),
            BytesMut::of(bytes),
            ReduceOp::Sum,
        );
        if let (Ok(()), Err(m)) = (&call.check, check) {
            call.check = Err(m);
        }
        let work = self.issue(call, buf);
        // The copy's heap memory stays where the call reads it until the call completes.
        self.progress.drop_after_issued(Box::new(scaled));
        work
    }

    /// Reduce-scatter of each rank's `send` scaled by that rank's own `factor` (see
    /// [`Communicator::all_reduce_premul_sum`]): `recv` becomes slice `rank` of the sum.
    pub fn reduce_scatter_premul_sum<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        factor: f64,
    ) -> Result<()> {
        self.reduce_scatter_premul_sum_raw(
            T::DTYPE,
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            factor,
        )
    }

    /// [`Communicator::reduce_scatter_premul_sum`] without waiting; [`Work::wait`] hands back
    /// `(send, recv)`, `recv` holding this rank's slice of the sum.
    pub fn reduce_scatter_premul_sum_async<T, S, R>(
        &self,
        send: S,
        recv: R,
        factor: f64,
    ) -> Work<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((send, recv));
        let (send, recv) = bufs.get();
        let (scaled, check) = scaled(T::DTYPE, bytemuck::cast_slice(send.as_ref()), factor);
        let mut call = self.reduce_scatter_call(
            T::DTYPE,
            Bytes::of(&scaled),
            BytesMut::of(bytemuck::cast_slice_mut(recv.as_mut())),
            ReduceOp::Sum,
        );
        if let (Ok(()), Err(m)) = (&call.check, check) {
            call.check = Err(m);
        }
        let work = self.issue(call, bufs);
        self.progress.drop_after_issued(Box::new(scaled));
        work
    }

    /// [`Communicator::reduce_scatter_premul_sum`] over raw bytes holding `dtype` elements.
    pub fn reduce_scatter_premul_sum_raw(
        &self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        factor: f64,
    ) -> Result<()> {
        let (scaled, check) = scaled(dtype, input, factor);
        let mut call = self.reduce_scatter_call(
            dtype,
            Bytes::of(&scaled),
            BytesMut::of(output),
            ReduceOp::Sum,
        );
        if let (Ok(()), Err(m)) = (&call.check, check) {
            call.check = Err(m);
        }
        self.blocking(call)
    }
}

/// A copy of `input` scaled by `factor`, and whether the factor can scale `dtype` (when it
/// cannot, the copy is left unscaled and the call carries the error).
fn scaled(dtype: DType, input: &[u8], factor: f64) -> (Vec<u8>, std::result::Result<(), String>) {
    let mut copy = input.to_vec();
    let check = kernels::check_scale(dtype, factor)
        .map_err(|e| format!("premul_sum: {e}"))
        .and_then(|()| {
            if input.len() % dtype.size() == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{} bytes are not whole {dtype} elements",
                    input.len()
                ))
            }
        });
    if check.is_ok() {
        kernels::scale(dtype, &mut copy, factor);
    }
    (copy, check)
}
