//! PJRT plugins: where to find them, loading one, checking its API version, and its errors.

use std::collections::HashMap;
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::ffi;
use crate::error::{Error, Result};

/// What a plugin drives, judged from its file name.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PluginKind {
    /// libtpu: Cloud TPUs.
    Tpu,
    /// A CUDA plugin (`jax-cuda12-pjrt`, `jax-cuda13-pjrt`).
    Cuda,
    /// Some other accelerator's plugin.
    Other,
    /// The CPU plugin (`xla-cpu-pjrt`).
    Cpu,
}

impl PluginKind {
    /// Judge a plugin by its file name.
    pub fn of(path: &Path) -> PluginKind {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if name.contains("tpu") {
            PluginKind::Tpu
        } else if name.contains("cuda") {
            PluginKind::Cuda
        } else if name.contains("cpu") {
            PluginKind::Cpu
        } else {
            PluginKind::Other
        }
    }
}

/// A plugin file found by [`candidates`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The shared library.
    pub path: PathBuf,
    /// Its kind, from its name.
    pub kind: PluginKind,
    /// Where it was found (`TUTTI_PJRT_PLUGIN`, `TPU_LIBRARY_PATH`, a site-packages folder...).
    pub source: String,
}

/// The environment variable naming the plugin to load.
pub const PLUGIN_ENV: &str = "TUTTI_PJRT_PLUGIN";

/// The plugins tutti would try, best first: `TUTTI_PJRT_PLUGIN` alone when it is set; otherwise
/// libtpu (`TPU_LIBRARY_PATH`, `/lib`, `/usr/lib`, `/usr/local/lib`, a `libtpu` Python package),
/// then CUDA plugins (`jax_plugins/xla_cuda*/`), other `jax_plugins`, then the CPU plugin
/// (`xla_plugins/xla_cpu_pjrt/`), each searched in the Python site-packages folders of
/// `PYTHONPATH`, `VIRTUAL_ENV`, `CONDA_PREFIX`, `~/.local`, `/usr/local`, `/usr` and `/opt/conda`.
pub fn candidates() -> Vec<Candidate> {
    if let Some(p) = std::env::var_os(PLUGIN_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(p);
        return vec![Candidate {
            kind: PluginKind::of(&path),
            path,
            source: PLUGIN_ENV.into(),
        }];
    }
    let mut found: Vec<Candidate> = Vec::new();
    let mut add = |path: PathBuf, source: String| {
        if path.is_file() && !found.iter().any(|c| same_file(&c.path, &path)) {
            found.push(Candidate {
                kind: PluginKind::of(&path),
                path,
                source,
            });
        }
    };
    if let Some(p) = std::env::var_os("TPU_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        add(PathBuf::from(p), "TPU_LIBRARY_PATH".into());
    }
    for dir in ["/lib", "/usr/lib", "/usr/local/lib"] {
        add(Path::new(dir).join("libtpu.so"), dir.into());
    }
    for site in site_packages() {
        let source = site.display().to_string();
        add(site.join("libtpu").join("libtpu.so"), source.clone());
        for (folder, _) in [("jax_plugins", ()), ("xla_plugins", ())] {
            for pkg in sorted_dir(&site.join(folder)) {
                for file in sorted_dir(&pkg) {
                    if file.extension().is_some_and(|e| e == "so") {
                        add(file, source.clone());
                    }
                }
            }
        }
    }
    found.sort_by_key(|c| c.kind);
    found
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn sorted_dir(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Python site-packages folders worth searching, existing ones only.
fn site_packages() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut push = |p: PathBuf| {
        if p.is_dir() && !out.contains(&p) {
            out.push(p);
        }
    };
    if let Some(pp) = std::env::var_os("PYTHONPATH") {
        for p in std::env::split_paths(&pp) {
            push(p);
        }
    }
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
    for prefix in prefixes {
        for lib in sorted_dir(&prefix.join("lib")) {
            let is_python = lib
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"));
            if is_python {
                push(lib.join("site-packages"));
                push(lib.join("dist-packages"));
            }
        }
    }
    push(PathBuf::from("/usr/lib/python3/dist-packages"));
    for p in python_site_packages() {
        push(p);
    }
    out
}

/// The site-packages folders of the `python3` on `PATH`, asked with a 5 s bound (none if
/// there is no python3).
fn python_site_packages() -> Vec<PathBuf> {
    let script = "import site, sys\n\
                  paths = list(getattr(site, 'getsitepackages', lambda: [])())\n\
                  paths.append(site.getusersitepackages())\n\
                  paths.extend(p for p in sys.path if p.endswith('-packages'))\n\
                  print('\\n'.join(paths))";
    let child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        return Vec::new();
    };
    let Some(status) = wait_child(&mut child, Duration::from_secs(5)) else {
        return Vec::new();
    };
    let mut out = String::new();
    if status.success() {
        if let Some(mut stdout) = child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        }
    }
    out.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// True when this machine shows TPU device files (`/dev/accel*`, or `/dev/vfio/<n>` on newer
