//! The reader's side of the control connection: handshake, then notices written at once when
//! the connection's writer is idle or queued (bounded) for its writer task, which also pings
//! (`send.rs`), and a reader task that watches for answers and silence.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::timeout;

mod send;

pub(crate) use send::Sent;
use send::{write_loop, Link, Notices};

use super::frame::{self, read_frame, write_frame};
use super::messages::{Descriptor, Message};
use super::ControlTimeouts;
use crate::auth::{self, AuthKey, SessionSecret};
use crate::completion::Announcement;
use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::ids::RequestId;

/// Notices queued towards one peer at most; beyond this they are dropped with a warning
/// (the peer will expire the request on its own abort timeout).
const NOTICE_QUEUE: usize = 1024;

/// A connection is dead once no frame arrived for three keep-alive intervals and at least this
/// many of our pings went unanswered meanwhile. A process that was itself stopped (its pings
/// not sent, its timer overdue when it resumes) so does not blame its peer for the silence, and
/// a dead peer is still found: pings go on being written every interval.
const SILENT_AFTER_PINGS: u32 = 2;

/// The prefill's answer to a `Done`: confirmed (how long the request had been held then), or
/// why not.
pub(crate) type Confirmation = std::result::Result<std::time::Duration, Refusal>;

/// Where each `Done` or `Pin` sent on this connection wants its `Confirm`, per request id in
/// the order they went out: the server answers every `Done` and `Pin` once, in order, so each
/// `Confirm` goes to the oldest of its id (a read that stopped waiting keeps its place, so its
/// answer is never taken for a later read's).
type Pending = Arc<Mutex<HashMap<RequestId, VecDeque<oneshot::Sender<Confirmation>>>>>;

/// The reads following a request's hold on this connection (progressive reads), by request:
/// where its `Part`s and `Ended` go. One follow per request id.
type Follows = Arc<Mutex<HashMap<RequestId, mpsc::Sender<Announcement>>>>;

/// Announcements queued towards one follow at most; a follow that falls this far behind is
/// dropped (its read fails at its deadline).
const FOLLOW_QUEUE: usize = 256;

/// Who waits for what the peer says: confirmations, and follows.
#[derive(Clone, Default)]
struct Waiters {
    confirms: Pending,
    follows: Follows,
}

/// A live control connection to one peer.
pub(crate) struct ControlClient {
    notices: Notices,
    closed: Arc<AtomicBool>,
    /// How the writer task ended, once it has: `Some(true)` after writing a `Bye`,
    /// `Some(false)` otherwise (the connection lost, or the client dropped).
    writer_ended: watch::Receiver<Option<bool>>,
    /// Becomes true once either task has ended: the connection is gone.
    gone: watch::Receiver<bool>,
    tasks: [JoinHandle<()>; 2],
    pending: Pending,
    follows: Follows,
}

impl Drop for ControlClient {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn handshake_err(peer: SocketAddr, reason: impl Into<String>) -> Error {
    Error::Handshake {
        peer: peer.to_string(),
        reason: reason.into(),
    }
}

/// A control connection after the descriptor exchange, before its background tasks start:
/// further request/response exchanges (RDMA queue pairs) happen here.
pub(crate) struct Handshake {
    stream: TcpStream,
    peer: SocketAddr,
    timeouts: ControlTimeouts,
}

impl Handshake {
    /// Sends `msg`, which has no answer, within the handshake deadline.
    pub(crate) async fn send(&mut self, msg: &Message) -> Result<()> {
        let frame = frame::encode(msg)?;
        timeout(
            self.timeouts.handshake,
            write_frame(&mut self.stream, &frame),
        )
        .await
        .map_err(|_| Error::Timeout {
            what: format!("sending to {}", self.peer),
            after: self.timeouts.handshake,
        })?
    }

    /// Sends `msg` and waits for the answer, within the handshake deadline. A refusal (`Error`)
    /// becomes `Error::Handshake` with the peer's message.
    pub(crate) async fn request(&mut self, msg: &Message) -> Result<Message> {
        match self.exchange(msg).await? {
            Message::Error { message } => {
                Err(handshake_err(self.peer, format!("refused: {message}")))
            }
            m => Ok(m),
        }
    }

