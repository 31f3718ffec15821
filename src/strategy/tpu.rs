//! TPU setup as TensorFlow's guides write it: a cluster resolver naming the TPU,
//! `initialize_tpu_system` (which opens the devices and reports their topology), then
//! `TPUStrategy` over them. tutti reaches TPUs through the PJRT plugin of this host (libtpu on a
//! TPU VM); where there is no TPU, any PJRT plugin's devices (the CPU plugin's) stand in.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::xla::{Client, ClientOptions};

/// TensorFlow's `TPUClusterResolver`: which TPU. `""`, `"local"` and `"localhost"` are this
/// host's (a TPU VM's, through libtpu, or the plugin `TUTTI_PJRT_PLUGIN` names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpuClusterResolver {
    tpu: String,
}

impl TpuClusterResolver {
    /// The TPU named `tpu` (TensorFlow's `tpu` argument). A remote TPU (a name resolved by a
    /// cloud API, or `grpc://host:port` of a TPU node) is refused with the reason: tutti drives
    /// TPUs through this host's PJRT plugin, so run the program on the TPU VM itself.
    pub fn new(tpu: &str) -> Result<TpuClusterResolver> {
        let t = tpu.trim();
        if !matches!(t, "" | "local" | "localhost") {
            return Err(Error::Unavailable {
                what: format!("TPU '{t}'"),
                why: "tutti reaches TPUs through this host's PJRT plugin (libtpu on a TPU VM), \
                      not over the network: run on the TPU VM with tpu='' (or 'local')"
                    .into(),
            });
        }
        Ok(TpuClusterResolver {
            tpu: "local".into(),
        })
    }

    /// TensorFlow's `master()`: where the TPU is (`"local"`: this host).
    pub fn master(&self) -> &str {
        &self.tpu
    }
}

/// What `initialize_tpu_system` found: TensorFlow's `tf.tpu.experimental.Topology`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Cores (devices) across every task.
    pub num_cores: usize,
    /// Tasks (hosts, workers) the cores belong to.
    pub num_tasks: usize,
    /// Cores of each task.
    pub num_cores_per_task: usize,
    /// The PJRT platform (`tpu`, `cpu`, ...).
    pub platform: String,
    /// The devices' kind (`TPU v4`, `cpu`, ...).
    pub device_kind: String,
}

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// TensorFlow's `tf.tpu.experimental.initialize_tpu_system(resolver)`: open the devices of the
/// TPU `resolver` names (options from `TUTTI_PJRT_OPTIONS`) and report their topology; the
/// client is what `Strategy::tpu` takes. Initializing again in one process warns, as
/// TensorFlow's guides do, that it loses what the devices hold (variables made on them before).
pub fn initialize_tpu_system(resolver: &TpuClusterResolver) -> Result<(Client, Topology)> {
    initialize_tpu_system_with(resolver, &ClientOptions::from_env()?)
}

/// [`initialize_tpu_system`] with the plugin's options given (`cpu_device_count=4` for the CPU
/// plugin, say).
pub fn initialize_tpu_system_with(
    resolver: &TpuClusterResolver,
    options: &ClientOptions,
) -> Result<(Client, Topology)> {
    let _ = resolver;
    if INITIALIZED.swap(true, Ordering::AcqRel) {
        log::warn!(
            "initialize_tpu_system: the TPU system was initialized before in this process; \
             initializing it again loses what its devices hold (variables made on them before)"
        );
    }
    let client = Client::discover(options)?;
    let topology = topology(&client);
    log::info!(
        "initialize_tpu_system: {} cores on {} task(s) ({} per task) of {} ({})",
        topology.num_cores,
        topology.num_tasks,
        topology.num_cores_per_task,
        topology.platform,
        topology.device_kind
    );
    Ok((client, topology))
}

/// The topology of `client`'s devices.
pub fn topology(client: &Client) -> Topology {
    let devices = client.devices();
    let mut tasks: Vec<i64> = devices.iter().map(|d| d.process_index).collect();
    tasks.sort_unstable();
    tasks.dedup();
    let num_tasks = tasks.len().max(1);
    Topology {
        num_cores: devices.len(),
        num_tasks,
        num_cores_per_task: devices.len() / num_tasks,
        platform: client.platform_name().to_string(),
        device_kind: devices.first().map(|d| d.kind.clone()).unwrap_or_default(),
    }
}
