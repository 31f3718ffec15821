//! Devices: what a replica runs on.
//!
//! Kinds are CPU, GPU and XLA. The CPU is always there; GPUs and XLA devices are discovered by
//! their own back ends behind cargo features. As with TensorFlow's logical device configuration,
//! one physical CPU can be presented as N logical devices `cpu:0` … `cpu:N-1` so that one host runs
//! N replicas.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "xla")]
pub(crate) mod pjrt;
mod tensor;

pub use tensor::DeviceTensor;
#[cfg(feature = "xla")]
pub(crate) use tensor::Storage;

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::sync::cores;

/// The kind of a device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host CPU (real in every build).
    Cpu,
    /// CUDA GPU.
    Gpu,
    /// XLA device reached through a PJRT plugin (TPU and others).
    Xla,
}

impl DeviceKind {
    /// Lower-case name as used in device specs (`cpu`, `gpu`, `xla`).
    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Gpu => "gpu",
            DeviceKind::Xla => "xla",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DeviceKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<DeviceKind> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "gpu" | "cuda" => Ok(DeviceKind::Gpu),
            "xla" | "tpu" => Ok(DeviceKind::Xla),
            _ => Err(Error::config(format!(
                "unknown device kind '{s}' (expected cpu, gpu or xla)"
            ))),
        }
    }
}

/// One device a replica can be placed on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Device {
    /// Its kind.
    pub kind: DeviceKind,
    /// Index among the devices of its kind (`cpu:1` has index 1).
    pub index: usize,
    /// Human-readable name (CPU model, GPU name, PJRT device kind).
    pub name: String,
    /// Memory the device may use, in bytes, when known.
    pub memory_bytes: Option<u64>,
    /// For a logical device, the index of the physical device it lives on.
    pub physical_index: usize,
}

impl Device {
    /// The device spec, e.g. `cpu:0`.
    pub fn spec(&self) -> String {
        format!("{}:{}", self.kind, self.index)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec())
    }
}

/// Parse a device spec: `cpu:0`, `GPU:1`, `/device:CPU:0`, or a full TensorFlow name such as
/// `/job:worker/replica:0/task:1/device:GPU:0` (the job part is ignored). A bare kind means index 0.
pub fn parse_spec(spec: &str) -> Result<(DeviceKind, usize)> {
    let last = spec.rsplit('/').next().unwrap_or(spec);
    let last = last.strip_prefix("device:").unwrap_or(last);
    let (kind, index) = match last.split_once(':') {
        Some((k, i)) => (k, i),
        None => (last, "0"),
    };
    let kind: DeviceKind = kind.parse().map_err(|_| {
        Error::config(format!(
            "device '{spec}': unknown kind '{kind}' (expected cpu, gpu or xla)"
        ))
    })?;
    let index = index
        .parse()
        .map_err(|_| Error::config(format!("device '{spec}': index '{index}' is not a number")))?;
    Ok((kind, index))
}

/// What the host offers.
#[derive(Clone, Debug, Serialize)]
pub struct HostInfo {
    /// Cores this process may use.
    pub cores: usize,
    /// The CPU model, from /proc/cpuinfo where there is one.
    pub cpu_model: String,
    /// Total memory in bytes (0 when unknown).
    pub memory_total_bytes: u64,
    /// Memory available to new allocations in bytes (0 when unknown).
    pub memory_available_bytes: u64,
}

fn meminfo_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// Discover the host: cores and memory.
pub fn host() -> HostInfo {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    HostInfo {
        cores: cores(),
        cpu_model,
        memory_total_bytes: meminfo_field(&meminfo, "MemTotal:"),
        memory_available_bytes: meminfo_field(&meminfo, "MemAvailable:"),
    }
}

