//! Logical (virtual) GPUs. As with TensorFlow's logical device configuration, one physical GPU
//! can be split into several logical GPUs, each with a memory limit ([`VirtualGpuConfig`]): each
//! logical GPU gets its own stream and its own allocation budget on the shared physical GPU, so
//! one machine with one GPU can run several replicas. NCCL refuses two ranks on one physical
//! GPU: virtual GPUs are reduced with the copy-based algorithms.

use serde::Serialize;

use super::discovery::{cvd_note, gib, GpuInfo};
use crate::error::{Error, Result};

/// One logical GPU of a plan: a whole physical GPU, or one of several on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LogicalGpu {
    /// Index among the logical GPUs (`gpu:N` of the replicas).
    pub index: usize,
    /// The physical GPU's ordinal.
    pub physical: usize,
    /// Bytes this logical GPU may allocate (`None`: no limit but the GPU's).
    pub memory_limit: Option<u64>,
    /// True when its physical GPU carries more than one logical GPU.
    pub is_virtual: bool,
}

/// TensorFlow's logical device configuration: physical GPUs split into logical GPUs, each
/// with a memory limit. Physical GPUs not configured stay one logical GPU each.
///
/// ```
/// use tutti::gpu::VirtualGpuConfig;
/// // Two logical GPUs of 16 GiB each on GPU 0.
/// let config = VirtualGpuConfig::new().split(0, &[16 << 30, 16 << 30]);
/// assert_eq!(config.logical_count(0), 2);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VirtualGpuConfig {
    splits: Vec<(usize, Vec<u64>)>,
}

/// Leave this share of a GPU's free memory out of even splits: room for kernels' and
/// libraries' own allocations.
pub const RESERVED_SHARE: f64 = 0.10;

/// Split `free` bytes evenly into `n` memory limits, keeping [`RESERVED_SHARE`] back and
/// rounding each limit down to whole MiB.
pub fn even_memory_limits(free: u64, n: usize) -> Result<Vec<u64>> {
    if n == 0 {
        return Err(Error::config(
            "virtual GPUs: the number per physical GPU must be at least 1",
        ));
    }
    let usable = (free as f64 * (1.0 - RESERVED_SHARE)) as u64;
    let each = (usable / n as u64) & !((1u64 << 20) - 1);
    if each == 0 {
        return Err(Error::config(format!(
            "virtual GPUs: {} free cannot be split into {n} GPUs of at least 1 MiB",
            gib(free)
        )));
    }
    Ok(vec![each; n])
}

impl VirtualGpuConfig {
    /// No splits: every physical GPU is one logical GPU.
    pub fn new() -> VirtualGpuConfig {
        VirtualGpuConfig::default()
    }

    /// Split physical GPU `gpu` into one logical GPU per entry of `memory_limits` (bytes).
    pub fn split(mut self, gpu: usize, memory_limits: &[u64]) -> VirtualGpuConfig {
        self.splits.push((gpu, memory_limits.to_vec()));
        self
    }

    /// Split physical GPU `gpu` into `n` logical GPUs sharing its free memory evenly
    /// ([`even_memory_limits`]; the free memory is read now when `gpu` does not have it).
    pub fn split_evenly(self, gpu: &GpuInfo, n: usize) -> Result<VirtualGpuConfig> {
        let limits = even_memory_limits(gpu.known_free_memory()?, n)?;
        Ok(self.split(gpu.ordinal, &limits))
    }

    /// The number of logical GPUs physical GPU `gpu` becomes (1 when not configured).
    pub fn logical_count(&self, gpu: usize) -> usize {
        self.splits
            .iter()
            .find(|(g, _)| *g == gpu)
            .map_or(1, |(_, l)| l.len())
    }

