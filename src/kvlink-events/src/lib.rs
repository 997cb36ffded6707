//! KV-cache events, byte-compatible with vLLM, SGLang and ATOM streams:
//! - the event types in both msgpack encodings ([`KvEvent`], [`EventBatch`], [`encode_batch`],
//!   [`decode_batch`]), decoded by a bounds-checked reader;
//! - fixed-size pages with chained hashes ([`PageSplitter`]);
//! - the replay ring and the subscriber's gap/replay/restart state machine, without I/O
//!   ([`ReplayRing`], [`StreamState`]);
//! - [`Publisher`], [`Subscriber`] and [`Merger`]: the ZeroMQ sockets (PUB, SUB, ROUTER and
//!   DEALER, on the `zeromq` crate) around them, following vLLM's endpoint rules
//!   ([`resolve_endpoint`]);
//! - [`Index`]: which engine holds which blocks, from their streams, and the prefix overlap a
//!   router asks of it, never counting a block it cannot vouch for (without I/O).
//!
//! A crate of its own: a router depends on it without the transfer engine (no verbs, GPU or
//! engine code). `kvlink` re-exports it as `kvlink::events` under its `events` feature (on by
//! default).

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

// Layers, top to bottom: a module imports only from layers below its own; tools/check_layers.py
// reads this list and checks every import against it.
//   index, merger > subscriber > publisher > pages, aggregate, fanout > wire, zmtp
//   > sequence, endpoint, guard > msgpack, error, keyed

mod aggregate;
mod endpoint;
mod error;
mod fanout;
mod guard;
mod index;
mod keyed;
mod merger;
/// The bounded msgpack reader under the event decoders (for fuzzing and tests).
#[doc(hidden)]
pub mod msgpack;
mod pages;
mod publisher;
mod sequence;
mod subscriber;
mod wire;
mod zmtp;

pub use aggregate::{TpAggregator, TpStats};
pub use endpoint::{resolve as resolve_endpoint, Attach, ResolvedEndpoint};
pub use error::{EventsError, MessageError, PeerError, ReplayError, ZmtpError};
pub use index::{
    token_blocks, HolderKey, HolderMatch, HolderState, Index, IndexConfig, IndexStats, Overlap,
    Salt,
};
pub use merger::{InputStats, Merger, MergerConfig, MergerInput};
pub use pages::{page_digest, PageHash, PageSplitter, Pages};
pub use publisher::{
    BatchBuilder, Publisher, PublisherConfig, PublisherStats, ReplayFormat, REPLAY_END,
    SNAPSHOT_TAG,
};
pub use sequence::{Action, ReplayRing, Resync, StreamState};
pub use subscriber::{SubItem, Subscriber, SubscriberConfig, SubscriberStats};
pub use wire::{
    decode_batch, decode_batch_reusing, encode_batch, encode_event, encode_stored_ref,
    incarnation_of, BatchError, BlockHash, BlockRemoved, BlockStored, BlockStoredRef,
    BlockTransferred, Decoded, Encoding, EventBatch, EventError, ExtraField, FieldKey, HashRef,
    HashesRef, KvEvent, SkippedEvent, Value, CLEARED_LEGACY_ORDER, MAX_EXTRA_POSITION,
    REMOVED_LEGACY_ORDER, STORED_LEGACY_ORDER, TRANSFERRED_LEGACY_ORDER,
};

/// The topic of llm-d's convention, `kv@<pod>@<model>`, which its indexer subscribes to by the
/// `kv@` prefix and reads the pod and model from.
pub fn llm_d_topic(pod: &str, model: &str) -> String {
    format!("kv@{pod}@{model}")
}

/// The pod and model of an llm-d topic (`kv@<pod>@<model>`; the model may itself hold `@`).
pub fn parse_llm_d_topic(topic: &[u8]) -> Option<(&str, &str)> {
    let rest = std::str::from_utf8(topic).ok()?.strip_prefix("kv@")?;
    let (pod, model) = rest.split_once('@')?;
    (!pod.is_empty() && !model.is_empty()).then_some((pod, model))
}
