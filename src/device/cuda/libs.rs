//! Finding the CUDA driver, NVRTC and NCCL at run time, without ever panicking.
//!
//! Nothing is linked at build time: a build with the `cuda` feature runs on machines without any
//! of these libraries and reports what is missing as [`Error::Unavailable`].
//!
//! * **libcuda** (the driver) is installed with the NVIDIA driver as `libcuda.so.1` in the
//!   dynamic linker's path; cudarc's loader finds it. Its presence is tested before the first
//!   call, and `cuInit` must succeed (it fails when there is no GPU or the driver is too old).
//! * **NVRTC** compiles the reduction kernels of the copy-based algorithms. tutti loads it
//!   itself, by path, and binds the functions it calls (see [`super::nvrtc_library`]): the
//!   CUDA 13 library (`libnvrtc.so.13`, pip's `nvidia-cuda-nvrtc`) and the CUDA 12 one
//!   (`libnvrtc.so.12`, pip's `nvidia-cuda-nvrtc-cu12`) alike. The search order is
//!   [`nvrtc_candidates`].
//! * **NCCL** ships as `libnccl.so.2` (NVIDIA's packages and the `nvidia-nccl-cu12` pip
//!   package), a name cudarc's loader does not search, so tutti loads it itself, by path, and
//!   binds the functions it calls (`nccl.rs`). The search order is
//!   [`nccl_candidates`].
//!
//! Python packages are looked for in the site-packages of every Python prefix tutti can find
//! without running Python ([`python_prefixes`]): `VIRTUAL_ENV`, `CONDA_PREFIX`, the `python3`
//! and `python` on `PATH` (the prefix above the `bin/` that `PATH` names, which is a virtual
//! environment's own, and the one above the interpreter it links to), `~/.local`, `/usr/local`,
//! `/usr` and `/opt/conda`.

use std::ffi::{OsStr, OsString};
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

/// Open a library by path (or by name, through the dynamic linker's search), with
/// `RTLD_NOW | RTLD_GLOBAL`.
fn open_global(path: &str) -> std::result::Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a CUDA library runs its initializers, which have no preconditions.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| e.to_string())
}

/// Open a library by path (or by name, through the dynamic linker's search), with
/// `RTLD_NOW | RTLD_LOCAL`: its symbols are reached through the handle only, so that another
/// version of the same library loaded later in the process (say, a CUDA 12 NVRTC next to
/// tutti's CUDA 13 one) keeps its own.
pub(crate) fn open_local(path: &str) -> std::result::Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: as for `open_global`.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
        .map(libloading::Library::from)
        .map_err(|e| e.to_string())
}

/// The directory an environment variable names, when it is an absolute path (a relative one
/// would be looked up from the working directory, so it is ignored).
fn absolute_var(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

fn push_unique(v: &mut Vec<PathBuf>, p: PathBuf) {
    if !v.contains(&p) {
        v.push(p);
    }
}

/// The prefixes of the Python interpreters named `python3` and `python` on `path_var` (a
/// `PATH` value), found without running them: for the first directory of `PATH` that holds
/// each name, the directory above it (a virtual environment's `bin/python3` is a link to the
/// interpreter it was made from, so the path as `PATH` gives it leads to the environment), then
/// the directory above the `bin/` of the file the name resolves to (the base installation).
/// Relative entries of `PATH` (`.`, an empty one) are skipped.
pub fn path_python_prefixes(path_var: Option<&OsStr>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Some(path_var) = path_var else {
        return out;
    };
    for exe in ["python3", "python"] {
        // Absolute directories only: a relative entry (`.`, or an empty one, which means the
        // working directory) would make the search load a library from wherever the process
        // happens to run.
        let Some(found) = std::env::split_paths(path_var)
            .filter(|d| d.is_absolute())
            .map(|d| d.join(exe))
            .find(|f| f.is_file())
        else {
            continue;
        };
        if let Some(prefix) = found.parent().and_then(Path::parent) {
            push_unique(&mut out, prefix.to_path_buf());
        }
        if let Ok(real) = std::fs::canonicalize(&found) {
            if let Some(prefix) = real.parent().and_then(Path::parent) {
                push_unique(&mut out, prefix.to_path_buf());
            }
        }
    }
    out
}

/// Every Python prefix tutti looks in, in order: `VIRTUAL_ENV`, `CONDA_PREFIX`, those of the
/// `python3` and `python` on `path_var` ([`path_python_prefixes`]), `~/.local`, `/usr/local`,
/// `/usr`, `/opt/conda`.
pub fn python_prefixes(path_var: Option<&OsStr>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = absolute_var(var) {
            push_unique(&mut prefixes, v);
        }
    }
    for p in path_python_prefixes(path_var) {
        push_unique(&mut prefixes, p);
    }
    if let Some(home) = absolute_var("HOME") {
        push_unique(&mut prefixes, home.join(".local"));
    }
    for p in ["/usr/local", "/usr", "/opt/conda"] {
        push_unique(&mut prefixes, PathBuf::from(p));
    }
    prefixes
}

