//! Completion tracking: which requests finished sending or receiving, failed or expired.
//!
//! [`CompletionTracker`] is one worker's view; [`TpAggregator`] combines the reports of every
//! tensor-parallel rank for the scheduler. Both are plain state machines: time is passed in.

mod aggregator;
mod tracker;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::RequestId;

pub use aggregator::TpAggregator;
pub use tracker::{CompletionTracker, SendNotice};

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
}

/// Telemetry of one finished receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferReport {
    /// The request.
    pub id: RequestId,
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