    /// [`request`](Self::request) that returns a refusal as the peer's `Error` message, for
    /// exchanges whose refusal ends only themselves (an RDMA device pair the peer cannot
    /// connect: the session goes on without it).
    pub(crate) async fn exchange(&mut self, msg: &Message) -> Result<Message> {
        let frame = frame::encode(msg)?;
        let peer = self.peer;
        let stream = &mut self.stream;
        let exchange = async {
            write_frame(stream, &frame).await?;
            read_frame(stream).await
        };
        let reply = timeout(self.timeouts.handshake, exchange)
            .await
            .map_err(|_| Error::Timeout {
                what: format!("waiting for an answer from {peer}"),
                after: self.timeouts.handshake,
            })?
            .map_err(|e| handshake_err(peer, e.to_string()))?
            .ok_or_else(|| handshake_err(peer, "the peer closed the connection"))?;
        frame::decode::<Message>(reply.0, &reply.1).map_err(|e| handshake_err(peer, e.to_string()))
    }

    /// Starts the keep-alive and notice tasks. Once `closing` is set (the engine is closing and
    /// its runtime stopping), notices are only queued: a task still running on a thread the
    /// stopped runtime left behind does not write them.
    pub(crate) fn start(self, closing: Arc<AtomicBool>) -> ControlClient {
        let Handshake {
            stream,
            peer,
            timeouts,
        } = self;
        let (rd, wr) = stream.into_split();
        let (gone_tx, gone) = watch::channel(false);
        let link = Link {
            peer,
            keepalive: timeouts.keepalive,
            closed: Arc::default(),
            gone: Arc::new(gone_tx),
            unanswered: Arc::default(),
        };
        let (tx, rx) = mpsc::channel::<Message>(NOTICE_QUEUE);
        let (ended_tx, writer_ended) = watch::channel(None);
        let waiters = Waiters::default();
        let (pending, follows) = (waiters.confirms.clone(), waiters.follows.clone());
        let side = Arc::new(tokio::sync::Mutex::new(wr));
        let queued = Arc::new(AtomicUsize::new(0));
        let weak = Arc::downgrade(&side);
        let writer = tokio::spawn(write_loop(side, queued.clone(), rx, link.clone(), ended_tx));
        let reader = tokio::spawn(read_loop(rd, link.clone(), waiters));
        ControlClient {
            notices: Notices {
                tx,
                side: weak,
                queued,
                link: link.clone(),
                closing,
            },
            closed: link.closed,
            writer_ended,
            gone,
            tasks: [writer, reader],
            pending,
            follows,
        }
    }
}

/// The reader task: confirmations to the reads waiting for them, until the peer closes, refuses
/// or falls silent (three intervals without a frame, with [`SILENT_AFTER_PINGS`] of our pings
/// unanswered).
async fn read_loop(rd: OwnedReadHalf, link: Link, waiters: Waiters) {
    let (peer, keepalive) = (link.peer, link.keepalive);
    // Frames come through a buffer: a small one (a confirmation) in one receive.
    let mut rd = tokio::io::BufReader::with_capacity(frame::READ_AHEAD, rd);
    loop {
        match timeout(keepalive * 3, read_frame(&mut rd)).await {
            Ok(Ok(Some((v, body)))) => {
                link.unanswered.store(0, Ordering::Release);
                if !on_frame(peer, frame::decode::<Message>(v, &body), &waiters) {
                    break;
                }
            }
            Ok(Ok(None)) => {
                // After our Bye (the writer has ended) the close is the expected one.
                if !link.closed.load(Ordering::Acquire) {
                    tracing::info!(%peer, "peer closed the control connection");
                }
                break;
            }
            Ok(Err(e)) => {
                tracing::warn!(%peer, error = %e, "control connection failed");
                break;
            }
            Err(_) => {
                let pings = link.unanswered.load(Ordering::Acquire);
                if pings < SILENT_AFTER_PINGS {
                    tracing::debug!(%peer, pings, "no frame for three keep-alive intervals, but this process sent too few pings meanwhile (it was stalled): waiting on");
                    continue;
                }
                tracing::warn!(%peer, pings, "control connection silent for {:?}", keepalive * 3);
                break;
            }
        }
    }
    link.end();
    // Reads still waiting hear that no confirmation, and no part, will come.
    waiters.confirms.lock().clear();
    waiters.follows.lock().clear();
}

/// Handles one frame from the peer; false when the connection ends on it.
fn on_frame(peer: SocketAddr, msg: Result<Message>, waiters: &Waiters) -> bool {
    let confirms = &waiters.confirms;
    match msg {
        Ok(Message::Pong { .. }) => true,
        Ok(Message::Confirm {
            request_id,
            refused,
            held_us,
        }) => {
            // The oldest Done of this id; a confirmation nobody waits for any more (its read
            // gave up, or its notice wanted no answer) is dropped.
            let tx = {
                let mut confirms = confirms.lock();
                let queue = confirms.get_mut(&request_id);
                let tx = queue.and_then(VecDeque::pop_front);
                if confirms.get(&request_id).is_some_and(VecDeque::is_empty) {
                    confirms.remove(&request_id);
                }
                tx
            };
            if let Some(tx) = tx {
                let held = std::time::Duration::from_micros(held_us);
                let _ = tx
                    .send(refused.map_or(Ok(held), |r| Err(Refusal::new(RefusalKind::Remote, r))));
            }
            true
        }
        Ok(Message::Part {
            request_id,
            token,
            first,
            blocks,
            tensors,
            sealed,
        }) => {
            let part = Announcement::Part {
                token,
                first,
                blocks,
                tensors,
                sealed,
            };
            tell_follow(&waiters.follows, request_id, part, sealed);
            true
        }
        Ok(Message::Ended { request_id, reason }) => {
            tell_follow(
                &waiters.follows,
                request_id,
                Announcement::Ended { reason },
                true,
            );
            true
        }
        Ok(Message::Error { message }) => {
            tracing::warn!(%peer, %message, "peer closed the control connection");
            false
        }
        other => {
            tracing::warn!(%peer, ?other, "unexpected control message");
            false
        }
    }
}

/// Passes `a` to the follow of request `id`, if one waits (a part for a follow that gave up is
/// dropped); `last`: nothing follows it. A follow that cannot take it (too far behind, or
/// gone) is dropped.
fn tell_follow(follows: &Follows, id: RequestId, a: Announcement, last: bool) {
    let mut follows = follows.lock();
    let Some(tx) = follows.get(&id) else {
        return;
    };
    if tx.try_send(a).is_err() || last {
        follows.remove(&id);
    }
}

impl ControlClient {
    /// Connects, sends our descriptor, and returns the peer's validated, compatible descriptor.
    pub(crate) async fn handshake(
        peer: SocketAddr,
        ours: &Descriptor,
        key: Option<&AuthKey>,
        timeouts: ControlTimeouts,
    ) -> Result<(Handshake, Descriptor, Option<SessionSecret>)> {
        let (hs, reply, secret) = hello(peer, ours, key, timeouts).await?;
        let theirs = match reply {
            Ok(Message::Descriptor(d)) => *d,
            Ok(other) => return Err(handshake_err(peer, format!("unexpected reply {other:?}"))),
            Err(Error::Timeout { after, .. }) => {
                return Err(Error::Timeout {
                    what: format!("waiting for the handshake reply of {peer}"),
                    after,
                })
            }
            Err(e) => return Err(e),
        };
        theirs
            .validate()
            .map_err(|e| handshake_err(peer, e.to_string()))?;
        let diffs = ours.differences(&theirs);
        if !diffs.is_empty() {
            return Err(Error::Incompatible {
                peer: peer.to_string(),
                differences: format!("(ours vs theirs) {}", diffs.join("; ")),
            });
        }
        Ok((hs, theirs, secret))
    }

