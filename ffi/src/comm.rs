//! `tutti_comm`: one rank's handle on a group, and the collectives.

use std::ffi::{c_char, CStr};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use std::collections::HashMap;

use tutti::{AbortHandle, ClusterSpec, Communicator, DeviceKind, SharedBuffer, TransportKind};

use crate::config::{self, tutti_config, Settings};
use crate::error::{boundary, boundary_void, tutti_result, Failure};
use crate::handle::{self, Entered, Handle, Kind, Live};
use crate::types::{self, tutti_algorithm};

/// One rank's handle on a group of ranks (opaque). Created by `tutti_comm_create_group`,
/// released by `tutti_comm_destroy`.
pub struct tutti_comm {
    /// Collectives hold it shared; `tutti_comm_set_algorithm` takes it exclusively.
    comm: RwLock<Communicator>,
    /// Aborts the group without touching the lock, from any thread.
    abort: AbortHandle,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// The kind of device the buffers live on.
    pub(crate) device: DeviceKind,
    /// The shared buffers handed out by `tutti_mem_alloc`, until `tutti_mem_free`.
    shared: Mutex<Vec<SharedBuffer>>,
    /// The bound on every wait (the destroy's wait for calls inside too).
    timeout: std::time::Duration,
    /// The calls inside this handle, which `tutti_comm_destroy` waits for.
    live: Live,
    /// Unique in the process: tells this handle from a later one at the same address (a group
    /// records its communicators by address until `tutti_group_end`).
    pub(crate) serial: u64,
}

impl Handle for tutti_comm {
    const KIND: Kind = Kind::Comm;
    fn live(&self) -> &Live {
        &self.live
    }
}

impl tutti_comm {
    pub(crate) fn into_raw(comm: Communicator) -> *mut tutti_comm {
        handle::into_raw(tutti_comm {
            abort: comm.abort_handle(),
            rank: comm.rank(),
            world: comm.world_size(),
            device: comm.device_kind(),
            timeout: comm.timeout(),
            comm: RwLock::new(comm),
            shared: Mutex::new(Vec::new()),
            live: Live::new(),
            serial: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
        })
    }

    /// The communicator to change a setting of (`what`), while no collective runs on it.
    fn between_calls(&self, what: &str) -> Result<RwLockWriteGuard<'_, Communicator>, Failure> {
        match self.comm.try_write() {
            Ok(g) => Ok(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Ok(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => Err(Failure::invalid(format!(
                "rank {}: a collective is running on this communicator; change the {what} \
                 between collectives",
                self.rank
            ))),
        }
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Communicator> {
        self.comm.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Arguments this rank rejected before it could take part in a collective: the group is
    /// aborted so that the other ranks' calls fail at once instead of waiting for this one.
    pub(crate) fn reject(&self, function: &str, message: String) -> Failure {
        self.abort.abort(&format!(
            "rank {} rejected its arguments to {function}: {message}",
            self.rank
        ));
        Failure::invalid(format!(
            "rank {}: {message} (the group is aborted so that the other ranks do not wait for \
             this call; create a new group)",
            self.rank
        ))
    }
}

/// The communicator behind a C handle, entered for one call (`tutti_comm_destroy` waits until
/// it is dropped), or an error when it is NULL or being destroyed.
///
/// # Safety
///
/// `comm` is NULL or a handle from `tutti_comm_create_*` whose destroy has not returned (one that
/// is being destroyed, or was, is refused without being read).
pub(crate) unsafe fn comm_ref<'a>(
    comm: *const tutti_comm,
) -> Result<Entered<'a, tutti_comm>, Failure> {
    // SAFETY: as the caller promises.
    unsafe { handle::enter(comm) }
}

pub(crate) fn out_ptr<T>(p: *mut T, name: &str) -> Result<*mut T, Failure> {
    if p.is_null() {
        Err(Failure::invalid(format!("{name} is NULL")))
    } else {
        Ok(p)
    }
}

/// Create an in-process group of `world_size` ranks and write its communicators, rank 0 first,
/// to `comms[0]` … `comms[world_size - 1]`. Hand each to the thread that runs that rank. Each is
/// released with `tutti_comm_destroy`. `config` may be NULL for every default.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `config` is NULL or points to a `tutti_config` of `config->struct_size` bytes; `comms` points
/// to room for `world_size` handles.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_create_group(
    world_size: usize,
    config: *const tutti_config,
    comms: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_create_group", || {
        // SAFETY: as the caller promises.
        let settings = unsafe { config::read(config) }?;
        config::in_process(&settings)?;
        // Room for zero handles may be NULL: the core then says what is wrong with the size.
        if world_size > 0 {
            out_ptr(comms, "comms")?;
        }
        let group = tutti::local_group(world_size, &settings.core)?;
        let handles: Vec<*mut tutti_comm> = group.into_iter().map(tutti_comm::into_raw).collect();
        if !handles.is_empty() {
            // SAFETY: the caller gave room for world_size handles, and checked non-NULL.
            unsafe { std::ptr::copy_nonoverlapping(handles.as_ptr(), comms, handles.len()) };
        }
        Ok(())
    })
}

