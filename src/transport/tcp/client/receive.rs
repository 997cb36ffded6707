//! The reader task's half of a TCP stream: one response read off the socket, its data landed
//! straight in host memory (`readv`) or through staging buffers for device memory, and the
//! server's confirmation after it. A stream reads ahead into a small buffer of its own
//! ([`ReadAhead`]): a small response's header, data and confirmation come in one receive.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::tcp::OwnedReadHalf;
use tokio::time::timeout;

use super::super::ahead::{Fill, ReadAhead, AHEAD};
use super::super::wire;
use super::Batch;
use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::memory::{self, RegionSpan};
use crate::transport::stream::staging::{group, Group, Inbound};
use crate::transport::{Confirmed, RequestCtl};

/// The reader's waits on its read-ahead, with its errors.
impl ReadAhead {
    /// Reads what the socket has, at least one byte, into the (empty) buffer, waiting up to
    /// `io_timeout` for it.
    async fn fill(
        &mut self,
        rd: &OwnedReadHalf,
        peer: SocketAddr,
        io_timeout: Duration,
    ) -> Result<()> {
        let stalled = || Error::Timeout {
            what: format!("receiving data from {peer} (stalled)"),
            after: io_timeout,
        };
        match timeout(io_timeout, self.fill_from(rd.as_ref())).await {
            Err(_) => Err(stalled()),
            Ok(Ok(Fill::Closed)) => Err(closed_mid_response(peer)),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(lost(peer, "receiving data", &e)),
        }
    }

    /// Fills `out`: from the buffer first, then the socket (through the buffer for a few
    /// bytes, straight into `out` for many).
    async fn read_exact(
        &mut self,
        rd: &OwnedReadHalf,
        out: &mut [u8],
        peer: SocketAddr,
        io_timeout: Duration,
        what: &str,
    ) -> Result<()> {
        let mut got = self.take_into(out);
        while got < out.len() {
            if out.len() - got >= AHEAD / 2 {
                return read_within(rd, &mut out[got..], peer, io_timeout, what).await;
            }
            self.fill(rd, peer, io_timeout).await?;
            got += self.take_into(&mut out[got..]);
        }
        Ok(())
    }
}

/// Waits up to `io_timeout` for the stream to be readable.
async fn readable_within(rd: &OwnedReadHalf, peer: SocketAddr, io_timeout: Duration) -> Result<()> {
    timeout(io_timeout, rd.readable())
        .await
        .map_err(|_| Error::Timeout {
            what: format!("receiving data from {peer} (stalled)"),
            after: io_timeout,
        })?
        .map_err(|e| lost(peer, "waiting for data", &e))
}

fn closed_mid_response(peer: SocketAddr) -> Error {
    Error::ConnectionLost {
        peer: peer.to_string(),
        reason: "the peer closed the data stream mid-response".into(),
    }
}

/// A stream's socket with what it read ahead, and the limits of its waits.
pub(super) struct Rx<'a> {
    pub(super) rd: &'a OwnedReadHalf,
    pub(super) ahead: &'a mut ReadAhead,
    pub(super) peer: SocketAddr,
    pub(super) io_timeout: Duration,
}

impl Rx<'_> {
    async fn read_exact(&mut self, out: &mut [u8], what: &str) -> Result<()> {
        self.ahead
            .read_exact(self.rd, out, self.peer, self.io_timeout, what)
            .await
    }
}

/// Reads one response header of tag `expect_tag` and, for a status other than data, its body.
async fn response_head(rx: &mut Rx<'_>, expect_tag: u64) -> Result<(u8, u64, Vec<u8>)> {
    let mut head = [0u8; wire::RESPONSE_HEADER];
    rx.read_exact(&mut head, "waiting for a data response header")
        .await?;
    let (tag, status, len) = wire::decode_response_header(&head)?;
    if tag != expect_tag {
        return Err(Error::Protocol(format!(
            "response tag {tag}, expected {expect_tag}"
        )));
    }
    if status == wire::STATUS_OK {
        return Ok((status, len, Vec::new()));
    }
    // A refusal or a confirmation: bounded by the header's checks (64 KiB).
    let mut body = vec![0u8; len as usize];
    rx.read_exact(&mut body, "reading a response").await?;
    Ok((status, len, body))
}

/// Fills `buf` from the stream, waiting up to `io_timeout` each time it has nothing: a stall or
/// a lost connection names `what`.
async fn read_within(
    rd: &OwnedReadHalf,
    buf: &mut [u8],
    peer: SocketAddr,
    io_timeout: Duration,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        timeout(io_timeout, rd.readable())
            .await
            .map_err(|_| Error::Timeout {
                what: format!("{what} from {peer}"),
                after: io_timeout,
            })?
            .map_err(|e| lost(peer, what, &e))?;
        match rd.try_read(&mut buf[got..]) {
            Ok(0) => return Err(closed_mid_response(peer)),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(lost(peer, what, &e)),
        }
    }
    Ok(())
}

