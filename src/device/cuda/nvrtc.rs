//! NVRTC, loaded at run time by path (see [`super::libs::nvrtc_candidates`]) and bound function
//! by function, so that a missing library or symbol is an `Unavailable` error, never a panic.
//!
//! The functions tutti calls have the same C signatures in CUDA 12 and CUDA 13, so the first
//! candidate that loads, binds every one of them and reports NVRTC 11.2 or later is used,
//! whichever CUDA it comes from (`libnvrtc.so.13`, `libnvrtc.so.12`, ...). On a machine with a
//! CUDA driver, an NVRTC of a newer CUDA major version than the driver runs is passed over too:
//! the driver could not load what it compiles. It is bound once per process; a failed search is
//! repeated on the next use.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use super::libs;
use crate::error::{Error, Result};

/// `nvrtcResult`.
pub(crate) type NvrtcResult = c_int;
/// `nvrtcProgram`.
pub(crate) type Program = *mut std::ffi::c_void;

/// `NVRTC_SUCCESS`.
pub(crate) const SUCCESS: NvrtcResult = 0;

/// The oldest NVRTC tutti uses: `nvrtcGetCUBIN` and the list of supported architectures
/// arrived in CUDA 11.2.
pub const MIN_VERSION: (i32, i32) = (11, 2);

/// The name of an `nvrtcResult` value.
pub fn result_name(code: i32) -> &'static str {
    match code {
        0 => "NVRTC_SUCCESS",
        1 => "NVRTC_ERROR_OUT_OF_MEMORY",
        2 => "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
        3 => "NVRTC_ERROR_INVALID_INPUT",
        4 => "NVRTC_ERROR_INVALID_PROGRAM",
        5 => "NVRTC_ERROR_INVALID_OPTION",
        6 => "NVRTC_ERROR_COMPILATION",
        7 => "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
        8 => "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
        9 => "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
        10 => "NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
        11 => "NVRTC_ERROR_INTERNAL_ERROR",
        12 => "NVRTC_ERROR_TIME_FILE_WRITE_FAILED",
        13 => "NVRTC_ERROR_NO_PCH_CREATE_ATTEMPTED",
        14 => "NVRTC_ERROR_PCH_CREATE_HEAP_EXHAUSTED",
        15 => "NVRTC_ERROR_PCH_CREATE",
        16 => "NVRTC_ERROR_CANCELLED",
        17 => "NVRTC_ERROR_TIME_TRACE_FILE_WRITE_FAILED",
        18 => "NVRTC_ERROR_BUSY",
        _ => "unknown nvrtcResult",
    }
}

/// The NVRTC functions tutti calls.
pub(crate) struct Api {
    _lib: libloading::Library,
    pub path: String,
    pub version: (i32, i32),
    pub get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    pub get_num_supported_archs: unsafe extern "C" fn(*mut c_int) -> NvrtcResult,
    pub get_supported_archs: unsafe extern "C" fn(*mut c_int) -> NvrtcResult,
    pub create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    pub destroy_program: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
    pub compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    pub get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    pub get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    pub get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    pub get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    pub get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    pub get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
}

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Send for Api {}
// SAFETY: as above; NVRTC's functions may be called from any thread (a program is used by one
// thread at a time, which its callers guarantee).
unsafe impl Sync for Api {}

/// The NVRTC library found: where, and its version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvrtcLibrary {
    /// The path or name it was loaded from.
    pub path: String,
    /// (major, minor), e.g. (13, 0).
    pub version: (u32, u32),
}