/// Create a group whose ranks are devices of this process, rank r on `devices[r]`, and write
/// its communicators, rank 0 first, to `comms[0]` … `comms[n - 1]`, as
/// `tutti_comm_create_group` does. Device specs: `"cpu:N"` (host memory, the host algorithms),
/// `"xla:N"` (a build with XLA: PJRT programs over the devices of the plugin
/// `TUTTI_PJRT_PLUGIN` names, with `TUTTI_PJRT_OPTIONS`; ranks `"xla:0"` … `"xla:n-1"` in order;
/// buffers are host memory, staged to the devices), `"cuda:N"` (a build with CUDA: NCCL or the
/// CUDA copy algorithms; buffers are CUDA device pointers on that GPU). Every collective and
/// its `_async` form takes the rank's device memory; calls are checked and ordered alike on
/// every device. All ranks must be on one kind of device. `config` may be NULL for every
/// default. Errors: `TUTTI_ERROR_INVALID_ARGUMENT` naming the spec that is wrong,
/// `TUTTI_ERROR_UNAVAILABLE` when this build or machine lacks the device kind.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `devices` points to `n` NUL-terminated strings (or is NULL with `n` 0); `config` is NULL or
/// points to a `tutti_config` of `config->struct_size` bytes; `comms` points to room for `n`
/// handles.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_create_devices(
    n: usize,
    devices: *const *const c_char,
    config: *const tutti_config,
    comms: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_create_devices", || {
        // SAFETY: as the caller promises.
        let settings = unsafe { config::read(config) }?;
        config::in_process(&settings)?;
        let mut specs = Vec::new();
        if n > 0 {
            out_ptr(comms, "comms")?;
            if devices.is_null() {
                return Err(Failure::invalid(format!("devices is NULL but n is {n}")));
            }
            // An upper bound on what a caller can mean, before anything is sized by n.
            if n > tutti::MAX_LOCAL_RANKS {
                return Err(Failure::invalid(format!(
                    "n = {n} devices is more than one process can hold ({})",
                    tutti::MAX_LOCAL_RANKS
                )));
            }
            for r in 0..n {
                // SAFETY: the caller promises n entries.
                let p = unsafe { *devices.add(r) };
                if p.is_null() {
                    return Err(Failure::invalid(format!("devices[{r}] is NULL")));
                }
                // SAFETY: the caller promises a NUL-terminated string.
                let spec = unsafe { CStr::from_ptr(p) }
                    .to_str()
                    .map_err(|_| Failure::invalid(format!("devices[{r}] is not UTF-8")))?;
                specs.push(spec.to_string());
            }
        }
        let group = tutti::device_group(&specs, &settings.core)?;
        let handles: Vec<*mut tutti_comm> = group.into_iter().map(tutti_comm::into_raw).collect();
        if !handles.is_empty() {
            // SAFETY: the caller gave room for n handles, and checked non-NULL.
            unsafe { std::ptr::copy_nonoverlapping(handles.as_ptr(), comms, handles.len()) };
        }
        Ok(())
    })
}