/// The physical devices this build can see: the host CPU, then (with the `cuda` feature, when
/// the CUDA driver is present) the GPUs `gpu:0`, `gpu:1`, ..., then (with the `xla` feature,
/// when a PJRT plugin is found) the XLA devices `xla:0`, `xla:1`, ...
pub fn discover() -> Vec<Device> {
    #[allow(unused_mut)]
    let mut devices = vec![host_cpu()];
    #[cfg(feature = "cuda")]
    devices.extend(cuda::discover_devices());
    #[cfg(feature = "xla")]
    devices.extend(pjrt::discover_devices());
    devices
}

fn host_cpu() -> Device {
    let h = host();
    Device {
        kind: DeviceKind::Cpu,
        index: 0,
        name: h.cpu_model,
        memory_bytes: Some(h.memory_total_bytes).filter(|&m| m > 0),
        physical_index: 0,
    }
}

/// `n` logical CPU devices `cpu:0` … `cpu:n-1` on the host CPU, sharing its memory.
pub fn logical_cpus(n: usize) -> Result<Vec<Device>> {
    if n == 0 {
        return Err(Error::config(
            "logical CPU devices: the count must be at least 1",
        ));
    }
    let cpu = host_cpu();
    Ok((0..n)
        .map(|index| Device {
            index,
            ..cpu.clone()
        })
        .collect())
}

/// The device `spec` names ([`parse_spec`]'s forms, TensorFlow's among them), for a strategy's
/// replicas: `cpu:N` a logical CPU device of the host; `gpu:N` the N-th GPU tutti sees (an
/// error saying why where it sees none); `xla:N` (or `tpu:N`) the N-th device of the PJRT
/// plugin a strategy opens for its XLA devices, checked when it does.
pub fn device_from_spec(spec: &str) -> Result<Device> {
    let (kind, index) = parse_spec(spec)?;
    match kind {
        DeviceKind::Cpu => Ok(Device {
            index,
            ..host_cpu()
        }),
        DeviceKind::Gpu => {
            #[cfg(feature = "cuda")]
            let gpus = cuda::discover_devices();
            #[cfg(not(feature = "cuda"))]
            let gpus: Vec<Device> = Vec::new();
            let seen = gpus.len();
            gpus.into_iter()
                .find(|d| d.index == index)
                .ok_or_else(|| Error::Unavailable {
                    what: format!("device '{spec}'"),
                    why: if cfg!(feature = "cuda") {
                        format!("tutti sees {seen} GPU(s) here (no CUDA driver, or fewer GPUs)")
                    } else {
                        "this build of tutti has no CUDA support (build with --features cuda)"
                            .into()
                    },
                })
        }
        DeviceKind::Xla => Ok(Device {
            kind,
            index,
            name: "xla".into(),
            memory_bytes: None,
            physical_index: index,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(parse_spec("cpu:3").unwrap(), (DeviceKind::Cpu, 3));
        assert_eq!(parse_spec("/device:GPU:1").unwrap(), (DeviceKind::Gpu, 1));
        assert_eq!(
            parse_spec("/job:worker/replica:0/task:1/device:CPU:0").unwrap(),
            (DeviceKind::Cpu, 0)
        );
        assert_eq!(parse_spec("tpu").unwrap(), (DeviceKind::Xla, 0));
        assert!(parse_spec("npu:0").unwrap_err().to_string().contains("npu"));
        let cpu = device_from_spec("/job:localhost/replica:0/task:0/device:CPU:2").unwrap();
        assert_eq!((cpu.kind, cpu.index), (DeviceKind::Cpu, 2));
        assert_eq!(device_from_spec("TPU:1").unwrap().spec(), "xla:1");
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            device_from_spec("/gpu:0"),
            Err(Error::Unavailable { what, why }) if what.contains("/gpu:0") && why.contains("cuda")
        ));
        assert!(parse_spec("cpu:x").unwrap_err().to_string().contains("'x'"));
    }

    #[test]
    fn host_and_logical_devices() {
        let h = host();
        assert!(h.cores >= 1);
        let d = logical_cpus(4).unwrap();
        assert_eq!(
            d.iter().map(Device::spec).collect::<Vec<_>>(),
            ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        );
        assert!(logical_cpus(0).is_err());
    }
}
