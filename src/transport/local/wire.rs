//! Framing of the same-host transport's Unix socket (little-endian, fixed layout; see
//! docs/protocol.md). Pure: encoders, and decoders that refuse anything malformed.
//!
//! Reader to server: `magic u32 = "KVLQ"`, `kind u8`, three zero bytes, `tag u64`,
//! `body_len u32`, then the body.
//! - `MAP` (kind 1): `region u32`, `api u8` (0 host, 1 CUDA, 2 HIP, 3 emulated),
//!   `handle_len u8`, two zero bytes, `offset u64`, `len u64`, then the handle. The memfd (host
//!   memory, emulated device memory) travels as `SCM_RIGHTS` with the frame's first byte.
//! - `READ` (kind 2): `id_len u16`, `flags u16` (as TCP's), `count u32`, the request id, the
//!   hold token (`u64`) and session id (16 bytes) the flags announce, then `count` entries of
//!   `src_region u32, dst_region u32, src_offset u64, dst_offset u64, len u64`.
//!
//! - `SHARE` (kind 3): `what u8` (0 the hold table, 1 a region), three zero bytes, `region u32`:
//!   asks for a read-only descriptor of the server's hold table or of one of its host regions,
//!   for the reader to copy from itself.
//!
//! Server to reader: `magic u32 = "KVLS"`, `tag u64`, `status u8` (0 done, 1 refused, 2 done
//! and confirmed, 3 done but not confirmed, 4 shared), `reason_len u32`, then the UTF-8 reason
//! of a refusal or of status 3, for status 2 eight bytes: how long the request had been held,
//! in microseconds, and for status 4 eight bytes: the shared file's length, its read-only
//! descriptor travelling as `SCM_RIGHTS` with the reply's first byte.

use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::gpu::{GpuApi, MAX_IPC_HANDLE};
use crate::ids::{RegionId, RequestId};
use crate::transport::stream::frame::{Extras, FLAGS};
use crate::transport::Confirmed;

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
/// Longest body a frame may announce (the id's extras are at most 24 bytes).
pub(crate) const MAX_BODY: u32 =
    (READ_FIXED + crate::transport::stream::frame::MAX_ID + 24) as u32 + MAX_ENTRIES * ENTRY as u32;
/// Longest refusal reason.
pub(crate) const MAX_REASON: u32 = 64 << 10;
/// Frame kind: open a reader's region.
pub(crate) const KIND_MAP: u8 = 1;
/// Frame kind: copy granted bytes into opened regions.
pub(crate) const KIND_READ: u8 = 2;
/// Frame kind: share the hold table or a host region read-only, or the reader's receipt page.
pub(crate) const KIND_SHARE: u8 = 3;
/// `SHARE` body bytes: what (1), whether a session follows (1), zeros (2), the region (4), the
/// session (16).
pub(crate) const SHARE_BODY: usize = 24;

/// What a `SHARE` frame asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Share {
    /// The server's hold table.
    Table,
    /// One of the server's host regions.
    Region(RegionId),
    /// The reader's receipt page in the server's hold table (`crate::holds`), for the reader
    /// of the control session named (engines without a key) or the one the connection proved.
    Receipts(Option<[u8; 16]>),
}

/// Encodes a `SHARE` frame.
pub(crate) fn encode_share(tag: u64, what: Share, out: &mut Vec<u8>) {
    header(KIND_SHARE, tag, SHARE_BODY, out);
    let (code, region, session) = match what {
        Share::Table => (0u8, 0u32, None),
        Share::Region(r) => (1, r.0, None),
        Share::Receipts(s) => (2, 0, s),
    };
    out.extend_from_slice(&[code, u8::from(session.is_some()), 0, 0]);
    out.extend_from_slice(&region.to_le_bytes());
    out.extend_from_slice(&session.unwrap_or_default());
}

