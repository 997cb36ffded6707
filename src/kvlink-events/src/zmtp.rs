//! ZMTP 3 without I/O, for the publisher's own PUB side of bound tcp endpoints (`fanout`): the
//! greeting and READY command it sends, a parser of what a subscriber sends (greeting,
//! commands, message frames), subscriptions in both forms (ZMTP 3.0 messages `\x01topic` /
//! `\x00topic`, ZMTP 3.1 `SUBSCRIBE` / `CANCEL` commands), and the frame headers of a
//! published message. Sizes are checked by the frame guard ([`super::guard::Check`]) before
//! bytes reach the parser; the parser still refuses anything malformed on its own.

use super::error::ZmtpError;

/// Length of a ZMTP 3 greeting.
pub(crate) const GREETING: usize = 64;

/// Most subscriptions one peer may hold (a SUB sends one per topic prefix it wants).
pub(crate) const MAX_SUBSCRIPTIONS: usize = 1024;
/// Most bytes of subscription prefixes one peer may hold, all together.
pub(crate) const MAX_SUBSCRIPTION_BYTES: usize = 64 << 10;
/// Longest PING context (ZMTP 3.1: at most 16 bytes).
pub(crate) const MAX_PING_CONTEXT: usize = 16;

/// Our greeting: signature, version 3.0 (peers then subscribe with messages, and libzmq and the
/// `zeromq` crate both speak it), the NULL mechanism, not a server.
pub(crate) fn greeting() -> [u8; GREETING] {
    let mut g = [0u8; GREETING];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A command frame: name, then `body`.
fn command(name: &[u8], body: &[u8]) -> Vec<u8> {
    let len = 1 + name.len() + body.len();
    let mut out = Vec::with_capacity(len + 9);
    if len <= 255 {
        out.extend([0x04, len as u8]);
    } else {
        out.push(0x06);
        out.extend((len as u64).to_be_bytes());
    }
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(body);
    out
}

/// The NULL mechanism's READY command announcing `socket_type`.
pub(crate) fn ready(socket_type: &str) -> Vec<u8> {
    let mut props = Vec::new();
    props.push(11);
    props.extend_from_slice(b"Socket-Type");
    props.extend((socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type.as_bytes());
    command(b"READY", &props)
}

/// A PONG answering a PING whose context is `context` (ZMTP 3.1 heartbeats).
pub(crate) fn pong(context: &[u8]) -> Vec<u8> {
    command(b"PONG", context)
}

/// A metadata property of a READY command: name and value.
pub(crate) type Property = (Vec<u8>, Vec<u8>);

/// The metadata properties of a READY command's body, by name.
pub(crate) fn properties(mut body: &[u8]) -> Result<Vec<Property>, ZmtpError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let n = usize::from(body[0]);
        let name = body
            .get(1..1 + n)
            .ok_or(ZmtpError::PropertyCutShort("name"))?;
        let len = body
            .get(1 + n..5 + n)
            .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or(ZmtpError::PropertyCutShort("length"))?;
        let value = body
            .get(5 + n..5 + n + len)
            .ok_or(ZmtpError::PropertyCutShort("value"))?;
        out.push((name.to_vec(), value.to_vec()));
        body = &body[5 + n + len..];
    }
    Ok(out)
}

/// What a peer sent, one unit at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// The greeting: version (major, minor) and mechanism name.
    Greeting {
        major: u8,
        minor: u8,
        mechanism: Vec<u8>,
    },
    /// A command: its name and data.
    Command { name: Vec<u8>, data: Vec<u8> },
    /// One frame of a message (`more` when others follow).
    Frame { more: bool, body: Vec<u8> },
}

/// Splits a peer's byte stream into [`Incoming`] units: bytes are fed as they arrive and units
/// taken when whole. Consumed bytes are dropped from the buffer once per [`Parser::feed`], not
/// once per unit.
#[derive(Debug, Default)]
pub(crate) struct Parser {
    buf: Vec<u8>,
    /// Bytes of `buf` already taken as units.
    at: usize,
    greeted: bool,
}

