//! KV-cache events: the wire types of vLLM, SGLang and ATOM streams in both encodings, a
//! bounds-checked msgpack reader, and the page splitter. (The ZeroMQ publisher, subscriber and
//! merger build on these.)

pub mod msgpack;
pub mod pages;
pub mod wire;

pub use pages::{page_digest, PageHash, PageSplitter, Pages};
pub use wire::{
    decode_batch, encode_batch, encode_event, BatchError, BlockHash, BlockRemoved, BlockStored,
    BlockTransferred, Decoded, Encoding, EventBatch, KvEvent,
};
