//! `tutti devices`: what this machine offers, as text or JSON.

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// `tutti devices [--json]`.
pub(crate) fn run(json: bool) -> Result<(), tutti::Error> {
    let host = tutti::host_info();
    let devs = tutti::discover_devices();
    if json {
        #[allow(unused_mut)]
        let mut v = serde_json::json!({ "host": host, "devices": devs });
        #[cfg(feature = "xla")]
        {
            v["xla"] = xla_json();
        }
        #[cfg(feature = "cuda")]
        {
            v["gpu"] = tutti::gpu::status().to_json();
        }
        say!("{v}");
        return Ok(());
    }
    say!(
        "host: {} cores, {:.1} GiB memory ({:.1} GiB available), {}",
        host.cores,
        gib(host.memory_total_bytes),
        gib(host.memory_available_bytes),
        host.cpu_model
    );
    say!("{:<8} {:<6} {:>12}  name", "device", "kind", "memory");
    for d in devs {
        let mem = d
            .memory_bytes
            .map_or("-".into(), |m| format!("{:.1} GiB", gib(m)));
        say!("{:<8} {:<6} {:>12}  {}", d.spec(), d.kind, mem, d.name);
    }
    #[cfg(feature = "cuda")]
    gpu_text();
    #[cfg(all(not(feature = "xla"), not(feature = "cuda")))]
    say!("(GPU: not built with CUDA support; XLA: not built with PJRT support)");
    #[cfg(all(not(feature = "xla"), feature = "cuda"))]
    say!("(XLA: not built with PJRT support)");
    #[cfg(feature = "xla")]
    xla_text();
    Ok(())
}

/// The GPU part of `tutti devices`: the driver, NCCL and NVRTC (or why each is missing), then
/// each GPU's details.
#[cfg(feature = "cuda")]
fn gpu_text() {
    let s = tutti::gpu::status();
    say!("GPU: {}", s.lines().join("; "));
    for g in s.gpus.as_deref().unwrap_or_default() {
        let visible = g.visible_as.as_ref().map_or(String::new(), |v| {
            format!(", CUDA_VISIBLE_DEVICES entry {v}")
        });
        // Listing reads no free memory (that would open a context on every GPU).
        let free = if g.free_memory > 0 {
            format!(" ({:.1} GiB free)", gib(g.free_memory))
        } else {
            String::new()
        };
        say!(
            "gpu:{:<4} compute capability {}.{}, {} SMs, {:.1} GiB{free}, PCI {}, {}{visible}",
            g.ordinal,
            g.compute_capability.0,
            g.compute_capability.1,
            g.multiprocessors,
            gib(g.total_memory),
            g.pci_bus_id,
            g.uuid
        );
    }
}

/// The `xla` section of `tutti devices --json`: the plugin and its devices, or why there are
/// none.
#[cfg(feature = "xla")]
fn xla_json() -> serde_json::Value {
    match tutti::xla::discovery() {
        Ok(d) => serde_json::json!({
            "plugin": d.plugin,
            "api_version": [d.api_version.0, d.api_version.1],
            "platform": d.platform,
            "platform_version": d.platform_version,
            "devices": d.devices,
        }),
        Err(e) => serde_json::json!({ "error": e.to_string(), "api_version": null }),
    }
}

#[cfg(feature = "xla")]
fn xla_text() {
    match tutti::xla::discovery() {
        Ok(d) => {
            say!(
                "XLA: PJRT plugin {} (C API {}.{}), platform {} {}",
                d.plugin.display(),
                d.api_version.0,
                d.api_version.1,
                d.platform,
                d.platform_version
            );
            say!(
                "{:<8} {:>6} {:>8} {:<16} description",
                "device",
                "id",
                "process",
                "kind"
            );
            for x in &d.devices {
                say!(
                    "{:<8} {:>6} {:>8} {:<16} {}",
                    format!("xla:{}", x.index),
                    x.id,
                    x.process_index,
                    x.kind,
                    x.description
                );
            }
            #[cfg(not(feature = "cuda"))]
            say!("(GPU: not built with CUDA support)");
        }
        Err(e) if cfg!(feature = "cuda") => say!("({e})"),
        Err(e) => say!("(GPU: not built with CUDA support; {e})"),
    }
}
