//! The TCP data server: serves reads of exported registered ranges, and nothing else (what a
//! reader may read is decided in `transport::stream::access`).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

use super::wire;
use crate::accept::serve_tcp;
use crate::conn_limit::ConnLimit;
use crate::error::{Error, Refusal, Result};
use crate::grant::Grant;
use crate::log_limit::{warn_limited, LogLimit};
use crate::memory::{self, RegionSpan};
use crate::transport::stream::access::{
    authorize, confirmation, reader_of, still_granted, Authorized, DataServer, SessionReader,
    Source,
};
use crate::transport::stream::staging::{group, Group, Outbound, StagingPool};
use crate::transport::stream::{proof, ServeLimits};
use requests::Requests;

mod requests;

/// Refused data requests: one line per second, with the count.
static REFUSED: LogLimit = LogLimit::new(Duration::from_secs(1));

/// Accepts data connections until the task is dropped, each admitted by `slots` (at most
/// [`MAX_CONNECTIONS`](crate::conn_limit::MAX_CONNECTIONS) at once, a share per address).
pub(crate) async fn serve(
    listener: TcpListener,
    regions: Arc<dyn DataServer>,
    limits: ServeLimits,
    slots: Arc<ConnLimit>,
) {
    // Peers can trigger these at will: one line per interval, with the count.
    static FULL: LogLimit = LogLimit::new(Duration::from_secs(10));
    static DROPPED: LogLimit = LogLimit::new(Duration::from_secs(1));
    serve_tcp(listener, "data", slots, &FULL, |stream, peer| {
        let regions = regions.clone();
        async move {
            match connection(stream, peer, regions, limits).await {
                Ok(()) => tracing::debug!(%peer, "data connection closed"),
                Err(e) => warn_limited!(DROPPED, %peer, error = %e, "data connection dropped"),
            }
        }
    })
    .await
}

fn timed_out(what: &str, after: Duration) -> Error {
    Error::Timeout {
        what: what.into(),
        after,
    }
}

// Long: one data connection's request loop: proof, header, id, entries, authorization, then the
//   reply; the buffers are reused across requests.
async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    regions: Arc<dyn DataServer>,
    limits: ServeLimits,
) -> Result<()> {
    let ServeLimits {
        io_timeout,
        idle_timeout,
        spin,
    } = limits;
    // The session the connection proved (engines with a key), and the reader it declared.
    let mut proven: Option<SessionReader> = None;
    if regions.auth_required() {
        // Nothing is served before the connection proves an authenticated control session.
        match proof::challenge(&mut stream, &*regions, io_timeout).await {
            Ok(p) => proven = Some(p),
            Err(e) => {
                regions.served(None);
                return Err(e);
            }
        }
    }
    // Requests are read through a buffer: a small request (header, id, entries) costs one
    // receive, not one per part. Writes go to the socket directly.
    let stream = &stream;
    let mut requests = Requests::new(stream);
    let mut header = [0u8; wire::REQUEST_HEADER];
    let mut id = Vec::with_capacity(wire::MAX_ID);
    let mut body = Vec::new();
    loop {
        // Idle between requests: readers keep streams open for later requests, so the first
        // byte may take long (bounded by `idle_timeout`; the reader reconnects after it); the
        // rest of a request must follow promptly.
        if !requests.next(spin, idle_timeout).await? {
            return Ok(());
        }
        let what = "reading a data request header";
        requests.read_exact(&mut header, io_timeout, what).await?;
        let head = wire::decode_request_header(&header)?;
        let (tag, count) = (head.tag, head.count);
        // The id, then the hold token and session id the flags announce (at most 24 bytes).
        id.resize(head.id_len + wire::Extras::len_of(head.flags), 0);
        let what = "reading a data request id";
        requests.read_exact(&mut id, io_timeout, what).await?;
        let request = wire::decode_request_id(&id[..head.id_len])?;
        let extras = wire::Extras::decode(head.flags, &id[head.id_len..]);
        // Entries are read in pieces as they arrive: the buffer grows with the bytes the peer
        // sent, never ahead of them.
        read_entries(
            &mut requests,
            &mut body,
            count as usize * wire::ENTRY,
            io_timeout,
        )
        .await?;

        let sources = wire::decode_entries(&body).map(Source::from);
        let reader = reader_of(&*regions, proven.as_ref(), extras.session.as_ref());
        let engine = reader.as_ref().ok().and_then(|r| r.as_ref()).map(|r| &*r.1);
        let authorized = reader
            .clone()
            .and_then(|_| authorize(&*regions, &request, engine, sources));
        match authorized {
            Ok(authorized) => {
                // Every check passed: the read claims the request for its engine.
                authorized.claim(&*regions, &request, engine);
                let Authorized {
                    grant,
                    spans,
                    total,
                } = authorized;
                let live = grant.as_deref();
                let head = wire::encode_response_header(tag, wire::STATUS_OK, total);
                // With a confirmation to follow, the data's last segment waits for it, so
                // that both reach the reader together (one wake-up there, not two).
                let more = extras.confirm;
                if spans.iter().any(RegionSpan::is_device) {
                    let pool = regions.staging();
                    write_staged(stream, &head, &spans, pool, live, io_timeout, more).await?;
                } else {
                    write_all(stream, &head, &spans, live, io_timeout, more).await?;
                }
                regions.served(Some(total));
                if extras.confirm {
                    // Every byte is in the socket: the hold is checked after the copy.
                    let reader = reader.as_ref().ok().and_then(Option::as_ref);
                    let c = confirmation(&*regions, reader, &request, extras.hold, live);
                    write_confirmation(stream, tag, c, io_timeout).await?;
                }
            }
            Err(e) => {
                regions.served(None);
                // What the reader is told, as every refusal of a read reads.
                let reason = Error::from(e).to_string();
                warn_limited!(REFUSED, %peer, tag, %reason, "refused a data request");
                let mut msg =
                    wire::encode_response_header(tag, wire::STATUS_REFUSED, reason.len() as u64)
                        .to_vec();
                msg.extend_from_slice(reason.as_bytes());
                write_all(stream, &msg, &[], None, io_timeout, false).await?;
            }
        }
    }
}

