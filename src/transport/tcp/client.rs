//! The reader's side of the TCP transport: several streams to one peer, each with a writer task
//! that pipelines requests and a reader task that lands responses in registered memory.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::timeout;

mod here;
mod pending;
mod receive;

use super::ahead::{Fill, ReadAhead};
use super::wire::{self, Entry, Extras};
use crate::auth::SessionSecret;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::transport::stream::staging::{Inbound, StagingPool};
use crate::transport::stream::{batch, proof};
use crate::transport::{
    bounded, ConfirmAsk, Confirmed, ReadDone, ReadFuture, ReadOp, RequestCtl, Transport, Waits,
};
use here::{RecvSide, RecvState};
use pending::Pending;

/// Requests in flight per stream (bounds memory and queueing towards a slow peer).
const PIPELINE: usize = 16;

/// A batch's end: its bytes in place, with the server's confirmation when it asked for one.
type Done = mpsc::Sender<Result<Option<Confirmed>>>;

struct Batch {
    /// The request whose held blocks the batch reads.
    id: RequestId,
    /// The hold token, session and confirmation its request carries.
    extras: Extras,
    ops: Vec<ReadOp>,
    bytes: u64,
    ctl: Arc<RequestCtl>,
    done: Done,
}

impl Batch {
    fn finish(self, r: Result<Option<Confirmed>>) {
        let _ = self.done.try_send(r);
    }
}

/// Why a stream died, shared by its tasks and the transport.
#[derive(Default)]
struct Health {
    broken: AtomicBool,
    reason: Mutex<Option<Error>>,
}

impl Health {
    fn fail(&self, e: Error) {
        let mut r = self.reason.lock();
        if r.is_none() {
            *r = Some(e);
        }
        self.broken.store(true, Ordering::Release);
    }
}

struct Stream {
    /// Batches for the stream's writer task.
    tx: mpsc::Sender<Batch>,
    /// The sending side, for a read of one batch to send its request itself.
    send: Arc<tokio::sync::Mutex<SendSide>>,
    /// The receiving side, for a read of one batch to receive its response itself.
    recv: Arc<RecvSide>,
    tasks: [JoinHandle<()>; 2],
}

/// A stream's sending side: whoever holds it sends the next request (the stream's writer task,
/// or a read of one batch on its own task, without a hand-off to the writer).
struct SendSide {
    wr: OwnedWriteHalf,
    /// The last request's tag.
    tag: u64,
    /// The request being encoded.
    buf: Vec<u8>,
    /// The stream's reader task learns each batch here before its request goes out.
    pending: Arc<Pending>,
}

impl SendSide {
    /// Encodes `batch`'s request under the next tag.
    fn encode(&mut self, batch: &Batch) {
        self.tag += 1;
        wire::encode_request(
            self.tag,
            batch.id.as_str(),
            &batch.extras,
            batch.ops.iter().map(|o| Entry {
                region: o.remote_region,
                offset: o.remote_offset,
                len: o.local.len(),
            }),
            &mut self.buf,
        );
    }
}

/// How a stream's sending failed, for its health.
fn send_failed(
    peer: SocketAddr,
    io_timeout: Duration,
    r: std::result::Result<std::io::Result<()>, tokio::time::error::Elapsed>,
) -> Option<Error> {
    match r {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(Error::io(format!("sending a read request to {peer}"), &e)),
        Err(_) => Some(Error::Timeout {
            what: format!("sending a read request to {peer} (it stopped reading)"),
            after: io_timeout,
        }),
    }
}

impl Stream {
    /// Sends `batch`'s request from this thread when the sending side is free and the reader
    /// task can take the batch at once; gives the batch back otherwise. Nothing in here waits,
    /// so a read dropped meanwhile (cancelled) never leaves half a request on the wire: what
    /// the socket does not take at once is finished by a task of its own, still holding the
    /// sending side.
    fn send_now(
        &self,
        batch: Batch,
        health: &Arc<Health>,
        peer: SocketAddr,
        io_timeout: Duration,
    ) -> std::result::Result<(), Batch> {
        let Ok(mut side) = self.send.clone().try_lock_owned() else {
            return Err(batch);
        };
        side.encode(&batch);
        if let Err(batch) = side.pending.try_push(batch) {
            side.tag -= 1;
            return Err(batch);
        }
        let sent = match side.wr.try_write(&side.buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
            Err(e) => {
                health.fail(Error::io(format!("sending a read request to {peer}"), &e));
                return Ok(());
            }
        };
        if sent < side.buf.len() {
            let health = health.clone();
            tokio::spawn(async move {
                let side = &mut *side;
                let r = timeout(io_timeout, side.wr.write_all(&side.buf[sent..])).await;
                if let Some(e) = send_failed(peer, io_timeout, r) {
                    health.fail(e);
                }
            });
        }
        Ok(())
    }
}

