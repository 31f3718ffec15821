//! Groups of ranks that are threads of one process: on logical CPUs (`local_group`), or on
//! devices of this process (`device_group`: `cpu:N`, `xla:N`, `cuda:N`).

use std::sync::Arc;

use super::{Communicator, Config};
use crate::device::{parse_spec, DeviceKind};
use crate::engine::GroupEngine;
use crate::error::{Error, Result};
use crate::transport::local::LocalTransport;

/// The most ranks an in-process group may have: each is a thread, and the group's mailboxes
/// grow with the square of its size (1024 ranks take 128 MiB).
pub const MAX_LOCAL_RANKS: usize = 1024;

fn check_local(world: usize) -> Result<()> {
    if world > MAX_LOCAL_RANKS {
        return Err(Error::config(format!(
            "{world} ranks in one process is more than an in-process group may have \
             ({MAX_LOCAL_RANKS}); use one process per rank (tutti launch) for larger jobs"
        )));
    }
    Ok(())
}

/// The communicators of a new in-process group of `world` ranks, one per thread that will use
/// it (rank r is element r).
pub fn local_group(world: usize, config: &Config) -> Result<Vec<Communicator>> {
    config.check(world)?;
    check_local(world)?;
    Ok(LocalTransport::group(world, config.timeout)
        .into_iter()
        .map(|t| Communicator::new(Arc::new(t), config))
        .collect())
}

/// The communicators of a group whose ranks are devices of this process, rank r on
/// `devices[r]` (`"cpu:0"`, `"xla:2"`, `"cuda:1"`; `"gpu:N"` and TensorFlow's
/// `/device:GPU:N` too), one per thread that will use it, as `ncclCommInitAll` makes them.
/// Every rank is checked and ordered by one communicator whatever the device; what runs a
/// call differs:
///
/// - `cpu:N`: the host algorithms, as [`local_group`];
/// - `xla:N` (feature `xla`): one PJRT program over the devices of the client that
///   `TUTTI_PJRT_PLUGIN` / `TUTTI_PJRT_OPTIONS` give (the CPU plugin gets as many devices as
///   the highest index needs); buffers are host memory, staged to the devices, or the ranks'
///   tensors on them. Any of the client's devices, in any order;
/// - `cuda:N` (feature `cuda`): NCCL or the CUDA copy algorithms (`Config::algorithm`: `auto`,
///   `hierarchical-copy[:G]`, `reduce-to-one[:ROOT]`) over device memory, passed by address
///   ([`Communicator::run_raw`]).
///
/// All ranks must be of one kind; a device listed twice, an unknown kind, or a kind this build
/// or machine lacks is an error that says which.
///
/// ```
/// let comms = tutti::device_group(&["cpu:0", "cpu:1"], &tutti::Config::default()).unwrap();
/// assert_eq!(comms[1].device_spec(), "cpu:1");
/// ```
pub fn device_group<S: AsRef<str>>(devices: &[S], config: &Config) -> Result<Vec<Communicator>> {
    config.check(devices.len())?;
    check_local(devices.len())?;
    let specs: Vec<(DeviceKind, usize)> = devices
        .iter()
        .map(|d| parse_spec(d.as_ref()))
        .collect::<Result<_>>()?;
    let kind = specs[0].0;
    for (r, (k, i)) in specs.iter().enumerate() {
        if *k != kind {
            return Err(Error::config(format!(
                "device {r} ('{}') is {k} but device 0 ('{}') is {kind}; the ranks of a group \
                 are all on one kind of device",
                devices[r].as_ref(),
                devices[0].as_ref()
            )));
        }
        if let Some(q) = specs[..r].iter().position(|s| s == &(*k, *i)) {
            return Err(Error::config(format!(
                "device {r} ('{}') is listed twice (also device {q}); give each rank its own \
                 device",
                devices[r].as_ref()
            )));
        }
    }
    let indices: Vec<usize> = specs.iter().map(|s| s.1).collect();
    let engine: Option<Arc<dyn GroupEngine>> = match kind {
        DeviceKind::Cpu => None,
        DeviceKind::Xla => Some(xla_engine(&indices, config)?),
        DeviceKind::Gpu => Some(cuda_engine(&indices, config)?),
    };
    Ok(engine_group(&specs, config, engine))
}

/// The communicators of an in-process group whose rank r is on `devices[r]`, its calls run by
/// `engine` (the host algorithms when `None`). Sizes and the config are checked by the caller.
pub(crate) fn engine_group(
    devices: &[(DeviceKind, usize)],
    config: &Config,
    engine: Option<Arc<dyn GroupEngine>>,
) -> Vec<Communicator> {
    LocalTransport::group(devices.len(), config.timeout)
        .into_iter()
        .zip(devices)
        .map(|(t, &device)| Communicator::with_engine(Arc::new(t), config, engine.clone(), device))
        .collect()
}

