//! Framing of the same-host transport's Unix socket (little-endian, fixed layout; see
//! docs/protocol.md). Pure: encoders, and decoders that refuse anything malformed.
//!
//! Reader to server: `magic u32 = "KVLQ"`, `kind u8`, three zero bytes, `tag u64`,
//! `body_len u32`, then the body.
//! - `MAP` (kind 1): `region u32`, `api u8` (0 host, 1 CUDA, 2 HIP, 3 emulated),
//!   `handle_len u8`, two zero bytes, `offset u64`, `len u64`, then the handle. The memfd (host
//!   memory, emulated device memory) travels as `SCM_RIGHTS` with the frame's first byte.
//! - `READ` (kind 2): `id_len u16`, two zero bytes, `count u32`, the request id, then `count`
//!   entries of `src_region u32, dst_region u32, src_offset u64, dst_offset u64, len u64`.
//!
//! Server to reader: `magic u32 = "KVLS"`, `tag u64`, `status u8` (0 done, 1 refused),
//! `reason_len u32`, then the UTF-8 reason of a refusal.

use crate::error::{Error, Result};
use crate::gpu::{GpuApi, MAX_IPC_HANDLE};
use crate::ids::{RegionId, RequestId};

/// Frame magic, reader to server.
pub(crate) const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"KVLQ");
/// Frame magic, server to reader.
pub(crate) const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"KVLS");
/// Frame header bytes, reader to server.
pub(crate) const HEADER: usize = 20;
/// Reply header bytes.
pub(crate) const REPLY_HEADER: usize = 17;
/// `MAP` body bytes before the handle.
pub(crate) const MAP_FIXED: usize = 24;
/// `READ` body bytes before the id.
pub(crate) const READ_FIXED: usize = 8;
/// Bytes per `READ` entry.
pub(crate) const ENTRY: usize = 32;
/// Most entries in one `READ`.
pub(crate) const MAX_ENTRIES: u32 = 4096;
/// Longest body a frame may announce.
pub(crate) const MAX_BODY: u32 =
    (READ_FIXED + crate::transport::stream::frame::MAX_ID) as u32 + MAX_ENTRIES * ENTRY as u32;
/// Longest refusal reason.
pub(crate) const MAX_REASON: u32 = 64 << 10;
/// Frame kind: open a reader's region.
pub(crate) const KIND_MAP: u8 = 1;
/// Frame kind: copy granted bytes into opened regions.
pub(crate) const KIND_READ: u8 = 2;

/// A `MAP` frame's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Map {
    /// The reader's region id (what `READ` entries name as destination).
    pub(crate) region: RegionId,
    /// `None` for host memory (a memfd), else the device runtime whose IPC opens it.
    pub(crate) api: Option<GpuApi>,
    /// Where the region starts in what the handle or descriptor opens.
    pub(crate) offset: u64,
    /// The region's length.
    pub(crate) len: u64,
    /// The runtime's IPC handle (empty for host memory).
    pub(crate) handle: Vec<u8>,
}

/// One `READ` entry: `len` bytes at `src_offset` of the server's `src_region` to `dst_offset`
/// of the reader's `dst_region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The server's region.
    pub(crate) src_region: RegionId,
    /// The reader's region (opened with `MAP`).
    pub(crate) dst_region: RegionId,
    /// Offset in the server's region.
    pub(crate) src_offset: u64,
    /// Offset in the reader's region.
    pub(crate) dst_offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

fn api_code(api: Option<GpuApi>) -> u8 {
    match api {
        None => 0,
        Some(GpuApi::Cuda) => 1,
        Some(GpuApi::Hip) => 2,
        Some(GpuApi::Emulated) => 3,
    }
}

fn header(kind: u8, tag: u64, body: usize, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(HEADER + body);
    out.extend_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out.extend_from_slice(&[kind, 0, 0, 0]);
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(&(body as u32).to_le_bytes());
}

/// Encodes a `MAP` frame (the handle is at most [`MAX_IPC_HANDLE`] bytes: the caller's export).
pub(crate) fn encode_map(tag: u64, m: &Map, out: &mut Vec<u8>) {
    debug_assert!(m.handle.len() <= MAX_IPC_HANDLE);
    header(KIND_MAP, tag, MAP_FIXED + m.handle.len(), out);
    out.extend_from_slice(&m.region.0.to_le_bytes());
    out.extend_from_slice(&[api_code(m.api), m.handle.len() as u8, 0, 0]);
    out.extend_from_slice(&m.offset.to_le_bytes());
    out.extend_from_slice(&m.len.to_le_bytes());
    out.extend_from_slice(&m.handle);
}

