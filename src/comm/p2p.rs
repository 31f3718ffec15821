//! Point-to-point: `send`, `recv` and groups of both (`send_recv`), between two ranks of a
//! communicator with no other rank involved.
//!
//! A rank's sends to a peer match that peer's receives from it in issue order, whatever the
//! grouping on either side; both sides state the same count and dtype, or the receive fails
//! naming both ranks and the communicator is aborted (the sender's next call says so). The calls
//! join the communicator's queue like the collectives (so they keep their order with them) but
//! take no call number: the other ranks never see them. A send to this rank itself needs its
//! receive in the same group. On the ranks of an in-process CUDA group the engine moves the bytes
//! GPU to GPU (see `engine::cuda`); XLA ranks, whose buffers are host memory, move them over the
//! group's transport as host ranks do; other device ranks refuse them.

use super::work::{Owned, Runnable, Shared};
use super::{Communicator, Work};
use crate::algorithm::Plan;
use crate::dtype::{DType, Element};
use crate::engine::StreamMark;
use crate::error::{Collective, Error, Result, Site};
use crate::transport::{PairData, PairOp};

/// One operation of a point-to-point group ([`Communicator::send_recv`]): a buffer sent to a
/// peer, or a buffer filled from one.
pub struct PeerOp<'a> {
    op: PairOp<'a>,
}