/// The engine of an in-process group on the XLA devices `xla:{indices}` of the plugin's
/// client (rank r on `indices[r]`; the CPU plugin gets as many devices as the highest index
/// needs, unless `TUTTI_PJRT_OPTIONS` says).
#[cfg(feature = "xla")]
pub(crate) fn xla_engine(indices: &[usize], config: &Config) -> Result<Arc<dyn GroupEngine>> {
    use crate::xla::{Client, ClientOptions, OptionValue, PluginKind};
    // Before any client starts: the CPU plugin would make as many devices as asked for.
    if let Some(r) = indices.iter().position(|&i| i >= MAX_LOCAL_RANKS) {
        return Err(Error::config(format!(
            "rank {r} is on xla:{}, past the devices one process's group may use (xla:0 … \
             xla:{})",
            indices[r],
            MAX_LOCAL_RANKS - 1
        )));
    }
    let need = indices.iter().max().map_or(0, |&m| m + 1);
    let base = ClientOptions::from_env()?.with_timeout(config.timeout);
    let client = Client::discover_with(&|plugin| {
        if plugin.kind() == PluginKind::Cpu && base.get("cpu_device_count").is_none() {
            base.clone()
                .with("cpu_device_count", OptionValue::Int(need as i64))
        } else {
            base.clone()
        }
    })?;
    let have = client.devices().len();
    if let Some(r) = indices.iter().position(|&i| i >= have) {
        return Err(Error::config(format!(
            "rank {r} is on xla:{}, but the {} client has {have} device(s) (xla:0 … xla:{})",
            indices[r],
            client.platform_name(),
            have.saturating_sub(1)
        )));
    }
    let client = if indices.iter().copied().eq(0..indices.len()) {
        client
    } else {
        client.subset(indices)?
    };
    Ok(Arc::new(crate::engine::pjrt::Pjrt { client }))
}

#[cfg(not(feature = "xla"))]
pub(crate) fn xla_engine(_: &[usize], _: &Config) -> Result<Arc<dyn GroupEngine>> {
    Err(Error::Unavailable {
        what: "XLA".into(),
        why: "this build of tutti has no PJRT support (build with --features xla)".into(),
    })
}

#[cfg(feature = "cuda")]
fn cuda_engine(indices: &[usize], config: &Config) -> Result<Arc<dyn GroupEngine>> {
    use crate::gpu::{GpuAlgorithm, GpuDevice, GpuGroup, VirtualGpuConfig};
    let gpus = crate::gpu::visible_devices(Some(indices))?;
    let devices: Vec<GpuDevice> = VirtualGpuConfig::new()
        .plan(&gpus)?
        .iter()
        .map(GpuDevice::open)
        .collect::<Result<_>>()?;
    let algorithm = GpuAlgorithm::from_core(config.algorithm)?;
    let group = GpuGroup::new(&devices, algorithm, config)?;
    Ok(Arc::new(crate::engine::cuda::Cuda::new(group, false)))
}

#[cfg(feature = "cuda")]
impl crate::gpu::GpuGroup {
    /// One communicator per device of this group, rank r on device r, whose calls this group
    /// runs (with its algorithm; `config` gives the timeout of every wait and the checks): the
    /// collectives of `tutti::gpu`'s table and point-to-point, over device memory passed by
    /// address ([`Communicator::run_raw`], [`Communicator::send_recv_raw_async`]). How one
    /// process runs several ranks on logical GPUs of one GPU, as TensorFlow's logical devices
    /// do. A group of one rank per process refuses: each process joins its job with
    /// [`Communicator::from_env`].
    pub fn into_communicators(mut self, config: &Config) -> Result<Vec<Communicator>> {
        // The communicators' timeout bounds the group's device waits too.
        self.set_timeout(config.timeout);
        gpu_communicators(self, config)
    }
}

/// The communicators of an in-process group of this process's GPUs (whole or logical), rank r
/// on `group`'s device r: see [`crate::gpu::GpuGroup::into_communicators`].
#[cfg(feature = "cuda")]
fn gpu_communicators(group: crate::gpu::GpuGroup, config: &Config) -> Result<Vec<Communicator>> {
    let n = group.devices().len();
    if group.first_rank() != 0 || group.world_size() != n {
        return Err(Error::config(format!(
            "this GPU group holds ranks {}..{} of a job of {} (one NCCL rank per process): each \
             process joins the job with Communicator::from_env (TUTTI_DEVICE=cuda) instead",
            group.first_rank(),
            group.first_rank() + n,
            group.world_size()
        )));
    }
    config.check(n)?;
    check_local(n)?;
    let specs: Vec<(DeviceKind, usize)> = group
        .devices()
        .iter()
        .map(|d| (DeviceKind::Gpu, d.index()))
        .collect();
    let engine = crate::engine::cuda::Cuda::new(group, false);
    Ok(engine_group(&specs, config, Some(Arc::new(engine))))
}

