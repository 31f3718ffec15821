//! tutti's own bindings to the PJRT C API: only the pieces tutti calls.
//!
//! Layouts mirror `pjrt_c_api.h` at API version [`HEADER_MAJOR`].[`HEADER_MINOR`] field for field.
//! Every `*_Args` struct starts with `struct_size`, which tutti sets to the header's
//! `PJRT_STRUCT_SIZE` (the offset of the last field plus its size, so without tail padding): a
//! plugin built against an older header reads the prefix it knows, a newer one sees which fields
//! tutti knows. The [`Api`] function table is mirrored in order up to the last entry tutti
//! calls; the entries it does not call are typed as [`Unused`] so that every offset matches.

#![allow(non_camel_case_types, missing_docs, dead_code)]

use std::ffi::{c_char, c_int, c_void};

/// The API version of the header these layouts mirror.
pub const HEADER_MAJOR: i32 = 0;
/// See [`HEADER_MAJOR`].
pub const HEADER_MINOR: i32 = 81;
/// The oldest minor version tutti accepts: every table entry and struct field tutti relies on
/// is present from here on (later additions are read only when the plugin's `struct_size`
/// says it knows them).
pub const MIN_MINOR: i32 = 40;

/// `offset_of(T, field) + sizeof(field)`: the header's `PJRT_STRUCT_SIZE`.
macro_rules! struct_size {
    ($t:ty, $field:ident, $ft:ty) => {
        std::mem::offset_of!($t, $field) + std::mem::size_of::<$ft>()
    };
}

// Opaque handles.
#[repr(C)]
pub struct Error {
    _p: [u8; 0],
}
#[repr(C)]
pub struct Event {
    _p: [u8; 0],
}
#[repr(C)]
pub struct Client {
    _p: [u8; 0],
}
#[repr(C)]
pub struct Device {
    _p: [u8; 0],
}
#[repr(C)]
pub struct DeviceDescription {
    _p: [u8; 0],
}
#[repr(C)]
pub struct LoadedExecutable {
    _p: [u8; 0],
}
#[repr(C)]
pub struct Buffer {
    _p: [u8; 0],
}
#[repr(C)]
pub struct Memory {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ExtensionBase {
    _p: [u8; 0],
}

/// A table entry tutti never calls (kept so that the later entries sit at their offsets).
pub type Unused = Option<unsafe extern "C" fn()>;

/// `PJRT_Error_Code` values (absl status codes).
pub fn error_code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNKNOWN_CODE",
    }
}

pub const ERROR_CODE_INVALID_ARGUMENT: i32 = 3;

#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: c_int,
    pub minor_version: c_int,
}

// ---------------------------------- Errors -----------------------------------

#[repr(C)]
pub struct Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *mut Error,
}
pub const ERROR_DESTROY_ARGS_SIZE: usize = struct_size!(Error_Destroy_Args, error, *mut Error);

#[repr(C)]
pub struct Error_Message_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *const Error,
    pub message: *const c_char,
    pub message_size: usize,
}
pub const ERROR_MESSAGE_ARGS_SIZE: usize = struct_size!(Error_Message_Args, message_size, usize);

#[repr(C)]
pub struct Error_GetCode_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *const Error,
    pub code: c_int,
}
pub const ERROR_GETCODE_ARGS_SIZE: usize = struct_size!(Error_GetCode_Args, code, c_int);

// ---------------------------- Named Values -----------------------------------

pub const NAMED_VALUE_STRING: c_int = 0;
pub const NAMED_VALUE_INT64: c_int = 1;
pub const NAMED_VALUE_INT64_LIST: c_int = 2;
pub const NAMED_VALUE_FLOAT: c_int = 3;
pub const NAMED_VALUE_BOOL: c_int = 4;

#[repr(C)]
#[derive(Copy, Clone)]
pub union NamedValueValue {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub name: *const c_char,
    pub name_size: usize,
    pub type_: c_int,
    pub value: NamedValueValue,
    pub value_size: usize,
}
pub const NAMED_VALUE_SIZE: usize = struct_size!(NamedValue, value_size, usize);

// ---------------------------------- Plugin -----------------------------------

#[repr(C)]
pub struct Plugin_Initialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
}
pub const PLUGIN_INITIALIZE_ARGS_SIZE: usize =
    struct_size!(Plugin_Initialize_Args, extension_start, *mut ExtensionBase);

