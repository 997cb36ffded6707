//! The handshake service: accepts control connections, runs each one's handshake
//! (`handshake.rs`), answers an accepted reader with this engine's descriptor, then takes its
//! notices, messages and queue-pair requests for as long as the connection lives.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWrite, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;

use super::frame::{self, read_frame, write_frame};
use super::handler::ControlHandler;
use super::handshake::{handshake, Accepted, Outcome, Refused};
use super::messages::Message;
use super::ControlTimeouts;
use crate::accept::serve_tcp;
use crate::auth::SessionSecret;
use crate::completion::{Announcement, Follower, SendNotice};
use crate::conn_limit::ConnLimit;
use crate::error::{Error, Refusal, Result};
use crate::ids::RequestId;
use crate::log_limit::{warn_limited, LogLimit};
use crate::tp::Reader;
use crate::transport::rdma::{QpEndpoint, ServerQps};

/// Most RDMA connects (one per device pair) one control connection may make.
const MAX_RDMA_CONNECTS: usize = 16;

/// Messages queued towards one reader that follows holds (`Part`, `Ended`) at most; a follower
/// whose message finds the queue full is dropped (its read fails at its deadline).
const PUSH_QUEUE: usize = 1024;

/// Accepts control connections until the task is dropped, each admitted by `slots` (at most
/// [`MAX_CONNECTIONS`](crate::conn_limit::MAX_CONNECTIONS) at once, a share per address).
pub(crate) async fn serve(
    listener: TcpListener,
    handler: Arc<dyn ControlHandler>,
    timeouts: ControlTimeouts,
    slots: Arc<ConnLimit>,
) {
    // Peers can trigger these at will: one line per interval, with the count.
    static FULL: LogLimit = LogLimit::new(Duration::from_secs(10));
    static CLOSED: LogLimit = LogLimit::new(Duration::from_secs(1));
    serve_tcp(listener, "control", slots, &FULL, |stream, peer| {
        let handler = handler.clone();
        async move {
            if let Err(e) = connection(stream, peer, handler, timeouts).await {
                warn_limited!(CLOSED, %peer, error = %e, "control connection closed with an error");
            }
        }
    })
    .await
}

async fn refuse(stream: &mut (impl AsyncWrite + Unpin), message: String) -> Error {
    if let Ok(frame) = frame::encode(&Message::Error {
        message: message.clone(),
    }) {
        let _ = timeout(
            std::time::Duration::from_secs(1),
            write_frame(stream, &frame),
        )
        .await;
    }
    Error::Protocol(message)
}

/// Refuses a handshake: counted before the answer is written, so a peer that reads the refusal
/// always finds it counted.
async fn refuse_handshake(
    stream: &mut TcpStream,
    handler: &dyn ControlHandler,
    message: String,
) -> Error {
    handler.handshake(false);
    refuse(stream, message).await
}

/// Most `Abort` notices a refused reader may send on its refused connection.
const MAX_REFUSED_ABORTS: usize = crate::inbox::OUTBOX_MESSAGES;

/// After refusing a reader whose layout does not match (it proved the key, when there is one,
/// and its descriptor is valid), takes its `Abort` notices for a while: reads refused here
/// still tell this engine to free the blocks it holds for them, instead of at their abort
/// timeout. Only aborts: anything else, an invalid id, or silence for the handshake deadline
/// ends it; no data connection is ever accepted for this reader.
async fn aborts_after_refusal(
    stream: &mut TcpStream,
    peer: SocketAddr,
    reader: &Reader,
    handler: &dyn ControlHandler,
    timeouts: ControlTimeouts,
) {
    static REFUSED: LogLimit = LogLimit::new(Duration::from_secs(1));
    for _ in 0..MAX_REFUSED_ABORTS {
        let Ok(Ok(Some(f))) = timeout(timeouts.handshake, read_frame(stream)).await else {
            return;
        };
        let Ok(Message::Abort {
            request_id,
            reason,
            hold,
        }) = frame::decode::<Message>(f.0, &f.1)
        else {
            return;
        };
        if request_id.validate().is_err() {
            return;
        }
        let reason = format!(
            "the reader's handshake was refused: {}",
            reason.chars().take(1024).collect::<String>()
        );
        let id = request_id.clone();
        let aborted = SendNotice::Aborted(reason);
        if let Err(why) = handler.notice(peer, reader, request_id, aborted, hold) {
            warn_limited!(REFUSED, %peer, engine = %reader.engine, %id, %why, "refused a refused reader's abort");
        }
    }
}

