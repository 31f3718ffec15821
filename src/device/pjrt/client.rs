//! A PJRT client: its devices, device buffers, compiled programs and bounded waits.
//!
//! (Why one long file: the client, its buffers, program cache and event waits all own raw
//! PJRT handles whose drop order and thread rules are kept in one place.)

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ffi;
use super::plugin::{self, str_of, Candidate, Plugin, PluginKind, PLUGIN_ENV};
use super::program::{self, Kind, Step};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// The environment variable holding client options: `key=value` pairs separated by commas.
pub const OPTIONS_ENV: &str = "TUTTI_PJRT_OPTIONS";

/// The value of a client option.
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    /// A 64-bit integer (`PJRT_NamedValue_kInt64`).
    Int(i64),
    /// A boolean (`kBool`).
    Bool(bool),
    /// A float (`kFloat`).
    Float(f32),
    /// A string (`kString`).
    Str(String),
}

impl OptionValue {
    /// Parse text: an integer, `true`/`false`, a number with a `.` or exponent as a float,
    /// anything else as a string.
    pub fn parse(text: &str) -> OptionValue {
        let t = text.trim();
        if let Ok(i) = t.parse::<i64>() {
            return OptionValue::Int(i);
        }
        match t {
            "true" => return OptionValue::Bool(true),
            "false" => return OptionValue::Bool(false),
            _ => {}
        }
        if t.contains(['.', 'e', 'E'])
            && !t
                .chars()
                .any(|c| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        {
            if let Ok(f) = t.parse::<f32>() {
                return OptionValue::Float(f);
            }
        }
        OptionValue::Str(t.to_string())
    }
}

impl std::fmt::Display for OptionValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptionValue::Int(v) => write!(f, "{v}"),
            OptionValue::Bool(v) => write!(f, "{v}"),
            OptionValue::Float(v) => write!(f, "{v}"),
            OptionValue::Str(v) => f.write_str(v),
        }
    }
}

/// What a client is created with: the plugin's create options and tutti's own settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientOptions {
    /// Options passed to `PJRT_Client_Create` (e.g. `cpu_device_count` for the CPU plugin).
    pub options: Vec<(String, OptionValue)>,
    /// Bound on every wait for the devices (default: `TUTTI_TIMEOUT` seconds, else 300 s).
    pub timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            options: Vec::new(),
            timeout: crate::sync::default_timeout(),
        }
    }
}

impl ClientOptions {
    /// Parse `key=value,key=value` (the `TUTTI_PJRT_OPTIONS` syntax).
    pub fn parse(text: &str) -> Result<ClientOptions> {
        let mut o = ClientOptions::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = pair.split_once('=') else {
                return Err(Error::config(format!(
                    "{OPTIONS_ENV}: '{pair}' is not key=value (e.g. cpu_device_count=4)"
                )));
            };
            let k = k.trim();
            if k.is_empty() || k.contains('\0') || v.contains('\0') {
                return Err(Error::config(format!(
                    "{OPTIONS_ENV}: '{pair}' has an empty key or a NUL byte"
                )));
            }
            o = o.with(k, OptionValue::parse(v));
        }
        Ok(o)
    }

    /// The options of `TUTTI_PJRT_OPTIONS` (none when it is unset).
    pub fn from_env() -> Result<ClientOptions> {
        match std::env::var(OPTIONS_ENV) {
            Ok(v) => ClientOptions::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(ClientOptions::default()),
            Err(e) => Err(Error::config(format!("{OPTIONS_ENV}: {e}"))),
        }
    }

    /// These options with `key` set to `value` (replacing an earlier value).
    pub fn with(mut self, key: &str, value: OptionValue) -> ClientOptions {
        self.options.retain(|(k, _)| k != key);
        self.options.push((key.to_string(), value));
        self
    }

    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> ClientOptions {
        self.timeout = timeout;
        self
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&OptionValue> {
        self.options.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// One addressable device of a client.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct XlaDevice {
    /// Position among the plugin client's addressable devices (the device is `xla:{index}`):
    /// replica `i` of a collective runs on device `i`. A view of some of the devices
    /// ([`Client::subset`]) keeps each device's own index, while its replica `i` runs on its
    /// device `i`.
    pub index: usize,
    /// The PJRT device id (unique across the processes of a job).
    pub id: i64,
    /// The index of the process the device belongs to.
    pub process_index: i64,
    /// The PJRT device kind (`cpu`, `TPU v4`, `NVIDIA H100 80GB HBM3`, ...).
    pub kind: String,
    /// The plugin's short description (`CpuDevice(id=0)`, `TPU_0(process=0,(0,0,0,0))`, ...).
    pub description: String,
    /// The local hardware id (`-1` where the plugin has none).
    pub local_hardware_id: i64,
    /// The memory the device may use, when the plugin says.
    pub memory_bytes: Option<u64>,
}

/// How the collectives are carried out.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Compiled XLA programs, falling back to the host-staged path for a program the plugin
    /// cannot compile (remembered per program).
    Auto,
    /// Compiled XLA programs only: a program that does not compile is an error.
    Program,
    /// Copy to the host, reduce there with tutti's kernels, copy back.
    HostStaged,
}

/// Counters of the program cache, and of the buffers copied between host and devices.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Programs compiled (cache misses that compiled).
    pub compiled: u64,
    /// Calls that found their program compiled already.
    pub hits: u64,
    /// Programs the plugin refused, run host-staged instead.
    pub refused: u64,
    /// Calls that ran host-staged.
    pub staged_calls: u64,
    /// Collectives whose data went through host memory: every call on host buffers (the
    /// `*_raw` forms and the typed host forms, which the `xla:N` ranks of a communicator run;
    /// each copies its inputs to the devices and its results back, or reduces on the host),
    /// and the calls on device buffers (and on [`crate::DeviceTensor`]s) that ran host-staged.
    /// A call is counted once its arguments passed their checks.
    pub host_calls: u64,
    /// Buffers copied from host memory to a device (by any call, or by
    /// [`Client::buffer_from_host`]).
    pub uploads: u64,
    /// Buffers copied from a device to host memory (by any call, or by
    /// [`XlaBuffer::to_vec`]).
    pub downloads: u64,
    /// Programs run (each collective, update or optimizer step: one launch for all the devices
    /// it runs on), what a device pays its dispatch for.
    pub launches: u64,
}

pub(crate) struct Executable {
    ptr: *mut ffi::LoadedExecutable,
    /// `order[i]`: the replica whose buffers go in the i-th argument list.
    pub(crate) order: Vec<usize>,
}

// SAFETY: PJRT loaded executables may be executed from any thread.
unsafe impl Send for Executable {}
unsafe impl Sync for Executable {}

