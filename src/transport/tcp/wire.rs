//! Data-stream framing of the TCP transport (little-endian, fixed layout; see docs/protocol.md).
//!
//! Request: `magic u32 = "KVRQ"`, `tag u64`, `count u32`, `id_len u16`, `flags u16`, then the
//! request id (`id_len` bytes of UTF-8, 1 to 256: the request whose held blocks the entries
//! read), the hold token (`u64`, flag [`FLAG_HOLD`]), the reader's control session id (16
//! bytes, flag [`FLAG_SESSION`]), then `count` entries of `region u32, offset u64, len u64`.
//! Response: `magic u32 = "KVRS"`, `tag u64`, `status u8` (0 ok, 1 refused), `len u64`, then
//! `len` bytes: the data for status 0 (entries in order), a UTF-8 reason for status 1. A
//! request with [`FLAG_CONFIRM`] served with status 0 gets a second response of the same tag:
//! status 2 (confirmed, `len` 8: how long the request had been held, in microseconds) or 3
//! (not confirmed, a UTF-8 reason).

use crate::error::{Error, Result};
use crate::ids::RegionId;
pub use crate::transport::stream::frame::{
    decode_request_id, Extras, AUTH_NONCE, AUTH_REPLY, FLAGS, FLAG_CONFIRM, FLAG_HOLD,
    FLAG_SESSION, MAX_ID, MAX_REQUEST_BYTES,
};

/// Request magic.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"KVRQ");
/// Response magic.
pub const RESPONSE_MAGIC: u32 = u32::from_le_bytes(*b"KVRS");
/// Request header bytes.
pub const REQUEST_HEADER: usize = 20;
/// Bytes per request entry.
pub const ENTRY: usize = 20;
/// Response header bytes.
pub const RESPONSE_HEADER: usize = 21;
/// Most entries in one request.
pub const MAX_ENTRIES: u32 = 4096;
/// Longest refusal reason.
pub const MAX_REASON: u64 = 64 << 10;
/// Response status: data follows.
pub const STATUS_OK: u8 = 0;
/// Response status: refused, a reason follows.
pub const STATUS_REFUSED: u8 = 1;

/// Response status: the read is confirmed, 8 bytes follow (microseconds the request was held).
pub const STATUS_CONFIRMED: u8 = 2;
/// Response status: the read is not confirmed, a reason follows.
pub const STATUS_UNCONFIRMED: u8 = 3;
/// One requested range of the server's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Region id (the server's).
    pub region: RegionId,
    /// Offset within the region.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

/// Encodes a request for the blocks held for request `id` (1 to [`MAX_ID`] bytes; the caller
/// validated it).
pub fn encode_request(
    tag: u64,
    id: &str,
    extras: &Extras,
    entries: impl ExactSizeIterator<Item = Entry>,
    out: &mut Vec<u8>,
) {
    debug_assert!((1..=MAX_ID).contains(&id.len()));
    out.clear();
    out.reserve(REQUEST_HEADER + id.len() + 24 + entries.len() * ENTRY);
    out.extend_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(&extras.flags().to_le_bytes());
    out.extend_from_slice(id.as_bytes());
    extras.encode(out);
    for e in entries {
        out.extend_from_slice(&e.region.0.to_le_bytes());
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.len.to_le_bytes());
    }
}

/// A request header's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// The stream's tag for it.
    pub tag: u64,
    /// Entries that follow.
    pub count: u32,
    /// Bytes of the request id.
    pub id_len: usize,
    /// What follows the id ([`Extras`]).
    pub flags: u16,
}

/// Parses a request header. Refuses a bad magic, too many entries, an id length outside 1 to
/// [`MAX_ID`], or flags this build does not know.
pub fn decode_request_header(h: &[u8; REQUEST_HEADER]) -> Result<RequestHeader> {
    let magic = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    if magic != REQUEST_MAGIC {
        return Err(Error::Protocol(format!("bad request magic {magic:#x}")));
    }
    let tag = u64::from_le_bytes(h[4..12].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
    if count == 0 || count > MAX_ENTRIES {
        return Err(Error::Protocol(format!(
            "request with {count} entries (1 to {MAX_ENTRIES} allowed)"
        )));
    }
    let id_len = usize::from(u16::from_le_bytes(h[16..18].try_into().expect("2 bytes")));
    let flags = u16::from_le_bytes(h[18..20].try_into().expect("2 bytes"));
    if id_len == 0 || id_len > MAX_ID || flags & !FLAGS != 0 {
        return Err(Error::Protocol(format!(
            "request id of {id_len} bytes, flags {flags:#x} (1 to {MAX_ID} bytes allowed; \
             flags {FLAGS:#x} at most)"
        )));
    }
    Ok(RequestHeader {
        tag,
        count,
        id_len,
        flags,
    })
}

/// Parses request entries (`body.len()` must be a multiple of [`ENTRY`]).
pub fn decode_entries(body: &[u8]) -> impl Iterator<Item = Entry> + '_ {
    body.chunks_exact(ENTRY).map(|c| Entry {
        region: RegionId(u32::from_le_bytes(c[0..4].try_into().expect("4"))),
        offset: u64::from_le_bytes(c[4..12].try_into().expect("8")),
        len: u64::from_le_bytes(c[12..20].try_into().expect("8")),
    })
}