/// TPU VMs). Used to skip libtpu during automatic discovery, where its client would otherwise
/// spend minutes looking for a cloud metadata server.
pub fn tpu_device_files() -> bool {
    let has = |dir: &str, pred: &dyn Fn(&str) -> bool| {
        std::fs::read_dir(dir).is_ok_and(|rd| {
            rd.filter_map(|e| e.ok())
                .any(|e| pred(&e.file_name().to_string_lossy()))
        })
    };
    has("/dev", &|n| n.starts_with("accel"))
        || has("/dev/vfio", &|n| n.chars().all(|c| c.is_ascii_digit()))
}

/// A loaded PJRT plugin. Plugins are loaded once per process and never unloaded (PJRT plugins
/// keep process-wide state, and callbacks may still arrive from their threads).
pub struct Plugin {
    path: PathBuf,
    kind: PluginKind,
    pub(crate) api: &'static ffi::Api,
    version: (i32, i32),
    attributes: Vec<(String, String)>,
}

// SAFETY: the API table is immutable once returned by GetPjrtApi and its functions are callable
// from any thread, as the PJRT C API requires of plugins.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

fn unavailable(why: impl Into<String>) -> Error {
    Error::Unavailable {
        what: "XLA".into(),
        why: why.into(),
    }
}

type Registry = Mutex<HashMap<PathBuf, &'static Plugin>>;

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Plugin {
    /// Load the plugin at `path` (once per process; later calls return the same plugin): open
    /// it, call `GetPjrtApi`, check the API version (major must equal tutti's, minor at least
    /// [`ffi::MIN_MINOR`]) and the table size, and run `PJRT_Plugin_Initialize`.
    pub fn load(path: impl AsRef<Path>) -> Result<&'static Plugin> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(unavailable(format!(
                "PJRT plugin {}: no such file",
                path.display()
            )));
        }
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = reg.get(&key) {
            return Ok(p);
        }
        let plugin: &'static Plugin = Box::leak(Box::new(Plugin::open(path)?));
        reg.insert(key, plugin);
        Ok(plugin)
    }

    fn open(path: &Path) -> Result<Plugin> {
        let shown = path.display();
        // SAFETY: loading a library runs its initializers; a PJRT plugin is meant to be loaded
        // this way. The library is never unloaded.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| unavailable(format!("PJRT plugin {shown} could not be loaded: {e}")))?;
        // SAFETY: the symbol's type is the one the PJRT C API declares.
        let get: libloading::Symbol<ffi::GetPjrtApi> = unsafe { lib.get(b"GetPjrtApi\0") }
            .map_err(|_| {
                unavailable(format!(
                    "{shown} is not a PJRT plugin: it exports no GetPjrtApi"
                ))
            })?;
        // SAFETY: GetPjrtApi takes nothing and returns a pointer to a static table.
        let api = unsafe { get() };
        if api.is_null() {
            return Err(unavailable(format!(
                "PJRT plugin {shown}: GetPjrtApi returned no API table"
            )));
        }
        // SAFETY: non-null; read the leading size and version before anything else. The leading
        // fields have been the same in every PJRT C API version.
        let (size, version) = unsafe {
            let size = std::ptr::addr_of!((*api).struct_size).read();
            let v = std::ptr::addr_of!((*api).pjrt_api_version).read();
            (size, (v.major_version, v.minor_version))
        };
        check_version(&shown.to_string(), version, size)?;
        std::mem::forget(lib);
        // SAFETY: the table is at least API_MIN_SIZE bytes (checked) and lives forever (the
        // library is never unloaded).
        let api: &'static ffi::Api = unsafe { &*api };
        let mut plugin = Plugin {
            path: path.to_path_buf(),
            kind: PluginKind::of(path),
            api,
            version,
            attributes: Vec::new(),
        };
        plugin.initialize()?;
        plugin.attributes = plugin.read_attributes();
        Ok(plugin)
    }

    fn initialize(&self) -> Result<()> {
        let Some(init) = self.api.plugin_initialize else {
            return Ok(());
        };
        let mut args = ffi::Plugin_Initialize_Args {
            struct_size: ffi::PLUGIN_INITIALIZE_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
        };
        // SAFETY: valid args for the call.
        let err = unsafe { init(&mut args) };
        self.check(err, || "PJRT_Plugin_Initialize".into())
            .map_err(|e| {
                unavailable(format!(
                    "PJRT plugin {} failed to initialize: {e}",
                    self.path.display()
                ))
            })
    }

    fn read_attributes(&self) -> Vec<(String, String)> {
        let Some(f) = self.api.plugin_attributes else {
            return Vec::new();
        };
        let mut args = ffi::Plugin_Attributes_Args {
            struct_size: ffi::PLUGIN_ATTRIBUTES_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            attributes: std::ptr::null(),
            num_attributes: 0,
        };
        // SAFETY: valid args for the call.
        let err = unsafe { f(&mut args) };
        if self.check(err, || "PJRT_Plugin_Attributes".into()).is_err() || args.attributes.is_null()
        {
            return Vec::new();
        }
        // SAFETY: the plugin returns num_attributes values living as long as the process.
        let attrs = unsafe { std::slice::from_raw_parts(args.attributes, args.num_attributes) };
        attrs
            .iter()
            .map(|a| {
                // SAFETY: fields as the header documents them, per the value's type tag.
                unsafe {
                    let name = str_of(a.name, a.name_size);
                    let value = match a.type_ {
                        ffi::NAMED_VALUE_STRING => str_of(a.value.string_value, a.value_size),
                        ffi::NAMED_VALUE_INT64 => a.value.int64_value.to_string(),
                        ffi::NAMED_VALUE_INT64_LIST => {
                            let v = if a.value.int64_array_value.is_null() {
                                &[][..]
                            } else {
                                std::slice::from_raw_parts(a.value.int64_array_value, a.value_size)
                            };
                            format!("{v:?}")
                        }
                        ffi::NAMED_VALUE_FLOAT => a.value.float_value.to_string(),
                        ffi::NAMED_VALUE_BOOL => a.value.bool_value.to_string(),
                        t => format!("(value of type {t})"),
                    };
                    (name, value)
                }
            })
            .collect()
    }

    /// The shared library this plugin was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its kind, judged from the file name.
    pub fn kind(&self) -> PluginKind {
        self.kind
    }

    /// The PJRT C API version the plugin was built with (major, minor).
    pub fn api_version(&self) -> (i32, i32) {
        self.version
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...), as text.
    pub fn attributes(&self) -> &[(String, String)] {
        &self.attributes
    }

    /// Load the first plugin [`candidates`] offers. With `TUTTI_PJRT_PLUGIN` set, that plugin
    /// or an error saying why it cannot be used; otherwise an `Unavailable` error that lists
    /// where tutti looked.
    pub fn from_env() -> Result<&'static Plugin> {
        let found = candidates();
        let mut why = Vec::new();
        for c in &found {
            if let Some(skip) = skip_reason(c) {
                why.push(skip);
                continue;
            }
            match Plugin::load(&c.path) {
                Ok(p) => return Ok(p),
                Err(e) if c.source == PLUGIN_ENV => return Err(e),
                Err(e) => why.push(e.to_string()),
            }
        }
        Err(not_found(&why))
    }

    /// The message and code of a PJRT error, which is destroyed here.
    pub(crate) fn take_error(&self, err: *mut ffi::Error) -> Option<(i32, String)> {
        take_error(self.api, err)
    }

    /// `Ok` for a null error; otherwise an `Error::System` naming `what` and carrying the
    /// plugin's code and message.
    pub(crate) fn check(&self, err: *mut ffi::Error, what: impl FnOnce() -> String) -> Result<()> {
        match self.take_error(err) {
            None => Ok(()),
            Some((code, message)) => Err(Error::System {
                what: what(),
                message: format!("{}: {message}", ffi::error_code_name(code)),
            }),
        }
    }
}

