//! Application messages between engines: the bytes a connector sends a peer engine over the
//! authenticated control connection (SGLang's chunk announcements, for instance), and the
//! bounded inbox they land in. Sans-I/O: no socket, no clock.

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// Largest message body an engine sends or accepts.
pub const MAX_MESSAGE_BYTES: usize = 64 << 10;
/// Most messages an inbox keeps before the oldest unread ones are kept and new ones dropped.
pub(crate) const INBOX_MESSAGES: usize = 4096;
/// Most body bytes an inbox keeps.
pub(crate) const INBOX_BYTES: usize = 16 << 20;

/// Most messages waiting for one peer's session to come up.
pub(crate) const OUTBOX_MESSAGES: usize = 1024;

/// A message body: raw bytes, encoded as msgpack `bin` and shown by its length in logs.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Body(pub Vec<u8>);

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{} bytes>", self.0.len())
    }
}

impl Serialize for Body {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Body, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Body;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> std::result::Result<Body, E> {
                Ok(Body(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> std::result::Result<Body, E> {
                Ok(Body(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Body, A::Error> {
                // Allocation follows the elements that arrived, not a declared length.
                let mut out = Vec::new();
                while let Some(b) = a.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(Body(out))
            }
        }
        d.deserialize_bytes(V)
    }
}

/// A message from a peer engine, as [`Engine::take_messages`](crate::Engine::take_messages)
/// returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerMessage {
    /// The sender's engine id, as it declared it in its authenticated handshake.
    pub from: String,
    /// The sender's control connection address.
    pub peer: SocketAddr,
    /// The body, at most [`MAX_MESSAGE_BYTES`].
    pub body: Vec<u8>,
}

/// Why a message was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Over [`MAX_MESSAGE_BYTES`].
    TooLarge,
    /// The inbox holds [`INBOX_MESSAGES`] messages or [`INBOX_BYTES`] bytes already.
    Full,
}

/// Messages received and not yet taken, bounded in count and bytes. When full, new messages
/// are refused (the sender's protocol times out and says so); what is queued is never lost.
#[derive(Debug)]
pub(crate) struct Inbox {
    queue: VecDeque<PeerMessage>,
    bytes: usize,
    max_messages: usize,
    max_bytes: usize,
}

impl Default for Inbox {
    fn default() -> Inbox {
        Inbox::with_limits(INBOX_MESSAGES, INBOX_BYTES)
    }
}

impl Inbox {
    /// An inbox with its own bounds (tests).
    pub(crate) fn with_limits(max_messages: usize, max_bytes: usize) -> Inbox {
        Inbox {
            queue: VecDeque::new(),
            bytes: 0,
            max_messages,
            max_bytes,
        }
    }

    /// Queues `m`, or says why not.
    pub(crate) fn push(&mut self, m: PeerMessage) -> std::result::Result<(), Refused> {
        if m.body.len() > MAX_MESSAGE_BYTES {
            return Err(Refused::TooLarge);
        }
        if self.queue.len() >= self.max_messages || self.bytes + m.body.len() > self.max_bytes {
            return Err(Refused::Full);
        }
        self.bytes += m.body.len();
        self.queue.push_back(m);
        Ok(())
    }

    /// Everything queued, oldest first.
    pub(crate) fn take(&mut self) -> Vec<PeerMessage> {
        self.bytes = 0;
        self.queue.drain(..).collect()
    }

    /// Messages queued.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(n: usize) -> PeerMessage {
        PeerMessage {
            from: "e".into(),
            peer: "127.0.0.1:1".parse().unwrap(),
            body: vec![7; n],
        }
    }

    #[test]
    fn bounds_refuse_new_messages_and_keep_the_queued_ones() {
        let mut i = Inbox::with_limits(3, 100);
        assert_eq!(i.push(msg(MAX_MESSAGE_BYTES + 1)), Err(Refused::TooLarge));
        i.push(msg(40)).unwrap();
        i.push(msg(60)).unwrap();
        assert_eq!(i.push(msg(1)), Err(Refused::Full), "100 bytes queued");
        i.push(msg(0)).unwrap();
        assert_eq!(i.push(msg(0)), Err(Refused::Full), "3 messages queued");
        let got = i.take();
        assert_eq!(
            got.iter().map(|m| m.body.len()).collect::<Vec<_>>(),
            [40, 60, 0]
        );
        assert_eq!(i.len(), 0);
        i.push(msg(100)).unwrap();
    }

    #[test]
    fn a_body_round_trips_as_msgpack_bin_and_logs_its_length() {
        let b = Body(vec![0, 1, 255, 128]);
        let enc = rmp_serde::to_vec(&b).unwrap();
        assert_eq!(enc, [0xc4, 4, 0, 1, 255, 128], "bin 8 with the raw bytes");
        assert_eq!(rmp_serde::from_slice::<Body>(&enc).unwrap(), b);
        // An array of small ints (another encoder's choice) is read too.
        assert_eq!(
            rmp_serde::from_slice::<Body>(&[0x92, 1, 2]).unwrap(),
            Body(vec![1, 2])
        );
        assert!(rmp_serde::from_slice::<Body>(&[0x91, 0xcd, 1, 0]).is_err());
        assert_eq!(format!("{b:?}"), "<4 bytes>");
    }
}
