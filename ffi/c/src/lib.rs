//! The C ABI of kvlink.
//!
//! Every type C sees is either an opaque handle (`kvlink_engine`, `kvlink_finished`,
//! `kvlink_aggregator`, always behind a pointer) or a `#[repr(C)]` struct whose layout is
//! asserted below. Every function that can fail returns a status (`KVLINK_OK` or a negative
//! `KVLINK_E_*` code) and leaves a message for [`kvlink_last_error`]; every body runs under
//! [`std::panic::catch_unwind`], so a panic becomes `KVLINK_E_INTERNAL` instead of unwinding into
//! C. Pointers are checked for NULL and alignment, strings for UTF-8, lengths for bounds.
//!
//! The header `include/kvlink.h` is generated from this file by cbindgen (see `cbindgen.toml`)
//! and checked in; `tests/header.rs` fails when it is stale. Doc comments on public items are
//! copied into the header, so they are written for C readers.

#![allow(unsafe_code, non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvlink::{
    DeviceMemory, Engine, EngineConfig, Error, ExternalMemory, FailedRequest, Finished, KvLayout,
    RegionId, RequestId, Side, TensorLayout, TpAggregator, TransportChoice, MAX_TENSORS,
};

// ------------------------------------------------------------------------------------------------
// Status codes and constants
// ------------------------------------------------------------------------------------------------

/// Success.
pub const KVLINK_OK: c_int = 0;
/// An argument is unusable: a NULL pointer, a string that is not UTF-8, a length or block id
/// out of range, an unknown region, a malformed layout, a buffer too small. The last error says
/// which argument and why.
pub const KVLINK_E_INVALID: c_int = -1;
/// A wait ran past its deadline.
pub const KVLINK_E_TIMEOUT: c_int = -2;
/// The peer's KV layout, parameters or protocol version do not match this engine's.
pub const KVLINK_E_INCOMPATIBLE: c_int = -3;
/// A socket or other operating-system I/O operation failed (binding a listen address, say).
pub const KVLINK_E_IO: c_int = -4;
/// The connection to a peer failed: handshake failure, connection lost, peer refused, protocol
/// violation.
pub const KVLINK_E_CONNECTION: c_int = -5;
/// An RDMA operation failed, or RDMA was required but is unavailable.
pub const KVLINK_E_RDMA: c_int = -6;
/// Allocating or registering memory failed, or deregistered memory is still in use.
pub const KVLINK_E_MEMORY: c_int = -7;
/// The engine is shutting down.
pub const KVLINK_E_SHUTDOWN: c_int = -8;
/// A bug in kvlink (a caught panic, an unexpected state); the last error has the details.
pub const KVLINK_E_INTERNAL: c_int = -9;
/// A GPU runtime (CUDA, HIP) is missing or one of its calls failed; the last error names the
/// runtime, the call and what to install or load.
pub const KVLINK_E_GPU: c_int = -10;

/// `kvlink_config.transport`: RDMA when both engines have it, TCP otherwise.
pub const KVLINK_TRANSPORT_AUTO: u32 = 0;
/// `kvlink_config.transport`: TCP only; RDMA is not probed.
pub const KVLINK_TRANSPORT_TCP: u32 = 1;
/// `kvlink_config.transport`: RDMA only; starting fails without a usable RDMA device.
pub const KVLINK_TRANSPORT_RDMA: u32 = 2;

/// Kind of entry in a `kvlink_finished`: sends confirmed by the reading peer (the blocks may be
/// freed).
pub const KVLINK_SENDING: c_int = 0;
/// Kind of entry in a `kvlink_finished`: receives complete (every byte is in place).
pub const KVLINK_RECEIVING: c_int = 1;
/// Kind of entry in a `kvlink_finished`: requests that failed or expired, on either side (their
/// blocks may be reused).
pub const KVLINK_FAILED: c_int = 2;

/// Side of a failed request: this worker held blocks a peer read (prefill).
pub const KVLINK_SIDE_SEND: c_int = 0;
/// Side of a failed request: this worker read blocks from a peer (decode).
pub const KVLINK_SIDE_RECV: c_int = 1;

/// A buffer of this many bytes always holds a handshake address and its NUL.
pub const KVLINK_ADDRESS_MAX: usize = 80;

/// Longest timeout any function accepts, in milliseconds (7 days).
pub const KVLINK_TIMEOUT_MAX_MS: u64 = 604_800_000;

// ------------------------------------------------------------------------------------------------
// Last error, status conversion and panic containment
// ------------------------------------------------------------------------------------------------

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

const EMPTY: &CStr = c"";

/// Text as a C string, with any NUL byte replaced (ids and messages never contain one in
/// practice, but a C string cannot).
fn to_cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\u{fffd}")).unwrap_or_default()
}

fn set_last_error(msg: &str) {
    let msg = to_cstring(msg);
    // A thread being torn down has no last error to keep.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(msg));
}

fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = None);
}

/// A failure on its way to C: a status code and the message for `kvlink_last_error`.
#[derive(Debug)]
struct FfiError {
    code: c_int,
    message: String,
}

type FfiResult<T = ()> = Result<T, FfiError>;

fn invalid(message: impl Into<String>) -> FfiError {
    FfiError {
        code: KVLINK_E_INVALID,
        message: message.into(),
    }
}

/// The status code of a kvlink error.
fn status_of(e: &Error) -> c_int {
    match e {
        Error::InvalidArgument(_) | Error::UnknownRegion(_) | Error::OutOfRange { .. } => {
            KVLINK_E_INVALID
        }
        Error::Timeout { .. } => KVLINK_E_TIMEOUT,
        Error::Incompatible { .. } | Error::VersionMismatch { .. } => KVLINK_E_INCOMPATIBLE,
        Error::Io { .. } => KVLINK_E_IO,
        Error::Handshake { .. }
        | Error::Refused { .. }
        | Error::Protocol(_)
        | Error::ConnectionLost { .. } => KVLINK_E_CONNECTION,
        Error::Rdma(_) | Error::RdmaUnavailable(_) => KVLINK_E_RDMA,
        Error::Memory(_) => KVLINK_E_MEMORY,
        Error::Gpu(_) => KVLINK_E_GPU,
        Error::Shutdown => KVLINK_E_SHUTDOWN,
        _ => KVLINK_E_INTERNAL,
    }
}

