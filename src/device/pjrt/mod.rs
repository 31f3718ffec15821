//! XLA devices through a PJRT plugin (cargo feature `xla`): the plugin, its PJRT C API, the
//! client, its devices and buffers, and the programs it compiles. The collectives that run those
//! programs across the devices are the PJRT engine (`crate::engine::pjrt`); users see both
//! through [`crate::xla`].

pub mod client;
pub mod ffi;
pub mod plugin;
pub mod program;

pub use client::{
    CacheStats, Client, ClientOptions, OptionValue, Route, XlaBuffer, XlaDevice, OPTIONS_ENV,
};
pub use plugin::{Candidate, Plugin, PluginKind, PLUGIN_ENV};

use super::{Device, DeviceKind};

/// What automatic discovery found: the plugin, its platform and its devices.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Discovery {
    /// The plugin's shared library.
    pub plugin: std::path::PathBuf,
    /// The plugin's PJRT C API version.
    pub api_version: (i32, i32),
    /// The platform (`cpu`, `tpu`, `cuda`, ...).
    pub platform: String,
    /// The platform's version text.
    pub platform_version: String,
    /// The addressable devices.
    pub devices: Vec<XlaDevice>,
}

/// The plugin and devices [`Client::from_env`] finds, looked up once per process (the client
/// made for it is closed again); the error says why there are none.
pub fn discovery() -> Result<&'static Discovery, crate::Error> {
    static FOUND: std::sync::OnceLock<Result<Discovery, crate::Error>> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            let c = Client::from_env()?;
            Ok(Discovery {
                plugin: c.plugin().path().to_path_buf(),
                api_version: c.plugin().api_version(),
                platform: c.platform_name().to_string(),
                platform_version: c.platform_version().to_string(),
                devices: c.devices().to_vec(),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The XLA devices of [`discovery`] as tutti [`Device`]s (`xla:0`, `xla:1`, ...; the name is
/// the PJRT device kind); empty when no plugin starts.
pub fn discover_devices() -> Vec<Device> {
    discovery()
        .map(|d| {
            d.devices
                .iter()
                .map(|x| Device {
                    kind: DeviceKind::Xla,
                    index: x.index,
                    name: x.kind.clone(),
                    memory_bytes: x.memory_bytes,
                    physical_index: x.index,
                })
                .collect()
        })
        .unwrap_or_default()
}