/// TCP data path to one peer.
pub(crate) struct TcpTransport {
    peer: SocketAddr,
    streams: Vec<Stream>,
    next: AtomicUsize,
    health: Arc<Health>,
    batch_bytes: u64,
    io_timeout: Duration,
    /// The unkeyed control session every request names (engines without a key).
    session: Option<[u8; 16]>,
    /// How long a read of one batch waits for its response on its own thread.
    spin: Duration,
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for s in &self.streams {
            for t in &s.tasks {
                t.abort();
            }
        }
    }
}

impl TcpTransport {
    /// Opens `streams` connections to the peer's data server.
    pub(crate) async fn connect(
        peer: SocketAddr,
        streams: usize,
        waits: Waits,
        batch_bytes: u64,
        staging: Arc<StagingPool>,
        session: Option<&SessionSecret>,
    ) -> Result<TcpTransport> {
        let Waits {
            connect: connect_timeout,
            io: io_timeout,
        } = waits;
        let health = Arc::new(Health::default());
        let mut out = Vec::with_capacity(streams);
        for _ in 0..streams.max(1) {
            let s = timeout(connect_timeout, TcpStream::connect(peer))
                .await
                .map_err(|_| Error::Timeout {
                    what: format!("connecting to the data server {peer}"),
                    after: connect_timeout,
                })?
                .map_err(|e| Error::io(format!("connecting to the data server {peer}"), &e))?;
            let _ = s.set_nodelay(true);
            let mut s = s;
            if let Some(session) = session.filter(|s| s.is_keyed()) {
                proof::answer(&mut s, session, peer, connect_timeout).await?;
            }
            let (rd, wr) = s.into_split();
            let (tx, rx) = mpsc::channel::<Batch>(PIPELINE);
            let pending = Arc::new(Pending::new());
            let send = Arc::new(tokio::sync::Mutex::new(SendSide {
                wr,
                tag: 0,
                buf: Vec::new(),
                pending: pending.clone(),
            }));
            let recv = Arc::new(RecvSide {
                rd,
                state: tokio::sync::Mutex::new(RecvState {
                    ahead: ReadAhead::new(),
                    tag: 0,
                    resume: None,
                }),
                kick: tokio::sync::Notify::new(),
                pending,
            });
            let w = tokio::spawn(writer(send.clone(), rx, health.clone(), peer, io_timeout));
            let r = tokio::spawn(reader(
                recv.clone(),
                health.clone(),
                peer,
                io_timeout,
                staging.clone(),
            ));
            out.push(Stream {
                tx,
                send,
                recv,
                tasks: [w, r],
            });
        }
        Ok(TcpTransport {
            peer,
            streams: out,
            next: AtomicUsize::new(0),
            health,
            batch_bytes: batch_bytes.max(1),
            io_timeout,
            session: session.filter(|s| !s.is_keyed()).map(|s| s.id),
            spin: Duration::ZERO,
        })
    }

