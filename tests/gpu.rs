//! GPU tests (`cargo test --features cuda --test gpu`).
//!
//! Every test that needs a GPU looks for one first and, when there is none, prints
//! `SKIPPED: <reason>` and returns; so does one that needs NVRTC or NCCL without it. On a GPU
//! machine set `TUTTI_REQUIRE_GPU=1` (or `=N`: N GPUs): every such skip then fails the test, so
//! that a run cannot pass without having tested the GPUs (the parts that need more GPUs than
//! `TUTTI_REQUIRE_GPU` says still skip when the machine has fewer). The tests of the pure logic
//! (visible devices, virtual-GPU memory limits, the generated kernels, NCCL codes, where the
//! libraries are looked for) and of the absent-library paths run everywhere. With GPUs, every
//! collective runs with every algorithm on several device sets (virtual GPUs on one GPU, whole
//! GPUs, NCCL with one rank), for every dtype and op, in place and out of place, and is checked
//! against `tutti::reference`.
//!
//! The tests that use GPUs run one at a time ([`gpu_lock`]): NCCL communicators made over the
//! same GPUs from parallel test threads can wait for each other forever.
#![cfg(feature = "cuda")]

mod common;

use std::fmt::Display;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tutti::gpu::{
    self, kernels, DevicePtr, GpuAlgorithm, GpuBuffer, GpuDevice, GpuGroup, GpuInfo, LogicalGpu,
    VirtualGpuConfig,
};
use tutti::{reference, Collective, Config, DType, Element, Error, RawCall, ReduceOp};
use tutti::{FileStore, TcpStore, TcpStoreServer};

/// One test that uses GPUs at a time, in this process. Poison-tolerant: a test that fails
/// while holding it does not fail the others.
fn gpu_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The number of GPUs `TUTTI_REQUIRE_GPU` asks for: 0 when unset, empty or `0`; a value that
/// is not a number asks for 1.
fn required_gpus() -> usize {
    match std::env::var("TUTTI_REQUIRE_GPU") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().unwrap_or(1),
        _ => 0,
    }
}

/// Skip (the rest of) a GPU test: print why, or fail when `TUTTI_REQUIRE_GPU` is set.
fn skip(test: &str, why: impl Display) {
    let n = required_gpus();
    assert!(
        n == 0,
        "TUTTI_REQUIRE_GPU={n}: {test} must run, but it would be skipped: {why}"
    );
    println!("SKIPPED: {test}: {why}");
}

/// The GPU lock and the GPUs, or `None` (skipped) without a GPU. With `TUTTI_REQUIRE_GPU=N`,
/// fewer than N GPUs fail the test.
fn gpus_or_skip(test: &str) -> Option<(MutexGuard<'static, ()>, Vec<GpuInfo>)> {
    let lock = gpu_lock();
    match gpu::devices() {
        Ok(g) => {
            let n = required_gpus();
            assert!(
                g.len() >= n,
                "TUTTI_REQUIRE_GPU={n}: {test}: this machine shows {} GPU(s)",
                g.len()
            );
            Some((lock, g))
        }
        Err(e) => {
            skip(test, e);
            None
        }
    }
}

fn nccl_or_skip(test: &str) -> bool {
    match gpu::nccl_library() {
        Ok(_) => true,
        Err(e) => {
            skip(test, e);
            false
        }
    }
}

fn nvrtc_or_skip(test: &str) -> bool {
    match gpu::nvrtc_library() {
        Ok(_) => true,
        Err(e) => {
            skip(test, e);
            false
        }
    }
}

fn config() -> Config {
    Config::default().with_timeout(Duration::from_secs(60))
}

fn open(plan: &[LogicalGpu]) -> Vec<GpuDevice> {
    plan.iter().map(|l| GpuDevice::open(l).unwrap()).collect()
}

/// `n` logical GPUs on physical GPU 0.
fn virtual_gpus(gpus: &[GpuInfo], n: usize) -> Vec<GpuDevice> {
    let plan = VirtualGpuConfig::new()
        .split_evenly(&gpus[0], n)
        .unwrap()
        .plan(&gpus[..1])
        .unwrap();
    open(&plan)
}

/// Every physical GPU, one logical GPU each.
fn whole_gpus(gpus: &[GpuInfo]) -> Vec<GpuDevice> {
    open(&VirtualGpuConfig::new().plan(gpus).unwrap())
}

// ---------------------------------------------------------------------------------------------
// Without a GPU: absent libraries, pure logic.

#[test]
fn absent_libraries_are_clean_errors() {
    let _gpu = gpu_lock();
    // A bogus explicit NCCL path: Unavailable naming it, never a panic.
    let e = gpu::open_nccl_library("/nonexistent/tutti-test/libnccl.so.2").unwrap_err();
    assert!(
        matches!(e, Error::Unavailable { ref what, .. } if what == "NCCL"),
        "{e:?}"
    );
    let m = e.to_string();
    assert!(m.starts_with("NCCL not available: "), "{m}");
    assert!(m.contains("/nonexistent/tutti-test/libnccl.so.2"), "{m}");
    // A file that is not a library.
    let e = gpu::open_nccl_library("/etc/hostname").unwrap_err();
    assert!(e.to_string().starts_with("NCCL not available: "), "{e}");
    assert_eq!(
        gpu::libs::nccl_candidates(Some("/x/libnccl.so.2")),
        vec!["/x/libnccl.so.2".to_string()]
    );

    // Whatever this machine has, every probe answers, and a missing part is Unavailable.
    let status = gpu::status();
    let lines = status.lines();
    assert_eq!(lines.len(), 3);
    let _ = status.to_json();
    match gpu::devices() {
        Ok(g) => assert!(!g.is_empty()),
        Err(e) => {
            println!("this machine has no usable GPU: {e}");
            assert!(
                matches!(e, Error::Unavailable { ref what, .. } if what == "CUDA"),
                "{e:?}"
            );
            assert!(e.to_string().starts_with("CUDA not available: "), "{e}");
            assert!(lines[0].starts_with("CUDA not available: "), "{lines:?}");
            // Everything that needs the driver says so too.
            let l = LogicalGpu {
                index: 0,
                physical: 0,
                memory_limit: None,
                is_virtual: false,
            };
            let e = GpuDevice::open(&l).unwrap_err();
            assert!(e.to_string().starts_with("CUDA not available: "), "{e}");
            assert!(gpu::driver_version().is_err());
            assert!(gpu::discover_devices().is_empty());
            assert!(gpu::replica_devices(2)
                .unwrap_err()
                .to_string()
                .starts_with("CUDA not available: "));
            assert!(gpu::device_copy_gbps(0).is_err());
            assert!(!tutti::discover_devices()
                .iter()
                .any(|d| d.kind == tutti::DeviceKind::Gpu));
        }
    }
    if let Err(e) = gpu::nccl_library() {
        assert!(e.to_string().starts_with("NCCL not available: "), "{e}");
    }
    if let Err(e) = gpu::nvrtc_version() {
        assert!(e.to_string().starts_with("NVRTC not available: "), "{e}");
    }
}

/// The command line: `tutti devices` reports the GPU state (with a bogus NCCL path, that NCCL
/// is missing and where tutti looked), and `tutti perf --device gpu` fails cleanly without a GPU.
#[test]
fn the_command_reports_missing_libraries() {
    let _gpu = gpu_lock();
    let exe = &common::tutti_bin();
    let out = Command::new(exe)
        .arg("devices")
        .env("TUTTI_NCCL_LIBRARY", "/nonexistent/tutti-test/libnccl.so.2")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    assert!(text.contains("NCCL not available"), "{text}");
    assert!(
        text.contains("/nonexistent/tutti-test/libnccl.so.2"),
        "{text}"
    );
    let out = Command::new(exe)
        .args(["devices", "--json"])
        .env("TUTTI_NCCL_LIBRARY", "/nonexistent/tutti-test/libnccl.so.2")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["gpu"]["nccl"]["error"]
            .as_str()
            .unwrap()
            .contains("NCCL not available"),
        "{v}"
    );

    if gpu::devices().is_err() {
        let out = Command::new(exe)
            .args(["perf", "--device", "gpu", "-n", "2", "-b", "1K", "-e", "1K"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains("CUDA not available"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn cuda_visible_devices_and_lists() {
    let v = gpu::parse_cuda_visible_devices(Some("3,1,bogus,2"));
    assert_eq!(v.entries, Some(vec!["3".to_string(), "1".to_string()]));
    assert_eq!(v.ignored, vec!["bogus".to_string(), "2".to_string()]);
    assert_eq!(
        gpu::parse_cuda_visible_devices(Some("-1")).entries,
        Some(vec![])
    );
    assert_eq!(gpu::parse_cuda_visible_devices(None).entries, None);
    assert_eq!(gpu::parse_device_list("1,gpu:0").unwrap(), vec![1, 0]);
    assert!(gpu::parse_device_list("xla:0").is_err());
}

fn fake(ordinal: usize, free_gib: u64) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: "test".into(),
        total_memory: (free_gib + 2) << 30,
        free_memory: free_gib << 30,
        compute_capability: (9, 0),
        multiprocessors: 132,
        pci_bus_id: String::new(),
        uuid: String::new(),
        visible_as: None,
    }
}

#[test]
fn virtual_gpu_memory_limits() {
    let gpus = [fake(0, 100), fake(1, 40)];
    let limits = gpu::even_memory_limits(100 << 30, 4).unwrap();
    assert_eq!(limits.len(), 4);
    let total: u64 = limits.iter().sum();
    assert!(total <= ((100u64 << 30) as f64 * (1.0 - gpu::RESERVED_SHARE)) as u64);
    assert!(limits.iter().all(|l| l % (1 << 20) == 0));
    let plan = VirtualGpuConfig::new()
        .split(0, &[10 << 30, 10 << 30, 10 << 30])
        .plan(&gpus)
        .unwrap();
    assert_eq!(plan.len(), 4);
    assert_eq!(
        plan.iter().map(|l| l.physical).collect::<Vec<_>>(),
        [0, 0, 0, 1]
    );
    assert!(plan[..3]
        .iter()
        .all(|l| l.is_virtual && l.memory_limit == Some(10 << 30)));
    assert!(!plan[3].is_virtual && plan[3].memory_limit.is_none());
    let e = VirtualGpuConfig::new()
        .split(1, &[30 << 30, 30 << 30])
        .plan(&gpus)
        .unwrap_err();
    assert!(
        e.to_string().contains("GPU 1") && e.to_string().contains("free"),
        "{e}"
    );
    let spread = gpu::plan_replicas(5, &gpus).unwrap();
    assert_eq!(
        spread.iter().map(|l| l.physical).collect::<Vec<_>>(),
        [0, 0, 0, 1, 1]
    );
    assert_eq!(
        spread.iter().map(|l| l.index).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
}

#[test]
fn kernel_source_covers_every_dtype_and_op() {
    let src = kernels::reduce_kernel_source();
    let ctype = |d: DType| match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 | DType::BF16 => "unsigned short",
        DType::I8 => "signed char",
        DType::U8 => "unsigned char",
        DType::I32 => "int",
        DType::U32 => "unsigned int",
        DType::I64 => "long long",
        DType::U64 => "unsigned long long",
    };
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            let name = kernels::reduce_kernel_name(d, op);
            if op.check(d).is_err() {
                // Bitwise ops on a float type: no kernel (the call is refused before).
                assert!(!src.contains(&format!("void {name}(")), "{name}");
                continue;
            }
            let start = src
                .find(&format!("void {name}("))
                .unwrap_or_else(|| panic!("{name} missing"));
            let body = &src[start..];
            let body = &body[..body.find("\n}\n").unwrap()];
            assert!(
                body.contains(&format!("{}* dst", ctype(d))),
                "{name}: {body}"
            );
            match d {
                DType::F16 => {
                    assert!(body.contains("tutti_f16_load") && body.contains("tutti_f16_store"))
                }
                DType::BF16 => {
                    assert!(body.contains("tutti_bf16_load") && body.contains("tutti_bf16_store"))
                }
                _ => assert!(!body.contains("_load(")),
            }
            let combine = match (op, d.is_float()) {
                (ReduceOp::Min, _) => "tutti_min",
                (ReduceOp::Max, _) => "tutti_max",
                (ReduceOp::Sum | ReduceOp::Mean, true) => "a + b",
                (ReduceOp::Prod, true) => "a * b",
                (ReduceOp::Sum | ReduceOp::Mean, false) => ")a + (",
                (ReduceOp::Prod, false) => ")a * (",
                (ReduceOp::BAnd, _) => "(a & b)",
                (ReduceOp::BOr, _) => "(a | b)",
                (ReduceOp::BXor, _) => "(a ^ b)",
            };
            assert!(body.contains(combine), "{name} lacks {combine}: {body}");
            if !d.is_float() {
                // Integer division in 64 bits, truncating toward zero.
                assert!(body.contains("long long)a / ("), "{name}: {body}");
            }
        }
    }
}