impl From<Error> for FfiError {
    fn from(e: Error) -> Self {
        FfiError {
            code: status_of(&e),
            message: e.to_string(),
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic payload");
    format!("internal error: kvlink panicked: {what}")
}

/// Runs an API body: clears the last error, contains panics and turns the outcome into a
/// status code.
fn guard(body: impl FnOnce() -> FfiResult) -> c_int {
    guard_value(|code| code, || body().map(|()| KVLINK_OK))
}

/// [`guard`] for functions that return a value: after an error or a panic (whose message goes to
/// the last error either way), returns `on_failure` of the status code.
fn guard_value<T>(on_failure: impl FnOnce(c_int) -> T, body: impl FnOnce() -> FfiResult<T>) -> T {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            on_failure(e.code)
        }
        Err(payload) => {
            set_last_error(&panic_message(payload.as_ref()));
            on_failure(KVLINK_E_INTERNAL)
        }
    }
}

/// The message of the last failed call on this thread, or an empty string when the last call
/// succeeded.
///
/// Never NULL. The string is owned by kvlink and stays valid until the next kvlink call on the
/// same thread; copy it to keep it. Every call other than this one and `kvlink_version` clears
/// or replaces it.
#[no_mangle]
pub extern "C" fn kvlink_last_error() -> *const c_char {
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|e| e.borrow().as_ref().map_or(EMPTY.as_ptr(), |m| m.as_ptr()))
            .unwrap_or(EMPTY.as_ptr())
    })
    .unwrap_or(EMPTY.as_ptr())
}

const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The version of this library, e.g. `"0.1.0"`. Never NULL; a static string owned by kvlink.
#[no_mangle]
pub extern "C" fn kvlink_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

// ------------------------------------------------------------------------------------------------
// Argument checks
// ------------------------------------------------------------------------------------------------

/// A borrowed string argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged for `'a`.
unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> FfiResult<&'a str> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: `p` is not NULL and the caller promised a NUL-terminated string living for 'a.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|e| invalid(format!("{what} is not valid UTF-8: {e}")))
}

/// An optional borrowed string argument: NULL gives `None`.
///
/// # Safety
/// As for [`str_arg`].
unsafe fn opt_str_arg<'a>(p: *const c_char, what: &str) -> FfiResult<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: forwarded from the caller.
        unsafe { str_arg(p, what) }.map(Some)
    }
}

/// A shared reference to an argument.
///
/// # Safety
/// `p` is NULL or points to a valid `T` that nothing mutates for `'a`.
unsafe fn ref_arg<'a, T>(p: *const T, what: &str) -> FfiResult<&'a T> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: not NULL, aligned, and the caller promised a valid T for 'a.
    Ok(unsafe { &*p })
}

/// An exclusive reference to an argument.
///
/// # Safety
/// `p` is NULL or points to a valid `T` that nothing else accesses for `'a`.
unsafe fn mut_arg<'a, T>(p: *mut T, what: &str) -> FfiResult<&'a mut T> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: not NULL, aligned, and the caller promised exclusive access to a valid T for 'a.
    Ok(unsafe { &mut *p })
}

/// A borrowed array argument of `count` elements; NULL is accepted when `count` is 0.
///
/// # Safety
/// When `count > 0`, `p` is NULL or points to `count` valid `T`s that nothing mutates for `'a`.
unsafe fn slice_arg<'a, T>(p: *const T, count: usize, what: &str) -> FfiResult<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL but its count is {count}")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    if count > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(invalid(format!("{what}: count {count} is too large")));
    }
    // SAFETY: not NULL, aligned, the total size fits in isize, and the caller promised `count`
    // valid elements for 'a.
    Ok(unsafe { std::slice::from_raw_parts(p, count) })
}

/// Checks an out-parameter before any work is done, so that no result is lost to a bad one.
fn check_out<T>(p: *mut T, what: &str) -> FfiResult {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    Ok(())
}

/// Stores a result through an out-parameter checked by [`check_out`].
///
/// # Safety
/// `p` passed [`check_out`] and points to writable memory for a `T`.
unsafe fn write_out<T>(p: *mut T, value: T) {
    // SAFETY: checked non-NULL and aligned; the caller promised it is writable. `write` does not
    // read or drop the (possibly uninitialised) old value.
    unsafe { p.write(value) }
}

fn millis(ms: u64, what: &str) -> FfiResult<Duration> {
    if ms > KVLINK_TIMEOUT_MAX_MS {
        return Err(invalid(format!(
            "{what} of {ms} ms is longer than the limit of {KVLINK_TIMEOUT_MAX_MS} ms (7 days)"
        )));
    }
    Ok(Duration::from_millis(ms))
}

// ------------------------------------------------------------------------------------------------
// Engine
// ------------------------------------------------------------------------------------------------

/// Settings of `kvlink_engine_start`. Fill one with `kvlink_config_default`, then change fields.
///
/// The strings are borrowed: they are read during `kvlink_engine_start` only, and the caller
/// keeps ownership.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvlink_config {
    /// Handshake listen address, `"ip:port"`; port 0 picks a free one. The default is
    /// `"127.0.0.1:0"`; NULL means the default.
    pub listen: *const c_char,
    /// Host or IP that peers should use to reach this engine when `listen` is a wildcard
    /// address such as `"0.0.0.0:7400"`; NULL to advertise the listen address.
    pub advertise_host: *const c_char,
    /// Engine id for logs and the handshake; NULL for `<hostname>-<pid>-rank<tp_rank>`.
    pub engine_id: *const c_char,
    /// Tensor-parallel rank of this worker (below `tp_size`).
    pub tp_rank: u32,
    /// Tensor-parallel size (at least 1).
    pub tp_size: u32,
    /// `KVLINK_TRANSPORT_AUTO`, `KVLINK_TRANSPORT_TCP` or `KVLINK_TRANSPORT_RDMA`.
    pub transport: u32,
    /// TCP streams opened to each peer for data, 1 to 64.
    pub tcp_streams: u32,
    /// Deadline of a whole `kvlink_engine_read_blocks` request, in milliseconds (1 ms to 7
    /// days).
    pub request_timeout_ms: u64,
    /// How long `kvlink_engine_hold_blocks` holds a send for its reader before it expires, in
    /// milliseconds (1 ms to 7 days).
    pub abort_timeout_ms: u64,
    /// 1 to look for GPU runtimes (CUDA, HIP) at start, 0 to skip them (host memory only).
    pub gpu: u32,
    /// Staging buffers the data server may use to send GPU memory over TCP, 1 to 4096.
    pub staging_buffers: u32,
    /// Bytes per staging buffer (GPU memory over TCP moves through pinned host buffers of this
    /// size), 4 KiB to 256 MiB.
    pub staging_chunk_bytes: u64,
}

