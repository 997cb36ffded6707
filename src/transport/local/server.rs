//! The same-host server: opens the regions a reader shares (`MAP`) and copies granted bytes of
//! this engine's regions into them (`READ`), with the TCP data server's checks: the
//! connection proves an authenticated control session first, every source range must be
//! exported and inside the request's grant, every destination inside what the reader mapped.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;
use tokio::time::timeout;

use super::wire::{self, Entry};
use crate::accept::serve_admitted;
use crate::error::{Error, Result};
use crate::gpu::GpuApi;
use crate::grant::Grant;
use crate::holds::TABLE_BYTES as HOLD_TABLE_BYTES;
use crate::ids::RequestId;
use crate::log_limit::{warn_limited, LogLimit};
use crate::memory::{PeerMemory, RegionSpan};
use crate::shm;
use crate::transport::stream::access::{
    authorize, confirmation, reader_of, still_granted, DataServer, Exports, SessionReader, Source,
};
use crate::transport::stream::{proof, ServeLimits};

/// Most regions one connection may open.
const MAX_MAPS: usize = 64;
/// Most bytes one connection may map (address space, not memory: the pages are the reader's).
const MAX_MAP_BYTES: u64 = 1 << 40;
/// Most copies one connection runs at once (more requests wait in the socket).
pub(crate) const MAX_INFLIGHT: usize = 4;
/// Copies of at most this many bytes run on the connection's own task: a hop to a blocking
/// thread and back costs more than the copy (about 20 us of memcpy on these machines, well
/// inside what a runtime worker may spend between awaits).
const INLINE_COPY_BYTES: u64 = 256 << 10;
/// Most connections at once.
const MAX_CONNECTIONS: usize = 64;

static REFUSED: LogLimit = LogLimit::new(Duration::from_secs(1));
static DROPPED: LogLimit = LogLimit::new(Duration::from_secs(1));

/// Accepts same-host connections until the task is dropped.
pub(crate) async fn serve(
    listener: UnixListener,
    regions: Arc<dyn DataServer>,
    limits: ServeLimits,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let admit = |_: &_| match slots.clone().try_acquire_owned() {
        Ok(permit) => Some(permit),
        Err(_) => {
            warn_limited!(
                DROPPED,
                "refusing a same-host connection: {MAX_CONNECTIONS} open"
            );
            None
        }
    };
    serve_admitted(listener, "same-host", admit, |stream: UnixStream, _| {
        let regions = regions.clone();
        async move {
            let pid = stream.peer_cred().ok().and_then(|c| c.pid());
            match connection(stream, regions, limits).await {
                Ok(()) => tracing::debug!(?pid, "same-host connection closed"),
                Err(e) => warn_limited!(DROPPED, ?pid, error = %e, "same-host connection dropped"),
            }
        }
    })
    .await
}

/// Bytes (and descriptors) arriving on a connection, parsed into frames. Cancel-safe: what
/// arrived stays here between calls.
struct Incoming {
    buf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
}

/// One frame: kind, tag, body.
type Frame = (u8, u64, Vec<u8>);

impl Incoming {
    fn parse(&mut self) -> Result<Option<Frame>> {
        if self.buf.len() < wire::HEADER {
            return Ok(None);
        }
        let h: [u8; wire::HEADER] = self.buf[..wire::HEADER].try_into().expect("header");
        let (kind, tag, body) = wire::decode_header(&h)?;
        if self.buf.len() < wire::HEADER + body {
            return Ok(None);
        }
        let frame = self.buf[wire::HEADER..wire::HEADER + body].to_vec();
        self.buf.drain(..wire::HEADER + body);
        Ok(Some((kind, tag, frame)))
    }