/// Encodes a response header.
pub fn encode_response_header(tag: u64, status: u8, len: u64) -> [u8; RESPONSE_HEADER] {
    let mut h = [0u8; RESPONSE_HEADER];
    h[0..4].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
    h[4..12].copy_from_slice(&tag.to_le_bytes());
    h[12] = status;
    h[13..21].copy_from_slice(&len.to_le_bytes());
    h
}

/// Parses a response header: `(tag, status, len)`.
pub fn decode_response_header(h: &[u8; RESPONSE_HEADER]) -> Result<(u64, u8, u64)> {
    let magic = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    if magic != RESPONSE_MAGIC {
        return Err(Error::Protocol(format!("bad response magic {magic:#x}")));
    }
    let tag = u64::from_le_bytes(h[4..12].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(h[13..21].try_into().expect("8 bytes"));
    match h[12] {
        STATUS_OK if len <= MAX_REQUEST_BYTES => Ok((tag, STATUS_OK, len)),
        STATUS_REFUSED if len <= MAX_REASON => Ok((tag, STATUS_REFUSED, len)),
        STATUS_CONFIRMED if len == 8 => Ok((tag, STATUS_CONFIRMED, len)),
        STATUS_UNCONFIRMED if len <= MAX_REASON => Ok((tag, STATUS_UNCONFIRMED, len)),
        s => Err(Error::Protocol(format!(
            "bad response status {s} with length {len}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip_and_refusals() {
        let entries = [
            Entry {
                region: RegionId(3),
                offset: 10,
                len: 20,
            },
            Entry {
                region: RegionId(4),
                offset: u64::MAX,
                len: 1,
            },
        ];
        let mut buf = Vec::new();
        let extras = Extras {
            confirm: true,
            hold: Some(77),
            session: Some([5; 16]),
        };
        encode_request(9, "req-7", &extras, entries.iter().copied(), &mut buf);
        let h: [u8; REQUEST_HEADER] = buf[..REQUEST_HEADER].try_into().unwrap();
        let head = decode_request_header(&h).unwrap();
        assert_eq!((head.tag, head.count, head.id_len), (9, 2, 5));
        let id = decode_request_id(&buf[REQUEST_HEADER..REQUEST_HEADER + 5]).unwrap();
        assert_eq!(id.as_str(), "req-7");
        assert!(decode_request_id(&[0xff, 0xfe]).is_err());
        let at = REQUEST_HEADER + 5;
        let n = Extras::len_of(head.flags);
        assert_eq!(Extras::decode(head.flags, &buf[at..at + n]), extras);
        let got: Vec<Entry> = decode_entries(&buf[at + n..]).collect();
        assert_eq!(got, entries);
        let mut plain = Vec::new();
        encode_request(
            1,
            "r",
            &Extras::default(),
            entries.iter().copied(),
            &mut plain,
        );
        let h: [u8; REQUEST_HEADER] = plain[..REQUEST_HEADER].try_into().unwrap();
        assert_eq!(decode_request_header(&h).unwrap().flags, 0);
        let mut unknown = h;
        unknown[18..20].copy_from_slice(&8u16.to_le_bytes());
        assert!(decode_request_header(&unknown).is_err(), "unknown flags");
        for bad_id in [0u16, MAX_ID as u16 + 1] {
            let mut b = h;
            b[16..18].copy_from_slice(&bad_id.to_le_bytes());
            assert!(decode_request_header(&b).is_err());
        }
        let mut bad = h;
        bad[0] ^= 1;
        assert!(decode_request_header(&bad).is_err());
        let mut many = h;
        many[12..16].copy_from_slice(&(MAX_ENTRIES + 1).to_le_bytes());
        assert!(decode_request_header(&many).is_err());
        let r = encode_response_header(5, STATUS_OK, 100);
        assert_eq!(decode_response_header(&r).unwrap(), (5, 0, 100));
        let r = encode_response_header(5, STATUS_REFUSED, MAX_REASON + 1);
        assert!(decode_response_header(&r).is_err());
        let r = encode_response_header(5, STATUS_CONFIRMED, 8);
        assert_eq!(decode_response_header(&r).unwrap(), (5, 2, 8));
        let r = encode_response_header(5, STATUS_CONFIRMED, 9);
        assert!(decode_response_header(&r).is_err());
        let r = encode_response_header(5, 7, 0);
        assert!(decode_response_header(&r).is_err());
    }
}