#[derive(Clone)]
pub(crate) enum Compiled {
    Ready(Arc<Executable>),
    /// The plugin refused this program: its message.
    Refused(String),
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ProgramKey {
    pub kind: Kind,
    pub dtype: DType,
    pub count: usize,
    pub replicas: usize,
}

pub(crate) struct Inner {
    pub(crate) plugin: &'static Plugin,
    ptr: *mut ffi::Client,
    devices: Vec<XlaDevice>,
    device_ptrs: Vec<*mut ffi::Device>,
    platform_name: String,
    platform_version: String,
    process_index: i64,
    pub(crate) timeout: Duration,
    cache: Mutex<HashMap<ProgramKey, Compiled>>,
    /// The optimizer steps' programs, each for one device: (step, dtype, count, device).
    steps: Mutex<HashMap<(Step, DType, usize, usize), Compiled>>,
    /// The steps fused with the gradients' sum, by replicas.
    group_steps: Mutex<HashMap<(Step, DType, usize, usize), Compiled>>,
    stats: Mutex<CacheStats>,
    route: Mutex<Route>,
    pub(crate) calls: AtomicU64,
    /// Set when a wait timed out: the plugin may still be working on memory tutti no longer
    /// tracks, so the client refuses further work and is never destroyed. Shared by a client
    /// and its views ([`Client::subset`]): they are one PJRT client.
    poisoned: Arc<Mutex<Option<String>>>,
    /// Held while a program is launched, by a client and its views alike: programs with
    /// collectives that share devices are queued on every device in one order, so that no
    /// device waits in one program's collective for a peer busy in another's.
    launch: Arc<parking_lot::Mutex<()>>,
    /// The client this one is a view of ([`Client::subset`]), kept alive while the view is;
    /// `None` for the client PJRT made, which alone destroys it.
    parent: Option<Arc<Inner>>,
}

// SAFETY: PJRT clients, devices, buffers and executables may be used from any thread (the PJRT
// C API requires plugins to be thread-safe); the Rust-side state is behind mutexes and atomics.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// A PJRT client: the devices of one plugin, and the collectives across them.
///
/// Cheap to clone (shared). Device buffers keep their client alive.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("plugin", &self.inner.plugin.path())
            .field("platform", &self.inner.platform_name)
            .field("devices", &self.inner.devices.len())
            .finish()
    }
}

/// A buffer on one device of a client.
pub struct XlaBuffer {
    inner: Arc<Inner>,
    pub(crate) ptr: *mut ffi::Buffer,
    device: usize,
    dtype: DType,
    len: usize,
}

// SAFETY: PJRT buffers may be used from any thread; this handle only reads its own fields.
unsafe impl Send for XlaBuffer {}
unsafe impl Sync for XlaBuffer {}

impl std::fmt::Debug for XlaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "XlaBuffer({} x {} on {})",
            self.dtype,
            self.len,
            self.device_name()
        )
    }
}

fn buffer_type(d: DType) -> std::ffi::c_int {
    match d {
        DType::F32 => ffi::BUFFER_TYPE_F32,
        DType::F64 => ffi::BUFFER_TYPE_F64,
        DType::F16 => ffi::BUFFER_TYPE_F16,
        DType::BF16 => ffi::BUFFER_TYPE_BF16,
        DType::I8 => ffi::BUFFER_TYPE_S8,
        DType::U8 => ffi::BUFFER_TYPE_U8,
        DType::I32 => ffi::BUFFER_TYPE_S32,
        DType::U32 => ffi::BUFFER_TYPE_U32,
        DType::I64 => ffi::BUFFER_TYPE_S64,
        DType::U64 => ffi::BUFFER_TYPE_U64,
    }
}

/// What an event callback hands back: which event, and its error if any.
type Ready = (usize, Option<(i32, String)>);

struct Waiter {
    api: &'static ffi::Api,
    index: usize,
    tx: crossbeam_channel::Sender<Ready>,
}

/// `PJRT_Event_OnReady` callback: report the event's status to the waiting thread. Owns
/// `user_arg` (a boxed [`Waiter`]) and the error. Never unwinds into the plugin.
unsafe extern "C" fn on_ready(err: *mut ffi::Error, user_arg: *mut c_void) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if user_arg.is_null() {
            return;
        }
        // SAFETY: user_arg is the Box<Waiter> leaked when the callback was registered, and
        // the plugin calls the callback once.
        let w = unsafe { Box::from_raw(user_arg.cast::<Waiter>()) };
        let status = plugin::take_error(w.api, err);
        let _ = w.tx.send((w.index, status));
    }));
}

impl Client {
    /// A client of the plugin `TUTTI_PJRT_PLUGIN` names, or the first one discovery finds that
    /// starts (see [`plugin::candidates`]), with the options of `TUTTI_PJRT_OPTIONS`.
    pub fn from_env() -> Result<Client> {
        Client::discover(&ClientOptions::from_env()?)
    }

    /// Like [`Client::from_env`] with these options. Where discovery finds several plugins, one
    /// whose client fails to start (a CUDA plugin on a machine without a GPU) gives way to the
    /// next, and the error lists every reason.
    pub fn discover(options: &ClientOptions) -> Result<Client> {
        Client::discover_with(&|_| options.clone())
    }

    /// Like [`Client::discover`], with the options chosen per plugin (e.g. a device count for
    /// the CPU plugin only).
    pub fn discover_with(options: &dyn Fn(&Plugin) -> ClientOptions) -> Result<Client> {
        let found = plugin::candidates();
        let mut why = Vec::new();
        for c in &found {
            if let Some(skip) = plugin::skip_reason(c) {
                why.push(skip);
                continue;
            }
            match Plugin::load(&c.path).and_then(|p| Client::new(p, &options(p))) {
                Ok(client) => return Ok(client),
                Err(e) if c.source == PLUGIN_ENV => return Err(e),
                Err(e) => why.push(e.to_string()),
            }
        }
        Err(plugin::not_found(&why))
    }