/// True when `var=1`: a missing library fails the test instead of skipping it (CI).
fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

#[test]
fn kernels_compile_with_nvrtc() {
    match gpu::nvrtc_library() {
        Ok(l) => println!("NVRTC {}.{} from {}", l.version.0, l.version.1, l.path),
        Err(e) => {
            assert!(
                !required("TUTTI_REQUIRE_NVRTC"),
                "TUTTI_REQUIRE_NVRTC=1: {e}"
            );
            skip("kernels_compile_with_nvrtc", e);
            return;
        }
    }
    let archs = kernels::nvrtc_architectures().unwrap();
    assert!(!archs.is_empty());
    for cc in [(8, 0), (9, 0)] {
        match kernels::compile_reduce_kernels(cc).unwrap() {
            kernels::Image::Cubin(b) | kernels::Image::Ptx(b) => assert!(b.len() > 1000),
        }
    }
}

/// The generated kernels built for the host with the C++ compiler (`CXX`, else `g++`): CUDA's
/// qualifiers become empty, the grid is emulated (3 blocks of 4 threads, so the grid-stride
/// loop runs), and the two f16 conversions, which are PTX instructions, become `_Float16`
/// casts (also round to nearest even). `None` (and a printed reason) without a compiler.
fn host_kernels() -> Option<libloading::Library> {
    let mut src = kernels::reduce_kernel_source();
    // Replace the two PTX conversions with host ones.
    let a = src
        .find("__device__ __forceinline__ float tutti_f16_load")
        .unwrap();
    let b = src
        .find("__device__ __forceinline__ float tutti_bf16_load")
        .unwrap();
    src.replace_range(a..b, r#"
__device__ __forceinline__ float tutti_f16_load(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
__device__ __forceinline__ unsigned short tutti_f16_store(float f) { _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h; }
"#);
    let prelude = r#"
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
struct tutti_dim3 { unsigned x, y, z; };
static tutti_dim3 gridDim, blockDim, blockIdx, threadIdx;
"#;
    let runner = r#"
typedef void (*tutti_kernel)(void*, const tutti_sources, int, tutti_u64, int, tutti_u64);
extern "C" void tutti_run(tutti_kernel k, void* dst, const void** srcs, int nsrc, tutti_u64 n, int acc, tutti_u64 div) {
  tutti_sources s; for (int i = 0; i < nsrc; ++i) s.p[i] = srcs[i];
  gridDim.x = 3; blockDim.x = 4;
  for (unsigned b = 0; b < 3; ++b) for (unsigned t = 0; t < 4; ++t) { blockIdx.x = b; threadIdx.x = t; k(dst, s, nsrc, n, acc, div); }
}
"#;
    let dir = std::env::temp_dir().join(format!("tutti-kernel-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cpp = dir.join("kernels.cpp");
    std::fs::write(&cpp, format!("{prelude}{src}{runner}")).unwrap();
    let so = dir.join("kernels.so");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let out = match Command::new(&cxx)
        .args(["-O1", "-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&cpp)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            println!(
                "SKIPPED: kernels_compute_the_reference_on_the_host: no C++ compiler ({cxx}: {e})"
            );
            return None;
        }
    };
    if !out.status.success() {
        println!(
            "SKIPPED: kernels_compute_the_reference_on_the_host: {cxx} cannot build the host harness (it needs _Float16): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    // SAFETY: a library just built from the kernels and the runner above.
    let lib = unsafe { libloading::Library::new(&so) }.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Some(lib)
}

type HostRun =
    unsafe extern "C" fn(*const std::ffi::c_void, *mut u8, *const *const u8, i32, u64, i32, u64);

fn host_check<T: Element>(lib: &libloading::Library) {
    // SAFETY: the runner's C signature.
    let run: libloading::Symbol<HostRun> = unsafe { lib.get(b"tutti_run").unwrap() };
    let n = 257;
    for p in [1usize, 2, 3, 5] {
        for op in ReduceOp::ALL
            .into_iter()
            .filter(|op| op.check(T::DTYPE).is_ok())
        {
            let inputs: Vec<Vec<T>> = (0..p)
                .map(|r| {
                    (0..n)
                        .map(|i| {
                            let v = if op == ReduceOp::Prod {
                                ((i * 7 + r * 3 + 1) % 5) as f64 - 2.0
                            } else {
                                ((i * 37 + r * 101 + 3) % 301) as f64 - 150.0 + 0.3 * (i % 3) as f64
                            };
                            let v = if i % 50 == 7
                                && T::DTYPE.is_float()
                                && matches!(op, ReduceOp::Min | ReduceOp::Max)
                                && r == 0
                            {
                                f64::NAN
                            } else {
                                v
                            };
                            T::from_f64(v)
                        })
                        .collect()
                })
                .collect();
            let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::reduce(&refs, op);
            let name = std::ffi::CString::new(kernels::reduce_kernel_name(T::DTYPE, op)).unwrap();
            // SAFETY: the kernel's address, passed to the runner as a function pointer.
            let k: libloading::Symbol<*const std::ffi::c_void> =
                unsafe { lib.get(name.as_bytes_with_nul()).unwrap() };
            // Overwrite form.
            let mut out = vec![T::from_f64(0.0); n];
            let ptrs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr() as *const u8).collect();
            let div = if op == ReduceOp::Mean { p as u64 } else { 0 };
            // SAFETY: buffers of n elements each, as the kernel reads and writes.
            unsafe {
                run(
                    *k,
                    out.as_mut_ptr() as *mut u8,
                    ptrs.as_ptr(),
                    p as i32,
                    n as u64,
                    0,
                    div,
                )
            };
            // Accumulate form: dst = input 0.
            let mut acc = inputs[0].clone();
            // SAFETY: as above.
            unsafe {
                run(
                    *k,
                    acc.as_mut_ptr() as *mut u8,
                    ptrs[1..].as_ptr(),
                    (p - 1) as i32,
                    n as u64,
                    1,
                    div,
                )
            };
            let tol = reference::tolerance(T::DTYPE, op, p, 160.0);
            for (form, got) in [("overwrite", &out), ("accumulate", &acc)] {
                let bad = reference::count_errors(got, &want, tol);
                if bad > 0 {
                    let i = (0..n)
                        .find(|&i| {
                            reference::count_errors(&got[i..i + 1], &want[i..i + 1], tol) > 0
                        })
                        .unwrap();
                    panic!("{} {op} p={p} {form}: {bad} wrong; at {i}: got {:?} want {:?} (inputs {:?})", T::DTYPE, got[i], want[i], inputs.iter().map(|v| v[i]).collect::<Vec<_>>());
                }
            }
            // Halves: exact match with the CPU kernels (one rounding, f32 accumulation).
            if matches!(T::DTYPE, DType::F16 | DType::BF16) {
                let mut cpu = vec![0u8; n * 2];
                let srcs: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
                tutti::kernels::reduce(
                    T::DTYPE,
                    op,
                    &mut cpu,
                    &srcs,
                    tutti::kernels::Init::Overwrite,
                    (op == ReduceOp::Mean).then_some(p),
                );
                let gpu: &[u8] = bytemuck::cast_slice(&out);
                assert_eq!(
                    gpu,
                    &cpu[..],
                    "{} {op} p={p}: differs from the CPU kernel",
                    T::DTYPE
                );
            }
        }
    }
}

/// The arithmetic of the generated kernels, run on the host: every dtype and op, 1 to 5
/// sources, both the overwrite and the accumulate form, against `tutti::reference` (wrapping
/// integers, truncating integer means, NaN losing in min/max), and for f16/bf16 bit for bit
/// against the CPU kernels (f32 accumulation, one rounding).
#[test]
fn kernels_compute_the_reference_on_the_host() {
    let Some(lib) = host_kernels() else {
        return;
    };
    for d in DType::ALL {
        tutti::for_each_dtype!(d, T => { host_check::<T>(&lib) });
    }
}

/// NCCL, when found, binds every function tutti calls and is new enough.
#[test]
fn the_nccl_library_binds() {
    match gpu::nccl_library() {
        Ok(l) => {
            println!("NCCL {:?} from {}", l.version, l.path);
            assert!(l.version >= gpu::MIN_VERSION, "{l:?}");
            assert_eq!(gpu::open_nccl_library(&l.path).unwrap(), l);
        }
        Err(e) => {
            assert!(!required("TUTTI_REQUIRE_NCCL"), "TUTTI_REQUIRE_NCCL=1: {e}");
            skip("the_nccl_library_binds", e);
        }
    }
}

#[test]
fn groups_and_buffers_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<GpuGroup>();
    send_sync::<GpuDevice>();
    send_sync::<GpuBuffer<f32>>();
}

#[test]
fn algorithm_names_and_nccl_codes() {
    for a in GpuAlgorithm::ALL {
        assert_eq!(a.to_string().parse::<GpuAlgorithm>().unwrap(), a);
    }
    assert_eq!("auto".parse::<GpuAlgorithm>().unwrap(), GpuAlgorithm::Auto);
    assert!("direct".parse::<GpuAlgorithm>().is_err());
    assert_eq!(gpu::nccl_dtype(DType::F16), 6);
    assert_eq!(gpu::nccl_dtype(DType::I8), 0);
    assert_eq!(gpu::nccl_op(ReduceOp::Sum), Some(0));
    assert_eq!(gpu::nccl_op(ReduceOp::Mean), Some(4));
    assert_eq!(gpu::nccl_op(ReduceOp::BAnd), None);
    assert_eq!(gpu::decode_version(22703), (2, 27, 3));
}

// ---------------------------------------------------------------------------------------------
// With GPUs.

#[test]
fn discovery_reports_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("discovery_reports_gpus") else {
        return;
    };
    for g in &gpus {
        println!("{g:?}");
        assert!(!g.name.is_empty());
        // Free memory is read only where this process has a context already (0 elsewhere).
        assert!(g.total_memory > 0 && g.total_memory >= g.free_memory);
        let free = g.current_free_memory().unwrap();
        assert!(free > 0 && free <= g.total_memory, "{free}");
        assert!(g.compute_capability >= (3, 5));
        assert!(g.multiprocessors > 0);
        assert!(g.uuid.starts_with("GPU-"), "{}", g.uuid);
    }
    let devs = tutti::discover_devices();
    assert_eq!(
        devs.iter()
            .filter(|d| d.kind == tutti::DeviceKind::Gpu)
            .count(),
        gpus.len()
    );
    assert_eq!(gpu::visible_devices(Some(&[0])).unwrap()[0].ordinal, 0);
    assert!(gpu::visible_devices(Some(&[gpus.len()])).is_err());
    let (major, _) = gpu::driver_version().unwrap();
    assert!(major >= 11);
    let bw = gpu::device_copy_gbps(0).unwrap();
    println!("device copy bandwidth of GPU 0: {bw:.0} GB/s");
    assert!(bw > 10.0);
}

fn round_trip<T: Element>(dev: &GpuDevice) {
    let data: Vec<T> = (0..1000)
        .map(|i| T::from_f64((i % 100) as f64 - 50.0))
        .collect();
    let mut b = GpuBuffer::from_host(dev, &data).unwrap();
    assert_eq!(b.to_host().unwrap(), data);
    let mid: Vec<T> = vec![T::from_f64(7.0); 10];
    b.slice_mut(100..110).unwrap().copy_from_host(&mid).unwrap();
    let mut back = vec![T::from_f64(0.0); 12];
    b.slice(99..111).unwrap().copy_to_host(&mut back).unwrap();
    assert_eq!(back[0], data[99]);
    assert_eq!(&back[1..11], &mid[..]);
    assert_eq!(back[11], data[110]);
    assert!(b.slice(990..1001).is_err());
    assert!(b.copy_from_host(&data[..10]).is_err());
}

#[test]
fn buffers_round_trip_and_respect_memory_limits() {
    let Some((_gpu, gpus)) = gpus_or_skip("buffers_round_trip_and_respect_memory_limits") else {
        return;
    };
    let dev = &whole_gpus(&gpus[..1])[0];
    for d in DType::ALL {
        tutti::for_each_dtype!(d, T => { round_trip::<T>(dev) });
    }
    let empty = GpuBuffer::<f32>::zeros(dev, 0).unwrap();
    assert!(empty.is_empty() && empty.to_host().unwrap().is_empty());
    // Two logical GPUs of 4 MiB each on GPU 0.
    let plan = VirtualGpuConfig::new()
        .split(gpus[0].ordinal, &[4 << 20, 4 << 20])
        .plan(&gpus[..1])
        .unwrap();
    let v = open(&plan);
    assert!(v[0].is_virtual() && v[0].memory_limit() == Some(4 << 20));
    let a = GpuBuffer::<f32>::zeros(&v[0], 512 << 10).unwrap();
    assert_eq!(v[0].memory_used(), 2 << 20);
    let e = GpuBuffer::<f32>::zeros(&v[0], 768 << 10).unwrap_err();
    assert!(
        e.to_string().contains("memory limit of 4194304 bytes"),
        "{e}"
    );
    // The other logical GPU has its own budget.
    let _b = GpuBuffer::<f32>::zeros(&v[1], 768 << 10).unwrap();
    drop(a);
    assert_eq!(v[0].memory_used(), 0);
    let _c = GpuBuffer::<f32>::zeros(&v[0], 768 << 10).unwrap();
}

/// Values whose reductions over a few ranks are exact in every type (small magnitudes).
fn value<T: Element>(r: usize, i: usize, op: ReduceOp) -> T {
    let v = if op == ReduceOp::Prod {
        ((i * 7 + r * 3 + 1) % 5) as f64 - 2.0
    } else {
        ((i * 13 + r * 7 + 3) % 11) as f64 - 5.0
    };
    T::from_f64(
        if T::DTYPE.is_float() || matches!(T::DTYPE, DType::I8 | DType::I32 | DType::I64) {
            v
        } else {
            v.abs()
        },
    )
}

fn host<T: Element>(bufs: &[GpuBuffer<T>]) -> Vec<Vec<T>> {
    bufs.iter().map(|b| b.to_host().unwrap()).collect()
}

fn check<T: Element>(what: &str, got: &[T], want: &[T], op: ReduceOp, ranks: usize) {
    let tol = reference::tolerance(T::DTYPE, op, ranks, 5.0);
    let bad = reference::count_errors(got, want, tol);
    if bad > 0 {
        let i = got
            .iter()
            .zip(want)
            .position(|(g, w)| reference::count_errors(&[*g], &[*w], tol) > 0)
            .unwrap_or(0);
        panic!(
            "{what}: {bad} of {} elements wrong; first at {i}: got {:?}, want {:?}",
            want.len(),
            got.get(i),
            want.get(i)
        );
    }
}

/// Every collective on `group` for `T`, every op, in place and out of place, against the
/// reference.
fn every_collective<T: Element>(group: &GpuGroup, label: &str, counts: &[usize]) {
    let devs = group.devices().to_vec();
    let p = devs.len();
    let up = |v: &[Vec<T>]| -> Vec<GpuBuffer<T>> {
        v.iter()
            .zip(&devs)
            .map(|(x, d)| GpuBuffer::from_host(d, x).unwrap())
            .collect()
    };
    for &n in counts {
        let what = |c: &str, extra: String| format!("{label} {} n={n} {c} {extra}", T::DTYPE);
        let nccl = group.algorithm() == GpuAlgorithm::Nccl;
        for op in ReduceOp::ALL {
            if op.is_bitwise() && (T::DTYPE.is_float() || nccl) {
                // Refused before anything runs: no bitwise ops on floats, none in NCCL.
                let mut bufs = up(&vec![vec![T::from_f64(1.0); n]; p]);
                let e = group.all_reduce(&mut bufs, op).unwrap_err();
                let want = if T::DTYPE.is_float() {
                    format!("{op} is defined on integer types only, not {}", T::DTYPE)
                } else {
                    format!("{op} is not available on NCCL")
                };
                assert!(
                    e.to_string().contains(&want),
                    "{}: {e}",
                    what("all_reduce", format!("{op}"))
                );
                continue;
            }
            let inputs: Vec<Vec<T>> = (0..p)
                .map(|r| (0..n).map(|i| value(r, i, op)).collect())
                .collect();
            let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::reduce(&refs, op);
            // all_reduce in place.
            let mut bufs = up(&inputs);
            group.all_reduce(&mut bufs, op).unwrap();
            for (r, got) in host(&bufs).iter().enumerate() {
                check(
                    &what("all_reduce in place", format!("{op} device {r}")),
                    got,
                    &want,
                    op,
                    p,
                );
            }
            // all_reduce_into.
            let send = up(&inputs);
            let mut recv = up(&vec![vec![T::from_f64(0.0); n]; p]);
            group.all_reduce_into(&send, &mut recv, op).unwrap();
            for (r, got) in host(&recv).iter().enumerate() {
                check(
                    &what("all_reduce_into", format!("{op} device {r}")),
                    got,
                    &want,
                    op,
                    p,
                );
            }
            assert_eq!(host(&send), inputs, "all_reduce_into changed its input");
            // reduce onto every root.
            for (root, dev) in devs.iter().enumerate() {
                let send = up(&inputs);
                let mut out = GpuBuffer::<T>::zeros(dev, n).unwrap();
                group.reduce(&send, Some(&mut out), op, root).unwrap();
                check(
                    &what("reduce", format!("{op} root {root}")),
                    &out.to_host().unwrap(),
                    &want,
                    op,
                    p,
                );
            }
            // reduce_scatter.
            let big: Vec<Vec<T>> = (0..p)
                .map(|r| (0..n * p).map(|i| value(r, i, op)).collect())
                .collect();
            let big_refs: Vec<&[T]> = big.iter().map(|v| v.as_slice()).collect();
            let big_want = reference::reduce(&big_refs, op);
            let send = up(&big);
            let mut recv = up(&vec![vec![T::from_f64(0.0); n]; p]);
            group.reduce_scatter(&send, &mut recv, op).unwrap();
            for (r, got) in host(&recv).iter().enumerate() {
                check(
                    &what("reduce_scatter", format!("{op} device {r}")),
                    got,
                    &big_want[r * n..(r + 1) * n],
                    op,
                    p,
                );
            }
        }
        let inputs: Vec<Vec<T>> = (0..p)
            .map(|r| (0..n).map(|i| value(r, i, ReduceOp::Sum)).collect())
            .collect();
        // broadcast from every root.
        for root in 0..p {
            let mut bufs = up(&inputs);
            group.broadcast(&mut bufs, root).unwrap();
            for (r, got) in host(&bufs).iter().enumerate() {
                assert_eq!(
                    got,
                    &inputs[root],
                    "{}",
                    what("broadcast", format!("root {root} device {r}"))
                );
            }
        }
        // all_gather, out of place and in place (the raw form with the own slice as input).
        let send = up(&inputs);
        let mut recv = up(&vec![vec![T::from_f64(0.0); n * p]; p]);
        group.all_gather(&send, &mut recv).unwrap();
        let cat = inputs.concat();
        for (r, got) in host(&recv).iter().enumerate() {
            assert_eq!(got, &cat, "{}", what("all_gather", format!("device {r}")));
        }
        let mut slots = vec![vec![T::from_f64(0.0); n * p]; p];
        for (r, s) in slots.iter_mut().enumerate() {
            s[r * n..(r + 1) * n].copy_from_slice(&inputs[r]);
        }
        let recv = up(&slots);
        let es = T::DTYPE.size() as u64;
        let out: Vec<DevicePtr> = recv.iter().enumerate().map(|(r, b)| b.tagged(r)).collect();
        let own: Vec<DevicePtr> = out
            .iter()
            .enumerate()
            .map(|(r, d)| DevicePtr {
                device: r,
                ptr: d.ptr + r as u64 * n as u64 * es,
            })
            .collect();
        group
            .collective_raw(
                Collective::AllGather,
                T::DTYPE,
                n,
                ReduceOp::Sum,
                0,
                &own,
                &out,
            )
            .unwrap();
        for (r, got) in host(&recv).iter().enumerate() {
            assert_eq!(
                got,
                &cat,
                "{}",
                what("all_gather in place", format!("device {r}"))
            );
        }
    }
}

fn sweep(group: &GpuGroup, label: &str, counts: &[usize]) {
    println!("{label}: {} on {:?}", group.algorithm(), group.devices());
    for d in DType::ALL {
        tutti::for_each_dtype!(d, T => { every_collective::<T>(group, label, counts) });
    }
}

#[test]
fn copy_algorithms_on_virtual_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("copy_algorithms_on_virtual_gpus") else {
        return;
    };
    if !nvrtc_or_skip("copy_algorithms_on_virtual_gpus") {
        return;
    }
    for n in [2, 3, 4] {
        let devs = virtual_gpus(&gpus, n);
        for algo in [
            GpuAlgorithm::HierarchicalCopy { group_size: 2 },
            GpuAlgorithm::HierarchicalCopy { group_size: 3 },
            GpuAlgorithm::ReductionToOneDevice { root: 0 },
            GpuAlgorithm::ReductionToOneDevice { root: n - 1 },
        ] {
            let group = GpuGroup::new(&devs, algo, &config()).unwrap();
            assert_eq!(group.algorithm(), algo);
            sweep(
                &group,
                &format!("{n} virtual GPUs, {algo}"),
                &[1, 1000, 70001],
            );
        }
    }
}

#[test]
fn every_algorithm_on_whole_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("every_algorithm_on_whole_gpus") else {
        return;
    };
    let devs = whole_gpus(&gpus);
    let mut algos = vec![];
    if nccl_or_skip("every_algorithm_on_whole_gpus (NCCL part)") {
        algos.push(GpuAlgorithm::Nccl);
    }
    if nvrtc_or_skip("every_algorithm_on_whole_gpus (copy algorithms)") {
        algos.push(GpuAlgorithm::HierarchicalCopy { group_size: 2 });
        algos.push(GpuAlgorithm::ReductionToOneDevice { root: 0 });
    }
    for algo in algos {
        let group = GpuGroup::new(&devs, algo, &config()).unwrap();
        sweep(
            &group,
            &format!("{} whole GPU(s), {algo}", devs.len()),
            &[0, 1, 1000, 70001],
        );
    }
}