impl<'a> PeerOp<'a> {
    /// Send `buf` to `peer`.
    pub fn send<T: Element>(buf: &'a [T], peer: usize) -> PeerOp<'a> {
        PeerOp::send_raw(T::DTYPE, bytemuck::cast_slice(buf), peer)
    }

    /// Receive `peer`'s buffer into `buf`.
    pub fn recv<T: Element>(buf: &'a mut [T], peer: usize) -> PeerOp<'a> {
        PeerOp::recv_raw(T::DTYPE, bytemuck::cast_slice_mut(buf), peer)
    }

    /// Send raw bytes holding `dtype` elements to `peer`.
    pub fn send_raw(dtype: DType, buf: &'a [u8], peer: usize) -> PeerOp<'a> {
        PeerOp {
            op: PairOp {
                peer,
                dtype,
                data: PairData::Send(buf),
            },
        }
    }

    /// Receive `peer`'s bytes, holding `dtype` elements, into `buf`.
    pub fn recv_raw(dtype: DType, buf: &'a mut [u8], peer: usize) -> PeerOp<'a> {
        PeerOp {
            op: PairOp {
                peer,
                dtype,
                data: PairData::Recv(buf),
            },
        }
    }

    /// By address (a receive's from its exclusive borrow: the call writes through it).
    fn raw(&mut self) -> RawPeerOp {
        let (send, ptr, len) = match &mut self.op.data {
            PairData::Send(d) => (true, d.as_ptr() as *mut u8, d.len()),
            PairData::Recv(d) => (false, d.as_mut_ptr(), d.len()),
        };
        RawPeerOp {
            send,
            peer: self.op.peer,
            dtype: self.op.dtype,
            ptr,
            len,
        }
    }
}

pub use crate::call::RawPeerOp;

/// A point-to-point call ready to run: its operations by address, checked when it was made.
struct PairCall {
    collective: Collective,
    rank: usize,
    ops: Ops,
    check: std::result::Result<(), String>,
    /// On a `cuda:N` rank with a CUDA stream set: the stream's work before the call, which its
    /// data waits for.
    mark: Option<Box<dyn StreamMark>>,
}

/// A call's operations: one (a blocking `send` or `recv`, held without an allocation, as the
/// latency of a small message is what such a call pays for) or several.
enum Ops {
    One(RawPeerOp),
    Many(Vec<RawPeerOp>),
}

impl std::ops::Deref for Ops {
    type Target = [RawPeerOp];
    fn deref(&self) -> &[RawPeerOp] {
        match self {
            Ops::One(o) => std::slice::from_ref(o),
            Ops::Many(v) => v,
        }
    }
}

// SAFETY: the addresses are the caller's buffers, valid and untouched by the caller until the
// call completes (held by the call's `Work` or borrowed by a blocking call).
unsafe impl Send for PairCall {}
unsafe impl Sync for PairCall {}

impl PairCall {
    /// Check `ops` on a communicator of `world` ranks where this is `rank`.
    fn new(comm: &Communicator, ops: Ops) -> PairCall {
        let (rank, world) = (comm.rank(), comm.world_size());
        let collective = match *ops {
            [RawPeerOp { send: true, .. }] => Collective::Send,
            [RawPeerOp { send: false, .. }] => Collective::Recv,
            _ => Collective::SendRecv,
        };
        let mut check = Self::check(comm, rank, world, &ops);
        let mut mark = None;
        if let (Ok(()), Some(stream), Some(engine)) =
            (&check, comm.cuda_stream, &comm.progress.shared().engine)
        {
            // SAFETY: `set_cuda_stream`'s caller promised the stream lives while it is set.
            match unsafe { engine.mark_stream(rank, stream) } {
                Ok(m) => mark = Some(m),
                Err(e) => check = Err(format!("the CUDA stream it was given: {e}")),
            }
        }
        PairCall {
            collective,
            rank,
            ops,
            check,
            mark,
        }
    }

    fn check(
        comm: &Communicator,
        rank: usize,
        world: usize,
        ops: &[RawPeerOp],
    ) -> std::result::Result<(), String> {
        let engine = comm.progress.shared().engine.clone();
        if engine
            .as_ref()
            .is_some_and(|e| !e.runs_pairs() && !e.pairs_on_host())
        {
            return Err(format!(
                "point-to-point calls are not available on {}: its device engine runs \
                 collectives only",
                comm.device_spec()
            ));
        }
        for (i, o) in ops.iter().enumerate() {
            let what = if o.send { "send" } else { "recv" };
            if o.peer >= world {
                return Err(format!(
                    "{what} {i}: peer {} is out of range (world size {world})",
                    o.peer
                ));
            }
            if o.len % o.dtype.size() != 0 {
                return Err(format!(
                    "{what} {i}: {} bytes are not whole {} elements",
                    o.len, o.dtype
                ));
            }
            if o.len > 0 && o.ptr.is_null() {
                return Err(format!("{what} {i}: the buffer is null"));
            }
            if let Some(e) = engine.as_ref().filter(|e| e.runs_pairs()) {
                e.check_pair(rank, o)
                    .map_err(|m| format!("{what} {i}: {m}"))?;
            }
        }
        // One operation with another rank (a blocking send or recv) has nothing to overlap or
        // pair with: the rest is for groups.
        if let [one] = ops {
            if one.peer != rank {
                return Ok(());
            }
        }
        // A receive's buffer may overlap no other buffer of the group.
        for (i, a) in ops.iter().enumerate().filter(|(_, o)| !o.send && o.len > 0) {
            for (j, b) in ops.iter().enumerate().filter(|(j, o)| *j != i && o.len > 0) {
                let (a0, b0) = (a.ptr as usize, b.ptr as usize);
                if a0 < b0 + b.len && b0 < a0 + a.len {
                    return Err(format!(
                        "recv {i} overlaps the buffer of {} {j}",
                        if b.send { "send" } else { "recv" }
                    ));
                }
            }
        }
        // Sends to this rank itself pair with its receives from itself, in order.
        let to_self = |send: bool| {
            ops.iter()
                .filter(move |o| o.peer == rank && o.send == send)
                .map(|o| (o.dtype, o.len))
        };
        if !to_self(true).eq(to_self(false)) {
            return Err(format!(
                "rank {rank}'s sends to itself ({:?}) do not match its receives from itself \
                 ({:?}) in this group: each needs its receive, of the same count and dtype, in \
                 the same group",
                to_self(true).collect::<Vec<_>>(),
                to_self(false).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }
}

impl Runnable for PairCall {
    fn site(&self, number: u64) -> Site {
        Site {
            collective: self.collective,
            rank: self.rank,
            call: number,
        }
    }

    fn numbered(&self) -> bool {
        false
    }

    fn run(&self, shared: &Shared, number: u64, _plan: &Plan) -> Result<()> {
        let site = self.site(number);
        if let Err(m) = &self.check {
            return Err(Error::invalid(site, m.clone()));
        }
        if let Some(engine) = shared.engine.as_ref().filter(|e| e.runs_pairs()) {
            // The device's engine moves the bytes (its sends to this rank itself too). An
            // aborted communicator runs no more of them; a failure aborts the engine too, so
            // that its waiting ranks hear at once.
            let transport = &*shared.transport;
            if let Some(reason) = transport.aborted() {
                return Err(Error::Aborted {
                    rank: self.rank,
                    reason,
                });
            }
            let aborted = || transport.aborted();
            let result =
                engine.pair_exchange(site, self.rank, &self.ops, self.mark.as_deref(), &aborted);
            if let Err(e) = &result {
                engine.abort(&e.to_string());
            }
            return self.finish(shared, result);
        }
        if let Ops::One(o) = &self.ops {
            if o.peer != self.rank {
                // SAFETY: see `PairCall`.
                let mut op = unsafe { o.transport_op() };
                let result = shared
                    .transport
                    .pair_exchange(site, std::slice::from_mut(&mut op));
                return self.finish(shared, result);
            }
        }
        // SAFETY: see `PairCall`; a receive's buffer overlaps no other (checked).
        let mut others = unsafe { self.transport_ops() };
        if others.iter().any(|o| o.peer == self.rank) {
            let (mut mine, rest): (Vec<PairOp<'_>>, Vec<PairOp<'_>>) =
                others.into_iter().partition(|o| o.peer == self.rank);
            // To itself: each send's bytes into the receive at the same place (checked to
            // match).
            let (sends, recvs): (Vec<_>, Vec<_>) = mine.iter_mut().partition(|o| o.is_send());
            for (s, r) in sends.into_iter().zip(recvs) {
                if let (PairData::Send(src), PairData::Recv(dst)) = (&s.data, &mut r.data) {
                    dst.copy_from_slice(src);
                }
            }
            others = rest;
        }
        if others.is_empty() {
            return Ok(());
        }
        let transport = &*shared.transport;
        let result = transport.pair_exchange(site, &mut others);
        self.finish(shared, result)
    }
}

impl PairCall {
    /// After the transport's exchange: a failure ends the communicator.
    fn finish(&self, shared: &Shared, result: Result<()>) -> Result<()> {
        let transport = &*shared.transport;
        if let Err(e) = &result {
            // A peer may be mid-message: the communicator cannot go on. `end` tells the peers
            // (an abort from another thread while this call ran could not: it held the link).
            if transport.aborted().is_none() {
                transport.abort(&e.to_string());
            }
            transport.end(Some(e));
        }
        result
    }
}

impl PairCall {
    /// The operations as the transport takes them.
    ///
    /// # Safety
    /// The addresses are valid for the call (see `PairCall`) and no receive overlaps another
    /// buffer.
    unsafe fn transport_ops(&self) -> Vec<PairOp<'_>> {
        // SAFETY: as the caller promises.
        self.ops
            .iter()
            .map(|o| unsafe { o.transport_op() })
            .collect()
    }
}

impl RawPeerOp {
    /// The operation as the transport takes it.
    ///
    /// # Safety
    /// As [`PairCall::transport_ops`]'s.
    unsafe fn transport_op(&self) -> PairOp<'_> {
        let data = if self.len == 0 {
            if self.send {
                PairData::Send(&[])
            } else {
                PairData::Recv(&mut [])
            }
        } else if self.send {
            // SAFETY: as the caller promises.
            PairData::Send(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
        } else {
            // SAFETY: as the caller promises.
            PairData::Recv(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
        };
        PairOp {
            peer: self.peer,
            dtype: self.dtype,
            data,
        }
    }
}

impl Communicator {
    /// A [`crate::RawCall`] naming a point-to-point call: refused on this rank alone, with no
    /// call number and no other rank involved.
    pub(super) fn raw_point_to_point(&self, collective: Collective) -> Box<dyn Runnable + Sync> {
        Box::new(PairCall {
            collective,
            rank: self.rank(),
            ops: Ops::Many(Vec::new()),
            check: Err(format!(
                "{collective} is point-to-point, not a collective: run it with \
                 Communicator::send, recv or send_recv"
            )),
            mark: None,
        })
    }

    /// Send `buf` to rank `peer`, which receives it with [`Communicator::recv`] (or in a
    /// [`Communicator::send_recv`] group). Matched with that rank's receives from this one in
    /// issue order; both state the same count and dtype. Returns once the bytes are handed over
    /// (between threads: copied; between processes: written to the connection, which may wait
    /// for the receiver; between GPUs of one process: copied GPU to GPU by the receiver, which
    /// this waits for). Bounded by the timeout.
    ///
    /// ```
    /// let comms = tutti::local_group(2, &tutti::Config::default()).unwrap();
    /// std::thread::scope(|s| {
    ///     s.spawn(|| comms[0].send(&[1.0f32, 2.0], 1).unwrap());
    ///     let mut got = [0.0f32; 2];
    ///     comms[1].recv(&mut got, 0).unwrap();
    ///     assert_eq!(got, [1.0, 2.0]);
    /// });
    /// ```
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.send_recv_one(PeerOp::send(buf, peer).raw())
    }

    /// Receive rank `peer`'s next send to this rank into `buf` (see [`Communicator::send`]).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.send_recv_one(PeerOp::recv(buf, peer).raw())
    }

    /// One operation, run now: its buffer is borrowed by the caller for the whole call.
    fn send_recv_one(&self, op: RawPeerOp) -> Result<()> {
        let call = PairCall::new(self, Ops::One(op));
        self.progress.run_blocking(&call)
    }

    /// Run a group of sends and receives together, as NCCL's grouped calls and torch's
    /// `batch_isend_irecv` do: every operation is under way at once, so a ring of sends and
    /// receives, or two ranks each sending to the other first, cannot deadlock. Each peer's
    /// operations in one direction keep their order.
    pub fn send_recv(&self, ops: &mut [PeerOp<'_>]) -> Result<()> {
        if let [one] = ops {
            return self.send_recv_one(one.raw());
        }
        let call = PairCall::new(self, Ops::Many(ops.iter_mut().map(PeerOp::raw).collect()));
        self.progress.run_blocking(&call)
    }

    /// [`Communicator::send`] without waiting; [`Work::wait`] hands `buf` back.
    pub fn send_async<T, B>(&self, buf: B, peer: usize) -> Work<B>
    where
        T: Element,
        B: AsRef<[T]> + Send + 'static,
    {
        let mut buf = Owned::new(buf);
        let held = buf.get();
        let bytes: &[u8] = bytemuck::cast_slice(held.as_ref());
        let op = RawPeerOp {
            send: true,
            peer,
            dtype: T::DTYPE,
            ptr: bytes.as_ptr() as *mut u8,
            len: bytes.len(),
        };
        let call = PairCall::new(self, Ops::One(op));
        self.progress.issue(Box::new(call), Box::new(buf))
    }

    /// [`Communicator::recv`] without waiting; [`Work::wait`] hands `buf` back.
    pub fn recv_async<T, B>(&self, buf: B, peer: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let mut buf = Owned::new(buf);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.get().as_mut());
        let op = RawPeerOp {
            send: false,
            peer,
            dtype: T::DTYPE,
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        };
        let call = PairCall::new(self, Ops::One(op));
        self.progress.issue(Box::new(call), Box::new(buf))
    }

    /// [`Communicator::send_recv`] without waiting: every buffer of `sends` goes to its peer
    /// and every buffer of `recvs` is filled from its peer, all under way at once (each peer's
    /// sends, and its receives, in list order). [`Work::wait`] hands both lists back once every
    /// operation has completed. One dtype for the group; mixed dtypes take
    /// [`Communicator::send_recv`]. A group of sends only, or receives only, names the other
    /// list's type: `c.send_recv_async::<f32, Vec<f32>, _>(vec![], recvs)`. This rank's own
    /// mistakes (a peer out of range, a send to itself without its receive) fail the `Work`,
    /// leaving the communicator usable.
    ///
    /// ```
    /// let comms = tutti::local_group(2, &tutti::Config::default()).unwrap();
    /// std::thread::scope(|s| {
    ///     for c in &comms {
    ///         s.spawn(move || {
    ///             let other = 1 - c.rank();
    ///             let work = c.send_recv_async(
    ///                 vec![(vec![c.rank() as f32; 3], other)],
    ///                 vec![(vec![0.0f32; 3], other)],
    ///             );
    ///             // ... compute meanwhile ...
    ///             let (_sent, received) = work.wait().unwrap();
    ///             assert_eq!(received[0].0, vec![other as f32; 3]);
    ///         });
    ///     }
    /// });
    /// ```
    #[allow(clippy::type_complexity)]
    pub fn send_recv_async<T, S, R>(
        &self,
        sends: Vec<(S, usize)>,
        recvs: Vec<(R, usize)>,
    ) -> Work<(Vec<(S, usize)>, Vec<(R, usize)>)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        let mut bufs = Owned::new((sends, recvs));
        let (sends, recvs) = bufs.get();
        let mut ops = Vec::with_capacity(sends.len() + recvs.len());
        for (buf, peer) in sends.iter() {
            let bytes: &[u8] = bytemuck::cast_slice(buf.as_ref());
            ops.push(RawPeerOp {
                send: true,
                peer: *peer,
                dtype: T::DTYPE,
                ptr: bytes.as_ptr() as *mut u8,
                len: bytes.len(),
            });
        }
        for (buf, peer) in recvs.iter_mut() {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.as_mut());
            ops.push(RawPeerOp {
                send: false,
                peer: *peer,
                dtype: T::DTYPE,
                ptr: bytes.as_mut_ptr(),
                len: bytes.len(),
            });
        }
        let call = PairCall::new(self, Ops::Many(ops));
        self.progress.issue(Box::new(call), Box::new(bufs))
    }

    /// A group of sends and receives by address, without waiting (the C ABI's
    /// `tutti_group_end` and `tutti_group_end_async`); the handle completes when every
    /// operation has.
    ///
    /// # Safety
    /// Each operation's `len` bytes at `ptr` are valid (writable for a receive) and untouched by
    /// the caller until the handle completes.
    pub unsafe fn send_recv_raw_async(&self, ops: &[RawPeerOp]) -> Work {
        let call = PairCall::new(self, Ops::Many(ops.to_vec()));
        self.progress
            .issue(Box::new(call), Box::new(Owned::new(())))
    }
}