    /// Sets how long a read of one batch waits for its response on its own thread, receiving
    /// it there (zero: never; it waits for the stream's reader task).
    pub(crate) fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    fn lost(&self) -> Error {
        let reason = self
            .health
            .reason
            .lock()
            .as_ref()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "data stream closed".into());
        Error::ConnectionLost {
            peer: self.peer.to_string(),
            reason,
        }
    }

    /// The first stream with no response due, or the next in turn when none is idle.
    fn first_idle(&self) -> usize {
        let idle = self.streams.iter().position(|s| s.recv.pending.is_empty());
        idle.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed))
    }

    async fn run(
        &self,
        id: &RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        confirm: Option<ConfirmAsk>,
    ) -> Result<ReadDone> {
        if self.is_broken() {
            return Err(self.lost());
        }
        // Cut the ops into batches of about batch_bytes, spread round-robin over the streams.
        let batches = batch::batches(
            ops,
            |op| op.local.len(),
            self.batch_bytes,
            wire::MAX_ENTRIES as usize,
        );
        let n = batches.len();
        // A read of one batch is confirmed with its data (no `Done` round trip after it).
        let extras = Extras::of_read(confirm, n, self.session);
        let (done_tx, mut done_rx) = mpsc::channel::<Result<Option<Confirmed>>>(n.max(1));
        let start = match n {
            // A read of one batch takes the first idle stream: back-to-back small reads keep
            // to one stream, whose server connection may be polling for them.
            1 => self.first_idle(),
            _ => self.next.fetch_add(n, Ordering::Relaxed),
        };
        let mut sent_here = None;
        for (i, ops) in batches.into_iter().enumerate() {
            let bytes = ops.iter().map(|o| o.local.len()).sum();
            let batch = Batch {
                id: id.clone(),
                extras,
                ops,
                bytes,
                ctl: ctl.clone(),
                done: done_tx.clone(),
            };
            let stream = &self.streams[(start + i) % self.streams.len()];
            // One batch: its request goes out from here when the stream is free.
            let batch = if n == 1 {
                match stream.send_now(batch, &self.health, self.peer, self.io_timeout) {
                    Ok(()) => {
                        sent_here = Some(&stream.recv);
                        continue;
                    }
                    Err(back) => back,
                }
            } else {
                batch
            };
            if stream.tx.send(batch).await.is_err() {
                return Err(self.lost());
            }
        }
        drop(done_tx);
        let mut confirmed = None;
        let mut left = n;
        // Only a read polled on its caller's thread (outside the runtime's tasks) waits
        // there: a runtime thread held spinning would delay the tasks receiving other reads.
        let here = sent_here.filter(|_| tokio::task::try_id().is_none());
        if let Some(r) = here.and_then(|s| s.wait_here(self.spin, &mut done_rx, &ctl)) {
            confirmed = r?;
            left = 0;
        }
        for _ in 0..left {
            match done_rx.recv().await {
                Some(Ok(c)) => confirmed = confirmed.or(c),
                Some(Err(e)) => return Err(e),
                None => return Err(self.lost()),
            }
        }
        Ok(ReadDone {
            work_requests: n as u64,
            confirmed,
            tell_received: false,
        })
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn read<'a>(
        &'a self,
        id: &'a RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        confirm: Option<ConfirmAsk>,
    ) -> ReadFuture<'a> {
        // Cancelled or past its deadline: batches still on the wire are received and discarded
        // by the streams; no write into the request's memory once this returns.
        Box::pin(async move {
            let run = self.run(id, ops, ctl.clone(), confirm);
            bounded(run, &ctl, deadline, self.io_timeout, &self.peer).await
        })
    }

    fn is_broken(&self) -> bool {
        self.health.broken.load(Ordering::Acquire)
    }

    fn names_reader(&self) -> bool {
        true
    }
}

async fn writer(
    send: Arc<tokio::sync::Mutex<SendSide>>,
    mut rx: mpsc::Receiver<Batch>,
    health: Arc<Health>,
    peer: SocketAddr,
    io_timeout: Duration,
) {
    while let Some(batch) = rx.recv().await {
        if batch.ctl.is_cancelled() {
            batch.finish(Err(Error::invalid("request cancelled")));
            continue;
        }
        let mut side = send.lock().await;
        let side = &mut *side;
        side.encode(&batch);
        // The reader must know the batch before its response can arrive.
        if let Err(batch) = side.pending.push_waiting(batch).await {
            batch.finish(Err(Error::ConnectionLost {
                peer: peer.to_string(),
                reason: "data stream closed".into(),
            }));
            break;
        }
        let r = timeout(io_timeout, side.wr.write_all(&side.buf)).await;
        if let Some(e) = send_failed(peer, io_timeout, r) {
            health.fail(e);
            break;
        }
    }
    health.broken.store(true, Ordering::Release);
}