impl Api {
    /// Load and bind `path`; why not, when it cannot be used.
    fn load(path: &str) -> std::result::Result<Api, String> {
        let lib = libs::open_local(path)?;
        // SAFETY: each symbol is bound to NVRTC's documented C signature, the same in CUDA 11.2
        // through 13.
        unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get($name.as_bytes())
                        .map_err(|e| format!("it has no {} ({e})", $name))?
                };
            }
            let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult =
                sym!("nvrtcVersion");
            let (mut major, mut minor): (c_int, c_int) = (0, 0);
            let r = version_fn(&mut major, &mut minor);
            if r != SUCCESS {
                return Err(format!("nvrtcVersion failed ({})", result_name(r)));
            }
            if (major, minor) < MIN_VERSION {
                return Err(format!(
                    "it is NVRTC {major}.{minor}; tutti needs {}.{} or later",
                    MIN_VERSION.0, MIN_VERSION.1
                ));
            }
            Ok(Api {
                get_error_string: sym!("nvrtcGetErrorString"),
                get_num_supported_archs: sym!("nvrtcGetNumSupportedArchs"),
                get_supported_archs: sym!("nvrtcGetSupportedArchs"),
                create_program: sym!("nvrtcCreateProgram"),
                destroy_program: sym!("nvrtcDestroyProgram"),
                compile_program: sym!("nvrtcCompileProgram"),
                get_program_log_size: sym!("nvrtcGetProgramLogSize"),
                get_program_log: sym!("nvrtcGetProgramLog"),
                get_cubin_size: sym!("nvrtcGetCUBINSize"),
                get_cubin: sym!("nvrtcGetCUBIN"),
                get_ptx_size: sym!("nvrtcGetPTXSize"),
                get_ptx: sym!("nvrtcGetPTX"),
                _lib: lib,
                path: path.to_string(),
                version: (major, minor),
            })
        }
    }

    /// The first of `candidates` that can be used, or an `Unavailable` error listing every
    /// candidate and why it was passed over. `explicit`: the candidates are
    /// `TUTTI_NVRTC_LIBRARY`'s.
    fn load_first(candidates: &[String], explicit: bool) -> Result<Api> {
        let mut why = Vec::with_capacity(candidates.len());
        let driver = driver_cuda_version();
        for c in candidates {
            match Api::load(c) {
                Ok(api) => match too_new_for_driver(api.version, driver) {
                    None => return Ok(api),
                    Some(e) => why.push(format!("{c}: {e}")),
                },
                Err(e) => why.push(format!("{c}: {e}")),
            }
        }
        let what = if explicit {
            "TUTTI_NVRTC_LIBRARY does not name a usable NVRTC"
        } else {
            "no usable NVRTC found (libnvrtc.so.13 or libnvrtc.so.12); install the CUDA \
             toolkit's NVRTC, or pip install nvidia-cuda-nvrtc (CUDA 13) or \
             nvidia-cuda-nvrtc-cu12 (CUDA 12), or set TUTTI_NVRTC_LIBRARY to its path"
        };
        let tried = if why.is_empty() {
            "nowhere".to_string()
        } else {
            why.join("; ")
        };
        Err(libs::unavailable("NVRTC", format!("{what}; tried {tried}")))
    }

    /// NVRTC's text for a result.
    pub fn error_text(&self, r: NvrtcResult) -> String {
        // SAFETY: any result is accepted; NVRTC returns a static string or null.
        let p = unsafe { (self.get_error_string)(r) };
        if p.is_null() {
            result_name(r).to_string()
        } else {
            // SAFETY: non-null, NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// Turn an NVRTC result into tutti's error, naming the call.
    pub fn check(&self, r: NvrtcResult, what: &str) -> Result<()> {
        if r == SUCCESS {
            return Ok(());
        }
        Err(Error::System {
            what: format!("NVRTC {what} ({})", self.path),
            message: format!("{}: {}", result_name(r), self.error_text(r)),
        })
    }
}

/// The CUDA version the driver runs, when there is a driver.
fn driver_cuda_version() -> Option<(u32, u32)> {
    super::driver_version().ok()
}

/// Why NVRTC `version` cannot serve a driver that runs CUDA `driver`: code of a newer CUDA
/// major version than the driver's does not load.
pub(crate) fn too_new_for_driver(
    version: (i32, i32),
    driver: Option<(u32, u32)>,
) -> Option<String> {
    let (d_major, d_minor) = driver?;
    if i64::from(version.0) > i64::from(d_major) {
        Some(format!(
            "it is NVRTC {}.{}, but the CUDA driver runs CUDA {d_major}.{d_minor}, which cannot \
             load what it compiles",
            version.0, version.1
        ))
    } else {
        None
    }
}

static API: OnceLock<Api> = OnceLock::new();

/// NVRTC as found by the default search: `TUTTI_NVRTC_LIBRARY` alone when set, else
/// [`super::libs::nvrtc_candidates`] (cached once found; a failed search is repeated).
pub(crate) fn api() -> Result<&'static Api> {
    if let Some(a) = API.get() {
        return Ok(a);
    }
    let explicit = std::env::var("TUTTI_NVRTC_LIBRARY")
        .ok()
        .filter(|p| !p.is_empty());
    let api = Api::load_first(
        &libs::nvrtc_candidates(explicit.as_deref()),
        explicit.is_some(),
    )?;
    // A second thread may have bound one meanwhile: either is as good.
    let _ = API.set(api);
    API.get()
        .ok_or_else(|| libs::unavailable("NVRTC", "the library could not be kept loaded"))
}