/// Writes the confirmation a request asked for after its data: confirmed with how long the
/// request had been held, or not, with the reason.
async fn write_confirmation(
    stream: &TcpStream,
    tag: u64,
    c: std::result::Result<Duration, Refusal>,
    io_timeout: Duration,
) -> Result<()> {
    let (status, body) = match c {
        Ok(held) => (
            wire::STATUS_CONFIRMED,
            (held.as_micros() as u64).to_le_bytes().to_vec(),
        ),
        Err(why) => {
            let mut why = why.into_reason().into_bytes();
            why.truncate(wire::MAX_REASON as usize);
            (wire::STATUS_UNCONFIRMED, why)
        }
    };
    let mut msg = wire::encode_response_header(tag, status, body.len() as u64).to_vec();
    msg.extend_from_slice(&body);
    write_all(stream, &msg, &[], None, io_timeout, false).await
}

/// Reads `len` bytes of request entries into `body` (cleared first), growing it only as bytes
/// arrive, so a peer that announces many entries and sends few costs what it sent.
async fn read_entries(
    requests: &mut Requests<'_>,
    body: &mut Vec<u8>,
    len: usize,
    io_timeout: Duration,
) -> Result<()> {
    const PIECE: usize = 16 << 10;
    body.clear();
    while body.len() < len {
        let start = body.len();
        let n = PIECE.min(len - start);
        body.resize(start + n, 0);
        let what = "reading data request entries";
        requests
            .read_exact(&mut body[start..], io_timeout, what)
            .await?;
    }
    Ok(())
}

/// Writes `head` then the spans' bytes straight from registered memory (`sendmsg`, no copy),
/// checking before every write that `live` (the request's grant, if any) has not ended. With
/// `more`, the last partial segment waits for the next write (`memory::writev`).
async fn write_all(
    stream: &TcpStream,
    head: &[u8],
    spans: &[RegionSpan],
    live: Option<&Grant>,
    io_timeout: Duration,
    more: bool,
) -> Result<()> {
    let fd = stream.as_raw_fd();
    let total = head.len() as u64 + spans.iter().map(RegionSpan::len).sum::<u64>();
    let mut done = 0u64;
    while done < total {
        timeout(io_timeout, stream.writable())
            .await
            .map_err(|_| {
                timed_out(
                    "writing a data response (the reader stopped reading)",
                    io_timeout,
                )
            })?
            .map_err(|e| Error::io("writing a data response", &e))?;
        still_granted(live)?;
        match stream.try_io(Interest::WRITABLE, || {
            memory::writev(fd, head, spans, done, more)
        }) {
            Ok(0) => return Err(Error::Protocol("data stream closed while writing".into())),
            Ok(n) => done += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(Error::io("writing a data response", &e)),
        }
    }
    Ok(())
}

/// Writes `head` then the spans' bytes: host spans straight from registered memory, device spans
/// through staging buffers, chunk by chunk, the next chunk's copy overlapping this one's send.
async fn write_staged(
    stream: &TcpStream,
    head: &[u8],
    spans: &[RegionSpan],
    pool: &Arc<StagingPool>,
    live: Option<&Grant>,
    io_timeout: Duration,
    more: bool,
) -> Result<()> {
    write_all(stream, head, &[], None, io_timeout, more).await?;
    let mut out = Outbound::new(pool.clone(), io_timeout);
    for g in group(spans, pool.chunk() as u64)? {
        match g {
            Group::Host(host) => {
                flush(stream, &mut out, io_timeout, more).await?;
                write_all(stream, &[], &host, live, io_timeout, more).await?;
            }
            Group::Device(mut pieces) => loop {
                // Checked before each copy out of the request's device memory.
                still_granted(live)?;
                if out.is_full() {
                    send_next(stream, &mut out, io_timeout, more).await?;
                }
                match out.start(pieces).await? {
                    Ok(()) => break,
                    Err(back) => {
                        pieces = back;
                        send_next(stream, &mut out, io_timeout, more).await?;
                    }
                }
            },
        }
    }
    flush(stream, &mut out, io_timeout, more).await
}

async fn send_next(
    stream: &TcpStream,
    out: &mut Outbound,
    io_timeout: Duration,
    more: bool,
) -> Result<()> {
    if let Some(filled) = out.next().await? {
        write_all(stream, filled.bytes(), &[], None, io_timeout, more).await?;
    }
    Ok(())
}

async fn flush(
    stream: &TcpStream,
    out: &mut Outbound,
    io_timeout: Duration,
    more: bool,
) -> Result<()> {
    while !out.is_empty() {
        send_next(stream, out, io_timeout, more).await?;
    }
    Ok(())
}

impl From<wire::Entry> for Source {
    fn from(e: wire::Entry) -> Self {
        Source {
            region: e.region,
            offset: e.offset,
            len: e.len,
        }
    }
}
