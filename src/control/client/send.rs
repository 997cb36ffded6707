//! The sending side of a control connection: notices written at once from the thread that
//! sends them when the connection's writer is idle, queued for its writer task otherwise; the
//! writer task, which also pings every keep-alive interval.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{mpsc, watch, OwnedMutexGuard};
use tokio::time::timeout;

use super::super::frame::{self, write_frame};
use super::super::messages::Message;

/// What the writer and reader tasks of one control connection share.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) peer: SocketAddr,
    pub(super) keepalive: Duration,
    /// Set by whichever task ends first (and by both), through [`Link::end`].
    pub(super) closed: Arc<AtomicBool>,
    /// Told when `closed` is set.
    pub(super) gone: Arc<watch::Sender<bool>>,
    /// Pings written since the last frame from the peer.
    pub(super) unanswered: Arc<AtomicU32>,
}

impl Link {
    /// One of the connection's tasks ended: the connection is gone.
    pub(super) fn end(&self) {
        self.closed.store(true, Ordering::Release);
        self.gone.send_replace(true);
    }
}

/// The connection's write half: whoever holds it writes the next frame (the writer task, or a
/// notice written at once).
pub(super) type WriteSide = Arc<tokio::sync::Mutex<OwnedWriteHalf>>;

/// How a notice went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Written to the socket (or being finished by a task holding the write half).
    Written,
    /// Queued for the writer task.
    Queued,
    /// Dropped: the connection is gone or its queue full (logged).
    Dropped,
}

/// Where a control connection's notices go.
pub(super) struct Notices {
    pub(super) tx: mpsc::Sender<Message>,
    /// The writer task holds the write half; when the task ends (the connection lost, the
    /// client dropped, the engine's runtime stopped) the write half goes with it, and its
    /// close tells the peer at once.
    pub(super) side: std::sync::Weak<tokio::sync::Mutex<OwnedWriteHalf>>,
    /// Notices queued and not yet written: a notice is written at once only when there are
    /// none, so none overtakes one sent before it.
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) link: Link,
    /// Set when the engine closes: notices are then queued only, never written at once (the
    /// writer task stops with the engine's runtime; a task the runtime could not stop, still
    /// running on a thread of its, must not speak for the closed engine).
    pub(super) closing: Arc<AtomicBool>,
}

impl Notices {
    /// Sends `msg`: at once when the writer is idle (no wake-up of its task, which would also
    /// wake an idle runtime thread to share the work), queued otherwise.
    pub(super) fn send(&self, msg: Message) -> Sent {
        match self.write_now(&msg) {
            Some(sent) => sent,
            None => self.queue(msg),
        }
    }

    /// Queues `msg` for the writer task.
    pub(super) fn queue(&self, msg: Message) -> Sent {
        self.queued.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(msg) {
            Ok(()) => Sent::Queued,
            Err(e) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                let peer = self.link.peer;
                match e {
                    mpsc::error::TrySendError::Full(m) => {
                        tracing::warn!(%peer, ?m, "control queue full; notice dropped");
                    }
                    mpsc::error::TrySendError::Closed(m) => {
                        tracing::warn!(%peer, ?m, "control connection closed; notice dropped");
                    }
                }
                Sent::Dropped
            }
        }
    }

    /// Writes `msg` from this thread if the write half is free and nothing is queued; `None`
    /// (nothing written) otherwise, or outside a runtime. What the socket does not take at once
    /// is finished by a task of its own, still holding the write half.
    fn write_now(&self, msg: &Message) -> Option<Sent> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        if self.link.closed.load(Ordering::Acquire) || self.closing.load(Ordering::Acquire) {
            return None;
        }
        let side = self.side.upgrade()?.try_lock_owned().ok()?;
        // Read under the write half's lock: the writer decrements it under the lock too, after
        // writing, so zero means every notice queued before this one is on the wire.
        if self.queued.load(Ordering::Acquire) != 0 {
            return None;
        }
        let f = frame::encode(msg).ok()?;
        let n = match side.try_write(&f) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
            // Broken: queued, the writer task finds it so and ends the connection.
            Err(_) => return None,
        };
        if n < f.len() {
            let link = self.link.clone();
            runtime.spawn(finish_write(side, f, n, link));
        }
        Some(Sent::Written)
    }
}

/// Writes the rest of a frame a notice began; a connection that does not take it within three
/// keep-alive intervals is shut down (a half-written frame must not be followed by another).
async fn finish_write(
    mut side: OwnedMutexGuard<OwnedWriteHalf>,
    f: Vec<u8>,
    from: usize,
    link: Link,
) {
    let wrote = timeout(link.keepalive * 3, side.write_all(&f[from..])).await;
    if !matches!(wrote, Ok(Ok(()))) {
        tracing::warn!(peer = %link.peer, "control connection lost while writing");
        let _ = timeout(link.keepalive, side.shutdown()).await;
        link.end();
    }
}

