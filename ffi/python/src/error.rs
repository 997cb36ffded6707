//! The `KvlinkError` exception family and the conversion of `kvlink::Error` into it.

use kvlink_core::Error;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    kvlink,
    KvlinkError,
    PyException,
    "Base class of kvlink errors."
);
pyo3::create_exception!(
    kvlink,
    InvalidArgument,
    KvlinkError,
    "An argument is unusable (sizes, block ids out of range, unknown region, bad address)."
);
pyo3::create_exception!(
    kvlink,
    KvlinkTimeout,
    KvlinkError,
    "A wait ran past its deadline (connect, handshake, request)."
);
pyo3::create_exception!(
    kvlink,
    IncompatiblePeer,
    KvlinkError,
    "The peer's KV layout, dtype, block size or TP size differs; the message lists each field."
);
pyo3::create_exception!(
    kvlink,
    PeerError,
    KvlinkError,
    "The peer refused, broke the protocol or could not be reached."
);
pyo3::create_exception!(
    kvlink,
    RdmaUnavailable,
    KvlinkError,
    "RDMA was required but cannot be used; the message says why."
);

pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidArgument(_) | Error::UnknownRegion(_) | Error::OutOfRange { .. } => {
            InvalidArgument::new_err(msg)
        }
        Error::Timeout { .. } => KvlinkTimeout::new_err(msg),
        Error::Incompatible { .. } | Error::VersionMismatch { .. } => {
            IncompatiblePeer::new_err(msg)
        }
        Error::RdmaUnavailable(_) => RdmaUnavailable::new_err(msg),
        Error::Handshake { .. }
        | Error::Refused { .. }
        | Error::Protocol(_)
        | Error::ConnectionLost { .. }
        | Error::Unconfirmed { .. }
        | Error::Rdma(_) => PeerError::new_err(msg),
        _ => KvlinkError::new_err(msg),
    }
}
