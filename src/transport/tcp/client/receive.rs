//! The reader task's half of a TCP stream: one response read off the socket, its data landed
//! straight in host memory (`readv`) or through staging buffers for device memory, and the
//! server's confirmation after it.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, Interest};
use tokio::net::tcp::OwnedReadHalf;
use tokio::time::timeout;

use super::super::wire;
use super::Batch;
use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::memory::{self, RegionSpan};
use crate::transport::stream::staging::{group, Group, Inbound};
use crate::transport::{Confirmed, RequestCtl};

/// Reads one response header of tag `expect_tag` and, for a status other than data, its body.
async fn response_head(
    rd: &mut OwnedReadHalf,
    expect_tag: u64,
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<(u8, u64, Vec<u8>)> {
    let mut head = [0u8; wire::RESPONSE_HEADER];
    let what = "waiting for a data response header";
    read_within(rd, &mut head, peer, io_timeout, what).await?;
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
    read_within(rd, &mut body, peer, io_timeout, "reading a response").await?;
    Ok((status, len, body))
}

/// Fills `buf` from the stream within `io_timeout`: a timeout or a lost connection names `what`.
async fn read_within(
    rd: &mut OwnedReadHalf,
    buf: &mut [u8],
    peer: SocketAddr,
    io_timeout: Duration,
    what: &str,
) -> Result<()> {
    timeout(io_timeout, rd.read_exact(buf))
        .await
        .map_err(|_| Error::Timeout {
            what: format!("{what} from {peer}"),
            after: io_timeout,
        })?
        .map_err(|e| lost(peer, what, &e))?;
    Ok(())
}

/// Reads the confirmation that follows the data of a request that asked for one.
async fn receive_confirmation(
    rd: &mut OwnedReadHalf,
    tag: u64,
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<Confirmed> {
    match response_head(rd, tag, peer, io_timeout).await? {
        (wire::STATUS_CONFIRMED, _, held) => {
            let us = u64::from_le_bytes(held[..8].try_into().expect("8 bytes"));
            Ok(Ok(Duration::from_micros(us)))
        }
        (wire::STATUS_UNCONFIRMED, _, why) => {
            let why = String::from_utf8_lossy(&why).into_owned();
            Ok(Err(Refusal::new(RefusalKind::Remote, why)))
        }
        (status, ..) => Err(Error::Protocol(format!(
            "response status {status} where a confirmation was due"
        ))),
    }
}

/// Reads one response (and the confirmation after it, when the batch asked for one). The outer
/// error breaks the stream; the inner one fails only the batch.
pub(super) async fn receive(
    rd: &mut OwnedReadHalf,
    batch: &Batch,
    expect_tag: u64,
    scratch: &mut [u8],
    inbound: &mut Inbound,
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<Result<Option<Confirmed>>> {
    let landed = receive_data(rd, batch, expect_tag, scratch, inbound, peer, io_timeout).await?;
    if landed.is_err() || !batch.extras.confirm {
        return Ok(landed.map(|()| None));
    }
    let c = receive_confirmation(rd, expect_tag, peer, io_timeout).await?;
    Ok(Ok(Some(c)))
}

/// Reads one data response into the batch's memory.
async fn receive_data(
    rd: &mut OwnedReadHalf,
    batch: &Batch,
    expect_tag: u64,
    scratch: &mut [u8],
    inbound: &mut Inbound,
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<Result<()>> {
    let (status, len, body) = response_head(rd, expect_tag, peer, io_timeout).await?;
    match status {
        wire::STATUS_OK => {}
        wire::STATUS_REFUSED => {
            return Ok(Err(Error::Refused {
                peer: peer.to_string(),
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
        return receive_staged(rd, batch, scratch, inbound, peer, io_timeout).await;
    }
    let spans: Vec<RegionSpan> = batch.ops.iter().map(|o| o.local.clone()).collect();
    read_into(rd, &spans, len, &batch.ctl, scratch, peer, io_timeout).await?;
    Ok(Ok(()))
}

fn lost(peer: SocketAddr, what: &str, e: &std::io::Error) -> Error {
    Error::ConnectionLost {
        peer: peer.to_string(),
        reason: format!("{what}: {e}"),
    }
}

/// Reads `len` bytes straight into host spans (`readv`), or into `scratch` once the request is
/// cancelled.
async fn read_into(
    rd: &mut OwnedReadHalf,
    spans: &[RegionSpan],
    len: u64,
    ctl: &RequestCtl,
    scratch: &mut [u8],
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<()> {
    let mut got = 0u64;
    while got < len {
        timeout(io_timeout, rd.readable())
            .await
            .map_err(|_| Error::Timeout {
                what: format!("receiving data from {peer} (stalled)"),
                after: io_timeout,
            })?
            .map_err(|e| lost(peer, "waiting for data", &e))?;
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
            Ok(0) => {
                return Err(Error::ConnectionLost {
                    peer: peer.to_string(),
                    reason: "the peer closed the data stream mid-response".into(),
                })
            }
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
    rd: &mut OwnedReadHalf,
    batch: &Batch,
    scratch: &mut [u8],
    inbound: &mut Inbound,
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<Result<()>> {
    inbound.failed = None;
    let mut armed = CancelOnDrop(Some(batch.ctl.clone()));
    let received = receive_pieces(rd, batch, scratch, inbound, peer, io_timeout).await;
    let drained = inbound.drain().await;
    armed.0 = None;
    if drained.is_err() {
        // A copy ran past io_timeout: stop the rest and wait (bounded) for that one before the
        // batch fails, without holding an async thread.
        batch.ctl.cancel_async(io_timeout).await;
    }
    received?;
    drained?;
    Ok(match inbound.failed.take() {
        Some(e) => Err(e),
        None => Ok(()),
    })
}

async fn receive_pieces(
    rd: &mut OwnedReadHalf,
    batch: &Batch,
    scratch: &mut [u8],
    inbound: &mut Inbound,
    peer: SocketAddr,
    io_timeout: Duration,
) -> Result<()> {
    let spans: Vec<RegionSpan> = batch.ops.iter().map(|o| o.local.clone()).collect();
    for g in group(&spans, inbound.chunk() as u64)? {
        match g {
            Group::Host(host) => {
                let n = host.iter().map(RegionSpan::len).sum();
                read_into(rd, &host, n, &batch.ctl, scratch, peer, io_timeout).await?;
            }
            Group::Device(pieces) => {
                let mut buf = inbound.buffer(&pieces[0]).await?;
                let n = pieces.iter().map(|p| p.len() as usize).sum();
                timeout(io_timeout, rd.read_exact(&mut buf.bytes_mut()[..n]))
                    .await
                    .map_err(|_| Error::Timeout {
                        what: format!("receiving data from {peer} (stalled)"),
                        after: io_timeout,
                    })?
                    .map_err(|e| lost(peer, "receiving data", &e))?;
                inbound.land(buf, pieces, batch.ctl.clone());
            }
        }
    }
    Ok(())
}