/// One tensor of the KV cache for `kvlink_engine_set_layout`: `num_blocks` blocks of
/// `block_bytes` bytes, block `b` starting at byte `offset + b * block_stride` of region
/// `region`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvlink_tensor {
    /// Region that holds the tensor (from `kvlink_engine_allocate_host` or
    /// `kvlink_engine_register_host`).
    pub region: u32,
    /// Number of blocks.
    pub num_blocks: u32,
    /// Byte offset of block 0 within the region.
    pub offset: u64,
    /// Distance in bytes from one block to the next (at least `block_bytes`).
    pub block_stride: u64,
    /// Bytes of one block of this tensor.
    pub block_bytes: u64,
}

const _: () = assert!(std::mem::size_of::<kvlink_tensor>() == 32);
const _: () = assert!(std::mem::align_of::<kvlink_tensor>() == 8);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, region) == 0);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, num_blocks) == 4);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, offset) == 8);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, block_stride) == 16);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, block_bytes) == 24);

#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<kvlink_config>() == 72);
    assert!(std::mem::align_of::<kvlink_config>() == 8);
    assert!(std::mem::offset_of!(kvlink_config, listen) == 0);
    assert!(std::mem::offset_of!(kvlink_config, advertise_host) == 8);
    assert!(std::mem::offset_of!(kvlink_config, engine_id) == 16);
    assert!(std::mem::offset_of!(kvlink_config, tp_rank) == 24);
    assert!(std::mem::offset_of!(kvlink_config, tp_size) == 28);
    assert!(std::mem::offset_of!(kvlink_config, transport) == 32);
    assert!(std::mem::offset_of!(kvlink_config, tcp_streams) == 36);
    assert!(std::mem::offset_of!(kvlink_config, request_timeout_ms) == 40);
    assert!(std::mem::offset_of!(kvlink_config, abort_timeout_ms) == 48);
    assert!(std::mem::offset_of!(kvlink_config, gpu) == 56);
    assert!(std::mem::offset_of!(kvlink_config, staging_buffers) == 60);
    assert!(std::mem::offset_of!(kvlink_config, staging_chunk_bytes) == 64);
};

// The handles are documented as usable from several threads at once.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<kvlink_engine>();
    shareable::<kvlink_finished>();
    shareable::<kvlink_aggregator>();
};

const DEFAULT_LISTEN: &CStr = c"127.0.0.1:0";

/// A kvlink engine (one per worker process and tensor-parallel rank). Opaque: create it with
/// `kvlink_engine_start`, destroy it with `kvlink_engine_free`.
///
/// Every function taking an engine may be called from several threads at once, except
/// `kvlink_engine_free`, which must be the last call on it.
pub struct kvlink_engine {
    engine: Engine,
}

/// Fills `*config` with the defaults: listen on `"127.0.0.1:0"`, rank 0 of 1, automatic
/// transport, 4 TCP streams, a 60 s request timeout and a 480 s abort timeout.
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when `config` is NULL.
///
/// # Safety
/// `config` is NULL or points to writable memory for a `kvlink_config`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_config_default(config: *mut kvlink_config) -> c_int {
    guard(|| {
        check_out(config, "config")?;
        let d = EngineConfig::default();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let c = kvlink_config {
            listen: DEFAULT_LISTEN.as_ptr(),
            advertise_host: std::ptr::null(),
            engine_id: std::ptr::null(),
            tp_rank: d.tp_rank,
            tp_size: d.tp_size,
            transport: KVLINK_TRANSPORT_AUTO,
            tcp_streams: u32::from(d.tcp_streams),
            request_timeout_ms: ms(d.request_timeout),
            abort_timeout_ms: ms(d.abort_timeout),
            gpu: u32::from(d.gpu),
            staging_buffers: u32::try_from(d.staging_buffers).unwrap_or(u32::MAX),
            staging_chunk_bytes: d.staging_chunk_bytes,
        };
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(config, c) };
        Ok(())
    })
}

fn engine_config(c: &kvlink_config) -> FfiResult<EngineConfig> {
    let mut config = EngineConfig::default();
    // SAFETY: the caller of kvlink_engine_start promised NUL-terminated strings or NULL.
    if let Some(listen) = unsafe { opt_str_arg(c.listen, "config->listen") }? {
        config.listen = listen.to_string();
    }
    // SAFETY: as above.
    config.advertise_host =
        unsafe { opt_str_arg(c.advertise_host, "config->advertise_host") }?.map(str::to_string);
    // SAFETY: as above.
    config.engine_id =
        unsafe { opt_str_arg(c.engine_id, "config->engine_id") }?.map(str::to_string);
    config.tp_rank = c.tp_rank;
    config.tp_size = c.tp_size;
    config.transport = match c.transport {
        KVLINK_TRANSPORT_AUTO => TransportChoice::Auto,
        KVLINK_TRANSPORT_TCP => TransportChoice::Tcp,
        KVLINK_TRANSPORT_RDMA => TransportChoice::Rdma,
        other => {
            return Err(invalid(format!(
                "config->transport is {other}; use KVLINK_TRANSPORT_AUTO (0), _TCP (1) or _RDMA (2)"
            )))
        }
    };
    config.tcp_streams = u16::try_from(c.tcp_streams).map_err(|_| {
        invalid(format!(
            "config->tcp_streams {} is too large",
            c.tcp_streams
        ))
    })?;
    config.request_timeout = millis(c.request_timeout_ms, "config->request_timeout_ms")?;
    config.abort_timeout = millis(c.abort_timeout_ms, "config->abort_timeout_ms")?;
    config.gpu = match c.gpu {
        0 => false,
        1 => true,
        other => return Err(invalid(format!("config->gpu is {other}; use 0 or 1"))),
    };
    // Ranges are checked by Engine::start.
    config.staging_buffers = c.staging_buffers as usize;
    config.staging_chunk_bytes = c.staging_chunk_bytes;
    Ok(config)
}