/// Parses a `SHARE` body.
pub(crate) fn decode_share(b: &[u8]) -> Result<Share> {
    if b.len() != SHARE_BODY || b[1] > 1 || b[2..4] != [0, 0] {
        return Err(Error::Protocol("bad SHARE frame".into()));
    }
    let session: Option<[u8; 16]> = (b[1] == 1).then(|| b[8..24].try_into().expect("16 bytes"));
    let bare = session.is_none() && b[8..24].iter().all(|x| *x == 0);
    match (b[0], u32_at(b, 4)) {
        (0, 0) if bare => Ok(Share::Table),
        (1, r) if bare => Ok(Share::Region(RegionId(r))),
        (2, 0) if session.is_some() || bare => Ok(Share::Receipts(session)),
        (c, _) if c > 2 => Err(Error::Protocol(format!("SHARE of unknown kind {c}"))),
        _ => Err(Error::Protocol("bad SHARE frame".into())),
    }
}

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
    extras: &Extras,
    entries: impl ExactSizeIterator<Item = Entry>,
    out: &mut Vec<u8>,
) {
    let flags = extras.flags();
    header(
        KIND_READ,
        tag,
        READ_FIXED + id.len() + Extras::len_of(flags) + entries.len() * ENTRY,
        out,
    );
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(id.as_bytes());
    extras.encode(out);
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
    if !matches!(kind, KIND_MAP | KIND_READ | KIND_SHARE) || h[5..8] != [0, 0, 0] {
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

/// A parsed `READ` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Read {
    /// The request whose held blocks it copies.
    pub(crate) id: RequestId,
    /// The hold token, session and confirmation it carries.
    pub(crate) extras: Extras,
    /// Its entries (1 to [`MAX_ENTRIES`]).
    pub(crate) entries: Vec<Entry>,
}

/// Parses a `READ` body: the request id, its extras and the entries (between 1 and
/// [`MAX_ENTRIES`]).
pub(crate) fn decode_read(b: &[u8]) -> Result<Read> {
    let bad = |m: String| Err(Error::Protocol(format!("bad READ frame: {m}")));
    if b.len() < READ_FIXED {
        return bad("too short".into());
    }
    let id_len = usize::from(u16::from_le_bytes([b[0], b[1]]));
    let flags = u16::from_le_bytes([b[2], b[3]]);
    let count = u32_at(b, 4);
    if flags & !FLAGS != 0 || count == 0 || count > MAX_ENTRIES {
        return bad(format!(
            "{count} entries (1 to {MAX_ENTRIES}), flags {flags:#x} (at most {FLAGS:#x})"
        ));
    }
    let extra = Extras::len_of(flags);
    if b.len() != READ_FIXED + id_len + extra + count as usize * ENTRY {
        return bad("length does not match its id and entries".into());
    }
    let id =
        crate::transport::stream::frame::decode_request_id(&b[READ_FIXED..READ_FIXED + id_len])?;
    let at = READ_FIXED + id_len;
    let extras = Extras::decode(flags, &b[at..at + extra]);
    let entries = b[at + extra..]
        .chunks_exact(ENTRY)
        .map(|c| Entry {
            src_region: RegionId(u32_at(c, 0)),
            dst_region: RegionId(u32_at(c, 4)),
            src_offset: u64_at(c, 8),
            dst_offset: u64_at(c, 16),
            len: u64_at(c, 24),
        })
        .collect();
    Ok(Read {
        id,
        extras,
        entries,
    })
}

/// What a reply says of its request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Done (a `MAP`, or a `READ` that asked for no confirmation).
    Done,
    /// Refused, with the reason.
    Refused(String),
    /// Done, with the confirmation the `READ` asked for.
    Confirmed(Confirmed),
    /// Shared: the file's length (its descriptor came with the reply).
    Shared(u64),
}

/// Status codes of [`Reply`].
const DONE: u8 = 0;
const REFUSED: u8 = 1;
const CONFIRMED: u8 = 2;
const UNCONFIRMED: u8 = 3;
const SHARED: u8 = 4;

/// Cuts `r` to at most [`MAX_REASON`] bytes, on a character boundary.
fn cut(r: &str) -> &str {
    let mut end = r.len().min(MAX_REASON as usize);
    while !r.is_char_boundary(end) {
        end -= 1;
    }
    &r[..end]
}

