//! Sessions: one cached connection per remote engine (single-flight connect, this file), the
//! connect and transport negotiation (`connect.rs`), and the transfer task that turns a request
//! into a plan, hands it to the transport and reports the outcome (`transfer.rs`).
//!
//! Sessions sit above the engine's state ([`EngineState`]): they read its layout, regions and
//! configuration and report into its completion tracker. The engine API owns the session cache.

mod connect;
mod idle;
#[cfg(test)]
mod pair;
mod transfer;

pub(crate) use transfer::{check_block_size, run_follow, run_read, FollowJob, ReadJob, Source};

use idle::IdleClock;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::control::messages::{Descriptor, Message};
use crate::control::{Confirmation, ControlClient, Sent};
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::inbox::OUTBOX_MESSAGES;
use crate::state::EngineState;
use crate::transport::rdma::RdmaFault;
use crate::transport::Transport;
use tokio::sync::oneshot;

/// The control connection of a session, as the transfer task uses it: done/abort notices to
/// the peer, and whether the connection died. [`ControlClient`] in production; the pair harness
/// (tests) delivers notices in memory.
pub(crate) trait ControlLink: Send + Sync {
    /// Queues a notice without waiting; false when it could not be queued (the peer then
    /// expires the request on its abort timeout).
    fn notify(&self, msg: Message) -> bool;
    /// [`notify`](Self::notify), saying whether the notice is on the wire already or queued
    /// for the connection's writer.
    fn send(&self, msg: Message) -> Sent {
        match self.notify(msg) {
            true => Sent::Queued,
            false => Sent::Dropped,
        }
    }
    /// Sends request `id`'s `Done`; the receiver gets the peer's confirmation (or fails when
    /// the connection closes first). `None` when it could not be queued.
    fn done(&self, id: RequestId, hold: Option<u64>) -> Option<oneshot::Receiver<Confirmation>>;
    /// Sends request `id`'s `Pin` (asking for `pin`, as an RDMA read is posted); the receiver
    /// gets the peer's answer, as for [`done`](Self::done), with whether the `Pin` is written
    /// or queued.
    fn pin(
        &self,
        id: RequestId,
        hold: Option<u64>,
        pin: std::time::Duration,
    ) -> Option<(oneshot::Receiver<Confirmation>, Sent)>;
    /// Whether the connection has died.
    fn is_closed(&self) -> bool;
    /// Closes the connection in order (`Bye`, after whatever is queued), waiting up to
    /// `within`; true when the peer was told.
    fn close(&self, within: std::time::Duration) -> CloseFuture<'_>;
    /// Resolves once the connection is gone: no confirmation can come after that.
    fn gone(&self) -> GoneFuture<'_>;
    /// Follows request `id`'s hold (`hold`, when known; a request not held yet is waited for
    /// up to `wait`): the receiver gets its parts and its end. `None` when the `Follow` could
    /// not be queued.
    fn follow(
        &self,
        id: RequestId,
        hold: Option<u64>,
        wait: std::time::Duration,
    ) -> Option<tokio::sync::mpsc::Receiver<crate::completion::Announcement>>;
    /// Stops following request `id` (its read ended).
    fn unfollow(&self, id: &RequestId);
}

/// A future that resolves once a control connection is gone.
pub(crate) type GoneFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// A future that closes a control connection in order.
pub(crate) type CloseFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + 'a>>;

impl ControlLink for ControlClient {
    fn close(&self, within: std::time::Duration) -> CloseFuture<'_> {
        Box::pin(ControlClient::close(self, within))
    }

    fn gone(&self) -> GoneFuture<'_> {
        Box::pin(ControlClient::gone(self))
    }

    fn notify(&self, msg: Message) -> bool {
        ControlClient::notify(self, msg)
    }

    fn send(&self, msg: Message) -> Sent {
        ControlClient::send(self, msg)
    }

    fn done(&self, id: RequestId, hold: Option<u64>) -> Option<oneshot::Receiver<Confirmation>> {
        ControlClient::done(self, id, hold)
    }

    fn pin(
        &self,
        id: RequestId,
        hold: Option<u64>,
        pin: std::time::Duration,
    ) -> Option<(oneshot::Receiver<Confirmation>, Sent)> {
        ControlClient::pin(self, id, hold, pin)
    }

    fn follow(
        &self,
        id: RequestId,
        hold: Option<u64>,
        wait: std::time::Duration,
    ) -> Option<tokio::sync::mpsc::Receiver<crate::completion::Announcement>> {
        ControlClient::follow(self, id, hold, wait)
    }

    fn unfollow(&self, id: &RequestId) {
        ControlClient::unfollow(self, id)
    }

    fn is_closed(&self) -> bool {
        ControlClient::is_closed(self)
    }
}

