//! The publisher's PUB side of a bound tcp endpoint, written for its data path: each
//! subscriber's connection is served here directly (ZMTP 3, NULL mechanism; `zmtp`), and each
//! published message is written to it from the payload's own memory with one vectored write,
//! shared by every subscriber (the `zeromq` crate, behind the frame guard's relay, copied each
//! payload three more times and woke three tasks per message). Inbound bytes go through the
//! same frame guard check ([`Check`]) as the relayed sockets.
//!
//! PUB semantics: a message goes to the subscribers whose subscriptions match its topic and
//! that completed the handshake; a subscriber whose queue is full (messages or bytes) loses
//! the message, counted, as a ZeroMQ PUB at its high-water mark drops; one that takes nothing
//! for `Limits::stall` is cut off.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::error::{PeerError, ZmtpError};
use super::guard::{accept_limited, Check, Limits};
use super::zmtp::{self, Incoming, Parser, Subscriptions};

/// How much may wait toward one subscriber before it loses messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueBound {
    /// Messages (ZeroMQ's SNDHWM).
    pub messages: usize,
    /// Bytes of frames.
    pub bytes: usize,
}
/// Most messages handed to the kernel in one vectored write.
const WRITE_BATCH: usize = 64;

/// One published message, shared by every subscriber's queue; counted in the fanout's bytes
/// alive until the last queue lets it go.
struct Message {
    /// Topic and sequence frames, and the payload frame's header.
    prefix: Bytes,
    payload: Bytes,
    alive: Arc<AtomicUsize>,
}

impl Drop for Message {
    fn drop(&mut self) {
        self.alive
            .fetch_sub(self.prefix.len() + self.payload.len(), Ordering::Relaxed);
    }
}

enum Out {
    Message(Arc<Message>),
    /// A command frame (PONG).
    Command(Bytes),
}

impl Out {
    fn len(&self) -> usize {
        match self {
            Out::Message(m) => m.prefix.len() + m.payload.len(),
            Out::Command(c) => c.len(),
        }
    }
}

/// One subscriber's state, shared by its connection task and the publishing side.
struct Peer {
    bound: QueueBound,
    /// A PONG is queued and not written yet (at most one is: a peer that pings without reading
    /// grows nothing).
    pong_queued: AtomicBool,
    /// Subscriptions in force (and whether its handshake completed: no message before).
    subscriptions: Mutex<Option<Subscriptions>>,
    queue: Mutex<Queue>,
    wake: Notify,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Out>,
    bytes: usize,
}

impl Peer {
    /// Bytes queued now.
    fn queued_bytes(&self) -> usize {
        self.queue.lock().bytes
    }

    /// Queues `out` unless the queue is full (returns whether it was queued); an empty queue
    /// takes a message of any size.
    fn push(&self, out: Out) -> bool {
        let mut q = self.queue.lock();
        if q.items.len() >= self.bound.messages
            || (!q.items.is_empty() && q.bytes + out.len() > self.bound.bytes)
        {
            return false;
        }
        q.bytes += out.len();
        let was_empty = q.items.is_empty();
        q.items.push_back(out);
        drop(q);
        // The writer waits only once it found the queue empty: pushes behind a waiting message
        // are taken with it, without waking it again.
        if was_empty {
            self.wake.notify_one();
        }
        true
    }
}

#[derive(Default)]
struct Shared {
    peers: Mutex<Vec<Arc<Peer>>>,
    /// Bytes of messages some subscriber's queue still holds (each message counted once).
    alive: Arc<AtomicUsize>,
    /// Past this many bytes alive, a subscriber more than an eighth of its bound behind loses
    /// new messages: lagging subscribers that stalled at different times cannot pin a window
    /// each.
    budget: usize,
    /// Set when the PUB side is dropped: connection tasks end.
    closed: AtomicBool,
    close: Notify,
}

