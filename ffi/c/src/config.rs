//! `kvlink_config`, the settings of `kvlink_engine_start` (with its layout asserts), its
//! defaults and its conversion to `kvlink::EngineConfig`.

use std::ffi::{c_char, c_int, CStr};
use std::time::Duration;

use kvlink::{AuthKey, EngineConfig, TransportChoice};

use crate::args::{copy_prefix, millis, opt_str_arg, struct_size};
use crate::guard::guard;
use crate::status::{
    invalid, FfiResult, KVLINK_TRANSPORT_AUTO, KVLINK_TRANSPORT_LOCAL, KVLINK_TRANSPORT_NETWORK,
    KVLINK_TRANSPORT_RDMA, KVLINK_TRANSPORT_TCP,
};

/// Settings of `kvlink_engine_start`. Set `size` to `sizeof(kvlink_config)` (or start from
/// `KVLINK_CONFIG_INIT`), fill it with `kvlink_config_default`, then change fields.
///
/// The struct grows at its end, 8 bytes at a time, and `size` says how much of it the caller's
/// header knows: a program built against an older header keeps working with a newer library
/// (the fields it does not know take their defaults), and a newer program is refused by an
/// older library with `KVLINK_E_INVALID` naming the size.
///
/// The strings are borrowed: they are read during `kvlink_engine_start` only, and the caller
/// keeps ownership.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvlink_config {
    /// This struct's size in bytes as the caller's header declares it:
    /// `sizeof(kvlink_config)`. Set it before `kvlink_config_default`, which keeps it.
    pub size: u64,
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
    /// `KVLINK_TRANSPORT_AUTO`, `KVLINK_TRANSPORT_TCP`, `KVLINK_TRANSPORT_RDMA`,
    /// `KVLINK_TRANSPORT_LOCAL` or `KVLINK_TRANSPORT_NETWORK`.
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
    /// The deployment key every engine shares (NUL-terminated text, at least 16 bytes); NULL
    /// reads `KVLINK_AUTH_KEY` or `KVLINK_AUTH_KEY_FILE`. Only read during
    /// `kvlink_engine_start`.
    pub auth_key: *const c_char,
    /// 1 to allow listening beyond loopback without a key (logged as a warning), 0 otherwise.
    pub insecure: u32,
    /// How long a held send stays held once its reader engine lost every control connection
    /// to this one, in milliseconds (1 ms to 7 days; default 30 s); `abort_timeout_ms` bounds
    /// a reader that never comes.
    pub lease_ms: u64,
    /// How long a session to a peer may go unused before it is closed in order (the peer keeps
    /// this engine's holds on their abort timeouts, and the next read opens a new session), in
    /// milliseconds (at most 7 days; default 120 s; 0 keeps sessions open until they break).
    /// Bounds the connections and queue pairs an engine holds to the peers it used lately.
    pub session_idle_ms: u64,
    /// How long a caller waiting in `kvlink_engine_wait_finished` polls while reads are in
    /// flight before it sleeps, in microseconds (at most 10,000; default 50; 0 never polls).
    /// A read that finishes meanwhile is seen without a thread wake-up. A small RDMA read
    /// (one chain of work requests) polls its completion queue itself for as long, and a
    /// small TCP read (one batch) its stream's socket; a TCP data connection serving this
    /// engine's memory polls for its reader's next request as long after each.
    pub spin_us: u64,
}

#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<kvlink_config>() == KVLINK_CONFIG_SIZE);
    assert!(std::mem::align_of::<kvlink_config>() == 8);
    assert!(std::mem::offset_of!(kvlink_config, size) == 0);
    assert!(std::mem::offset_of!(kvlink_config, listen) == 8);
    assert!(std::mem::offset_of!(kvlink_config, advertise_host) == 16);
    assert!(std::mem::offset_of!(kvlink_config, engine_id) == 24);
    assert!(std::mem::offset_of!(kvlink_config, tp_rank) == 32);
    assert!(std::mem::offset_of!(kvlink_config, tp_size) == 36);
    assert!(std::mem::offset_of!(kvlink_config, transport) == 40);
    assert!(std::mem::offset_of!(kvlink_config, tcp_streams) == 44);
    assert!(std::mem::offset_of!(kvlink_config, request_timeout_ms) == 48);
    assert!(std::mem::offset_of!(kvlink_config, abort_timeout_ms) == 56);
    assert!(std::mem::offset_of!(kvlink_config, gpu) == 64);
    assert!(std::mem::offset_of!(kvlink_config, staging_buffers) == 68);
    assert!(std::mem::offset_of!(kvlink_config, staging_chunk_bytes) == 72);
    assert!(std::mem::offset_of!(kvlink_config, auth_key) == 80);
    assert!(std::mem::offset_of!(kvlink_config, insecure) == 88);
    assert!(std::mem::offset_of!(kvlink_config, lease_ms) == 96);
    assert!(std::mem::offset_of!(kvlink_config, session_idle_ms) == 104);
    assert!(std::mem::offset_of!(kvlink_config, spin_us) == 112);
};

