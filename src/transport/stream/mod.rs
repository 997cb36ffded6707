//! What the two stream data planes share, TCP (`tcp`) and the same-host path (`local`): the
//! parts of the framing they have in common (`frame`), the session proof of a data connection
//! (`proof`), the access decision (`access`: who may read what), how a read is cut into
//! batches (`batch`), the staging of device memory (`staging`) and the servers' limits
//! ([`ServeLimits`]). Each transport keeps only its own framing, client and server.

use std::time::Duration;

pub(crate) mod access;
pub(crate) mod batch;
pub(crate) mod frame;
pub(crate) mod proof;
pub(crate) mod staging;

/// The limits of a data server (TCP or same host) on each connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServeLimits {
    /// Most time to send or receive the rest of a message once it started.
    pub(crate) io_timeout: Duration,
    /// Most time a stream waits for its next request.
    pub(crate) idle_timeout: Duration,
    /// Most time a TCP data connection polls its socket for the next request before it sleeps
    /// (`EngineConfig::spin`; zero: never).
    pub(crate) spin: Duration,
}
