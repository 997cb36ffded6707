//! Control-plane framing: `u32` big-endian length of what follows, `u16` big-endian protocol
//! version, then a msgpack body (rmp-serde, named fields). The length is checked against a cap
//! before any allocation; the version is checked before the body is decoded.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};

/// The control protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 10;

/// Largest control frame accepted or sent (bytes after the length prefix).
pub const MAX_FRAME_BYTES: u32 = 4 << 20;

/// Encodes one frame (length, version, body).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>> {
    let mut out = vec![0u8; 6];
    rmp_serde::encode::write_named(&mut out, msg)
        .map_err(|e| Error::Protocol(format!("cannot encode control message: {e}")))?;
    let len = out.len() - 4;
    if len > MAX_FRAME_BYTES as usize {
        return Err(Error::Protocol(format!(
            "control message of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit"
        )));
    }
    out[..4].copy_from_slice(&(len as u32).to_be_bytes());
    out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    Ok(out)
}

/// Decodes a frame body of the given version. Never panics on hostile input.
pub fn decode<T: DeserializeOwned>(version: u16, body: &[u8]) -> Result<T> {
    if version != PROTOCOL_VERSION {
        return Err(Error::Protocol(format!(
            "protocol version {version} is not supported (this build speaks {PROTOCOL_VERSION})"
        )));
    }
    rmp_serde::from_slice(body)
        .map_err(|e| Error::Protocol(format!("malformed control message: {e}")))
}

/// Largest frame a peer may send before it has authenticated, on engines with a key (the
/// `AuthHello` is under 100 bytes).
pub const MAX_UNAUTHENTICATED_FRAME_BYTES: u32 = 4 << 10;

/// Bytes a long-lived control connection reads ahead of the frame it parses (through a
/// `BufReader`): a frame's header and a small body in one receive, where two receives read
/// them apart; a body larger than it is read straight into its own buffer.
pub const READ_AHEAD: usize = 4096;

/// Reads one frame: `Ok(None)` on a clean end of stream before the first byte.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<(u16, Vec<u8>)>> {
    read_frame_up_to(r, MAX_FRAME_BYTES).await
}

/// [`read_frame`] refusing frames over `limit` bytes (at most [`MAX_FRAME_BYTES`]).
pub async fn read_frame_up_to<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: u32,
) -> Result<Option<(u16, Vec<u8>)>> {
    let limit = limit.min(MAX_FRAME_BYTES);
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r
            .read(&mut head[got..])
            .await
            .map_err(|e| Error::io("reading a control frame", &e))?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(Error::Protocol(
                "control stream ended inside a frame header".into(),
            ));
        }
        got += n;
    }
    let len = u32::from_be_bytes(head);
    if len < 2 {
        return Err(Error::Protocol(format!(
            "control frame length {len} is too short"
        )));
    }
    if len > limit {
        return Err(Error::Protocol(format!(
            "control frame of {len} bytes exceeds the {limit}-byte limit"
        )));
    }
    // Grow with the bytes that actually arrive, so a peer announcing a large frame and sending
    // nothing costs no memory.
    let mut buf = Vec::with_capacity((len as usize).min(64 << 10));
    let got = (&mut *r)
        .take(u64::from(len))
        .read_to_end(&mut buf)
        .await
        .map_err(|e| Error::io("reading a control frame body", &e))?;
    if got != len as usize {
        return Err(Error::Protocol(
            "control stream ended inside a frame".into(),
        ));
    }
    let version = u16::from_be_bytes([buf[0], buf[1]]);
    buf.drain(..2);
    Ok(Some((version, buf)))
}

/// Writes one already-encoded frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> Result<()> {
    w.write_all(frame)
        .await
        .map_err(|e| Error::io("writing a control frame", &e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::messages::Message;
    use proptest::prelude::*;

    #[tokio::test(flavor = "current_thread")]
    async fn roundtrip_and_limits() {
        let msg = Message::Ping { nonce: 7 };
        let bytes = encode(&msg).unwrap();
        let mut r = &bytes[..];
        let (v, body) = read_frame(&mut r).await.unwrap().unwrap();
        assert_eq!(decode::<Message>(v, &body).unwrap(), msg);
        assert!(decode::<Message>(v + 1, &body)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut r: &[u8] = &[0xff, 0xff, 0xff, 0xff, 0, 1];
        assert!(read_frame(&mut r)
            .await
            .unwrap_err()
            .to_string()
            .contains("exceeds"));
        let mut r: &[u8] = &[0, 0, 0, 9, 0, 1, 2];
        assert!(read_frame(&mut r).await.is_err());
        let mut r: &[u8] = &[];
        assert!(read_frame(&mut r).await.unwrap().is_none());
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(body in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<Message>(PROTOCOL_VERSION, &body);
        }
    }
}