/// A future that makes a session.
pub(crate) type ConnectFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<PeerConn>> + Send + 'a>>;

/// A future that sends notices.
pub(crate) type NoticeFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send + 'a>>;

/// How sessions are made: [`connect::Network`] (handshake, then RDMA or TCP) in production; the
/// pair harness joins engines in memory.
pub(crate) trait Connector: Send + Sync {
    /// Connects to `peer` as session `generation`.
    fn connect<'a>(
        &'a self,
        state: &'a Arc<EngineState>,
        peer: &'a str,
        generation: u64,
    ) -> ConnectFuture<'a>;

    /// Sends `aborts` to `peer` on a connection of their own: for a peer that refused this
    /// engine's session (an incompatible layout), which still takes the aborts of the reads it
    /// refused and frees their blocks.
    fn send_aborts<'a>(
        &'a self,
        state: &'a Arc<EngineState>,
        peer: &'a str,
        aborts: Vec<Message>,
    ) -> NoticeFuture<'a>;
}

/// A live session with one remote engine.
pub(crate) struct PeerConn {
    pub(crate) descriptor: Descriptor,
    pub(crate) control: Box<dyn ControlLink>,
    pub(crate) transport: Box<dyn Transport>,
    pub(crate) generation: u64,
}

impl PeerConn {
    fn is_broken(&self) -> bool {
        self.control.is_closed() || self.transport.is_broken()
    }
}

type Outcome = Option<Result<Arc<PeerConn>>>;

enum Slot {
    Connecting(watch::Receiver<Outcome>),
    /// Up, with how long it has been idle (the reaper closes it past `session_idle`).
    Ready(Arc<PeerConn>, IdleClock),
    /// A recent failure, returned to callers until the instant passes (so a burst of requests
    /// to a bad peer costs one handshake, and a dead peer is not hammered).
    Failed(Error, tokio::time::Instant),
}

/// A session the reaper took out of the cache.
struct Unused {
    peer: String,
    conn: Arc<PeerConn>,
    /// Broken (else idle past the limit).
    broken: bool,
}

/// How long a failed connect is remembered.
const FAILURE_MEMORY: std::time::Duration = std::time::Duration::from_millis(500);

/// How long aborts for a peer that refused this engine's session are gathered before they go
/// out together.
const ABORT_GATHER: std::time::Duration = std::time::Duration::from_millis(20);

/// Whether a connect failed in its handshake (the peer refused the session, its layout does
/// not match ours, or the connection was refused) rather than by silence or a lost link.
fn refused_by_peer(e: &Error) -> bool {
    matches!(e, Error::Handshake { .. } | Error::Incompatible { .. })
}

/// What an engine knows of its session with a peer ([`Engine::session_state`]).
///
/// [`Engine::session_state`]: crate::Engine::session_state
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionState {
    /// No session was asked for (or none since the engine started).
    None,
    /// A connect is under way.
    Connecting,
    /// The session is up: its control connection answers keep-alives.
    Up,
    /// The last connect failed, or the session ended; the next read or message to the peer
    /// connects again. The reason says which.
    Down(String),
}

/// The cache of sessions, keyed by the peer's handshake address as the caller gave it.
pub(crate) struct Sessions {
    pub(crate) state: Arc<EngineState>,
    connector: Box<dyn Connector>,
    map: Mutex<HashMap<String, Slot>>,
    generation: AtomicU64,
    /// Control messages waiting for a peer's session, by peer, in call order (`post`).
    outbox: Mutex<HashMap<String, VecDeque<Message>>>,
}

