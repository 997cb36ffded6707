//! The reader's side of the same-host transport: shares its destination regions with the
//! engine it reads from (once per region per session), then asks for copies in batches, several
//! in flight, and waits for each answer.
//!
//! The peer writes the reader's memory, so a request's control counts every batch in flight
//! ([`RequestCtl::remote_begin`]): a cancel or a deadline returns only once each was answered,
//! or the connection closed (the server closes it only once its copies ended).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;

use super::server::{send_all, MAX_INFLIGHT};
use super::views::{copy_here, Mapped, Shared as ShareAnswer, Views};
use super::wire;
use crate::auth::SessionSecret;
use crate::error::{Error, Result};
use crate::ids::{RegionId, RequestId};
use crate::shm;
use crate::transport::stream::frame::Extras;
use crate::transport::stream::{batch, proof};
use crate::transport::{
    bounded, ConfirmAsk, Confirmed, ReadDone, ReadFuture, ReadOp, RequestCtl, Transport, Waits,
};

/// What the server answered a frame.
enum Answer {
    /// Done (a `MAP`, a `READ` that asked for no confirmation).
    Done,
    /// A `READ`'s bytes are in place, with the confirmation it asked for.
    Confirmed(Confirmed),
    /// A `SHARE`: the read-only descriptor and the file's length.
    Shared(OwnedFd, u64),
}

/// Most descriptors a reader keeps waiting for their replies.
const MAX_SHARED_FDS: usize = 16;

/// An answer the reader waits for, and the request whose memory the copy writes.
struct Waiter {
    done: oneshot::Sender<Result<Answer>>,
    ctl: Option<Arc<RequestCtl>>,
}

struct Shared {
    peer: String,
    stream: Arc<UnixStream>,
    /// Held by whoever writes a frame: the writer task, or a read of one batch sending its
    /// frame itself.
    sending: Arc<tokio::sync::Mutex<()>>,
    pending: Mutex<HashMap<u64, Waiter>>,
    broken: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Shared {
    fn lost(&self) -> Error {
        Error::ConnectionLost {
            peer: self.peer.clone(),
            reason: self
                .reason
                .lock()
                .clone()
                .unwrap_or_else(|| "same-host connection closed".into()),
        }
    }

    /// A failure this side found while the socket is still open (a send that failed, an answer
    /// that made no sense): nothing more is sent, and the server, reading end of stream,
    /// finishes the copies it has and closes; the waiters hear it then (`fail_all`), since
    /// only the close says that nothing writes their memory any more.
    fn stop(&self, why: String) {
        self.reason.lock().get_or_insert(why);
        self.broken.store(true, Ordering::Release);
        let _ = shm::shutdown_write(self.stream.as_fd());
    }

    /// Takes a waiter back (a request that was never sent, or whose future was dropped
    /// before its frame reached the writer).
    fn forget(&self, tag: u64) {
        if let Some(w) = self.pending.lock().remove(&tag) {
            if let Some(ctl) = &w.ctl {
                ctl.remote_end();
            }
        }
    }

    /// The connection closed (the server closes only after its last copy): every waiter
    /// hears it, and every request it counted is told its copies ended.
    fn fail_all(&self, why: String) {
        self.reason.lock().get_or_insert(why);
        self.broken.store(true, Ordering::Release);
        let waiters: Vec<Waiter> = self.pending.lock().drain().map(|(_, w)| w).collect();
        for w in waiters {
            if let Some(ctl) = &w.ctl {
                ctl.remote_end();
            }
            let _ = w.done.send(Err(self.lost()));
        }
    }
}

/// A session's same-host data path.
pub(crate) struct LocalTransport {
    shared: Arc<Shared>,
    /// Frames for the writer task, which sends them whole, in order.
    frames: mpsc::Sender<Frame>,
    /// Regions this session shared with the peer already; one share at a time.
    mapped: tokio::sync::Mutex<HashSet<RegionId>>,
    next_tag: AtomicU64,
    batch_bytes: u64,
    io_timeout: Duration,
    tasks: [tokio::task::JoinHandle<()>; 2],
    /// The unkeyed control session every `READ` names (engines without a key).
    session: Option<[u8; 16]>,
    /// What this session mapped of the peer's memory, for copies this side makes itself.
    views: tokio::sync::Mutex<Views>,
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A frame and the descriptor that goes with it.
struct Frame {
    bytes: Vec<u8>,
    fd: Option<OwnedFd>,
}

/// Undoes a request's registration unless its frame reached the writer.
struct Registered<'a> {
    shared: &'a Shared,
    tag: u64,
    sent: bool,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if !self.sent {
            self.shared.forget(self.tag);
        }
    }
}

