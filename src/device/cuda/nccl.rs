//! NCCL, loaded at run time from `libnccl.so.2` (see [`super::libs::nccl_candidates`]) and bound
//! function by function, so that a missing library or symbol is an `Unavailable` error, never a
//! panic. The types and enum values are cudarc's NCCL bindings.
//!
//! Communicators are created non-blocking (`ncclConfig_t.blocking = 0`): every NCCL call returns
//! at once, and tutti polls `ncclCommGetAsyncError` and the streams until the work is done, an
//! error is reported (returned with NCCL's message and its last-error text), or the timeout
//! passes, when every communicator of the group is aborted with `ncclCommAbort` (NCCL's kernels
//! stop) and the group refuses later calls.
//!
//! NCCL switches devices itself; every call into it is wrapped so that the caller's current CUDA
//! context is current again afterwards.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

use super::discovery::DeviceInner;
use super::driver;
use super::libs;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;

/// The name of an `ncclResult_t` value.
pub fn result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// Decode `ncclGetVersion`'s code: `major*10000 + minor*100 + patch` since NCCL 2.9,
/// `major*1000 + minor*100 + patch` before.
pub fn decode_version(code: i32) -> (u32, u32, u32) {
    let c = code.max(0) as u32;
    if c >= 10000 {
        (c / 10000, (c % 10000) / 100, c % 100)
    } else {
        (c / 1000, (c % 1000) / 100, c % 100)
    }
}

/// The oldest NCCL tutti uses: non-blocking communicators (`ncclConfig_t`,
/// `ncclCommFinalize`) arrived in 2.14.
pub const MIN_VERSION: (u32, u32, u32) = (2, 14, 0);

/// `ncclConfig_t` as of NCCL 2.17. Later NCCLs read this prefix (by `size` and `version`) and
/// give the fields it lacks their defaults.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const CONFIG_UNDEF_INT: c_int = c_int::MIN;

impl Config {
    fn non_blocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 2 * 10000 + 17 * 100,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

type Stream_ = *mut c_void;

/// The NCCL functions tutti calls.
pub(crate) struct Api {
    _lib: libloading::Library,
    path: String,
    version: (u32, u32, u32),
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    comm_init_rank_config:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut Config) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    comm_finalize: unsafe extern "C" fn(ncclComm_t) -> c_int,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        ncclComm_t,
        Stream_,
    ) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        ncclComm_t,
        Stream_,
    ) -> c_int,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        ncclComm_t,
        Stream_,
    ) -> c_int,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        ncclComm_t,
        Stream_,
    ) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, ncclComm_t, Stream_) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, ncclComm_t, Stream_) -> c_int,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        ncclComm_t,
        Stream_,
    ) -> c_int,
}

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Send for Api {}
// SAFETY: as above; NCCL's functions are callable from any thread.
unsafe impl Sync for Api {}

/// The NCCL library found: where, and its version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclLibrary {
    /// The path or name it was loaded from.
    pub path: String,
    /// (major, minor, patch).
    pub version: (u32, u32, u32),
}