    /// A client of `plugin` with `options`. A CUDA plugin's client takes GPU memory as it
    /// needs it (`preallocate=false`) unless the options name `preallocate`, `allocator` or
    /// `memory_fraction`: XLA's own default takes 75% of the GPU at once, which the caller's
    /// framework on that GPU would then lack.
    pub fn new(plugin: &'static Plugin, options: &ClientOptions) -> Result<Client> {
        let defaulted;
        let options = if PluginKind::of(plugin.path()) == PluginKind::Cuda
            && ["preallocate", "allocator", "memory_fraction"]
                .iter()
                .all(|k| options.get(k).is_none())
        {
            defaulted = options
                .clone()
                .with("preallocate", OptionValue::Bool(false));
            &defaulted
        } else {
            options
        };
        let api = plugin.api;
        let create = api
            .client_create
            .ok_or_else(|| missing(plugin, "PJRT_Client_Create"))?;
        let names: Vec<Vec<u8>> = options
            .options
            .iter()
            .map(|(k, _)| k.as_bytes().to_vec())
            .collect();
        let strings: Vec<Vec<u8>> = options
            .options
            .iter()
            .map(|(_, v)| match v {
                OptionValue::Str(s) => s.as_bytes().to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let values: Vec<ffi::NamedValue> = options
            .options
            .iter()
            .enumerate()
            .map(|(i, (_, v))| {
                let (type_, value, value_size) = match v {
                    OptionValue::Int(x) => (
                        ffi::NAMED_VALUE_INT64,
                        ffi::NamedValueValue { int64_value: *x },
                        1,
                    ),
                    OptionValue::Bool(x) => (
                        ffi::NAMED_VALUE_BOOL,
                        ffi::NamedValueValue { bool_value: *x },
                        1,
                    ),
                    OptionValue::Float(x) => (
                        ffi::NAMED_VALUE_FLOAT,
                        ffi::NamedValueValue { float_value: *x },
                        1,
                    ),
                    OptionValue::Str(_) => (
                        ffi::NAMED_VALUE_STRING,
                        ffi::NamedValueValue {
                            string_value: strings[i].as_ptr().cast(),
                        },
                        strings[i].len(),
                    ),
                };
                ffi::NamedValue {
                    struct_size: ffi::NAMED_VALUE_SIZE,
                    extension_start: std::ptr::null_mut(),
                    name: names[i].as_ptr().cast(),
                    name_size: names[i].len(),
                    type_,
                    value,
                    value_size,
                }
            })
            .collect();
        let mut args = ffi::Client_Create_Args {
            struct_size: ffi::CLIENT_CREATE_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            create_options: values.as_ptr(),
            num_options: values.len(),
            kv_get_callback: None,
            kv_get_user_arg: std::ptr::null_mut(),
            kv_put_callback: None,
            kv_put_user_arg: std::ptr::null_mut(),
            client: std::ptr::null_mut(),
            kv_try_get_callback: None,
            kv_try_get_user_arg: std::ptr::null_mut(),
        };
        // SAFETY: valid args; the option names and values outlive the call.
        let err = unsafe { create(&mut args) };
        if let Some((code, message)) = plugin.take_error(err) {
            let shown = plugin.path().display();
            let opts: Vec<String> = options
                .options
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let with = if opts.is_empty() {
                String::new()
            } else {
                format!(" with options {}", opts.join(","))
            };
            // A TPU plugin that starts no client found no usable TPU, unless tutti's own
            // options were at fault.
            let no_tpu =
                plugin.kind() == PluginKind::Tpu && code != ffi::ERROR_CODE_INVALID_ARGUMENT;
            return Err(if no_tpu {
                Error::Unavailable {
                    what: "XLA".into(),
                    why: format!(
                        "no TPU: the TPU plugin {shown} could not start a client{with} ({}: {message})",
                        ffi::error_code_name(code)
                    ),
                }
            } else {
                Error::Unavailable {
                    what: "XLA".into(),
                    why: format!(
                        "the PJRT plugin {shown} could not start a client{with} ({}: {message})",
                        ffi::error_code_name(code)
                    ),
                }
            });
        }
        if args.client.is_null() {
            return Err(Error::System {
                what: "PJRT_Client_Create".into(),
                message: format!("{} returned no client", plugin.path().display()),
            });
        }
        let mut inner = Inner {
            plugin,
            ptr: args.client,
            devices: Vec::new(),
            device_ptrs: Vec::new(),
            platform_name: String::new(),
            platform_version: String::new(),
            process_index: 0,
            timeout: options.timeout,
            cache: Mutex::new(HashMap::new()),
            steps: Mutex::new(HashMap::new()),
            group_steps: Mutex::new(HashMap::new()),
            stats: Mutex::new(CacheStats::default()),
            route: Mutex::new(Route::Auto),
            calls: AtomicU64::new(0),
            poisoned: Arc::new(Mutex::new(None)),
            launch: Arc::new(parking_lot::Mutex::new(())),
            parent: None,
        };
        // From here on, dropping `inner` destroys the client.
        inner.platform_name =
            inner.client_string(api.client_platform_name, "PJRT_Client_PlatformName")?;
        inner.platform_version = inner
            .client_string(api.client_platform_version, "PJRT_Client_PlatformVersion")
            .unwrap_or_default();
        if let Some(f) = api.client_process_index {
            let mut a = ffi::Client_ProcessIndex_Args {
                struct_size: ffi::CLIENT_PROCESS_INDEX_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                client: inner.ptr,
                process_index: 0,
            };
            // SAFETY: valid args.
            let err = unsafe { f(&mut a) };
            plugin.check(err, || "PJRT_Client_ProcessIndex".into())?;
            inner.process_index = i64::from(a.process_index);
        }
        inner.load_devices()?;
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// The plugin this client runs on.
    pub fn plugin(&self) -> &'static Plugin {
        self.inner.plugin
    }

    /// The platform's name (`cpu`, `tpu`, `cuda`, ...).
    pub fn platform_name(&self) -> &str {
        &self.inner.platform_name
    }

    /// The platform's version text.
    pub fn platform_version(&self) -> &str {
        &self.inner.platform_version
    }

    /// This process's index in the job (0 for a single process).
    pub fn process_index(&self) -> i64 {
        self.inner.process_index
    }

    /// The addressable devices, in the order collectives place replicas on them.
    pub fn devices(&self) -> &[XlaDevice] {
        &self.inner.devices
    }

    /// A client over some of this one's devices: its device `i` is this one's `devices[i]`
    /// (still named by its own `index`), its replica `i` of every collective runs there, and its
    /// programs span those devices only. It is the same PJRT client (no new one starts): its
    /// buffers are its own, its programs compiled and cached apart, and a failure that makes
    /// one unusable makes both so. How a group of some of a client's devices (a split, or
    /// ranks on `xla:2` and `xla:3`) runs its calls.
    ///
    /// Errors name a device listed twice or one this client lacks.
    pub fn subset(&self, devices: &[usize]) -> Result<Client> {
        self.inner.check_usable()?;
        let have = self.inner.devices.len();
        for (i, &d) in devices.iter().enumerate() {
            if d >= have {
                return Err(Error::config(format!(
                    "XLA device {d} (entry {i} of the subset) does not exist: this {} client \
                     has {have} device(s)",
                    self.inner.platform_name
                )));
            }
            if let Some(j) = devices[..i].iter().position(|&e| e == d) {
                return Err(Error::config(format!(
                    "XLA device {d} is listed twice in the subset (entries {j} and {i})"
                )));
            }
        }
        let p = &self.inner;
        let inner = Inner {
            plugin: p.plugin,
            ptr: p.ptr,
            devices: devices.iter().map(|&d| p.devices[d].clone()).collect(),
            device_ptrs: devices.iter().map(|&d| p.device_ptrs[d]).collect(),
            platform_name: p.platform_name.clone(),
            platform_version: p.platform_version.clone(),
            process_index: p.process_index,
            timeout: p.timeout,
            cache: Mutex::new(HashMap::new()),
            steps: Mutex::new(HashMap::new()),
            group_steps: Mutex::new(HashMap::new()),
            stats: Mutex::new(CacheStats::default()),
            route: Mutex::new(self.route()),
            calls: AtomicU64::new(0),
            poisoned: p.poisoned.clone(),
            launch: p.launch.clone(),
            parent: Some(p.clone()),
        };
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// How collectives run from now on (default [`Route::Auto`]).
    pub fn set_route(&self, route: Route) {
        *self.inner.route.lock().unwrap_or_else(|e| e.into_inner()) = route;
    }

    /// How collectives run.
    pub fn route(&self) -> Route {
        *self.inner.route.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The program cache's counters.
    pub fn cache_stats(&self) -> CacheStats {
        *self.inner.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copy `data` to device `device` (for every element type).
    pub fn buffer_from_host<T: Element>(&self, data: &[T], device: usize) -> Result<XlaBuffer> {
        self.inner
            .upload(bytemuck::cast_slice(data), T::DTYPE, data.len(), device)
            .map(|ptr| XlaBuffer {
                inner: self.inner.clone(),
                ptr,
                device,
                dtype: T::DTYPE,
                len: data.len(),
            })
    }

    pub(crate) fn wrap(
        &self,
        ptr: *mut ffi::Buffer,
        device: usize,
        dtype: DType,
        len: usize,
    ) -> XlaBuffer {
        XlaBuffer {
            inner: self.inner.clone(),
            ptr,
            device,
            dtype,
            len,
        }
    }

    pub(crate) fn upload_bytes(
        &self,
        bytes: &[u8],
        dtype: DType,
        device: usize,
    ) -> Result<XlaBuffer> {
        let len = bytes.len() / dtype.size();
        self.inner
            .upload(bytes, dtype, len, device)
            .map(|ptr| self.wrap(ptr, device, dtype, len))
    }

    /// One optimizer step of a variable's copy `w` by the gradient `g`, both on one device of
    /// this client, at learning rate `lr` (one element of the step's arithmetic there), with the
    /// rule's `state` there (its slots, then Adam's powers: see [`Step`]), in one program on
    /// that device. Returns the new copy and state (the old
    /// buffers are left as they were), or `None` where the step is to run on the host instead:
    /// the route is host-staged, or the plugin refused the program under [`Route::Auto`].
    pub(crate) fn run_step(
        &self,
        step: Step,
        w: &XlaBuffer,
        g: &XlaBuffer,
        lr: &XlaBuffer,
        state: &[&XlaBuffer],
    ) -> Result<Option<(XlaBuffer, Vec<XlaBuffer>)>> {
        self.inner.check_usable()?;
        let want = self.step_state(step, w, g, lr, state)?;
        let (dtype, count, device) = (w.dtype(), w.len(), w.device());
        let route = self.route();
        if route == Route::HostStaged {
            self.inner.count_staged();
            return Ok(None);
        }
        let exe = match self.inner.step_program(step, dtype, count, device)? {
            Compiled::Ready(exe) => exe,
            Compiled::Refused(_) if route == Route::Auto => {
                self.inner.count_staged();
                return Ok(None);
            }
            Compiled::Refused(why) => {
                return Err(Error::System {
                    what: format!("XLA: compiling the {step:?} step for {dtype} x {count}"),
                    message: why,
                })
            }
        };
        let mut args = vec![w, g, lr];
        args.extend_from_slice(state);
        let outs =
            self.inner
                .execute_outputs(&exe, &[args], 1 + state.len(), "an optimizer step")?;
        let mut bufs = outs.into_iter().flatten();
        let new_w = bufs.next().map(|ptr| self.wrap(ptr, device, dtype, count));
        let new_state: Vec<XlaBuffer> = bufs
            .zip(&want)
            .map(|(ptr, &(d, n))| self.wrap(ptr, device, d, n))
            .collect();
        match new_w {
            Some(w) if new_state.len() == state.len() => Ok(Some((w, new_state))),
            _ => Err(Error::System {
                what: "XLA: an optimizer step".into(),
                message: "the plugin returned fewer results than the program has".into(),
            }),
        }
    }
}

impl Client {
    /// The state (dtype, length of each buffer) `step` keeps beside a copy like `w`, once the
    /// step's buffers are checked: `w`, its gradient `g`, the learning rate `lr` and `state`
    /// all on `w`'s device of this client, of the dtypes and lengths the step takes.
    fn step_state(
        &self,
        step: Step,
        w: &XlaBuffer,
        g: &XlaBuffer,
        lr: &XlaBuffer,
        state: &[&XlaBuffer],
    ) -> Result<Vec<(DType, usize)>> {
        let (dtype, count, device) = (w.dtype(), w.len(), w.device());
        let arith = program::step_arith(dtype);
        let wrong = |why: String| Err(Error::config(format!("XLA: an optimizer step: {why}")));
        if !dtype.is_float() {
            return wrong(format!(
                "the variable is {dtype}; steps are for float variables"
            ));
        }
        let mut want = vec![(arith, count); step.slots()];
        if step.powers() {
            want.push((arith, 2));
        }
        let given: Vec<(DType, usize)> = state.iter().map(|b| (b.dtype(), b.len())).collect();
        if given != want {
            return wrong(format!("the rule's state is {given:?}, not {want:?}"));
        }
        if (lr.dtype(), lr.len()) != (arith, 1) {
            return wrong(format!(
                "the learning rate is {} x {}, not one {arith}",
                lr.dtype(),
                lr.len()
            ));
        }
        for (b, what) in std::iter::once((g, "the gradient"))
            .chain(std::iter::once((w, "the variable")))
            .chain(std::iter::once((lr, "the learning rate")))
            .chain(state.iter().map(|b| (*b, "a slot")))
        {
            if !b.same_client(self) || b.device() != device {
                return wrong(format!(
                    "{what} is on {}device {}, the variable's copy on device {device}",
                    if b.same_client(self) {
                        ""
                    } else {
                        "another client's "
                    },
                    b.device()
                ));
            }
        }
        if (g.dtype(), g.len()) != (dtype, count) {
            return wrong(format!(
                "the gradient holds {} {}, the variable {count} {dtype}",
                g.len(),
                g.dtype()
            ));
        }
        Ok(want)
    }

    /// One optimizer step of every replica's copy fused with the gradients' sum: replica r's
    /// copy `steps[r].w` (on device r), gradient, learning rate and state as [`Client::run_step`]
    /// takes them; the gradients summed across the replicas, then each copy stepped by the sum,
    /// in one program on every device ([`program::step_group_mlir`]). Returns, per replica,
    /// the new copy, state and summed gradient (the old buffers are left as they were), or
    /// `None` where the route is host-staged or the plugin refused the program under
    /// [`Route::Auto`]: then the sum and the steps are to run apart.
    pub(crate) fn run_group_step(
        &self,
        step: Step,
        steps: &[StepBuffers<'_>],
    ) -> Result<Option<Vec<StepResult>>> {
        self.inner.check_usable()?;
        let n = steps.len();
        let Some(first) = steps.first() else {
            return Ok(Some(Vec::new()));
        };
        let (dtype, count) = (first.w.dtype(), first.w.len());
        let mut want = Vec::new();
        for (r, s) in steps.iter().enumerate() {
            want = self.step_state(step, s.w, s.g, s.lr, &s.state)?;
            if s.w.device() != r || (s.w.dtype(), s.w.len()) != (dtype, count) {
                return Err(Error::config(format!(
                    "XLA: an optimizer step: replica {r}'s copy is {} x {} on device {}; replica \
                     0's is {dtype} x {count}, and replica r's must be on device r",
                    s.w.dtype(),
                    s.w.len(),
                    s.w.device()
                )));
            }
        }
        let route = self.route();
        if route == Route::HostStaged || n < 2 {
            return Ok(None);
        }
        let exe = match self.inner.group_step_program(step, dtype, count, n)? {
            Compiled::Ready(exe) => exe,
            Compiled::Refused(_) if route == Route::Auto => return Ok(None),
            Compiled::Refused(why) => {
                return Err(Error::System {
                    what: format!(
                        "XLA: compiling the {step:?} step for {dtype} x {count} on {n} devices"
                    ),
                    message: why,
                })
            }
        };
        let args: Vec<Vec<&XlaBuffer>> = steps
            .iter()
            .map(|s| {
                let mut a = vec![s.w, s.g, s.lr];
                a.extend_from_slice(&s.state);
                a
            })
            .collect();
        let outs = self.inner.execute_outputs(
            &exe,
            &args,
            2 + want.len(),
            "an optimizer step with the gradients' sum",
        )?;
        let mut results = Vec::with_capacity(n);
        for (r, ptrs) in outs.into_iter().enumerate() {
            // Every buffer the plugin returned is owned (destroyed if dropped).
            let mut bufs = ptrs.into_iter().enumerate().map(|(k, ptr)| {
                let (d, len) = match k {
                    0 => (dtype, count),
                    k if k <= want.len() => want[k - 1],
                    _ => (dtype, count),
                };
                self.wrap(ptr, r, d, len)
            });
            let w = bufs.next();
            let state: Vec<XlaBuffer> = bufs.by_ref().take(want.len()).collect();
            let g = bufs.next();
            match (w, g) {
                (Some(w), Some(g)) if state.len() == want.len() => {
                    results.push(StepResult { w, state, g })
                }
                _ => {
                    return Err(Error::System {
                        what: "XLA: an optimizer step with the gradients' sum".into(),
                        message: "the plugin returned fewer results than the program has".into(),
                    })
                }
            }
        }
        Ok(Some(results))
    }
}

/// One replica's buffers of [`Client::run_group_step`].
pub(crate) struct StepBuffers<'a> {
    /// The variable's copy.
    pub w: &'a XlaBuffer,
    /// The replica's gradient.
    pub g: &'a XlaBuffer,
    /// The learning rate (one element of the step's arithmetic).
    pub lr: &'a XlaBuffer,
    /// The rule's slots, then Adam's powers.
    pub state: Vec<&'a XlaBuffer>,
}

/// One replica's results of [`Client::run_group_step`].
pub(crate) struct StepResult {
    /// The stepped copy.
    pub w: XlaBuffer,
    /// The rule's state after the step.
    pub state: Vec<XlaBuffer>,
    /// The gradients' sum.
    pub g: XlaBuffer,
}

fn missing(plugin: &Plugin, name: &str) -> Error {
    Error::Unavailable {
        what: "XLA".into(),
        why: format!(
            "PJRT plugin {} does not implement {name}",
            plugin.path().display()
        ),
    }
}

impl Inner {
    pub(crate) fn api(&self) -> &'static ffi::Api {
        self.plugin.api
    }

    pub(crate) fn check_usable(&self) -> Result<()> {
        match &*self.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            None => Ok(()),
            // A dead group is `Aborted` on every device kind, as on a communicator.
            Some(why) => Err(Error::Aborted {
                rank: 0,
                reason: format!(
                    "the XLA client is unusable after an earlier failure ({why}); create a new \
                     client"
                ),
            }),
        }
    }

    pub(crate) fn poison(&self, why: &str) {
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_none() {
            *p = Some(why.to_string());
        }
    }

    pub(crate) fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn client_string(
        &self,
        f: Option<unsafe extern "C" fn(*mut ffi::Client_String_Args) -> *mut ffi::Error>,
        name: &str,
    ) -> Result<String> {
        let f = f.ok_or_else(|| missing(self.plugin, name))?;
        let mut a = ffi::Client_String_Args {
            struct_size: ffi::CLIENT_STRING_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            client: self.ptr,
            value: std::ptr::null(),
            value_size: 0,
        };
        // SAFETY: valid args; the string lives as long as the client.
        let err = unsafe { f(&mut a) };
        self.plugin.check(err, || name.into())?;
        // SAFETY: (pointer, size) from the plugin.
        Ok(unsafe { str_of(a.value, a.value_size) })
    }

    fn load_devices(&mut self) -> Result<()> {
        let api = self.api();
        let f = api
            .client_addressable_devices
            .ok_or_else(|| missing(self.plugin, "PJRT_Client_AddressableDevices"))?;
        let mut a = ffi::Client_AddressableDevices_Args {
            struct_size: ffi::CLIENT_ADDRESSABLE_DEVICES_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            client: self.ptr,
            addressable_devices: std::ptr::null(),
            num_addressable_devices: 0,
        };
        // SAFETY: valid args; the list lives as long as the client.
        let err = unsafe { f(&mut a) };
        self.plugin
            .check(err, || "PJRT_Client_AddressableDevices".into())?;
        let ptrs: Vec<*mut ffi::Device> = if a.addressable_devices.is_null() {
            Vec::new()
        } else {
            // SAFETY: num_addressable_devices pointers, owned by the client.
            unsafe { std::slice::from_raw_parts(a.addressable_devices, a.num_addressable_devices) }
                .to_vec()
        };
        for (index, &dev) in ptrs.iter().enumerate() {
            let d = self.describe(index, dev)?;
            self.devices.push(d);
        }
        self.device_ptrs = ptrs;
        Ok(())
    }

    fn describe(&self, index: usize, dev: *mut ffi::Device) -> Result<XlaDevice> {
        let api = self.api();
        let p = self.plugin;
        let get = api
            .device_get_description
            .ok_or_else(|| missing(p, "PJRT_Device_GetDescription"))?;
        let mut a = ffi::Device_GetDescription_Args {
            struct_size: ffi::DEVICE_GET_DESCRIPTION_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            device: dev,
            device_description: std::ptr::null_mut(),
        };
        // SAFETY: valid args.
        let err = unsafe { get(&mut a) };
        p.check(err, || "PJRT_Device_GetDescription".into())?;
        let desc = a.device_description;
        let int = |f: Option<
            unsafe extern "C" fn(*mut ffi::DeviceDescription_Int_Args) -> *mut ffi::Error,
        >,
                   name: &str|
         -> Result<i64> {
            let Some(f) = f else { return Ok(-1) };
            let mut a = ffi::DeviceDescription_Int_Args {
                struct_size: ffi::DEVICE_DESCRIPTION_INT_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                device_description: desc,
                value: 0,
            };
            // SAFETY: valid args.
            let err = unsafe { f(&mut a) };
            p.check(err, || name.into())?;
            Ok(i64::from(a.value))
        };
        let text = |f: Option<
            unsafe extern "C" fn(*mut ffi::DeviceDescription_String_Args) -> *mut ffi::Error,
        >,
                    name: &str|
         -> Result<String> {
            let Some(f) = f else { return Ok(String::new()) };
            let mut a = ffi::DeviceDescription_String_Args {
                struct_size: ffi::DEVICE_DESCRIPTION_STRING_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                device_description: desc,
                value: std::ptr::null(),
                value_size: 0,
            };
            // SAFETY: valid args; the string lives as long as the device.
            let err = unsafe { f(&mut a) };
            p.check(err, || name.into())?;
            // SAFETY: (pointer, size) from the plugin.
            Ok(unsafe { str_of(a.value, a.value_size) })
        };
        let local_hardware_id = match api.device_local_hardware_id {
            Some(f) => {
                let mut a = ffi::Device_LocalHardwareId_Args {
                    struct_size: ffi::DEVICE_LOCAL_HARDWARE_ID_ARGS_SIZE,
                    extension_start: std::ptr::null_mut(),
                    device: dev,
                    local_hardware_id: -1,
                };
                // SAFETY: valid args.
                let err = unsafe { f(&mut a) };
                p.check(err, || "PJRT_Device_LocalHardwareId".into())?;
                i64::from(a.local_hardware_id)
            }
            None => -1,
        };
        Ok(XlaDevice {
            index,
            id: int(api.device_description_id, "PJRT_DeviceDescription_Id")?,
            process_index: int(
                api.device_description_process_index,
                "PJRT_DeviceDescription_ProcessIndex",
            )?,
            kind: text(api.device_description_kind, "PJRT_DeviceDescription_Kind")?,
            description: text(
                api.device_description_to_string,
                "PJRT_DeviceDescription_ToString",
            )?,
            local_hardware_id,
            memory_bytes: self.memory_limit(dev),
        })
    }

    /// The device's memory limit, where the plugin reports one (many do not: not an error).
    fn memory_limit(&self, dev: *mut ffi::Device) -> Option<u64> {
        let f = self.api().device_memory_stats?;
        // SAFETY: an all-zero Device_MemoryStats_Args is valid (integers, bools, nulls).
        let mut a: ffi::Device_MemoryStats_Args = unsafe { std::mem::zeroed() };
        a.struct_size = ffi::DEVICE_MEMORY_STATS_ARGS_SIZE;
        a.device = dev;
        // SAFETY: valid args.
        let err = unsafe { f(&mut a) };
        if self.plugin.take_error(err).is_some() || !a.bytes_limit_is_set || a.bytes_limit <= 0 {
            return None;
        }
        Some(a.bytes_limit as u64)
    }

    /// Copy host bytes to a new buffer on `device`. The plugin copies them before returning
    /// (`kImmutableOnlyDuringCall`), so the caller's memory is free when this returns.
    pub(crate) fn upload(
        &self,
        bytes: &[u8],
        dtype: DType,
        len: usize,
        device: usize,
    ) -> Result<*mut ffi::Buffer> {
        self.check_usable()?;
        let p = self.plugin;
        let Some(&dev) = self.device_ptrs.get(device) else {
            return Err(Error::config(format!(
                "XLA device {device} does not exist (this client has {} devices)",
                self.devices.len()
            )));
        };
        let f = self
            .api()
            .client_buffer_from_host_buffer
            .ok_or_else(|| missing(p, "PJRT_Client_BufferFromHostBuffer"))?;
        let dims = [len as i64];
        let mut a = ffi::Client_BufferFromHostBuffer_Args {
            struct_size: ffi::CLIENT_BUFFER_FROM_HOST_BUFFER_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            client: self.ptr,
            data: bytes.as_ptr().cast(),
            type_: buffer_type(dtype),
            dims: dims.as_ptr(),
            num_dims: 1,
            byte_strides: std::ptr::null(),
            num_byte_strides: 0,
            host_buffer_semantics: ffi::HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL,
            device: dev,
            memory: std::ptr::null_mut(),
            device_layout: std::ptr::null_mut(),
            done_with_host_buffer: std::ptr::null_mut(),
            buffer: std::ptr::null_mut(),
        };
        // SAFETY: valid args; `bytes` holds len elements of dtype and is only read during the
        // call.
        let err = unsafe { f(&mut a) };
        self.destroy_event(a.done_with_host_buffer);
        p.check(err, || {
            format!("copying {len} {dtype} elements to XLA device {device} (PJRT_Client_BufferFromHostBuffer)")
        })?;
        if a.buffer.is_null() {
            return Err(Error::System {
                what: "PJRT_Client_BufferFromHostBuffer".into(),
                message: "the plugin returned no buffer".into(),
            });
        }
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).uploads += 1;
        Ok(a.buffer)
    }

    /// Copy device buffers to host memory, all at once, waiting (bounded) for every copy.
    /// `dsts[i]` receives `srcs[i]`; each must be exactly the buffer's size.
    ///
    /// The copies land in memory this function allocates, then move to `dsts`: when a wait
    /// times out, that landing memory is left to the plugin (leaked) instead of the caller's.
    pub(crate) fn download(&self, srcs: &[&XlaBuffer], dsts: &mut [&mut [u8]]) -> Result<()> {
        self.check_usable()?;
        let p = self.plugin;
        let f = self
            .api()
            .buffer_to_host_buffer
            .ok_or_else(|| missing(p, "PJRT_Buffer_ToHostBuffer"))?;
        let mut landing: Vec<Vec<u64>> = srcs
            .iter()
            .map(|b| vec![0u64; (b.len * b.dtype.size()).div_ceil(8)])
            .collect();
        let mut events = Vec::with_capacity(srcs.len());
        let mut first_err = None;
        for (i, (b, land)) in srcs.iter().zip(landing.iter_mut()).enumerate() {
            let bytes = b.len * b.dtype.size();
            let mut a = ffi::Buffer_ToHostBuffer_Args {
                struct_size: ffi::BUFFER_TO_HOST_BUFFER_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                src: b.ptr,
                host_layout: std::ptr::null_mut(),
                dst: land.as_mut_ptr().cast(),
                dst_size: bytes,
                event: std::ptr::null_mut(),
            };
            // SAFETY: valid args; `land` holds at least `bytes` bytes and stays alive until the
            // event fires (or is leaked below).
            let err = unsafe { f(&mut a) };
            if let Err(e) = p.check(err, || {
                format!(
                    "copying buffer {i} from XLA device {} to the host (PJRT_Buffer_ToHostBuffer)",
                    b.device
                )
            }) {
                first_err.get_or_insert(e);
                self.destroy_event(a.event);
                continue;
            }
            events.push((b.device, a.event));
        }
        let waited = self.wait(&events, "copy device buffers to the host");
        if let Err(e) = waited {
            // The plugin may still write into the landing memory: never free it.
            std::mem::forget(landing);
            return Err(e);
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for ((b, land), dst) in srcs.iter().zip(&landing).zip(dsts.iter_mut()) {
            let bytes = b.len * b.dtype.size();
            if dst.len() != bytes {
                return Err(Error::config(format!(
                    "copying a {} x {} buffer to the host: the destination holds {} bytes, not {bytes}",
                    b.dtype,
                    b.len,
                    dst.len()
                )));
            }
            dst.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(land)[..bytes]);
        }
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .downloads += srcs.len() as u64;
        Ok(())
    }

    /// Wait for `events`, each labelled with the device that errors name, at most until the
    /// client's timeout from now; destroys them. On a timeout the client is poisoned.
    pub(crate) fn wait(&self, events: &[(usize, *mut ffi::Event)], what: &str) -> Result<()> {
        let p = self.plugin;
        let api = self.api();
        let (tx, rx) = crossbeam_channel::unbounded::<Ready>();
        // Callbacks report their position in `events` (unique); errors name the label.
        let mut pending: Vec<usize> = Vec::new();
        let mut failures: Vec<String> = Vec::new();
        for (k, &(label, ev)) in events.iter().enumerate() {
            if ev.is_null() {
                continue;
            }
            let Some(on) = api.event_on_ready else {
                failures.push("the plugin does not implement PJRT_Event_OnReady".into());
                break;
            };
            let w = Box::into_raw(Box::new(Waiter {
                api,
                index: k,
                tx: tx.clone(),
            }));
            let mut a = ffi::Event_OnReady_Args {
                struct_size: ffi::EVENT_ONREADY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                event: ev,
                callback: Some(on_ready),
                user_arg: w.cast(),
            };
            // SAFETY: valid args; the callback owns `w` once registered.
            let err = unsafe { on(&mut a) };
            if let Some((code, m)) = p.take_error(err) {
                // Not registered: the callback will never run, so `w` is still ours.
                // SAFETY: `w` came from Box::into_raw above and was not handed over.
                drop(unsafe { Box::from_raw(w) });
                failures.push(format!("{label}: {}: {m}", ffi::error_code_name(code)));
                continue;
            }
            pending.push(k);
        }
        drop(tx);
        let deadline = Instant::now() + self.timeout;
        let mut timed_out = false;
        while !pending.is_empty() {
            match rx.recv_deadline(deadline) {
                Ok((k, status)) => {
                    pending.retain(|&i| i != k);
                    if let Some((code, m)) = status {
                        let label = events[k].0;
                        failures.push(format!("{label}: {}: {m}", ffi::error_code_name(code)));
                    }
                }
                Err(_) => {
                    timed_out = true;
                    break;
                }
            }
        }
        for &(_, ev) in events {
            self.destroy_event(ev);
        }
        if timed_out {
            let list: Vec<String> = pending.iter().map(|&k| events[k].0.to_string()).collect();
            let why = format!(
                "timed out after {:?} waiting for XLA device(s) {} to {what}",
                self.timeout,
                list.join(", ")
            );
            self.poison(&why);
            return Err(Error::System {
                what: "XLA".into(),
                message: format!(
                    "{why}; the device is stuck or slow (raise the timeout with TUTTI_TIMEOUT); \
                     this client is now unusable"
                ),
            });
        }
        if !failures.is_empty() {
            return Err(Error::System {
                what: format!("XLA: {what}"),
                message: format!("failed on device(s) {}", failures.join("; ")),
            });
        }
        Ok(())
    }

    pub(crate) fn destroy_event(&self, ev: *mut ffi::Event) {
        if ev.is_null() {
            return;
        }
        if let Some(f) = self.api().event_destroy {
            let mut a = ffi::Event_Destroy_Args {
                struct_size: ffi::EVENT_DESTROY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                event: ev,
            };
            // SAFETY: a live event, destroyed once.
            let err = unsafe { f(&mut a) };
            if let Some((_, m)) = self.plugin.take_error(err) {
                log::warn!("XLA: destroying an event failed: {m}");
            }
        }
    }

    pub(crate) fn destroy_buffer(&self, b: *mut ffi::Buffer) {
        if b.is_null() {
            return;
        }
        if let Some(f) = self.api().buffer_destroy {
            let mut a = ffi::Buffer_Destroy_Args {
                struct_size: ffi::BUFFER_DESTROY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                buffer: b,
            };
            // SAFETY: a live buffer, destroyed once.
            let err = unsafe { f(&mut a) };
            if let Some((_, m)) = self.plugin.take_error(err) {
                log::warn!("XLA: destroying a buffer failed: {m}");
            }
        }
    }

    /// The compiled program for `key` (compiling it on a miss), or why the plugin refused it.
    pub(crate) fn program(&self, key: ProgramKey) -> Result<Compiled> {
        self.cached(&self.cache, key, || self.compile(key), |why| {
            log::warn!(
                "XLA: {} refused the {} program for {} x {} on {} devices; that call runs host-staged: {why}",
                self.plugin.path().display(),
                key.kind,
                key.dtype,
                key.count,
                key.replicas
            )
        })
    }

    /// The compiled program of `step` for `count` elements of `dtype` on device `device`
    /// (compiling it on a miss), or why the plugin refused it.
    pub(crate) fn step_program(
        &self,
        step: Step,
        dtype: DType,
        count: usize,
        device: usize,
    ) -> Result<Compiled> {
        let code = || self.compile_code(&program::step_mlir(step, dtype, count), &[device]);
        self.cached(&self.steps, (step, dtype, count, device), code, |why| {
            log::warn!(
                "XLA: {} refused the {step:?} step's program for {dtype} x {count}; it steps on \
                 the host: {why}",
                self.plugin.path().display()
            )
        })
    }

    /// The compiled program of `step` fused with the gradients' sum for `count` elements of
    /// `dtype` on devices `0..replicas` (compiling it on a miss), or why the plugin refused it.
    pub(crate) fn group_step_program(
        &self,
        step: Step,
        dtype: DType,
        count: usize,
        replicas: usize,
    ) -> Result<Compiled> {
        let devices: Vec<usize> = (0..replicas).collect();
        let code = || {
            self.compile_code(
                &program::step_group_mlir(step, dtype, count, replicas),
                &devices,
            )
        };
        self.cached(
            &self.group_steps,
            (step, dtype, count, replicas),
            code,
            |why| {
                log::warn!(
                    "XLA: {} refused the {step:?} step's program with the gradients' sum for \
                 {dtype} x {count} on {replicas} devices; the sum and the steps run apart: {why}",
                    self.plugin.path().display()
                )
            },
        )
    }

    /// `key`'s entry in `cache`, compiled by `compile` on a miss (`refused` told why, under the
    /// `Auto` route, where the plugin refuses it), the cache's counters kept.
    fn cached<K: std::hash::Hash + Eq + Copy>(
        &self,
        cache: &Mutex<HashMap<K, Compiled>>,
        key: K,
        compile: impl FnOnce() -> Result<Compiled>,
        refused: impl FnOnce(&str),
    ) -> Result<Compiled> {
        let hit = cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        if let Some(c) = hit {
            if matches!(c, Compiled::Ready(_)) {
                self.stats.lock().unwrap_or_else(|e| e.into_inner()).hits += 1;
            }
            return Ok(c);
        }
        let compiled = compile()?;
        if let Compiled::Refused(why) = &compiled {
            if *self.route.lock().unwrap_or_else(|e| e.into_inner()) == Route::Auto {
                refused(why);
            }
        }
        let mut entries = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = entries.get(&key).cloned() {
            // Another thread compiled it meanwhile: keep theirs.
            drop(entries);
            if let Compiled::Ready(exe) = compiled {
                self.destroy_executable(&exe);
            }
            return Ok(existing);
        }
        entries.insert(key, compiled.clone());
        drop(entries);
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        match &compiled {
            Compiled::Ready(_) => s.compiled += 1,
            Compiled::Refused(_) => s.refused += 1,
        }
        Ok(compiled)
    }

    pub(crate) fn count_host_call(&self) {
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .host_calls += 1;
    }

    pub(crate) fn count_staged(&self) {
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .staged_calls += 1;
    }

    fn compile(&self, key: ProgramKey) -> Result<Compiled> {
        let code = program::mlir(key.kind, key.dtype, key.count, key.replicas);
        let devices: Vec<usize> = (0..key.replicas).collect();
        self.compile_code(&code, &devices)
    }

    /// `code` compiled for one replica on each of `devices` (client device indices), replica
    /// r on `devices[r]`; or why the plugin refused it.
    fn compile_code(&self, code: &str, devices: &[usize]) -> Result<Compiled> {
        self.check_usable()?;
        let p = self.plugin;
        let api = self.api();
        let f = api
            .client_compile
            .ok_or_else(|| missing(p, "PJRT_Client_Compile"))?;
        let ids: Vec<i64> = devices.iter().map(|&d| self.devices[d].id).collect();
        let options = program::compile_options(&ids);
        let format = b"mlir";
        let prog = ffi::Program {
            struct_size: ffi::PROGRAM_SIZE,
            extension_start: std::ptr::null_mut(),
            code: code.as_ptr() as *mut _,
            code_size: code.len(),
            format: format.as_ptr().cast(),
            format_size: format.len(),
        };
        let mut a = ffi::Client_Compile_Args {
            struct_size: ffi::CLIENT_COMPILE_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            client: self.ptr,
            program: &prog,
            compile_options: options.as_ptr().cast(),
            compile_options_size: options.len(),
            executable: std::ptr::null_mut(),
        };
        // SAFETY: valid args; the code and options outlive the call (the plugin reads the code
        // and does not write it).
        let err = unsafe { f(&mut a) };
        if let Some((code_, message)) = p.take_error(err) {
            return Ok(Compiled::Refused(format!(
                "{}: {message}",
                ffi::error_code_name(code_)
            )));
        }
        if a.executable.is_null() {
            return Ok(Compiled::Refused(
                "the plugin returned no executable".into(),
            ));
        }
        let exe = Executable {
            ptr: a.executable,
            order: Vec::new(),
        };
        let order = self.replica_order(&exe, devices);
        match order {
            Ok(order) => Ok(Compiled::Ready(Arc::new(Executable { order, ..exe }))),
            Err(e) => {
                self.destroy_executable(&exe);
                Err(e)
            }
        }
    }

    /// Which replica each argument list of `exe` belongs to: the executable's addressable
    /// devices, matched against `devices` (replica r's is `devices[r]`).
    fn replica_order(&self, exe: &Executable, devices: &[usize]) -> Result<Vec<usize>> {
        let replicas = devices.len();
        let f = self
            .api()
            .loaded_executable_addressable_devices
            .ok_or_else(|| missing(self.plugin, "PJRT_LoadedExecutable_AddressableDevices"))?;
        let mut a = ffi::LoadedExecutable_AddressableDevices_Args {
            struct_size: ffi::LOADED_EXECUTABLE_ADDRESSABLE_DEVICES_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            executable: exe.ptr,
            addressable_devices: std::ptr::null(),
            num_addressable_devices: 0,
        };
        // SAFETY: valid args; the list lives as long as the executable.
        let err = unsafe { f(&mut a) };
        self.plugin
            .check(err, || "PJRT_LoadedExecutable_AddressableDevices".into())?;
        let devs = if a.addressable_devices.is_null() {
            &[][..]
        } else {
            // SAFETY: num_addressable_devices pointers owned by the executable.
            unsafe { std::slice::from_raw_parts(a.addressable_devices, a.num_addressable_devices) }
        };
        let order: Vec<usize> = devs
            .iter()
            .filter_map(|d| devices.iter().position(|&r| self.device_ptrs[r] == *d))
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        if devs.len() != replicas || sorted != (0..replicas).collect::<Vec<_>>() {
            return Err(Error::System {
                what: "XLA: compiling a collective".into(),
                message: format!(
                    "the executable runs on {} devices, not on the {replicas} devices it was compiled for",
                    devs.len()
                ),
            });
        }
        Ok(order)
    }

    fn destroy_executable(&self, exe: &Executable) {
        if let Some(f) = self.api().loaded_executable_destroy {
            let mut a = ffi::LoadedExecutable_Destroy_Args {
                struct_size: ffi::LOADED_EXECUTABLE_DESTROY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                executable: exe.ptr,
            };
            // SAFETY: a live executable, destroyed once.
            let err = unsafe { f(&mut a) };
            if let Some((_, m)) = self.plugin.take_error(err) {
                log::warn!("XLA: destroying an executable failed: {m}");
            }
        }
    }

    /// Run `exe` with one input buffer per replica; returns one output buffer per replica, in
    /// replica order, once every device has finished (bounded by the timeout).
    pub(crate) fn execute(
        &self,
        exe: &Executable,
        inputs: &[Vec<&XlaBuffer>],
        what: &str,
    ) -> Result<Vec<*mut ffi::Buffer>> {
        let outs = self.execute_outputs(exe, inputs, 1, what)?;
        Ok(outs.into_iter().flatten().collect())
    }

    /// Run `exe`, whose program has `num_outputs` results, with each replica's argument list;
    /// returns each replica's results, in replica order, once every device has finished
    /// (bounded by the timeout).
    pub(crate) fn execute_outputs(
        &self,
        exe: &Executable,
        inputs: &[Vec<&XlaBuffer>],
        num_outputs: usize,
        what: &str,
    ) -> Result<Vec<Vec<*mut ffi::Buffer>>> {
        self.check_usable()?;
        let f = self
            .api()
            .loaded_executable_execute
            .ok_or_else(|| missing(self.plugin, "PJRT_LoadedExecutable_Execute"))?;
        let n = exe.order.len();
        let num_args = inputs.first().map_or(0, Vec::len);
        if inputs.iter().any(|a| a.len() != num_args) {
            return Err(Error::config(format!(
                "XLA: running {what}: the replicas pass different numbers of arguments"
            )));
        }
        let args: Vec<Vec<*mut ffi::Buffer>> = exe
            .order
            .iter()
            .map(|&r| inputs[r].iter().map(|b| b.ptr).collect())
            .collect();
        let arg_lists: Vec<*const *mut ffi::Buffer> = args.iter().map(|a| a.as_ptr()).collect();
        let mut outs: Vec<Vec<*mut ffi::Buffer>> = vec![vec![std::ptr::null_mut(); num_outputs]; n];
        let out_lists: Vec<*mut *mut ffi::Buffer> =
            outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
        let mut events: Vec<*mut ffi::Event> = vec![std::ptr::null_mut(); n];
        // SAFETY: an all-zero ExecuteOptions is valid (no callbacks, no context).
        let mut options: ffi::ExecuteOptions = unsafe { std::mem::zeroed() };
        options.struct_size = ffi::EXECUTE_OPTIONS_SIZE;
        let mut a = ffi::LoadedExecutable_Execute_Args {
            struct_size: ffi::LOADED_EXECUTABLE_EXECUTE_ARGS_SIZE,
            extension_start: std::ptr::null_mut(),
            executable: exe.ptr,
            options: &mut options,
            argument_lists: arg_lists.as_ptr(),
            num_devices: n,
            num_args,
            output_lists: out_lists.as_ptr(),
            device_complete_events: events.as_mut_ptr(),
            execute_device: std::ptr::null_mut(),
        };
        // Another group's launch holds it only while the plugin queues that program; bounded
        // all the same, as every wait is.
        let Some(launching) = self.launch.try_lock_for(self.timeout) else {
            return Err(Error::System {
                what: "XLA".into(),
                message: format!(
                    "running {what}: another group of this client's devices did not finish \
                     launching its program within {:?} (raise the timeout with TUTTI_TIMEOUT)",
                    self.timeout
                ),
            });
        };
        // SAFETY: valid args: n argument lists of num_args live buffers each, n output lists
        // of num_outputs slots each, n event slots; all outlive the call.
        let err = unsafe { f(&mut a) };
        drop(launching);
        self.plugin.check(err, || {
            format!("XLA: running {what} (PJRT_LoadedExecutable_Execute)")
        })?;
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .launches += 1;
        let tagged: Vec<(usize, *mut ffi::Event)> = exe
            .order
            .iter()
            .zip(&events)
            .map(|(&r, &e)| (r, e))
            .collect();
        let mut by_replica = vec![Vec::new(); n];
        for (k, &r) in exe.order.iter().enumerate() {
            by_replica[r] = std::mem::take(&mut outs[k]);
        }
        if let Err(e) = self.wait(&tagged, &format!("finish {what}")) {
            for b in by_replica.into_iter().flatten() {
                self.destroy_buffer(b);
            }
            return Err(e);
        }
        if by_replica.iter().flatten().any(|b| b.is_null()) {
            for b in by_replica.into_iter().flatten() {
                self.destroy_buffer(b);
            }
            return Err(Error::System {
                what: format!("XLA: running {what}"),
                message: "the plugin returned fewer output buffers than the program has results"
                    .into(),
            });
        }
        Ok(by_replica)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(why) = &*self.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            log::warn!(
                "XLA: leaving the PJRT client of {} in place after: {why}",
                self.plugin.path().display()
            );
            return;
        }
        let cache = std::mem::take(&mut *self.cache.lock().unwrap_or_else(|e| e.into_inner()));
        let steps = std::mem::take(&mut *self.steps.lock().unwrap_or_else(|e| e.into_inner()));
        let group_steps =
            std::mem::take(&mut *self.group_steps.lock().unwrap_or_else(|e| e.into_inner()));
        for c in cache
            .into_values()
            .chain(steps.into_values())
            .chain(group_steps.into_values())
        {
            if let Compiled::Ready(exe) = c {
                self.destroy_executable(&exe);
            }
        }
        if self.parent.is_some() {
            // A view: the client is its parent's to destroy.
            return;
        }
        if let Some(f) = self.api().client_destroy {
            let mut a = ffi::Client_Destroy_Args {
                struct_size: ffi::CLIENT_DESTROY_ARGS_SIZE,
                extension_start: std::ptr::null_mut(),
                client: self.ptr,
            };
            // SAFETY: the client is live and destroyed once; every buffer and executable of it
            // is gone (buffers hold this Inner alive).
            let err = unsafe { f(&mut a) };
            if let Some((_, m)) = self.plugin.take_error(err) {
                log::warn!("XLA: destroying the client failed: {m}");
            }
        }
    }
}

impl XlaBuffer {
    /// The client whose device holds this buffer.
    pub fn client(&self) -> Client {
        Client {
            inner: self.inner.clone(),
        }
    }