/// Starts an engine: binds its handshake service and data server and starts its threads.
/// Register memory and set a layout before peers read from it.
///
/// On success stores a new engine in `*out`; the caller owns it and frees it with
/// `kvlink_engine_free`. On failure `*out` is left unchanged. `config` is only read during the
/// call; NULL means the defaults of `kvlink_config_default`.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID` (bad settings), `KVLINK_E_IO` (cannot bind the
/// listen address) or `KVLINK_E_RDMA` (`KVLINK_TRANSPORT_RDMA` without a usable device).
///
/// # Safety
/// `config` is NULL or points to a valid `kvlink_config` whose strings are NULL or
/// NUL-terminated; `out` is NULL or points to writable memory for a pointer.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_start(
    config: *const kvlink_config,
    out: *mut *mut kvlink_engine,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        let config = if config.is_null() {
            EngineConfig::default()
        } else {
            // SAFETY: the caller promised a valid kvlink_config.
            engine_config(unsafe { ref_arg(config, "config") }?)?
        };
        let engine = Engine::start(config)?;
        let handle = Box::into_raw(Box::new(kvlink_engine { engine }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Stops an engine and frees it with all the memory it allocated (pointers returned by
/// `kvlink_engine_allocate_host` dangle afterwards). Transfers in flight are abandoned. NULL is
/// ignored.
///
/// # Safety
/// `engine` is NULL or a pointer returned by `kvlink_engine_start` that has not been freed, and
/// no other thread uses it during or after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_free(engine: *mut kvlink_engine) {
    guard(|| {
        if !engine.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in
            // kvlink_engine_start, used by no one else.
            drop(unsafe { Box::from_raw(engine) });
        }
        Ok(())
    });
}

/// Copies the engine's handshake address (`"ip:port"`, what peers pass to
/// `kvlink_engine_read_blocks`) into `buf` as a NUL-terminated string.
///
/// `buf` is owned by the caller and must hold `len` bytes; `KVLINK_ADDRESS_MAX` bytes are
/// always enough. Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when an argument is NULL or the
/// buffer is too small (then `buf` holds an empty string if `len > 0`).
///
/// # Safety
/// `engine` is NULL or a live engine; `buf` is NULL or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_handshake_address(
    engine: *const kvlink_engine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        let addr = e.engine.handshake_address().to_string();
        // SAFETY: the caller promised `len` writable bytes at `buf` (or NULL).
        unsafe { copy_str_out(buf, len, &addr, "the handshake address") }
    })
}

/// Copies `s` and a NUL into `buf` (`len` bytes), or refuses (writing an empty string when
/// there is room for one) when it does not fit.
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes that do not overlap `s`.
unsafe fn copy_str_out(buf: *mut c_char, len: usize, s: &str, what: &str) -> FfiResult {
    if buf.is_null() {
        return Err(invalid("buf is NULL"));
    }
    let needed = s.len() + 1;
    if len < needed {
        if len > 0 {
            // SAFETY: buf points to at least one writable byte.
            unsafe { buf.write(0) };
        }
        return Err(invalid(format!(
            "buffer of {len} bytes is too small for {what} ({needed} bytes with its NUL)"
        )));
    }
    // SAFETY: buf has room for `needed` bytes (checked above) and does not overlap `s` (the
    // caller's promise).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

/// Writes a report of the transports and memory kinds this engine found into `buf` (`len`
/// bytes, NUL-terminated), one line per item: `transport rdma: yes: <device>` or
/// `memory cuda:    no: <why>`. Returns `KVLINK_OK` or `KVLINK_E_INVALID` (NULL argument,
/// buffer too small: 4096 bytes suffice in practice, and the last error says how many are
/// needed).
///
/// # Safety
/// `engine` is NULL or a live engine; `buf` is NULL or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_capabilities(
    engine: *const kvlink_engine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        let report = e.engine.capabilities().to_string();
        // SAFETY: the caller promised `len` writable bytes at `buf` (or NULL); `report` is ours.
        unsafe { copy_str_out(buf, len, &report, "the capabilities report") }
    })
}

/// Allocates `len` bytes of zeroed host memory and registers it as a new region (with
/// `huge_pages`, on 2 MiB huge pages when the system has them reserved, else regular pages).
///
/// Stores the region id in `*region_id` and the memory's address in `*ptr`. The memory is owned
/// by the engine: the caller may read and write it until `kvlink_engine_deregister` of its
/// region or `kvlink_engine_free`, whichever comes first (both release it), and must not free
/// it. Returns `KVLINK_OK`, `KVLINK_E_INVALID` (NULL argument, `len` of 0) or
/// `KVLINK_E_MEMORY`.
///
/// # Safety
/// `engine` is NULL or a live engine; `region_id` and `ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_allocate_host(
    engine: *mut kvlink_engine,
    len: u64,
    huge_pages: bool,
    region_id: *mut u32,
    ptr: *mut *mut u8,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(region_id, "region_id")?;
        check_out(ptr, "ptr")?;
        let region = e.engine.allocate_host(len, huge_pages)?;
        // SAFETY: both checked above; the caller promised writable memory.
        unsafe {
            write_out(region_id, region.id().0);
            write_out(ptr, region.as_ptr());
        }
        Ok(())
    })
}

/// Registers `len` bytes of caller-owned host memory at `ptr` (an inference engine's KV cache)
/// as a new region, and stores its id in `*region_id`.
///
/// The memory stays owned by the caller, but kvlink and its peers read and write it
/// concurrently until `kvlink_engine_deregister` returns `KVLINK_OK` for the region or the
/// engine is freed; only then may it be freed. Returns `KVLINK_OK`, `KVLINK_E_INVALID` (NULL
/// argument, `len` of 0, or a loaded GPU runtime says `ptr` is GPU or managed memory: use
/// `kvlink_engine_register_device`), `KVLINK_E_GPU` (a GPU runtime failed to classify `ptr`)
/// or `KVLINK_E_MEMORY` (the RDMA device could not register it).
///
/// # Safety
/// `engine` is NULL or a live engine; `region_id` is NULL or writable; `ptr` is NULL or points
/// to `len` bytes valid for reads and writes for as long as described above.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_register_host(
    engine: *mut kvlink_engine,
    ptr: *mut c_void,
    len: u64,
    region_id: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(region_id, "region_id")?;
        // SAFETY: the caller promised `len` bytes at `ptr`, valid for reads and writes until
        // the region is deregistered or the engine freed: ExternalMemory::new's contract.
        // NULL and empty ranges are refused by new itself.
        let mem = unsafe { ExternalMemory::new(ptr.cast::<u8>(), len) }?;
        let region = e.engine.register_host(mem)?;
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(region_id, region.id().0) };
        Ok(())
    })
}