/// The transport a multi-process communicator uses: the config's, else `TUTTI_TRANSPORT`, else
/// `auto`.
pub(crate) fn transport_for(settings: &Settings) -> Result<TransportKind, Failure> {
    if let Some(t) = settings.transport {
        return Ok(t);
    }
    match std::env::var("TUTTI_TRANSPORT") {
        Ok(v) => v
            .parse::<TransportKind>()
            .map_err(|e| Failure::invalid(format!("TUTTI_TRANSPORT: {e}"))),
        Err(_) => Ok(TransportKind::Auto),
    }
}

/// Join the multi-process job that this process's environment describes, as this process's
/// rank, and write the communicator to `*comm`: under `tutti launch`, torchrun, mpirun or srun,
/// or with `TF_CONFIG`, or `TUTTI_RANK`, `TUTTI_WORLD_SIZE` and `TUTTI_MASTER_ADDR` (`host:port`
/// of rank 0's rendezvous) set; `TUTTI_JOB_TOKEN` is the secret every connection proves.
/// `TUTTI_DEVICE` places the rank: `cpu` (the default: host memory), or `cuda` (this process's
/// local rank's GPU) / `cuda:N` in a build with CUDA (one NCCL rank per process; buffers are
/// device memory). Blocks until every rank has joined or the timeout runs out. `config` may be
/// NULL for every default. Released with `tutti_comm_destroy`.
///
/// Errors: `TUTTI_ERROR_INVALID_ARGUMENT` naming what to set when the environment describes no
/// job, or naming `TUTTI_DEVICE` when it is no device a process joins as;
/// `TUTTI_ERROR_UNAVAILABLE` when this build or machine lacks that device.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `config` is NULL or points to a `tutti_config` of `config->struct_size` bytes; `comm` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_create_from_env(
    config: *const tutti_config,
    comm: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_create_from_env", || {
        // SAFETY: as the caller promises.
        let settings = unsafe { config::read(config) }?;
        let out = out_ptr(comm, "comm")?;
        let kind = transport_for(&settings)?;
        let c = if kind.is_mpi_here() {
            Communicator::from_env_over(kind, &settings.core)?
        } else {
            let spec = ClusterSpec::from_env()?.ok_or_else(|| {
                Failure::invalid(
                    "no cluster in the environment: run under tutti launch, torchrun, mpirun or \
                     srun, or set TF_CONFIG, or TUTTI_RANK, TUTTI_WORLD_SIZE and \
                     TUTTI_MASTER_ADDR (or call tutti_comm_create_rank)",
                )
            })?;
            Communicator::from_cluster_on_env_device(&spec, kind, &settings.core)?
        };
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(tutti_comm::into_raw(c)) };
        Ok(())
    })
}

