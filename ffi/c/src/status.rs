//! Status codes and the other constants of the C API, and the error type that carries a
//! status code and its message (`FfiError`) with the mapping from `kvlink::Error`.

use std::ffi::c_int;

use kvlink::Error;

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

/// `kvlink_config.transport`: the same-host path when the engines share a host and the memory
/// can be shared, else RDMA when both engines have it, else TCP.
pub const KVLINK_TRANSPORT_AUTO: u32 = 0;
/// `kvlink_config.transport`: TCP only; RDMA is not probed.
pub const KVLINK_TRANSPORT_TCP: u32 = 1;
/// `kvlink_config.transport`: RDMA only; starting fails without a usable RDMA device.
pub const KVLINK_TRANSPORT_RDMA: u32 = 2;
/// `kvlink_config.transport`: the same-host path only (shared memfd, GPU IPC); reads from a
/// peer on another host, or into memory that cannot be shared, fail with the reason.
pub const KVLINK_TRANSPORT_LOCAL: u32 = 3;
/// `kvlink_config.transport`: RDMA when both engines have it, else TCP; never the same-host
/// path.
pub const KVLINK_TRANSPORT_NETWORK: u32 = 4;

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

/// Largest body `kvlink_engine_send_message` sends (64 KiB).
pub const KVLINK_MESSAGE_MAX: usize = 65_536;
const _: () = assert!(KVLINK_MESSAGE_MAX == kvlink::MAX_MESSAGE_BYTES);

/// Longest timeout any function accepts, in milliseconds (7 days).
pub const KVLINK_TIMEOUT_MAX_MS: u64 = 604_800_000;

// The C limit is the core's.
const _: () = assert!(KVLINK_TIMEOUT_MAX_MS as u128 == kvlink::internal::MAX_DURATION.as_millis());

/// A failure on its way to C: a status code and the message for `kvlink_last_error`.
#[derive(Debug)]
pub(crate) struct FfiError {
    pub(crate) code: c_int,
    pub(crate) message: String,
}

pub(crate) type FfiResult<T = ()> = Result<T, FfiError>;

pub(crate) fn invalid(message: impl Into<String>) -> FfiError {
    FfiError {
        code: KVLINK_E_INVALID,
        message: message.into(),
    }
}

/// The status code of a kvlink error.
pub(crate) fn status_of(e: &Error) -> c_int {
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
        | Error::ConnectionLost { .. }
        | Error::Unconfirmed { .. } => KVLINK_E_CONNECTION,
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
