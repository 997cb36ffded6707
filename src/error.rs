//! The crate's error type.

use std::time::Duration;

use crate::gpu::GpuError;
use crate::ids::RegionId;

/// Result alias for kvlink operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, with enough context to act on it.
///
/// Errors are `Clone` so that one failed handshake can fail every request that waited on it
/// with the same reason.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument given by the caller is unusable; the message says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A region id that this engine has not registered (or has already deregistered).
    #[error("{0} is not registered with this engine")]
    UnknownRegion(RegionId),

    /// A byte range outside the registered memory it names. For a local range this is a caller
    /// bug; from a peer it is refused and logged.
    #[error("range [{offset}, {offset}+{len}) is outside {region} (length {region_len})")]
    OutOfRange {
        /// Region the range was checked against.
        region: RegionId,
        /// Start of the range, relative to the region.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },

    /// Registering or allocating memory failed (the OS refused a mapping, say).
    #[error("memory: {0}")]
    Memory(String),

    /// The peer's KV layout or parameters do not match ours; the message lists each difference.
    /// Both engines must serve the same model with the same block size, dtype and TP size.
    #[error("peer {peer} is incompatible: {differences}")]
    Incompatible {
        /// The peer's handshake address.
        peer: String,
        /// Every field that differs, "ours vs theirs".
        differences: String,
    },

    /// The peer speaks another protocol version; upgrade one side.
    #[error("peer {peer} speaks protocol version {theirs}, this engine speaks {ours}")]
    VersionMismatch {
        /// The peer's handshake address.
        peer: String,
        /// Our protocol version.
        ours: u16,
        /// The peer's protocol version.
        theirs: u16,
    },

    /// A wait ran past its deadline.
    #[error("timed out after {after:?} while {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long it waited.
        after: Duration,
    },

    /// The handshake with a peer failed; the message says at which step.
    #[error("handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer's handshake address.
        peer: String,
        /// Why.
        reason: String,
    },

    /// The peer refused a request (for example a read outside its exported memory); its message
    /// is included.
    #[error("peer {peer} refused: {message}")]
    Refused {
        /// The peer's address.
        peer: String,
        /// The peer's explanation.
        message: String,
    },

    /// A message from a peer broke the protocol (bad frame, wrong type, wrong length). The
    /// connection it arrived on is dropped.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// A socket operation failed.
    #[error("I/O error while {context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error kind.
        kind: std::io::ErrorKind,
        /// The OS error text.
        message: String,
    },

    /// The prefill did not confirm that it held a read's blocks until the read's `Done`
    /// arrived (its hold ended first: expired, released, or its blocks may have been reused; or
    /// no confirmation came in time): the bytes read may not be the request's, and the read
    /// fails.
    #[error("read from {peer} not confirmed: {reason}")]
    Unconfirmed {
        /// The prefill's handshake address.
        peer: String,
        /// The prefill's refusal, or why no confirmation came.
        reason: String,
    },

    /// The connection to a peer was lost (peer process exited, network failure).
    #[error("connection to {peer} lost: {reason}")]
    ConnectionLost {
        /// The peer's address.
        peer: String,
        /// What was observed.
        reason: String,
    },

    /// An RDMA operation failed; [`RdmaError::kind`] says how (for a work completion error, the
    /// verbs status: remote access error, retry count exceeded, ...), the message names it and
    /// the peer. The connection is rebuilt on next use.
    #[error("RDMA: {0}")]
    Rdma(RdmaError),

    /// RDMA was required (`TransportChoice::Rdma`) but cannot be used; the message says why
    /// (no verbs library, no device, no active port, peer without RDMA).
    #[error("RDMA unavailable: {0}")]
    RdmaUnavailable(String),

    /// A GPU runtime is missing or one of its calls failed: [`GpuError`] carries the runtime
    /// and its error code; the message names the call and, for a missing piece, what to install
    /// or load (driver, ROCm, kernel module).
    #[error("GPU: {0}")]
    Gpu(GpuError),

    /// The engine is shutting down; no new work is accepted.
    #[error("engine is shut down")]
    Shutdown,

    /// The caller cancelled the request.
    #[error("cancelled: {0}")]
    Cancelled(String),
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, err: &std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            kind: err.kind(),
            message: err.to_string(),
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

/// A request or message refused: its kind, for code that branches on it, and the reason its
/// sender is told (the text is what goes on the wire and into the logs; the wire carries no
/// kind, so a refusal received from a peer is [`RefusalKind::Remote`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    kind: RefusalKind,
    reason: String,
}

