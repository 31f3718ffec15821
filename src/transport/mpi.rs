//! MPI as a carrier (feature `mpi`): every exchange of every tutti algorithm runs on MPI's
//! non-blocking point-to-point calls, so that a job launched by `mpirun` or `srun` moves its
//! bytes over whatever fabric the MPI library drives (shared memory, TCP, InfiniBand through
//! UCX, EFA or Slingshot through libfabric).
//!
//! What stays tutti's, as on its own transports:
//! - **Checks.** Each message of a call is preceded by the frame header of [`super::wire`]
//!   (the call's identity and the length that follows) in a message of its own, and the
//!   receiver posts the receive of the data only once that header matched its own call: a
//!   mismatched call is an error naming both ranks, and no byte of it lands in the caller's
//!   buffer. The calls that need one have the check round of the network transport.
//! - **Timeouts.** Nothing waits in MPI: requests are tested (`MPI_Testsome`) until they
//!   complete, the communicator is aborted or the timeout passes; a timeout names the ranks whose
//!   messages never came.
//! - **Abort.** A rank whose call fails tells every peer why on a tag of its own, which every
//!   wait watches, so the peers fail at once with the reason rather than at their timeout.
//!
//! And MPI's fault model, which tutti cannot change: a send that MPI has begun cannot be taken
//! back (`MPI_Cancel` of a send is deprecated and Open MPI does not honour it), and with most
//! MPI libraries a process that dies ends the job (`mpirun` kills the others). So a rank that
//! gives up (its call failed, it was aborted, or a peer told it why it gave up) starts a sweeper
//! thread that, for one timeout, takes every message peers send it that no receive was posted
//! for, so that their sends complete; a failing call cancels its own receives and waits for its
//! own sends at most one more timeout, while its peers' sweepers take them. A send still held
//! by MPI after that, which would let MPI read memory that is the caller's again, ends the job
//! with `MPI_Abort`, after logging the rank, the call and the peers it waited for.
//!
//! Each tutti communicator has an MPI communicator of its own (`MPI_Comm_idup` of
//! `MPI_COMM_WORLD`, or of its parent's for a split, whose groups share it: they have no member
//! in common), with errors returned rather than fatal. MPI must give `MPI_THREAD_MULTIPLE` (tutti's progress thread and the
//! caller's both call MPI); tutti initializes MPI when the program has not, and then finalizes
//! it at exit.

use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mpi::ffi as m;
use parking_lot::Mutex;

use super::wire::{
    frame, frame_ident, parse_frame, CurrentIdent, Ident, FRAME_DATA, FRAME_HEADER, HDR,
};
use super::{
    CallBuffers, CallHeader, NativeCall, PairData, PairOp, RecvMode, RecvOp, SendOp, Transport,
};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result, Site};
use crate::reuse::recycle;

/// The tag of the messages of calls (frame headers and data).
const TAG_DATA: c_int = 0x7017;
/// The tag of the abort notices a failing rank sends every peer.
const TAG_ABORT: c_int = 0x7018;
/// The most bytes of data in one MPI message (MPI counts are `int`); a reducing receive stages
/// one such piece at a time, two in flight.
const PIECE: usize = 4 << 20;
/// The longest rejection or abort message carried after a frame header.
const MAX_MSG: usize = 4000;
/// Capacity of a received header message: a frame header and its message.
const HDR_CAP: usize = HDR + MAX_MSG;
/// How long a failing call keeps receiving (and dropping) what its peers already sent.
const DRAIN: Duration = Duration::from_millis(500);
/// Frame kind of an abort notice.
const FRAME_ABORT: u32 = super::wire::FRAME_ABORT;

/// An MPI handle that may cross threads: MPI gives `MPI_THREAD_MULTIPLE`, checked at
/// initialization.
#[derive(Copy, Clone)]
struct Shared<T>(T);
// SAFETY: MPI handles are plain identifiers; the library was initialized with
// MPI_THREAD_MULTIPLE, under which any thread may use them.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

fn unavailable(why: impl Into<String>) -> Error {
    Error::Unavailable {
        what: "the MPI transport".into(),
        why: why.into(),
    }
}

/// MPI's message for an error code.
fn describe(code: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes.
    let ok = unsafe { m::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if ok != 0 || len <= 0 {
        return format!("MPI error {code}");
    }
    buf.truncate((len as usize).min(512));
    String::from_utf8_lossy(&buf).into_owned()
}

/// `Ok` for `MPI_SUCCESS`, else what MPI says, with `what` was being done.
fn check(code: c_int, what: &str) -> Result<()> {
    if code == m::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(Error::System {
            what: format!("MPI: {what}"),
            message: describe(code),
        })
    }
}

static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// MPI initialized with `MPI_THREAD_MULTIPLE`, by tutti (then finalized at exit) or by the
/// program before.
fn init() -> Result<()> {
    INIT.get_or_init(|| {
        let mut flag: c_int = 0;
        // SAFETY: both may be called at any time, before or after MPI_Init.
        unsafe { m::MPI_Finalized(&mut flag) };
        if flag != 0 {
            return Err("MPI was already finalized in this process".into());
        }
        // SAFETY: as above.
        unsafe { m::MPI_Initialized(&mut flag) };
        let mut provided: c_int = 0;
        // SAFETY: reading the constant tutti's MPI binding exports.
        let multiple = unsafe { m::RSMPI_THREAD_MULTIPLE };
        if flag == 0 {
            // SAFETY: MPI is not initialized; NULL argc/argv are allowed.
            let code = unsafe {
                m::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    multiple,
                    &mut provided,
                )
            };
            if code != 0 {
                return Err(format!("MPI_Init_thread failed: {}", describe(code)));
            }
            // SAFETY: registering a plain function.
            unsafe { libc::atexit(finalize_at_exit) };
        } else {
            // SAFETY: MPI is initialized.
            unsafe { m::MPI_Query_thread(&mut provided) };
        }
        if provided < multiple {
            return Err(format!(
                "the MPI library gives thread level {provided}, and tutti needs MPI_THREAD_MULTIPLE \
                 ({multiple}): its progress thread and the caller's both call MPI (initialize MPI \
                 with MPI_Init_thread(MPI_THREAD_MULTIPLE), or use an MPI built with it)"
            ));
        }
        Ok(())
    })
    .clone()
    .map_err(unavailable)
}

extern "C" fn finalize_at_exit() {
    EXITING.store(true, Ordering::Release);
    let until = Instant::now() + Duration::from_secs(2);
    while SWEEPERS.load(Ordering::Acquire) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut flag: c_int = 0;
    // SAFETY: callable at any time; finalize once, only if nobody did.
    unsafe {
        m::MPI_Finalized(&mut flag);
        if flag == 0 {
            m::MPI_Finalize();
        }
    }
}

fn finalized() -> bool {
    let mut flag: c_int = 0;
    // SAFETY: callable at any time.
    unsafe { m::MPI_Finalized(&mut flag) };
    flag != 0
}

fn request_null() -> m::MPI_Request {
    // SAFETY: reading a constant of the binding.
    unsafe { m::RSMPI_REQUEST_NULL }
}

fn byte() -> m::MPI_Datatype {
    // SAFETY: reading a constant of the binding.
    unsafe { m::RSMPI_UINT8_T }
}

fn empty_status() -> m::MPI_Status {
    // SAFETY: MPI_Status is plain old data.
    unsafe { std::mem::zeroed() }
}

/// Take one message that a peer sent this rank on `comm`'s data tag and no receive was posted
/// for into `buf` (never read; every message tutti sends fits); its receive is added to
/// `reqs`. True when one was there.
fn take_unexpected(comm: m::MPI_Comm, buf: &mut [u8], reqs: &mut Vec<m::MPI_Request>) -> bool {
    let mut flag: c_int = 0;
    // SAFETY: reading a constant of the binding.
    let mut msg = unsafe { m::RSMPI_MESSAGE_NULL };
    let mut st = empty_status();
    // SAFETY: a communicator of ours; a matched probe takes the message for us alone.
    unsafe {
        m::MPI_Improbe(
            m::RSMPI_ANY_SOURCE,
            TAG_DATA,
            comm,
            &mut flag,
            &mut msg,
            &mut st,
        )
    };
    if flag == 0 {
        return false;
    }
    let mut req = request_null();
    // SAFETY: the caller keeps `buf` until the request completes (or leaks it). Several
    // receives may write it at once: its bytes are never read.
    let code = unsafe {
        m::MPI_Imrecv(
            buf.as_mut_ptr().cast(),
            buf.len() as c_int,
            byte(),
            &mut msg,
            &mut req,
        )
    };
    if code == 0 {
        reqs.push(req);
    }
    true
}

