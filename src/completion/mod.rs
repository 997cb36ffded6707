//! Completion tracking: which requests finished sending or receiving, failed or expired.
//!
//! [`CompletionTracker`] is one worker's view; [`TpAggregator`] combines the reports of every
//! tensor-parallel rank for the scheduler. Both are plain state machines: time is passed in.

mod aggregator;
mod follow;
mod presence;
mod tracker;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, RdmaErrorKind};
use crate::ids::RequestId;

pub use aggregator::TpAggregator;
pub use follow::{Announcement, Follower};
pub(crate) use presence::DEFAULT_LEASE;
pub use tracker::{CompletionTracker, HoldTerms, Release, SendNotice};

/// Which side of a transfer a request is on, from this worker's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Side {
    /// This worker holds blocks that a peer reads (prefill).
    Send,
    /// This worker reads blocks from a peer (decode).
    Recv,
}

/// A request that ended without success.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedRequest {
    /// The request.
    pub id: RequestId,
    /// Whether it was being sent or received.
    pub side: Side,
    /// True when it ended because its deadline passed (for the send side: the peer never
    /// confirmed its read within the abort timeout). Either way its blocks may now be reused.
    pub expired: bool,
    /// What happened, in words a user can act on.
    pub reason: String,
    /// What happened, for code that branches on it.
    #[serde(default)]
    pub cause: FailureCause,
}

/// Why a request failed, for code that branches on it ([`FailedRequest::reason`] says it for
/// people).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FailureCause {
    /// Its deadline passed (receive: `request_timeout`; send: no reader confirmed within the
    /// abort timeout; aggregated: a rank never reported).
    Expired,
    /// The peer aborted it or refused it.
    Peer,
    /// The connection to the peer could not be made or was lost; the handshake failed or the
    /// peer is incompatible.
    Connection,
    /// An RDMA failure of this kind (for a work completion error, the verbs status).
    Rdma(RdmaErrorKind),
    /// A GPU runtime call failed, with the code it returned where there was one.
    Gpu {
        /// The runtime's error code (`CUresult`, `hipError_t`).
        code: Option<i32>,
    },
    /// The caller cancelled it (`Engine::cancel`).
    Cancelled,
    /// Receive: every byte arrived, but the prefill did not confirm it held the blocks until
    /// then (its hold ended first, or no confirmation came in time): the bytes may be another
    /// request's. Recompute the request.
    Unconfirmed,
    /// Anything else: a local error, the engine shutting down.
    #[default]
    Other,
}

impl FailureCause {
    /// A stable lowercase name for bindings and metrics: `expired`, `peer`, `connection`,
    /// `rdma`, `gpu`, `cancelled`, `unconfirmed` or `other`.
    pub fn name(&self) -> &'static str {
        match self {
            FailureCause::Expired => "expired",
            FailureCause::Peer => "peer",
            FailureCause::Connection => "connection",
            FailureCause::Rdma(_) => "rdma",
            FailureCause::Gpu { .. } => "gpu",
            FailureCause::Cancelled => "cancelled",
            FailureCause::Unconfirmed => "unconfirmed",
            FailureCause::Other => "other",
        }
    }

    /// The cause an error stands for.
    pub fn of(error: &Error) -> FailureCause {
        match error {
            Error::Refused { .. } => FailureCause::Peer,
            Error::Timeout { .. }
            | Error::Incompatible { .. }
            | Error::VersionMismatch { .. }
            | Error::Handshake { .. }
            | Error::Io { .. }
            | Error::Protocol(_)
            | Error::ConnectionLost { .. }
            | Error::RdmaUnavailable(_) => FailureCause::Connection,
            Error::Rdma(e) => FailureCause::Rdma(e.kind),
            Error::Gpu(e) => FailureCause::Gpu { code: e.code },
            Error::Cancelled(_) => FailureCause::Cancelled,
            Error::Unconfirmed { .. } => FailureCause::Unconfirmed,
            _ => FailureCause::Other,
        }
    }
}

