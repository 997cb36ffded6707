//! Why a batch, or one event inside it, could not be read.

use std::fmt;

use crate::msgpack::DecodeError;

/// Why a whole batch is unreadable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The bytes are not msgpack, so the events' extents cannot be found.
    #[error("unreadable event batch: {0}")]
    Msgpack(#[from] DecodeError),
    /// The payload is not a msgpack array.
    #[error("unreadable event batch: a batch is not an array")]
    NotAnArray,
    /// The array is shorter than `[ts, events]`.
    #[error("unreadable event batch: a batch has {0} elements, at least 2 expected")]
    TooShort(usize),
    /// The first element is not a number.
    #[error("unreadable event batch: the batch timestamp is not a number")]
    TimestampNotANumber,
    /// The second element is not an array.
    #[error("unreadable event batch: the batch's events are not an array")]
    EventsNotAnArray,
}

/// Why one event of a readable batch was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// The event's bytes are not msgpack where a value was read.
    #[error(transparent)]
    Msgpack(#[from] DecodeError),
    /// The event is neither a map (current encoding) nor an array (legacy).
    #[error("event is neither a map nor an array")]
    NotAMapOrArray,
    /// A map event with a key that is not a string.
    #[error("a map event has a key that is not a string")]
    KeyNotAString,
    /// A map event with no `type`.
    #[error("map event without a string \"type\"")]
    MapWithoutType,
    /// An empty array event, or one whose first element is not a string.
    #[error("array event without a tag")]
    ArrayWithoutTag,
    /// Two `type` fields in one map event.
    #[error("a second \"type\" in one event")]
    SecondType,
    /// The `type` field is not a string.
    #[error("the event \"type\" is not a string")]
    TypeNotAString,
    /// A type no engine publishes.
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    /// A field (named) of the wrong type.
    #[error("field {0} has the wrong type")]
    WrongType(&'static str),
    /// A list field (named) that is not an array.
    #[error("field {0} is not an array")]
    NotAnArray(&'static str),
    /// An entry of a hash list (named) that is not a hash.
    #[error("a {0} entry is not a hash")]
    NotAHash(&'static str),
    /// An entry of a token list (named) that is not a u32 token id.
    #[error("a {0} entry is not a u32 token id")]
    NotATokenId(&'static str),
    /// A BlockStored with more tokens than its blocks hold: its blocks are masked or from a
    /// sliding window, and reading them as full would misalign every hash.
    #[error(
        "BlockStored has {tokens} tokens for {blocks} blocks of {block_size} (masked or \
         sliding-window blocks?): refused rather than misaligned"
    )]
    TokensExceedBlocks {
        /// The event's token ids.
        tokens: usize,
        /// The event's block hashes.
        blocks: usize,
        /// Its block size.
        block_size: u32,
    },
}

/// One event a batch's decoding skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedEvent {
    /// Its place in the batch's event list.
    pub index: usize,
    /// Why it was skipped.
    pub why: EventError,
}

impl fmt::Display for SkippedEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "event {}: {}", self.index, self.why)
    }
}