async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    handler: Arc<dyn ControlHandler>,
    timeouts: ControlTimeouts,
) -> Result<()> {
    match handshake(&mut stream, peer, &*handler, timeouts).await {
        Outcome::Closed => Ok(()),
        Outcome::Refused(Refused {
            reason,
            aborts_from,
        }) => {
            let refused = refuse_handshake(&mut stream, &*handler, reason.into_reason()).await;
            if let Some(reader) = aborts_from {
                aborts_after_refusal(&mut stream, peer, &reader, &*handler, timeouts).await;
            }
            Err(refused)
        }
        Outcome::Accepted(accepted) => {
            serve_reader(stream, peer, handler, accepted, timeouts).await
        }
    }
}

/// Writes one message within `within`; `what` names it in the timeout error.
async fn send(
    stream: &mut (impl AsyncWrite + Unpin),
    msg: &Message,
    what: &str,
    within: Duration,
) -> Result<()> {
    let frame = frame::encode(msg)?;
    timeout(within, write_frame(stream, &frame))
        .await
        .map_err(|_| Error::Timeout {
            what: what.into(),
            after: within,
        })?
}

/// Serves an accepted reader: sends this engine's descriptor, then takes its notices,
/// keep-alives, messages and queue-pair exchanges until it goes away or falls silent. Its
/// session (secret and presence) lasts as long as this does.
async fn serve_reader(
    mut stream: TcpStream,
    peer: SocketAddr,
    handler: Arc<dyn ControlHandler>,
    accepted: Accepted,
    timeouts: ControlTimeouts,
) -> Result<()> {
    let Accepted {
        reader,
        theirs,
        ours,
        secret,
    } = accepted;
    handler.handshake(true);
    // Data connections of this session are accepted while it lives; the reader's holds are
    // on a lease while it has no session.
    let _session = secret.map(|s| SessionGuard::open(handler.clone(), s, reader.clone()));
    let mut present = Presence::open(handler.clone(), reader.clone());
    let reply = Message::Descriptor(Box::new((*ours).clone()));
    send(
        &mut stream,
        &reply,
        "sending the descriptor",
        timeouts.handshake,
    )
    .await?;
    tracing::info!(
        %peer, engine = %theirs.engine_id, rank = theirs.tp_rank, tp = %ours.tp_relation(&theirs),
        "handshake accepted"
    );
    // Frames are read on their own half, so that what followers are told goes out between
    // them without cutting a frame being read.
    let (rd, wr) = stream.into_split();
    let (pushes, pushed) = mpsc::channel(PUSH_QUEUE);
    let mut serving = Serving {
        stream: wr,
        peer,
        handler: &*handler,
        reader,
        rdma_qps: Vec::new(),
        bad_notices: 0,
        timeouts,
        pushes,
    };
    let ended = serving.frames(rd, pushed).await;
    if matches!(ended, Ok(true)) {
        tracing::debug!(%peer, engine = %theirs.engine_id, "reader closed its idle session");
        present.left_in_order();
    }
    ended.map(drop)
}

impl Serving<'_> {
    /// Takes the reader's frames, and writes what its followers are told between them, until
    /// the reader goes away (`Ok(true)`: after its `Bye`) or falls silent.
    async fn frames(
        &mut self,
        rd: OwnedReadHalf,
        mut pushed: mpsc::Receiver<Message>,
    ) -> Result<bool> {
        let (peer, idle) = (self.peer, self.timeouts.keepalive * 3);
        // Frames come through a buffer: a small one (a Done, a notice) in one receive.
        let rd = BufReader::with_capacity(frame::READ_AHEAD, rd);
        let mut next = Box::pin(next_frame(rd, idle));
        loop {
            let (rd, got) = tokio::select! {
                biased;
                got = &mut next => got,
                Some(m) = pushed.recv() => {
                    let within = self.timeouts.handshake;
                    send(&mut self.stream, &m, "telling a follower", within).await?;
                    continue;
                }
            };
            next = Box::pin(next_frame(rd, idle));
            let frame = match got {
                Err(_) => {
                    // The protocol's promise: a refusal is said before the connection closes.
                    let why =
                        format!("no frame from {peer} for {idle:?} (three keep-alive intervals)");
                    refuse(&mut self.stream, why).await;
                    return Err(Error::Timeout {
                        what: format!("waiting for a frame from {peer}"),
                        after: idle,
                    });
                }
                Ok(Ok(None)) => return Ok(false),
                Ok(Ok(Some(f))) => f,
                Ok(Err(e)) => return Err(refuse(&mut self.stream, e.to_string()).await),
            };
            match frame::decode::<Message>(frame.0, &frame.1) {
                Ok(Message::Bye) => return Ok(true),
                Ok(msg) => self.on_message(msg).await?,
                Err(e) => return Err(refuse(&mut self.stream, e.to_string()).await),
            }
        }
    }
}