#[test]
fn nccl_with_one_rank_per_process_through_the_store() {
    let Some((_gpu, gpus)) = gpus_or_skip("nccl_with_one_rank_per_process_through_the_store")
    else {
        return;
    };
    if !nccl_or_skip("nccl_with_one_rank_per_process_through_the_store") {
        return;
    }
    // One rank: the id goes through a file store.
    let dir = std::env::temp_dir().join(format!("tutti-gpu-test-{}", std::process::id()));
    let store = FileStore::new(&dir).unwrap();
    let devs = whole_gpus(&gpus[..1]);
    let group = GpuGroup::from_store(&store, 0, 1, &devs, &config()).unwrap();
    assert_eq!((group.world_size(), group.first_rank()), (1, 0));
    sweep(&group, "NCCL, one rank", &[1, 1000]);
    drop(group);
    let _ = std::fs::remove_dir_all(&dir);

    // One rank per GPU, each joining through the TCP rendezvous store on its own thread.
    if gpus.len() < 2 {
        // TUTTI_REQUIRE_GPU=2 or more makes this a failure (in gpus_or_skip).
        println!(
            "SKIPPED (two ranks): needs 2 GPUs, this machine has {}",
            gpus.len()
        );
        return;
    }
    let server = TcpStoreServer::start("127.0.0.1:0", "token").unwrap();
    let addr = server.addr().to_string();
    let world = gpus.len();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (addr, gpus) = (addr.clone(), &gpus);
                s.spawn(move || {
                    let store = TcpStore::connect(&addr, "token", Duration::from_secs(30)).unwrap();
                    let devs = whole_gpus(&gpus[r..r + 1]);
                    let group = GpuGroup::from_store(&store, r, world, &devs, &config()).unwrap();
                    assert_eq!(group.first_rank(), r);
                    let n = 4099;
                    for op in ReduceOp::ALL.into_iter().filter(|o| !o.is_bitwise()) {
                        let mine: Vec<f32> = (0..n).map(|i| value(r, i, op)).collect();
                        let mut b = vec![GpuBuffer::from_host(&devs[0], &mine).unwrap()];
                        group.all_reduce(&mut b, op).unwrap();
                        let all: Vec<Vec<f32>> = (0..world)
                            .map(|k| (0..n).map(|i| value(k, i, op)).collect())
                            .collect();
                        let refs: Vec<&[f32]> = all.iter().map(|v| v.as_slice()).collect();
                        check(
                            "NCCL across ranks",
                            &b[0].to_host().unwrap(),
                            &reference::reduce(&refs, op),
                            op,
                            world,
                        );
                    }
                    let mut b = vec![GpuBuffer::from_host(&devs[0], &[r as f64; 10]).unwrap()];
                    group.broadcast(&mut b, world - 1).unwrap();
                    assert_eq!(b[0].to_host().unwrap(), vec![(world - 1) as f64; 10]);
                    // Only the root's process gives a receive buffer.
                    let send = vec![GpuBuffer::from_host(&devs[0], &[1i32; 8]).unwrap()];
                    let mut out = GpuBuffer::<i32>::zeros(&devs[0], 8).unwrap();
                    let recv = (r == 0).then_some(&mut out);
                    group.reduce(&send, recv, ReduceOp::Sum, 0).unwrap();
                    if r == 0 {
                        assert_eq!(out.to_host().unwrap(), vec![world as i32; 8]);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

#[test]
fn a_missing_rank_times_out_and_aborts() {
    let Some((_gpu, gpus)) = gpus_or_skip("a_missing_rank_times_out_and_aborts") else {
        return;
    };
    if !nccl_or_skip("a_missing_rank_times_out_and_aborts") {
        return;
    }
    // Rank 1 of 2 publishes its device count but never joins NCCL: rank 0's setup must end at
    // the timeout, with an error naming the wait, and abort its communicator.
    let dir = std::env::temp_dir().join(format!("tutti-gpu-timeout-{}", std::process::id()));
    let store = FileStore::new(&dir).unwrap();
    use tutti::Store;
    store.add("tutti/gpu/generation/1", 1).unwrap();
    store.set("tutti/gpu/1/devices/1", b"1").unwrap();
    let devs = whole_gpus(&gpus[..1]);
    let t = std::time::Instant::now();
    let short = Config::default().with_timeout(Duration::from_secs(5));
    let e = GpuGroup::from_store(&store, 0, 2, &devs, &short).unwrap_err();
    let m = e.to_string();
    println!("{m}");
    assert!(m.contains("timed out"), "{m}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nccl_refuses_virtual_gpus_and_auto_falls_back() {
    let Some((_gpu, gpus)) = gpus_or_skip("nccl_refuses_virtual_gpus_and_auto_falls_back") else {
        return;
    };
    let devs = virtual_gpus(&gpus, 2);
    let e = GpuGroup::new(&devs, GpuAlgorithm::Nccl, &config()).unwrap_err();
    assert!(
        e.to_string()
            .contains("NCCL refuses two ranks on one physical GPU"),
        "{e}"
    );
    let g = GpuGroup::new(&devs, GpuAlgorithm::Auto, &config()).unwrap();
    assert_eq!(
        g.algorithm(),
        GpuAlgorithm::ReductionToOneDevice { root: 0 }
    );
    assert!(g.fallback_reason().unwrap().contains("NCCL refuses"));
    let whole = whole_gpus(&gpus);
    let g = GpuGroup::new(&whole, GpuAlgorithm::Auto, &config()).unwrap();
    match (gpu::nccl_library(), g.algorithm()) {
        (Ok(_), GpuAlgorithm::Nccl) | (Err(_), GpuAlgorithm::ReductionToOneDevice { root: 0 }) => {}
        // NCCL loads, but its communicators did not start here (a sandbox, say): Auto falls
        // back, saying why.
        (Ok(_), GpuAlgorithm::ReductionToOneDevice { root: 0 }) => {
            let why = g.fallback_reason().unwrap();
            println!("auto fell back: {why}");
            assert!(why.contains("communicators did not start"), "{why}");
        }
        (n, a) => panic!("auto chose {a} (NCCL: {:?})", n.map(|l| l.path)),
    }
}

#[test]
fn wrong_arguments_are_errors_and_the_group_stays_usable() {
    let Some((_gpu, gpus)) = gpus_or_skip("wrong_arguments_are_errors_and_the_group_stays_usable")
    else {
        return;
    };
    if !nvrtc_or_skip("wrong_arguments_are_errors_and_the_group_stays_usable") {
        return;
    }
    let devs = virtual_gpus(&gpus, 2);
    let other = virtual_gpus(&gpus, 2);
    let group = GpuGroup::new(
        &devs,
        GpuAlgorithm::ReductionToOneDevice { root: 0 },
        &config(),
    )
    .unwrap();
    let msg = |r: tutti::Result<()>| r.unwrap_err().to_string();
    let mut one = vec![GpuBuffer::<f32>::zeros(&devs[0], 4).unwrap()];
    assert!(msg(group.all_reduce(&mut one, ReduceOp::Sum)).contains("1 buffers for a group of 2"));
    let mut wrong = vec![
        GpuBuffer::<f32>::zeros(&devs[0], 4).unwrap(),
        GpuBuffer::<f32>::zeros(&other[1], 4).unwrap(),
    ];
    assert!(msg(group.all_reduce(&mut wrong, ReduceOp::Sum)).contains("buffer 1 is on"));
    let mut uneven = vec![
        GpuBuffer::<f32>::zeros(&devs[0], 4).unwrap(),
        GpuBuffer::<f32>::zeros(&devs[1], 5).unwrap(),
    ];
    assert!(msg(group.all_reduce(&mut uneven, ReduceOp::Sum)).contains("buffer 1 has 5 elements"));
    let mut ok = vec![
        GpuBuffer::<f32>::from_host(&devs[0], &[1.0; 4]).unwrap(),
        GpuBuffer::<f32>::from_host(&devs[1], &[2.0; 4]).unwrap(),
    ];
    assert!(msg(group.broadcast(&mut ok, 2)).contains("root 2 is out of range"));
    let small = vec![
        GpuBuffer::<f32>::zeros(&devs[0], 4).unwrap(),
        GpuBuffer::<f32>::zeros(&devs[1], 4).unwrap(),
    ];
    assert!(
        msg(group.all_gather(&ok, &mut small.into_iter().collect::<Vec<_>>())).contains("needs 8")
    );
    // Raw addresses: wrong tag, not device memory, too small.
    let p: Vec<DevicePtr> = ok.iter().enumerate().map(|(i, b)| b.tagged(i)).collect();
    let mut swapped = p.clone();
    swapped.swap(0, 1);
    let raw = |s: &[DevicePtr], n: usize| {
        group.collective_raw(Collective::AllReduce, DType::F32, n, ReduceOp::Sum, 0, s, s)
    };
    assert!(msg(raw(&swapped, 4)).contains("tagged with device"));
    let host = [0f32; 4];
    let bogus = vec![
        DevicePtr {
            device: 0,
            ptr: host.as_ptr() as u64,
        },
        p[1],
    ];
    assert!(msg(raw(&bogus, 4)).contains("not device memory"));
    assert!(msg(raw(&p, 1 << 20)).contains("do not fit"));
    let none = vec![
        DevicePtr { device: 0, ptr: 0 },
        DevicePtr { device: 1, ptr: 0 },
    ];
    let e = group.collective_raw(
        Collective::Reduce,
        DType::F32,
        4,
        ReduceOp::Sum,
        1,
        &p,
        &none,
    );
    assert!(msg(e).contains("receive address is null"));
    // Still usable.
    raw(&p, 4).unwrap();
    group.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
    assert_eq!(ok[1].to_host().unwrap(), vec![6.0; 4]);
}

#[test]
fn perf_rows_are_correct_on_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("perf_rows_are_correct_on_gpus") else {
        return;
    };
    let bw = gpu::device_copy_gbps(gpus[0].ordinal).unwrap();
    let mut runs: Vec<(usize, GpuAlgorithm)> = vec![];
    if nvrtc_or_skip("perf_rows_are_correct_on_gpus (copy algorithms)") {
        runs.push((2, GpuAlgorithm::HierarchicalCopy { group_size: 2 }));
        runs.push((4, GpuAlgorithm::ReductionToOneDevice { root: 0 }));
    }
    if nccl_or_skip("perf_rows_are_correct_on_gpus (NCCL part)") {
        runs.push((1, GpuAlgorithm::Nccl));
    }
    for (n, algo) in runs {
        for c in [
            Collective::AllReduce,
            Collective::Broadcast,
            Collective::AllGather,
            Collective::Reduce,
            Collective::ReduceScatter,
            Collective::AllToAll,
            Collective::AllToAllV,
            Collective::Gather,
            Collective::Scatter,
            Collective::AllGatherV,
            Collective::ReduceScatterV,
        ] {
            for in_place in [false, true] {
                if in_place && !tutti::perf::has_in_place(c) {
                    continue;
                }
                let opts = tutti::perf::Options {
                    collective: c,
                    ranks: n,
                    min_bytes: 1024,
                    max_bytes: 1 << 20,
                    factor: 32,
                    placement: if in_place {
                        tutti::perf::Placement::InPlace
                    } else {
                        tutti::perf::Placement::OutOfPlace
                    },
                    iters: Some(3),
                    config: config(),
                    ..Default::default()
                };
                let rows = tutti::perf::gpu::run(&opts, algo, bw, &|_| {}).unwrap();
                assert_eq!(rows.len(), 3);
                for r in rows {
                    assert_eq!(r.errors, 0, "{r:?}");
                    assert!(r.time_us > 0.0 && r.mem_ratio > 0.0);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Where the libraries are found, and what tutti leaves behind on the caller's thread and GPUs.

/// A scratch directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("tutti-gpu-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(std::fs::canonicalize(&d).unwrap())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A virtual environment found through `PATH` alone (no `VIRTUAL_ENV`): its `bin/python3`
/// leads to its site-packages, where NVRTC is looked for in the CUDA 13 wheel's place, then the
/// CUDA 12 wheel's. An empty file there is passed over with its reason; with a real NVRTC on
/// this machine (`TUTTI_NVRTC_LIBRARY` in CI), a copy of its directory in the wheel's place is
/// found and binds.
#[test]
fn nvrtc_is_found_in_the_virtual_environment_on_path() {
    use gpu::libs::{nvrtc_candidates_in, python_package_dirs, SearchDirs};
    let t = Scratch::new("venv");
    let venv = t.0.join("venv");
    let sp = venv.join("lib/python3.12/site-packages");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    std::fs::write(venv.join("bin/python3"), b"").unwrap();
    let cu13 = sp.join("nvidia/cu13/lib");
    std::fs::create_dir_all(&cu13).unwrap();
    std::fs::write(cu13.join("libnvrtc.so.13"), b"").unwrap();
    let path = std::env::join_paths([venv.join("bin")]).unwrap();
    let dirs = python_package_dirs(Some(&path));
    assert!(dirs.contains(&sp), "{dirs:?}");
    let under = |dirs: &[std::path::PathBuf]| -> Vec<String> {
        nvrtc_candidates_in(&SearchDirs {
            site_packages: dirs.to_vec(),
            ..SearchDirs::default()
        })
        .into_iter()
        .filter(|c| c.starts_with(t.0.to_str().unwrap()))
        .collect()
    };
    let empty = cu13.join("libnvrtc.so.13").to_string_lossy().into_owned();
    assert_eq!(under(&dirs), vec![empty.clone()]);
    let e = gpu::first_nvrtc_library(&under(&dirs)).unwrap_err();
    assert!(e.to_string().starts_with("NVRTC not available: "), "{e}");
    assert!(e.to_string().contains(&format!("{empty}: ")), "{e}");

    // A real NVRTC, placed where its wheel puts it.
    let Ok(real) = gpu::nvrtc_library() else {
        println!("no NVRTC on this machine: the loading part is not run");
        return;
    };
    let file = std::path::Path::new(&real.path);
    let (Some(dir), Some(name)) = (file.parent(), file.file_name().and_then(|n| n.to_str())) else {
        println!(
            "NVRTC came from the dynamic linker ({}): the loading part is not run",
            real.path
        );
        return;
    };
    if dir.as_os_str().is_empty() {
        println!(
            "NVRTC came from the dynamic linker ({}): the loading part is not run",
            real.path
        );
        return;
    }
    let wheel_dir = match name {
        "libnvrtc.so.13" => "nvidia/cu13/lib",
        "libnvrtc.so.12" => "nvidia/cuda_nvrtc/lib",
        _ => {
            println!(
                "NVRTC is {}: not a wheel's name; the loading part is not run",
                real.path
            );
            return;
        }
    };
    std::fs::remove_dir_all(sp.join("nvidia")).unwrap();
    let place = sp.join(wheel_dir);
    std::fs::create_dir_all(place.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(std::fs::canonicalize(dir).unwrap(), &place).unwrap();
    let found = under(&python_package_dirs(Some(&path)));
    assert_eq!(found, vec![place.join(name).to_string_lossy().into_owned()]);
    let l = gpu::first_nvrtc_library(&found).unwrap();
    assert_eq!(
        (l.path.as_str(), l.version),
        (found[0].as_str(), real.version)
    );
    println!("NVRTC {:?} found through PATH at {}", l.version, l.path);
}

/// The CUDA driver's own view, for the checks below: whether GPU `ordinal`'s primary context is
/// active in this process, and the calling thread's current context.
fn primary_context_active(ordinal: usize) -> bool {
    use cudarc::driver::sys;
    let (mut dev, mut flags, mut active) = (0, 0u32, 0i32);
    // SAFETY: valid out-pointers; tutti found the driver (the callers listed the GPUs).
    unsafe {
        assert_eq!(
            sys::cuDeviceGet(&mut dev, ordinal as i32),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    active != 0
}

fn current_context() -> cudarc::driver::sys::CUcontext {
    use cudarc::driver::sys;
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the driver is loaded.
    assert_eq!(
        unsafe { sys::cuCtxGetCurrent(&mut c) },
        sys::CUresult::CUDA_SUCCESS
    );
    c
}

/// Listing GPUs makes no context on any of them (in a fresh process: this one may have opened
/// GPUs in other tests): the child runs `devices()`, `status()` and a plan of whole GPUs, and
/// checks with the driver that no primary context is active.
#[test]
fn listing_gpus_creates_no_context() {
    const CHILD: &str = "TUTTI_GPU_TEST_LISTING_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let gpus = gpu::devices().unwrap();
        let _ = gpu::status();
        let _ = tutti::discover_devices();
        let _ = gpu::plan_replicas(gpus.len(), &gpus).unwrap();
        for g in &gpus {
            assert!(
                !primary_context_active(g.ordinal),
                "listing made a context on GPU {}",
                g.ordinal
            );
        }
        println!("child: no context on {} GPU(s)", gpus.len());
        return;
    }
    let Some((_gpu, _gpus)) = gpus_or_skip("listing_gpus_creates_no_context") else {
        return;
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "listing_gpus_creates_no_context",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        // XLA discovery (`discover_devices` with the `xla` feature) makes a client of the PJRT
        // plugin it finds, and a CUDA plugin's client holds a context of its own on the GPU:
        // the plugin's, not the listing's. A plugin that does not exist keeps this to tutti's.
        .env("TUTTI_PJRT_PLUGIN", "/nonexistent/tutti-test/plugin.so")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    assert!(out.status.success(), "{text}");
    assert!(text.contains("child: no context on"), "{text}");
}

/// tutti's calls leave the caller's current context current: none, or one of the caller's own
/// (another library's), through opening GPUs, buffers and their host copies, groups and their
/// collectives (each algorithm there is), and drops.
#[test]
fn the_callers_context_stays_current() {
    use cudarc::driver::sys;
    let Some((_gpu, gpus)) = gpus_or_skip("the_callers_context_stays_current") else {
        return;
    };
    let mut algos = vec![];
    if nvrtc_or_skip("the_callers_context_stays_current (copy algorithms)") {
        algos.push(GpuAlgorithm::ReductionToOneDevice { root: 0 });
    }
    if nccl_or_skip("the_callers_context_stays_current (NCCL part)") {
        algos.push(GpuAlgorithm::Nccl);
    }
    let exercise = |want: sys::CUcontext, label: &str| {
        let same = |step: &str| {
            assert_eq!(current_context(), want, "{label}: after {step}");
        };
        let devs = whole_gpus(&gpus);
        same("opening the GPUs");
        for &algo in &algos {
            let group = GpuGroup::new(&devs, algo, &config()).unwrap();
            same(&format!("making a {algo} group"));
            let mut bufs: Vec<GpuBuffer<f32>> = devs
                .iter()
                .map(|d| GpuBuffer::from_host(d, &[1.0; 1000]).unwrap())
                .collect();
            same("copying to the GPUs");
            group.all_reduce(&mut bufs, ReduceOp::Sum).unwrap();
            same(&format!("a {algo} all-reduce"));
            assert_eq!(bufs[0].to_host().unwrap(), vec![devs.len() as f32; 1000]);
            same("copying to the host");
            devs[0].synchronize().unwrap();
            drop(bufs);
            drop(group);
            same(&format!("dropping the {algo} group and its buffers"));
        }
        let _ = gpus[0].current_free_memory().unwrap();
        same("reading the free memory");
        drop(devs);
        same("dropping the devices");
    };
    // No context current.
    // SAFETY: unbinds whatever is current on this test thread.
    assert_eq!(
        unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) },
        sys::CUresult::CUDA_SUCCESS
    );
    exercise(std::ptr::null_mut(), "no current context");
    // A context of the caller's own on GPU 0 (not tutti's primary context).
    let mut dev = 0;
    let mut mine: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the context is destroyed below.
    unsafe {
        assert_eq!(
            sys::cuDeviceGet(&mut dev, gpus[0].ordinal as i32),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuCtxCreate_v2(&mut mine, 0, dev),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    assert_eq!(current_context(), mine);
    exercise(mine, "the caller's own context");
    // SAFETY: the context made above, current on this thread and no longer used.
    unsafe {
        assert_eq!(sys::cuCtxDestroy_v2(mine), sys::CUresult::CUDA_SUCCESS);
    }
}

/// A collective that times out marks its devices failed: the buffers dropped after it do not
/// wait the device's timeout again (they are freed once the stream is idle, or left allocated
/// while it is busy), nothing panics, and the devices work again once their streams drain.
#[test]
fn drops_after_a_timeout_do_not_wait_again() {
    let Some((_gpu, gpus)) = gpus_or_skip("drops_after_a_timeout_do_not_wait_again") else {
        return;
    };
    if !nvrtc_or_skip("drops_after_a_timeout_do_not_wait_again") {
        return;
    }
    let devs = virtual_gpus(&gpus, 2);
    let n = 32 << 20;
    let tiny = Config::default().with_timeout(Duration::from_nanos(1));
    let group =
        GpuGroup::new(&devs, GpuAlgorithm::ReductionToOneDevice { root: 0 }, &tiny).unwrap();
    // Compile and load the kernels first, so that the timed call is all GPU work.
    let ok = GpuGroup::new(
        &devs,
        GpuAlgorithm::ReductionToOneDevice { root: 0 },
        &config(),
    )
    .unwrap();
    let mut small: Vec<GpuBuffer<f32>> = devs
        .iter()
        .map(|d| GpuBuffer::from_host(d, &[1.0; 4]).unwrap())
        .collect();
    ok.all_reduce(&mut small, ReduceOp::Sum).unwrap();
    let mut bufs: Vec<GpuBuffer<f32>> = devs
        .iter()
        .map(|d| GpuBuffer::zeros(d, n).unwrap())
        .collect();
    let mut timed_out = false;
    for _ in 0..20 {
        match group.all_reduce(&mut bufs, ReduceOp::Sum) {
            Err(Error::Timeout { .. }) => {
                timed_out = true;
                break;
            }
            Err(e) => panic!("{e}"),
            Ok(()) => {}
        }
    }
    assert!(timed_out, "a 1 ns timeout never passed");
    let t = std::time::Instant::now();
    drop(bufs);
    drop(small);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "dropping after a timeout took {:?}",
        t.elapsed()
    );
    // The streams drain: the devices work again.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for d in &devs {
        while d.synchronize().is_err() {
            assert!(std::time::Instant::now() < deadline, "{d:?} stays busy");
        }
    }
    let b = GpuBuffer::from_host(&devs[0], &[3.0f32; 8]).unwrap();
    assert_eq!(b.to_host().unwrap(), vec![3.0; 8]);
}

/// A `cuda:0` rank with the caller's stream set: each call, issued right after the caller
/// queued slow work and then its input's values on that stream (no synchronization between),
/// reads those values: the call's GPU work waits for the stream's work before it.
#[test]
fn calls_wait_for_the_callers_stream() {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    let Some((_gpu, gpus)) = gpus_or_skip("calls_wait_for_the_callers_stream") else {
        return;
    };
    if !nccl_or_skip("calls_wait_for_the_callers_stream (NCCL)")
        && !nvrtc_or_skip("calls_wait_for_the_callers_stream (copy algorithms)")
    {
        return;
    }
    const N: usize = 32 << 20;
    let mut comms = tutti::device_group(&["cuda:0"], &config()).unwrap();
    let (mut dev, mut ctx, mut stream) = (0, std::ptr::null_mut(), std::ptr::null_mut());
    let (mut input, mut output) = (0, 0);
    // SAFETY: the driver is loaded (the GPUs were listed); every handle made here is released
    // at the end, and the stream outlives its use by the communicator (unset before it goes).
    unsafe {
        assert_eq!(
            sys::cuDeviceGet(&mut dev, gpus[0].ordinal as i32),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut stream, 1), CUDA_SUCCESS); // non-blocking
        assert_eq!(sys::cuMemAlloc_v2(&mut input, N * 4), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAlloc_v2(&mut output, N * 4), CUDA_SUCCESS);
        assert_eq!(sys::cuMemsetD32_v2(output, 0, N), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxSynchronize(), CUDA_SUCCESS);
        comms[0].set_cuda_stream(Some(stream as u64)).unwrap();
        let mut host = vec![0f32; N];
        for round in 1..=3u32 {
            for _ in 0..16 {
                assert_eq!(sys::cuMemsetD32Async(input, 0, N, stream), CUDA_SUCCESS);
            }
            let v = round as f32;
            assert_eq!(
                sys::cuMemsetD32Async(input, v.to_bits(), N, stream),
                CUDA_SUCCESS
            );
            comms[0]
                .run_raw(&RawCall {
                    collective: Collective::AllReduce,
                    dtype: DType::F32,
                    count: N,
                    op: ReduceOp::Sum,
                    root: 0,
                    input: input as *const u8,
                    output: output as *mut u8,
                    counts: &[],
                    recv_counts: &[],
                })
                .unwrap();
            assert_eq!(
                sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), output, N * 4),
                CUDA_SUCCESS
            );
            let wrong = host.iter().filter(|&&x| x != v).count();
            assert_eq!(
                wrong, 0,
                "round {round}: {wrong} elements missed the stream's values"
            );
        }
        comms[0].set_cuda_stream(None).unwrap();
        drop(comms);
        assert_eq!(sys::cuMemFree_v2(input), CUDA_SUCCESS);
        assert_eq!(sys::cuMemFree_v2(output), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamDestroy_v2(stream), CUDA_SUCCESS);
        let mut popped = std::ptr::null_mut();
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(dev), CUDA_SUCCESS);
    }
}

/// A `cuda:0` rank with the caller's stream set: work the caller queues on that stream right
/// after issuing a non-blocking call (without waiting for its handle) runs after the call's
/// GPU work, as with NCCL: a copy of the call's output queued there reads the call's result.
#[test]
fn work_queued_on_the_stream_after_a_call_waits_for_it() {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    let Some((_gpu, gpus)) = gpus_or_skip("work_queued_on_the_stream_after_a_call_waits_for_it")
    else {
        return;
    };
    if !nccl_or_skip("work_queued_on_the_stream_after_a_call_waits_for_it (NCCL)")
        && !nvrtc_or_skip("work_queued_on_the_stream_after_a_call_waits_for_it (copies)")
    {
        return;
    }
    const N: usize = 32 << 20;
    let mut comms = tutti::device_group(&["cuda:0"], &config()).unwrap();
    let (mut dev, mut ctx, mut stream) = (0, std::ptr::null_mut(), std::ptr::null_mut());
    let (mut input, mut output, mut copy) = (0, 0, 0);
    // SAFETY: the driver is loaded (the GPUs were listed); every handle made here is released
    // at the end, and the stream outlives its use by the communicator (unset before it goes).
    unsafe {
        assert_eq!(
            sys::cuDeviceGet(&mut dev, gpus[0].ordinal as i32),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut stream, 1), CUDA_SUCCESS); // non-blocking
        for p in [&mut input, &mut output, &mut copy] {
            assert_eq!(sys::cuMemAlloc_v2(p, N * 4), CUDA_SUCCESS);
        }
        comms[0].set_cuda_stream(Some(stream as u64)).unwrap();
        let mut host = vec![0f32; N];
        for round in 1..=3u32 {
            let v = round as f32;
            assert_eq!(sys::cuMemsetD32Async(output, 0, N, stream), CUDA_SUCCESS);
            assert_eq!(sys::cuMemsetD32Async(copy, 0, N, stream), CUDA_SUCCESS);
            for _ in 0..16 {
                assert_eq!(sys::cuMemsetD32Async(input, 0, N, stream), CUDA_SUCCESS);
            }
            assert_eq!(
                sys::cuMemsetD32Async(input, v.to_bits(), N, stream),
                CUDA_SUCCESS
            );
            let work = comms[0].issue_raw(&RawCall {
                collective: Collective::AllReduce,
                dtype: DType::F32,
                count: N,
                op: ReduceOp::Sum,
                root: 0,
                input: input as *const u8,
                output: output as *mut u8,
                counts: &[],
                recv_counts: &[],
            });
            // Queued after the call, before its handle is waited: runs after the call's work.
            assert_eq!(
                sys::cuMemcpyDtoDAsync_v2(copy, output, N * 4, stream),
                CUDA_SUCCESS
            );
            assert_eq!(sys::cuStreamSynchronize(stream), CUDA_SUCCESS);
            assert!(
                work.is_completed(),
                "round {round}: the stream is done, the call not"
            );
            work.wait().unwrap();
            assert_eq!(
                sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), copy, N * 4),
                CUDA_SUCCESS
            );
            let wrong = host.iter().filter(|&&x| x != v).count();
            assert_eq!(
                wrong, 0,
                "round {round}: {wrong} elements of the copy queued after the call missed its result"
            );
        }
        comms[0].set_cuda_stream(None).unwrap();
        drop(comms);
        for p in [input, output, copy] {
            assert_eq!(sys::cuMemFree_v2(p), CUDA_SUCCESS);
        }
        assert_eq!(sys::cuStreamDestroy_v2(stream), CUDA_SUCCESS);
        let mut popped = std::ptr::null_mut();
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(dev), CUDA_SUCCESS);
    }
}

/// The inputs of a personalized call: rank r's element i, distinct across ranks and blocks.
fn personal_inputs(p: usize, len: usize) -> Vec<Vec<i32>> {
    (0..p)
        .map(|r| (0..len).map(|i| (r * 1_000_003 + i) as i32).collect())
        .collect()
}

/// All-to-all, gather and scatter of equal blocks on `group`: every rank's output against the
/// reference, for each count and root.
fn personalized_sweep(group: &GpuGroup, label: &str) {
    let devs = group.devices().to_vec();
    let p = devs.len();
    let ptrs = |bufs: &[GpuBuffer<i32>]| -> Vec<DevicePtr> {
        bufs.iter()
            .enumerate()
            .map(|(device, b)| DevicePtr {
                device,
                ptr: b.device_ptr(),
            })
            .collect()
    };
    let up = |v: &[Vec<i32>]| -> Vec<GpuBuffer<i32>> {
        v.iter()
            .zip(&devs)
            .map(|(x, d)| GpuBuffer::from_host(d, x).unwrap())
            .collect()
    };
    let zeros = |len: usize| -> Vec<GpuBuffer<i32>> {
        devs.iter()
            .map(|d| GpuBuffer::zeros(d, len).unwrap())
            .collect()
    };
    for n in [0usize, 1, 7, 70001] {
        let block = |v: &[i32], k: usize| v[k * n..(k + 1) * n].to_vec();
        // all_to_all: rank k's block j is rank j's block k.
        let inputs = personal_inputs(p, p * n);
        let (send, recv) = (up(&inputs), zeros(p * n));
        group
            .collective_raw(
                Collective::AllToAll,
                DType::I32,
                n,
                ReduceOp::Sum,
                0,
                &ptrs(&send),
                &ptrs(&recv),
            )
            .unwrap();
        for (k, got) in host(&recv).iter().enumerate() {
            let want: Vec<i32> = (0..p).flat_map(|j| block(&inputs[j], k)).collect();
            assert!(got == &want, "{label}: all_to_all n={n}, rank {k}");
        }
        for root in [0, p - 1] {
            // gather: the root's block j is rank j's input; the others receive nothing.
            let inputs = personal_inputs(p, n);
            let (send, recv) = (up(&inputs), zeros(p * n));
            let mut at = ptrs(&recv);
            for (k, d) in at.iter_mut().enumerate() {
                if k != root {
                    d.ptr = 0;
                }
            }
            group
                .collective_raw(
                    Collective::Gather,
                    DType::I32,
                    n,
                    ReduceOp::Sum,
                    root,
                    &ptrs(&send),
                    &at,
                )
                .unwrap();
            let got = host(&recv);
            assert_eq!(
                got[root],
                inputs.concat(),
                "{label}: gather n={n} root {root}"
            );
            for (k, g) in got.iter().enumerate().filter(|(k, _)| *k != root) {
                assert!(
                    g.iter().all(|&x| x == 0),
                    "{label}: gather wrote to rank {k}"
                );
            }
            // scatter: rank k gets block k of the root's input; the others send nothing.
            let inputs = personal_inputs(p, p * n);
            let (send, recv) = (up(&inputs), zeros(n));
            let mut from = ptrs(&send);
            for (k, d) in from.iter_mut().enumerate() {
                if k != root {
                    d.ptr = 0;
                }
            }
            group
                .collective_raw(
                    Collective::Scatter,
                    DType::I32,
                    n,
                    ReduceOp::Sum,
                    root,
                    &from,
                    &ptrs(&recv),
                )
                .unwrap();
            for (k, got) in host(&recv).iter().enumerate() {
                assert_eq!(
                    got,
                    &block(&inputs[root], k),
                    "{label}: scatter n={n} root {root}, rank {k}"
                );
            }
        }
        // A root without its buffer is an argument error, before anything is queued.
        if n > 0 {
            let (send, recv) = (up(&personal_inputs(p, n)), zeros(p * n));
            let mut at = ptrs(&recv);
            at[0].ptr = 0;
            let e = group
                .collective_raw(
                    Collective::Gather,
                    DType::I32,
                    n,
                    ReduceOp::Sum,
                    0,
                    &ptrs(&send),
                    &at,
                )
                .unwrap_err();
            assert!(
                e.to_string().contains("receive address is null"),
                "{label}: {e}"
            );
        }
    }
    println!("{label}: all_to_all, gather and scatter correct");
}

/// The calls with a count per block on `group`: all_gather_v, reduce_scatter_v (every op, in
/// `T`) and all_to_all_v over uneven counts, zeros among them, against the reference; a pair of
/// all_to_all_v counts that disagree is an error naming both ranks, and the group goes on.
fn varying_sweep<T: Element>(group: &GpuGroup, label: &str) {
    let devs = group.devices().to_vec();
    let p = devs.len();
    let ptrs = |bufs: &[GpuBuffer<T>]| -> Vec<DevicePtr> {
        bufs.iter()
            .enumerate()
            .map(|(device, b)| DevicePtr {
                device,
                ptr: b.device_ptr(),
            })
            .collect()
    };
    let up = |v: &[Vec<T>]| -> Vec<GpuBuffer<T>> {
        v.iter()
            .zip(&devs)
            .map(|(x, d)| GpuBuffer::from_host(d, x).unwrap())
            .collect()
    };
    let zeros = |lens: &[usize]| -> Vec<GpuBuffer<T>> {
        devs.iter()
            .zip(lens)
            .map(|(d, &n)| GpuBuffer::zeros(d, n).unwrap())
            .collect()
    };
    let offsets = |c: &[usize]| -> Vec<usize> {
        std::iter::once(0)
            .chain(c.iter().scan(0, |a, &n| {
                *a += n;
                Some(*a)
            }))
            .collect()
    };
    let distinct = |r: usize, i: usize| T::from_f64(((r * 37 + i) % 101) as f64);
    for scale in [0usize, 1, 7, 20011] {
        // Rank k's count: uneven, one rank's zero where there are several.
        let counts: Vec<usize> = (0..p)
            .map(|k| if p > 1 && k == 1 { 0 } else { (k + 1) * scale })
            .collect();
        let o = offsets(&counts);
        let total = o[p];
        // all_gather_v: block k of every output is rank k's input.
        let inputs: Vec<Vec<T>> = (0..p)
            .map(|r| (0..counts[r]).map(|i| distinct(r, i)).collect())
            .collect();
        let (send, recv) = (up(&inputs), zeros(&vec![total; p]));
        group
            .all_gather_v_raw(T::DTYPE, &counts, &ptrs(&send), &ptrs(&recv))
            .unwrap();
        let want: Vec<T> = inputs.concat();
        for (k, got) in host(&recv).iter().enumerate() {
            assert!(got == &want, "{label}: all_gather_v {counts:?}, rank {k}");
        }
        // reduce_scatter_v: rank k's output is block k of the reduction, for every op.
        let nccl = group.algorithm() == GpuAlgorithm::Nccl;
        for op in ReduceOp::ALL {
            if op.check(T::DTYPE).is_err() || (op.is_bitwise() && nccl) {
                continue;
            }
            let inputs: Vec<Vec<T>> = (0..p)
                .map(|r| (0..total).map(|i| value::<T>(r, i, op)).collect())
                .collect();
            let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
            let full = reference::reduce(&refs, op);
            let (send, recv) = (up(&inputs), zeros(&counts));
            group
                .reduce_scatter_v_raw(T::DTYPE, op, &counts, &ptrs(&send), &ptrs(&recv))
                .unwrap();
            for (k, got) in host(&recv).iter().enumerate() {
                let what = format!("{label}: reduce_scatter_v {op} {counts:?}, rank {k}");
                check(&what, got, &full[o[k]..o[k + 1]], op, p);
            }
        }
        // all_to_all_v: rank i sends ((i + 2j) % 3) × scale elements to rank j.
        let pair = |i: usize, j: usize| (i + 2 * j) % 3 * scale;
        let send_counts: Vec<Vec<usize>> = (0..p)
            .map(|i| (0..p).map(|j| pair(i, j)).collect())
            .collect();
        let recv_counts: Vec<Vec<usize>> = (0..p)
            .map(|k| (0..p).map(|j| pair(j, k)).collect())
            .collect();
        let inputs: Vec<Vec<T>> = (0..p)
            .map(|r| {
                let n: usize = send_counts[r].iter().sum();
                (0..n).map(|i| distinct(r, i)).collect()
            })
            .collect();
        let recv_lens: Vec<usize> = recv_counts.iter().map(|c| c.iter().sum()).collect();
        let (send, recv) = (up(&inputs), zeros(&recv_lens));
        let sc: Vec<&[usize]> = send_counts.iter().map(|v| v.as_slice()).collect();
        let rc: Vec<&[usize]> = recv_counts.iter().map(|v| v.as_slice()).collect();
        group
            .all_to_all_v_raw(T::DTYPE, &ptrs(&send), &sc, &ptrs(&recv), &rc)
            .unwrap();
        for (k, got) in host(&recv).iter().enumerate() {
            let want: Vec<T> = (0..p)
                .flat_map(|j| {
                    let from = offsets(&send_counts[j]);
                    inputs[j][from[k]..from[k + 1]].to_vec()
                })
                .collect();
            assert!(
                got == &want,
                "{label}: all_to_all_v scale {scale}, rank {k}"
            );
        }
        // A pair whose counts disagree: refused before anything moves, naming both ranks.
        if p > 1 && scale > 0 {
            let mut wrong = recv_counts.clone();
            wrong[p - 1][0] += 1;
            let lens: Vec<usize> = wrong.iter().map(|c| c.iter().sum()).collect();
            let recv = zeros(&lens);
            let rc: Vec<&[usize]> = wrong.iter().map(|v| v.as_slice()).collect();
            let e = group
                .all_to_all_v_raw(T::DTYPE, &ptrs(&send), &sc, &ptrs(&recv), &rc)
                .unwrap_err()
                .to_string();
            let (a, b) = ("rank 0".to_string(), format!("rank {}", p - 1));
            assert!(
                e.contains(&a) && e.contains(&b) && e.contains("expects"),
                "{label}: {e}"
            );
        }
    }
    println!(
        "{label}: all_gather_v, reduce_scatter_v and all_to_all_v of {} correct",
        T::DTYPE
    );
}

#[test]
fn calls_with_a_count_per_block_on_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("calls_with_a_count_per_block_on_gpus") else {
        return;
    };
    if nvrtc_or_skip("calls_with_a_count_per_block_on_gpus (copies between logical GPUs)") {
        for n in [1, 2, 3, 4] {
            let devs = virtual_gpus(&gpus, n);
            let algo = GpuAlgorithm::HierarchicalCopy { group_size: 2 };
            let group = GpuGroup::new(&devs, algo, &config()).unwrap();
            let label = format!("{n} virtual GPUs, copies");
            varying_sweep::<f32>(&group, &label);
            varying_sweep::<i32>(&group, &label);
            varying_sweep::<tutti::bf16>(&group, &label);
            varying_sweep::<u8>(&group, &label);
        }
    }
    if nccl_or_skip("calls_with_a_count_per_block_on_gpus (NCCL)") {
        let devs = whole_gpus(&gpus);
        let group = GpuGroup::new(&devs, GpuAlgorithm::Nccl, &config()).unwrap();
        let label = format!("{} whole GPU(s), NCCL", devs.len());
        varying_sweep::<f32>(&group, &label);
        varying_sweep::<i64>(&group, &label);
        // Through a communicator of the device: the call is checked, its counts reach the
        // engine with its buffers.
        let comms = tutti::device_group(&["cuda:0"], &config()).unwrap();
        let input = GpuBuffer::from_host(&devs[0], &[5i32, 6, 7]).unwrap();
        let mut output = GpuBuffer::<i32>::zeros(&devs[0], 3).unwrap();
        for c in [
            Collective::AllToAllV,
            Collective::AllGatherV,
            Collective::ReduceScatterV,
        ] {
            assert!(comms[0].runs(c), "{c}");
            // SAFETY: both addresses are live device memory of 3 i32 on the group's GPU,
            // held until the call has returned.
            unsafe {
                comms[0].run_raw(&RawCall {
                    collective: c,
                    dtype: DType::I32,
                    count: 3,
                    op: ReduceOp::Sum,
                    root: 0,
                    input: input.device_ptr() as *const u8,
                    output: output.device_ptr() as *mut u8,
                    counts: &[3],
                    recv_counts: &[3],
                })
            }
            .unwrap();
            assert_eq!(output.to_host().unwrap(), vec![5, 6, 7], "{c}");
            output.copy_from_host(&[0, 0, 0]).unwrap();
        }
        // A count list that is not one count per rank is the communicator's argument error.
        // SAFETY: as above; the call is refused before anything is read.
        let e = unsafe {
            comms[0].run_raw(&RawCall {
                collective: Collective::AllGatherV,
                dtype: DType::I32,
                count: 3,
                op: ReduceOp::Sum,
                root: 0,
                input: input.device_ptr() as *const u8,
                output: output.device_ptr() as *mut u8,
                counts: &[2, 1],
                recv_counts: &[],
            })
        }
        .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("one per rank"),
            "{e}"
        );
    }
}