// Long: one stream's receive loop: its staging buffers live across iterations and every
//   branch ends the stream its own way.
async fn reader(
    side: Arc<RecvSide>,
    health: Arc<Health>,
    peer: SocketAddr,
    io_timeout: Duration,
    staging: Arc<StagingPool>,
) {
    let mut scratch = vec![0u8; 64 << 10];
    // This stream's staging buffers for device memory (allocated on first use).
    let mut inbound = Inbound::new(staging, io_timeout);
    let pending = &side.pending;
    loop {
        // Uncontended (no read waiting on its thread holds it) most of the time: taken
        // without the runtime's await, which would spend the task's budget.
        let mut state = match side.state.try_lock() {
            Ok(state) => state,
            Err(_) => side.state.lock().await,
        };
        // A response a waiting read began, and left to this task to finish; or the next one.
        let (batch, got) = if let Some(here::Resume { batch, got }) = state.resume.take() {
            let (tag, mut rx) = state.rx(&side.rd, peer, io_timeout);
            let r = receive::resume(&mut rx, &batch, got, tag, &mut scratch).await;
            (batch, r)
        } else {
            match look(&mut state.ahead, &side.rd, pending, peer) {
                Ok(true) => {}
                Ok(false) => {
                    drop(state);
                    if let Err(e) = side.wait(peer, io_timeout).await {
                        health.fail(e);
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    health.fail(e);
                    break;
                }
            }
            // A response's batch was queued before its request went out, so before the
            // response came: bytes with no batch queued were not asked.
            let Some(batch) = pending.pop() else {
                health.fail(unasked(peer));
                break;
            };
            state.tag += 1;
            let (tag, mut rx) = state.rx(&side.rd, peer, io_timeout);
            let r = receive::receive(&mut rx, &batch, tag, &mut scratch, &mut inbound).await;
            (batch, r)
        };
        if !end_batch(batch, got, pending, &health) {
            break;
        }
    }
    // Fail whatever is still queued on this stream with the stream's reason.
    for b in pending.close() {
        let reason = health
            .reason
            .lock()
            .clone()
            .unwrap_or_else(|| stream_lost(peer, "data stream closed"));
        b.finish(Err(reason));
    }
    health.broken.store(true, Ordering::Release);
}

/// Whether a response is read ahead: bytes already buffered, or what the socket has now
/// (a waiting read may have received what woke the reader task); `false`: nothing yet. An
/// error: the stream ended or failed (a server closing an idle stream, or dying, marks the
/// transport broken now, so the next request rebuilds the session instead of failing on a
/// dead stream).
fn look(
    ahead: &mut ReadAhead,
    rd: &OwnedReadHalf,
    pending: &Pending,
    peer: SocketAddr,
) -> Result<bool> {
    if !ahead.is_empty() {
        return Ok(true);
    }
    let reason = match ahead.try_fill(rd.as_ref(), true) {
        Ok(Fill::Bytes) => return Ok(true),
        Ok(Fill::Nothing) => return Ok(false),
        Ok(Fill::Closed) if pending.is_empty() => "the peer closed an idle data stream".into(),
        Ok(Fill::Closed) => "the peer closed the data stream mid-response".into(),
        Err(e) => format!("data stream failed: {e}"),
    };
    Err(stream_lost(peer, reason))
}

/// The stream to `peer` lost, for `reason`.
fn stream_lost(peer: SocketAddr, reason: impl Into<String>) -> Error {
    Error::ConnectionLost {
        peer: peer.to_string(),
        reason: reason.into(),
    }
}

/// Ends `batch` with what receiving its response gave (the outer error breaks the stream) and
/// returns its permit; `false` when the stream broke.
fn end_batch(
    batch: Batch,
    got: Result<Result<Option<Confirmed>>>,
    pending: &Pending,
    health: &Health,
) -> bool {
    pending.done();
    match got {
        Ok(outcome) => {
            batch.finish(outcome);
            true
        }
        Err(e) => {
            health.fail(e.clone());
            batch.finish(Err(e));
            false
        }
    }
}

impl RecvSide {
    /// The reader task's wait, the socket found empty: until it is readable or a waiting read
    /// asks for a look. Bounded: a response `io_timeout` late is an error.
    async fn wait(&self, peer: SocketAddr, io_timeout: Duration) -> Result<()> {
        let patience = self.pending.patience(io_timeout);
        if patience.is_zero() {
            return Err(Error::Timeout {
                what: format!("waiting for a data response from {peer}"),
                after: io_timeout,
            });
        }
        let woken = async {
            tokio::select! {
                r = self.rd.readable() => r,
                () = self.kick.notified() => Ok(()),
            }
        };
        match timeout(patience, woken).await {
            Err(_) | Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::ConnectionLost {
                peer: peer.to_string(),
                reason: format!("data stream failed: {e}"),
            }),
        }
    }
}

fn unasked(peer: SocketAddr) -> Error {
    Error::Protocol(format!("{peer} sent data with no request outstanding"))
}

#[cfg(test)]
mod tests;
