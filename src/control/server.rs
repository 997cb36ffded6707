//! The handshake service: answers `Hello` with this engine's descriptor, then takes the
//! reader's done/abort notices for as long as the connection lives.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

use super::frame::{self, read_frame, write_frame};
use super::messages::{Descriptor, Message};
use super::ControlTimeouts;
use crate::auth::{self, AuthKey, SessionSecret};
use crate::completion::SendNotice;
use crate::conn_limit::{ConnLimit, MAX_CONNECTIONS};
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::log_limit::{warn_limited, LogLimit};
use crate::tp::{Reader, TpRank};
use crate::transport::rdma::QpEndpoint;

/// What the handshake service needs from the engine.
/// Most RDMA connects (one per device pair) one control connection may make.
const MAX_RDMA_CONNECTS: usize = 16;

pub(crate) trait ControlHandler: Send + Sync + 'static {
    /// This engine's descriptor; `None` until a KV layout is set.
    fn descriptor(&self) -> Option<Arc<Descriptor>>;
    /// Reader `from`'s notice about a send; refused (with the reason) when the request is not
    /// held, or is held for other readers. Returns how long the request had been held.
    fn notice(
        &self,
        peer: SocketAddr,
        from: &Reader,
        id: RequestId,
        notice: SendNotice,
        hold: Option<u64>,
    ) -> std::result::Result<Duration, String>;
    /// An application message from reader engine `from` (after its handshake); refused, with
    /// the reason, when too large or when the inbox is full.
    fn message(
        &self,
        peer: SocketAddr,
        from: &str,
        body: Vec<u8>,
    ) -> std::result::Result<(), String>;
    /// A handshake ended: accepted or refused.
    fn handshake(&self, accepted: bool);
    /// A reader asks for queue pairs connected to its own. Returns ours and a guard that keeps
    /// them alive for as long as the control connection lives.
    fn rdma_accept(
        &self,
        peer: SocketAddr,
        device: u32,
        qps: &[QpEndpoint],
    ) -> std::result::Result<(Vec<QpEndpoint>, Box<dyn std::any::Any + Send>), String>;
    /// The deployment key readers must prove; `None` serves readers without authentication.
    fn auth_key(&self) -> Option<&AuthKey>;
    /// An authenticated session of `reader` began: its data connections present this secret's
    /// proofs.
    fn session_opened(&self, secret: SessionSecret, reader: Reader);
    /// That session ended: its secret no longer opens data connections.
    fn session_closed(&self, id: [u8; 16]);
    /// An accepted control session of `reader` began (authenticated, where there is a key).
    fn reader_connected(&self, reader: &Reader);
    /// That session ended, for whatever reason: the reader's holds go on a lease once it has
    /// no session left.
    fn reader_disconnected(&self, reader: &Reader);
    /// `from` announces it is reading request `id` (under hold `hold`, when named); refused,
    /// with the reason, when the request is not held for it.
    fn reading(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
    ) -> std::result::Result<(), String>;
}