/// A point-to-point group of `ops` (send?, device address, elements of `T`, peer) on `comm`.
fn pairs<T: Element>(
    comm: &tutti::Communicator,
    ops: &[(bool, u64, usize, usize)],
) -> tutti::Result<()> {
    let raw: Vec<tutti::RawPeerOp> = ops
        .iter()
        .map(|&(send, ptr, n, peer)| tutti::RawPeerOp {
            send,
            peer,
            dtype: T::DTYPE,
            ptr: ptr as *mut u8,
            len: n * T::DTYPE.size(),
        })
        .collect();
    // SAFETY: every address is live device memory of `n` elements, held by the caller until
    // this returns (the handle is waited for here).
    unsafe { comm.send_recv_raw_async(&raw) }.wait().map(drop)
}

/// Point-to-point between the ranks of an in-process group of logical GPUs (its
/// communicators): a ring of grouped sends and receives, messages of one pair in issue order, a
/// send to the rank itself, zero elements; a count mismatch fails both sides naming both ranks;
/// host memory is refused before anything moves; a receive with no send times out naming the
/// peer.
#[test]
fn point_to_point_between_logical_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("point_to_point_between_logical_gpus") else {
        return;
    };
    let p = 3;
    let devs = virtual_gpus(&gpus, p);
    let algo = GpuAlgorithm::ReductionToOneDevice { root: 0 };
    let comms = GpuGroup::new(&devs, algo, &config())
        .unwrap()
        .into_communicators(&config())
        .unwrap();
    for c in [Collective::Send, Collective::Recv, Collective::SendRecv] {
        assert!(comms[0].runs(c), "{c}");
    }
    for n in [0usize, 1, 7, 70001] {
        let inputs: Vec<Vec<f32>> = (0..p)
            .map(|r| (0..n).map(|i| (r * 100_003 + i) as f32).collect())
            .collect();
        let send: Vec<GpuBuffer<f32>> = inputs
            .iter()
            .zip(&devs)
            .map(|(v, d)| GpuBuffer::from_host(d, v).unwrap())
            .collect();
        let zeros = || -> Vec<GpuBuffer<f32>> {
            devs.iter()
                .map(|d| GpuBuffer::zeros(d, n).unwrap())
                .collect()
        };
        let (ring, twice, own) = (zeros(), zeros(), zeros());
        std::thread::scope(|s| {
            for (r, comm) in comms.iter().enumerate() {
                let (send, ring, twice, own) = (&send, &ring, &twice, &own);
                s.spawn(move || {
                    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
                    // A ring: every rank sends right and receives from the left, grouped.
                    pairs::<f32>(
                        comm,
                        &[
                            (true, send[r].device_ptr(), n, next),
                            (false, ring[r].device_ptr(), n, prev),
                        ],
                    )
                    .unwrap();
                    // Two messages of one pair, in two calls each side: they keep their order.
                    if r == 0 {
                        pairs::<f32>(comm, &[(true, send[0].device_ptr(), n, 2)]).unwrap();
                        pairs::<f32>(comm, &[(true, send[1].device_ptr(), n, 2)]).unwrap();
                    }
                    if r == 2 {
                        pairs::<f32>(comm, &[(false, twice[0].device_ptr(), n, 0)]).unwrap();
                        pairs::<f32>(comm, &[(false, twice[1].device_ptr(), n, 0)]).unwrap();
                    }
                    // To itself, in one group.
                    pairs::<f32>(
                        comm,
                        &[
                            (true, send[r].device_ptr(), n, r),
                            (false, own[r].device_ptr(), n, r),
                        ],
                    )
                    .unwrap();
                });
            }
        });
        for r in 0..p {
            let prev = (r + p - 1) % p;
            assert_eq!(
                ring[r].to_host().unwrap(),
                inputs[prev],
                "ring n={n}, rank {r}"
            );
            assert_eq!(
                own[r].to_host().unwrap(),
                inputs[r],
                "to itself n={n}, rank {r}"
            );
        }
        assert_eq!(
            twice[0].to_host().unwrap(),
            inputs[0],
            "first of two, n={n}"
        );
        assert_eq!(
            twice[1].to_host().unwrap(),
            inputs[1],
            "second of two, n={n}"
        );
    }
    println!("{p} logical GPUs: ring, ordered pairs and sends to itself correct");

    // Host memory on a device rank: the call's argument error, before anything moves.
    let host = [1.0f32; 4];
    let e = pairs::<f32>(&comms[0], &[(true, host.as_ptr() as u64, 4, 1)]).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("not device memory"),
        "{e}"
    );

    // A count mismatch: both sides fail, each naming both ranks.
    let a = GpuBuffer::<f32>::zeros(&devs[0], 4).unwrap();
    let b = GpuBuffer::<f32>::zeros(&devs[1], 5).unwrap();
    let (e0, e1) = std::thread::scope(|s| {
        let t = s.spawn(|| pairs::<f32>(&comms[0], &[(true, a.device_ptr(), 4, 1)]).unwrap_err());
        let e1 = pairs::<f32>(&comms[1], &[(false, b.device_ptr(), 5, 0)]).unwrap_err();
        (t.join().unwrap(), e1)
    });
    for e in [&e0, &e1] {
        let m = e.to_string();
        assert!(
            m.contains("rank 0")
                && m.contains("rank 1")
                && m.contains("4 f32")
                && m.contains("5 f32"),
            "{m}"
        );
    }
    // The failure aborted the communicators: a later call fails at once, saying so.
    let c = GpuBuffer::<f32>::zeros(&devs[2], 4).unwrap();
    let started = std::time::Instant::now();
    let e = pairs::<f32>(&comms[2], &[(false, c.device_ptr(), 4, 0)]).unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(comms);

    // A receive whose send never comes: a timeout naming the peer, within the timeout.
    let short = config().with_timeout(Duration::from_secs(2));
    let comms = GpuGroup::new(&devs, algo, &short)
        .unwrap()
        .into_communicators(&short)
        .unwrap();
    let started = std::time::Instant::now();
    let e = pairs::<f32>(&comms[1], &[(false, b.device_ptr(), 5, 2)]).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    match &e {
        Error::Timeout { waiting_for, .. } => assert_eq!(waiting_for, &vec![2], "{e}"),
        e => panic!("not a timeout: {e}"),
    }
}