impl Api {
    fn load(candidates: &[String]) -> Result<Api> {
        let (lib, path) = libs::open_nccl(candidates)?;
        // SAFETY: each symbol is bound to NCCL's documented C signature.
        unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get($name.as_bytes()).map_err(|e| {
                        libs::unavailable(
                            "NCCL",
                            format!(
                                "{path} has no {} ({e}); tutti needs NCCL {}.{} or later",
                                $name, MIN_VERSION.0, MIN_VERSION.1
                            ),
                        )
                    })?
                };
            }
            let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = sym!("ncclGetVersion");
            let mut code: c_int = 0;
            let r = get_version(&mut code);
            if r != NCCL_SUCCESS {
                return Err(libs::unavailable(
                    "NCCL",
                    format!("{path}: ncclGetVersion failed ({})", result_name(r)),
                ));
            }
            let version = decode_version(code);
            if version < MIN_VERSION {
                return Err(libs::unavailable(
                    "NCCL",
                    format!(
                        "{path} is NCCL {}.{}.{}; tutti needs {}.{} or later (non-blocking communicators)",
                        version.0, version.1, version.2, MIN_VERSION.0, MIN_VERSION.1
                    ),
                ));
            }
            Ok(Api {
                get_unique_id: sym!("ncclGetUniqueId"),
                comm_init_rank_config: sym!("ncclCommInitRankConfig"),
                comm_get_async_error: sym!("ncclCommGetAsyncError"),
                comm_finalize: sym!("ncclCommFinalize"),
                comm_destroy: sym!("ncclCommDestroy"),
                comm_abort: sym!("ncclCommAbort"),
                get_error_string: sym!("ncclGetErrorString"),
                get_last_error: sym!("ncclGetLastError"),
                group_start: sym!("ncclGroupStart"),
                group_end: sym!("ncclGroupEnd"),
                all_reduce: sym!("ncclAllReduce"),
                broadcast: sym!("ncclBroadcast"),
                reduce: sym!("ncclReduce"),
                all_gather: sym!("ncclAllGather"),
                reduce_scatter: sym!("ncclReduceScatter"),
                send: sym!("ncclSend"),
                recv: sym!("ncclRecv"),
                _lib: lib,
                path,
                version,
            })
        }
    }

    /// NCCL's text for `code`, plus the communicator's last error when it has one.
    fn message(&self, code: c_int, comm: Option<ncclComm_t>) -> String {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated strings it owns.
                unsafe { CStr::from_ptr(p) }
                    .to_string_lossy()
                    .trim()
                    .to_string()
            }
        };
        // SAFETY: any code is accepted.
        let mut m = format!(
            "{}: {}",
            result_name(code),
            text(unsafe { (self.get_error_string)(code) })
        );
        if let Some(c) = comm {
            // SAFETY: a live communicator (or null, which NCCL accepts).
            let last = text(unsafe { (self.get_last_error)(c) });
            if !last.is_empty() {
                m.push_str(&format!("; NCCL says: {last}"));
            }
        }
        m
    }

    fn check(
        &self,
        code: c_int,
        comm: Option<ncclComm_t>,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        if code == NCCL_SUCCESS || code == NCCL_IN_PROGRESS {
            Ok(())
        } else {
            Err(Error::System {
                what: what(),
                message: self.message(code, comm),
            })
        }
    }
}

static API: OnceLock<Api> = OnceLock::new();

/// NCCL as found by the default search (cached once found; a failed search is repeated).
pub(crate) fn api() -> Result<&'static Api> {
    if let Some(a) = API.get() {
        return Ok(a);
    }
    let explicit = std::env::var("TUTTI_NCCL_LIBRARY").ok();
    let api = Api::load(&libs::nccl_candidates(explicit.as_deref()))?;
    let _ = API.set(api);
    API.get()
        .ok_or_else(|| libs::unavailable("NCCL", "the library could not be kept loaded"))
}

/// The NCCL library tutti uses: `TUTTI_NCCL_LIBRARY`, else the search of
/// [`super::libs::nccl_candidates`]; `Unavailable` when none loads or it is older than 2.14.
pub fn nccl_library() -> Result<NcclLibrary> {
    let a = api()?;
    Ok(NcclLibrary {
        path: a.path.clone(),
        version: a.version,
    })
}

/// Load NCCL from `path` alone (not cached): what `TUTTI_NCCL_LIBRARY=path` would find.
pub fn open_nccl_library(path: &str) -> Result<NcclLibrary> {
    let a = Api::load(&[path.to_string()])?;
    Ok(NcclLibrary {
        path: a.path.clone(),
        version: a.version,
    })
}

/// NCCL's code for a tutti element type.
pub fn nccl_dtype(d: DType) -> i32 {
    (match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I8 => ncclDataType_t::ncclInt8,
        DType::U8 => ncclDataType_t::ncclUint8,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::U32 => ncclDataType_t::ncclUint32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U64 => ncclDataType_t::ncclUint64,
    }) as i32
}

/// NCCL's code for a tutti reduce op (`Mean` is `ncclAvg`: integers sum, wrapping, then divide
/// truncating toward zero, as tutti does); `None` for the bitwise ops, which NCCL does not have.
pub fn nccl_op(op: ReduceOp) -> Option<i32> {
    let code = match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Mean => ncclRedOp_t::ncclAvg,
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => return None,
    };
    Some(code as i32)
}