    /// Sends `aborts` (`Abort` notices) to `peer` on a connection of their own, whatever the
    /// answer to our Hello: a peer that refuses this engine's layout still takes the aborts of
    /// the reads it refused, so it frees their blocks now rather than at its abort timeout.
    /// Returns once they are written and the connection is closed.
    pub(crate) async fn send_aborts(
        peer: SocketAddr,
        ours: &Descriptor,
        key: Option<&AuthKey>,
        timeouts: ControlTimeouts,
        aborts: &[Message],
    ) -> Result<()> {
        let (mut hs, reply, _) = hello(peer, ours, key, timeouts).await?;
        if let Err(e) = reply {
            tracing::debug!(%peer, error = %e, "sending aborts after a refused handshake");
        }
        for m in aborts {
            hs.send(m).await?;
        }
        let _ = timeout(timeouts.handshake, hs.stream.shutdown()).await;
        Ok(())
    }

    /// Sends request `id`'s `Done` and returns where its `Confirm` will arrive; `None` when the
    /// notice cannot be queued (the connection is gone or its queue full). The receiver fails
    /// when the connection closes first.
    pub(crate) fn done(
        &self,
        id: RequestId,
        hold: Option<u64>,
    ) -> Option<oneshot::Receiver<Confirmation>> {
        let done = Message::Done {
            request_id: id.clone(),
            hold,
        };
        self.ask(id, done).map(|(rx, _)| rx)
    }