    /// The logical GPUs over `gpus`, numbered physical GPU by physical GPU in `gpus`' order, or
    /// an error naming a GPU configured twice or not in `gpus`, an empty split, a zero limit,
    /// or limits that add up to more than the GPU's free memory (read now for a split GPU whose
    /// `free_memory` was not read; GPUs not split are not touched).
    pub fn plan(&self, gpus: &[GpuInfo]) -> Result<Vec<LogicalGpu>> {
        for (i, (g, limits)) in self.splits.iter().enumerate() {
            let info = gpus.iter().find(|x| x.ordinal == *g).ok_or_else(|| {
                Error::config(format!(
                    "virtual GPUs: GPU {g} is configured but not among the {} GPU(s) in use{}",
                    gpus.len(),
                    cvd_note()
                ))
            })?;
            if self.splits[..i].iter().any(|(h, _)| h == g) {
                return Err(Error::config(format!(
                    "virtual GPUs: GPU {g} is configured twice"
                )));
            }
            if limits.is_empty() {
                return Err(Error::config(format!(
                    "virtual GPUs: GPU {g} is split into no logical GPU (give at least one memory limit)"
                )));
            }
            if let Some(k) = limits.iter().position(|&l| l == 0) {
                return Err(Error::config(format!(
                    "virtual GPUs: logical GPU {k} on GPU {g} has a memory limit of 0 bytes"
                )));
            }
            let sum = limits.iter().fold(0u64, |a, &b| a.saturating_add(b));
            let free = info.known_free_memory()?;
            if sum > free {
                return Err(Error::config(format!(
                    "virtual GPUs: the {} logical GPUs on GPU {g} ({}) ask for {} in all, but it has {} free",
                    limits.len(),
                    info.name,
                    gib(sum),
                    gib(free)
                )));
            }
        }
        let mut out = Vec::new();
        for g in gpus {
            match self.splits.iter().find(|(o, _)| *o == g.ordinal) {
                Some((_, limits)) => {
                    for &l in limits {
                        out.push(LogicalGpu {
                            index: out.len(),
                            physical: g.ordinal,
                            memory_limit: Some(l),
                            is_virtual: limits.len() > 1,
                        });
                    }
                }
                None => out.push(LogicalGpu {
                    index: out.len(),
                    physical: g.ordinal,
                    memory_limit: None,
                    is_virtual: false,
                }),
            }
        }
        Ok(out)
    }
}

/// `n` replicas over `gpus`: the first `n` GPUs when there are enough, else every GPU split into
/// logical GPUs (as evenly as possible, the first GPUs taking one more) with even memory limits.
pub fn plan_replicas(n: usize, gpus: &[GpuInfo]) -> Result<Vec<LogicalGpu>> {
    if n == 0 {
        return Err(Error::config("GPU replicas: -n must be at least 1"));
    }
    if gpus.is_empty() {
        return Err(Error::config("GPU replicas: no GPU to place them on"));
    }
    if n <= gpus.len() {
        return VirtualGpuConfig::new().plan(&gpus[..n]);
    }
    // Every GPU is split: read each one's free memory once, for the limits and the check.
    let gpus: Vec<GpuInfo> = gpus
        .iter()
        .map(GpuInfo::with_free_memory)
        .collect::<Result<_>>()?;
    let p = gpus.len();
    let mut config = VirtualGpuConfig::new();
    for (i, g) in gpus.iter().enumerate() {
        let k = n / p + usize::from(i < n % p);
        config = config.split_evenly(g, k)?;
    }
    config.plan(&gpus)
}

/// A GPU as the driver would report it, for plans made without a driver.
#[cfg(test)]
pub(crate) fn test_gpu(ordinal: usize, free_gib: u64) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: "Test GPU".into(),
        total_memory: (free_gib + 1) << 30,
        free_memory: free_gib << 30,
        compute_capability: (9, 0),
        multiprocessors: 132,
        pci_bus_id: String::new(),
        uuid: String::new(),
        visible_as: None,
    }
}

#[cfg(test)]
mod tests {
    use super::test_gpu as gpu;
    use super::*;
    use crate::device::cuda::libs;

