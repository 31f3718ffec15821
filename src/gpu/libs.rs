//! Finding the CUDA driver, NVRTC and NCCL at run time, without ever panicking.
//!
//! Nothing is linked at build time: a build with the `cuda` feature runs on machines without any
//! of these libraries and reports what is missing as [`Error::Unavailable`].
//!
//! * **libcuda** (the driver) is installed with the NVIDIA driver as `libcuda.so.1` in the
//!   dynamic linker's path; cudarc's loader finds it. Its presence is tested before the first
//!   call, and `cuInit` must succeed (it fails when there is no GPU or the driver is too old).
//! * **NVRTC** (`libnvrtc.so.12`) compiles the reduction kernels of the copy-based algorithms.
//!   When the linker does not find it, tutti looks in `TUTTI_NVRTC_LIBRARY`, the CUDA toolkit
//!   (`CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`) and the `nvidia-cuda-nvrtc-cu12` pip
//!   package, and loads the file it finds by path: the dynamic linker then resolves cudarc's
//!   later `dlopen("libnvrtc.so.12")` to that already-loaded library (same soname).
//! * **NCCL** ships as `libnccl.so.2` (NVIDIA's packages and the `nvidia-nccl-cu12` pip
//!   package), a name cudarc's loader does not search, so tutti loads it itself, by path, and
//!   binds the functions it calls (see [`super::nccl`]). The search order is
//!   [`nccl_candidates`].

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The error for a missing library or device.
pub(crate) fn unavailable(what: &str, why: impl Into<String>) -> Error {
    Error::Unavailable {
        what: what.into(),
        why: why.into(),
    }
}

/// Where a search looked, for messages.
fn tried(list: &[String]) -> String {
    if list.is_empty() {
        return "nowhere".into();
    }
    list.join(", ")
}

/// The CUDA driver: present, and `cuInit` succeeded. Checked once per process.
pub(crate) fn cuda() -> Result<()> {
    static STATE: OnceLock<std::result::Result<(), Error>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: dlopen and dlclose of the driver's library names, nothing called yet.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(unavailable(
                    "CUDA",
                    "libcuda.so.1 not found (no NVIDIA driver on this machine, or it is not in \
                     the dynamic linker's path)",
                ));
            }
            // SAFETY: the library is present; cuInit takes no pointers.
            let r = unsafe { cudarc::driver::sys::cuInit(0) };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                let e = super::driver::describe(r);
                let hint = match r {
                    cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                        let cvd = std::env::var("CUDA_VISIBLE_DEVICES")
                            .map(|v| format!(" (CUDA_VISIBLE_DEVICES='{v}')"))
                            .unwrap_or_default();
                        format!("the driver sees no GPU{cvd}")
                    }
                    cudarc::driver::sys::CUresult::CUDA_ERROR_STUB_LIBRARY => {
                        "the libcuda found is the toolkit's stub, not the driver's".to_string()
                    }
                    _ => "the driver did not initialize".to_string(),
                };
                return Err(unavailable(
                    "CUDA",
                    format!("{hint}: cuInit failed with {e}"),
                ));
            }
            Ok(())
        })
        .clone()
}

/// Libraries loaded by path and kept loaded for the life of the process.
fn keep(lib: libloading::Library) {
    static KEPT: std::sync::Mutex<Vec<libloading::Library>> = std::sync::Mutex::new(Vec::new());
    match KEPT.lock() {
        Ok(mut v) => v.push(lib),
        Err(p) => p.into_inner().push(lib),
    }
}

/// Open a library by path (or by name, through the dynamic linker's search), with
/// `RTLD_NOW | RTLD_GLOBAL`.
fn open_global(path: &str) -> std::result::Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a CUDA library runs its initializers, which have no preconditions.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| e.to_string())
}

/// Directories of Python packages where pip puts NVIDIA's wheels (`nvidia/<pkg>/lib`).
fn python_package_dirs() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            prefixes.push(PathBuf::from(v));
        }
    }
    if let Some(home) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    let mut dirs = Vec::new();
    for p in prefixes {
        let lib = p.join("lib");
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            for sub in ["site-packages", "dist-packages"] {
                dirs.push(py.join(sub));
            }
        }
    }
    dirs.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    dirs
}

/// CUDA toolkit library directories: `CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`.
fn toolkit_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(|v| std::env::var_os(v).filter(|v| !v.is_empty()))
        .map(PathBuf::from)
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    roots
        .into_iter()
        .flat_map(|r| {
            [
                r.join("lib64"),
                r.join("lib"),
                r.join("targets/x86_64-linux/lib"),
            ]
        })
        .collect()
}

/// Where tutti looks for NCCL, in order: `explicit` (the value of `TUTTI_NCCL_LIBRARY`) alone
/// when given; otherwise `libnccl.so.2` and `libnccl.so` through the dynamic linker's search
/// (`LD_LIBRARY_PATH`, the linker cache), then the `nvidia-nccl-cu12` pip package in every
/// Python's site-packages (virtualenv, conda, `~/.local`, `/usr/local`, `/usr`), then the conda
/// environment's `lib`, the CUDA toolkit's `lib64` and `/usr/local/nccl/lib`.
pub fn nccl_candidates(explicit: Option<&str>) -> Vec<String> {
    if let Some(p) = explicit.filter(|p| !p.is_empty()) {
        return vec![p.to_string()];
    }
    let mut v: Vec<String> = vec!["libnccl.so.2".into(), "libnccl.so".into()];
    let mut files: Vec<PathBuf> = python_package_dirs()
        .into_iter()
        .map(|d| d.join("nvidia/nccl/lib/libnccl.so.2"))
        .collect();
    if let Some(c) = std::env::var_os("CONDA_PREFIX").filter(|v| !v.is_empty()) {
        files.push(Path::new(&c).join("lib/libnccl.so.2"));
    }
    files.extend(toolkit_dirs().into_iter().map(|d| d.join("libnccl.so.2")));
    files.push(PathBuf::from("/usr/local/nccl/lib/libnccl.so.2"));
    for f in files {
        if f.is_file() {
            v.push(f.to_string_lossy().into_owned());
        }
    }
    v
}