/// Why automatic discovery skips a candidate, if it does (libtpu on a machine without TPU
/// device files, unless `TUTTI_PJRT_PLUGIN` names it).
pub fn skip_reason(c: &Candidate) -> Option<String> {
    (c.source != PLUGIN_ENV && c.kind == PluginKind::Tpu && !tpu_device_files()).then(|| {
        format!(
            "{}: no TPU on this machine (no /dev/accel* or /dev/vfio devices); \
             set {PLUGIN_ENV} to use it anyway",
            c.path.display()
        )
    })
}

/// The error for "no usable plugin", listing what was tried.
pub(crate) fn not_found(tried: &[String]) -> Error {
    let mut why = format!(
        "no PJRT plugin found (set {PLUGIN_ENV}=/path/to/plugin.so, or install one: \
         pip install xla-cpu-pjrt, libtpu or jax-cuda12-pjrt)"
    );
    if tried.is_empty() {
        why.push_str("; searched TPU_LIBRARY_PATH, /lib, /usr/lib, /usr/local/lib and the Python site-packages folders");
    } else {
        why.push_str("; tried: ");
        why.push_str(&tried.join("; "));
    }
    unavailable(why)
}

fn check_version(shown: &str, (major, minor): (i32, i32), size: usize) -> Result<()> {
    let ours = format!(
        "this build of tutti speaks PJRT C API {}.{} and accepts {}.{} or newer with the same major version",
        ffi::HEADER_MAJOR,
        ffi::HEADER_MINOR,
        ffi::HEADER_MAJOR,
        ffi::MIN_MINOR
    );
    if major != ffi::HEADER_MAJOR || minor < ffi::MIN_MINOR {
        return Err(unavailable(format!(
            "PJRT plugin {shown} is incompatible: it implements PJRT C API {major}.{minor}; {ours}"
        )));
    }
    if size < ffi::API_MIN_SIZE {
        return Err(unavailable(format!(
            "PJRT plugin {shown} is incompatible: its API table is {size} bytes, fewer than the {} \
             tutti needs; {ours}",
            ffi::API_MIN_SIZE
        )));
    }
    Ok(())
}