#[repr(C)]
pub struct Plugin_Attributes_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub attributes: *const NamedValue,
    pub num_attributes: usize,
}
pub const PLUGIN_ATTRIBUTES_ARGS_SIZE: usize =
    struct_size!(Plugin_Attributes_Args, num_attributes, usize);

// ---------------------------------- Events -----------------------------------

#[repr(C)]
pub struct Event_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub event: *mut Event,
}
pub const EVENT_DESTROY_ARGS_SIZE: usize = struct_size!(Event_Destroy_Args, event, *mut Event);

pub type EventOnReadyCallback = unsafe extern "C" fn(error: *mut Error, user_arg: *mut c_void);

#[repr(C)]
pub struct Event_OnReady_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub event: *mut Event,
    pub callback: Option<EventOnReadyCallback>,
    pub user_arg: *mut c_void,
}
pub const EVENT_ONREADY_ARGS_SIZE: usize = struct_size!(Event_OnReady_Args, user_arg, *mut c_void);

// ---------------------------------- Client -----------------------------------

#[repr(C)]
pub struct Client_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub create_options: *const NamedValue,
    pub num_options: usize,
    pub kv_get_callback: Unused,
    pub kv_get_user_arg: *mut c_void,
    pub kv_put_callback: Unused,
    pub kv_put_user_arg: *mut c_void,
    pub client: *mut Client,
    pub kv_try_get_callback: Unused,
    pub kv_try_get_user_arg: *mut c_void,
}
pub const CLIENT_CREATE_ARGS_SIZE: usize =
    struct_size!(Client_Create_Args, kv_try_get_user_arg, *mut c_void);

#[repr(C)]
pub struct Client_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub client: *mut Client,
}
pub const CLIENT_DESTROY_ARGS_SIZE: usize = struct_size!(Client_Destroy_Args, client, *mut Client);

/// `PJRT_Client_PlatformName_Args` and `PJRT_Client_PlatformVersion_Args` (same layout).
#[repr(C)]
pub struct Client_String_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub client: *mut Client,
    pub value: *const c_char,
    pub value_size: usize,
}
pub const CLIENT_STRING_ARGS_SIZE: usize = struct_size!(Client_String_Args, value_size, usize);

#[repr(C)]
pub struct Client_ProcessIndex_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub client: *mut Client,
    pub process_index: c_int,
}
pub const CLIENT_PROCESS_INDEX_ARGS_SIZE: usize =
    struct_size!(Client_ProcessIndex_Args, process_index, c_int);

#[repr(C)]
pub struct Client_AddressableDevices_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub client: *mut Client,
    pub addressable_devices: *const *mut Device,
    pub num_addressable_devices: usize,
}
pub const CLIENT_ADDRESSABLE_DEVICES_ARGS_SIZE: usize = struct_size!(
    Client_AddressableDevices_Args,
    num_addressable_devices,
    usize
);

#[repr(C)]
pub struct Program {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub code: *mut c_char,
    pub code_size: usize,
    pub format: *const c_char,
    pub format_size: usize,
}
pub const PROGRAM_SIZE: usize = struct_size!(Program, format_size, usize);

#[repr(C)]
pub struct Client_Compile_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub client: *mut Client,
    pub program: *const Program,
    pub compile_options: *const c_char,
    pub compile_options_size: usize,
    pub executable: *mut LoadedExecutable,
}
pub const CLIENT_COMPILE_ARGS_SIZE: usize =
    struct_size!(Client_Compile_Args, executable, *mut LoadedExecutable);

// `PJRT_Buffer_Type` values tutti uses.
pub const BUFFER_TYPE_S8: c_int = 2;
pub const BUFFER_TYPE_S32: c_int = 4;
pub const BUFFER_TYPE_S64: c_int = 5;
pub const BUFFER_TYPE_U8: c_int = 6;
pub const BUFFER_TYPE_U32: c_int = 8;
pub const BUFFER_TYPE_U64: c_int = 9;
pub const BUFFER_TYPE_F16: c_int = 10;
pub const BUFFER_TYPE_F32: c_int = 11;
pub const BUFFER_TYPE_F64: c_int = 12;
pub const BUFFER_TYPE_BF16: c_int = 13;

/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the plugin copies the host data before
/// the call returns, so no later wait guards the caller's memory.
pub const HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL: c_int = 0;