fn describe(a: &Api) -> NvrtcLibrary {
    NvrtcLibrary {
        path: a.path.clone(),
        version: (a.version.0.max(0) as u32, a.version.1.max(0) as u32),
    }
}

/// The NVRTC library tutti uses: `TUTTI_NVRTC_LIBRARY`, else the search of
/// [`super::libs::nvrtc_candidates`]; `Unavailable` when none can be used.
pub fn nvrtc_library() -> Result<NvrtcLibrary> {
    api().map(describe)
}

/// Load NVRTC from `path` alone (not cached): what `TUTTI_NVRTC_LIBRARY=path` would find.
pub fn open_nvrtc_library(path: &str) -> Result<NvrtcLibrary> {
    Api::load_first(&[path.to_string()], true).map(|a| describe(&a))
}

/// The first usable NVRTC of `candidates` (not cached), or an `Unavailable` error listing every
/// candidate and why it was passed over.
pub fn first_nvrtc_library(candidates: &[String]) -> Result<NvrtcLibrary> {
    Api::load_first(candidates, false).map(|a| describe(&a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_newer_than_the_driver_is_passed_over() {
        assert_eq!(too_new_for_driver((13, 0), None), None);
        assert_eq!(too_new_for_driver((13, 0), Some((13, 0))), None);
        assert_eq!(too_new_for_driver((12, 8), Some((13, 1))), None);
        assert_eq!(too_new_for_driver((12, 9), Some((12, 4))), None);
        let why = too_new_for_driver((13, 0), Some((12, 8))).unwrap();
        assert!(
            why.contains("NVRTC 13.0") && why.contains("CUDA 12.8"),
            "{why}"
        );
    }

    #[test]
    fn result_names() {
        assert_eq!(result_name(0), "NVRTC_SUCCESS");
        assert_eq!(result_name(6), "NVRTC_ERROR_COMPILATION");
        assert_eq!(result_name(99), "unknown nvrtcResult");
    }

    #[test]
    fn unusable_candidates_are_listed_with_their_reasons() {
        let e = first_nvrtc_library(&[
            "/nonexistent/tutti-test/libnvrtc.so.13".to_string(),
            "/etc/hostname".to_string(),
            "libtutti-test-no-such-nvrtc.so.12".to_string(),
        ])
        .unwrap_err();
        assert!(
            matches!(e, Error::Unavailable { ref what, .. } if what == "NVRTC"),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(m.starts_with("NVRTC not available: no usable NVRTC"), "{m}");
        for c in [
            "/nonexistent/tutti-test/libnvrtc.so.13: ",
            "/etc/hostname: ",
            "libtutti-test-no-such-nvrtc.so.12: ",
        ] {
            assert!(m.contains(c), "{c} missing: {m}");
        }
        let e = open_nvrtc_library("/nonexistent/tutti-test/libnvrtc.so.13").unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("TUTTI_NVRTC_LIBRARY does not name a usable NVRTC"),
            "{m}"
        );
        // A library that loads but is not NVRTC.
        let e = first_nvrtc_library(&["libm.so.6".to_string()]).unwrap_err();
        assert!(
            e.to_string().contains("libm.so.6: it has no nvrtcVersion"),
            "{e}"
        );
        assert!(first_nvrtc_library(&[])
            .unwrap_err()
            .to_string()
            .contains("tried nowhere"));
    }
}