/// The PUB side of one bound tcp endpoint.
pub(crate) struct Fanout {
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl Fanout {
    /// Serves subscribers connecting to `listener`.
    pub(crate) fn start(listener: TcpListener, limits: Limits, bound: QueueBound) -> Fanout {
        let shared = Arc::new(Shared {
            budget: bound.bytes,
            ..Shared::default()
        });
        let accept = tokio::spawn(accept_loop(listener, limits, bound, shared.clone()));
        Fanout { shared, accept }
    }

    /// Connected peers that subscribed to something.
    pub(crate) fn subscribers(&self) -> usize {
        let peers = self.shared.peers.lock().clone();
        peers
            .iter()
            .filter(|p| {
                p.subscriptions
                    .lock()
                    .as_ref()
                    .is_some_and(|s| !s.is_empty())
            })
            .count()
    }

    /// Queues the message `[topic, seq, payload]` toward every subscriber whose subscriptions
    /// match `topic`; never waits. Returns how many subscribers lost it to a full queue.
    pub(crate) fn send(&self, topic: &[u8], seq: u64, payload: Bytes) -> u64 {
        let peers = self.shared.peers.lock().clone();
        let mut message = None;
        let mut dropped = 0;
        let over_budget = self.shared.alive.load(Ordering::Relaxed) > self.shared.budget;
        for p in peers {
            let wanted = p
                .subscriptions
                .lock()
                .as_ref()
                .is_some_and(|s| s.matches(topic));
            if !wanted {
                continue;
            }
            if over_budget && p.queued_bytes() > p.bound.bytes / 8 {
                dropped += 1;
                continue;
            }
            let m = message
                .get_or_insert_with(|| {
                    let prefix = Bytes::from(zmtp::message_prefix(topic, seq, payload.len()));
                    self.shared
                        .alive
                        .fetch_add(prefix.len() + payload.len(), Ordering::Relaxed);
                    Arc::new(Message {
                        prefix,
                        payload: payload.clone(),
                        alive: self.shared.alive.clone(),
                    })
                })
                .clone();
            if !p.push(Out::Message(m)) {
                dropped += 1;
            }
        }
        dropped
    }
}

impl Drop for Fanout {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.closed.store(true, Ordering::Release);
        self.shared.close.notify_waiters();
        for p in self.shared.peers.lock().iter() {
            p.wake.notify_one();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    limits: Limits,
    bound: QueueBound,
    shared: Arc<Shared>,
) {
    accept_limited(listener, limits.max_connections, |tcp, addr| {
        let shared = shared.clone();
        async move {
            let peer = Arc::new(Peer {
                bound,
                pong_queued: AtomicBool::new(false),
                subscriptions: Mutex::new(None),
                queue: Mutex::new(Queue::default()),
                wake: Notify::new(),
            });
            shared.peers.lock().push(peer.clone());
            let why = serve(tcp, &peer, limits, &shared).await;
            shared.peers.lock().retain(|p| !Arc::ptr_eq(p, &peer));
            match why {
                Ok(()) => tracing::debug!(peer = %addr, "KV-event subscriber left"),
                Err(why) => tracing::warn!(peer = %addr, "KV-event subscriber cut off: {why}"),
            }
        }
    })
    .await
}

/// Serves one subscriber until it leaves, misbehaves or stalls, or the PUB side closes.
async fn serve(
    tcp: TcpStream,
    peer: &Peer,
    limits: Limits,
    shared: &Shared,
) -> Result<(), PeerError> {
    let (mut rd, mut wr) = tcp.into_split();
    let mut hello = zmtp::greeting().to_vec();
    hello.extend(zmtp::ready("PUB"));
    tokio::time::timeout(limits.handshake, wr.write_all(&hello))
        .await
        .map_err(|_| PeerError::Handshake(limits.handshake))??;
    let inbound = read_loop(&mut rd, peer, limits);
    let outbound = write_loop(&mut wr, peer, limits.stall, shared);
    let closed = async {
        loop {
            // Made before the flag is read, so a close between the two is not missed.
            let woken = shared.close.notified();
            if shared.closed.load(Ordering::Acquire) {
                break;
            }
            woken.await;
        }
    };
    tokio::select! {
        r = inbound => r,
        r = outbound => r,
        _ = closed => Ok(()),
    }
}

/// Reads what the subscriber sends, checked by the frame guard, until it closes or breaks a
/// rule: its greeting and READY within the handshake time, then commands and (un)subscriptions.
async fn read_loop(rd: &mut OwnedReadHalf, peer: &Peer, limits: Limits) -> Result<(), PeerError> {
    let mut check = Check::new(limits);
    let mut parser = Parser::default();
    let mut buf = vec![0u8; 4096];
    let deadline = tokio::time::Instant::now() + limits.handshake;
    let mut ready = false;
    let mut in_message = false;
    loop {
        let n = if ready {
            rd.read(&mut buf).await
        } else {
            tokio::time::timeout_at(deadline, rd.read(&mut buf))
                .await
                .map_err(|_| PeerError::Handshake(limits.handshake))?
        }?;
        if n == 0 {
            return Ok(());
        }
        check.feed(&buf[..n])?;
        parser.feed(&buf[..n]);
        while let Some(unit) = parser.next()? {
            // A frame is a whole message when it starts one and ends it.
            let whole = !in_message && matches!(unit, Incoming::Frame { more: false, .. });
            if let Incoming::Frame { more, .. } = unit {
                in_message = more;
            }
            on_unit(&unit, whole, &mut ready, peer)?;
        }
    }
}

/// One unit the subscriber sent: its greeting, its READY (`ready` from then on), a PING
/// (answered), a subscription or its cancel; anything else ends the connection.
fn on_unit(unit: &Incoming, whole: bool, ready: &mut bool, peer: &Peer) -> Result<(), ZmtpError> {
    match unit {
        Incoming::Greeting {
            major, mechanism, ..
        } => {
            if *major < 3 || mechanism != b"NULL" {
                return Err(ZmtpError::Unsupported {
                    major: *major,
                    mechanism: String::from_utf8_lossy(mechanism).into_owned(),
                });
            }
        }
        Incoming::Command { name, .. } if name == b"READY" && *ready => {
            return Err(ZmtpError::SecondReady);
        }
        Incoming::Command { name, data } if name == b"READY" => {
            let props = zmtp::properties(data)?;
            let ty = props
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(b"Socket-Type"))
                .map(|(_, v)| v.as_slice());
            if !matches!(ty, Some(b"SUB" | b"XSUB")) {
                return Err(ZmtpError::WrongSocketType(
                    ty.map(|t| String::from_utf8_lossy(t).into_owned()),
                ));
            }
            *ready = true;
            *peer.subscriptions.lock() = Some(Subscriptions::default());
        }
        _ if !*ready => return Err(ZmtpError::BeforeReady),
        Incoming::Command { name, data } if name == b"PING" => {
            // PING: TTL (2 bytes), then a context of at most 16 bytes, echoed in
            // the PONG. At most one PONG waits: a peer that pings and reads nothing
            // grows no memory here.
            let context = data.get(2..).unwrap_or_default();
            if context.len() > zmtp::MAX_PING_CONTEXT {
                return Err(ZmtpError::PingContext {
                    len: context.len(),
                    max: zmtp::MAX_PING_CONTEXT,
                });
            }
            if !peer.pong_queued.swap(true, Ordering::AcqRel)
                && !peer.push(Out::Command(Bytes::from(zmtp::pong(context))))
            {
                peer.pong_queued.store(false, Ordering::Release);
            }
        }
        Incoming::Command { name, .. } if name == b"PONG" => {}
        Incoming::Command { name, .. } if name == b"ERROR" => {
            return Err(ZmtpError::PeerSentError);
        }
        Incoming::Command { name, .. } if name != b"SUBSCRIBE" && name != b"CANCEL" => {
            return Err(ZmtpError::UnexpectedCommand(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        _ => {
            if let Some(subs) = peer.subscriptions.lock().as_mut() {
                subs.apply(unit, whole)?;
            }
        }
    }
    Ok(())
}

/// Writes what is queued toward the subscriber, up to [`WRITE_BATCH`] messages per vectored
/// write, each payload from its own memory.
async fn write_loop<W: AsyncWrite + Unpin>(
    wr: &mut W,
    peer: &Peer,
    stall: Duration,
    shared: &Shared,
) -> Result<(), PeerError> {
    let mut batch: Vec<Out> = Vec::with_capacity(WRITE_BATCH);
    loop {
        {
            let mut q = peer.queue.lock();
            while batch.len() < WRITE_BATCH {
                let Some(o) = q.items.pop_front() else { break };
                q.bytes -= o.len();
                batch.push(o);
            }
        }
        if batch.is_empty() {
            if shared.closed.load(Ordering::Acquire) {
                return Ok(());
            }
            peer.wake.notified().await;
            continue;
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * batch.len());
        for o in &batch {
            match o {
                Out::Message(m) => {
                    slices.push(IoSlice::new(&m.prefix));
                    slices.push(IoSlice::new(&m.payload));
                }
                Out::Command(c) => slices.push(IoSlice::new(c)),
            }
        }
        write_all_vectored(wr, &mut slices, stall).await?;
        drop(slices);
        if batch.iter().any(|o| matches!(o, Out::Command(_))) {
            peer.pong_queued.store(false, Ordering::Release);
        }
        batch.clear();
    }
}

/// Writes every byte of `bufs`; fails when a write takes nothing for `stall`.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    wr: &mut W,
    mut bufs: &mut [IoSlice<'_>],
    stall: Duration,
) -> Result<(), PeerError> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = tokio::time::timeout(stall, wr.write_vectored(bufs))
            .await
            .map_err(|_| PeerError::Stalled(stall))??;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero).into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}
