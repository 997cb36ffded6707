//! KV-cache events: the wire types of vLLM, SGLang and ATOM streams in both encodings, a
//! bounds-checked msgpack reader, the page splitter, and the sans-I/O sequencing of streams
//! (replay ring, gap/replay/restart state machine). The ZeroMQ publisher, subscriber and merger
//! are to be built on these.

pub mod msgpack;
pub mod pages;
pub mod sequence;
pub mod wire;

pub use pages::{page_digest, PageHash, PageSplitter, Pages};
pub use sequence::{Action, ReplayRing, Resync, StreamState};
pub use wire::{
    decode_batch, encode_batch, encode_event, BatchError, BlockHash, BlockRemoved, BlockStored,
    BlockTransferred, Decoded, Encoding, EventBatch, KvEvent,
};