    /// The next frame; `None` at end of stream or after `idle` without one starting. A frame
    /// that started must complete within `io`.
    async fn next(
        &mut self,
        s: &UnixStream,
        idle: Duration,
        io: Duration,
    ) -> Result<Option<Frame>> {
        const PIECE: usize = 64 << 10;
        loop {
            if let Some(f) = self.parse()? {
                return Ok(Some(f));
            }
            let wait = if self.buf.is_empty() { idle } else { io };
            match timeout(wait, s.readable()).await {
                Err(_) if self.buf.is_empty() => return Ok(None),
                Err(_) => {
                    return Err(Error::Timeout {
                        what: "reading a same-host frame".into(),
                        after: io,
                    })
                }
                Ok(r) => r.map_err(|e| Error::io("reading a same-host frame", &e))?,
            }
            // The buffer grows by what arrived, never ahead of it.
            let start = self.buf.len();
            self.buf.resize(start + PIECE, 0);
            let got = s.try_io(Interest::READABLE, || {
                shm::recv_with_fd(s.as_raw_fd(), &mut self.buf[start..])
            });
            match got {
                Ok((0, _)) => {
                    self.buf.truncate(start);
                    return if start == 0 {
                        Ok(None)
                    } else {
                        Err(Error::Protocol("same-host frame cut short".into()))
                    };
                }
                Ok((n, fds)) => {
                    self.buf.truncate(start + n);
                    self.fds.extend(fds);
                    if self.fds.len() > 2 {
                        return Err(Error::Protocol(
                            "descriptors sent without MAP frames to use them".into(),
                        ));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.buf.truncate(start),
                Err(e) => return Err(Error::io("reading a same-host frame", &e)),
            }
        }
    }
}

/// Writes all of `data` within `io`.
pub(crate) async fn send_all(
    s: &UnixStream,
    mut data: &[u8],
    mut fd: Option<std::os::fd::BorrowedFd<'_>>,
    io: Duration,
) -> Result<()> {
    let what = "writing to a same-host connection";
    timeout(io, async {
        while !data.is_empty() {
            s.writable().await.map_err(|e| Error::io(what, &e))?;
            match s.try_io(Interest::WRITABLE, || {
                shm::send_with_fd(s.as_raw_fd(), data, fd)
            }) {
                Ok(n) => {
                    data = &data[n..];
                    fd = None;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(Error::io(what, &e)),
            }
        }
        Ok(())
    })
    .await
    .map_err(|_| Error::Timeout {
        what: what.into(),
        after: io,
    })?
}

/// A granted copy, checked and ready to run on a blocking thread.
struct Copy {
    pieces: Vec<(RegionSpan, Arc<PeerMemory>, u64)>,
    grant: Option<Arc<Grant>>,
    /// The request to confirm once the bytes are copied, when the `READ` asked.
    confirm: Option<ToConfirm>,
}

/// What a `READ` that asked for a confirmation names.
struct ToConfirm {
    id: RequestId,
    hold: Option<u64>,
    reader: Option<SessionReader>,
}

/// A copy that ran: its bytes, and what to confirm now that they are in place.
struct Served {
    bytes: u64,
    grant: Option<Arc<Grant>>,
    confirm: Option<ToConfirm>,
}

impl Copy {
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|(src, _, _)| src.len()).sum()
    }

    /// Copies the pieces, consecutive pieces into one region together, checking before each
    /// run of them that the request's hold has not ended.
    fn run(self) -> Result<Served> {
        let mut total = 0;
        let mut run: Vec<(u64, RegionSpan)> = Vec::new();
        let mut pieces = self.pieces.into_iter().peekable();
        while let Some((src, dst, at)) = pieces.next() {
            total += src.len();
            run.push((at, src));
            let same_next = pieces.peek().is_some_and(|(_, d, _)| Arc::ptr_eq(d, &dst));
            if !same_next {
                still_granted(self.grant.as_deref())?;
                dst.write_many(&run)?;
                run.clear();
            }
        }
        Ok(Served {
            bytes: total,
            grant: self.grant,
            confirm: self.confirm,
        })
    }
}

// Long: one connection's loop: the proof, then frames and finished copies in one select; its
//   opened maps, copies in flight and received descriptors live across iterations.
async fn connection(
    mut stream: UnixStream,
    regions: Arc<dyn DataServer>,
    limits: ServeLimits,
) -> Result<()> {
    let mut proven: Option<SessionReader> = None;
    if regions.auth_required() {
        // Nothing is opened or copied before the connection proves an authenticated session.
        match proof::challenge(&mut stream, &*regions, limits.io_timeout).await {
            Ok(r) => proven = Some(r),
            Err(e) => {
                regions.served(None);
                return Err(e);
            }
        }
    }
    // Every copy holds the socket open: the reader takes its close to mean that nothing
    // writes its memory any more, even when this task is dropped (the engine closing).
    let stream = Arc::new(stream);
    let mut incoming = Incoming {
        buf: Vec::new(),
        fds: VecDeque::new(),
    };
    let mut maps: HashMap<u32, Arc<PeerMemory>> = HashMap::new();
    let mut copies: JoinSet<(u64, Result<Served>)> = JoinSet::new();
    // A process of this engine's own user could read its memory anyway (`process_vm_readv`):
    // only such a reader is shared it read-only.
    let same_user = stream.peer_cred().is_ok_and(|c| c.uid() == shm::own_uid());
    let ended = loop {
        tokio::select! {
            Some(done) = copies.join_next(), if !copies.is_empty() => {
                let (tag, r) = done.unwrap_or_else(|e| (0, Err(Error::Protocol(format!("copy task: {e}")))));
                if let Err(e) = reply(&stream, &*regions, tag, r.map(Some), limits.io_timeout).await {
                    break Err(e);
                }
            }
            f = incoming.next(&stream, limits.idle_timeout, limits.io_timeout), if copies.len() < MAX_INFLIGHT => {
                let (kind, tag, body) = match f {
                    Ok(Some(f)) => f,
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e),
                };
                if kind == wire::KIND_SHARE {
                    let shared = share(&*regions, same_user, proven.as_ref(), &body);
                    if let Err(e) = reply_share(&stream, &*regions, tag, shared, limits.io_timeout).await {
                        break Err(e);
                    }
                    continue;
                }
                let r = match kind {
                    wire::KIND_MAP => {
                        open(&*regions, &mut maps, &mut incoming.fds, &body).map(|()| None)
                    }
                    _ => match prepare(&*regions, proven.as_ref(), &maps, &body) {
                        Ok(copy) if copy.bytes() <= INLINE_COPY_BYTES => copy.run().map(Some),
                        Ok(copy) => {
                            let open = stream.clone();
                            copies.spawn_blocking(move || {
                                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                                    || copy.run(),
                                ))
                                .unwrap_or_else(|_| {
                                    Err(Error::Protocol("the copy panicked".into()))
                                });
                                drop(open);
                                (tag, r)
                            });
                            continue;
                        }
                        Err(e) => Err(e),
                    },
                };
                if let Err(e) = reply(&stream, &*regions, tag, r, limits.io_timeout).await {
                    break Err(e);
                }
            }
        }
    };
    // The socket closes only once no copy writes into the reader's memory: the reader counts on
    // it (a closed connection tells it its request's memory is its own again).
    while let Some(done) = copies.join_next().await {
        if ended.is_ok() {
            if let Ok((tag, r)) = done {
                let _ = reply(&stream, &*regions, tag, r.map(Some), limits.io_timeout).await;
            }
        }
    }
    ended
}