/// The writer task: queued notices in order, a ping every keep-alive interval, nothing after a
/// `Bye`. Says how it ended on `ended` (`Some(true)`: after writing a `Bye`).
pub(super) async fn write_loop(
    side: WriteSide,
    queued: Arc<AtomicUsize>,
    mut rx: mpsc::Receiver<Message>,
    link: Link,
    ended: watch::Sender<Option<bool>>,
) {
    let (peer, keepalive) = (link.peer, link.keepalive);
    let mut tick = tokio::time::interval(keepalive);
    // After a stall, one ping rather than a burst of the missed ones.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tick.tick().await;
    let mut nonce = 0u64;
    let mut bye = false;
    loop {
        let (msg, from_queue) = tokio::select! {
            m = rx.recv() => match m { Some(m) => (m, true), None => break },
            _ = tick.tick() => { nonce += 1; (Message::Ping { nonce }, false) }
        };
        let mut wr = side.lock().await;
        let ok = match frame::encode(&msg) {
            Ok(f) => matches!(
                timeout(keepalive * 3, write_frame(&mut *wr, &f)).await,
                Ok(Ok(()))
            ),
            Err(_) => false,
        };
        if from_queue {
            queued.fetch_sub(1, Ordering::AcqRel);
        }
        if !ok {
            tracing::warn!(%peer, "control connection lost while writing");
            // Ended before the write half is free: nothing is written after this.
            link.end();
            break;
        }
        if matches!(msg, Message::Ping { .. }) {
            link.unanswered.fetch_add(1, Ordering::AcqRel);
        }
        if matches!(msg, Message::Bye) {
            // Nothing follows a Bye: the server ends the session on it.
            let _ = timeout(keepalive, wr.shutdown()).await;
            link.end();
            bye = true;
            break;
        }
    }
    link.end();
    let _ = ended.send(Some(bye));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::frame::read_frame;
    use crate::ids::RequestId;
    use tokio::net::{TcpListener, TcpStream};

    fn abort(i: usize, reason_bytes: usize) -> Message {
        Message::Abort {
            request_id: RequestId::new(format!("n-{i}")),
            reason: "x".repeat(reason_bytes),
            hold: None,
        }
    }

    /// A notice sent while an earlier one waits in the queue is queued behind it, though the
    /// write half is free at that moment (the writer task has not taken it yet).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_notice_never_overtakes_a_queued_one() {
        let (notices, mut server) = pair().await;
        let busy = notices.side.upgrade().unwrap().lock_owned().await;
        assert_eq!(
            notices.send(abort(0, 10)),
            Sent::Queued,
            "the writer is busy"
        );
        drop(busy);
        assert_eq!(notices.send(abort(1, 10)), Sent::Queued, "one is queued");
        expect_aborts(&mut server, 1).await;
    }

    /// When the writer task ends (here: aborted, as when the engine's runtime stops), the peer
    /// sees the connection close at once, though the notices' side lives on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_peer_sees_the_close_when_the_writer_task_ends() {
        let (notices, mut server, writer) = pair_with_writer().await;
        writer.abort();
        let _ = writer.await;
        let end = timeout(Duration::from_secs(5), read_frame(&mut server)).await;
        assert!(matches!(end, Ok(Ok(None))), "{end:?}");
        assert_ne!(notices.send(abort(0, 10)), Sent::Written);
    }

    /// Once the engine closes, a notice is queued for the writer task (which stops with the
    /// engine's runtime), never written from the thread that sends it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_closing_engine_writes_no_notice_itself() {
        let (notices, _server) = pair().await;
        notices.closing.store(true, Ordering::Release);
        assert_eq!(notices.send(abort(0, 10)), Sent::Queued);
    }

    /// Notices written at once while the writer is idle and queued behind a frame the socket
    /// could not take at once reach the peer in the order they were sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn notices_written_at_once_or_queued_arrive_in_order() {
        let (notices, mut server) = pair().await;
        assert_eq!(
            notices.send(abort(0, 10)),
            Sent::Written,
            "idle: written at once"
        );
        // 64 MiB the peer does not read yet: the socket fills, a frame is finished by a task
        // holding the write half, and the notices after it queue.
        let sent: Vec<Sent> = (1..=256)
            .map(|i| notices.send(abort(i, 256 << 10)))
            .collect();
        assert!(sent.contains(&Sent::Queued), "{sent:?}");
        assert!(!sent.contains(&Sent::Dropped), "{sent:?}");
        expect_aborts(&mut server, 256).await;
    }

    /// Reads aborts `n-0` to `n-{last}` off `server`, in that order.
    async fn expect_aborts(server: &mut TcpStream, last: usize) {
        for i in 0..=last {
            let (v, body) = read_frame(server).await.unwrap().unwrap();
            match frame::decode::<Message>(v, &body).unwrap() {
                Message::Abort { request_id, .. } => {
                    assert_eq!(request_id.as_str(), format!("n-{i}"))
                }
                m => panic!("unexpected {m:?}"),
            }
        }
    }

    /// Notices with their writer task over a loopback connection, and the peer's end.
    async fn pair() -> (Notices, TcpStream) {
        let (notices, server, _writer) = pair_with_writer().await;
        (notices, server)
    }

    /// [`pair`], and the writer task.
    async fn pair_with_writer() -> (Notices, TcpStream, tokio::task::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (_rd, wr) = c.unwrap().into_split();
        let (gone, _) = watch::channel(false);
        let link = Link {
            peer: addr,
            keepalive: Duration::from_secs(30),
            closed: Arc::default(),
            gone: Arc::new(gone),
            unanswered: Arc::default(),
        };
        let (tx, rx) = mpsc::channel(1024);
        let (ended, _) = watch::channel(None);
        let side: WriteSide = Arc::new(tokio::sync::Mutex::new(wr));
        let queued = Arc::new(AtomicUsize::new(0));
        let weak = Arc::downgrade(&side);
        let writer = write_loop(side, queued.clone(), rx, link.clone(), ended);
        let writer = tokio::spawn(writer);
        let notices = Notices {
            tx,
            side: weak,
            queued,
            link,
            closing: Arc::default(),
        };
        (notices, s.unwrap().0, writer)
    }
}