/// Open the first NCCL library of `candidates`; the library and the path or name it was found
/// under, or an `Unavailable` error that lists what was tried and why each failed.
pub(crate) fn open_nccl(candidates: &[String]) -> Result<(libloading::Library, String)> {
    let mut why = Vec::new();
    for c in candidates {
        match open_global(c) {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => why.push(format!("{c}: {e}")),
        }
    }
    let explicit = std::env::var("TUTTI_NCCL_LIBRARY").ok();
    let what = if explicit.is_some() {
        "TUTTI_NCCL_LIBRARY does not name a library that loads"
    } else {
        "libnccl.so.2 not found; install NCCL (the libnccl2 package, or pip install \
         nvidia-nccl-cu12) or set TUTTI_NCCL_LIBRARY to its path"
    };
    Err(unavailable(
        "NCCL",
        format!("{what}; tried {}", tried(&why)),
    ))
}

/// Candidate NVRTC libraries to load by path when the dynamic linker finds none.
fn nvrtc_files() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = python_package_dirs()
        .into_iter()
        .map(|d| d.join("nvidia/cuda_nvrtc/lib"))
        .collect();
    dirs.extend(toolkit_dirs());
    if let Some(c) = std::env::var_os("CONDA_PREFIX").filter(|v| !v.is_empty()) {
        dirs.push(Path::new(&c).join("lib"));
    }
    dirs.into_iter()
        .map(|d| d.join("libnvrtc.so.12"))
        .filter(|f| f.is_file())
        .collect()
}

/// NVRTC: present (possibly after loading it by path) and new enough (CUDA 11.2 or later, for
/// `nvrtcGetCUBIN` and the list of supported architectures). Returns its version.
pub(crate) fn nvrtc() -> Result<(i32, i32)> {
    static STATE: OnceLock<std::result::Result<(i32, i32), Error>> = OnceLock::new();
    STATE.get_or_init(find_nvrtc).clone()
}

fn find_nvrtc() -> Result<(i32, i32)> {
    // SAFETY (each is_culib_present): dlopen/dlclose of NVRTC's names, nothing called.
    let present = || unsafe { cudarc::nvrtc::sys::is_culib_present() };
    let mut tried_paths = Vec::new();
    if let Some(p) = std::env::var("TUTTI_NVRTC_LIBRARY")
        .ok()
        .filter(|p| !p.is_empty())
    {
        match open_global(&p) {
            Ok(lib) => keep(lib),
            Err(e) => {
                return Err(unavailable(
                    "NVRTC",
                    format!("TUTTI_NVRTC_LIBRARY={p} does not load: {e}"),
                ))
            }
        }
        if !present() {
            return Err(unavailable(
                "NVRTC",
                format!(
                    "TUTTI_NVRTC_LIBRARY={p} loaded, but it is not libnvrtc.so.12 (this build \
                     of tutti uses the CUDA 12 NVRTC)"
                ),
            ));
        }
    } else if !present() {
        for f in nvrtc_files() {
            let f = f.to_string_lossy().into_owned();
            match open_global(&f) {
                Ok(lib) => {
                    keep(lib);
                    if present() {
                        break;
                    }
                    tried_paths.push(format!("{f}: loaded, but not found by its soname"));
                }
                Err(e) => tried_paths.push(format!("{f}: {e}")),
            }
        }
        if !present() {
            return Err(unavailable(
                "NVRTC",
                format!(
                    "libnvrtc.so.12 not found by the dynamic linker{}; install the CUDA \
                     toolkit's NVRTC or pip install nvidia-cuda-nvrtc-cu12, or set \
                     TUTTI_NVRTC_LIBRARY to its path",
                    if tried_paths.is_empty() {
                        " nor in the CUDA toolkit or pip package locations".to_string()
                    } else {
                        format!("; also tried {}", tried(&tried_paths))
                    }
                ),
            ));
        }
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded; two valid out-pointers.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(unavailable("NVRTC", format!("nvrtcVersion failed ({r:?})")));
    }
    if (major, minor) < (11, 2) {
        return Err(unavailable(
            "NVRTC",
            format!("NVRTC {major}.{minor} is older than 11.2, which tutti needs"),
        ));
    }
    Ok((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_nccl_path_is_the_only_candidate() {
        assert_eq!(
            nccl_candidates(Some("/opt/x/libnccl.so.2")),
            vec!["/opt/x/libnccl.so.2".to_string()]
        );
        let v = nccl_candidates(None);
        assert_eq!(
            &v[..2],
            &["libnccl.so.2".to_string(), "libnccl.so".to_string()]
        );
        assert!(nccl_candidates(Some("")).len() >= 2);
    }

    #[test]
    fn a_missing_nccl_is_a_clean_error() {
        let e = open_nccl(&["/nonexistent/tutti-test/libnccl.so.2".to_string()]).unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("NCCL not available: "), "{m}");
        assert!(m.contains("/nonexistent/tutti-test/libnccl.so.2"), "{m}");
    }
}