/// Join a multi-process job as rank `rank` of `world_size`, meeting the others at
/// `master_addr` (`host:port`; rank 0 serves the rendezvous there), and write the communicator
/// to `*comm`. `TUTTI_JOB_TOKEN`, when set, is the secret every connection proves. Blocks until
/// every rank has joined or the timeout runs out. `config` may be NULL for every default.
/// Released with `tutti_comm_destroy`.
///
/// Thread-safety: callable from any thread.
///
/// # Safety
///
/// `master_addr` is NULL or a NUL-terminated string; `config` is NULL or points to a
/// `tutti_config` of `config->struct_size` bytes; `comm` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_create_rank(
    rank: usize,
    world_size: usize,
    master_addr: *const c_char,
    config: *const tutti_config,
    comm: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_create_rank", || {
        // SAFETY: as the caller promises.
        let settings = unsafe { config::read(config) }?;
        if master_addr.is_null() {
            return Err(Failure::invalid("master_addr is NULL"));
        }
        // SAFETY: the caller promises a NUL-terminated string.
        let addr = unsafe { CStr::from_ptr(master_addr) }
            .to_str()
            .map_err(|_| Failure::invalid("master_addr is not UTF-8"))?;
        let out = out_ptr(comm, "comm")?;
        // Named as the arguments they are (the checks of the environment's spec below would
        // name TUTTI_RANK and TUTTI_WORLD_SIZE).
        if world_size == 0 {
            return Err(Failure::invalid(
                "world_size is 0: a job has at least one rank",
            ));
        }
        if world_size > tutti::MAX_WORLD_SIZE {
            return Err(Failure::invalid(format!(
                "world_size {world_size} is more ranks than tutti supports ({})",
                tutti::MAX_WORLD_SIZE
            )));
        }
        if rank >= world_size {
            return Err(Failure::invalid(format!(
                "rank {rank} is out of range for world_size {world_size}"
            )));
        }
        let (_, port) = tutti::split_addr(addr, "master_addr")?;
        if port == 0 {
            return Err(Failure::invalid(format!(
                "master_addr '{addr}' has port 0; rank 0 serves the rendezvous at a fixed port \
                 that every rank names"
            )));
        }
        let kind = transport_for(&settings)?;
        // The job's secret (or where this user's lives, or the opt-out) comes from the
        // environment as for every other way of joining.
        let from_env = [
            "TUTTI_JOB_TOKEN",
            "TUTTI_LISTEN_HOST",
            "TUTTI_INSECURE",
            "HOME",
            "XDG_RUNTIME_DIR",
        ];
        let mut vars: HashMap<String, String> = from_env
            .into_iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect();
        vars.insert("TUTTI_RANK".into(), rank.to_string());
        vars.insert("TUTTI_WORLD_SIZE".into(), world_size.to_string());
        vars.insert("TUTTI_MASTER_ADDR".into(), addr.to_string());
        let spec = ClusterSpec::from_vars(&vars)?
            .ok_or_else(|| Failure::invalid("the cluster spec could not be built"))?;
        let c = Communicator::from_cluster(&spec, kind, &settings.core)?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(tutti_comm::into_raw(c)) };
        Ok(())
    })
}

/// Allocate `bytes` bytes of shared memory for this communicator's collectives and write its
/// address to `*ptr`: zeroed, 64-byte aligned, mapped by every process of the group (all on
/// this host, on shared memory). A collective of 64 KiB or more per rank whose buffers lie in
/// such memory on every rank (the inputs in memory from one `tutti_mem_alloc` call, the outputs
/// from one), with the algorithm `AUTO` or `DIRECT`, runs without a copy through shared-memory
/// slots: each rank reduces its slice from every peer's input and writes it into every peer's
/// output (a reduce, whose ranks off the root have no output, excepted). Collective: every rank
/// calls it, in the same order as its other calls, with the same size, one allocation at a
/// time. In a group of threads it is plain memory.
///
/// Errors: `TUTTI_ERROR_INVALID_ARGUMENT` when some peer is not on shared memory of this host,
/// a rank asked for another size, the communicator's ranks are devices, or an argument is NULL;
/// `TUTTI_ERROR_SYSTEM` when a segment could not be created or mapped (the message says which
/// rank and why); the errors of a collective, which it is.
///
/// Thread-safety: callable from any thread; it is a collective of its own (not alongside
/// another `tutti_mem_alloc` on the same communicator).
///
/// # Safety
///
/// `comm` is NULL or a live handle; `ptr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_mem_alloc(
    comm: *mut tutti_comm,
    bytes: usize,
    ptr: *mut *mut std::ffi::c_void,
) -> tutti_result {
    boundary("tutti_mem_alloc", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm)? };
        let out = out_ptr(ptr, "ptr")?;
        let mut buf = c.read().alloc_shared(bytes)?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(buf.as_mut_ptr().cast()) };
        c.shared.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
        Ok(())
    })
}