impl Parser {
    /// Appends bytes that arrived.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        self.buf.drain(..self.at);
        self.at = 0;
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole unit, if one is there.
    pub(crate) fn next(&mut self) -> Result<Option<Incoming>, ZmtpError> {
        let rest = &self.buf[self.at..];
        if !self.greeted {
            if rest.len() < GREETING {
                return Ok(None);
            }
            let g = &rest[..GREETING];
            if g[0] != 0xFF || g[9] & 1 != 1 {
                return Err(ZmtpError::NotAGreeting);
            }
            let mech = &g[12..32];
            let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
            let unit = Incoming::Greeting {
                major: g[10],
                minor: g[11],
                mechanism: mech[..end].to_vec(),
            };
            self.greeted = true;
            self.at += GREETING;
            return Ok(Some(unit));
        }
        let Some(&flags) = rest.first() else {
            return Ok(None);
        };
        if flags & !0x07 != 0 {
            return Err(ZmtpError::ReservedFlags(flags));
        }
        if flags & 0x05 == 0x05 {
            return Err(ZmtpError::CommandWithMore);
        }
        let (head, len): (usize, u64) = if flags & 0x02 != 0 {
            match rest.get(1..9) {
                Some(b) => (9, u64::from_be_bytes(b.try_into().expect("8 bytes"))),
                None => return Ok(None),
            }
        } else {
            match rest.get(1) {
                Some(&b) => (2, u64::from(b)),
                None => return Ok(None),
            }
        };
        let len = usize::try_from(len).map_err(|_| ZmtpError::FrameTooLarge)?;
        let Some(body) = rest.get(head..head.saturating_add(len)) else {
            return Ok(None);
        };
        let unit = if flags & 0x04 != 0 {
            let n = usize::from(*body.first().ok_or(ZmtpError::EmptyCommand)?);
            let name = body.get(1..1 + n).ok_or(ZmtpError::CommandNameCutShort)?;
            Incoming::Command {
                name: name.to_vec(),
                data: body[1 + n..].to_vec(),
            }
        } else {
            Incoming::Frame {
                more: flags & 0x01 != 0,
                body: body.to_vec(),
            }
        };
        self.at += head + len;
        Ok(Some(unit))
    }
}

/// The topic prefixes a subscriber asked for, as a multiset: each subscribe adds one, each
/// cancel removes one (libzmq's semantics).
#[derive(Debug, Default, Clone)]
pub(crate) struct Subscriptions {
    prefixes: Vec<Vec<u8>>,
    bytes: usize,
}

impl Subscriptions {
    /// Whether no prefix was subscribed yet.
    pub(crate) fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// Adds a prefix; fails past [`MAX_SUBSCRIPTIONS`] or [`MAX_SUBSCRIPTION_BYTES`].
    pub(crate) fn subscribe(&mut self, prefix: &[u8]) -> Result<(), ZmtpError> {
        if self.prefixes.len() >= MAX_SUBSCRIPTIONS {
            return Err(ZmtpError::TooManySubscriptions(MAX_SUBSCRIPTIONS));
        }
        if self.bytes + prefix.len() > MAX_SUBSCRIPTION_BYTES {
            return Err(ZmtpError::SubscriptionBytes(MAX_SUBSCRIPTION_BYTES));
        }
        self.bytes += prefix.len();
        self.prefixes.push(prefix.to_vec());
        Ok(())
    }

    /// Removes one instance of a prefix, if held.
    pub(crate) fn cancel(&mut self, prefix: &[u8]) {
        if let Some(i) = self.prefixes.iter().position(|p| p == prefix) {
            self.bytes -= self.prefixes.swap_remove(i).len();
        }
    }

    /// Whether a message with `topic` goes to this subscriber.
    pub(crate) fn matches(&self, topic: &[u8]) -> bool {
        self.prefixes.iter().any(|p| topic.starts_with(p))
    }