/// `MPI_Testsome` over an exchange's requests: its code and how many completed (their indices
/// and statuses in `r.done`, `r.statuses`), `usize::MAX` when none was open.
fn test_some(r: &mut Reuse) -> (c_int, usize) {
    let n = r.reqs.len();
    r.done.resize(n, 0);
    r.statuses.resize(n, empty_status());
    let mut out: c_int = 0;
    // SAFETY: arrays of `n` requests, indices and statuses, all ours.
    let code = unsafe {
        m::MPI_Testsome(
            n as c_int,
            r.reqs.as_mut_ptr(),
            &mut out,
            r.done.as_mut_ptr(),
            r.statuses.as_mut_ptr(),
        )
    };
    // SAFETY: reading a constant of the binding.
    if out == unsafe { m::RSMPI_UNDEFINED } {
        return (code, usize::MAX);
    }
    (code, out.max(0) as usize)
}

/// Whether `req` has completed (then it is null), testing it once.
fn test(req: &mut m::MPI_Request) -> bool {
    if *req == request_null() {
        return true;
    }
    let mut flag: c_int = 0;
    let mut st = empty_status();
    // SAFETY: a request of ours, tested in place.
    unsafe { m::MPI_Test(req, &mut flag, &mut st) };
    flag != 0
}

/// Test `req` until it completes or `deadline` passes; true when it completed.
fn wait_until(req: &mut m::MPI_Request, deadline: Instant) -> bool {
    let mut idle = Idle::default();
    loop {
        let mut flag: c_int = 0;
        let mut st = empty_status();
        // SAFETY: a request of ours, tested in place.
        unsafe { m::MPI_Test(req, &mut flag, &mut st) };
        if flag != 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        idle.pause();
    }
}

/// How a wait gives its core away while nothing completes: spin briefly (MPI progresses only
/// inside its calls), then yield, then sleep in short steps, so that ranks that outnumber the
/// cores let the others run.
#[derive(Default)]
struct Idle {
    rounds: u32,
}

impl Idle {
    fn pause(&mut self) {
        self.rounds = self.rounds.saturating_add(1);
        match self.rounds {
            0..=64 => std::hint::spin_loop(),
            65..=512 => std::thread::yield_now(),
            n => std::thread::sleep(Duration::from_micros(u64::from((n - 512).min(100)).max(10))),
        }
    }

    fn reset(&mut self) {
        self.rounds = 0;
    }
}

/// The communicator `comm` duplicated (collectively, bounded by `deadline`), with errors
/// returned rather than fatal.
fn duplicate(comm: m::MPI_Comm, deadline: Instant, timeout: Duration) -> Result<m::MPI_Comm> {
    // MPI writes the new handle when the duplication completes, which may be after a timeout:
    // the slot it writes to outlives this call.
    let slot: &'static mut m::MPI_Comm = Box::leak(Box::new(comm));
    let mut req = request_null();
    // SAFETY: a valid communicator, a slot that lives forever, a request of ours.
    check(
        unsafe { m::MPI_Comm_idup(comm, slot, &mut req) },
        "MPI_Comm_idup",
    )?;
    if !wait_until(&mut req, deadline) {
        return Err(Error::JoinTimeout {
            message: "the ranks of the MPI job did not all make the communicator (MPI_Comm_idup) \
                      in time: a rank did not start, or called something else first"
                .into(),
            timeout,
        });
    }
    let new = *slot;
    // SAFETY: reclaiming the slot MPI has written (the request completed).
    drop(unsafe { Box::from_raw(slot as *mut m::MPI_Comm) });
    Ok(new)
}

/// Every rank's host (numbered in order of first rank), from an all-gather of host
/// identities bounded by the timeout.
fn gather_hosts(comm: m::MPI_Comm, world: usize, timeout: Duration) -> Result<Vec<usize>> {
    const ID: usize = 320;
    let mut mine = vec![0u8; ID];
    let id = super::net::host_id();
    let id = &id.as_bytes()[..id.len().min(ID)];
    mine[..id.len()].copy_from_slice(id);
    let mut all = vec![0u8; ID * world];
    let mut req = request_null();
    // SAFETY: both buffers outlive the request (waited for below, or leaked on timeout).
    check(
        unsafe {
            m::MPI_Iallgather(
                mine.as_ptr().cast(),
                ID as c_int,
                byte(),
                all.as_mut_ptr().cast(),
                ID as c_int,
                byte(),
                comm,
                &mut req,
            )
        },
        "MPI_Iallgather (hosts)",
    )?;
    if !wait_until(&mut req, Instant::now() + timeout) {
        // MPI may still write both buffers.
        std::mem::forget(all);
        std::mem::forget(mine);
        return Err(Error::JoinTimeout {
            message: "the ranks of the MPI job did not all exchange their hosts in time".into(),
            timeout,
        });
    }
    // Each rank's host as the first rank with the same identity, then numbered.
    let ids: Vec<&[u8]> = all.chunks_exact(ID).collect();
    Ok(renumber(
        ids.iter()
            .map(|h| ids.iter().position(|o| o == h).unwrap_or(0)),
    ))
}

/// The frame header of a point-to-point message: `PairOp` data carries its dtype in aux.
fn pair_aux(dtype: crate::dtype::DType) -> u32 {
    super::net::pair_aux(dtype)
}

/// A receive of an exchange, from header to data.
enum Want<'a> {
    /// A check round: the header (and any rejection message) only.
    Header,
    /// Data after a matching header: into `dst`, copied or reduced; `aux` the point-to-point
    /// dtype mark (0 in collectives).
    Data {
        dst: &'a mut [u8],
        mode: RecvMode<'a>,
        aux: u32,
    },
}

#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Stage {
    /// Waits for an earlier receive from the same peer to post all of its pieces.
    Held,
    /// Its header receive is posted.
    Header,
    /// Its pieces are being received: `next` posted so far of `total`, `done` complete.
    Pieces {
        next: usize,
        done: usize,
        total: usize,
    },
    /// Complete.
    Done,
}

struct Recv<'a> {
    peer: usize,
    want: Want<'a>,
    /// The header message (frame header and any message), `got` bytes of it.
    hdr: Vec<u8>,
    got: usize,
    stage: Stage,
    /// Staging for a reducing receive: two pieces in flight, each buffer taken by a piece
    /// from when its receive is posted until it is delivered (MPI may complete the later piece
    /// first).
    scratch: [Vec<u8>; 2],
    busy: [bool; 2],
}

/// What one request of an exchange is for.
#[derive(Copy, Clone, Debug)]
enum Slot {
    /// A send (header or piece) to this peer.
    Send(usize),
    /// The header of receive `r`.
    Header(usize),
    /// Piece `k` of receive `r`, in its scratch buffer `buf` (2: straight into the destination).
    Piece { r: usize, k: usize, buf: u8 },
}