/// The directories of Python packages where pip puts NVIDIA's wheels (`nvidia/<pkg>/lib`):
/// `lib/python3*/site-packages` and `dist-packages` of every prefix of [`python_prefixes`]
/// (with `path_var` as `PATH`), then `/usr/lib/python3/dist-packages`. Only directories that
/// exist.
pub fn python_package_dirs(path_var: Option<&OsStr>) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for p in python_prefixes(path_var) {
        let Ok(entries) = std::fs::read_dir(p.join("lib")) else {
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
                let d = py.join(sub);
                if d.is_dir() {
                    push_unique(&mut dirs, d);
                }
            }
        }
    }
    let debian = PathBuf::from("/usr/lib/python3/dist-packages");
    if debian.is_dir() {
        push_unique(&mut dirs, debian);
    }
    dirs
}

/// CUDA toolkit library directories: `lib64`, `lib` and `targets/x86_64-linux/lib` of
/// `CUDA_HOME`, `CUDA_PATH`, `CUDA_ROOT` and `/usr/local/cuda`.
fn toolkit_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(|v| absolute_var(v))
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut dirs = Vec::new();
    for r in roots {
        for d in [
            r.join("lib64"),
            r.join("lib"),
            r.join("targets/x86_64-linux/lib"),
        ] {
            push_unique(&mut dirs, d);
        }
    }
    dirs
}

/// The directories the library searches look in, read from the environment by
/// [`SearchDirs::from_env`] (or given, for tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SearchDirs {
    /// Python site-packages directories ([`python_package_dirs`]).
    pub site_packages: Vec<PathBuf>,
    /// The conda environment (`CONDA_PREFIX`): its `lib` holds conda's CUDA packages.
    pub conda_prefix: Option<PathBuf>,
    /// CUDA toolkit library directories (`CUDA_HOME`, `CUDA_PATH`, `CUDA_ROOT`,
    /// `/usr/local/cuda`: `lib64`, `lib`, `targets/x86_64-linux/lib`).
    pub toolkit: Vec<PathBuf>,
}

impl SearchDirs {
    /// The directories of this process's environment (`PATH`, `VIRTUAL_ENV`, `CONDA_PREFIX`,
    /// `HOME`, `CUDA_HOME`, ...).
    pub fn from_env() -> SearchDirs {
        let path: Option<OsString> = std::env::var_os("PATH");
        SearchDirs {
            site_packages: python_package_dirs(path.as_deref()),
            conda_prefix: absolute_var("CONDA_PREFIX"),
            toolkit: toolkit_dirs(),
        }
    }
}

/// The files of `files` that exist, as strings, after `names`, without repeats.
fn names_then_files(names: &[&str], files: Vec<PathBuf>) -> Vec<String> {
    let mut v: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    for f in files {
        if f.is_file() {
            let s = f.to_string_lossy().into_owned();
            if !v.contains(&s) {
                v.push(s);
            }
        }
    }
    v
}

/// Where tutti looks for NCCL, in order: `explicit` (the value of `TUTTI_NCCL_LIBRARY`) alone
/// when given; otherwise `libnccl.so.2` and `libnccl.so` through the dynamic linker's search
/// (`LD_LIBRARY_PATH`, the linker cache), then NVIDIA's pip packages in every Python's
/// site-packages (`nvidia/cu13/lib/libnccl.so.2`, `nvidia/nccl/lib/libnccl.so.2`; see
/// [`python_package_dirs`]), then the conda environment's `lib`, the CUDA toolkit's library
/// directories and `/usr/local/nccl/lib`. Files are listed only when they exist.
pub fn nccl_candidates(explicit: Option<&str>) -> Vec<String> {
    if let Some(p) = explicit.filter(|p| !p.is_empty()) {
        return vec![p.to_string()];
    }
    nccl_candidates_in(&SearchDirs::from_env())
}

