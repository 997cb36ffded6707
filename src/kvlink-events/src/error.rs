//! The events crate's errors: what a caller of the sockets gets ([`EventsError`]), and why a
//! peer's connection or message was refused ([`ZmtpError`], [`PeerError`], [`MessageError`],
//! [`ReplayError`]). A leaf: every other module may use it.

use std::io;
use std::time::Duration;

/// Errors of the KV-event sockets.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
        source: io::Error,
    },
    /// The settings are inconsistent.
    #[error("invalid KV-event configuration: {0}")]
    Config(String),
    /// The publish queue is full: the batch was dropped (and counted).
    #[error(
        "KV-event publish queue full (at most {cap} batches and {cap_bytes} bytes wait); the batch was dropped"
    )]
    QueueFull {
        /// The queue's capacity in batches.
        cap: usize,
        /// The queue's capacity in payload bytes.
        cap_bytes: usize,
    },
    /// The publisher is closed.
    #[error("the KV-event publisher is closed")]
    Closed,
}

/// A ZMTP peer broke the protocol, or one of the limits put on an untrusted peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZmtpError {
    /// The first bytes are not a ZMTP 3 greeting.
    #[error("not a ZMTP 3 greeting")]
    NotAGreeting,
    /// A greeting of another version or security mechanism than 3 with NULL.
    #[error("ZMTP {major} with mechanism {mechanism:?} (3 with NULL expected)")]
    Unsupported {
        /// The peer's major version.
        major: u8,
        /// The peer's mechanism.
        mechanism: String,
    },
    /// Frame flags with bits ZMTP reserves.
    #[error("frame flags {0:#04x} set reserved bits")]
    ReservedFlags(u8),
    /// A command frame marked as followed by more.
    #[error("a command frame with the MORE flag")]
    CommandWithMore,
    /// A frame longer than this machine's address space.
    #[error("a frame too large")]
    FrameTooLarge,
    /// A command frame with no name length.
    #[error("an empty command frame")]
    EmptyCommand,
    /// A command whose name runs past its frame.
    #[error("a command name is cut short")]
    CommandNameCutShort,
    /// A READY property (its part named) that runs past the command.
    #[error("a READY property {0} is cut short")]
    PropertyCutShort(&'static str),
    /// A frame over the limit.
    #[error("a frame of {len} bytes exceeds the limit of {max}")]
    FrameOverLimit {
        /// The frame's announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A multipart message of more frames than the limit.
    #[error("a message of more than {0} frames")]
    TooManyFrames(u32),
    /// A multipart message of more bytes than the limit.
    #[error("a message of more than {0} bytes")]
    MessageOverLimit(u64),
    /// More messages on one connection than the limit.
    #[error("more than {0} messages on one connection")]
    TooManyMessages(u64),
    /// More subscriptions than a subscriber may hold.
    #[error("more than {0} subscriptions")]
    TooManySubscriptions(usize),
    /// More subscription bytes than a subscriber may hold.
    #[error("more than {0} bytes of subscriptions")]
    SubscriptionBytes(usize),
    /// A second READY command.
    #[error("a second READY")]
    SecondReady,
    /// A socket type that cannot talk to a PUB (its type, when it gave one).
    #[error("a {0:?} socket connected to a PUB")]
    WrongSocketType(Option<String>),
    /// A frame or command before READY.
    #[error("a frame before READY")]
    BeforeReady,
    /// A PING whose context is over ZMTP's limit.
    #[error("a PING context of {len} bytes (at most {max})")]
    PingContext {
        /// The context's length.
        len: usize,
        /// ZMTP's limit.
        max: usize,
    },
    /// The peer sent ERROR.
    #[error("the peer sent ERROR")]
    PeerSentError,
    /// A command this side does not take.
    #[error("an unexpected command {0:?}")]
    UnexpectedCommand(String),
}

/// Why a connection to an untrusted ZMTP peer ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// The peer broke the protocol or a limit.
    #[error(transparent)]
    Zmtp(#[from] ZmtpError),
    /// The socket failed.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The greeting and READY did not both cross within the handshake time.
    #[error("no ZMTP handshake within {0:?}")]
    Handshake(Duration),
    /// The peer took nothing sent toward it for the stall time.
    #[error("the peer took nothing for {0:?}")]
    Stalled(Duration),
}

/// Why a message from the publisher was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A live message of a frame count no publisher sends.
    #[error("{0} frames, expected 3")]
    Frames(usize),
    /// A replay answer of a frame count no publisher sends.
    #[error("replay answer of {0} frames")]
    ReplayFrames(usize),
    /// A sequence frame that is not 8 bytes.
    #[error("sequence frame of {0} bytes, expected 8")]
    SequenceFrame(usize),
    /// A live message with the sequence that marks a replay's end.
    #[error("live sequence 0xFF*8 is reserved for replay end markers")]
    ReservedSequence,
}

/// Why a replay could not be asked for.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// No replay endpoint is configured.
    #[error("the publisher has no replay endpoint configured here")]
    NoEndpoint,
    /// The DEALER could not connect.
    #[error("connecting to {endpoint}: {source}")]
    Connect {
        /// The replay endpoint.
        endpoint: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
    /// The request could not be sent.
    #[error("sending the request to {endpoint}: {source}")]
    Send {
        /// The replay endpoint.
        endpoint: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
    /// The request was not taken within the replay timeout.
    #[error("sending the request to {endpoint} timed out")]
    SendTimeout {
        /// The replay endpoint.
        endpoint: String,
    },
}