    /// The device (index into [`Client::devices`]) holding this buffer.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The name of the device holding it: `xla:N`, N its index among the plugin client's
    /// devices (in a view of some of them, not its place in the view).
    pub fn device_name(&self) -> String {
        format!("xla:{}", self.inner.devices[self.device].index)
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy the buffer into `dst`, which must have its type and length.
    pub fn copy_to_host<T: Element>(&self, dst: &mut [T]) -> Result<()> {
        self.check_type::<T>(dst.len())?;
        self.inner
            .download(&[self], &mut [bytemuck::cast_slice_mut(dst)])
    }

    /// Copy the buffer's bytes into `dst`, which must be exactly as long.
    pub(crate) fn copy_bytes_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.inner.download(&[self], &mut [dst])
    }

    /// The buffer's elements, copied to the host.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let mut v = vec![T::from_f64(0.0); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    fn check_type<T: Element>(&self, len: usize) -> Result<()> {
        if T::DTYPE != self.dtype || len != self.len {
            return Err(Error::config(format!(
                "copying {self:?} to the host: the destination is {} x {len}",
                T::DTYPE
            )));
        }
        Ok(())
    }

    pub(crate) fn same_client(&self, c: &Client) -> bool {
        Arc::ptr_eq(&self.inner, &c.inner)
    }
}

impl Drop for XlaBuffer {
    fn drop(&mut self) {
        self.inner.destroy_buffer(self.ptr);
    }
}

/// The candidates discovery would try, with the reason each would be skipped (if it would).
pub fn discovery_report() -> Vec<(Candidate, Option<String>)> {
    plugin::candidates()
        .into_iter()
        .map(|c| {
            let skip = plugin::skip_reason(&c);
            (c, skip)
        })
        .collect()
}