/// Why a request or message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefusalKind {
    /// The request is not held here: never held, released, expired, or held again under
    /// another hold than the one named.
    NotHeld,
    /// The request is held for other readers: another engine, or another engine at the same
    /// decode rank.
    OtherReader,
    /// The reader's TP place does not fit the hold: a decode of another TP size than its
    /// first reader's, or a decode rank that does not read this prefill rank.
    WrongTp,
    /// A range in a block the hold does not grant, or an empty or overflowing range.
    OutOfGrant,
    /// Bytes this engine does not export: a region it has not registered, a range past a
    /// region's end, bytes in no block of the KV layout (padding between blocks).
    NotExported,
    /// The peer did not authenticate: no key where one is required, a wrong proof.
    Unauthenticated,
    /// A message that fails validation or comes out of order.
    Malformed,
    /// No message within the handshake timeout, or the peer closed before sending one.
    Silent,
    /// A message over its size limit, or for an inbox that is full.
    Limit,
    /// The reader's engine is incompatible with this one (its descriptor differs).
    Incompatible,
    /// This engine cannot serve yet: no KV layout is registered.
    NotReady,
    /// Received from a peer, which gave only its reason.
    Remote,
}

impl Refusal {
    /// A refusal of this kind, with the reason its sender is told.
    pub fn new(kind: RefusalKind, reason: impl Into<String>) -> Self {
        Refusal {
            kind,
            reason: reason.into(),
        }
    }

    /// Why it was refused.
    pub fn kind(&self) -> RefusalKind {
        self.kind
    }

    /// The reason, as the sender is told it.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The reason, to send.
    pub fn into_reason(self) -> String {
        self.reason
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for Refusal {}

impl From<crate::tp::TpError> for Error {
    /// TP sizes or a rank the caller gave that cannot pair: an invalid argument.
    fn from(e: crate::tp::TpError) -> Self {
        Error::InvalidArgument(e.to_string())
    }
}

impl From<Refusal> for Error {
    /// A refusal returned to the caller: an invalid argument, with the reason.
    fn from(r: Refusal) -> Self {
        Error::InvalidArgument(r.reason)
    }
}

/// The verbs `ibv_wc_status` values (verbs.h) kvlink tells apart: the `status` of
/// [`RdmaErrorKind::WorkCompletion`].
pub mod wc_status {
    /// `IBV_WC_LOC_QP_OP_ERR`: a local queue pair operation error (what SoftRoCE reports once
    /// its port went down).
    pub const LOC_QP_OP_ERR: u32 = 2;
    /// `IBV_WC_WR_FLUSH_ERR`: flushed, the queue pair was in the error state.
    pub const WR_FLUSH_ERR: u32 = 5;
    /// `IBV_WC_BAD_RESP_ERR`: an unexpected response from the peer.
    pub const BAD_RESP_ERR: u32 = 7;
    /// `IBV_WC_REM_ACCESS_ERR`: a wrong remote key, or an address outside the peer's
    /// registered memory.
    pub const REM_ACCESS_ERR: u32 = 10;
    /// `IBV_WC_RETRY_EXC_ERR`: the peer stopped answering.
    pub const RETRY_EXC_ERR: u32 = 12;
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer was not ready, retries exhausted.
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
    /// `IBV_WC_GENERAL_ERR`: an error the device does not name.
    pub const GENERAL_ERR: u32 = 21;
}

/// How an RDMA operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum RdmaErrorKind {
    /// A work completion came back with an error status: `status` is the verbs `ibv_wc_status`
    /// value (for example [`wc_status::REM_ACCESS_ERR`], 10: wrong key or address outside the
    /// peer's registered memory; [`wc_status::RETRY_EXC_ERR`], 12: the peer stopped answering).
    WorkCompletion {
        /// The `ibv_wc_status` value.
        status: u32,
    },
    /// Posting work requests to a queue pair failed.
    Post,
    /// Polling the completion queue failed.
    Poll,
    /// The connection had already failed (an earlier error, a deadline, a cancellation); the
    /// next request to this peer builds a new one.
    ConnectionBroken,
    /// The request was cancelled while its reads were outstanding.
    Cancelled,
    /// Creating or connecting queue pairs or completion queues failed.
    Setup,
}

/// An RDMA failure: its kind, and a message that names the verbs error and the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaError {
    /// How it failed.
    pub kind: RdmaErrorKind,
    /// What happened, for people.
    pub message: String,
}

impl RdmaError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: RdmaErrorKind, message: impl Into<String>) -> RdmaError {
        RdmaError {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for RdmaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RdmaError {}

impl From<String> for RdmaError {
    /// A failure described by its text alone is a setup failure (opening a device,
    /// registering memory, making or connecting queue pairs).
    fn from(message: String) -> Self {
        RdmaError::new(RdmaErrorKind::Setup, message)
    }
}

impl From<&str> for RdmaError {
    /// As `From<String>`: a setup failure.
    fn from(message: &str) -> Self {
        RdmaError::new(RdmaErrorKind::Setup, message)
    }
}