/// Registers `len` bytes of caller-owned GPU memory at device address `ptr` (a KV cache
/// allocated with CUDA or HIP) as a new region, and stores its id in `*region_id`. The loaded
/// GPU runtime says which device it is on; RDMA registers it with dma-buf or a peer-memory
/// driver, TCP stages it through pinned host buffers.
///
/// The same lifetime rules as `kvlink_engine_register_host` apply. Returns `KVLINK_OK`,
/// `KVLINK_E_INVALID` (NULL argument, `len` of 0, `ptr` not device memory), `KVLINK_E_GPU` (no
/// GPU runtime loaded, the last error saying why each is missing, or a runtime call failed) or
/// `KVLINK_E_MEMORY` (the RDMA device could not register it: the last error names the dma-buf
/// and peer-memory attempts; a `KVLINK_TRANSPORT_TCP` engine does not register with RDMA).
///
/// # Safety
/// `engine` is NULL or a live engine; `region_id` is NULL or writable; `[ptr, ptr + len)` is a
/// live device allocation of this process's CUDA or HIP runtime that stays allocated as
/// described above.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_register_device(
    engine: *mut kvlink_engine,
    ptr: u64,
    len: u64,
    region_id: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(region_id, "region_id")?;
        // SAFETY: the caller promised a live device allocation: DeviceMemory::new's contract.
        let mem = unsafe { DeviceMemory::new(ptr, len) }?;
        let region = e.engine.register_device(mem)?;
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(region_id, region.id().0) };
        Ok(())
    })
}

/// Stops exporting a region and waits until no transfer uses it any more (at most the request
/// timeout plus 10 s). When this returns `KVLINK_OK`, memory registered with
/// `kvlink_engine_register_host` or `kvlink_engine_register_device` may be freed; memory from
/// `kvlink_engine_allocate_host` is freed by the engine.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID` (unknown region, or a region the layout uses) or
/// `KVLINK_E_MEMORY` (still in use after the wait: do not free the memory).
///
/// # Safety
/// `engine` is NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_deregister(
    engine: *mut kvlink_engine,
    region_id: u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        e.engine.deregister(RegionId(region_id))?;
        Ok(())
    })
}

/// Sets the KV layout (validated against the registered regions) and publishes it to peers.
///
/// `tensors` points to `count` tensors (1 to 16384) in the order both engines agree on
/// (layer-major, K before V); they are named `t0`, `t1`, ... in logs. `dtype` is the element
/// type tag (`"bf16"`, `"fp8_e4m3"`, ...), 1 to 32 bytes; peers must agree on it and on
/// `tokens_per_block`. Both are only read during the call.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (the last error names the offending tensor).
///
/// # Safety
/// `engine` is NULL or a live engine; `dtype` is NULL or NUL-terminated; `tensors` is NULL or
/// points to `count` valid `kvlink_tensor`s.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_set_layout(
    engine: *mut kvlink_engine,
    tokens_per_block: u32,
    dtype: *const c_char,
    tensors: *const kvlink_tensor,
    count: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let dtype = unsafe { str_arg(dtype, "dtype") }?;
        if count == 0 || count > MAX_TENSORS {
            return Err(invalid(format!(
                "count is {count}; a layout has 1 to {MAX_TENSORS} tensors"
            )));
        }
        // SAFETY: the caller promised `count` valid tensors or NULL.
        let tensors = unsafe { slice_arg(tensors, count, "tensors") }?;
        let layout = KvLayout {
            tokens_per_block,
            dtype: dtype.to_string(),
            tensors: tensors
                .iter()
                .enumerate()
                .map(|(i, t)| TensorLayout {
                    name: format!("t{i}"),
                    region: RegionId(t.region),
                    offset: t.offset,
                    block_stride: t.block_stride,
                    block_bytes: t.block_bytes,
                    num_blocks: t.num_blocks,
                })
                .collect(),
        };
        e.engine.set_layout(layout)?;
        Ok(())
    })
}

/// Connects to the engine at `peer` (its handshake address), or reuses the cached connection,
/// waiting up to `timeout_ms`; optional, as `kvlink_engine_read_blocks` connects on first use.
/// Stores the number of blocks of the peer's cache in `*peer_blocks` unless it is NULL.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID`, `KVLINK_E_TIMEOUT`, `KVLINK_E_INCOMPATIBLE` (the
/// layouts differ; the last error lists every difference), `KVLINK_E_CONNECTION` or
/// `KVLINK_E_IO`.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer` is NULL or NUL-terminated; `peer_blocks` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_connect(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    timeout_ms: u64,
    peer_blocks: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let peer = unsafe { str_arg(peer, "peer") }?;
        if !peer_blocks.is_null() {
            check_out(peer_blocks, "peer_blocks")?;
        }
        let timeout = millis(timeout_ms, "timeout_ms")?;
        let descriptor = e.engine.connect(peer, timeout)?;
        if !peer_blocks.is_null() {
            // SAFETY: checked above; the caller promised writable memory.
            unsafe { write_out(peer_blocks, descriptor.layout.num_blocks()) };
        }
        Ok(())
    })
}

/// Starts reading blocks `remote[i]` of the engine at `peer` (its handshake address) into
/// blocks `local[i]` of this engine, for every tensor of the layout, as request `request_id`
/// (1 to 256 bytes). Returns at once: the outcome arrives through
/// `kvlink_engine_wait_finished`, as `request_id` in the receiving or the failed entries.
///
/// `local` and `remote` hold `count` block ids each and are only read during the call; a local
/// block id may appear once per request. Returns `KVLINK_OK` or an immediate refusal:
/// `KVLINK_E_INVALID` (bad id, block id out of range, no layout, request id already in flight)
/// or `KVLINK_E_SHUTDOWN`. Everything later (handshake, transfer, deadline) ends as a failed
/// entry instead.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer` and `request_id` are NULL or NUL-terminated;
/// `local` and `remote` are NULL or point to `count` readable `uint32_t`s.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_read_blocks(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    request_id: *const c_char,
    local: *const u32,
    remote: *const u32,
    count: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised NUL-terminated strings or NULL.
        let peer = unsafe { str_arg(peer, "peer") }?;
        // SAFETY: as above.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        // SAFETY: the caller promised `count` readable ids or NULL.
        let local = unsafe { slice_arg(local, count, "local") }?;
        // SAFETY: as above.
        let remote = unsafe { slice_arg(remote, count, "remote") }?;
        e.engine.read_blocks(peer, id, local, remote)?;
        Ok(())
    })
}