/// Encodes a reply (reasons cut to [`MAX_REASON`]).
pub(crate) fn encode_reply(tag: u64, reply: &Reply) -> Vec<u8> {
    let held;
    let shared;
    let (status, body): (u8, &[u8]) = match reply {
        Reply::Done => (DONE, &[]),
        Reply::Refused(r) => (REFUSED, cut(r).as_bytes()),
        Reply::Confirmed(Ok(d)) => {
            held = (d.as_micros() as u64).to_le_bytes();
            (CONFIRMED, &held)
        }
        Reply::Confirmed(Err(r)) => (UNCONFIRMED, cut(r.reason()).as_bytes()),
        Reply::Shared(len) => {
            shared = len.to_le_bytes();
            (SHARED, &shared)
        }
    };
    let mut out = Vec::with_capacity(REPLY_HEADER + body.len());
    out.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    out.push(status);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Parses a reply header: `(tag, status, body_len)`.
pub(crate) fn decode_reply_header(h: &[u8; REPLY_HEADER]) -> Result<(u64, u8, usize)> {
    if u32_at(h, 0) != REPLY_MAGIC {
        return Err(Error::Protocol(format!(
            "bad local reply magic {:#x}",
            u32_at(h, 0)
        )));
    }
    let len = u32_at(h, 13);
    let ok = match h[12] {
        DONE => len == 0,
        CONFIRMED | SHARED => len == 8,
        REFUSED | UNCONFIRMED => len <= MAX_REASON,
        _ => false,
    };
    if !ok {
        return Err(Error::Protocol(format!(
            "bad local reply status {} with a {len}-byte body",
            h[12]
        )));
    }
    Ok((u64_at(h, 4), h[12], len as usize))
}

/// Parses a reply's body for its status (checked by [`decode_reply_header`]).
pub(crate) fn decode_reply(status: u8, body: &[u8]) -> Reply {
    let text = || String::from_utf8_lossy(body).into_owned();
    match status {
        REFUSED => Reply::Refused(text()),
        CONFIRMED => Reply::Confirmed(Ok(std::time::Duration::from_micros(u64_at(body, 0)))),
        UNCONFIRMED => Reply::Confirmed(Err(Refusal::new(RefusalKind::Remote, text()))),
        SHARED => Reply::Shared(u64_at(body, 0)),
        _ => Reply::Done,
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
        let extras = Extras {
            confirm: true,
            hold: Some(3),
            session: Some([1; 16]),
        };
        encode_read(11, "req-1", &extras, [e, e].into_iter(), &mut buf);
        let h: [u8; HEADER] = buf[..HEADER].try_into().unwrap();
        let (kind, tag, body) = decode_header(&h).unwrap();
        assert_eq!((kind, tag, body), (KIND_READ, 11, buf.len() - HEADER));
        let r = decode_read(&buf[HEADER..]).unwrap();
        assert_eq!(
            (r.id.as_str(), r.extras, r.entries),
            ("req-1", extras, vec![e, e])
        );
        let mut flags = buf[HEADER..].to_vec();
        flags[2] |= 8;
        assert!(decode_read(&flags).is_err(), "unknown flags");
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
    }

    #[test]
    fn replies_round_trip_and_malformed_ones_are_refused() {
        for (tag, reply) in [
            (5, Reply::Refused("no hold".into())),
            (6, Reply::Done),
            (
                7,
                Reply::Confirmed(Ok(std::time::Duration::from_micros(42))),
            ),
            (
                8,
                Reply::Confirmed(Err(Refusal::new(RefusalKind::Remote, "hold ended"))),
            ),
            (9, Reply::Shared(1 << 20)),
        ] {
            let r = encode_reply(tag, &reply);
            let rh: [u8; REPLY_HEADER] = r[..REPLY_HEADER].try_into().unwrap();
            let (t, status, n) = decode_reply_header(&rh).unwrap();
            assert_eq!((t, n), (tag, r.len() - REPLY_HEADER));
            assert_eq!(decode_reply(status, &r[REPLY_HEADER..]), reply);
        }
        let ok = encode_reply(6, &Reply::Done);
        let mut rh: [u8; REPLY_HEADER] = ok[..].try_into().unwrap();
        rh[12] = 2;
        assert!(
            decode_reply_header(&rh).is_err(),
            "a confirmation without its 8 bytes"
        );
        rh[12] = 5;
        assert!(decode_reply_header(&rh).is_err());
        let mut share = Vec::new();
        for what in [
            Share::Table,
            Share::Region(RegionId(7)),
            Share::Receipts(None),
            Share::Receipts(Some([3; 16])),
        ] {
            encode_share(4, what, &mut share);
            let h: [u8; HEADER] = share[..HEADER].try_into().unwrap();
            assert_eq!(decode_header(&h).unwrap(), (KIND_SHARE, 4, SHARE_BODY));
            assert_eq!(decode_share(&share[HEADER..]).unwrap(), what);
        }
        share[HEADER] = 5;
        assert!(decode_share(&share[HEADER..]).is_err(), "unknown kind");
        share[HEADER] = 0;
        assert!(
            decode_share(&share[HEADER..]).is_err(),
            "a table share naming a session"
        );
    }
}