    #[test]
    fn memory_limit_math() {
        let l = even_memory_limits(100 << 30, 4).unwrap();
        assert_eq!(l.len(), 4);
        assert!(l.iter().all(|&x| x == l[0] && x % (1 << 20) == 0));
        let sum: u64 = l.iter().sum();
        assert!(sum <= (90 << 30) && sum > (89 << 30), "{sum}");
        assert!(even_memory_limits(100 << 30, 0).is_err());
        assert!(even_memory_limits(1 << 20, 4).is_err());
    }

    #[test]
    fn virtual_gpu_plans() {
        let gpus = vec![gpu(0, 80), gpu(1, 80)];
        let plan = VirtualGpuConfig::new()
            .split(1, &[10 << 30, 20 << 30])
            .plan(&gpus)
            .unwrap();
        assert_eq!(plan.len(), 3);
        assert_eq!(
            (plan[0].physical, plan[0].memory_limit, plan[0].is_virtual),
            (0, None, false)
        );
        assert_eq!(
            (plan[1].physical, plan[1].memory_limit),
            (1, Some(10 << 30))
        );
        assert_eq!(
            (plan[2].index, plan[2].memory_limit, plan[2].is_virtual),
            (2, Some(20 << 30), true)
        );
        // One logical GPU with a limit is not virtual (NCCL may use it).
        let one = VirtualGpuConfig::new()
            .split(0, &[1 << 30])
            .plan(&gpus)
            .unwrap();
        assert!(!one[0].is_virtual);
        let err = |c: VirtualGpuConfig| c.plan(&gpus).unwrap_err().to_string();
        assert!(err(VirtualGpuConfig::new().split(5, &[1])).contains("GPU 5"));
        assert!(err(VirtualGpuConfig::new().split(0, &[1]).split(0, &[1])).contains("twice"));
        assert!(err(VirtualGpuConfig::new().split(0, &[])).contains("no logical GPU"));
        assert!(err(VirtualGpuConfig::new().split(0, &[0])).contains("0 bytes"));
        assert!(err(VirtualGpuConfig::new().split(0, &[60 << 30, 60 << 30])).contains("free"));
    }

    #[test]
    fn replicas_spread_over_gpus() {
        let one = vec![gpu(0, 100)];
        let p = plan_replicas(4, &one).unwrap();
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|l| l.physical == 0 && l.is_virtual));
        let two = vec![gpu(0, 100), gpu(1, 100)];
        let p = plan_replicas(3, &two).unwrap();
        assert_eq!(
            p.iter().map(|l| l.physical).collect::<Vec<_>>(),
            vec![0, 0, 1]
        );
        assert_eq!(
            p.iter().map(|l| l.is_virtual).collect::<Vec<_>>(),
            vec![true, true, false]
        );
        let p = plan_replicas(2, &two).unwrap();
        assert!(p.iter().all(|l| !l.is_virtual && l.memory_limit.is_none()));
        assert!(plan_replicas(0, &two).is_err());
    }

    #[test]
    fn free_memory_is_read_only_for_split_gpus() {
        // Free memory not read (as `devices()` leaves it): whole GPUs plan without it.
        let unread = vec![gpu(0, 0), gpu(1, 0)];
        assert_eq!(plan_replicas(2, &unread).unwrap().len(), 2);
        assert_eq!(VirtualGpuConfig::new().plan(&unread).unwrap().len(), 2);
        // Read when given: no driver needed.
        let read = gpu(0, 8);
        assert_eq!(read.with_free_memory().unwrap(), read);
        // A split of a GPU whose free memory was not read reads it from the driver: without one
        // that is the driver's error, naming it.
        if libs::cuda().is_err() {
            for e in [
                VirtualGpuConfig::new()
                    .split(0, &[1 << 20])
                    .plan(&unread)
                    .unwrap_err(),
                plan_replicas(3, &unread).unwrap_err(),
                VirtualGpuConfig::new()
                    .split_evenly(&unread[1], 2)
                    .unwrap_err(),
            ] {
                assert!(e.to_string().starts_with("CUDA not available: "), "{e}");
            }
        }
    }
}