/// Release memory from `tutti_mem_alloc` on this rank (not a collective: the peers' memory of
/// the same call stays theirs, and collectives on it go through the shared-memory slots).
/// NULL is accepted and ignored. `tutti_comm_destroy` releases what is left.
///
/// The memory is unmapped once every call this rank issued before the free has completed: a
/// non-blocking call still queued or running on it goes on reading and writing mapped memory
/// (the caller must not use the pointer after this returns; the calls issued before may).
///
/// Errors: `TUTTI_ERROR_INVALID_ARGUMENT` when `ptr` is not memory of this communicator's
/// `tutti_mem_alloc` (freed already, say).
///
/// Thread-safety: callable from any thread, while calls issued before run.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `ptr` is NULL or from `tutti_mem_alloc` on `comm`.
#[no_mangle]
pub unsafe extern "C" fn tutti_mem_free(
    comm: *mut tutti_comm,
    ptr: *mut std::ffi::c_void,
) -> tutti_result {
    boundary("tutti_mem_free", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm)? };
        if ptr.is_null() {
            return Ok(());
        }
        let mut bufs = c.shared.lock().unwrap_or_else(|e| e.into_inner());
        let i = bufs
            .iter_mut()
            .position(|b| b.as_mut_ptr().cast() == ptr)
            .ok_or_else(|| {
                Failure::invalid(format!(
                    "rank {}: {ptr:?} is not memory from tutti_mem_alloc on this communicator \
                     (or was freed already)",
                    c.rank
                ))
            })?;
        let buf = bufs.swap_remove(i);
        drop(bufs);
        // Calls issued by address before this may still use it: unmapped after them.
        c.read().drop_after_issued(buf);
        Ok(())
    })
}

/// Release a communicator. NULL is accepted and ignored. Other ranks' calls that wait for this
/// one fail when their timeout runs out; abort the group first (`tutti_comm_abort`) to make
/// them fail at once.
///
/// Calls on other threads that are inside `comm` when this is called are waited for, up to the
/// communicator's timeout; past it the group is aborted, which ends them at once. Calls made
/// on `comm` from then on, until this returns, fail with `TUTTI_ERROR_INVALID_ARGUMENT`. A
/// second destroy of the same handle (or two threads destroying it at once) does nothing but
/// record, as the thread's last error, that it was not a live handle. Should calls inside
/// never leave, the handle is left allocated (not freed under them) and the last error says
/// so. The last error is empty when the handle was released. Non-blocking calls issued before
/// are completed (each bounded by the timeout) before it returns.
///
/// Thread-safety: callable from any thread, while other threads use `comm` (a watchdog's
/// `tutti_comm_abort` then `tutti_comm_destroy`, say); no call may use `comm` after this has
/// returned: a call that races the end of the destroy fails with `TUTTI_ERROR_INVALID_ARGUMENT`
/// (the handle is looked up among the live ones, never read once destroyed), but as with `free()`,
/// the address may be reused by a new handle, which such a call would then use.
///
/// # Safety
///
/// `comm` is NULL or a handle from `tutti_comm_create_*` (destroyed already or not).
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_destroy(comm: *mut tutti_comm) {
    boundary_void("tutti_comm_destroy", || {
        if comm.is_null() {
            return; // a no-op that leaves the last error alone
        }
        // SAFETY: as the caller promises; a handle not registered as live is not touched.
        let r = unsafe {
            handle::destroy(
                comm,
                |c| c.timeout,
                |c, n| {
                    c.abort.abort(&format!(
                        "tutti_comm_destroy on rank {}: {n} call(s) on other threads were still \
                         inside the communicator after its timeout ({:?})",
                        c.rank, c.timeout
                    ))
                },
                |_| {},
            )
        };
        handle::report("tutti_comm_destroy", r);
    })
}