/// An accepted reader's control connection, between messages.
struct Serving<'a> {
    /// The connection's write half (its read half is in the loop's pending read).
    stream: OwnedWriteHalf,
    peer: SocketAddr,
    handler: &'a dyn ControlHandler,
    reader: Reader,
    /// Queue pairs made for this reader, one set per RDMA device pair it connected (they live
    /// as long as the control connection).
    rdma_qps: Vec<ServerQps>,
    /// Notices naming an invalid request id so far.
    bad_notices: u64,
    timeouts: ControlTimeouts,
    /// Where followers' messages are queued for this connection.
    pushes: mpsc::Sender<Message>,
}

/// The next frame on a reader's control connection (`Ok(None)` when it closed), or `Err` once it
/// was silent for `idle`. A server stalled past `idle` (a stopped process) does not count a
/// reader silent whose frames arrived meanwhile: on resume the runtime takes the socket's
/// readiness in the same turn as the overdue deadline, and `timeout` polls the read first
/// (`tests.rs` checks it, and fails for a wait that looks at its deadline first).
async fn next_frame(mut stream: Frames, idle: Duration) -> (Frames, NextFrame) {
    let got = timeout(idle, read_frame(&mut stream)).await;
    (stream, got)
}

/// A reader's control connection's read half, through a buffer.
type Frames = BufReader<OwnedReadHalf>;

/// What [`next_frame`] read: a frame, the end, an error, or silence.
type NextFrame = std::result::Result<Result<Option<(u16, Vec<u8>)>>, tokio::time::error::Elapsed>;

/// Notices the engine refused (not held, or held for another reader): one line per interval
/// for the whole engine, with the count; the session goes on.
static REFUSED_NOTICES: LogLimit = LogLimit::new(Duration::from_secs(1));

impl Serving<'_> {
    /// A reader follows a request: it is told of the hold's parts through this connection's
    /// queue, or at once why not.
    async fn on_follow(
        &mut self,
        request_id: RequestId,
        hold: Option<u64>,
        wait_ms: u64,
    ) -> Result<()> {
        let wait = Duration::from_millis(wait_ms);
        let follower = Arc::new(QueueFollower(self.pushes.clone()));
        let r = self
            .handler
            .follow(&self.reader, &request_id, hold, wait, follower);
        let Err(why) = r else {
            return Ok(());
        };
        self.refused(&request_id, Err(why.clone()));
        let ended = Message::Ended {
            request_id,
            reason: why.into_reason(),
        };
        let within = self.timeouts.handshake;
        send(&mut self.stream, &ended, "refusing a follow", within).await
    }

    /// Handles one message; an error ends the connection (the reader was told why).
    async fn on_message(&mut self, msg: Message) -> Result<()> {
        let peer = self.peer;
        match msg {
            Message::Done { request_id, hold } if request_id.validate().is_ok() => {
                self.on_done(request_id, hold).await?
            }
            Message::Received { request_id, hold } if request_id.validate().is_ok() => {
                self.on_received(request_id, hold)
            }
            Message::Reading { request_id, hold } if request_id.validate().is_ok() => {
                tracing::debug!(%peer, id = %request_id, ?hold, "reader announced a read");
                let r = self.handler.reading(&self.reader, &request_id, hold);
                self.refused(&request_id, r);
            }
            Message::Pin {
                request_id,
                hold,
                pin_us,
            } if request_id.validate().is_ok() => self.on_pin(request_id, hold, pin_us).await?,
            Message::Abort {
                request_id,
                reason,
                hold,
            } if request_id.validate().is_ok() => {
                let reason: String = reason.chars().take(1024).collect();
                let aborted = SendNotice::Aborted(reason);
                let r = self
                    .handler
                    .notice(peer, &self.reader, request_id.clone(), aborted, hold);
                self.refused(&request_id, r.map(drop));
            }
            Message::Follow {
                request_id,
                hold,
                wait_ms,
            } if request_id.validate().is_ok() => self.on_follow(request_id, hold, wait_ms).await?,
            // A notice naming an invalid id (empty, too long) is refused alone: the session and
            // the other requests on it go on.
            Message::Done { request_id, .. }
            | Message::Received { request_id, .. }
            | Message::Abort { request_id, .. }
            | Message::Reading { request_id, .. }
            | Message::Pin { request_id, .. }
            | Message::Follow { request_id, .. } => {
                self.bad_notices += 1;
                if self.bad_notices == 1 {
                    tracing::warn!(%peer, len = request_id.as_str().len(), "notice with an invalid request id ignored (further ones on this connection are counted, not logged)");
                }
            }
            // Refused alone (too large, inbox full): the session goes on; the engine counts and
            // logs it.
            Message::AppMessage { body } => {
                let from = self.reader.engine.as_str();
                if let Err(why) = self.handler.message(peer, from, body.0) {
                    warn_limited!(REFUSED_NOTICES, %peer, engine = from, %why, "refused a peer's message");
                }
            }
            Message::RdmaConnect {
                generation,
                device,
                qps,
            } if self.rdma_qps.len() < MAX_RDMA_CONNECTS => {
                self.rdma_connect(generation, device, &qps).await?
            }
            Message::Ping { nonce } => {
                let within = self.timeouts.handshake;
                send(
                    &mut self.stream,
                    &Message::Pong { nonce },
                    "answering a ping",
                    within,
                )
                .await?;
            }
            other => {
                return Err(refuse(&mut self.stream, format!("unexpected message {other:?}")).await)
            }
        }
        Ok(())
    }

    /// Answers a reader's queue pairs on one device with ours, or with why not: one device
    /// pair that cannot connect leaves the session and its other devices alone.
    async fn rdma_connect(
        &mut self,
        generation: u64,
        device: u32,
        qps: &[QpEndpoint],
    ) -> Result<()> {
        let (peer, within) = (self.peer, self.timeouts.handshake);
        match self.handler.rdma_accept(peer, device, qps) {
            Ok((ours, guard)) => {
                self.rdma_qps.push(guard);
                let reply = Message::RdmaAccept {
                    generation,
                    qps: ours,
                };
                send(
                    &mut self.stream,
                    &reply,
                    "answering an RDMA connect",
                    within,
                )
                .await?;
                tracing::info!(%peer, generation, "RDMA queue pairs connected");
            }
            Err(e) => {
                tracing::warn!(%peer, device, error = %e, "RDMA connect refused");
                let answer = Message::Error {
                    message: format!("RDMA connect refused: {e}"),
                };
                send(
                    &mut self.stream,
                    &answer,
                    "refusing an RDMA connect",
                    within,
                )
                .await?;
            }
        }
        Ok(())
    }

    /// Logs a refused notice (rate-limited for the whole engine).
    fn refused(&self, id: &RequestId, r: std::result::Result<(), Refusal>) {
        if let Err(why) = r {
            let (peer, engine) = (self.peer, self.reader.engine.as_str());
            warn_limited!(REFUSED_NOTICES, %peer, engine, %id, %why, "refused a reader's notice");
        }
    }
}