impl Sessions {
    /// An empty cache reading from `state`, connecting over the network.
    pub(crate) fn new(state: Arc<EngineState>) -> Sessions {
        Sessions::with_connector(state, Box::new(connect::Network::default()))
    }

    /// [`new`](Sessions::new), its RDMA connections corrupting what they post as `fault`
    /// says (the tests of the verbs error paths).
    pub(crate) fn with_rdma_fault(state: Arc<EngineState>, fault: RdmaFault) -> Sessions {
        Sessions::with_connector(state, Box::new(connect::Network::with_rdma_fault(fault)))
    }

    /// An empty cache reading from `state`, making sessions with `connector`.
    pub(crate) fn with_connector(
        state: Arc<EngineState>,
        connector: Box<dyn Connector>,
    ) -> Sessions {
        Sessions {
            state,
            connector,
            map: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            outbox: Mutex::new(HashMap::new()),
        }
    }

    /// Hands `msg` to `peer`'s control connection, in call order per peer: at once when the
    /// session is up and nothing waits for it, else queued (at most [`OUTBOX_MESSAGES`]) and
    /// sent by one task once `get` has connected. Application messages are counted as sent or
    /// unsent; a message that cannot go out is logged. Returns at once.
    pub(crate) fn post(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        peer: &str,
        msg: Message,
    ) -> Result<()> {
        let mut waiting = self.outbox.lock();
        let queue = waiting.entry(peer.to_string()).or_default();
        if queue.is_empty() {
            if let Some(c) = self.ready_conn(peer) {
                waiting.remove(peer);
                self.hand_over(Some(&c), msg);
                return Ok(());
            }
        }
        if queue.len() >= OUTBOX_MESSAGES {
            self.hand_over(None, msg);
            return Err(Error::ConnectionLost {
                peer: peer.to_string(),
                reason: format!(
                    "the session is not up yet and {OUTBOX_MESSAGES} messages already wait for it"
                ),
            });
        }
        let first = queue.is_empty();
        queue.push_back(msg);
        drop(waiting);
        if first {
            let sessions = self.clone();
            let peer = peer.to_string();
            // `get` bounds the whole connect itself.
            rt.spawn(async move {
                let conn = sessions.get(&peer).await;
                if conn.as_ref().is_err_and(refused_by_peer) {
                    // The aborts of reads refused together go out on one connection.
                    tokio::time::sleep(ABORT_GATHER).await;
                }
                // Handed over under the lock: a later call waits, and so goes out after these.
                let mut aborts = Vec::new();
                {
                    let mut waiting = sessions.outbox.lock();
                    let queued = waiting.remove(&peer).unwrap_or_default();
                    for m in queued {
                        match (&conn, m) {
                            (Err(_), m @ Message::Abort { .. }) => aborts.push(m),
                            (c, m) => sessions.hand_over(c.as_ref().ok(), m),
                        }
                    }
                }
                if let Err(e) = conn {
                    sessions.abort_without_session(&peer, &e, aborts).await;
                }
            });
        }
        Ok(())
    }

    /// Sends the aborts that waited for a session to `peer` that could not be made (`why`). A
    /// peer that answered and refused the session still takes them on a connection of their
    /// own (bounded like a connect); anything else that waited is dropped with a log line.
    async fn abort_without_session(&self, peer: &str, why: &Error, aborts: Vec<Message>) {
        if refused_by_peer(why) && !aborts.is_empty() {
            let cfg = &self.state.config();
            let limit = cfg.connect_timeout + cfg.handshake_timeout * 3;
            let send = self.connector.send_aborts(&self.state, peer, aborts);
            match tokio::time::timeout(limit, send).await {
                Ok(Ok(())) => return,
                Ok(Err(e)) => {
                    tracing::warn!(peer, error = %e, "could not send aborts to a peer that refused this engine's session; it frees those blocks at its abort timeout")
                }
                Err(_) => {
                    tracing::warn!(
                        peer,
                        ?limit,
                        "sending aborts to a peer that refused this engine's session timed out"
                    )
                }
            }
        }
        tracing::warn!(peer, error = %why, "could not send control messages (notices, application messages): no session to the peer");
    }