/// Reads the confirmation that follows the data of a request that asked for one.
async fn receive_confirmation(rx: &mut Rx<'_>, tag: u64) -> Result<Confirmed> {
    let (status, _, body) = response_head(rx, tag).await?;
    confirmation(status, &body).ok_or_else(|| {
        Error::Protocol(format!(
            "response status {status} where a confirmation was due"
        ))
    })
}

/// A confirmation's verdict from its status and body (a `STATUS_CONFIRMED` body is 8 bytes,
/// checked with its header); `None` for a status that is not a confirmation's.
pub(super) fn confirmation(status: u8, body: &[u8]) -> Option<Confirmed> {
    match status {
        wire::STATUS_CONFIRMED => {
            let us = u64::from_le_bytes(body.get(..8)?.try_into().ok()?);
            Some(Ok(Duration::from_micros(us)))
        }
        wire::STATUS_UNCONFIRMED => {
            let why = String::from_utf8_lossy(body).into_owned();
            Some(Err(Refusal::new(RefusalKind::Remote, why)))
        }
        _ => None,
    }
}

/// One response header at the start of `buf`, when `buf` holds a whole one of tag `tag`.
pub(super) fn buffered_head(buf: &[u8], tag: u64) -> Option<(u8, usize)> {
    let head: &[u8; wire::RESPONSE_HEADER] = buf.get(..wire::RESPONSE_HEADER)?.try_into().ok()?;
    match wire::decode_response_header(head) {
        Ok((t, status, len)) if t == tag => Some((status, usize::try_from(len).ok()?)),
        _ => None,
    }
}

/// Reads one response (and the confirmation after it, when the batch asked for one). The outer
/// error breaks the stream; the inner one fails only the batch.
pub(super) async fn receive(
    rx: &mut Rx<'_>,
    batch: &Batch,
    expect_tag: u64,
    scratch: &mut [u8],
    inbound: &mut Inbound,
) -> Result<Result<Option<Confirmed>>> {
    let landed = receive_data(rx, batch, expect_tag, scratch, inbound).await?;
    if landed.is_err() || !batch.extras.confirm {
        return Ok(landed.map(|()| None));
    }
    let c = receive_confirmation(rx, expect_tag).await?;
    Ok(Ok(Some(c)))
}

/// Finishes a response a waiting read began (`super::here`): the rest of its data from byte
/// `got` (its header read), then the confirmation when the batch asked for one. Errors as
/// [`receive`]'s.
pub(super) async fn resume(
    rx: &mut Rx<'_>,
    batch: &Batch,
    got: u64,
    tag: u64,
    scratch: &mut [u8],
) -> Result<Result<Option<Confirmed>>> {
    if got < batch.bytes {
        let spans: Vec<RegionSpan> = batch.ops.iter().map(|o| o.local.clone()).collect();
        land(rx, &spans, (got, batch.bytes), &batch.ctl, scratch).await?;
    }
    if !batch.extras.confirm {
        return Ok(Ok(None));
    }
    Ok(Ok(Some(receive_confirmation(rx, tag).await?)))
}

/// Reads one data response into the batch's memory.
async fn receive_data(
    rx: &mut Rx<'_>,
    batch: &Batch,
    expect_tag: u64,
    scratch: &mut [u8],
    inbound: &mut Inbound,
) -> Result<Result<()>> {
    let (status, len, body) = response_head(rx, expect_tag).await?;
    match status {
        wire::STATUS_OK => {}
        wire::STATUS_REFUSED => {
            return Ok(Err(Error::Refused {
                peer: rx.peer.to_string(),
                message: String::from_utf8_lossy(&body).into_owned(),
            }))
        }
        s => {
            return Err(Error::Protocol(format!(
                "response status {s} where data was due"
            )))
        }
    }
    if len != batch.bytes {
        return Err(Error::Protocol(format!(
            "response of {len} bytes to a request of {}",
            batch.bytes
        )));
    }
    if batch.ops.iter().any(|o| o.local.is_device()) {
        return receive_staged(rx, batch, scratch, inbound).await;
    }
    let spans: Vec<RegionSpan> = batch.ops.iter().map(|o| o.local.clone()).collect();
    land(rx, &spans, (0, len), &batch.ctl, scratch).await?;
    Ok(Ok(()))
}

/// Lands bytes `got..len` of the stream's response in host spans: what was read ahead and,
/// for a few bytes more, through the buffer; straight into place (`readv`) for many. Into
/// nothing once the request is cancelled.
async fn land(
    rx: &mut Rx<'_>,
    spans: &[RegionSpan],
    (mut got, len): (u64, u64),
    ctl: &RequestCtl,
    scratch: &mut [u8],
) -> Result<()> {
    loop {
        let n = (rx.ahead.buffered().len() as u64).min(len - got);
        if n > 0 {
            let bytes = &rx.ahead.buffered()[..n as usize];
            ctl.guarded(|| copy_into(spans, got, bytes), || Ok(()))?;
            rx.ahead.consume(n as usize);
            got += n;
        }
        if got == len {
            return Ok(());
        }
        if len - got >= (AHEAD / 2) as u64 {
            return read_into(rx, spans, got, len, ctl, scratch).await;
        }
        rx.ahead.fill(rx.rd, rx.peer, rx.io_timeout).await?;
    }
}

