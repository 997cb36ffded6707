//! KV-cache events, byte-compatible with vLLM, SGLang and ATOM streams:
//! - [`wire`]: the event types in both msgpack encodings, over a bounds-checked reader
//!   ([`msgpack`]);
//! - [`pages`]: fixed-size pages with chained hashes;
//! - [`sequence`]: the replay ring and the subscriber's gap/replay/restart state machine,
//!   without I/O;
//! - [`Publisher`], [`Subscriber`] and [`Merger`]: the ZeroMQ sockets (PUB, SUB, ROUTER and
//!   DEALER, on the `zeromq` crate) around them, following vLLM's endpoint rules
//!   ([`endpoint`]).

pub mod endpoint;
mod guard;
pub mod merger;
pub mod msgpack;
pub mod pages;
pub mod publisher;
pub mod sequence;
pub mod subscriber;
pub mod wire;

pub use merger::{InputStats, Merger, MergerConfig, MergerInput};
pub use pages::{page_digest, PageHash, PageSplitter, Pages};
pub use publisher::{Publisher, PublisherConfig, PublisherStats, ReplayFormat, REPLAY_END};
pub use sequence::{Action, ReplayRing, Resync, StreamState};
pub use subscriber::{SubItem, Subscriber, SubscriberConfig, SubscriberStats};
pub use wire::{
    decode_batch, encode_batch, encode_event, BatchError, BlockHash, BlockRemoved, BlockStored,
    BlockTransferred, Decoded, Encoding, EventBatch, KvEvent,
};

/// Errors of the KV-event sockets.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// The endpoint string is unusable.
    #[error("bad KV-event endpoint {0}")]
    Endpoint(String),
    /// A ZeroMQ operation failed.
    #[error("ZeroMQ error {context}: {source}")]
    Zmq {
        /// What was being done.
        context: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
    /// An I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The settings are inconsistent.
    #[error("invalid KV-event configuration: {0}")]
    Config(String),
    /// The publish queue is full: the batch was dropped (and counted).
    #[error("KV-event publish queue full ({cap} batches waiting); the batch was dropped")]
    QueueFull {
        /// The queue's capacity.
        cap: usize,
    },
    /// The publisher is closed.
    #[error("the KV-event publisher is closed")]
    Closed,
}