/// The engine of one process's rank on GPU `index` of a job: an NCCL rank of the job's group,
/// met through the job's rendezvous store.
#[cfg(feature = "cuda")]
pub(super) fn cuda_rank_engine(
    index: usize,
    spec: &crate::cluster::ClusterSpec,
    config: &Config,
    staged: bool,
) -> Result<Arc<dyn GroupEngine>> {
    use crate::gpu::{GpuDevice, GpuGroup, VirtualGpuConfig};
    let gpus = crate::gpu::visible_devices(Some(&[index]))?;
    let plan = VirtualGpuConfig::new().plan(&gpus)?;
    let device = GpuDevice::open(&plan[0])?;
    let group = GpuGroup::from_cluster(spec, Some(&[device]), config)?;
    Ok(if staged {
        Arc::new(crate::engine::cuda::Staged {
            group,
            per_rank: true,
        })
    } else {
        Arc::new(crate::engine::cuda::Cuda::new(group, true))
    })
}

#[cfg(not(feature = "cuda"))]
pub(super) fn cuda_rank_engine(
    _: usize,
    _: &crate::cluster::ClusterSpec,
    _: &Config,
    _: bool,
) -> Result<Arc<dyn GroupEngine>> {
    cuda_engine(&[], &Config::default())
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(_: &[usize], _: &Config) -> Result<Arc<dyn GroupEngine>> {
    Err(Error::Unavailable {
        what: "CUDA".into(),
        why: "this build of tutti has no CUDA support (build with --features cuda)".into(),
    })
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Run `f` on `world` threads, each with its rank's communicator, and return their results in
/// rank order. A rank that panics aborts the group (its peers' calls fail at once instead of
/// waiting for the timeout) and the panic is returned as an error naming the rank.
pub fn run_local<R, F>(world: usize, config: &Config, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(&Communicator) -> R + Sync,
{
    run_group(&local_group(world, config)?, f)
}

/// [`run_local`] over the communicators of an in-process group already made (a
/// [`device_group`]'s): `f` on a thread per rank, the results in rank order.
pub(crate) fn run_group<R, F>(comms: &[Communicator], f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(&Communicator) -> R + Sync,
{
    let results: Vec<std::thread::Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("tutti-rank-{}", comm.rank()))
                    .spawn_scoped(s, move || {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                        if let Err(p) = &r {
                            comm.abort(&format!(
                                "rank {} panicked: {}",
                                comm.rank(),
                                panic_message(&**p)
                            ));
                        }
                        r
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect()
    });
    let mut out = Vec::with_capacity(comms.len());
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => out.push(v),
            Err(p) => {
                return Err(Error::Aborted {
                    rank,
                    reason: format!("rank {rank} panicked: {}", panic_message(&*p)),
                })
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::GroupCall;
    use crate::error::Site;
    use crate::transport::CallBuffers;
    use crate::ReduceOp;
    use std::time::{Duration, Instant};

    /// An engine that refuses every call, as a GPU group refuses memory that is not its own.
    struct Refuses;
    impl GroupEngine for Refuses {
        fn run(&self, site: Site, _: &GroupCall, _: &[CallBuffers]) -> Result<()> {
            Err(Error::invalid(site, "not device memory"))
        }
    }

    /// An engine's error comes after the ranks met: the other ranks hear it at once, with the
    /// reason, instead of waiting for the timeout and blaming rank 0.
    #[test]
    fn an_engine_error_reaches_every_rank_at_once() {
        let config = Config::default().with_timeout(Duration::from_secs(60));
        let devices = [
            (DeviceKind::Xla, 0),
            (DeviceKind::Xla, 1),
            (DeviceKind::Xla, 2),
        ];
        let comms = engine_group(&devices, &config, Some(Arc::new(Refuses)));
        let t = Instant::now();
        let errs: Vec<Error> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| s.spawn(move || c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap().unwrap_err())
                .collect()
        });
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
        assert!(
            matches!(errs[0], Error::InvalidArgument { .. }),
            "{:?}",
            errs[0]
        );
        for e in &errs[1..] {
            let m = e.to_string();
            assert!(
                matches!(e, Error::Aborted { .. }) && m.contains("not device memory"),
                "{m}"
            );
        }
    }

    /// A buffer whose Drop panics, dropped with its call on the progress thread, does not end
    /// that thread: later calls still run.
    #[test]
    fn a_panicking_buffer_drop_does_not_stop_the_progress_thread() {
        struct Bomb(Vec<f32>);
        impl AsMut<[f32]> for Bomb {
            fn as_mut(&mut self) -> &mut [f32] {
                &mut self.0
            }
        }
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("a caller's buffer panicked in Drop");
            }
        }
        let config = Config::default().with_timeout(Duration::from_secs(60));
        let comms = local_group(2, &config).unwrap();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    drop(c.all_reduce_async(Bomb(vec![1.0; 8]), ReduceOp::Sum));
                    let w = c.all_reduce_async(vec![2.0f32; 8], ReduceOp::Sum);
                    assert_eq!(w.wait().unwrap(), vec![4.0; 8]);
                });
            }
        });
    }
}