    /// Applies a subscription message or command, if `unit` is one (ZMTP 3.0: a one-frame
    /// message starting with 1 or 0, `whole` when the frame is a message of its own; ZMTP
    /// 3.1: `SUBSCRIBE` / `CANCEL`). Returns whether it was.
    pub(crate) fn apply(&mut self, unit: &Incoming, whole: bool) -> Result<bool, ZmtpError> {
        match unit {
            Incoming::Frame { more: false, body } if whole => match body.split_first() {
                Some((1, topic)) => self.subscribe(topic).map(|_| true),
                Some((0, topic)) => {
                    self.cancel(topic);
                    Ok(true)
                }
                _ => Ok(false),
            },
            Incoming::Command { name, data } if name == b"SUBSCRIBE" => {
                self.subscribe(data).map(|_| true)
            }
            Incoming::Command { name, data } if name == b"CANCEL" => {
                self.cancel(data);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// The frames of a published message `[topic, seq (8 bytes, big-endian), payload]` up to the
/// payload's body: topic frame, seq frame, and the payload frame's header. The payload follows
/// as it is (no copy of it).
pub(crate) fn message_prefix(topic: &[u8], seq: u64, payload_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(topic.len() + 30);
    frame_header(&mut out, topic.len(), true);
    out.extend_from_slice(topic);
    frame_header(&mut out, 8, true);
    out.extend(seq.to_be_bytes());
    frame_header(&mut out, payload_len, false);
    out
}

fn frame_header(out: &mut Vec<u8>, len: usize, more: bool) {
    let more = u8::from(more);
    if len <= 255 {
        out.extend([more, len as u8]);
    } else {
        out.push(0x02 | more);
        out.extend((len as u64).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(bytes: &[u8], step: usize) -> Result<Vec<Incoming>, ZmtpError> {
        let mut p = Parser::default();
        let mut out = Vec::new();
        for chunk in bytes.chunks(step) {
            p.feed(chunk);
            while let Some(u) = p.next()? {
                out.push(u);
            }
        }
        Ok(out)
    }

    #[test]
    fn a_subscribers_stream_parses_in_any_chunking() {
        let mut s = greeting().to_vec();
        s.extend(ready("SUB"));
        s.extend([0x00, 3, 1, b'k', b'v']); // subscribe "kv" (ZMTP 3.0)
        s.extend(command(b"SUBSCRIBE", b"")); // subscribe to everything (ZMTP 3.1)
        s.extend(command(b"PING", &[0, 10, b'c']));
        s.push(0x02); // a long frame
        s.extend(300u64.to_be_bytes());
        s.extend([7u8; 300]);
        for step in [1, 2, 7, 64, 1000] {
            let u = units(&s, step).unwrap();
            assert_eq!(u.len(), 6, "step {step}");
            assert_eq!(
                u[0],
                Incoming::Greeting {
                    major: 3,
                    minor: 0,
                    mechanism: b"NULL".to_vec()
                }
            );
            let Incoming::Command { name, data } = &u[1] else {
                panic!("READY expected")
            };
            assert_eq!(name, b"READY");
            assert_eq!(
                properties(data).unwrap(),
                vec![(b"Socket-Type".to_vec(), b"SUB".to_vec())]
            );
            let mut subs = Subscriptions::default();
            assert!(subs.apply(&u[2], true).unwrap());
            assert!(subs.matches(b"kv@pod") && !subs.matches(b"x"));
            assert!(subs.apply(&u[3], true).unwrap());
            assert!(subs.matches(b"x"));
            assert!(
                !subs.apply(&u[4], true).unwrap(),
                "PING is not a subscription"
            );
            assert_eq!(
                u[5],
                Incoming::Frame {
                    more: false,
                    body: vec![7; 300]
                }
            );
        }
    }

    #[test]
    fn cancels_remove_one_subscription_each() {
        let mut subs = Subscriptions::default();
        subs.subscribe(b"a").unwrap();
        subs.subscribe(b"a").unwrap();
        let cancel = Incoming::Frame {
            more: false,
            body: vec![0, b'a'],
        };
        assert!(
            !subs.apply(&cancel, false).unwrap(),
            "the last frame of a longer message is not a subscription"
        );
        subs.apply(&cancel, true).unwrap();
        assert!(subs.matches(b"ab"), "one of two left");
        subs.apply(
            &Incoming::Command {
                name: b"CANCEL".to_vec(),
                data: b"a".to_vec(),
            },
            true,
        )
        .unwrap();
        assert!(!subs.matches(b"ab"));
        for _ in 0..MAX_SUBSCRIPTIONS {
            subs.subscribe(b"x").unwrap();
        }
        assert!(subs.subscribe(b"x").is_err());
        let mut big = Subscriptions::default();
        big.subscribe(&[b'p'; MAX_SUBSCRIPTION_BYTES]).unwrap();
        assert!(big.subscribe(b"q").is_err(), "bounded in bytes");
        big.cancel(&[b'p'; MAX_SUBSCRIPTION_BYTES]);
        big.subscribe(b"q").unwrap();
    }

    #[test]
    fn malformed_input_is_refused() {
        assert!(units(
            b"GET / HTTP/1.1\r\n\r\n-------------------------------------------------------",
            5
        )
        .is_err());
        let mut s = greeting().to_vec();
        s.push(0x80);
        assert!(units(&s, 3).is_err(), "reserved flag bits");
        let mut s = greeting().to_vec();
        s.extend([0x04, 3, 9, b'a', b'b']); // command name longer than the frame
        assert!(units(&s, 1).is_err());
        let mut s = greeting().to_vec();
        s.extend([0x05, 2, 1, b'a']); // a command with MORE
        assert!(units(&s, 1).is_err());
        assert!(properties(&[11, b'S']).is_err());
        assert!(properties(&[1, b'a', 0, 0, 0, 9, b'x']).is_err());
    }

    #[test]
    fn message_frames_are_written_as_zmtp_frames() {
        let payload = vec![5u8; 1000];
        let mut wire = greeting().to_vec();
        wire.extend(message_prefix(b"kv@p@m", 7, payload.len()));
        wire.extend(&payload);
        let u = units(&wire, 13).unwrap();
        assert_eq!(
            &u[1..],
            &[
                Incoming::Frame {
                    more: true,
                    body: b"kv@p@m".to_vec()
                },
                Incoming::Frame {
                    more: true,
                    body: 7u64.to_be_bytes().to_vec()
                },
                Incoming::Frame {
                    more: false,
                    body: payload
                },
            ]
        );
        let short = message_prefix(b"", 0, 3);
        assert_eq!(short, [1, 0, 1, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(pong(b"c"), [0x04, 6, 4, b'P', b'O', b'N', b'G', b'c']);
    }
}