/// The op NCCL is given for `op` over `world` ranks. The mean of one rank is its sum, and
/// NCCL before 2.29.7 leaves the tail of a one-rank `ncclAvg` unwritten (NVIDIA/nccl#1950:
/// the one-rank kernel splits the elements among its blocks rounding down); `ncclSum` over one
/// rank is a plain copy.
fn one_rank_op(world: usize, op: ReduceOp) -> ReduceOp {
    if world == 1 && op == ReduceOp::Mean {
        ReduceOp::Sum
    } else {
        op
    }
}

/// A fresh NCCL unique id (rank 0 makes it; the others receive it).
pub(crate) fn unique_id() -> Result<[u8; 128]> {
    let a = api()?;
    let _keep = driver::preserve_current();
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: valid out-pointer.
    a.check(unsafe { (a.get_unique_id)(&mut id) }, None, || {
        "NCCL ncclGetUniqueId".into()
    })?;
    Ok(id.internal.map(|c| c as u8))
}

/// One collective for [`Comms::run`]: what to call with which addresses on each device.
#[derive(Clone, Debug)]
pub(crate) enum Call {
    AllReduce {
        op: ReduceOp,
    },
    Broadcast {
        root: usize,
    },
    Reduce {
        op: ReduceOp,
        root: usize,
    },
    AllGather,
    ReduceScatter {
        op: ReduceOp,
    },
    /// Block j of each rank's send buffer to rank j, as grouped sends and receives.
    AllToAll,
    /// Every rank's send buffer into block k of the root's receive buffer.
    Gather {
        root: usize,
    },
    /// Block k of the root's send buffer to rank k.
    Scatter {
        root: usize,
    },
    /// Each rank's send buffer into its block of every rank's receive buffer (the blocks'
    /// offsets: `enqueue`'s), as grouped sends and receives.
    AllGatherV,
    /// Block k of every rank's send buffer reduced into rank k's receive buffer: one reduce
    /// per block, rooted at its rank.
    ReduceScatterV {
        op: ReduceOp,
    },
    /// Block j of each rank's send buffer to rank j, blocks of their own lengths.
    AllToAllV,
}

/// The block offsets of a call with a count per block: each local device's into its send
/// buffer, and into its receive buffer (see [`Comms::enqueue`]).
pub(crate) type BlockLists<'a> = (&'a [Vec<usize>], &'a [Vec<usize>]);

/// The NCCL communicators of this process's devices in one group.
pub(crate) struct Comms {
    api: &'static Api,
    comms: Vec<ncclComm_t>,
    /// The global rank of each local device.
    pub ranks: Vec<usize>,
    /// Ranks in the NCCL world.
    world: usize,
    aborted: AtomicBool,
    /// Held (shared) while a communicator is asked for its state, (alone) by an abort, which
    /// frees them.
    gate: parking_lot::RwLock<()>,
}

// SAFETY: communicator handles may be used from any thread (one call at a time, which the
// group guarantees).
unsafe impl Send for Comms {}
// SAFETY: as above.
unsafe impl Sync for Comms {}