/// Encodes a `READ` frame for request `id` (validated by the caller).
pub(crate) fn encode_read(
    tag: u64,
    id: &str,
    entries: impl ExactSizeIterator<Item = Entry>,
    out: &mut Vec<u8>,
) {
    header(
        KIND_READ,
        tag,
        READ_FIXED + id.len() + entries.len() * ENTRY,
        out,
    );
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(id.as_bytes());
    for e in entries {
        out.extend_from_slice(&e.src_region.0.to_le_bytes());
        out.extend_from_slice(&e.dst_region.0.to_le_bytes());
        out.extend_from_slice(&e.src_offset.to_le_bytes());
        out.extend_from_slice(&e.dst_offset.to_le_bytes());
        out.extend_from_slice(&e.len.to_le_bytes());
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Parses a frame header: `(kind, tag, body_len)`. Refuses a bad magic, an unknown kind,
/// nonzero reserved bytes or a body over [`MAX_BODY`].
pub(crate) fn decode_header(h: &[u8; HEADER]) -> Result<(u8, u64, usize)> {
    if u32_at(h, 0) != REQUEST_MAGIC {
        return Err(Error::Protocol(format!(
            "bad local frame magic {:#x}",
            u32_at(h, 0)
        )));
    }
    let kind = h[4];
    if !matches!(kind, KIND_MAP | KIND_READ) || h[5..8] != [0, 0, 0] {
        return Err(Error::Protocol(format!("unknown local frame kind {kind}")));
    }
    let body = u32_at(h, 16);
    if body > MAX_BODY {
        return Err(Error::Protocol(format!(
            "local frame of {body} bytes (at most {MAX_BODY})"
        )));
    }
    Ok((kind, u64_at(h, 8), body as usize))
}

/// Parses a `MAP` body.
pub(crate) fn decode_map(b: &[u8]) -> Result<Map> {
    let bad = |m: &str| Err(Error::Protocol(format!("bad MAP frame: {m}")));
    if b.len() < MAP_FIXED {
        return bad("too short");
    }
    let api = match b[4] {
        0 => None,
        1 => Some(GpuApi::Cuda),
        2 => Some(GpuApi::Hip),
        3 => Some(GpuApi::Emulated),
        c => return bad(&format!("unknown memory kind {c}")),
    };
    let handle_len = usize::from(b[5]);
    if handle_len > MAX_IPC_HANDLE || b[6..8] != [0, 0] || b.len() != MAP_FIXED + handle_len {
        return bad("handle length does not match the frame");
    }
    let len = u64_at(b, 16);
    if len == 0 {
        return bad("an empty region");
    }
    Ok(Map {
        region: RegionId(u32_at(b, 0)),
        api,
        offset: u64_at(b, 8),
        len,
        handle: b[MAP_FIXED..].to_vec(),
    })
}

/// Parses a `READ` body: the request id and the entries (between 1 and [`MAX_ENTRIES`]).
pub(crate) fn decode_read(b: &[u8]) -> Result<(RequestId, Vec<Entry>)> {
    let bad = |m: String| Err(Error::Protocol(format!("bad READ frame: {m}")));
    if b.len() < READ_FIXED {
        return bad("too short".into());
    }
    let id_len = usize::from(u16::from_le_bytes([b[0], b[1]]));
    let count = u32_at(b, 4);
    if b[2..4] != [0, 0] || count == 0 || count > MAX_ENTRIES {
        return bad(format!("{count} entries (1 to {MAX_ENTRIES})"));
    }
    if b.len() != READ_FIXED + id_len + count as usize * ENTRY {
        return bad("length does not match its id and entries".into());
    }
    let id =
        crate::transport::stream::frame::decode_request_id(&b[READ_FIXED..READ_FIXED + id_len])?;
    let entries = b[READ_FIXED + id_len..]
        .chunks_exact(ENTRY)
        .map(|c| Entry {
            src_region: RegionId(u32_at(c, 0)),
            dst_region: RegionId(u32_at(c, 4)),
            src_offset: u64_at(c, 8),
            dst_offset: u64_at(c, 16),
            len: u64_at(c, 24),
        })
        .collect();
    Ok((id, entries))
}

/// Encodes a reply: done (`reason` `None`) or refused with a reason (cut to [`MAX_REASON`]).
pub(crate) fn encode_reply(tag: u64, reason: Option<&str>) -> Vec<u8> {
    let reason = reason.map(|r| {
        let mut end = r.len().min(MAX_REASON as usize);
        while !r.is_char_boundary(end) {
            end -= 1;
        }
        &r[..end]
    });
    let mut out = Vec::with_capacity(REPLY_HEADER + reason.map_or(0, str::len));
    out.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    out.push(u8::from(reason.is_some()));
    out.extend_from_slice(&(reason.map_or(0, str::len) as u32).to_le_bytes());
    out.extend_from_slice(reason.unwrap_or("").as_bytes());
    out
}

/// Parses a reply header: `(tag, refused, reason_len)`.
pub(crate) fn decode_reply_header(h: &[u8; REPLY_HEADER]) -> Result<(u64, bool, usize)> {
    if u32_at(h, 0) != REPLY_MAGIC {
        return Err(Error::Protocol(format!(
            "bad local reply magic {:#x}",
            u32_at(h, 0)
        )));
    }
    let reason = u32_at(h, 13);
    match h[12] {
        0 if reason == 0 => Ok((u64_at(h, 4), false, 0)),
        1 if reason <= MAX_REASON => Ok((u64_at(h, 4), true, reason as usize)),
        s => Err(Error::Protocol(format!(
            "bad local reply status {s} with a {reason}-byte reason"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_malformed_ones_are_refused() {
        let m = Map {
            region: RegionId(7),
            api: Some(GpuApi::Cuda),
            offset: 4096,
            len: 1 << 30,
            handle: vec![9; 64],
        };
        let mut buf = Vec::new();
        encode_map(3, &m, &mut buf);
        let h: [u8; HEADER] = buf[..HEADER].try_into().unwrap();
        assert_eq!(decode_header(&h).unwrap(), (KIND_MAP, 3, MAP_FIXED + 64));
        assert_eq!(decode_map(&buf[HEADER..]).unwrap(), m);
        let mut bad = buf[HEADER..].to_vec();
        bad[4] = 9;
        assert!(decode_map(&bad).is_err(), "unknown memory kind");
        assert!(
            decode_map(&buf[HEADER..buf.len() - 1]).is_err(),
            "short handle"
        );
        let mut empty = buf[HEADER..].to_vec();
        empty[16..24].fill(0);
        assert!(decode_map(&empty).is_err(), "empty region");

        let e = Entry {
            src_region: RegionId(1),
            dst_region: RegionId(2),
            src_offset: 3,
            dst_offset: 4,
            len: 5,
        };
        encode_read(11, "req-1", [e, e].into_iter(), &mut buf);
        let h: [u8; HEADER] = buf[..HEADER].try_into().unwrap();
        let (kind, tag, body) = decode_header(&h).unwrap();
        assert_eq!((kind, tag, body), (KIND_READ, 11, buf.len() - HEADER));
        let (id, got) = decode_read(&buf[HEADER..]).unwrap();
        assert_eq!((id.as_str(), got), ("req-1", vec![e, e]));
        assert!(
            decode_read(&buf[HEADER..buf.len() - 1]).is_err(),
            "truncated"
        );
        let mut zero = buf[HEADER..].to_vec();
        zero[4..8].fill(0);
        assert!(decode_read(&zero).is_err(), "no entries");

        let mut hh = h;
        hh[0] ^= 1;
        assert!(decode_header(&hh).is_err(), "magic");
        let mut hh = h;
        hh[4] = 5;
        assert!(decode_header(&hh).is_err(), "kind");
        let mut hh = h;
        hh[16..20].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        assert!(decode_header(&hh).is_err(), "oversized body");

        let r = encode_reply(5, Some("no hold"));
        let rh: [u8; REPLY_HEADER] = r[..REPLY_HEADER].try_into().unwrap();
        assert_eq!(decode_reply_header(&rh).unwrap(), (5, true, 7));
        assert_eq!(&r[REPLY_HEADER..], b"no hold");
        let ok = encode_reply(6, None);
        let rh: [u8; REPLY_HEADER] = ok[..].try_into().unwrap();
        assert_eq!(decode_reply_header(&rh).unwrap(), (6, false, 0));
        let mut rh = rh;
        rh[12] = 2;
        assert!(decode_reply_header(&rh).is_err());
    }
}