    /// Queues `msg` on `conn` (none: it cannot be sent); application messages are counted.
    fn hand_over(&self, conn: Option<&Arc<PeerConn>>, msg: Message) {
        let app = matches!(msg, Message::AppMessage { .. });
        let sent = conn.is_some_and(|c| c.control.notify(msg));
        if app {
            let c = &self.state.counters();
            let c = if sent {
                &c.messages_sent
            } else {
                &c.messages_unsent
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What is known of the session with `peer`, without waiting or connecting.
    pub(crate) fn state(&self, peer: &str) -> SessionState {
        match self.map.lock().get(peer) {
            None => SessionState::None,
            Some(Slot::Connecting(_)) => SessionState::Connecting,
            Some(Slot::Ready(c, _)) if !c.is_broken() => SessionState::Up,
            Some(Slot::Ready(..)) => SessionState::Down(
                "the session ended (its connection closed, or the peer fell silent)".into(),
            ),
            Some(Slot::Failed(e, _)) => SessionState::Down(e.to_string()),
        }
    }

    /// The cached session if it is ready and healthy (a use: its idle wait starts again).
    pub(crate) fn ready_conn(&self, peer: &str) -> Option<Arc<PeerConn>> {
        match self.map.lock().get_mut(peer) {
            Some(Slot::Ready(c, idle)) if !c.is_broken() => {
                idle.touch();
                Some(c.clone())
            }
            _ => None,
        }
    }

    /// Sessions up now (healthy, in the cache).
    pub(crate) fn up(&self) -> usize {
        let map = self.map.lock();
        map.values()
            .filter(|s| matches!(s, Slot::Ready(c, _) if !c.is_broken()))
            .count()
    }

    /// Takes out of the cache, as of a reaper tick at `now`, every session nothing but the
    /// cache holds that is broken (its next use would rebuild it anyway), or healthy and unused
    /// for `limit` (see [`IdleClock`]; never when `limit` is zero).
    fn take_unused(&self, now: tokio::time::Instant, limit: Duration) -> Vec<Unused> {
        let mut map = self.map.lock();
        let unused: Vec<(String, bool)> = map
            .iter_mut()
            .filter_map(|(peer, slot)| match slot {
                Slot::Ready(c, clock) => {
                    // The map's own reference is the only one while nothing uses it; a use
                    // clones it under this lock, so none can start unseen.
                    let in_use = Arc::strong_count(c) > 1;
                    let broken = c.is_broken();
                    let close = match (broken, limit.is_zero()) {
                        (true, _) => !in_use,
                        (false, true) => false,
                        (false, false) => clock.tick(now, in_use, limit),
                    };
                    close.then(|| (peer.clone(), broken))
                }
                _ => None,
            })
            .collect();
        unused
            .into_iter()
            .filter_map(|(peer, broken)| match map.remove(&peer) {
                Some(Slot::Ready(conn, _)) => Some(Unused { peer, conn, broken }),
                _ => None,
            })
            .collect()
    }

    /// Closes, in order, the sessions nothing uses that are broken or idle past `limit`: each
    /// peer is told (`Bye`, after any notice queued before it) and keeps this engine's holds
    /// on their abort timeouts; the next read or message to it opens a new session. The closes
    /// run at once, each bounded by the handshake timeout, so a stalled peer delays no other.
    pub(crate) async fn close_unused(&self, limit: Duration) {
        let unused = self.take_unused(tokio::time::Instant::now(), limit);
        let within = self.state.config().handshake_timeout;
        let mut closing = tokio::task::JoinSet::new();
        for Unused { peer, conn, broken } in unused {
            let state = self.state.clone();
            closing.spawn(async move {
                let told = conn.control.close(within).await;
                let generation = conn.generation;
                if broken {
                    tracing::debug!(%peer, generation, told, "broken session nothing uses: closed");
                } else {
                    let closed = &state.counters().sessions_closed_idle;
                    closed.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%peer, generation, told, ?limit, "session idle: closed (the next read opens a new one)");
                }
            });
        }
        while closing.join_next().await.is_some() {}
    }

    /// Runs [`close_unused`](Self::close_unused) on `rt` for as long as the cache exists: every
    /// quarter of `session_idle` (50 ms to 5 s), or every 5 s when it is zero (broken sessions
    /// only).
    pub(crate) fn spawn_reaper(self: &Arc<Self>, rt: &tokio::runtime::Handle) {
        let limit = self.state.config().session_idle;
        let period = match limit.is_zero() {
            true => idle::MAX_TICK,
            false => idle::tick_period(limit),
        };
        let sessions = Arc::downgrade(self);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(s) = sessions.upgrade() else { break };
                s.close_unused(limit).await;
            }
        });
    }

    /// The session to `peer`, connecting once however many callers ask at the same time. A
    /// failed connect fails every waiting caller with its reason; the next call tries again.
    // Long: one connect per peer however many callers wait: the slot's states (absent, connecting,
    //   up) and the waiters' loop share the lock and the channel.
    pub(crate) async fn get(self: &Arc<Self>, peer: &str) -> Result<Arc<PeerConn>> {
        let mut rx = {
            let mut map = self.map.lock();
            match map.get_mut(peer) {
                Some(Slot::Ready(c, idle)) if !c.is_broken() => {
                    idle.touch();
                    return Ok(c.clone());
                }
                Some(Slot::Connecting(rx)) => rx.clone(),
                Some(Slot::Failed(e, until)) if tokio::time::Instant::now() < *until => {
                    return Err(e.clone())
                }
                other => {
                    let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
                    if let Some(Slot::Ready(old, _)) = other {
                        tracing::warn!(
                            peer,
                            old_generation = old.generation,
                            generation,
                            "session broken; rebuilding it"
                        );
                    }
                    let (tx, rx) = watch::channel(None);
                    map.insert(peer.to_string(), Slot::Connecting(rx.clone()));
                    let sessions = self.clone();
                    let peer = peer.to_string();
                    tokio::spawn(async move {
                        let state = &sessions.state;
                        let cfg = &state.config();
                        // The whole connect (name lookup, handshake, queue pairs or streams) is
                        // bounded, so a slot never stays "connecting" for ever.
                        let limit = cfg.connect_timeout * 2 + cfg.handshake_timeout * 3;
                        let result = match tokio::time::timeout(
                            limit,
                            sessions.connector.connect(state, &peer, generation),
                        )
                        .await
                        {
                            Ok(r) => r.map(Arc::new),
                            Err(_) => Err(Error::Timeout {
                                what: format!("connecting to {peer} (all steps)"),
                                after: limit,
                            }),
                        };
                        {
                            let mut map = sessions.map.lock();
                            match &result {
                                Ok(c) => {
                                    let opened = &state.counters().sessions_opened;
                                    opened.fetch_add(1, Ordering::Relaxed);
                                    map.insert(
                                        peer.clone(),
                                        Slot::Ready(c.clone(), IdleClock::default()),
                                    );
                                }
                                Err(e) => {
                                    tracing::warn!(%peer, error = %e, "connecting to peer failed");
                                    let until = tokio::time::Instant::now() + FAILURE_MEMORY;
                                    map.insert(peer.clone(), Slot::Failed(e.clone(), until));
                                }
                            }
                        }
                        let _ = tx.send(Some(result));
                    });
                    rx
                }
            }
        };
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return r;
            }
            if rx.changed().await.is_err() {
                // The connect task ended without an answer (runtime shutting down, or a panic):
                // free the slot so the next call starts afresh.
                let mut map = self.map.lock();
                if matches!(map.get(peer), Some(Slot::Connecting(_))) {
                    map.remove(peer);
                }
                return Err(Error::ConnectionLost {
                    peer: peer.to_string(),
                    reason: "the connection attempt was abandoned".into(),
                });
            }
        }
    }
}
