//! RDMA verbs transport: one-sided RDMA READs over reliable-connection queue pairs.
//!
//! The verbs library is loaded at run time (sideway dlopens libibverbs), so the same binary runs
//! where no RDMA stack exists and says why RDMA is unavailable. This module and its children are
//! the only place, with `memory`, where `unsafe` is allowed: verbs take raw addresses and keys.
//!
//! One file per verbs concept:
//! - `device`: device/port/GID selection, the protection domain, memory registration (split
//!   into chunks below the NIC's registration limit, `mr`) and the completion channel;
//! - `poller`: the completion poller thread and the handler registry it drives;
//! - `qp`: queue pair creation and the moves to ready-to-send;
//! - `conn`: a connection to one peer: several RC queue pairs, posting of READ work requests
//!   (chained per doorbell, selective signaling, gated on queue credits);
//! - sans-I/O cores with unit tests: `wr` (work requests: split at registration chunks and
//!   `max_wr_bytes`, scatter lists) and `ledger` (per queue pair credits, sequence numbers in
//!   work request ids, retirement on signaled completions, flush grace with time passed in).

mod conn;
mod device;
mod ledger;
mod mr;
mod poller;
mod qp;
mod wr;

use serde::{Deserialize, Serialize};

pub(crate) use conn::RdmaConnection;

/// Most RDMA devices one engine opens.
pub(crate) const MAX_DEVICES: usize = 16;
pub use device::RdmaSettings;
pub(crate) use device::{probe, RdmaDevice};
pub(crate) use qp::ServerQps;
pub use wr::RdmaFault;

use crate::ids::RegionId;

/// How a peer reaches one of our queue pairs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number of its send queue.
    pub psn: u32,
    /// GID of the port (RoCE: IPv6 or IPv4-mapped address).
    pub gid: [u8; 16],
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Active MTU in bytes.
    pub mtu: u32,
}

/// What a peer needs to read one of our regions: its address and a key per chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegionInfo {
    /// The region.
    pub id: RegionId,
    /// Virtual address of byte 0 of the region.
    pub addr: u64,
    /// Bytes per registration chunk (the last may be shorter).
    pub chunk_bytes: u64,
    /// Remote key of each chunk, in order.
    pub rkeys: Vec<u32>,
}