/// A follower's messages, queued for its control connection (bounded: a full queue drops the
/// follower).
#[derive(Debug)]
struct QueueFollower(mpsc::Sender<Message>);

impl Follower for QueueFollower {
    fn announce(&self, id: &RequestId, a: Announcement) -> bool {
        let request_id = id.clone();
        let m = match a {
            Announcement::Part {
                token,
                first,
                blocks,
                tensors,
                sealed,
            } => Message::Part {
                request_id,
                token,
                first,
                blocks,
                tensors,
                sealed,
            },
            Announcement::Ended { reason } => Message::Ended { request_id, reason },
        };
        self.0.try_send(m).is_ok()
    }
}

/// Keeps an authenticated session's secret registered with the data server while the control
/// session lives.
struct SessionGuard {
    handler: Arc<dyn ControlHandler>,
    id: [u8; 16],
}

impl SessionGuard {
    fn open(
        handler: Arc<dyn ControlHandler>,
        secret: SessionSecret,
        reader: Reader,
    ) -> SessionGuard {
        let id = secret.id;
        handler.session_opened(secret, reader);
        SessionGuard { handler, id }
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.handler.session_closed(self.id);
    }
}

/// Tells the engine a reader's accepted session began, and ended (on every path out): in order
/// after its `Bye`, else as a loss.
struct Presence {
    handler: Arc<dyn ControlHandler>,
    reader: Reader,
    in_order: bool,
}

impl Presence {
    fn open(handler: Arc<dyn ControlHandler>, reader: Reader) -> Presence {
        handler.reader_connected(&reader);
        Presence {
            handler,
            reader,
            in_order: false,
        }
    }

    /// The reader said `Bye`: the session ends in order.
    fn left_in_order(&mut self) {
        self.in_order = true;
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        if self.in_order {
            self.handler.reader_left(&self.reader);
        } else {
            self.handler.reader_disconnected(&self.reader);
        }
    }
}

mod notices;
#[cfg(test)]
mod tests;
