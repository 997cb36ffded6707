//! TCP transport: a one-sided read emulated by a data server on the peer.
//!
//! The reader opens several streams to the peer's data server and pipelines read requests on
//! each. The server checks every requested range against its exported regions and answers with
//! the bytes written straight from registered memory (`writev`); the reader reads them straight
//! into its registered memory (`readv`). No user-space copies on either side for host memory;
//! GPU memory is staged through pinned host buffers, chunked and pipelined (see `staging`). How
//! a read is cut into batches is decided without I/O (`stream::batch`, with its tests); what
//! this transport shares with the same-host path is in `stream`.

mod ahead;
mod client;
mod server;
pub mod wire;

pub(crate) use client::TcpTransport;
pub(crate) use server::serve;