/// What exchanges reuse, so that a repeated one allocates nothing.
#[derive(Default)]
struct Reuse {
    reqs: Vec<m::MPI_Request>,
    slots: Vec<Slot>,
    headers: Vec<[u8; HDR]>,
    pool: Vec<Vec<u8>>,
    recvs: Vec<Recv<'static>>,
    /// An exchange's sends: peer, header index, bytes.
    sends: Vec<(usize, usize, &'static [u8])>,
    done: Vec<c_int>,
    statuses: Vec<m::MPI_Status>,
}

// SAFETY: the requests and the pointers in the receive states are used only under the engine
// lock, by one thread at a time, and MPI gives MPI_THREAD_MULTIPLE.
unsafe impl Send for Reuse {}

/// How a split of an MPI communicator meets: every rank of the parent duplicates the parent's
/// MPI communicator (`MPI_Comm_idup`, bounded by the timeout, unlike `MPI_Comm_split`), and
/// each group's members talk among themselves on it. Groups have no member in common, so
/// their messages never meet.
pub(crate) struct Parent {
    comm: Shared<m::MPI_Comm>,
    /// The parent's ranks in its MPI communicator, and their hosts.
    peers: Vec<c_int>,
    hosts: Vec<usize>,
}

impl Parent {
    /// Collective over the parent, every rank of which calls it right after the same checked
    /// all-gather of colors and keys: this rank's transport among `members` (the parent's
    /// ranks of its group, in their new order), or `None` for a rank of no group.
    pub(crate) fn split(
        &self,
        members: Option<&[usize]>,
        timeout: Duration,
    ) -> Result<Option<MpiTransport>> {
        let comm = duplicate(self.comm.0, Instant::now() + timeout, timeout)?;
        let Some(members) = members else {
            // SAFETY: a communicator of ours that nothing uses.
            unsafe { m::MPI_Comm_free(&mut { comm }) };
            return Ok(None);
        };
        let peers = members.iter().map(|&k| self.peers[k]).collect();
        let hosts = renumber(members.iter().map(|&k| self.hosts[k]));
        MpiTransport::over(comm, peers, hosts, timeout).map(Some)
    }
}

/// Hosts numbered from 0 in the order of their first rank.
fn renumber(hosts: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut seen: Vec<usize> = Vec::new();
    hosts
        .map(|h| match seen.iter().position(|&s| s == h) {
            Some(i) => i,
            None => {
                seen.push(h);
                seen.len() - 1
            }
        })
        .collect()
}

/// Transports whose sweeper ([`MpiTransport::sweep_after_abort`]) still runs: MPI is not
/// finalized under them.
static SWEEPERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Set at exit: sweepers stop.
static EXITING: AtomicBool = AtomicBool::new(false);

/// One rank's end of a communicator whose bytes travel on MPI.
pub(crate) struct MpiTransport {
    comm: Shared<m::MPI_Comm>,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Every rank's rank in `comm` (a split's group shares its communicator with the parent's
    /// other groups).
    peers: Vec<c_int>,
    /// The ranks are all of `comm`'s, in its order: MPI's collectives on it are this group's.
    whole: bool,
    hosts: Vec<usize>,
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    /// The peers have been told why this rank stopped.
    notified: AtomicBool,
    /// The receive of the first abort notice from any peer, and its buffer.
    abort_in: Mutex<(Shared<m::MPI_Request>, Vec<u8>)>,
    /// Serializes exchanges; holds what they reuse.
    engine: Mutex<Reuse>,
    /// The identity of the current call.
    ident: CurrentIdent,
    /// The current call has moved data: a failure now leaves peers mid-step.
    data_started: AtomicBool,
    /// An in-place all-reduce's input, for MPI's own collective.
    stage: Mutex<Vec<u8>>,
    /// A thread takes what peers send this rank after it gave up (see
    /// [`MpiTransport::sweep_after_abort`]); then `comm` is never freed.
    sweeping: AtomicBool,
}

impl MpiTransport {
    /// This process's rank of the MPI job (`MPI_COMM_WORLD`), on a communicator of its own.
    pub(crate) fn world(timeout: Duration) -> Result<MpiTransport> {
        init()?;
        let deadline = Instant::now() + timeout;
        // SAFETY: reading a constant of the binding.
        let world = unsafe { m::RSMPI_COMM_WORLD };
        let comm = duplicate(world, deadline, timeout)?;
        let mut size: c_int = 0;
        // SAFETY: a valid communicator of ours.
        unsafe {
            check(
                m::MPI_Comm_set_errhandler(comm, m::RSMPI_ERRORS_RETURN),
                "MPI_Comm_set_errhandler",
            )?;
            check(m::MPI_Comm_size(comm, &mut size), "MPI_Comm_size")?;
        }
        let world = size.max(0) as usize;
        if world > crate::cluster::MAX_WORLD_SIZE {
            return Err(Error::config(format!(
                "the MPI job has {world} ranks, more than tutti supports ({})",
                crate::cluster::MAX_WORLD_SIZE
            )));
        }
        let hosts = gather_hosts(comm, world, timeout)?;
        MpiTransport::over(comm, (0..size).collect(), hosts, timeout)
    }

    /// A transport over `comm` among the ranks `peers` of it (this rank among them), on
    /// `hosts`; `comm` is this transport's own from now on.
    fn over(
        comm: m::MPI_Comm,
        peers: Vec<c_int>,
        hosts: Vec<usize>,
        timeout: Duration,
    ) -> Result<MpiTransport> {
        let mut me: c_int = 0;
        // SAFETY: a valid communicator of ours.
        unsafe {
            check(
                m::MPI_Comm_set_errhandler(comm, m::RSMPI_ERRORS_RETURN),
                "MPI_Comm_set_errhandler",
            )?;
            check(m::MPI_Comm_rank(comm, &mut me), "MPI_Comm_rank")?;
        }
        let rank = peers.iter().position(|&p| p == me).ok_or_else(|| {
            Error::config(format!("MPI rank {me} is not a member of its own group"))
        })?;
        let world = peers.len();
        let mut size: c_int = 0;
        // SAFETY: a valid communicator of ours.
        check(
            unsafe { m::MPI_Comm_size(comm, &mut size) },
            "MPI_Comm_size",
        )?;
        // And in their order: MPI's collectives order blocks by rank in `comm`.
        let whole = usize::try_from(size).ok() == Some(world)
            && peers
                .iter()
                .enumerate()
                .all(|(k, &p)| usize::try_from(p).ok() == Some(k));
        let t = MpiTransport {
            comm: Shared(comm),
            rank,
            world,
            timeout,
            peers,
            whole,
            hosts,
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            notified: AtomicBool::new(false),
            abort_in: Mutex::new((Shared(request_null()), vec![0u8; HDR_CAP])),
            engine: Mutex::new(Reuse::default()),
            ident: Default::default(),
            data_started: AtomicBool::new(false),
            sweeping: AtomicBool::new(false),
            stage: Mutex::new(Vec::new()),
        };
        {
            let mut a = t.abort_in.lock();
            let (req, buf) = &mut *a;
            // SAFETY: the buffer lives in the transport, which cancels this receive before it
            // drops it.
            check(
                unsafe {
                    m::MPI_Irecv(
                        buf.as_mut_ptr().cast(),
                        HDR_CAP as c_int,
                        byte(),
                        m::RSMPI_ANY_SOURCE,
                        TAG_ABORT,
                        comm,
                        &mut req.0,
                    )
                },
                "MPI_Irecv (abort notices)",
            )?;
        }
        Ok(t)
    }

    /// How a split of this communicator meets.
    pub(crate) fn parent(&self) -> Parent {
        Parent {
            comm: self.comm,
            peers: self.peers.clone(),
            hosts: self.hosts.clone(),
        }
    }

