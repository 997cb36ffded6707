//! Followers of holds, without I/O: readers that asked to be told of a hold's blocks as the
//! prefill holds them (a progressive read), and what they are told. The tracker keeps the
//! followers of each hold and of requests not held yet, and tells them through
//! [`Follower::announce`], which only queues (it is called under the tracker's lock).

use crate::ids::{BlockId, RequestId};

/// What a follower of a hold is told, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announcement {
    /// Blocks of the hold that are final: per block group, where they start among the hold's
    /// blocks (`first`) and their ids, in the order the reader pairs them with its own.
    /// `sealed`: the hold is complete, no part follows; a read confirms only then.
    Part {
        /// The hold's token (its `Done` names it).
        token: u64,
        /// Per block group, the position of the part's first block among the hold's.
        first: Vec<u32>,
        /// Per block group, the part's block ids: new blocks of the hold, or none when the
        /// part only adds tensors to the blocks of the part before (`tensors`).
        blocks: Vec<Vec<BlockId>>,
        /// The tensors of the layout (in its order) the part makes final, `[start, end)`:
        /// `None`, every tensor. A part of new blocks starts at tensor 0; the next parts, until
        /// the last tensor, name no block and continue that part's blocks where it ended.
        tensors: Option<(u32, u32)>,
        /// The hold is sealed: this is its last part.
        sealed: bool,
    },
    /// The hold ended before its reader confirmed (released, expired, aborted), or the follow
    /// was refused or not held in time: why. Nothing follows.
    Ended {
        /// What happened, for the reader's report.
        reason: String,
    },
}

/// Where a follower's announcements go (its control connection's bounded queue).
pub trait Follower: Send + Sync + std::fmt::Debug {
    /// Queues `a` about request `id`; false when it cannot (the connection is gone or its
    /// queue full): the tracker drops the follower, whose read then fails at its deadline.
    fn announce(&self, id: &RequestId, a: Announcement) -> bool;
}