impl LocalTransport {
    /// Connects to the peer's same-host socket `name` (abstract namespace) and proves the
    /// session when the engines have a deployment key.
    pub(crate) async fn connect(
        name: &str,
        peer: &str,
        session: Option<&SessionSecret>,
        waits: Waits,
        batch_bytes: u64,
    ) -> Result<LocalTransport> {
        let Waits {
            connect: connect_timeout,
            io: io_timeout,
        } = waits;
        use std::os::linux::net::SocketAddrExt;
        let what = format!("connecting to the same-host socket of {peer}");
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(&what, &e))?;
        // Connecting to an abstract socket does not block: it is there or refused at once.
        let std = std::os::unix::net::UnixStream::connect_addr(&addr)
            .map_err(|e| Error::io(&what, &e))?;
        std.set_nonblocking(true)
            .map_err(|e| Error::io(&what, &e))?;
        let mut stream = UnixStream::from_std(std).map_err(|e| Error::io(&what, &e))?;
        if let Some(s) = session.filter(|s| s.is_keyed()) {
            proof::answer(&mut stream, s, peer, connect_timeout).await?;
        }
        let shared = Arc::new(Shared {
            peer: peer.to_string(),
            stream: Arc::new(stream),
            sending: Arc::new(tokio::sync::Mutex::new(())),
            pending: Mutex::new(HashMap::new()),
            broken: AtomicBool::new(false),
            reason: Mutex::new(None),
        });
        let (frames, rx) = mpsc::channel(2 * MAX_INFLIGHT + 2);
        let tasks = [
            tokio::spawn(replies(shared.clone(), io_timeout)),
            tokio::spawn(writer(shared.clone(), rx, io_timeout)),
        ];
        Ok(LocalTransport {
            shared,
            frames,
            mapped: tokio::sync::Mutex::new(HashSet::new()),
            next_tag: AtomicU64::new(1),
            batch_bytes: batch_bytes.max(1),
            io_timeout,
            tasks,
            session: session.filter(|s| !s.is_keyed()).map(|s| s.id),
            views: tokio::sync::Mutex::new(Views::default()),
        })
    }

    /// Hands a frame (with a descriptor) to the writer and returns the receiver of its answer.
    /// Cancel-safe: dropped before the writer took the frame, the request is forgotten.
    async fn request(
        &self,
        frame: impl FnOnce(u64) -> Vec<u8>,
        fd: Option<OwnedFd>,
        ctl: Option<&Arc<RequestCtl>>,
        direct: bool,
    ) -> Result<oneshot::Receiver<Result<Answer>>> {
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if let Some(c) = ctl {
            c.remote_begin();
        }
        self.shared.pending.lock().insert(
            tag,
            Waiter {
                done: tx,
                ctl: ctl.cloned(),
            },
        );
        let mut registered = Registered {
            shared: &self.shared,
            tag,
            sent: false,
        };
        if self.shared.broken.load(Ordering::Acquire) {
            return Err(self.shared.lost());
        }
        let bytes = frame(tag);
        let bytes = match fd {
            None if direct => match self.send_now(bytes) {
                Ok(()) => {
                    registered.sent = true;
                    return Ok(rx);
                }
                Err(back) => back,
            },
            _ => bytes,
        };
        self.frames
            .send(Frame { bytes, fd })
            .await
            .map_err(|_| self.shared.lost())?;
        registered.sent = true;
        Ok(rx)
    }

    /// Writes a frame without a descriptor from this thread when no other frame is being
    /// written; gives it back otherwise. Nothing in here waits, so a read dropped meanwhile
    /// never leaves half a frame on the socket: what the socket does not take at once is
    /// finished by a task of its own, which holds the sending side until then.
    fn send_now(&self, bytes: Vec<u8>) -> std::result::Result<(), Vec<u8>> {
        let Ok(guard) = self.shared.sending.clone().try_lock_owned() else {
            return Err(bytes);
        };
        let sent = match self.shared.stream.try_write(&bytes) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
            Err(e) => {
                // Its waiter hears of the close (`fail_all`).
                self.shared.stop(e.to_string());
                return Ok(());
            }
        };
        if sent < bytes.len() {
            let (shared, io) = (self.shared.clone(), self.io_timeout);
            tokio::spawn(async move {
                let r = send_all(&shared.stream, &bytes[sent..], None, io).await;
                drop(guard);
                if let Err(e) = r {
                    shared.stop(e.to_string());
                }
            });
        }
        Ok(())
    }

    /// The read, when this side can copy it itself (host destinations, every source shared,
    /// the hold in the peer's table); `None` when the peer must copy it.
    async fn try_copy_here(
        &self,
        id: &RequestId,
        ops: &[ReadOp],
        ctl: &Arc<RequestCtl>,
        confirm: Option<ConfirmAsk>,
    ) -> Result<Option<ReadDone>> {
        let Some(ask) = confirm.filter(|_| ops.iter().all(|o| !o.local.is_device())) else {
            return Ok(None);
        };
        match self.mapped_sources(ops).await? {
            Some(mapped) => copy_here(mapped, id, ask, ops, ctl).await,
            None => Ok(None),
        }
    }

    /// The peer's hold table and the source regions of `ops`, mapped read-only, and this
    /// reader's receipt page (asked for once per session each); `None` when the peer shares not
    /// all of them.
    async fn mapped_sources(&self, ops: &[ReadOp]) -> Result<Option<Mapped>> {
        let mut views = self.views.lock().await;
        if views.table_unknown() {
            let table = self.ask_share(wire::Share::Table).await?;
            let receipts = match table {
                Some(_) => self.ask_share(wire::Share::Receipts(self.session)).await?,
                None => None,
            };
            views.set_table(table, receipts);
        }
        for r in views.unknown_regions(ops) {
            let shared = self.ask_share(wire::Share::Region(r)).await?;
            views.set_region(r, shared);
        }
        Ok(views.of(ops))
    }

    /// Asks the peer to share its table or a region: the read-only descriptor and length, or
    /// `None` when it refuses (its reason logged).
    async fn ask_share(&self, what: wire::Share) -> Result<ShareAnswer> {
        let encode = |tag| {
            let mut b = Vec::new();
            wire::encode_share(tag, what, &mut b);
            b
        };
        let rx = self.request(encode, None, None, false).await?;
        match self.answer(rx).await {
            Ok(Answer::Shared(fd, len)) => Ok(Some((fd, len))),
            Ok(_) => Err(Error::Protocol(
                "a SHARE answered without a descriptor".into(),
            )),
            Err(Error::Refused { message, .. }) => {
                tracing::debug!(peer = %self.shared.peer, ?what, %message, "not shared: read through the peer's copy");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Shares `region`'s memory with the peer unless this session did already.
    async fn share(&self, region: &Arc<crate::memory::Region>) -> Result<()> {
        let mut mapped = self.mapped.lock().await;
        if mapped.contains(&region.id()) {
            return Ok(());
        }
        let export = region
            .export_local()
            .map_err(|why| Error::InvalidArgument(why.0))?;
        let m = wire::Map {
            region: region.id(),
            api: export.api,
            offset: export.offset,
            len: export.len,
            handle: export.handle,
        };
        let rx = self
            .request(
                |tag| {
                    let mut b = Vec::new();
                    wire::encode_map(tag, &m, &mut b);
                    b
                },
                export.fd,
                None,
                false,
            )
            .await?;
        self.answer(rx).await?;
        mapped.insert(region.id());
        Ok(())
    }

    async fn answer(&self, rx: oneshot::Receiver<Result<Answer>>) -> Result<Answer> {
        match timeout(self.io_timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(self.shared.lost()),
            Err(_) => Err(Error::Timeout {
                what: format!("waiting for the same-host copy from {}", self.shared.peer),
                after: self.io_timeout,
            }),
        }
    }

    async fn run(
        &self,
        id: &RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        confirm: Option<ConfirmAsk>,
    ) -> Result<ReadDone> {
        if self.is_broken() {
            return Err(self.shared.lost());
        }
        if let Some(done) = self.try_copy_here(id, &ops, &ctl, confirm).await? {
            return Ok(done);
        }
        let mut seen = HashSet::new();
        for op in &ops {
            if seen.insert(op.local.region().id()) {
                self.share(op.local.region()).await?;
            }
        }
        let batches = batch::batches(
            ops,
            |op| op.local.len(),
            self.batch_bytes,
            wire::MAX_ENTRIES as usize,
        );
        let n = batches.len();
        // A read of one batch is confirmed with its copy (no `Done` round trip after it).
        let extras = Extras::of_read(confirm, n, self.session);
        let mut inflight = std::collections::VecDeque::new();
        for ops in batches {
            if inflight.len() >= MAX_INFLIGHT {
                self.answer(inflight.pop_front().expect("in flight"))
                    .await?;
            }
            if ctl.is_cancelled() {
                return Err(Error::Cancelled(format!(
                    "reading from {}",
                    self.shared.peer
                )));
            }
            let entries = ops.iter().map(|op| wire::Entry {
                src_region: op.remote_region,
                dst_region: op.local.region().id(),
                src_offset: op.remote_offset,
                dst_offset: op.local.offset(),
                len: op.local.len(),
            });
            let rx = self
                .request(
                    |tag| {
                        let mut b = Vec::new();
                        wire::encode_read(tag, id.as_str(), &extras, entries, &mut b);
                        b
                    },
                    None,
                    Some(&ctl),
                    n == 1,
                )
                .await?;
            inflight.push_back(rx);
        }
        let mut confirmed = None;
        while let Some(rx) = inflight.pop_front() {
            if let Answer::Confirmed(c) = self.answer(rx).await? {
                confirmed = Some(c);
            }
        }
        Ok(ReadDone {
            work_requests: n as u64,
            confirmed,
            tell_received: false,
        })
    }
}

/// Sends frames whole, in order, until the transport is dropped or a send fails.
async fn writer(shared: Arc<Shared>, mut rx: mpsc::Receiver<Frame>, io: Duration) {
    while let Some(f) = rx.recv().await {
        if shared.broken.load(Ordering::Acquire) {
            // Its waiter hears of the close (`fail_all`).
            continue;
        }
        let _sending = shared.sending.lock().await;
        if let Err(e) = send_all(
            &shared.stream,
            &f.bytes,
            f.fd.as_ref().map(|f| f.as_fd()),
            io,
        )
        .await
        {
            // A frame cut in the middle leaves the stream unusable.
            shared.stop(e.to_string());
        }
    }
}

/// Reads answers until the connection closes, handing each to its waiter. An answer that makes
/// no sense stops the connection; what follows is read and dropped until the server closes
/// (at most `io` after), and only then do the waiters hear it.
// Long: the answer loop: parses answers, hands each to its waiter (with its descriptor), reads
//   more; its buffer, descriptor queue and stop deadline live across iterations.
async fn replies(shared: Arc<Shared>, io: Duration) {
    let stream = shared.stream.clone();
    let mut buf: Vec<u8> = Vec::new();
    // Descriptors that came with replies, in arrival order (each `SHARE` reply carries one).
    let mut fds: VecDeque<OwnedFd> = VecDeque::new();
    let mut stopped: Option<tokio::time::Instant> = None;
    let why = loop {
        if stopped.is_none() && buf.len() >= wire::REPLY_HEADER {
            let h: [u8; wire::REPLY_HEADER] = buf[..wire::REPLY_HEADER].try_into().expect("hdr");
            match wire::decode_reply_header(&h) {
                Err(e) => {
                    shared.stop(e.to_string());
                    stopped = Some(tokio::time::Instant::now() + io);
                    continue;
                }
                Ok((tag, status, n)) if buf.len() >= wire::REPLY_HEADER + n => {
                    let answer = wire::decode_reply(status, &buf[wire::REPLY_HEADER..][..n]);
                    buf.drain(..wire::REPLY_HEADER + n);
                    let Some(w) = shared.pending.lock().remove(&tag) else {
                        shared.stop(format!("an answer to unknown request tag {tag}"));
                        stopped = Some(tokio::time::Instant::now() + io);
                        continue;
                    };
                    let r = match answer {
                        wire::Reply::Refused(message) => Err(Error::Refused {
                            peer: shared.peer.clone(),
                            message,
                        }),
                        wire::Reply::Done => Ok(Answer::Done),
                        wire::Reply::Confirmed(c) => Ok(Answer::Confirmed(c)),
                        wire::Reply::Shared(len) => match fds.pop_front() {
                            Some(fd) => Ok(Answer::Shared(fd, len)),
                            None => Err(Error::Protocol(
                                "a shared file without its descriptor".into(),
                            )),
                        },
                    };
                    if let Some(ctl) = &w.ctl {
                        if r.is_ok() {
                            ctl.note_data();
                        }
                        ctl.remote_end();
                    }
                    let _ = w.done.send(r);
                    continue;
                }
                Ok(_) => {}
            }
        }
        if stopped.is_some() {
            buf.clear();
        }
        let readable = match stopped {
            Some(until) => match tokio::time::timeout_at(until, stream.readable()).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::error!(peer = %shared.peer, "the same-host server did not close its connection after it was stopped; its copies may still be running");
                    break "the same-host server did not close its connection".into();
                }
            },
            None => stream.readable().await,
        };
        if let Err(e) = readable {
            break e.to_string();
        }
        let start = buf.len();
        buf.resize(start + 4096, 0);
        let got = stream.try_io(tokio::io::Interest::READABLE, || {
            shm::recv_with_fd(stream.as_raw_fd(), &mut buf[start..])
        });
        match got {
            Ok((0, _)) => break "the peer closed the same-host connection".into(),
            Ok((n, got_fds)) => {
                buf.truncate(start + n);
                fds.extend(got_fds);
                // Descriptors nobody asked for are not kept: a server that sends them stops.
                if fds.len() > MAX_SHARED_FDS && stopped.is_none() {
                    shared.stop("the peer sent descriptors nobody asked for".into());
                    stopped = Some(tokio::time::Instant::now() + io);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => buf.truncate(start),
            Err(e) => break e.to_string(),
        }
    };
    shared.fail_all(why);
}

impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        "local"
    }

    fn read<'a>(
        &'a self,
        id: &'a RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        confirm: Option<ConfirmAsk>,
    ) -> ReadFuture<'a> {
        // On a deadline or a cancel, the copies the peer was asked for are waited out before
        // the request is reported (the request's control counts them); on another failure the
        // transfer does the same before it reports (`session::transfer`).
        Box::pin(async move {
            let run = self.run(id, ops, ctl.clone(), confirm);
            bounded(run, &ctl, deadline, self.io_timeout, &self.shared.peer).await
        })
    }

    fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Acquire)
    }

    fn names_reader(&self) -> bool {
        true
    }
}
