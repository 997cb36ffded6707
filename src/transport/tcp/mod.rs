//! TCP transport: a one-sided read emulated by a data server on the peer.
//!
//! The reader opens several streams to the peer's data server and pipelines read requests on
//! each. The server checks every requested range against its exported regions and answers with
//! the bytes written straight from registered memory (`writev`); the reader reads them straight
//! into its registered memory (`readv`). No user-space copies on either side for host memory;
//! GPU memory is staged through pinned host buffers, chunked and pipelined (see `staging`). How
//! a read is cut into batches is decided without I/O (`batch`, with its tests).

pub(crate) mod batch;
mod client;
mod server;
mod staging;
pub mod wire;

pub(crate) use client::{prove_session, TcpTransport};
pub(crate) use server::{serve, ServeLimits};
pub(crate) use staging::StagingPool;