    fn set_aborted(&self, reason: &str) {
        let mut r = self.reason.lock();
        if r.is_none() {
            *r = Some(reason.to_string());
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    fn aborted_error(&self) -> Error {
        Error::Aborted {
            rank: self.rank,
            reason: self
                .reason
                .lock()
                .clone()
                .unwrap_or_else(|| "aborted".into()),
        }
    }

    /// A peer's abort notice, once one has come.
    fn abort_notice(&self) -> Option<Error> {
        let mut a = self.abort_in.lock();
        let (req, buf) = &mut *a;
        if req.0 == request_null() {
            return None;
        }
        let mut flag: c_int = 0;
        let mut st = empty_status();
        // SAFETY: our request, tested in place.
        unsafe { m::MPI_Test(&mut req.0, &mut flag, &mut st) };
        if flag == 0 {
            return None;
        }
        let mut n: c_int = 0;
        // SAFETY: the status of a completed receive.
        unsafe { m::MPI_Get_count(&st, byte(), &mut n) };
        let n = (n.max(0) as usize).min(buf.len());
        let text = if n >= HDR {
            let (_, _, len) = parse_frame(buf[..HDR].try_into().expect("HDR bytes"));
            let len = (len as usize).min(n - HDR);
            String::from_utf8_lossy(&buf[HDR..HDR + len]).into_owned()
        } else {
            "no reason given".into()
        };
        let from = self.peers.iter().position(|&p| p == st.MPI_SOURCE);
        let reason = match from {
            Some(peer) => format!("rank {peer} gave up: {text}"),
            None => format!("a peer gave up: {text}"),
        };
        self.set_aborted(&reason);
        self.sweep_after_abort();
        Some(Error::Aborted {
            rank: self.rank,
            reason,
        })
    }

    /// Once this rank gave up (or heard a peer did): a thread takes what peers send this rank
    /// on the data tag, for one timeout and [`DRAIN`], so that their sends complete (a rank
    /// whose call failed waits for its own sends before it returns; see the module's notes).
    /// Only messages no receive was posted for are taken; nothing of them is read. The
    /// communicator is aborted: no call of it receives again.
    fn sweep_after_abort(&self) {
        if self.sweeping.swap(true, Ordering::AcqRel)
            || EXITING.load(Ordering::Acquire)
            || finalized()
        {
            return;
        }
        let comm = self.comm;
        let until = Instant::now() + self.timeout + DRAIN;
        SWEEPERS.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name("tutti-mpi-sweep".into())
            .spawn(move || {
                let comm = comm;
                let mut buf = vec![0u8; PIECE.max(HDR_CAP)];
                let mut reqs = Vec::new();
                let mut quiet = 0u32;
                while Instant::now() < until && !EXITING.load(Ordering::Acquire) {
                    let took = take_unexpected(comm.0, &mut buf, &mut reqs);
                    reqs.retain_mut(|q| !test(q));
                    quiet = if took { 0 } else { quiet.saturating_add(1) };
                    if quiet > 64 {
                        std::thread::sleep(Duration::from_micros(u64::from(quiet.min(1000))));
                    }
                }
                let end = Instant::now() + DRAIN;
                let open = reqs
                    .iter_mut()
                    .any(|q| EXITING.load(Ordering::Acquire) || !wait_until(q, end));
                if open {
                    // MPI may still write it.
                    std::mem::forget(buf);
                }
                SWEEPERS.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            SWEEPERS.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Tell every peer why this rank stops (once; never waits: MPI frees the requests when they
    /// complete, and the message stays allocated for them).
    fn notify_peers(&self, reason: &str) {
        if self.notified.swap(true, Ordering::AcqRel) || finalized() {
            return;
        }
        let text = reason.as_bytes();
        let text = &text[..text.len().min(MAX_MSG)];
        let mut msg = frame(FRAME_ABORT, 0, text.len() as u64, &self.ident.get()).to_vec();
        msg.extend_from_slice(text);
        let msg: &'static [u8] = Box::leak(msg.into_boxed_slice());
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            let mut req = request_null();
            // SAFETY: the message lives forever; the request is freed once sent.
            unsafe {
                if m::MPI_Isend(
                    msg.as_ptr().cast(),
                    msg.len() as c_int,
                    byte(),
                    self.peers[peer],
                    TAG_ABORT,
                    self.comm.0,
                    &mut req,
                ) == 0
                {
                    m::MPI_Request_free(&mut req);
                }
            }
        }
    }

    /// Post a send of `len` bytes at `data` to `peer`.
    fn isend(&self, r: &mut Reuse, peer: usize, data: *const u8, len: usize) -> Result<()> {
        let mut req = request_null();
        // SAFETY: `data` stays valid and unchanged until the request completes (the exchange
        // does not return before, or ends the job); `len` fits an int (at most PIECE or
        // HDR_CAP).
        check(
            unsafe {
                m::MPI_Isend(
                    data.cast::<c_void>(),
                    len as c_int,
                    byte(),
                    self.peers[peer],
                    TAG_DATA,
                    self.comm.0,
                    &mut req,
                )
            },
            "MPI_Isend",
        )?;
        r.reqs.push(req);
        r.slots.push(Slot::Send(peer));
        Ok(())
    }

    /// Post a receive of at most `len` bytes into `dst` from `peer`.
    fn irecv(
        &self,
        r: &mut Reuse,
        peer: usize,
        dst: *mut u8,
        len: usize,
        slot: Slot,
    ) -> Result<()> {
        let mut req = request_null();
        // SAFETY: `dst` stays valid until the request completes (the exchange does not return
        // before, or cancels it, or ends the job); `len` fits an int.
        check(
            unsafe {
                m::MPI_Irecv(
                    dst.cast::<c_void>(),
                    len as c_int,
                    byte(),
                    self.peers[peer],
                    TAG_DATA,
                    self.comm.0,
                    &mut req,
                )
            },
            "MPI_Irecv",
        )?;
        r.reqs.push(req);
        r.slots.push(slot);
        Ok(())
    }

    /// Post one message: `hdr` (with `msg` after it, for a rejection), then `data` in pieces.
    fn post_send(&self, r: &mut Reuse, peer: usize, hdr_at: usize, data: &[u8]) -> Result<()> {
        let h = r.headers[hdr_at].as_ptr();
        self.isend(r, peer, h, HDR)?;
        for piece in pieces(data.len()) {
            let n = piece_len(data.len(), piece.start);
            self.isend(r, peer, data[piece].as_ptr(), n)?;
        }
        Ok(())
    }

    /// Post the header receive of receive `i`.
    fn post_header(&self, r: &mut Reuse, recvs: &mut [Recv<'_>], i: usize) -> Result<()> {
        let rv = &mut recvs[i];
        rv.hdr.resize(HDR_CAP, 0);
        rv.stage = Stage::Header;
        let (peer, p) = (rv.peer, rv.hdr.as_mut_ptr());
        self.irecv(r, peer, p, HDR_CAP, Slot::Header(i))
    }

    /// Post the pieces of receive `i` that may be in flight now.
    fn post_pieces(&self, r: &mut Reuse, recvs: &mut [Recv<'_>], i: usize) -> Result<()> {
        let rv = &mut recvs[i];
        let Stage::Pieces { next, done, total } = rv.stage else {
            return Ok(());
        };
        let Want::Data { dst, mode, .. } = &mut rv.want else {
            return Ok(());
        };
        let len = dst.len();
        let mut next = next;
        if mode.combined().is_none() {
            while next < total {
                let off = next * PIECE;
                let n = piece_len(len, off);
                let p = dst[off..].as_mut_ptr();
                self.irecv(
                    r,
                    rv.peer,
                    p,
                    n,
                    Slot::Piece {
                        r: i,
                        k: next,
                        buf: 2,
                    },
                )?;
                next += 1;
            }
        } else {
            while next < total && !rv.busy[next % 2] {
                let off = next * PIECE;
                let n = piece_len(len, off);
                let b = next % 2;
                rv.busy[b] = true;
                let s = &mut rv.scratch[b];
                if s.len() < n {
                    s.resize(n, 0);
                }
                let p = s.as_mut_ptr();
                self.irecv(
                    r,
                    rv.peer,
                    p,
                    n,
                    Slot::Piece {
                        r: i,
                        k: next,
                        buf: b as u8,
                    },
                )?;
                next += 1;
            }
        }
        rv.stage = Stage::Pieces { next, done, total };
        Ok(())
    }

    /// After receive `i` posted all its pieces (or finished): start the next held receive
    /// from the same peer.
    fn release_held(&self, r: &mut Reuse, recvs: &mut [Recv<'_>], i: usize) -> Result<()> {
        let peer = recvs[i].peer;
        if let Some(j) = (i + 1..recvs.len()).find(|&j| recvs[j].peer == peer) {
            if recvs[j].stage == Stage::Held {
                self.post_header(r, recvs, j)?;
            }
        }
        Ok(())
    }

    /// Receive `i`'s header arrived (`n` bytes): check it against this rank's call and, for
    /// data, post the pieces. After an error, what the peer announced is left to the sweeper.
    fn on_header(
        &self,
        site: Site,
        r: &mut Reuse,
        recvs: &mut [Recv<'_>],
        i: usize,
        n: usize,
        mine: &Ident,
    ) -> Result<()> {
        let rv = &mut recvs[i];
        rv.got = n;
        let peer = rv.peer;
        if n < HDR {
            return Err(Error::invalid(
                site,
                format!("rank {peer} sent a message of {n} bytes where a frame header was due"),
            ));
        }
        let h: [u8; HDR] = rv.hdr[..HDR].try_into().expect("HDR bytes");
        let (kind, aux, len) = parse_frame(&h);
        let theirs = *frame_ident(&h);
        let result = match &mut rv.want {
            Want::Header => {
                rv.stage = Stage::Done;
                if kind == FRAME_HEADER {
                    Ok(())
                } else {
                    // Data where a check round's header was due: the peer is mid-call, and
                    // this call cannot end cleanly.
                    self.data_started.store(true, Ordering::Release);
                    if theirs != *mine {
                        Err(super::wire::mismatch(site, peer, &theirs, mine))
                    } else {
                        Err(Error::invalid(
                            site,
                            format!(
                            "rank {peer} is out of step with this rank (sent frame kind {kind} \
                             where {FRAME_HEADER} was due)"
                        ),
                        ))
                    }
                }
            }
            // A rank that rejected its arguments says so instead of sending data; its header
            // states the call as it could, so only the call number must match.
            Want::Data { .. }
                if kind == FRAME_HEADER && len > 0 && super::wire::same_call(&theirs, mine) =>
            {
                let text = &rv.hdr[HDR..n.min(HDR + (len as usize).min(MAX_MSG))];
                Err(Error::PeerRejected {
                    site,
                    peer,
                    message: String::from_utf8_lossy(text).into_owned(),
                })
            }
            Want::Data { .. } if theirs != *mine => {
                Err(super::wire::mismatch(site, peer, &theirs, mine))
            }
            Want::Data { dst, aux: want, .. } => {
                if kind != FRAME_DATA {
                    Err(Error::invalid(
                        site,
                        format!("rank {peer} sent a frame of kind {kind} where data was due"),
                    ))
                } else if *want != 0 && (aux != *want || len != dst.len() as u64) {
                    let sent = crate::dtype::DType::from_u32(aux & 0xffff);
                    let mine_d = crate::dtype::DType::from_u32(*want & 0xffff);
                    Err(match (sent, mine_d) {
                        (Some(d), Some(md)) => {
                            super::pair_mismatch(site, peer, (d, len as usize), (md, dst.len()))
                        }
                        _ => Error::invalid(
                            site,
                            format!("rank {peer} sent a frame this rank cannot read"),
                        ),
                    })
                } else if len != dst.len() as u64 {
                    Err(Error::invalid(
                        site,
                        format!(
                            "rank {peer} sent {len} bytes where {} were expected",
                            dst.len()
                        ),
                    ))
                } else {
                    let total = pieces(dst.len()).count();
                    rv.stage = Stage::Pieces {
                        next: 0,
                        done: 0,
                        total,
                    };
                    return self
                        .post_pieces(r, recvs, i)
                        .and_then(|()| self.maybe_release(r, recvs, i));
                }
            }
        };
        if result.is_err() {
            // What the peer sends after this header is taken off the wire as the call ends.
            rv.stage = Stage::Done;
        }
        result
    }

    /// Receive `i` has posted every piece: the next receive from its peer may start.
    fn maybe_release(&self, r: &mut Reuse, recvs: &mut [Recv<'_>], i: usize) -> Result<()> {
        match recvs[i].stage {
            Stage::Pieces { next, total, .. } if next == total => self.release_held(r, recvs, i),
            Stage::Done => self.release_held(r, recvs, i),
            _ => Ok(()),
        }
    }

    /// Piece `k` of receive `i` arrived.
    fn on_piece(
        &self,
        r: &mut Reuse,
        recvs: &mut [Recv<'_>],
        i: usize,
        k: usize,
        buf: u8,
    ) -> Result<()> {
        let rv = &mut recvs[i];
        let Stage::Pieces { next, done, total } = rv.stage else {
            return Ok(());
        };
        if let Want::Data { dst, mode, .. } = &mut rv.want {
            if buf < 2 {
                let off = k * PIECE;
                let n = piece_len(dst.len(), off);
                mode.deliver(&mut dst[off..off + n], off, &rv.scratch[buf as usize][..n]);
                rv.busy[buf as usize] = false;
            }
        }
        let done = done + 1;
        rv.stage = if done == total {
            Stage::Done
        } else {
            Stage::Pieces { next, done, total }
        };
        if done < total {
            self.post_pieces(r, recvs, i)?;
        }
        self.maybe_release(r, recvs, i)
    }

    /// Run the posted requests of an exchange, and those they lead to, until every one has
    /// completed; on an error, clean up (see the module's notes) before returning it.
    fn run(
        &self,
        site: Site,
        phase: &'static str,
        r: &mut Reuse,
        recvs: &mut [Recv<'_>],
        mine: &Ident,
        rejected: Option<&str>,
    ) -> Result<()> {
        let result = self.progress(site, phase, r, recvs, mine);
        if let Err(e) = result {
            // Whatever failed here, the peers may be mid-step: the communicator ends, and they
            // hear why first, so that those still in this step fail at once and take what this
            // rank sent them, which lets its sends complete. A rank that rejected its own
            // arguments gives that as its reason, not the data its peers sent meanwhile (a
            // lost peer, a timeout or an abort stays the reason).
            self.data_started.store(true, Ordering::Release);
            match (rejected, &e) {
                (Some(m), Error::Mismatch { .. } | Error::InvalidArgument { .. }) => {
                    self.give_up(&Error::invalid(site, m))
                }
                _ => self.give_up(&e),
            }
            self.clean_up(site, r, recvs);
            return Err(e);
        }
        Ok(())
    }

    /// Whether `e` ends the communicator: anything but a difference that a check round found
    /// alike on every rank before any data moved.
    fn fatal(&self, e: &Error) -> bool {
        !matches!(
            e,
            Error::Mismatch { .. }
                | Error::PeerRejected { .. }
                | Error::InvalidArgument { site: Some(_), .. }
        ) || self.aborted.load(Ordering::Acquire)
            || self.data_started.load(Ordering::Acquire)
    }

    /// Abort with `e`'s reason and tell the peers (once).
    fn give_up(&self, e: &Error) {
        // An abort's own reason, not its "communicator aborted on rank N:" wrapping.
        let reason = match e {
            Error::Aborted { reason, .. } => reason.clone(),
            e => e.to_string(),
        };
        self.set_aborted(&reason);
        self.notify_peers(&reason);
        self.sweep_after_abort();
    }

    /// Test requests until all are done (Ok), the timeout (a `Timeout`), an abort, or an error.
    /// Every completion of a test is handled (a header leads to its data) before an error of
    /// one of them is returned.
    fn progress(
        &self,
        site: Site,
        phase: &'static str,
        r: &mut Reuse,
        recvs: &mut [Recv<'_>],
        mine: &Ident,
    ) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut idle = Idle::default();
        let mut looks = 0u32;
        loop {
            let (code, out) = test_some(r);
            if out == usize::MAX {
                return Ok(()); // every request is done
            }
            if code != 0 && code != m::MPI_ERR_IN_STATUS as c_int {
                let e = check(code, "MPI_Testsome").unwrap_err();
                return Err(lost(site, None, e));
            }
            if out > 0 {
                idle.reset();
                let mut first = Ok(());
                for j in 0..out {
                    let at = r.done[j] as usize;
                    let st = r.statuses[j];
                    let slot = r.slots[at];
                    let err = if code != 0 { st.MPI_ERROR } else { 0 };
                    let done = self.complete(site, r, recvs, mine, slot, &st, err);
                    if first.is_ok() {
                        first = done;
                    }
                }
                first?;
                continue;
            }
            if self.aborted.load(Ordering::Acquire) {
                return Err(self.aborted_error());
            }
            looks = looks.wrapping_add(1);
            if looks % 16 == 0 {
                if let Some(e) = self.abort_notice() {
                    return Err(e);
                }
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        site,
                        waiting_for: self.pending_peers(r, recvs),
                        phase,
                        timeout: self.timeout,
                        stalled_on: Vec::new(),
                    });
                }
            }
            idle.pause();
        }
    }

    /// The peers whose requests are still open, and those of receives not yet posted.
    fn pending_peers(&self, r: &Reuse, recvs: &[Recv<'_>]) -> Vec<usize> {
        let mut v: Vec<usize> = Vec::new();
        for (req, slot) in r.reqs.iter().zip(&r.slots) {
            if *req == request_null() {
                continue;
            }
            v.push(match *slot {
                Slot::Send(p) => p,
                Slot::Header(i) | Slot::Piece { r: i, .. } => recvs[i].peer,
            });
        }
        v.extend(
            recvs
                .iter()
                .filter(|x| x.stage == Stage::Held)
                .map(|x| x.peer),
        );
        v.sort_unstable();
        v.dedup();
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        site: Site,
        r: &mut Reuse,
        recvs: &mut [Recv<'_>],
        mine: &Ident,
        slot: Slot,
        st: &m::MPI_Status,
        err: c_int,
    ) -> Result<()> {
        let truncated = err == m::MPI_ERR_TRUNCATE as c_int;
        match slot {
            Slot::Send(peer) => {
                if err != 0 {
                    return Err(lost(site, Some(peer), check(err, "a send").unwrap_err()));
                }
            }
            Slot::Header(i) => {
                let peer = recvs[i].peer;
                if err != 0 && !truncated {
                    recvs[i].stage = Stage::Done;
                    return Err(lost(site, Some(peer), check(err, "a receive").unwrap_err()));
                }
                let mut n: c_int = 0;
                // SAFETY: the status of a completed receive.
                unsafe { m::MPI_Get_count(st, byte(), &mut n) };
                let n = (n.max(0) as usize).min(HDR_CAP);
                self.on_header(site, r, recvs, i, n, mine)?;
            }
            Slot::Piece { r: i, k, buf } => {
                let peer = recvs[i].peer;
                if err != 0 {
                    recvs[i].stage = Stage::Done;
                    return Err(if truncated {
                        Error::invalid(site, format!("rank {peer} sent more than it announced"))
                    } else {
                        lost(site, Some(peer), check(err, "a receive").unwrap_err())
                    });
                }
                self.on_piece(r, recvs, i, k, buf)?;
            }
        }
        Ok(())
    }

    /// After a failed exchange (the peers told already): cancel this rank's receives not yet
    /// matched, and wait for its own requests while the sweeper takes what peers sent it (what
    /// a failed header announced, what receives not yet posted would have taken), so that
    /// their sends complete too. A request MPI still holds one timeout later ends the job (see
    /// the module's notes).
    fn clean_up(&self, site: Site, r: &mut Reuse, recvs: &mut [Recv<'_>]) {
        if finalized() {
            return;
        }
        for (req, slot) in r.reqs.iter_mut().zip(&r.slots) {
            if *req != request_null() && !matches!(slot, Slot::Send(_)) {
                // SAFETY: an open receive of ours; one already matched completes as usual.
                unsafe { m::MPI_Cancel(req) };
            }
        }
        self.sweep_after_abort();
        let deadline = Instant::now() + self.timeout;
        let mut idle = Idle::default();
        loop {
            let (_, out) = test_some(r);
            if out == usize::MAX {
                return;
            }
            if Instant::now() >= deadline {
                let peers = self.pending_peers(r, recvs);
                log::error!(
                    "{site}: MPI still holds this rank's buffers for ranks {peers:?} one timeout \
                     ({:?}) after the call failed; ending the job (MPI_Abort), since MPI cannot \
                     take back a transfer it has begun",
                    self.timeout
                );
                eprintln!(
                    "tutti: {site}: MPI still holds this rank's buffers for ranks {peers:?} \
                     after the call failed; ending the job with MPI_Abort"
                );
                // SAFETY: ends every process of the job.
                unsafe { m::MPI_Abort(m::RSMPI_COMM_WORLD, 70) };
            }
            if out > 0 {
                idle.reset();
            } else {
                idle.pause();
            }
        }
    }

    /// Start an exchange: take the reused lists.
    fn lists(r: &mut Reuse) -> Vec<Recv<'static>> {
        r.reqs.clear();
        r.slots.clear();
        r.headers.clear();
        std::mem::take(&mut r.recvs)
    }

    /// End an exchange: keep the lists and the scratch buffers.
    fn keep(r: &mut Reuse, mut recvs: Vec<Recv<'_>>) {
        for rv in recvs.iter_mut() {
            for s in rv.scratch.iter_mut() {
                let v = std::mem::take(s);
                if v.capacity() > 0 {
                    r.pool.push(v);
                }
            }
            let h = std::mem::take(&mut rv.hdr);
            if h.capacity() > 0 {
                r.pool.push(h);
            }
        }
        r.recvs = recycle(recvs);
        r.reqs.clear();
        r.slots.clear();
    }

    /// A kept buffer for a header (the smallest), or a new one.
    fn small(pool: &mut Vec<Vec<u8>>) -> Vec<u8> {
        let i = (0..pool.len()).min_by_key(|&i| pool[i].capacity());
        i.map(|i| pool.swap_remove(i)).unwrap_or_default()
    }

    /// A kept buffer for a piece in flight (the largest, so that one grown before is not
    /// grown again), or a new one.
    fn large(pool: &mut Vec<Vec<u8>>) -> Vec<u8> {
        let i = (0..pool.len()).max_by_key(|&i| pool[i].capacity());
        i.map(|i| pool.swap_remove(i)).unwrap_or_default()
    }

    fn new_recv<'a>(r: &mut Reuse, peer: usize, want: Want<'a>, held: bool) -> Recv<'a> {
        let hdr = Self::small(&mut r.pool);
        let reduce = matches!(&want, Want::Data { mode, .. } if mode.combined().is_some());
        let scratch = if reduce {
            [Self::large(&mut r.pool), Self::large(&mut r.pool)]
        } else {
            [Vec::new(), Vec::new()]
        };
        Recv {
            peer,
            want,
            hdr,
            got: 0,
            stage: if held { Stage::Held } else { Stage::Header },
            scratch,
            busy: [false; 2],
        }
    }

    /// Post every send and the first receive from each peer, then run.
    fn exchange_all(
        &self,
        site: Site,
        phase: &'static str,
        r: &mut Reuse,
        sends: &[(usize, usize, &[u8])],
        recvs: &mut [Recv<'_>],
        mine: &Ident,
    ) -> Result<()> {
        let mut posted = Ok(());
        for &(peer, h, data) in sends {
            posted = self.post_send(r, peer, h, data);
            if posted.is_err() {
                break;
            }
        }
        if posted.is_ok() {
            for i in 0..recvs.len() {
                if recvs[i].stage == Stage::Header {
                    posted = self.post_header(r, recvs, i);
                    if posted.is_err() {
                        break;
                    }
                }
            }
        }
        if let Err(e) = posted {
            self.clean_up(site, r, recvs);
            return Err(e);
        }
        self.run(site, phase, r, recvs, mine, None)
    }
}

/// A failure MPI reported: the peer named where one is known.
fn lost(site: Site, peer: Option<usize>, e: Error) -> Error {
    let detail = e.to_string();
    match peer {
        Some(peer) => Error::PeerLost { site, peer, detail },
        None => Error::System {
            what: format!("{site}"),
            message: detail,
        },
    }
}

/// The byte ranges of the MPI messages `len` bytes travel in (one, empty, for none).
fn pieces(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let n = len.div_ceil(PIECE).max(1);
    (0..n).map(move |k| {
        let a = k * PIECE;
        a..(a + PIECE).min(len)
    })
}

fn piece_len(len: usize, off: usize) -> usize {
    (len - off.min(len)).min(PIECE)
}

/// MPI's datatype for elements of `d` in a reduction (`None`: MPI has none: f16, bf16).
fn mpi_dtype(d: DType) -> Option<m::MPI_Datatype> {
    // SAFETY: reading constants of the binding.
    unsafe {
        Some(match d {
            DType::F32 => m::RSMPI_FLOAT,
            DType::F64 => m::RSMPI_DOUBLE,
            DType::I8 => m::RSMPI_INT8_T,
            DType::U8 => m::RSMPI_UINT8_T,
            DType::I32 => m::RSMPI_INT32_T,
            DType::U32 => m::RSMPI_UINT32_T,
            DType::I64 => m::RSMPI_INT64_T,
            DType::U64 => m::RSMPI_UINT64_T,
            DType::F16 | DType::BF16 => return None,
        })
    }
}

/// MPI's op for `op` (`None`: MPI has no mean).
fn mpi_op(op: ReduceOp) -> Option<m::MPI_Op> {
    // SAFETY: reading constants of the binding.
    unsafe {
        Some(match op {
            ReduceOp::Sum => m::RSMPI_SUM,
            ReduceOp::Prod => m::RSMPI_PROD,
            ReduceOp::Min => m::RSMPI_MIN,
            ReduceOp::Max => m::RSMPI_MAX,
            ReduceOp::BAnd => m::RSMPI_BAND,
            ReduceOp::BOr => m::RSMPI_BOR,
            ReduceOp::BXor => m::RSMPI_BXOR,
            ReduceOp::Mean => return None,
        })
    }
}

impl MpiTransport {
    /// Post MPI's own collective for `call` (see [`Transport::native`]); `None` where MPI has
    /// no such call for it (every rank decides alike: from the collective, dtype, op and
    /// sizes the call checked). `stage` holds an in-place call's input.
    fn post_native(
        &self,
        call: &NativeCall,
        stage: &mut Vec<u8>,
    ) -> Option<Result<m::MPI_Request>> {
        use crate::error::Collective as C;
        let b = call.buffers;
        let reduces = matches!(call.collective, C::AllReduce | C::Reduce | C::ReduceScatter);
        // Element type and count unit: the reductions need MPI's type of the elements; the
        // others move bytes, whatever the type.
        let (dt, unit) = if reduces {
            (mpi_dtype(call.dtype)?, call.dtype.size())
        } else {
            (byte(), 1)
        };
        let op = if reduces {
            mpi_op(call.op?)?
        } else {
            // SAFETY: reading a constant of the binding (unused by these collectives).
            unsafe { m::RSMPI_SUM }
        };
        let p = self.world.max(1);
        // The count MPI takes, from a length every rank states alike for this collective
        // (checked by the call's round): the decision to hand the call to MPI is the same on
        // every rank. The calls with counts (whose lengths are each rank's own) are not MPI's
        // here.
        let bytes = match call.collective {
            C::AllReduce | C::Broadcast | C::ReduceScatter | C::Scatter => b.output_len,
            C::Reduce | C::AllGather | C::Gather => b.input_len,
            C::AllToAll => b.input_len / p,
            _ => return None,
        };
        let count = c_int::try_from(bytes / unit).ok()?;
        let root = self.peers.get(call.root).copied().unwrap_or(0);
        // Nothing moves: done, without MPI, which may refuse the null buffers of empty calls.
        if count == 0 {
            return Some(Ok(request_null()));
        }
        let comm = self.comm.0;
        let mut req = request_null();
        let out = b.output.cast::<c_void>();
        // In place, the input lies in the output, which MPI forbids without MPI_IN_PLACE
        // (whose value differs between MPI libraries; Open MPI ends the job on an aliased
        // buffer whatever the error handler): it is sent from a copy. Whether a call is in
        // place is each rank's own choice, so it never decides the path.
        let (i0, o0) = (b.input as usize, b.output as usize);
        let overlap = i0 < o0.saturating_add(b.output_len) && o0 < i0.saturating_add(b.input_len);
        let inp: *const c_void = if call.collective != C::Broadcast
            && !b.input.is_null()
            && !b.output.is_null()
            && overlap
        {
            stage.clear();
            // SAFETY: the call's input, valid for its length.
            stage.extend_from_slice(unsafe { std::slice::from_raw_parts(b.input, b.input_len) });
            stage.as_ptr().cast()
        } else {
            b.input.cast()
        };
        // SAFETY: the buffers are the call's (or the stage), valid until it completes, which
        // `wait_native` waits for (or ends the job); counts are those the checked call states.
        let code = unsafe {
            match call.collective {
                C::AllReduce => m::MPI_Iallreduce(inp, out, count, dt, op, comm, &mut req),
                C::Broadcast => m::MPI_Ibcast(out, count, dt, root, comm, &mut req),
                C::Reduce => m::MPI_Ireduce(inp, out, count, dt, op, root, comm, &mut req),
                C::ReduceScatter => {
                    m::MPI_Ireduce_scatter_block(inp, out, count, dt, op, comm, &mut req)
                }
                C::AllGather => m::MPI_Iallgather(inp, count, dt, out, count, dt, comm, &mut req),
                C::AllToAll => m::MPI_Ialltoall(inp, count, dt, out, count, dt, comm, &mut req),
                C::Gather => m::MPI_Igather(inp, count, dt, out, count, dt, root, comm, &mut req),
                C::Scatter => m::MPI_Iscatter(inp, count, dt, out, count, dt, root, comm, &mut req),
                _ => return None,
            }
        };
        Some(check(code, "posting MPI's collective").map(|()| req))
    }

    /// Wait for MPI's collective `req` (the timeout, aborts); on a failure the peers hear why,
    /// and the request, which MPI cannot cancel, is waited for one more timeout before the job
    /// ends (see the module's notes).
    fn wait_native(&self, site: Site, req: &mut m::MPI_Request) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut idle = Idle::default();
        let mut looks = 0u32;
        let failed = loop {
            let mut flag: c_int = 0;
            let mut st = empty_status();
            // SAFETY: our request, tested in place.
            let code = unsafe { m::MPI_Test(req, &mut flag, &mut st) };
            if code != 0 {
                break lost(site, None, check(code, "MPI's collective").unwrap_err());
            }
            if flag != 0 {
                return Ok(());
            }
            if self.aborted.load(Ordering::Acquire) {
                break self.aborted_error();
            }
            looks = looks.wrapping_add(1);
            if looks % 16 == 0 {
                if let Some(e) = self.abort_notice() {
                    break e;
                }
                if Instant::now() >= deadline {
                    break Error::Timeout {
                        site,
                        waiting_for: Vec::new(),
                        phase: "finish MPI's collective",
                        timeout: self.timeout,
                        stalled_on: Vec::new(),
                    };
                }
            }
            idle.pause();
        };
        self.data_started.store(true, Ordering::Release);
        self.give_up(&failed);
        if *req != request_null() && !wait_until(req, Instant::now() + self.timeout) {
            log::error!(
                "{site}: MPI's collective still holds this rank's buffers one timeout ({:?}) \
                 after the call failed ({failed}); ending the job (MPI_Abort), since MPI cannot \
                 cancel a collective",
                self.timeout
            );
            eprintln!(
                "tutti: {site}: MPI's collective still holds this rank's buffers after the call \
                 failed; ending the job with MPI_Abort"
            );
            // SAFETY: ends every process of the job.
            unsafe { m::MPI_Abort(m::RSMPI_COMM_WORLD, 70) };
        }
        Err(failed)
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn begin(&self, site: Site, header: &CallHeader, _buffers: CallBuffers) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        if let Some(e) = self.abort_notice() {
            return Err(e);
        }
        self.data_started.store(false, Ordering::Release);
        if self.world == 1 {
            return Ok(());
        }
        let ident = header.ident();
        self.ident.set(&ident);
        // The calls the network transport rounds (see `NetTransport::begin`) have a check
        // round here too; the others carry their check with their data.
        use crate::error::Collective::{Barrier, Broadcast, Reduce};
        let round = header.full_check
            || header.count == 0
            || matches!(header.collective, Barrier | Broadcast | Reduce)
            || header.root.is_some()
            || header.counts.is_some()
            || header.rejected.is_some()
            // MPI's own collective carries no tutti header.
            || header.algorithm == crate::call::Algorithm::Mpi;
        if !round {
            return Ok(());
        }
        let message = header
            .rejected
            .as_deref()
            .map(|m| if m.is_empty() { "rejected" } else { m })
            .unwrap_or("")
            .as_bytes();
        let message = &message[..message.len().min(MAX_MSG)];
        let mut engine = self.engine.lock();
        let r = &mut *engine;
        // The header and any rejection, in a buffer kept between calls.
        let mut hdr = Self::small(&mut r.pool);
        hdr.clear();
        hdr.extend_from_slice(&frame(FRAME_HEADER, 0, message.len() as u64, &ident));
        hdr.extend_from_slice(message);
        let mut recvs = Self::lists(r);
        let peers = (0..self.world).filter(|&p| p != self.rank);
        let mut posted = Ok(());
        for peer in peers.clone() {
            posted = self.isend(r, peer, hdr.as_ptr(), hdr.len());
            if posted.is_err() {
                break;
            }
        }
        let mut recvs: Vec<Recv<'_>> = recycle(std::mem::take(&mut recvs));
        for peer in peers {
            let rv = Self::new_recv(r, peer, Want::Header, false);
            recvs.push(rv);
        }
        let result = match posted {
            Ok(()) => {
                let mut p = Ok(());
                for i in 0..recvs.len() {
                    p = self.post_header(r, &mut recvs, i);
                    if p.is_err() {
                        break;
                    }
                }
                match p {
                    Ok(()) => self.run(
                        site,
                        "arrive",
                        r,
                        &mut recvs,
                        &ident,
                        header.rejected.as_deref(),
                    ),
                    Err(e) => {
                        self.clean_up(site, r, &mut recvs);
                        Err(e)
                    }
                }
            }
            Err(e) => {
                self.clean_up(site, r, &mut recvs);
                Err(e)
            }
        };
        // Compared once every peer's header is in, so that every rank reports the same
        // first difference and the communicator stays usable.
        let checked = result.and_then(|()| {
            for rv in &recvs {
                let h: [u8; HDR] = rv.hdr[..HDR].try_into().expect("HDR bytes");
                let (_, _, len) = parse_frame(&h);
                let len = (len as usize).min(rv.got.saturating_sub(HDR));
                if len > 0 {
                    return Err(Error::PeerRejected {
                        site,
                        peer: rv.peer,
                        message: String::from_utf8_lossy(&rv.hdr[HDR..HDR + len]).into_owned(),
                    });
                }
                let theirs = frame_ident(&h);
                if *theirs != ident {
                    return Err(super::wire::mismatch(site, rv.peer, theirs, &ident));
                }
            }
            Ok(())
        });
        Self::keep(r, recvs);
        r.pool.push(hdr);
        checked
    }

    fn exchange(&self, site: Site, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        super::check_peers(site, self.rank, self.world, sends, recvs)?;
        // Nothing is sent on a communicator that gave up, or whose peer did: nobody would
        // receive it.
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        if let Some(e) = self.abort_notice() {
            return Err(e);
        }
        self.data_started.store(true, Ordering::Release);
        let ident = self.ident.get();
        let mut engine = self.engine.lock();
        let r = &mut *engine;
        let list = Self::lists(r);
        for s in sends {
            r.headers
                .push(frame(FRAME_DATA, 0, s.data.len() as u64, &ident));
        }
        let mut ss: Vec<(usize, usize, &[u8])> = recycle(std::mem::take(&mut r.sends));
        ss.extend(sends.iter().enumerate().map(|(k, s)| (s.peer, k, s.data)));
        let mut rs: Vec<Recv<'_>> = recycle(list);
        for op in recvs.iter_mut() {
            let rv = Self::new_recv(
                r,
                op.peer,
                Want::Data {
                    dst: &mut *op.dst,
                    mode: op.mode,
                    aux: 0,
                },
                false,
            );
            rs.push(rv);
        }
        let result = self.exchange_all(site, "exchange data", r, &ss, &mut rs, &ident);
        r.sends = recycle(ss);
        Self::keep(r, rs);
        result
    }

    fn pair_exchange(&self, site: Site, ops: &mut [PairOp<'_>]) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        if let Some(e) = self.abort_notice() {
            return Err(e);
        }
        static IDENT: OnceLock<Ident> = OnceLock::new();
        let ident = *IDENT.get_or_init(super::net::pair_ident);
        self.ident.set(&ident);
        self.data_started.store(true, Ordering::Release);
        let mut engine = self.engine.lock();
        let r = &mut *engine;
        let list = Self::lists(r);
        let mut ss: Vec<(usize, usize, &[u8])> = recycle(std::mem::take(&mut r.sends));
        let mut rs: Vec<Recv<'_>> = recycle(list);
        for op in ops.iter_mut() {
            let aux = pair_aux(op.dtype);
            match &mut op.data {
                PairData::Send(data) => {
                    r.headers
                        .push(frame(FRAME_DATA, aux, data.len() as u64, &ident));
                    ss.push((op.peer, r.headers.len() - 1, data));
                }
                PairData::Recv(dst) => {
                    let held = rs.iter().any(|x| x.peer == op.peer);
                    let rv = Self::new_recv(
                        r,
                        op.peer,
                        Want::Data {
                            dst,
                            mode: RecvMode::Copy,
                            aux,
                        },
                        held,
                    );
                    rs.push(rv);
                }
            }
        }
        let result = self.exchange_all(site, "point-to-point", r, &ss, &mut rs, &ident);
        r.sends = recycle(ss);
        Self::keep(r, rs);
        result
    }

    fn has_native(&self) -> bool {
        true
    }

    fn native(&self, site: Site, call: &NativeCall) -> Option<Result<()>> {
        // One rank: the algorithms' copy is all there is to do. A split's group shares its
        // MPI communicator with the parent's other groups, so MPI's collectives on it would
        // be theirs too: the group runs the algorithms (the same for every member).
        if self.world == 1 || !self.whole {
            return None;
        }
        let mut stage = self.stage.lock();
        let mut req = match self.post_native(call, &mut stage)? {
            Ok(req) => req,
            Err(e) => return Some(Err(e)),
        };
        self.data_started.store(true, Ordering::Release);
        let done = self.wait_native(site, &mut req);
        if stage.capacity() > 4 << 20 {
            // An in-place call's copy is not kept for the communicator's life.
            *stage = Vec::new();
        }
        Some(done)
    }

    fn end(&self, failed: Option<&Error>) {
        let Some(e) = failed else {
            return;
        };
        if !self.fatal(e) {
            // Found in a check round by every rank alike, before any data moved: still usable.
            return;
        }
        let _engine = self.engine.lock();
        self.give_up(e);
    }

    fn hosts(&self) -> Option<&[usize]> {
        Some(&self.hosts)
    }

    /// MPI carries the messages between ranks of one node through its own shared memory.
    fn shm_within_hosts(&self) -> bool {
        true
    }

    fn regroup(&self) -> Option<super::Regroup> {
        Some(super::Regroup::Mpi(self.parent()))
    }

    fn abort(&self, reason: &str) {
        self.set_aborted(reason);
        if let Some(_engine) = self.engine.try_lock() {
            self.notify_peers(reason);
            self.sweep_after_abort();
        }
    }

    fn aborted(&self) -> Option<String> {
        if self.aborted.load(Ordering::Acquire) {
            self.reason.lock().clone()
        } else {
            None
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        if finalized() {
            return;
        }
        let mut a = self.abort_in.lock();
        let (req, buf) = &mut *a;
        if req.0 != request_null() {
            // SAFETY: our open receive; cancelled, it completes at once (or has completed).
            unsafe { m::MPI_Cancel(&mut req.0) };
            if !wait_until(&mut req.0, Instant::now() + Duration::from_secs(1)) {
                // MPI may still write the buffer: leave it to MPI.
                std::mem::forget(std::mem::take(buf));
                return;
            }
        }
        if self.sweeping.load(Ordering::Acquire) {
            // The sweeper may still use it; an aborted communicator's handle is left to MPI.
            return;
        }
        // SAFETY: no request of ours is open on it.
        unsafe { m::MPI_Comm_free(&mut self.comm.0) };
    }
}