#[repr(C)]
pub struct Client_BufferFromHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub client: *mut Client,
    pub data: *const c_void,
    pub type_: c_int,
    pub dims: *const i64,
    pub num_dims: usize,
    pub byte_strides: *const i64,
    pub num_byte_strides: usize,
    pub host_buffer_semantics: c_int,
    pub device: *mut Device,
    pub memory: *mut Memory,
    pub device_layout: *mut c_void,
    pub done_with_host_buffer: *mut Event,
    pub buffer: *mut Buffer,
}
pub const CLIENT_BUFFER_FROM_HOST_BUFFER_ARGS_SIZE: usize =
    struct_size!(Client_BufferFromHostBuffer_Args, buffer, *mut Buffer);

// -------------------------- Device Descriptions ------------------------------

/// `PJRT_DeviceDescription_Id_Args` and `PJRT_DeviceDescription_ProcessIndex_Args`.
#[repr(C)]
pub struct DeviceDescription_Int_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub device_description: *mut DeviceDescription,
    pub value: c_int,
}
pub const DEVICE_DESCRIPTION_INT_ARGS_SIZE: usize =
    struct_size!(DeviceDescription_Int_Args, value, c_int);

/// `PJRT_DeviceDescription_Kind_Args` and `PJRT_DeviceDescription_ToString_Args`.
#[repr(C)]
pub struct DeviceDescription_String_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub device_description: *mut DeviceDescription,
    pub value: *const c_char,
    pub value_size: usize,
}
pub const DEVICE_DESCRIPTION_STRING_ARGS_SIZE: usize =
    struct_size!(DeviceDescription_String_Args, value_size, usize);

// --------------------------------- Devices -----------------------------------

#[repr(C)]
pub struct Device_GetDescription_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub device: *mut Device,
    pub device_description: *mut DeviceDescription,
}
pub const DEVICE_GET_DESCRIPTION_ARGS_SIZE: usize = struct_size!(
    Device_GetDescription_Args,
    device_description,
    *mut DeviceDescription
);

#[repr(C)]
pub struct Device_LocalHardwareId_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub device: *mut Device,
    pub local_hardware_id: c_int,
}
pub const DEVICE_LOCAL_HARDWARE_ID_ARGS_SIZE: usize =
    struct_size!(Device_LocalHardwareId_Args, local_hardware_id, c_int);

#[repr(C)]
pub struct Device_MemoryStats_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub device: *mut Device,
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: i64,
    pub peak_bytes_in_use_is_set: bool,
    pub num_allocs: i64,
    pub num_allocs_is_set: bool,
    pub largest_alloc_size: i64,
    pub largest_alloc_size_is_set: bool,
    pub bytes_limit: i64,
    pub bytes_limit_is_set: bool,
    pub bytes_reserved: i64,
    pub bytes_reserved_is_set: bool,
    pub peak_bytes_reserved: i64,
    pub peak_bytes_reserved_is_set: bool,
    pub bytes_reservable_limit: i64,
    pub bytes_reservable_limit_is_set: bool,
    pub largest_free_block_bytes: i64,
    pub largest_free_block_bytes_is_set: bool,
    pub pool_bytes: i64,
    pub pool_bytes_is_set: bool,
    pub peak_pool_bytes: i64,
    pub peak_pool_bytes_is_set: bool,
}
pub const DEVICE_MEMORY_STATS_ARGS_SIZE: usize =
    struct_size!(Device_MemoryStats_Args, peak_pool_bytes_is_set, bool);

// ------------------------------- Executables ---------------------------------

#[repr(C)]
pub struct LoadedExecutable_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub executable: *mut LoadedExecutable,
}
pub const LOADED_EXECUTABLE_DESTROY_ARGS_SIZE: usize = struct_size!(
    LoadedExecutable_Destroy_Args,
    executable,
    *mut LoadedExecutable
);

#[repr(C)]
pub struct LoadedExecutable_AddressableDevices_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub executable: *mut LoadedExecutable,
    pub addressable_devices: *const *mut Device,
    pub num_addressable_devices: usize,
}
pub const LOADED_EXECUTABLE_ADDRESSABLE_DEVICES_ARGS_SIZE: usize = struct_size!(
    LoadedExecutable_AddressableDevices_Args,
    num_addressable_devices,
    usize
);