/// Holds the blocks of request `request_id` (1 to 256 bytes) for a reader (prefill side): the
/// request finishes sending when the reader confirms its read, and fails when the reader
/// aborts or after `abort_timeout_ms` (0 for the engine's `abort_timeout_ms`; at most 7 days).
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (bad id, id already held, bad timeout).
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_hold_blocks(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    abort_timeout_ms: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        if abort_timeout_ms == 0 {
            e.engine.hold_blocks(id)?;
        } else {
            let timeout = millis(abort_timeout_ms, "abort_timeout_ms")?;
            e.engine.hold_blocks_for(id, timeout)?;
        }
        Ok(())
    })
}

/// Waits up to `timeout_ms` (0 to poll, at most 7 days) until some request finishes, then
/// stores everything that finished since the last call (each request exactly once) in a new
/// `kvlink_finished` at `*out`, possibly empty when the wait timed out. The caller owns it and
/// frees it with `kvlink_finished_free`.
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` (NULL argument, timeout too long).
///
/// # Safety
/// `engine` is NULL or a live engine; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_wait_finished(
    engine: *mut kvlink_engine,
    timeout_ms: u64,
    out: *mut *mut kvlink_finished,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(out, "out")?;
        let timeout = millis(timeout_ms, "timeout_ms")?;
        let finished = e.engine.wait_finished(timeout);
        let handle = Box::into_raw(Box::new(kvlink_finished::new(finished)));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

// ------------------------------------------------------------------------------------------------
// Finished sets
// ------------------------------------------------------------------------------------------------

/// A set of finished requests: sending, receiving and failed entries (see `KVLINK_SENDING`,
/// `KVLINK_RECEIVING`, `KVLINK_FAILED`). Opaque: made by `kvlink_engine_wait_finished`,
/// `kvlink_aggregator_take` or `kvlink_finished_new`, freed with `kvlink_finished_free`.
///
/// Strings returned by its accessors are owned by it and stay valid until it is freed. It may
/// be read from several threads at once, but not while `kvlink_finished_add*` changes it.
pub struct kvlink_finished {
    finished: Finished,
    sending: Vec<CString>,
    receiving: Vec<CString>,
    failed: Vec<CString>,
    reasons: Vec<CString>,
}

impl kvlink_finished {
    fn new(finished: Finished) -> Self {
        let ids = |v: &[RequestId]| v.iter().map(|id| to_cstring(id.as_str())).collect();
        kvlink_finished {
            sending: ids(&finished.sending),
            receiving: ids(&finished.receiving),
            failed: finished
                .failed
                .iter()
                .map(|f| to_cstring(f.id.as_str()))
                .collect(),
            reasons: finished
                .failed
                .iter()
                .map(|f| to_cstring(&f.reason))
                .collect(),
            finished,
        }
    }

    fn ids(&self, kind: c_int) -> FfiResult<&[CString]> {
        match kind {
            KVLINK_SENDING => Ok(&self.sending),
            KVLINK_RECEIVING => Ok(&self.receiving),
            KVLINK_FAILED => Ok(&self.failed),
            other => Err(invalid(format!(
                "kind is {other}; use KVLINK_SENDING (0), KVLINK_RECEIVING (1) or KVLINK_FAILED (2)"
            ))),
        }
    }

    fn failed(&self, index: usize) -> FfiResult<&FailedRequest> {
        self.finished.failed.get(index).ok_or_else(|| {
            invalid(format!(
                "index {index} is out of range: there are {} failed entries",
                self.finished.failed.len()
            ))
        })
    }
}

/// Number of entries of `kind` (`KVLINK_SENDING`, `KVLINK_RECEIVING` or `KVLINK_FAILED`) in
/// `finished`. Returns 0, with the last error set, when `finished` is NULL or `kind` unknown.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_count(
    finished: *const kvlink_finished,
    kind: c_int,
) -> usize {
    guard_value(
        |_| 0,
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(f.ids(kind)?.len())
        },
    )
}

/// The request id of entry `index` of `kind` in `finished`, as a NUL-terminated string owned by
/// `finished` (valid until `kvlink_finished_free`). Returns NULL, with the last error set, when
/// an argument is NULL, unknown or out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_id(
    finished: *const kvlink_finished,
    kind: c_int,
    index: usize,
) -> *const c_char {
    guard_value(
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            let ids = f.ids(kind)?;
            ids.get(index).map(|s| s.as_ptr()).ok_or_else(|| {
                invalid(format!(
                    "index {index} is out of range: there are {} entries of kind {kind}",
                    ids.len()
                ))
            })
        },
    )
}

/// Why failed entry `index` of `finished` failed, in words a user can act on, as a
/// NUL-terminated string owned by `finished` (valid until `kvlink_finished_free`). Returns NULL,
/// with the last error set, when `finished` is NULL or `index` out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_reason(
    finished: *const kvlink_finished,
    index: usize,
) -> *const c_char {
    guard_value(
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            f.failed(index)?;
            Ok(f.reasons[index].as_ptr())
        },
    )
}

/// 1 when failed entry `index` of `finished` ended because its deadline passed (for a send: the
/// reader never confirmed within the abort timeout), 0 when it failed otherwise, or a negative
/// status (`KVLINK_E_INVALID`) when `finished` is NULL or `index` out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_expired(
    finished: *const kvlink_finished,
    index: usize,
) -> c_int {
    guard_value(
        |code| code,
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(c_int::from(f.failed(index)?.expired))
        },
    )
}

/// The side of failed entry `index` of `finished`: `KVLINK_SIDE_SEND` or `KVLINK_SIDE_RECV`, or
/// a negative status (`KVLINK_E_INVALID`) when `finished` is NULL or `index` out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_side(
    finished: *const kvlink_finished,
    index: usize,
) -> c_int {
    guard_value(
        |code| code,
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(match f.failed(index)?.side {
                Side::Send => KVLINK_SIDE_SEND,
                Side::Recv => KVLINK_SIDE_RECV,
            })
        },
    )
}

/// Stores a new, empty `kvlink_finished` in `*out`, for building a rank's report received from
/// another process before passing it to `kvlink_aggregator_report`. The caller owns it and
/// frees it with `kvlink_finished_free`.
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when `out` is NULL.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_new(out: *mut *mut kvlink_finished) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        let handle = Box::into_raw(Box::new(kvlink_finished::new(Finished::default())));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Appends `request_id` (copied) to the sending (`KVLINK_SENDING`) or receiving
/// (`KVLINK_RECEIVING`) entries of `finished`; failed entries are added with
/// `kvlink_finished_add_failed`.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished` that no other thread uses during the call;
/// `request_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_add(
    finished: *mut kvlink_finished,
    kind: c_int,
    request_id: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised exclusive use of a live kvlink_finished or NULL.
        let f = unsafe { mut_arg(finished, "finished") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        let c = to_cstring(id);
        match kind {
            KVLINK_SENDING => {
                f.finished.sending.push(RequestId::new(id));
                f.sending.push(c);
            }
            KVLINK_RECEIVING => {
                f.finished.receiving.push(RequestId::new(id));
                f.receiving.push(c);
            }
            other => {
                return Err(invalid(format!(
                    "kind is {other}; use KVLINK_SENDING (0) or KVLINK_RECEIVING (1), \
                     and kvlink_finished_add_failed for failed entries"
                )))
            }
        }
        Ok(())
    })
}