/// `sizeof(kvlink_config)` in this release (64-bit targets).
pub const KVLINK_CONFIG_SIZE: usize = 120;

const DEFAULT_LISTEN: &CStr = c"127.0.0.1:0";

/// Fills the first `config->size` bytes of `*config` with the defaults (`size` is kept): listen
/// on `"127.0.0.1:0"`, rank 0 of 1, automatic transport, 4 TCP streams, a 60 s request
/// timeout, a 480 s abort timeout, a 30 s lease and sessions closed after 120 s unused.
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when `config` is NULL or its `size` is not a
/// size of this struct (set it to `sizeof(kvlink_config)` first).
///
/// # Safety
/// `config` is NULL or points to writable memory for a `kvlink_config` of the caller's header,
/// whose `size` field is set.
#[no_mangle]
pub unsafe extern "C" fn kvlink_config_default(config: *mut kvlink_config) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a kvlink_config of its header with its size set.
        let size = unsafe { struct_size(config, "config") }?;
        let c = defaults(size);
        // SAFETY: `size` bytes of the caller's struct are writable (it declared them), and
        // struct_size checked that they end at a field boundary.
        unsafe { copy_prefix(&c, config, size) };
        Ok(())
    })
}

/// The defaults, with `size` as given.
fn defaults(size: usize) -> kvlink_config {
    let d = EngineConfig::default();
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    kvlink_config {
        size: size as u64,
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
        auth_key: std::ptr::null(),
        insecure: 0,
        lease_ms: ms(d.lease),
        session_idle_ms: ms(d.session_idle),
        spin_us: u64::try_from(d.spin.as_micros()).unwrap_or(u64::MAX),
    }
}

/// The caller's `kvlink_config` as this release's: the fields its header knows (`size`) over
/// the defaults.
///
/// # Safety
/// `config` is NULL or points to a `kvlink_config` of the caller's header with its size set.
pub(crate) unsafe fn read_config(config: *const kvlink_config) -> FfiResult<kvlink_config> {
    // SAFETY: forwarded from the caller.
    let size = unsafe { struct_size(config, "config") }?;
    let mut c = defaults(size);
    // SAFETY: the caller's struct holds `size` readable bytes, which end at a field boundary
    // (struct_size); `c` is a full struct of our own.
    unsafe { copy_prefix(config, &mut c, size) };
    Ok(c)
}

pub(crate) fn engine_config(c: &kvlink_config) -> FfiResult<EngineConfig> {
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
        KVLINK_TRANSPORT_LOCAL => TransportChoice::Local,
        KVLINK_TRANSPORT_NETWORK => TransportChoice::Network,
        other => {
            return Err(invalid(format!(
                "config->transport is {other}; use KVLINK_TRANSPORT_AUTO (0), _TCP (1), _RDMA (2), \
                 _LOCAL (3) or _NETWORK (4)"
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
    config.lease = millis(c.lease_ms, "config->lease_ms")?;
    config.session_idle = millis(c.session_idle_ms, "config->session_idle_ms")?;
    // Its range is checked by Engine::start.
    config.spin = std::time::Duration::from_micros(c.spin_us);
    config.gpu = match c.gpu {
        0 => false,
        1 => true,
        other => return Err(invalid(format!("config->gpu is {other}; use 0 or 1"))),
    };
    // Ranges are checked by Engine::start.
    config.staging_buffers = c.staging_buffers as usize;
    config.staging_chunk_bytes = c.staging_chunk_bytes;
    // SAFETY: as above.
    if let Some(key) = unsafe { opt_str_arg(c.auth_key, "config->auth_key") }? {
        config.auth_key = Some(AuthKey::new(key.as_bytes().to_vec())?);
    }
    config.insecure = match c.insecure {
        0 => false,
        1 => true,
        other => return Err(invalid(format!("config->insecure is {other}; use 0 or 1"))),
    };
    Ok(config)
}