/// [`nccl_candidates`] without an explicit library, over the directories of `dirs`.
pub fn nccl_candidates_in(dirs: &SearchDirs) -> Vec<String> {
    let mut files: Vec<PathBuf> = Vec::new();
    for d in &dirs.site_packages {
        files.push(d.join("nvidia/cu13/lib/libnccl.so.2"));
        files.push(d.join("nvidia/nccl/lib/libnccl.so.2"));
    }
    if let Some(c) = &dirs.conda_prefix {
        files.push(c.join("lib/libnccl.so.2"));
    }
    files.extend(dirs.toolkit.iter().map(|d| d.join("libnccl.so.2")));
    files.push(PathBuf::from("/usr/local/nccl/lib/libnccl.so.2"));
    names_then_files(&["libnccl.so.2", "libnccl.so"], files)
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

/// The names NVRTC goes by in the dynamic linker's search, newest CUDA first.
pub const NVRTC_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Where tutti looks for NVRTC, in order: `explicit` (the value of `TUTTI_NVRTC_LIBRARY`)
/// alone when given; otherwise [`NVRTC_NAMES`] through the dynamic linker's search, then
/// NVIDIA's pip packages in every Python's site-packages (`nvidia/cu13/lib/libnvrtc.so.13`,
/// then `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`; see [`python_package_dirs`]), then
/// `libnvrtc.so.13` and `libnvrtc.so.12` in the CUDA toolkit's library directories and in the
/// conda environment's `lib`. Files are listed only when they exist. The first candidate that
/// loads, has every function tutti calls and is NVRTC 11.2 or later is used.
pub fn nvrtc_candidates(explicit: Option<&str>) -> Vec<String> {
    if let Some(p) = explicit.filter(|p| !p.is_empty()) {
        return vec![p.to_string()];
    }
    nvrtc_candidates_in(&SearchDirs::from_env())
}

/// [`nvrtc_candidates`] without an explicit library, over the directories of `dirs`.
pub fn nvrtc_candidates_in(dirs: &SearchDirs) -> Vec<String> {
    let mut files: Vec<PathBuf> = Vec::new();
    for d in &dirs.site_packages {
        files.push(d.join("nvidia/cu13/lib/libnvrtc.so.13"));
        files.push(d.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
    }
    let conda = dirs.conda_prefix.as_ref().map(|c| c.join("lib"));
    for d in dirs.toolkit.iter().chain(conda.as_ref()) {
        files.push(d.join("libnvrtc.so.13"));
        files.push(d.join("libnvrtc.so.12"));
    }
    names_then_files(&NVRTC_NAMES, files)
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

    /// A scratch directory, removed when dropped.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Tree {
            let d = std::env::temp_dir().join(format!(
                "tutti-libs-{name}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Tree(std::fs::canonicalize(&d).unwrap())
        }

        /// Create an empty file (and its directories) at `rel`; its path.
        fn file(&self, rel: &str) -> PathBuf {
            let f = self.0.join(rel);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(&f, b"").unwrap();
            f
        }

        fn dir(&self, rel: &str) -> PathBuf {
            let d = self.0.join(rel);
            std::fs::create_dir_all(&d).unwrap();
            d
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn explicit_nvrtc_path_is_the_only_candidate() {
        assert_eq!(
            nvrtc_candidates(Some("/opt/x/libnvrtc.so.13")),
            vec!["/opt/x/libnvrtc.so.13".to_string()]
        );
        let v = nvrtc_candidates(None);
        assert_eq!(&v[..3], &NVRTC_NAMES.map(String::from));
        assert!(nvrtc_candidates(Some("")).len() >= 3);
    }

    #[test]
    fn nvrtc_candidates_in_order() {
        let t = Tree::new("nvrtc");
        let sp1 = t.dir("venv/lib/python3.12/site-packages");
        let sp2 = t.dir("base/lib/python3.12/site-packages");
        let a13 = t.file("venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13");
        let a12 = t.file("venv/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        let b12 = t.file("base/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        let tk = t.dir("cuda/lib64");
        let tk13 = t.file("cuda/lib64/libnvrtc.so.13");
        let tk12 = t.file("cuda/lib64/libnvrtc.so.12");
        let tk_targets = t.dir("cuda/targets/x86_64-linux/lib");
        let tkt12 = t.file("cuda/targets/x86_64-linux/lib/libnvrtc.so.12");
        let conda13 = t.file("conda/lib/libnvrtc.so.13");
        let dirs = SearchDirs {
            site_packages: vec![sp1, sp2],
            conda_prefix: Some(t.0.join("conda")),
            toolkit: vec![tk, t.0.join("cuda/lib"), tk_targets],
        };
        let s = |p: PathBuf| p.to_string_lossy().into_owned();
        let mut want: Vec<String> = NVRTC_NAMES.map(String::from).to_vec();
        want.extend([a13, a12, b12, tk13, tk12, tkt12, conda13].map(s));
        assert_eq!(nvrtc_candidates_in(&dirs), want);
        // Nothing there: the linker names only.
        assert_eq!(
            nvrtc_candidates_in(&SearchDirs::default()),
            NVRTC_NAMES.map(String::from).to_vec()
        );
    }

    #[test]
    fn nccl_candidates_in_order() {
        let t = Tree::new("nccl");
        let sp = t.dir("venv/lib/python3.11/site-packages");
        let cu13 = t.file("venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnccl.so.2");
        let cu12 = t.file("venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let conda = t.file("conda/lib/libnccl.so.2");
        let tk = t.dir("cuda/lib64");
        let tkf = t.file("cuda/lib64/libnccl.so.2");
        let dirs = SearchDirs {
            site_packages: vec![sp],
            conda_prefix: Some(t.0.join("conda")),
            toolkit: vec![tk],
        };
        let v = nccl_candidates_in(&dirs);
        let s = |p: PathBuf| p.to_string_lossy().into_owned();
        assert_eq!(
            &v[..6],
            &[
                "libnccl.so.2".to_string(),
                "libnccl.so".to_string(),
                s(cu13),
                s(cu12),
                s(conda),
                s(tkf)
            ]
        );
    }

    /// `to` relative to `from` (both absolute).
    fn pathdiff(to: &Path, from: &Path) -> PathBuf {
        let (t, f): (Vec<_>, Vec<_>) = (to.components().collect(), from.components().collect());
        let common = t.iter().zip(&f).take_while(|(a, b)| a == b).count();
        let mut out = PathBuf::new();
        for _ in common..f.len() {
            out.push("..");
        }
        for c in &t[common..] {
            out.push(c);
        }
        out
    }

    #[test]
    fn pythons_on_path_give_their_prefixes() {
        let t = Tree::new("path");
        // A base installation and a virtual environment made from it, whose bin/python3 links
        // to the base interpreter; and a `python` elsewhere on PATH.
        let base_py = t.file("base/bin/python3.12");
        let base_sp = t.dir("base/lib/python3.12/site-packages");
        let venv_sp = t.dir("venv/lib/python3.12/site-packages");
        t.dir("venv/bin");
        std::os::unix::fs::symlink(&base_py, t.0.join("venv/bin/python3")).unwrap();
        t.file("other/bin/python");
        let other_sp = t.dir("other/lib/python3.9/dist-packages");
        t.dir("empty/bin");
        let path = std::env::join_paths([
            t.0.join("empty/bin"),
            t.0.join("venv/bin"),
            t.0.join("base/bin"),
            t.0.join("other/bin"),
        ])
        .unwrap();
        let prefixes = path_python_prefixes(Some(&path));
        let base = t.0.join("base");
        assert_eq!(
            prefixes,
            vec![t.0.join("venv"), base.clone(), t.0.join("other")]
        );
        assert!(path_python_prefixes(None).is_empty());
        assert!(path_python_prefixes(Some(OsStr::new(""))).is_empty());
        // A relative entry (here the tree's venv, relative to the working directory; `.` or an
        // empty entry alike) is never searched: only absolute directories are.
        let cwd = std::env::current_dir().unwrap();
        let rel = pathdiff(&t.0.join("venv/bin"), &cwd);
        assert!(
            rel.is_relative() && rel.join("python3").is_file(),
            "{rel:?}"
        );
        let relative =
            std::env::join_paths([rel.clone(), PathBuf::from("."), PathBuf::new()]).unwrap();
        let found = path_python_prefixes(Some(&relative));
        assert!(
            found.is_empty(),
            "relative PATH entries searched: {found:?}"
        );
        let dirs = python_package_dirs(Some(&relative));
        assert!(dirs.iter().all(|d| d.is_absolute()), "{dirs:?}");

        let dirs = python_package_dirs(Some(&path));
        let pos = |d: &Path| dirs.iter().position(|x| x == d);
        let (v, b, o) = (
            pos(&venv_sp).expect("the venv's site-packages"),
            pos(&base.join("lib/python3.12/site-packages")).expect("the base's site-packages"),
            pos(&other_sp).expect("the other python's dist-packages"),
        );
        assert!(v < b && b < o, "{dirs:?}");
        assert!(base_sp.is_dir());
        // The search finds the venv's NVRTC and NCCL through PATH alone.
        let f = t.file("venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13");
        let n = t.file("venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let sd = SearchDirs {
            site_packages: dirs,
            ..SearchDirs::default()
        };
        assert!(nvrtc_candidates_in(&sd).contains(&f.to_string_lossy().into_owned()));
        assert!(nccl_candidates_in(&sd).contains(&n.to_string_lossy().into_owned()));
    }
}