/// Appends a failed entry for `request_id` on `side` (`KVLINK_SIDE_SEND` or
/// `KVLINK_SIDE_RECV`) to `finished`, with `expired` as in `kvlink_finished_expired` and
/// `reason` as its explanation (NULL for none). The strings are copied.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished` that no other thread uses during the call;
/// `request_id` and `reason` are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_add_failed(
    finished: *mut kvlink_finished,
    side: c_int,
    request_id: *const c_char,
    expired: bool,
    reason: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised exclusive use of a live kvlink_finished or NULL.
        let f = unsafe { mut_arg(finished, "finished") }?;
        // SAFETY: the caller promised NUL-terminated strings or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        // SAFETY: as above.
        let reason = unsafe { opt_str_arg(reason, "reason") }?.unwrap_or("");
        let side = match side {
            KVLINK_SIDE_SEND => Side::Send,
            KVLINK_SIDE_RECV => Side::Recv,
            other => {
                return Err(invalid(format!(
                    "side is {other}; use KVLINK_SIDE_SEND (0) or KVLINK_SIDE_RECV (1)"
                )))
            }
        };
        f.failed.push(to_cstring(id));
        f.reasons.push(to_cstring(reason));
        f.finished.failed.push(FailedRequest {
            id: RequestId::new(id),
            side,
            expired,
            reason: reason.to_string(),
        });
        Ok(())
    })
}

/// Frees a `kvlink_finished` and the strings its accessors returned. NULL is ignored.
///
/// # Safety
/// `finished` is NULL or a `kvlink_finished` not freed yet, which no other thread uses during or
/// after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_free(finished: *mut kvlink_finished) {
    guard(|| {
        if !finished.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in this
            // library, used by no one else.
            drop(unsafe { Box::from_raw(finished) });
        }
        Ok(())
    });
}

// ------------------------------------------------------------------------------------------------
// Tensor-parallel aggregation
// ------------------------------------------------------------------------------------------------

/// Combines the finished sets of the ranks of a tensor-parallel group for the scheduler: a
/// request is released once every rank reported it, as finished when every rank succeeded and
/// as failed when any failed (or when some rank did not report within the rank timeout).
/// Opaque: made by `kvlink_aggregator_new`, freed by `kvlink_aggregator_free`. Safe to use from
/// several threads at once, except `kvlink_aggregator_free`.
pub struct kvlink_aggregator {
    inner: Mutex<TpAggregator>,
}

impl kvlink_aggregator {
    fn lock(&self) -> std::sync::MutexGuard<'_, TpAggregator> {
        // A panic inside a call leaves the aggregator consistent enough to keep going: every
        // update is a handful of map operations.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Stores a new aggregator for `world_size` ranks (at least 1) in `*out`; a request some ranks
/// reported fails when the others have not reported within `rank_timeout_ms` (1 ms to 7 days)
/// of the first report. The caller owns it and frees it with `kvlink_aggregator_free`.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_new(
    world_size: usize,
    rank_timeout_ms: u64,
    out: *mut *mut kvlink_aggregator,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        if rank_timeout_ms == 0 {
            return Err(invalid("rank_timeout_ms is 0"));
        }
        let timeout = millis(rank_timeout_ms, "rank_timeout_ms")?;
        let agg = TpAggregator::new(world_size, timeout)?;
        let handle = Box::into_raw(Box::new(kvlink_aggregator {
            inner: Mutex::new(agg),
        }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Takes rank `rank`'s finished set (from its `kvlink_engine_wait_finished`, or built with
/// `kvlink_finished_new`). `finished` stays owned by the caller and is only read during the
/// call. Duplicate reports are ignored.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (NULL argument, rank not below the world size).
///
/// # Safety
/// `aggregator` is NULL or a live aggregator; `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_report(
    aggregator: *mut kvlink_aggregator,
    rank: usize,
    finished: *const kvlink_finished,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live aggregator or NULL.
        let a = unsafe { ref_arg(aggregator, "aggregator") }?;
        // SAFETY: the caller promised a live kvlink_finished or NULL.
        let f = unsafe { ref_arg(finished, "finished") }?;
        a.lock().handle_report(rank, &f.finished, Instant::now())?;
        Ok(())
    })
}

/// Fails the requests whose missing ranks ran past the rank timeout, then stores the requests
/// released since the last call in a new `kvlink_finished` at `*out` (possibly empty). The
/// caller owns it and frees it with `kvlink_finished_free`.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `aggregator` is NULL or a live aggregator; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_take(
    aggregator: *mut kvlink_aggregator,
    out: *mut *mut kvlink_finished,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live aggregator or NULL.
        let a = unsafe { ref_arg(aggregator, "aggregator") }?;
        check_out(out, "out")?;
        let finished = {
            let mut agg = a.lock();
            agg.poll(Instant::now());
            agg.take_finished()
        };
        let handle = Box::into_raw(Box::new(kvlink_finished::new(finished)));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Frees an aggregator. NULL is ignored.