    /// Sends request `id`'s `Pin` (for `pin`) and returns where its `Confirm` will arrive, as
    /// [`done`](Self::done) does, and whether the `Pin` is written or queued for the writer.
    pub(crate) fn pin(
        &self,
        id: RequestId,
        hold: Option<u64>,
        pin: std::time::Duration,
    ) -> Option<(oneshot::Receiver<Confirmation>, Sent)> {
        let msg = Message::Pin {
            request_id: id.clone(),
            hold,
            pin_us: u64::try_from(pin.as_micros()).unwrap_or(u64::MAX),
        };
        self.ask(id, msg)
    }

    /// Sends `msg` about request `id`, which the peer answers with a `Confirm`, and returns
    /// where that answer will arrive and whether `msg` is written or queued.
    fn ask(&self, id: RequestId, msg: Message) -> Option<(oneshot::Receiver<Confirmation>, Sent)> {
        let (tx, rx) = oneshot::channel();
        // Queued under the lock, so the answers' order is the notices' order.
        let mut pending = self.pending.lock();
        let sent = self.send(msg);
        if sent == Sent::Dropped {
            return None;
        }
        pending.entry(id).or_default().push_back(tx);
        drop(pending);
        (!self.is_closed()).then_some((rx, sent))
    }

    /// Follows request `id`'s hold (`hold`, when known; waited for up to `wait` when not held
    /// yet) and returns where its parts and its end will arrive; `None` when the `Follow`
    /// cannot be queued. The receiver ends when the connection closes, or after the last part.
    /// A new follow of the same id replaces an earlier one.
    pub(crate) fn follow(
        &self,
        id: RequestId,
        hold: Option<u64>,
        wait: std::time::Duration,
    ) -> Option<mpsc::Receiver<Announcement>> {
        let (tx, rx) = mpsc::channel(FOLLOW_QUEUE);
        let mut follows = self.follows.lock();
        follows.insert(id.clone(), tx);
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let sent = self.notify(Message::Follow {
            request_id: id.clone(),
            hold,
            wait_ms,
        });
        if !sent {
            follows.remove(&id);
            return None;
        }
        drop(follows);
        (!self.is_closed()).then_some(rx)
    }

    /// Stops following request `id` (its read ended): later parts are dropped.
    pub(crate) fn unfollow(&self, id: &RequestId) {
        self.follows.lock().remove(id);
    }