/// Split `comm` as `MPI_Comm_split` does: the ranks that pass the same `color` (0 or more)
/// form a new communicator, ranked by `key`, then by their rank in `comm`; `*newcomm` is set to
/// it. A rank that passes a negative `color` takes part but gets no communicator (`*newcomm`
/// is set to NULL). Collective: every rank of `comm` calls it, in the same order as its
/// collectives, and it is checked and bounded by the timeout as they are. The new communicator
/// has `comm`'s settings and connections of its own: its calls never disturb another group's
/// or `comm`'s. Destroy it with `tutti_comm_destroy`, before or after `comm`. A group of one
/// process's XLA devices splits into groups over their members' devices.
///
/// Errors: `TUTTI_ERROR_INVALID_ARGUMENT` (NULL `newcomm`, a color past 2^32 - 1),
/// `TUTTI_ERROR_MISMATCH` when the ranks' calls differ, `TUTTI_ERROR_UNAVAILABLE` for GPU
/// ranks, and the errors of a collective or of joining (a timeout naming the rank).
///
/// Thread-safety: as a collective.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `newcomm` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_split(
    comm: *mut tutti_comm,
    color: i64,
    key: i64,
    newcomm: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_split", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let checked = (|| -> Result<_, Failure> {
            let out = out_ptr(newcomm, "newcomm")?;
            let color = match color {
                c if c < 0 => None,
                c => Some(u32::try_from(c).map_err(|_| {
                    Failure::invalid(format!(
                        "color {c} is more than 2^32 - 1 (a negative color: no communicator)"
                    ))
                })?),
            };
            Ok((out, color))
        })();
        let (out, color) = checked.map_err(|f| c.reject("tutti_comm_split", f.message))?;
        let split = c.read().split(color, key)?;
        let handle = split.map_or(std::ptr::null_mut(), tutti_comm::into_raw);
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(handle) };
        Ok(())
    })
}

/// After a rank was lost (a call failed with `TUTTI_ERROR_PEER_LOST`, or `TUTTI_ERROR_ABORTED`
/// or `TUTTI_ERROR_TIMEOUT` because of one), make a new communicator of the ranks of `comm`
/// that are still alive, renumbered in `comm`'s rank order, and set `*newcomm` to it; the
/// processes go on without restarting. Every surviving rank calls it. `comm` is aborted first
/// (so that every survivor's calls fail and it shrinks too); the survivors then find each other
/// on the ports they listened on when they joined and agree on who they are within `comm`'s
/// timeout. A rank that is alive but does not call it in time is left out, and its own later
/// call fails rather than go on alone. The new communicator has `comm`'s settings; destroy it
/// with `tutti_comm_destroy`, and `comm` too.
///
/// The state of the training is the survivors' to restore: broadcast it (weights, optimizer
/// state, step) from the new rank 0 and repeat the step that failed.
///
/// With no rank lost it re-forms the group: after a rank's rejection of its own arguments or a
/// mismatch aborted `comm` (between processes under the default check), every rank calls it
/// and gets a communicator of all of them, in the same rank order.
///
/// Errors (`*newcomm` is then NULL): `TUTTI_ERROR_INVALID_ARGUMENT` (NULL `newcomm`; survivors
/// that found different sets of live ranks, each named; a rank too late for the others, or too
/// few answering to outnumber the silent ones), `TUTTI_ERROR_UNAVAILABLE` for groups of threads,
/// device groups, GPU ranks and the MPI transport, `TUTTI_ERROR_TIMEOUT` when a survivor stops
/// answering during the agreement, `TUTTI_ERROR_SYSTEM` when a connection fails during the
/// shrink.
///
/// Thread-safety: callable from any thread; the calls still running on `comm` fail.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `newcomm` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_shrink(
    comm: *mut tutti_comm,
    newcomm: *mut *mut tutti_comm,
) -> tutti_result {
    boundary("tutti_comm_shrink", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let out = out_ptr(newcomm, "newcomm")?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(std::ptr::null_mut()) };
        let shrunk = c.read().shrink()?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(tutti_comm::into_raw(shrunk)) };
        Ok(())
    })
}