/// Answers a frame: done (confirmed or not, when a `READ` asked), or refused with the reason
/// (the connection goes on; only I/O errors end it). `Ok(Some(..))` is a served copy,
/// `Ok(None)` an opened region.
async fn reply(
    s: &UnixStream,
    regions: &dyn Exports,
    tag: u64,
    r: Result<Option<Served>>,
    io: Duration,
) -> Result<()> {
    let msg = match &r {
        Ok(served) => {
            let mut answer = wire::Reply::Done;
            if let Some(served) = served {
                regions.served(Some(served.bytes));
                if let Some(c) = &served.confirm {
                    // Every byte is in the reader's memory: the hold is checked after the copy.
                    let grant = served.grant.as_deref();
                    let ok = confirmation(regions, c.reader.as_ref(), &c.id, c.hold, grant);
                    answer = wire::Reply::Confirmed(ok);
                }
            }
            wire::encode_reply(tag, &answer)
        }
        Err(e) => {
            regions.served(None);
            let reason = e.to_string();
            warn_limited!(REFUSED, tag, %reason, "refused a same-host request");
            wire::encode_reply(tag, &wire::Reply::Refused(reason))
        }
    };
    send_all(s, &msg, None, io).await
}

/// The descriptor and length a `SHARE` asks for: this engine's hold table or one of its host
/// regions kvlink allocated (a memfd), read-only; or the reader's own receipt page in the hold
/// table, writable (by that reader only: the one its session names). Refused for a reader of
/// another user, device memory and memory registered from a caller's pointer (their reads keep
/// this side's copy).
fn share(
    regions: &dyn DataServer,
    same_user: bool,
    proven: Option<&SessionReader>,
    body: &[u8],
) -> Result<(OwnedFd, u64)> {
    if !same_user {
        return Err(Error::invalid(
            "the reader runs as another user: it is served by this engine's copy",
        ));
    }
    let table = || {
        regions
            .hold_table()
            .ok_or_else(|| Error::invalid("this engine has no hold table"))
    };
    let (fd, len) = match wire::decode_share(body)? {
        wire::Share::Table => {
            let table = table()?;
            let fd = table
                .map()
                .fd()
                .ok_or_else(|| Error::invalid("no table file"))?;
            (shm::readonly_fd(fd), HOLD_TABLE_BYTES as u64)
        }
        wire::Share::Receipts(named) => {
            let Some((_, reader)) = reader_of(regions, proven, named.as_ref())? else {
                return Err(Error::invalid(
                    "receipts are for the reader of a session; this share names none",
                ));
            };
            let page = table()?.receipts_for(&reader);
            return page.map_err(|e| Error::io("making the reader's receipt page", &e));
        }
        wire::Share::Region(id) => {
            let region = regions.region(id).ok_or(Error::UnknownRegion(id))?;
            if region.is_device() {
                return Err(Error::invalid(format!(
                    "{id} is device memory: it is served by this engine's copy"
                )));
            }
            let export = region
                .export_local()
                .map_err(|why| Error::InvalidArgument(why.0))?;
            let fd = export
                .fd
                .ok_or_else(|| Error::invalid(format!("{id} has no memory file to share")))?;
            (shm::readonly_fd(fd.as_fd()), export.len)
        }
    };
    let fd = fd.map_err(|e| Error::io("opening a read-only descriptor to share", &e))?;
    Ok((fd, len))
}