    /// Closes the connection in order: queues a `Bye` after whatever is queued (so every
    /// notice before it goes out) and waits, up to `within`, for the writer to have written
    /// it. Returns whether it was written; the connection is closed either way once the client
    /// is dropped.
    pub(crate) async fn close(&self, within: std::time::Duration) -> bool {
        if self.is_closed() || self.notices.queue(Message::Bye) != Sent::Queued {
            return false;
        }
        let mut ended = self.writer_ended.clone();
        let told = match timeout(within, ended.wait_for(Option::is_some)).await {
            Ok(Ok(end)) => *end == Some(true),
            _ => false,
        };
        told
    }

    /// Resolves once the connection is gone (closed, refused, silent, or after a `Bye`).
    pub(crate) async fn gone(&self) {
        let mut gone = self.gone.clone();
        // An error means both tasks ended and dropped the sender: gone as well.
        let _ = gone.wait_for(|g| *g).await;
    }

    /// Whether the connection has died.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Sends a notice without waiting: written at once when the connection's writer is idle,
    /// queued otherwise. Returns false (and logs) when the peer is gone or its queue is full;
    /// the peer then expires the request on its abort timeout.
    pub(crate) fn notify(&self, msg: Message) -> bool {
        self.send(msg) != Sent::Dropped
    }

    /// [`notify`](Self::notify), saying whether the notice is on the wire or queued.
    pub(crate) fn send(&self, msg: Message) -> Sent {
        self.notices.send(msg)
    }
}

/// Connects to `peer`, proves `key` both ways when there is one, and sends our descriptor.
/// Returns the connection, the peer's answer to the Hello (its refusal as `Err`), and the
/// session's secret.
async fn hello(
    peer: SocketAddr,
    ours: &Descriptor,
    key: Option<&AuthKey>,
    timeouts: ControlTimeouts,
) -> Result<(Handshake, Result<Message>, Option<SessionSecret>)> {
    let stream = timeout(timeouts.connect, TcpStream::connect(peer))
        .await
        .map_err(|_| Error::Timeout {
            what: format!("connecting to {peer}"),
            after: timeouts.connect,
        })?
        .map_err(|e| handshake_err(peer, format!("connect: {e}")))?;
    let _ = stream.set_nodelay(true);
    let mut hs = Handshake {
        stream,
        peer,
        timeouts,
    };
    // With a key: prove it both ways before any descriptor moves (docs/security.md).
    let (hello, secret) = match key {
        None => {
            let id = SessionSecret::random_id()?;
            (
                Message::Hello {
                    descriptor: Box::new(ours.clone()),
                    session: Some(id),
                },
                Some(SessionSecret::unkeyed(id)),
            )
        }
        Some(key) => {
            let client_nonce = auth::nonce()?;
            let (server_nonce, server_proof) =
                match hs.request(&Message::AuthHello { client_nonce }).await {
                    Ok(Message::AuthChallenge {
                        server_nonce,
                        server_proof,
                    }) => (server_nonce, server_proof),
                    Ok(other) => {
                        return Err(handshake_err(
                            peer,
                            format!("unexpected answer to the authentication hello: {other:?}"),
                        ))
                    }
                    Err(Error::Timeout { after, .. }) => {
                        return Err(Error::Timeout {
                            what: format!("waiting for the authentication challenge of {peer}"),
                            after,
                        })
                    }
                    Err(e) => return Err(e),
                };
            if !auth::server_proof_checks(key, &client_nonce, &server_nonce, &server_proof) {
                return Err(handshake_err(
                    peer,
                    "the peer failed to prove the deployment key (a different \
                 KVLINK_AUTH_KEY, or not a kvlink engine)"
                        .to_string(),
                ));
            }
            hs.send(&Message::AuthProof {
                client_proof: auth::client_proof(key, &client_nonce, &server_nonce),
            })
            .await?;
            (
                Message::Hello {
                    descriptor: Box::new(ours.clone()),
                    session: None,
                },
                Some(SessionSecret::derive(key, &client_nonce, &server_nonce)),
            )
        }
    };
    let reply = hs.request(&hello).await;
    Ok((hs, reply, secret))
}

#[cfg(test)]
mod tests;