/// Write where this rank's buffers live: the kind of device to `*kind` (`TUTTI_DEVICE_CPU` for
/// host memory, `TUTTI_DEVICE_GPU`, `TUTTI_DEVICE_XLA`) and its index among this process's
/// devices of that kind to `*index` (the `N` of `cuda:N`, whether `TUTTI_DEVICE` or
/// `tutti_comm_create_devices` placed it; 0 for host ranks of processes).
///
/// Thread-safety: callable from any thread, during a collective too.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `kind` and `index` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_device(
    comm: *const tutti_comm,
    kind: *mut types::tutti_device_kind,
    index: *mut usize,
) -> tutti_result {
    boundary("tutti_comm_device", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let kind = out_ptr(kind, "kind")?;
        let index = out_ptr(index, "index")?;
        let (k, i) = {
            let comm = c.read();
            (comm.device_kind(), comm.device_index())
        };
        // SAFETY: checked non-NULL; the caller promises they are writable.
        unsafe {
            kind.write(types::device_kind_to_c(k));
            index.write(i);
        }
        Ok(())
    })
}

/// Write this communicator's rank (in `0 .. world_size - 1`) to `*rank`.
///
/// Thread-safety: callable from any thread, during a collective too.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `rank` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_rank(
    comm: *const tutti_comm,
    rank: *mut usize,
) -> tutti_result {
    boundary("tutti_comm_rank", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let rank = out_ptr(rank, "rank")?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { rank.write(c.rank) };
        Ok(())
    })
}

/// Write the number of ranks in the group to `*world_size`.
///
/// Thread-safety: callable from any thread, during a collective too.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `world_size` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_world_size(
    comm: *const tutti_comm,
    world_size: *mut usize,
) -> tutti_result {
    boundary("tutti_comm_world_size", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let out = out_ptr(world_size, "world_size")?;
        let n = c.world;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(n) };
        Ok(())
    })
}

/// Write the bound on every wait, in milliseconds, to `*timeout_ms`.
///
/// Thread-safety: callable from any thread, during a collective too.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `timeout_ms` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_timeout_ms(
    comm: *const tutti_comm,
    timeout_ms: *mut u64,
) -> tutti_result {
    boundary("tutti_comm_timeout_ms", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let out = out_ptr(timeout_ms, "timeout_ms")?;
        let ms = u64::try_from(c.read().timeout().as_millis()).unwrap_or(u64::MAX);
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(ms) };
        Ok(())
    })
}

/// Write the communicator's algorithm and its argument (group size or root; 0 for the others)
/// to `*algorithm` and `*arg`.
///
/// Thread-safety: callable from any thread, during a collective too.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `algorithm` and `arg` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_algorithm(
    comm: *const tutti_comm,
    algorithm: *mut tutti_algorithm,
    arg: *mut u32,
) -> tutti_result {
    boundary("tutti_comm_algorithm", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let algorithm = out_ptr(algorithm, "algorithm")?;
        let arg = out_ptr(arg, "arg")?;
        let (a, n) = types::algorithm_to_c(c.read().algorithm())?;
        // SAFETY: checked non-NULL; the caller promises they are writable.
        unsafe {
            algorithm.write(a);
            arg.write(n);
        }
        Ok(())
    })
}

/// Choose the algorithm of this communicator's later collectives; `arg` is the group size of
/// `TUTTI_ALGORITHM_HIERARCHICAL_COPY` (0: 2) or the root of `TUTTI_ALGORITHM_REDUCE_TO_ONE`,
/// and 0 for the others. Every rank must make the same choice before its next collective: a
/// collective whose algorithm differs between ranks fails with `TUTTI_ERROR_MISMATCH`.
///
/// Thread-safety: callable from any thread; fails with `TUTTI_ERROR_INVALID_ARGUMENT` while a
/// collective runs on this communicator.
///
/// # Safety
///
/// `comm` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_set_algorithm(
    comm: *mut tutti_comm,
    algorithm: tutti_algorithm,
    arg: u32,
) -> tutti_result {
    boundary("tutti_comm_set_algorithm", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let a = types::algorithm(algorithm, arg)?;
        c.between_calls("algorithm")?.set_algorithm(a)?;
        Ok(())
    })
}