#[repr(C)]
pub struct ExecuteOptions {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub send_callbacks: *mut *mut c_void,
    pub recv_callbacks: *mut *mut c_void,
    pub num_send_ops: usize,
    pub num_recv_ops: usize,
    pub launch_id: c_int,
    pub non_donatable_input_indices: *const i64,
    pub num_non_donatable_input_indices: usize,
    pub context: *mut c_void,
    pub call_location: *const c_char,
    pub num_tasks: usize,
    pub task_ids: *mut c_int,
    pub incarnation_ids: *mut i64,
}
pub const EXECUTE_OPTIONS_SIZE: usize = struct_size!(ExecuteOptions, incarnation_ids, *mut i64);

#[repr(C)]
pub struct LoadedExecutable_Execute_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub executable: *mut LoadedExecutable,
    pub options: *mut ExecuteOptions,
    pub argument_lists: *const *const *mut Buffer,
    pub num_devices: usize,
    pub num_args: usize,
    pub output_lists: *const *mut *mut Buffer,
    pub device_complete_events: *mut *mut Event,
    pub execute_device: *mut Device,
}
pub const LOADED_EXECUTABLE_EXECUTE_ARGS_SIZE: usize =
    struct_size!(LoadedExecutable_Execute_Args, execute_device, *mut Device);

// ---------------------------------- Buffers ----------------------------------

#[repr(C)]
pub struct Buffer_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub buffer: *mut Buffer,
}
pub const BUFFER_DESTROY_ARGS_SIZE: usize = struct_size!(Buffer_Destroy_Args, buffer, *mut Buffer);

#[repr(C)]
pub struct Buffer_ToHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub src: *mut Buffer,
    pub host_layout: *mut c_void,
    pub dst: *mut c_void,
    pub dst_size: usize,
    pub event: *mut Event,
}
pub const BUFFER_TO_HOST_BUFFER_ARGS_SIZE: usize =
    struct_size!(Buffer_ToHostBuffer_Args, event, *mut Event);

// -------------------------------- The table ----------------------------------

type F<A> = Option<unsafe extern "C" fn(args: *mut A) -> *mut Error>;

/// `PJRT_Api`, up to `PJRT_Buffer_ReadyEvent`.
#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub pjrt_api_version: ApiVersion,

    pub error_destroy: Option<unsafe extern "C" fn(args: *mut Error_Destroy_Args)>,
    pub error_message: Option<unsafe extern "C" fn(args: *mut Error_Message_Args)>,
    pub error_get_code: F<Error_GetCode_Args>,

    pub plugin_initialize: F<Plugin_Initialize_Args>,
    pub plugin_attributes: F<Plugin_Attributes_Args>,

    pub event_destroy: F<Event_Destroy_Args>,
    pub event_is_ready: Unused,
    pub event_error: Unused,
    pub event_await: Unused,
    pub event_on_ready: F<Event_OnReady_Args>,

    pub client_create: F<Client_Create_Args>,
    pub client_destroy: F<Client_Destroy_Args>,
    pub client_platform_name: F<Client_String_Args>,
    pub client_process_index: F<Client_ProcessIndex_Args>,
    pub client_platform_version: F<Client_String_Args>,
    pub client_devices: Unused,
    pub client_addressable_devices: F<Client_AddressableDevices_Args>,
    pub client_lookup_device: Unused,
    pub client_lookup_addressable_device: Unused,
    pub client_addressable_memories: Unused,
    pub client_compile: F<Client_Compile_Args>,
    pub client_default_device_assignment: Unused,
    pub client_buffer_from_host_buffer: F<Client_BufferFromHostBuffer_Args>,

    pub device_description_id: F<DeviceDescription_Int_Args>,
    pub device_description_process_index: F<DeviceDescription_Int_Args>,
    pub device_description_attributes: Unused,
    pub device_description_kind: F<DeviceDescription_String_Args>,
    pub device_description_debug_string: Unused,
    pub device_description_to_string: F<DeviceDescription_String_Args>,

    pub device_get_description: F<Device_GetDescription_Args>,
    pub device_is_addressable: Unused,
    pub device_local_hardware_id: F<Device_LocalHardwareId_Args>,
    pub device_addressable_memories: Unused,
    pub device_default_memory: Unused,
    pub device_memory_stats: F<Device_MemoryStats_Args>,

    pub memory_id: Unused,
    pub memory_kind: Unused,
    pub memory_debug_string: Unused,
    pub memory_to_string: Unused,
    pub memory_addressable_by_devices: Unused,

    pub executable_destroy: Unused,
    pub executable_name: Unused,
    pub executable_num_replicas: Unused,
    pub executable_num_partitions: Unused,
    pub executable_num_outputs: Unused,
    pub executable_size_of_generated_code_in_bytes: Unused,
    pub executable_get_cost_analysis: Unused,
    pub executable_output_memory_kinds: Unused,
    pub executable_optimized_program: Unused,
    pub executable_serialize: Unused,

    pub loaded_executable_destroy: F<LoadedExecutable_Destroy_Args>,
    pub loaded_executable_get_executable: Unused,
    pub loaded_executable_addressable_devices: F<LoadedExecutable_AddressableDevices_Args>,
    pub loaded_executable_delete: Unused,
    pub loaded_executable_is_deleted: Unused,
    pub loaded_executable_execute: F<LoadedExecutable_Execute_Args>,
    pub executable_deserialize_and_load: Unused,
    pub loaded_executable_fingerprint: Unused,

    pub buffer_destroy: F<Buffer_Destroy_Args>,
    pub buffer_element_type: Unused,
    pub buffer_dimensions: Unused,
    pub buffer_unpadded_dimensions: Unused,
    pub buffer_dynamic_dimension_indices: Unused,
    pub buffer_get_memory_layout: Unused,
    pub buffer_on_device_size_in_bytes: Unused,
    pub buffer_device: Unused,
    pub buffer_memory: Unused,
    pub buffer_delete: Unused,
    pub buffer_is_deleted: Unused,
    pub buffer_copy_to_device: Unused,
    pub buffer_to_host_buffer: F<Buffer_ToHostBuffer_Args>,
    pub buffer_is_on_cpu: Unused,
    pub buffer_ready_event: Unused,
}