///
/// # Safety
/// `aggregator` is NULL or an aggregator not freed yet, which no other thread uses during or
/// after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_free(aggregator: *mut kvlink_aggregator) {
    guard(|| {
        if !aggregator.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in
            // kvlink_aggregator_new, used by no one else.
            drop(unsafe { Box::from_raw(aggregator) });
        }
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: kvlink_last_error never returns NULL, and the string lives until the next call.
        unsafe { CStr::from_ptr(kvlink_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let code = guard(|| panic!("deliberate"));
        assert_eq!(code, KVLINK_E_INTERNAL);
        assert!(last_error().contains("deliberate"), "{}", last_error());
        let code = guard(|| std::panic::panic_any(17_u8));
        assert_eq!(code, KVLINK_E_INTERNAL);
        assert!(last_error().contains("internal error"), "{}", last_error());
        assert!(guard_value(|_| std::ptr::null::<c_char>(), || panic!("x")).is_null());
    }

    #[test]
    fn success_clears_the_last_error() {
        assert_eq!(guard(|| Err(invalid("nope"))), KVLINK_E_INVALID);
        assert_eq!(last_error(), "nope");
        assert_eq!(guard(|| Ok(())), KVLINK_OK);
        assert_eq!(last_error(), "");
    }

    #[test]
    fn errors_map_to_status_codes() {
        let cases = [
            (Error::InvalidArgument("a".into()), KVLINK_E_INVALID),
            (Error::UnknownRegion(RegionId(3)), KVLINK_E_INVALID),
            (
                Error::Timeout {
                    what: "w".into(),
                    after: Duration::from_secs(1),
                },
                KVLINK_E_TIMEOUT,
            ),
            (
                Error::Incompatible {
                    peer: "p".into(),
                    differences: "d".into(),
                },
                KVLINK_E_INCOMPATIBLE,
            ),
            (Error::io("x", &std::io::Error::other("y")), KVLINK_E_IO),
            (Error::Protocol("p".into()), KVLINK_E_CONNECTION),
            (Error::RdmaUnavailable("r".into()), KVLINK_E_RDMA),
            (Error::Memory("m".into()), KVLINK_E_MEMORY),
            (Error::Gpu("g".into()), KVLINK_E_GPU),
            (Error::Shutdown, KVLINK_E_SHUTDOWN),
        ];
        for (e, code) in cases {
            assert_eq!(status_of(&e), code, "{e}");
        }
    }

    #[test]
    fn nul_bytes_never_truncate_messages() {
        assert_eq!(to_cstring("a\0b").to_str().unwrap(), "a\u{fffd}b");
    }

    #[test]
    fn string_arguments_are_checked() {
        let bad = [0xff_u8, 0];
        // SAFETY: a NUL-terminated buffer that outlives the call.
        let e = unsafe { str_arg(bad.as_ptr().cast(), "s") }.unwrap_err();
        assert!(e.message.contains("UTF-8"), "{}", e.message);
        // SAFETY: NULL is allowed.
        let e = unsafe { str_arg(std::ptr::null(), "s") }.unwrap_err();
        assert_eq!(e.message, "s is NULL");
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { opt_str_arg(std::ptr::null(), "s") }.unwrap(), None);
    }

    #[test]
    fn engine_round_trip_without_peers() {
        let mut config = std::mem::MaybeUninit::<kvlink_config>::uninit();
        // SAFETY: writable memory for a kvlink_config.
        let rc = unsafe { kvlink_config_default(config.as_mut_ptr()) };
        assert_eq!(rc, KVLINK_OK);
        // SAFETY: initialised by kvlink_config_default.
        let mut config = unsafe { config.assume_init() };
        config.transport = KVLINK_TRANSPORT_TCP;
        let mut engine = std::ptr::null_mut();
        let bad = kvlink_config { gpu: 2, ..config };
        // SAFETY: valid config and out-pointer; refused before any engine exists.
        let rc = unsafe { kvlink_engine_start(&bad, &mut engine) };
        assert_eq!(rc, KVLINK_E_INVALID);
        assert!(last_error().contains("config->gpu"), "{}", last_error());
        let bad = kvlink_config {
            staging_buffers: 0,
            ..config
        };
        // SAFETY: as above.
        let rc = unsafe { kvlink_engine_start(&bad, &mut engine) };
        assert_eq!(rc, KVLINK_E_INVALID);
        assert!(engine.is_null());
        config.gpu = 0;
        // SAFETY: valid config and out-pointer.
        let rc = unsafe { kvlink_engine_start(&config, &mut engine) };
        assert_eq!(rc, KVLINK_OK, "{}", last_error());
        let mut buf = [0 as c_char; KVLINK_ADDRESS_MAX];
        // SAFETY: live engine, buffer of the given length.
        let rc = unsafe { kvlink_engine_handshake_address(engine, buf.as_mut_ptr(), buf.len()) };
        assert_eq!(rc, KVLINK_OK);
        // SAFETY: NUL-terminated by the call above.
        let addr = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
        assert!(addr.starts_with("127.0.0.1:"), "{addr}");
        // The capabilities report, and the error when the buffer is too small.
        let mut caps = [0 as c_char; 4096];
        // SAFETY: live engine, buffer of the given length.
        let rc = unsafe { kvlink_engine_capabilities(engine, caps.as_mut_ptr(), caps.len()) };
        assert_eq!(rc, KVLINK_OK, "{}", last_error());
        // SAFETY: NUL-terminated by the call above.
        let text = unsafe { CStr::from_ptr(caps.as_ptr()) }.to_str().unwrap();
        assert!(
            text.contains("memory cuda:")
                && text.contains("transport tcp:")
                && text.contains("disabled by configuration (gpu: false)"),
            "{text}"
        );
        // SAFETY: live engine, buffer of the given length.
        let rc = unsafe { kvlink_engine_capabilities(engine, caps.as_mut_ptr(), 8) };
        assert_eq!(rc, KVLINK_E_INVALID);
        assert!(last_error().contains("too small"), "{}", last_error());
        // Device memory that no runtime knows: KVLINK_E_GPU (no runtime) or KVLINK_E_INVALID (a
        // runtime says it is host memory); never a crash.
        let mut host = vec![0u8; 4096];
        let mut region = 0u32;
        // SAFETY: live engine; the address is refused before any access.
        let rc = unsafe {
            kvlink_engine_register_device(engine, host.as_mut_ptr() as u64, 4096, &mut region)
        };
        assert!(rc == KVLINK_E_GPU || rc == KVLINK_E_INVALID, "{rc}");
        assert!(
            last_error().contains("GPU") || last_error().contains("device"),
            "{}",
            last_error()
        );
        let mut f = std::ptr::null_mut();
        // SAFETY: live engine, valid out-pointer.
        let rc = unsafe { kvlink_engine_wait_finished(engine, 0, &mut f) };
        assert_eq!(rc, KVLINK_OK);
        // SAFETY: f was just made.
        assert_eq!(unsafe { kvlink_finished_count(f, KVLINK_RECEIVING) }, 0);
        // SAFETY: both are live and freed once.
        unsafe {
            kvlink_finished_free(f);
            kvlink_engine_free(engine);
        }
    }
}