/// Copy a (pointer, length) string the plugin owns.
///
/// # Safety
/// `p` must be null or point to `n` readable bytes.
pub(crate) unsafe fn str_of(p: *const c_char, n: usize) -> String {
    if p.is_null() {
        return String::new();
    }
    let bytes = std::slice::from_raw_parts(p.cast::<u8>(), n);
    String::from_utf8_lossy(bytes).into_owned()
}

/// The message and code of `err`, destroying it. Never panics (it runs in callbacks too).
pub(crate) fn take_error(api: &ffi::Api, err: *mut ffi::Error) -> Option<(i32, String)> {
    if err.is_null() {
        return None;
    }
    let mut message = String::from("(the plugin gave no message)");
    if let Some(f) = api.error_message {
        let mut args = ffi::Error_Message_Args {
            struct_size: ffi::ERROR_MESSAGE_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            error: err,
            message: std::ptr::null(),
            message_size: 0,
        };
        // SAFETY: err is a live error; the message lives as long as it.
        unsafe {
            f(&mut args);
            if !args.message.is_null() {
                message = str_of(args.message, args.message_size);
            }
        }
    }
    let mut code = 2;
    if let Some(f) = api.error_get_code {
        let mut args = ffi::Error_GetCode_Args {
            struct_size: ffi::ERROR_GETCODE_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            error: err,
            code: 2,
        };
        // SAFETY: err is a live error.
        let e2 = unsafe { f(&mut args) };
        if e2.is_null() {
            code = args.code;
        } else if let Some(d) = api.error_destroy {
            let mut a = ffi::Error_Destroy_Args {
                struct_size: ffi::ERROR_DESTROY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                error: e2,
            };
            // SAFETY: e2 is an error the plugin handed us.
            unsafe { d(&mut a) };
        }
    }
    if let Some(d) = api.error_destroy {
        let mut args = ffi::Error_Destroy_Args {
            struct_size: ffi::ERROR_DESTROY_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            error: err,
        };
        // SAFETY: err is a live error, destroyed once.
        unsafe { d(&mut args) };
    }
    Some((code, message))
}

/// Wait for a child process with a bound, killing it when the bound passes.
pub(crate) fn wait_child(
    child: &mut std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s),
            Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_from_names() {
        assert_eq!(
            PluginKind::of(Path::new("/x/libtpu/libtpu.so")),
            PluginKind::Tpu
        );
        assert_eq!(
            PluginKind::of(Path::new("/x/jax_plugins/xla_cuda13/xla_cuda_plugin.so")),
            PluginKind::Cuda
        );
        assert_eq!(
            PluginKind::of(Path::new("/x/xla_cpu_pjrt.so")),
            PluginKind::Cpu
        );
        assert!(PluginKind::Tpu < PluginKind::Cuda && PluginKind::Other < PluginKind::Cpu);
    }

    #[test]
    fn versions_are_checked() {
        assert!(check_version("p", (0, ffi::HEADER_MINOR), ffi::API_MIN_SIZE).is_ok());
        assert!(check_version("p", (0, ffi::MIN_MINOR), 10_000).is_ok());
        let e = check_version("p", (1, 0), 10_000).unwrap_err().to_string();
        assert!(e.contains("incompatible") && e.contains("1.0"), "{e}");
        let e = check_version("p", (0, ffi::MIN_MINOR - 1), 10_000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("incompatible"), "{e}");
        let e = check_version("p", (0, 81), 100).unwrap_err().to_string();
        assert!(e.contains("100 bytes"), "{e}");
    }

    #[test]
    fn missing_file_is_unavailable() {
        let e = Plugin::load("/nonexistent/tutti/plugin.so").unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        assert!(e.to_string().contains("no such file"), "{e}");
    }
}