/// The smallest `PJRT_Api::struct_size` whose table covers every entry tutti calls.
pub const API_MIN_SIZE: usize = struct_size!(Api, buffer_ready_event, Unused);

/// `GetPjrtApi`, the one symbol a plugin exports.
pub type GetPjrtApi = unsafe extern "C" fn() -> *const Api;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// Offsets and sizes worked out by hand from the header (x86-64 / aarch64 LP64).
    #[test]
    fn layouts_match_the_header() {
        assert_eq!(ERROR_GETCODE_ARGS_SIZE, 28);
        assert_eq!(offset_of!(NamedValue, type_), 32);
        assert_eq!(offset_of!(NamedValue, value), 40);
        assert_eq!(NAMED_VALUE_SIZE, 56);
        assert_eq!(std::mem::size_of::<NamedValue>(), 56);
        assert_eq!(CLIENT_CREATE_ARGS_SIZE, 88);
        assert_eq!(offset_of!(Client_Create_Args, client), 64);
        assert_eq!(CLIENT_COMPILE_ARGS_SIZE, 56);
        assert_eq!(offset_of!(Client_BufferFromHostBuffer_Args, type_), 32);
        assert_eq!(
            offset_of!(Client_BufferFromHostBuffer_Args, host_buffer_semantics),
            72
        );
        assert_eq!(CLIENT_BUFFER_FROM_HOST_BUFFER_ARGS_SIZE, 120);
        assert_eq!(DEVICE_MEMORY_STATS_ARGS_SIZE, 185);
        assert_eq!(offset_of!(ExecuteOptions, launch_id), 48);
        assert_eq!(EXECUTE_OPTIONS_SIZE, 112);
        assert_eq!(LOADED_EXECUTABLE_EXECUTE_ARGS_SIZE, 80);
        assert_eq!(BUFFER_TO_HOST_BUFFER_ARGS_SIZE, 56);
        assert_eq!(PROGRAM_SIZE, 48);
        // Offsets in the header's PJRT_Api (as a C compiler lays it out).
        assert_eq!(offset_of!(Api, error_destroy), 40);
        assert_eq!(offset_of!(Api, client_create), 120);
        assert_eq!(offset_of!(Api, client_compile), 200);
        assert_eq!(offset_of!(Api, device_description_to_string), 264);
        assert_eq!(offset_of!(Api, device_memory_stats), 312);
        assert_eq!(offset_of!(Api, loaded_executable_addressable_devices), 456);
        assert_eq!(offset_of!(Api, loaded_executable_execute), 480);
        assert_eq!(offset_of!(Api, buffer_to_host_buffer), 600);
        assert_eq!(API_MIN_SIZE, 624);
    }
}