/// Answers a `SHARE`: the length, with the descriptor attached, or the refusal.
async fn reply_share(
    s: &UnixStream,
    regions: &dyn Exports,
    tag: u64,
    shared: Result<(OwnedFd, u64)>,
    io: Duration,
) -> Result<()> {
    match shared {
        Ok((fd, len)) => {
            let msg = wire::encode_reply(tag, &wire::Reply::Shared(len));
            send_all(s, &msg, Some(fd.as_fd()), io).await
        }
        Err(e) => reply(s, regions, tag, Err(e), io).await,
    }
}

/// Opens a region the reader shares.
fn open(
    regions: &dyn DataServer,
    maps: &mut HashMap<u32, Arc<PeerMemory>>,
    fds: &mut VecDeque<OwnedFd>,
    body: &[u8],
) -> Result<()> {
    let m = wire::decode_map(body)?;
    // Host and emulated device memory come with a memfd (descriptors arrive in frame order);
    // CUDA and HIP handles with none.
    let fd = match m.api {
        None | Some(GpuApi::Emulated) => fds.pop_front(),
        Some(_) => None,
    };
    if maps.len() >= MAX_MAPS && !maps.contains_key(&m.region.0) {
        return Err(Error::invalid(format!(
            "more than {MAX_MAPS} regions opened on one connection"
        )));
    }
    let mapped: u64 = maps
        .iter()
        .filter(|(r, _)| **r != m.region.0)
        .map(|(_, p)| p.len())
        .sum();
    if mapped.saturating_add(m.len) > MAX_MAP_BYTES {
        return Err(Error::invalid(format!(
            "more than {MAX_MAP_BYTES} bytes opened on one connection"
        )));
    }
    let mem = match m.api {
        None => {
            let fd = fd.ok_or_else(|| Error::invalid("a host region comes with its memfd"))?;
            if m.offset != 0 {
                return Err(Error::invalid("a host region starts at its memfd's start"));
            }
            PeerMemory::open_host(fd, m.len)
        }
        Some(api) => {
            let (rt, ordinal) = regions.device_runtime(api).ok_or_else(|| {
                Error::invalid(format!(
                    "this engine has no {api} runtime to open the reader's device memory"
                ))
            })?;
            PeerMemory::open_device(rt, ordinal, &m.handle, fd, m.offset, m.len)
        }
    }
    .map_err(|why| Error::invalid(format!("opening the reader's {}: {why}", m.region)))?;
    maps.insert(m.region.0, Arc::new(mem));
    Ok(())
}

/// Checks a `READ`: the grant, every source range (exported, granted), every destination range
/// (inside an opened region).
fn prepare(
    regions: &dyn Exports,
    proven: Option<&SessionReader>,
    maps: &HashMap<u32, Arc<PeerMemory>>,
    body: &[u8],
) -> Result<Copy> {
    let wire::Read {
        id,
        extras,
        entries,
    } = wire::decode_read(body)?;
    let session = reader_of(regions, proven, extras.session.as_ref())?;
    let reader = session.as_ref().map(|s| &*s.1);
    let sources = entries.iter().map(|e: &Entry| Source {
        region: e.src_region,
        offset: e.src_offset,
        len: e.len,
    });
    let mut authorized = authorize(regions, &id, reader, sources)?;
    let spans = std::mem::take(&mut authorized.spans);
    let mut pieces = Vec::with_capacity(spans.len());
    for (i, (span, e)) in spans.into_iter().zip(&entries).enumerate() {
        let dst = maps.get(&e.dst_region.0).ok_or_else(|| {
            Error::invalid(format!(
                "entry {i}: the reader's {} is not opened",
                e.dst_region
            ))
        })?;
        if e.dst_offset
            .checked_add(e.len)
            .is_none_or(|end| end > dst.len())
        {
            return Err(Error::invalid(format!(
                "entry {i}: {} bytes at {} run past the reader's {}",
                e.len, e.dst_offset, e.dst_region
            )));
        }
        pieces.push((span, dst.clone(), e.dst_offset));
    }
    // Only a read that passed every check, its destinations too, claims the request.
    authorized.claim(regions, &id, reader);
    let confirm = extras.confirm.then_some(ToConfirm {
        id,
        hold: extras.hold,
        reader: session,
    });
    Ok(Copy {
        pieces,
        grant: authorized.grant,
        confirm,
    })
}