/// Accepts control connections until the task is dropped: at most [`MAX_CONNECTIONS`] at once,
/// `per_ip` of them from one address.
pub(crate) async fn serve(
    listener: TcpListener,
    handler: Arc<dyn ControlHandler>,
    timeouts: ControlTimeouts,
    per_ip: usize,
) {
    // Peers can trigger these at will: one line per interval, with the count.
    static FULL: LogLimit = LogLimit::new(Duration::from_secs(10));
    static CLOSED: LogLimit = LogLimit::new(Duration::from_secs(1));
    let slots = ConnLimit::new(MAX_CONNECTIONS, per_ip);
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let permit = match slots.admit(peer.ip()) {
                    Ok(p) => p,
                    Err(full) => {
                        warn_limited!(FULL, %peer, "refusing a control connection: {full}");
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    if let Err(e) = connection(stream, peer, handler.clone(), timeouts).await {
                        warn_limited!(CLOSED, %peer, error = %e, "control connection closed with an error");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a control connection failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn refuse(stream: &mut TcpStream, message: String) -> Error {
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
    stream: TcpStream,
    peer: SocketAddr,
    handler: Arc<dyn ControlHandler>,
    timeouts: ControlTimeouts,
) -> Result<()> {
    session(stream, peer, &handler, timeouts).await
}

async fn session(
    mut stream: TcpStream,
    peer: SocketAddr,
    handler: &Arc<dyn ControlHandler>,
    timeouts: ControlTimeouts,
) -> Result<()> {
    // Handshake: the first frame must be a Hello, within the handshake deadline.
    // Before a peer proves the key, a keyed engine reads at most a small frame from it.
    let first_limit = match handler.auth_key() {
        Some(_) => frame::MAX_UNAUTHENTICATED_FRAME_BYTES,
        None => frame::MAX_FRAME_BYTES,
    };
    let first = match timeout(
        timeouts.handshake,
        frame::read_frame_up_to(&mut stream, first_limit),
    )
    .await
    {
        Err(_) => {
            return Err(refuse_handshake(
                &mut stream,
                &**handler,
                format!("no Hello within {:?}", timeouts.handshake),
            )
            .await)
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(f))) => f,
        Ok(Err(e)) => {
            let why = match handler.auth_key() {
                // Most likely a Hello from an engine without the key: say what to do.
                Some(_) => format!(
                    "this engine requires authentication: set the deployment key \
                     (KVLINK_AUTH_KEY or KVLINK_AUTH_KEY_FILE) on every engine ({e})"
                ),
                None => e.to_string(),
            };
            return Err(refuse_handshake(&mut stream, &**handler, why).await);
        }
    };
    let first = frame::decode::<Message>(first.0, &first.1);
    let (theirs, secret) = match (handler.auth_key(), first) {
        (None, Ok(Message::Hello { descriptor })) => (descriptor, None),
        (None, Ok(Message::AuthHello { .. })) => {
            return Err(refuse_handshake(
                &mut stream,
                &**handler,
                "this engine has no authentication key; give every engine the same \
                 KVLINK_AUTH_KEY, or none"
                    .into(),
            )
            .await)
        }
        (Some(key), Ok(Message::AuthHello { client_nonce })) => {
            match authenticate(&mut stream, peer, key, client_nonce, timeouts).await {
                Ok(r) => r,
                Err(why) => return Err(refuse_handshake(&mut stream, &**handler, why).await),
            }
        }
        // Nothing about this engine goes to a peer that has not proved the key.
        (Some(_), Ok(_)) => {
            return Err(refuse_handshake(
                &mut stream,
                &**handler,
                "this engine requires authentication: set the deployment key \
                 (KVLINK_AUTH_KEY or KVLINK_AUTH_KEY_FILE) on every engine"
                    .into(),
            )
            .await)
        }
        (None, Ok(other)) => {
            return Err(refuse_handshake(
                &mut stream,
                &**handler,
                format!("expected Hello first, got {other:?}"),
            )
            .await)
        }
        (_, Err(e)) => return Err(refuse_handshake(&mut stream, &**handler, e.to_string()).await),
    };
    if let Err(e) = theirs.validate() {
        return Err(refuse_handshake(&mut stream, &**handler, e.to_string()).await);
    }
    let Some(ours) = handler.descriptor() else {
        return Err(refuse_handshake(
            &mut stream,
            &**handler,
            "this engine has no KV layout registered yet; retry once it has".into(),
        )
        .await);
    };
    let reader = Reader {
        engine: theirs.engine_id.clone(),
        tp: TpRank::new(theirs.tp_rank, theirs.tp_size),
    };
    let diffs = ours.differences(&theirs);
    if !diffs.is_empty() {
        let refused = refuse_handshake(
            &mut stream,
            &**handler,
            format!(
                "incompatible with engine {} (its value vs yours): {}",
                ours.engine_id,
                diffs.join("; ")
            ),
        )
        .await;
        aborts_after_refusal(&mut stream, peer, &reader, &**handler, timeouts).await;
        return Err(refused);
    }
    let reply = frame::encode(&Message::Descriptor(Box::new((*ours).clone())))?;
    handler.handshake(true);
    // Data connections of this session are accepted while it lives; the reader's holds are
    // on a lease while it has no session.
    let _session = secret.map(|s| SessionGuard::open(handler.clone(), s, reader.clone()));
    let _present = Presence::open(handler.clone(), reader.clone());
    timeout(timeouts.handshake, write_frame(&mut stream, &reply))
        .await
        .map_err(|_| Error::Timeout {
            what: "sending the descriptor".into(),
            after: timeouts.handshake,
        })??;
    tracing::info!(
        %peer, engine = %theirs.engine_id, rank = theirs.tp_rank, tp = %ours.tp_relation(&theirs),
        "handshake accepted"
    );

    // Notices, keep-alives and queue-pair exchanges until the reader goes away or falls silent.
    let idle = timeouts.keepalive * 3;
    // Queue pairs made for this reader, one set per RDMA device it connects (kept alive with
    // the control connection).
    let mut rdma_qps: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
    let mut bad_notices = 0u64;
    // Notices the engine refused (not held, or held for another reader): one line per
    // interval for the whole engine, with the count; the session goes on.
    static REFUSED: LogLimit = LogLimit::new(Duration::from_secs(1));
    let from = theirs.engine_id.as_str();
    let refused = |id: &RequestId, r: std::result::Result<(), String>| {
        if let Err(why) = r {
            warn_limited!(REFUSED, %peer, engine = from, %id, %why, "refused a reader's notice");
        }
    };
    loop {
        let frame = match timeout(idle, read_frame(&mut stream)).await {
            Err(_) => {
                // The protocol's promise: a refusal is said before the connection closes.
                let why = format!("no frame from {peer} for {idle:?} (three keep-alive intervals)");
                refuse(&mut stream, why.clone()).await;
                return Err(Error::Timeout {
                    what: format!("waiting for a frame from {peer}"),
                    after: idle,
                });
            }
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(f))) => f,
            Ok(Err(e)) => return Err(refuse(&mut stream, e.to_string()).await),
        };
        match frame::decode::<Message>(frame.0, &frame.1) {
            Ok(Message::Done { request_id, hold }) if request_id.validate().is_ok() => {
                // Answered either way: the reader reports the request received only once
                // this engine confirms it still held the blocks for it.
                let r = handler.notice(peer, &reader, request_id.clone(), SendNotice::Done, hold);
                let answer = frame::encode(&Message::Confirm {
                    request_id: request_id.clone(),
                    refused: r.clone().err(),
                    held_us: r.as_ref().map_or(0, |d| d.as_micros() as u64),
                })?;
                refused(&request_id, r.map(drop));
                timeout(timeouts.handshake, write_frame(&mut stream, &answer))
                    .await
                    .map_err(|_| Error::Timeout {
                        what: "confirming a done notice".into(),
                        after: timeouts.handshake,
                    })??;
            }
            Ok(Message::Reading { request_id, hold }) if request_id.validate().is_ok() => {
                tracing::debug!(%peer, id = %request_id, ?hold, "reader announced a read");
                let r = handler.reading(&reader, &request_id, hold);
                refused(&request_id, r);
            }
            Ok(Message::Abort {
                request_id,
                reason,
                hold,
            }) if request_id.validate().is_ok() => {
                let reason: String = reason.chars().take(1024).collect();
                let aborted = SendNotice::Aborted(reason);
                let r = handler.notice(peer, &reader, request_id.clone(), aborted, hold);
                refused(&request_id, r.map(drop));
            }
            // A notice naming an invalid id (empty, too long) is refused alone: the session and
            // the other requests on it go on.
            Ok(
                Message::Done { request_id, .. }
                | Message::Abort { request_id, .. }
                | Message::Reading { request_id, .. },
            ) => {
                bad_notices += 1;
                if bad_notices == 1 {
                    tracing::warn!(%peer, len = request_id.as_str().len(), "notice with an invalid request id ignored (further ones on this connection are counted, not logged)");
                }
            }
            // Refused alone (too large, inbox full): the session goes on; the engine counts and
            // logs it.
            Ok(Message::AppMessage { body }) => {
                if let Err(why) = handler.message(peer, from, body.0) {
                    warn_limited!(REFUSED, %peer, engine = from, %why, "refused a peer's message");
                }
            }
            Ok(Message::RdmaConnect {
                generation,
                device,
                qps,
            }) if rdma_qps.len() < MAX_RDMA_CONNECTS => {
                match handler.rdma_accept(peer, device, &qps) {
                    Ok((ours, guard)) => {
                        rdma_qps.push(guard);
                        let reply = frame::encode(&Message::RdmaAccept {
                            generation,
                            qps: ours,
                        })?;
                        timeout(timeouts.handshake, write_frame(&mut stream, &reply))
                            .await
                            .map_err(|_| Error::Timeout {
                                what: "answering an RDMA connect".into(),
                                after: timeouts.handshake,
                            })??;
                        tracing::info!(%peer, generation, "RDMA queue pairs connected");
                    }
                    // One device pair that cannot connect leaves the session and its other
                    // devices alone: the reader hears why and goes on without it.
                    Err(e) => {
                        tracing::warn!(%peer, device, error = %e, "RDMA connect refused");
                        let answer = frame::encode(&Message::Error {
                            message: format!("RDMA connect refused: {e}"),
                        })?;
                        timeout(timeouts.handshake, write_frame(&mut stream, &answer))
                            .await
                            .map_err(|_| Error::Timeout {
                                what: "refusing an RDMA connect".into(),
                                after: timeouts.handshake,
                            })??;
                    }
                }
            }
            Ok(Message::Ping { nonce }) => {
                let pong = frame::encode(&Message::Pong { nonce })?;
                timeout(timeouts.handshake, write_frame(&mut stream, &pong))
                    .await
                    .map_err(|_| Error::Timeout {
                        what: "answering a ping".into(),
                        after: timeouts.handshake,
                    })??;
            }
            Ok(other) => {
                return Err(refuse(&mut stream, format!("unexpected message {other:?}")).await)
            }
            Err(e) => return Err(refuse(&mut stream, e.to_string()).await),
        }
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

/// Tells the engine a reader's accepted session began, and ended (on every path out).
struct Presence {
    handler: Arc<dyn ControlHandler>,
    reader: Reader,
}

impl Presence {
    fn open(handler: Arc<dyn ControlHandler>, reader: Reader) -> Presence {
        handler.reader_connected(&reader);
        Presence { handler, reader }
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        self.handler.reader_disconnected(&self.reader);
    }
}

/// The server's side of the challenge-response: answers the reader's nonce with its own and its
/// proof, expects the reader's proof (a small frame), then reads its Hello. The refusal says
/// only that authentication failed.
async fn authenticate(
    stream: &mut TcpStream,
    peer: SocketAddr,
    key: &AuthKey,
    client_nonce: [u8; 32],
    timeouts: ControlTimeouts,
) -> std::result::Result<(Box<Descriptor>, Option<SessionSecret>), String> {
    let server_nonce = auth::nonce().map_err(|e| e.to_string())?;
    let challenge = frame::encode(&Message::AuthChallenge {
        server_nonce,
        server_proof: auth::server_proof(key, &client_nonce, &server_nonce),
    })
    .map_err(|e| e.to_string())?;
    match timeout(timeouts.handshake, write_frame(stream, &challenge)).await {
        Ok(Ok(())) => {}
        _ => return Err("could not send the authentication challenge".into()),
    }
    let proof = timeout(
        timeouts.handshake,
        frame::read_frame_up_to(stream, frame::MAX_UNAUTHENTICATED_FRAME_BYTES),
    );
    let frame = match proof.await {
        Ok(Ok(Some(f))) => f,
        Err(_) => {
            return Err(format!(
                "no answer to the challenge within {:?}",
                timeouts.handshake
            ))
        }
        Ok(Ok(None)) | Ok(Err(_)) => return Err("authentication failed".into()),
    };
    match frame::decode::<Message>(frame.0, &frame.1) {
        Ok(Message::AuthProof { client_proof })
            if auth::client_proof_checks(key, &client_nonce, &server_nonce, &client_proof) => {}
        _ => return Err("authentication failed".into()),
    }
    tracing::debug!(%peer, "reader authenticated");
    // Authenticated: the Hello may be as large as any frame.
    let frame = match timeout(timeouts.handshake, read_frame(stream)).await {
        Ok(Ok(Some(f))) => f,
        Err(_) => return Err(format!("no Hello within {:?}", timeouts.handshake)),
        Ok(Ok(None)) => return Err("the reader closed before its Hello".into()),
        Ok(Err(e)) => return Err(e.to_string()),
    };
    match frame::decode::<Message>(frame.0, &frame.1) {
        Ok(Message::Hello { descriptor }) => Ok((
            descriptor,
            Some(SessionSecret::derive(key, &client_nonce, &server_nonce)),
        )),
        Ok(other) => Err(format!(
            "expected Hello after authentication, got {other:?}"
        )),
        Err(e) => Err(e.to_string()),
    }
}