impl Comms {
    /// Create the communicators of `devices` (global ranks `first_rank..`, of `world`) from
    /// `id`, in one NCCL group, waiting up to `timeout` for every rank of the world to join.
    pub fn init(
        devices: &[&DeviceInner],
        id: &[u8; 128],
        first_rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Comms> {
        let api = api()?;
        let uid = ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        let what = |i: usize| {
            format!(
                "NCCL ncclCommInitRankConfig (rank {} of {world}, gpu:{} on GPU {})",
                first_rank + i,
                devices[i].logical.index,
                devices[i].logical.physical
            )
        };
        let _keep = driver::preserve_current();
        // SAFETY: NCCL group calls with valid out-pointers and config; each device's context
        // is current while its communicator is created.
        let started = unsafe { (api.group_start)() };
        api.check(started, None, || "NCCL ncclGroupStart".into())?;
        let mut first_err = None;
        for (i, d) in devices.iter().enumerate() {
            let _cur = match d.ctx.enter() {
                Ok(c) => c,
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            let mut config = Config::non_blocking();
            // SAFETY: as above.
            let r = unsafe {
                (api.comm_init_rank_config)(
                    &mut comms[i],
                    world as c_int,
                    uid,
                    (first_rank + i) as c_int,
                    &mut config,
                )
            };
            if let Err(e) = api.check(r, None, || what(i)) {
                first_err.get_or_insert(e);
            }
        }
        // SAFETY: closes the group opened above.
        let ended = unsafe { (api.group_end)() };
        let made = Comms {
            api,
            comms,
            ranks: (first_rank..first_rank + devices.len()).collect(),
            world,
            aborted: AtomicBool::new(false),
            gate: parking_lot::RwLock::new(()),
        };
        let result = first_err
            .map_or(Ok(()), Err)
            .and_then(|_| {
                api.check(ended, None, || {
                    "NCCL ncclGroupEnd (communicator setup)".into()
                })
            })
            .and_then(|_| made.settle(Instant::now() + timeout, "join the NCCL communicator"));
        match result {
            Ok(()) => Ok(made),
            Err(e) => {
                made.abort();
                Err(e)
            }
        }
    }

    /// Poll every communicator until none is in progress; an error names the device; at the
    /// deadline the communicators are aborted.
    fn settle(&self, deadline: Instant, phase: &str) -> Result<()> {
        let _keep = driver::preserve_current();
        let start = Instant::now();
        loop {
            let mut busy = Vec::new();
            for (i, &c) in self.comms.iter().enumerate() {
                if c.is_null() {
                    continue;
                }
                let mut state: c_int = NCCL_SUCCESS;
                // SAFETY: a live communicator and a valid out-pointer.
                let r = unsafe { (self.api.comm_get_async_error)(c, &mut state) };
                self.api
                    .check(r, Some(c), || "NCCL ncclCommGetAsyncError".into())?;
                if state == NCCL_IN_PROGRESS {
                    busy.push(self.ranks[i]);
                } else {
                    self.api.check(state, Some(c), || {
                        format!("NCCL (rank {}) while waiting to {phase}", self.ranks[i])
                    })?;
                }
            }
            if busy.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                self.abort();
                return Err(Error::System {
                    what: "NCCL".into(),
                    message: format!(
                        "timed out after {:?} waiting for NCCL rank(s) {busy:?} to {phase}; a rank \
                         is missing, stuck or on an unreachable host (the communicators were \
                         aborted)",
                        now - start
                    ),
                });
            }
            driver::pause(now - start);
        }
    }

    /// Queue one collective over every local device, on each device's stream (see
    /// [`Comms::wait`]). `sends[i]`, `recvs[i]` are device `i`'s addresses; `count` is NCCL's
    /// count (per rank for all-gather's input and reduce-scatter's output). The calls with a
    /// count per block take `blocks`: device i's P + 1 offsets (elements) into its send buffer
    /// and into its receive buffer, checked to agree between ranks; NCCL moves a block of
    /// zero elements on neither side.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &self,
        call: &Call,
        dtype: DType,
        count: usize,
        blocks: Option<BlockLists<'_>>,
        sends: &[u64],
        recvs: &[u64],
        devices: &[&DeviceInner],
        what: &str,
    ) -> Result<()> {
        let _gate = self.gate.read();
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::System {
                what: what.into(),
                message: "the group's NCCL communicators were aborted by an earlier failure; build a new group".into(),
            });
        }
        let api = self.api;
        let _keep = driver::preserve_current();
        let dt = nccl_dtype(dtype) as c_int;
        // The op's code, before anything is queued: NCCL has no bitwise ops (the group refuses
        // them before a call reaches here; this keeps a stray one an error, never a bad code).
        let op = match *call {
            Call::AllReduce { op }
            | Call::Reduce { op, .. }
            | Call::ReduceScatter { op }
            | Call::ReduceScatterV { op } => op,
            Call::Broadcast { .. }
            | Call::AllGather
            | Call::AllToAll
            | Call::Gather { .. }
            | Call::Scatter { .. }
            | Call::AllGatherV
            | Call::AllToAllV => ReduceOp::Sum,
        };
        let v = matches!(
            call,
            Call::AllGatherV | Call::ReduceScatterV { .. } | Call::AllToAllV
        );
        let (send_blocks, recv_blocks) = match blocks {
            Some((s, r)) if s.len() == devices.len() && r.len() == devices.len() => (s, r),
            _ if !v => (&[][..], &[][..]),
            _ => {
                return Err(Error::System {
                    what: what.into(),
                    message: "a call with a count per block came without a block list per \
                              device"
                        .into(),
                })
            }
        };
        if send_blocks
            .iter()
            .chain(recv_blocks)
            .any(|o| o.len() != self.world + 1)
        {
            return Err(Error::System {
                what: what.into(),
                message: format!(
                    "a block list is not {} offsets (one count per rank)",
                    self.world + 1
                ),
            });
        }
        let es = dtype.size();
        // Block `k` of the offsets `o` over the buffer at `base`: its address and elements.
        let block_of = |base: u64, o: &[usize], k: usize| {
            ((base + (o[k] * es) as u64) as *mut c_void, o[k + 1] - o[k])
        };
        // A block of `count` elements, and the address of block `k` of a buffer.
        let block = count * dtype.size();
        let at = |base: u64, k: usize| (base + (k * block) as u64) as *mut c_void;
        let peers = self.world as c_int;
        // Inside a group a non-blocking communicator may answer "in progress" for each call.
        let fine = |r: c_int| r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS;
        let red_op = nccl_op(one_rank_op(self.world, op)).ok_or_else(|| Error::Unavailable {
            what: format!("{op} on NCCL"),
            why: format!("NCCL has no bitwise reduce ops ({what})"),
        })?;
        // SAFETY: group calls over live communicators; every address lies in device memory of
        // the matching device, of the sizes the group checked; streams are the devices' own.
        let started = unsafe { (api.group_start)() };
        api.check(started, None, || format!("{what}: ncclGroupStart"))?;
        let mut first_err = None;
        for (i, d) in devices.iter().enumerate() {
            let (c, s) = (self.comms[i], d.stream.raw as Stream_);
            let (send, recv) = (sends[i] as *const c_void, recvs[i] as *mut c_void);
            // SAFETY: as above.
            let r = unsafe {
                match *call {
                    Call::AllReduce { .. } => (api.all_reduce)(send, recv, count, dt, red_op, c, s),
                    Call::Broadcast { root } => {
                        (api.broadcast)(send, recv, count, dt, root as c_int, c, s)
                    }
                    Call::Reduce { root, .. } => {
                        let recv = if self.ranks[i] == root {
                            recv
                        } else {
                            std::ptr::null_mut()
                        };
                        (api.reduce)(send, recv, count, dt, red_op, root as c_int, c, s)
                    }
                    Call::AllGather => (api.all_gather)(send, recv, count, dt, c, s),
                    Call::ReduceScatter { .. } => {
                        (api.reduce_scatter)(send, recv, count, dt, red_op, c, s)
                    }
                    // NCCL's own all-to-all, gather and scatter are grouped sends and receives
                    // (a rank's block to itself too), queued inside this group.
                    Call::AllToAll => {
                        let mut r = NCCL_SUCCESS;
                        for peer in 0..peers {
                            let k = peer as usize;
                            r = (api.send)(at(sends[i], k), count, dt, peer, c, s);
                            if fine(r) {
                                r = (api.recv)(at(recvs[i], k), count, dt, peer, c, s);
                            }
                            if !fine(r) {
                                break;
                            }
                        }
                        r
                    }
                    Call::Gather { root } => {
                        let mut r = (api.send)(send, count, dt, root as c_int, c, s);
                        if self.ranks[i] == root {
                            for peer in 0..peers {
                                if !fine(r) {
                                    break;
                                }
                                r = (api.recv)(at(recvs[i], peer as usize), count, dt, peer, c, s);
                            }
                        }
                        r
                    }
                    Call::Scatter { root } => {
                        let mut r = NCCL_SUCCESS;
                        if self.ranks[i] == root {
                            for peer in 0..peers {
                                r = (api.send)(at(sends[i], peer as usize), count, dt, peer, c, s);
                                if !fine(r) {
                                    break;
                                }
                            }
                        }
                        if fine(r) {
                            r = (api.recv)(recv, count, dt, root as c_int, c, s);
                        }
                        r
                    }
                    // The blocks' lengths agree between ranks (checked), so a block of zero
                    // elements is skipped on both sides.
                    Call::AllGatherV => {
                        let (so, ro) = (&send_blocks[i], &recv_blocks[i]);
                        let mine = so[self.ranks[i] + 1] - so[self.ranks[i]];
                        let mut r = NCCL_SUCCESS;
                        for peer in 0..peers {
                            if mine > 0 {
                                r = (api.send)(send, mine, dt, peer, c, s);
                            }
                            let (at, n) = block_of(recvs[i], ro, peer as usize);
                            if fine(r) && n > 0 {
                                r = (api.recv)(at, n, dt, peer, c, s);
                            }
                            if !fine(r) {
                                break;
                            }
                        }
                        r
                    }
                    Call::ReduceScatterV { .. } => {
                        let so = &send_blocks[i];
                        let mut r = NCCL_SUCCESS;
                        for root in 0..peers {
                            let (from, n) = block_of(sends[i], so, root as usize);
                            if n == 0 {
                                continue;
                            }
                            let to = if self.ranks[i] == root as usize {
                                recv
                            } else {
                                std::ptr::null_mut()
                            };
                            r = (api.reduce)(from, to, n, dt, red_op, root, c, s);
                            if !fine(r) {
                                break;
                            }
                        }
                        r
                    }
                    Call::AllToAllV => {
                        let (so, ro) = (&send_blocks[i], &recv_blocks[i]);
                        let mut r = NCCL_SUCCESS;
                        for peer in 0..peers {
                            let (from, n) = block_of(sends[i], so, peer as usize);
                            if n > 0 {
                                r = (api.send)(from, n, dt, peer, c, s);
                            }
                            let (to, m) = block_of(recvs[i], ro, peer as usize);
                            if fine(r) && m > 0 {
                                r = (api.recv)(to, m, dt, peer, c, s);
                            }
                            if !fine(r) {
                                break;
                            }
                        }
                        r
                    }
                }
            };
            if let Err(e) = api.check(r, Some(c), || format!("{what} on rank {}", self.ranks[i])) {
                first_err.get_or_insert(e);
            }
        }
        // SAFETY: closes the group opened above.
        let ended = unsafe { (api.group_end)() };
        if let Some(e) = first_err {
            return Err(e);
        }
        api.check(ended, None, || format!("{what}: ncclGroupEnd"))
    }

    /// Wait until the work queued on the devices' streams is done, watching for NCCL's
    /// asynchronous errors. `Ok(Err(ranks))`: the deadline passed while those global ranks were
    /// busy (the communicators are then aborted).
    pub fn wait(
        &self,
        devices: &[&DeviceInner],
        deadline: Instant,
        what: &str,
    ) -> Result<std::result::Result<(), Vec<usize>>> {
        let r = self.wait_for(|i| devices[i].stream.done(), deadline, what)?;
        if r.is_err() {
            self.abort();
        }
        Ok(r)
    }

    /// [`Comms::wait`] with what "done" means for local device `i` given by `done(i)` (its
    /// stream idle, or an event recorded after a call's work completed). Past the deadline
    /// the communicators are left as they are: the caller decides whether to abort.
    pub fn wait_for(
        &self,
        done: impl Fn(usize) -> Result<bool>,
        deadline: Instant,
        what: &str,
    ) -> Result<std::result::Result<(), Vec<usize>>> {
        let start = Instant::now();
        loop {
            let mut pending = Vec::new();
            if !self.in_progress(what)? {
                for (i, &rank) in self.ranks.iter().enumerate() {
                    if !done(i)? {
                        pending.push(rank);
                    }
                }
                if pending.is_empty() {
                    return Ok(Ok(()));
                }
            } else {
                pending = self.ranks.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Err(pending));
            }
            driver::pause(now - start);
        }
    }

    /// True while a communicator is still queueing work; an asynchronous error of any is
    /// returned (and the communicators aborted). Several threads may ask at once (the waits
    /// of calls issued on streams); an abort waits until no one asks.
    pub(crate) fn in_progress(&self, what: &str) -> Result<bool> {
        let api = self.api;
        let _gate = self.gate.read();
        if self.is_aborted() {
            return Err(Error::System {
                what: what.into(),
                message: "the group's NCCL communicators were aborted by an earlier failure; \
                          build a new group"
                    .into(),
            });
        }
        let mut busy = false;
        for (i, &c) in self.comms.iter().enumerate() {
            let mut state: c_int = NCCL_SUCCESS;
            // SAFETY: a live communicator (not aborted: the gate holds aborts off) and a valid
            // out-pointer.
            let r = unsafe { (api.comm_get_async_error)(c, &mut state) };
            api.check(r, Some(c), || format!("{what}: ncclCommGetAsyncError"))?;
            if state == NCCL_IN_PROGRESS {
                busy = true;
            } else if let Err(e) = api.check(state, Some(c), || {
                format!("{what} on rank {}", self.ranks[i])
            }) {
                drop(_gate);
                self.abort();
                return Err(e);
            }
        }
        Ok(busy)
    }

    /// Abort every communicator (once): NCCL's kernels stop and the communicators are freed.
    pub fn abort(&self) {
        let _gate = self.gate.write();
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        let _keep = driver::preserve_current();
        for (i, &c) in self.comms.iter().enumerate() {
            if c.is_null() {
                continue;
            }
            // SAFETY: a communicator created by ncclCommInitRankConfig, aborted once.
            let r = unsafe { (self.api.comm_abort)(c) };
            if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
                driver::log(&format!(
                    "ncclCommAbort (rank {}) failed: {}",
                    self.ranks[i],
                    self.api.message(r, None)
                ));
            }
        }
    }

    /// True once [`Comms::abort`] ran.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if self.is_aborted() {
            return;
        }
        // Finalize (flush) every communicator, bounded, then destroy; abort when that fails.
        let api = self.api;
        let _keep = driver::preserve_current();
        let mut ok = true;
        for &c in self.comms.iter().filter(|c| !c.is_null()) {
            // SAFETY: a live communicator.
            let r = unsafe { (api.comm_finalize)(c) };
            if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
                driver::log(&format!(
                    "ncclCommFinalize failed: {}",
                    api.message(r, Some(c))
                ));
                ok = false;
            }
        }
        if ok {
            if let Err(e) = self.settle(Instant::now() + Duration::from_secs(30), "finalize") {
                driver::log(&format!("closing NCCL communicators: {e}"));
                self.abort();
                return;
            }
            for &c in self.comms.iter().filter(|c| !c.is_null()) {
                // SAFETY: a finalized communicator, destroyed once.
                let r = unsafe { (api.comm_destroy)(c) };
                if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
                    driver::log(&format!("ncclCommDestroy failed: {}", api.message(r, None)));
                }
            }
        } else {
            self.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode() {
        assert_eq!(decode_version(22105), (2, 21, 5));
        assert_eq!(decode_version(2804), (2, 8, 4));
        assert!(decode_version(21403) >= MIN_VERSION);
        assert!(decode_version(21305) < MIN_VERSION);
    }

    #[test]
    fn one_rank_mean_is_a_sum() {
        assert_eq!(one_rank_op(1, ReduceOp::Mean), ReduceOp::Sum);
        assert_eq!(one_rank_op(2, ReduceOp::Mean), ReduceOp::Mean);
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            assert_eq!(one_rank_op(1, op), op);
        }
    }

    #[test]
    fn codes_match_nccl() {
        assert_eq!(nccl_dtype(DType::F32), 7);
        assert_eq!(nccl_dtype(DType::BF16), 9);
        assert_eq!(nccl_dtype(DType::U64), 5);
        assert_eq!(nccl_op(ReduceOp::Max), Some(2));
        assert_eq!(nccl_op(ReduceOp::Min), Some(3));
        assert_eq!(nccl_op(ReduceOp::Mean), Some(4));
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            assert_eq!(nccl_op(op), None, "{op}");
        }
        assert_eq!(std::mem::size_of::<Config>(), 48);
    }
}