/// Telemetry of one finished receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferReport {
    /// The request (the reader's own id for it).
    pub id: RequestId,
    /// The handshake address of the engine it was read from.
    pub peer: String,
    /// Bytes moved.
    pub bytes: u64,
    /// Segments after coalescing.
    pub segments: usize,
    /// Block pairs requested.
    pub blocks: usize,
    /// Work requests posted (RDMA) or read requests sent (TCP).
    pub work_requests: u64,
    /// Transport that moved them (`"tcp"`).
    pub transport: &'static str,
    /// From `read_blocks` to completion.
    pub elapsed: Duration,
    /// When its steps happened.
    pub timeline: Timeline,
}

/// When a receive's steps happened, each measured from the read call (decode side); `None`
/// for a step that was not seen (no byte to read from a source, say).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// How long the prefill had held the request when this engine's `Done` arrived there (the
    /// longest over the prefill ranks read): how long its blocks waited for this reader.
    pub held: Option<Duration>,
    /// Sessions to every source were up (connected and handshaken, or already up).
    pub connected: Option<Duration>,
    /// The first bytes landed in this engine's blocks.
    pub first_byte: Option<Duration>,
    /// Every source's bytes were in place.
    pub last_byte: Option<Duration>,
    /// Every prefill confirmed that it held the request for the whole read; the request was
    /// reported received then.
    pub confirmed: Option<Duration>,
}

/// Requests finished since a tracker started, by side and outcome: monotonic counters, fit
/// for a metrics exporter (`EngineStats::totals`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Receives completed.
    pub reads_done: u64,
    /// Receives failed, expired ones and cancelled ones included.
    pub reads_failed: u64,
    /// Receives that expired (also counted in `reads_failed`).
    pub reads_expired: u64,
    /// Receives cancelled by the caller (also counted in `reads_failed`).
    pub reads_cancelled: u64,
    /// Bytes of the completed receives.
    pub bytes_read: u64,
    /// Sends confirmed by their reader.
    pub sends_done: u64,
    /// Sends aborted by their reader or expired.
    pub sends_failed: u64,
    /// Sends that expired (also counted in `sends_failed`), their lease's end included.
    pub sends_expired: u64,
    /// Sends that expired because their reader was gone (no control session) for the whole
    /// lease (also counted in `sends_expired`).
    pub sends_lease_expired: u64,
}

/// What finished since the last call, each request exactly once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Finished {
    /// Sends confirmed by the reading peer: the blocks may be freed.
    pub sending: Vec<RequestId>,
    /// Receives complete: every byte is in place, the request may be scheduled.
    pub receiving: Vec<RequestId>,
    /// Requests that failed or expired, on either side; their blocks may be reused.
    pub failed: Vec<FailedRequest>,
    /// Telemetry for the receives in `receiving` (same order).
    pub reports: Vec<TransferReport>,
}

impl Finished {
    /// True when nothing finished.
    pub fn is_empty(&self) -> bool {
        self.sending.is_empty() && self.receiving.is_empty() && self.failed.is_empty()
    }

    /// Appends `other`'s entries.
    pub fn extend(&mut self, other: Finished) {
        self.sending.extend(other.sending);
        self.receiving.extend(other.receiving);
        self.failed.extend(other.failed);
        self.reports.extend(other.reports);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{RdmaError, RdmaErrorKind};
    use crate::gpu::{GpuApi, GpuError};

    #[test]
    fn errors_map_to_causes_code_can_branch_on() {
        let wc = RdmaErrorKind::WorkCompletion { status: 10 };
        let cases = [
            (
                Error::Rdma(RdmaError::new(wc, "remote access error")),
                FailureCause::Rdma(wc),
            ),
            (
                Error::Gpu(GpuError::call(GpuApi::Cuda, 2, "out of memory".into())),
                FailureCause::Gpu { code: Some(2) },
            ),
            (
                Error::Refused {
                    peer: "p".into(),
                    message: "outside exported memory".into(),
                },
                FailureCause::Peer,
            ),
            (
                Error::ConnectionLost {
                    peer: "p".into(),
                    reason: "reset".into(),
                },
                FailureCause::Connection,
            ),
            (
                Error::Timeout {
                    what: "the handshake reply".into(),
                    after: Duration::from_secs(1),
                },
                FailureCause::Connection,
            ),
            (Error::Shutdown, FailureCause::Other),
        ];
        for (e, cause) in cases {
            assert_eq!(FailureCause::of(&e), cause, "{e}");
        }
    }
}
