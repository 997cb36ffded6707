//! Same-host transport: for engines that share a machine (for example prefill on four GPUs of
//! a node and decode on the other four).
//!
//! The reader shares its destination regions with the engine it reads from over a Unix socket
//! in the abstract namespace: host memory kvlink allocated as its sealed memfd (`SCM_RIGHTS`),
//! GPU memory as a CUDA or HIP IPC handle. The serving engine opens them and, for each read
//! request, checks the grant and every range exactly as its TCP data server does, then copies
//! its own registered bytes straight into the reader's blocks: one copy, no socket in the data
//! path, done by the side that enforces the grant. Peers on other hosts, or in another network
//! namespace, never reach the socket; readers whose memory cannot be shared (host memory
//! registered from a pointer) use TCP or RDMA.

mod client;
mod server;
mod views;
pub(crate) mod wire;

pub(crate) use client::LocalTransport;
pub(crate) use server::serve;

/// The abstract socket name of an engine: unique per process and start.
pub(crate) fn socket_name(nonce: u64) -> String {
    format!("kvlink-{}-{nonce:016x}", std::process::id())
}
