//! The TCP data server: serves reads of exported registered ranges, and nothing else.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

use super::staging::{group, Group, Outbound, StagingPool};
use super::wire::{self, Entry};
use crate::auth::{self, SessionSecret};
use crate::error::{Error, Result};
use crate::ids::RegionId;
use crate::log_limit::{warn_limited, LogLimit};
use crate::memory::{self, Region, RegionSpan};

/// Refused data requests: one line per second, with the count.
static REFUSED: LogLimit = LogLimit::new(Duration::from_secs(1));

/// Where the data server finds exported regions.
pub(crate) trait RegionLookup: Send + Sync + 'static {
    /// The exported region with this id, if any.
    fn region(&self, id: RegionId) -> Option<Arc<Region>>;
    /// Whether data connections must prove an authenticated control session.
    fn auth_required(&self) -> bool;
    /// The authenticated control session with this id, while it lives.
    fn data_session(&self, id: &[u8; 16]) -> Option<SessionSecret>;
    /// A request was served (`Some(bytes)`) or refused (`None`).
    fn served(&self, bytes: Option<u64>);
    /// The staging buffers for device memory.
    fn staging(&self) -> &Arc<StagingPool>;
}

/// Accepts data connections until the task is dropped.
pub(crate) async fn serve(
    listener: TcpListener,
    regions: Arc<dyn RegionLookup>,
    io_timeout: Duration,
    idle_timeout: Duration,
) {
    // Peers can trigger these at will: one line per interval, with the count.
    static FULL: LogLimit = LogLimit::new(Duration::from_secs(10));
    static DROPPED: LogLimit = LogLimit::new(Duration::from_secs(1));
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    warn_limited!(FULL, %peer, "refusing a data connection: {MAX_CONNECTIONS} already open");
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let regions = regions.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match connection(stream, peer, regions, io_timeout, idle_timeout).await {
                        Ok(()) => tracing::debug!(%peer, "data connection closed"),
                        Err(e) => {
                            warn_limited!(DROPPED, %peer, error = %e, "data connection dropped")
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a data connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Most data connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 4096;

fn timed_out(what: &str, after: Duration) -> Error {
    Error::Timeout {
        what: what.into(),
        after,
    }
}

/// Resolves every entry to an exported span, or says which one is refused and why.
fn resolve(
    regions: &dyn RegionLookup,
    entries: impl Iterator<Item = Entry>,
) -> Result<(Vec<RegionSpan>, u64)> {
    let mut spans = Vec::new();
    let mut total = 0u64;
    for (i, e) in entries.enumerate() {
        let region = regions
            .region(e.region)
            .ok_or_else(|| Error::invalid(format!("entry {i}: {} is not exported", e.region)))?;
        let span = RegionSpan::new(region, e.offset, e.len)
            .map_err(|err| Error::invalid(format!("entry {i}: {err}")))?;
        total += e.len;
        if total > wire::MAX_REQUEST_BYTES {
            return Err(Error::invalid(format!(
                "request asks for more than {} bytes",
                wire::MAX_REQUEST_BYTES
            )));
        }
        spans.push(span);
    }
    Ok((spans, total))
}

async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    regions: Arc<dyn RegionLookup>,
    io_timeout: Duration,
    idle_timeout: Duration,
) -> Result<()> {
    if regions.auth_required() {
        // Nothing is served before the connection proves an authenticated control session.
        if let Err(e) = prove_session(&mut stream, &*regions, io_timeout).await {
            regions.served(None);
            return Err(e);
        }
    }
    let mut header = [0u8; wire::REQUEST_HEADER];
    let mut body = Vec::new();
    loop {
        // Idle between requests: readers keep streams open for later requests, so the first
        // byte may take long (bounded by `idle_timeout`; the reader reconnects after it); the
        // rest of a request must follow promptly.
        let n = match timeout(idle_timeout, stream.read(&mut header)).await {
            Err(_) => return Ok(()),
            Ok(r) => r.map_err(|e| Error::io("reading a data request", &e))?,
        };
        if n == 0 {
            return Ok(());
        }
        timeout(io_timeout, stream.read_exact(&mut header[n..]))
            .await
            .map_err(|_| timed_out("reading a data request header", io_timeout))?
            .map_err(|e| Error::io("reading a data request header", &e))?;
        let (tag, count) = wire::decode_request_header(&header)?;
        body.resize(count as usize * wire::ENTRY, 0);
        timeout(io_timeout, stream.read_exact(&mut body))
            .await
            .map_err(|_| timed_out("reading data request entries", io_timeout))?
            .map_err(|e| Error::io("reading data request entries", &e))?;

        match resolve(&*regions, wire::decode_entries(&body)) {
            Ok((spans, total)) => {
                let head = wire::encode_response_header(tag, wire::STATUS_OK, total);
                if spans.iter().any(RegionSpan::is_device) {
                    write_staged(&stream, &head, &spans, regions.staging(), io_timeout).await?;
                } else {
                    write_all(&stream, &head, &spans, io_timeout).await?;
                }
                regions.served(Some(total));
            }
            Err(e) => {
                regions.served(None);
                let reason = e.to_string();
                warn_limited!(REFUSED, %peer, tag, %reason, "refused a data request");
                let mut msg =
                    wire::encode_response_header(tag, wire::STATUS_REFUSED, reason.len() as u64)
                        .to_vec();
                msg.extend_from_slice(reason.as_bytes());
                write_all(&stream, &msg, &[], io_timeout).await?;
            }
        }
    }
}

/// Writes `head` then the spans' bytes straight from registered memory (`writev`, no copy).
async fn write_all(
    stream: &TcpStream,
    head: &[u8],
    spans: &[RegionSpan],
    io_timeout: Duration,
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
        match stream.try_io(Interest::WRITABLE, || memory::writev(fd, head, spans, done)) {
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
    io_timeout: Duration,
) -> Result<()> {
    write_all(stream, head, &[], io_timeout).await?;
    let mut out = Outbound::new(pool.clone(), io_timeout);
    for g in group(spans, pool.chunk() as u64)? {
        match g {
            Group::Host(host) => {
                flush(stream, &mut out, io_timeout).await?;
                write_all(stream, &[], &host, io_timeout).await?;
            }
            Group::Device(mut pieces) => loop {
                if out.is_full() {
                    send_next(stream, &mut out, io_timeout).await?;
                }
                match out.start(pieces).await? {
                    Ok(()) => break,
                    Err(back) => {
                        pieces = back;
                        send_next(stream, &mut out, io_timeout).await?;
                    }
                }
            },
        }
    }
    flush(stream, &mut out, io_timeout).await
}

async fn send_next(stream: &TcpStream, out: &mut Outbound, io_timeout: Duration) -> Result<()> {
    if let Some(filled) = out.next().await? {
        write_all(stream, filled.bytes(), &[], io_timeout).await?;
    }
    Ok(())
}

async fn flush(stream: &TcpStream, out: &mut Outbound, io_timeout: Duration) -> Result<()> {
    while !out.is_empty() {
        send_next(stream, out, io_timeout).await?;
    }
    Ok(())
}

/// How long a new data connection has to prove its session.
const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// The data server's side of the session proof: sends a fresh nonce, expects the session id and
/// the session's proof over the nonce (`wire::AUTH_REPLY` bytes) within a few seconds.
async fn prove_session(
    stream: &mut TcpStream,
    regions: &dyn RegionLookup,
    io_timeout: Duration,
) -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let deadline = PROOF_DEADLINE.min(io_timeout);
    let nonce = auth::nonce()?;
    timeout(deadline, stream.write_all(&nonce))
        .await
        .map_err(|_| timed_out("sending the session challenge", deadline))?
        .map_err(|e| Error::io("sending the session challenge", &e))?;
    let mut reply = [0u8; wire::AUTH_REPLY];
    timeout(deadline, stream.read_exact(&mut reply))
        .await
        .map_err(|_| timed_out("waiting for the session proof", deadline))?
        .map_err(|e| Error::io("reading the session proof", &e))?;
    let (id, proof) = reply.split_at(16);
    let id: [u8; 16] = id.try_into().expect("16 bytes");
    match regions.data_session(&id) {
        Some(s) if s.verify_data(&nonce, proof) => Ok(()),
        _ => Err(Error::Protocol(
            "data connection without a valid session proof".into(),
        )),
    }
}