/// Copies `bytes` into the spans' concatenation, from its byte `skip` on.
pub(super) fn copy_into(spans: &[RegionSpan], mut skip: u64, mut bytes: &[u8]) -> Result<()> {
    for span in spans {
        if bytes.is_empty() {
            break;
        }
        if skip >= span.len() {
            skip -= span.len();
            continue;
        }
        let n = ((span.len() - skip) as usize).min(bytes.len());
        span.region().write_at(span.offset() + skip, &bytes[..n])?;
        bytes = &bytes[n..];
        skip = 0;
    }
    Ok(())
}

fn lost(peer: SocketAddr, what: &str, e: &std::io::Error) -> Error {
    Error::ConnectionLost {
        peer: peer.to_string(),
        reason: format!("{what}: {e}"),
    }
}

/// Reads the spans' bytes from `got` to `len` straight into them (`readv`), or into `scratch`
/// once the request is cancelled. Nothing may be read ahead.
async fn read_into(
    rx: &mut Rx<'_>,
    spans: &[RegionSpan],
    mut got: u64,
    len: u64,
    ctl: &RequestCtl,
    scratch: &mut [u8],
) -> Result<()> {
    debug_assert!(rx.ahead.is_empty());
    let (rd, peer) = (rx.rd, rx.peer);
    while got < len {
        readable_within(rd, peer, rx.io_timeout).await?;
        let stream: &tokio::net::TcpStream = rd.as_ref();
        let res = ctl.guarded(
            || {
                stream.try_io(Interest::READABLE, || {
                    memory::readv(stream.as_raw_fd(), spans, got)
                })
            },
            || {
                let want = ((len - got) as usize).min(scratch.len());
                rd.try_read(&mut scratch[..want])
            },
        );
        match res {
            Ok(0) => return Err(closed_mid_response(peer)),
            Ok(n) => got += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(lost(peer, "receiving data", &e)),
        }
    }
    Ok(())
}

/// Cancels a request if dropped armed: a reader task aborted mid-response must not leave device
/// copies landing in the request's memory after the request has failed. Queued copies discard
/// at once; the one in progress is waited out on a blocking thread (the session's own
/// `cancel_async` waits for it before reporting the failure).
struct CancelOnDrop(Option<Arc<RequestCtl>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(ctl) = self.0.take() {
            ctl.mark_cancelled();
            match tokio::runtime::Handle::try_current() {
                Ok(h) => drop(h.spawn_blocking(move || ctl.cancel())),
                Err(_) => ctl.cancel(),
            }
        }
    }
}

/// Receives a response with device spans among its destinations: host spans are read straight
/// into place, device spans through staging buffers whose copies to the GPU overlap receiving
/// the next chunk. Returns only once every copy has finished.
async fn receive_staged(
    rx: &mut Rx<'_>,
    batch: &Batch,
    scratch: &mut [u8],
    inbound: &mut Inbound,
) -> Result<Result<()>> {
    inbound.failed = None;
    let mut armed = CancelOnDrop(Some(batch.ctl.clone()));
    let received = receive_pieces(rx, batch, scratch, inbound).await;
    let drained = inbound.drain().await;
    armed.0 = None;
    if drained.is_err() {
        // A copy ran past io_timeout: stop the rest and wait (bounded) for that one before the
        // batch fails, without holding an async thread.
        batch.ctl.cancel_async(rx.io_timeout).await;
    }
    received?;
    drained?;
    Ok(match inbound.failed.take() {
        Some(e) => Err(e),
        None => Ok(()),
    })
}

async fn receive_pieces(
    rx: &mut Rx<'_>,
    batch: &Batch,
    scratch: &mut [u8],
    inbound: &mut Inbound,
) -> Result<()> {
    let spans: Vec<RegionSpan> = batch.ops.iter().map(|o| o.local.clone()).collect();
    for g in group(&spans, inbound.chunk() as u64)? {
        match g {
            Group::Host(host) => {
                let n = host.iter().map(RegionSpan::len).sum();
                land(rx, &host, (0, n), &batch.ctl, scratch).await?;
            }
            Group::Device(pieces) => {
                let mut buf = inbound.buffer(&pieces[0]).await?;
                let n = pieces.iter().map(|p| p.len() as usize).sum();
                rx.read_exact(&mut buf.bytes_mut()[..n], "receiving data")
                    .await?;
                inbound.land(buf, pieces, batch.ctl.clone());
            }
        }
    }
    Ok(())
}