/// Order this communicator's later collectives on a CUDA stream (`cudaStream_t` or `CUstream`,
/// of the rank's GPU in its primary context as the CUDA runtime's streams are; NULL: the legacy
/// default stream), for `"cuda:N"` ranks, as NCCL does. A collective issued while a stream is
/// set waits, on the GPU and not on the host, for the work queued on the stream before it was
/// issued, and the work queued on the stream after it waits for the collective's GPU work. The
/// collective meets its peers when it is issued (each rank of an in-process group issues from
/// its own thread) and returns once its GPU work is queued: the `_async` call's work handle
/// completes when that work is done, and the blocking call returns then.
/// `tutti_comm_unset_cuda_stream` goes back to no stream (the default: the caller makes sure
/// the buffers are ready). Errors: `TUTTI_ERROR_INVALID_ARGUMENT` on a rank that is not a CUDA GPU.
///
/// Thread-safety: as `tutti_comm_set_algorithm`.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `stream` is a live stream of the rank's GPU (or NULL) until
/// it is replaced, unset, or the communicator destroyed.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_set_cuda_stream(
    comm: *mut tutti_comm,
    stream: *mut std::ffi::c_void,
) -> tutti_result {
    boundary("tutti_comm_set_cuda_stream", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let mut inner = c.between_calls("CUDA stream")?;
        // SAFETY: as the caller promises.
        unsafe { inner.set_cuda_stream(Some(stream as u64))? };
        Ok(())
    })
}

/// Stop ordering this communicator's collectives after a CUDA stream
/// (`tutti_comm_set_cuda_stream`).
///
/// Thread-safety: as `tutti_comm_set_algorithm`.
///
/// # Safety
///
/// `comm` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_unset_cuda_stream(comm: *mut tutti_comm) -> tutti_result {
    boundary("tutti_comm_unset_cuda_stream", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        // SAFETY: no stream is set, so none needs to live.
        unsafe { c.between_calls("CUDA stream")?.set_cuda_stream(None)? };
        Ok(())
    })
}

/// Abort the group: every blocked and later collective of every rank fails at once with
/// `TUTTI_ERROR_ABORTED`, carrying `reason` (NULL: a default reason). Use it to wake ranks
/// blocked in a collective when one rank gives up. The communicators stay valid for
/// `tutti_comm_destroy`; create a new group to go on.
///
/// Thread-safety: callable from any thread at any time, including while another thread is
/// blocked in a collective on this same communicator.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `reason` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_abort(
    comm: *const tutti_comm,
    reason: *const c_char,
) -> tutti_result {
    boundary("tutti_comm_abort", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let reason = if reason.is_null() {
            format!("tutti_comm_abort was called on rank {}", c.rank)
        } else {
            // SAFETY: the caller promises a NUL-terminated string.
            let r = unsafe { CStr::from_ptr(reason) }.to_string_lossy();
            format!("tutti_comm_abort was called on rank {}: {r}", c.rank)
        };
        c.abort.abort(&reason);
        Ok(())
    })
}

/// Write whether the group has been aborted (by `tutti_comm_abort`, a timeout or a failed
/// peer) to `*aborted`.
///
/// Thread-safety: callable from any thread at any time.
///
/// # Safety
///
/// `comm` is NULL or a live handle; `aborted` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tutti_comm_is_aborted(
    comm: *const tutti_comm,
    aborted: *mut bool,
) -> tutti_result {
    boundary("tutti_comm_is_aborted", || {
        // SAFETY: as the caller promises.
        let c = unsafe { comm_ref(comm) }?;
        let out = out_ptr(aborted, "aborted")?;
        let a = c.read().aborted().is_some();
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { out.write(a) };
        Ok(())
    })
}