#[test]
fn personalized_calls_on_gpus() {
    let Some((_gpu, gpus)) = gpus_or_skip("personalized_calls_on_gpus") else {
        return;
    };
    if nvrtc_or_skip("personalized_calls_on_gpus (copies between logical GPUs)") {
        for n in [2, 3] {
            let devs = virtual_gpus(&gpus, n);
            let algo = GpuAlgorithm::ReductionToOneDevice { root: 0 };
            let group = GpuGroup::new(&devs, algo, &config()).unwrap();
            personalized_sweep(&group, &format!("{n} virtual GPUs, copies"));
        }
    }
    if nccl_or_skip("personalized_calls_on_gpus (NCCL)") {
        let devs = whole_gpus(&gpus);
        let group = GpuGroup::new(&devs, GpuAlgorithm::Nccl, &config()).unwrap();
        personalized_sweep(&group, &format!("{} whole GPU(s), NCCL", devs.len()));
        // Through a communicator of the devices: the call is checked, then the engine runs it.
        let comms = tutti::device_group(&["cuda:0"], &config()).unwrap();
        let input = GpuBuffer::from_host(&devs[0], &[5i32, 6, 7]).unwrap();
        let output = GpuBuffer::<i32>::zeros(&devs[0], 3).unwrap();
        assert!(comms[0].runs(Collective::AllToAll) && comms[0].runs(Collective::AllToAllV));
        // SAFETY: both addresses are live device memory of 3 i32 on the group's GPU, held
        // until the call has returned.
        unsafe {
            comms[0].run_raw(&RawCall {
                collective: Collective::AllToAll,
                dtype: DType::I32,
                count: 3,
                op: ReduceOp::Sum,
                root: 0,
                input: input.device_ptr() as *const u8,
                output: output.device_ptr() as *mut u8,
                counts: &[],
                recv_counts: &[],
            })
        }
        .unwrap();
        assert_eq!(output.to_host().unwrap(), vec![5, 6, 7]);
    }
}
