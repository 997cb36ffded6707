//! The handshake a reader's control connection opens with: its `Hello` (after the
//! challenge-response, on an engine with a key), checked and compared with this engine's
//! descriptor. It only decides: the server counts the outcome, says a refusal and serves an
//! accepted reader.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::time::timeout;

use super::frame::{self, read_frame, write_frame};
use super::handler::ControlHandler;
use super::messages::{Descriptor, Message};
use super::ControlTimeouts;
use crate::auth::{self, AuthKey, SessionSecret};
use crate::error::{Refusal, RefusalKind};
use crate::tp::{Reader, TpRank};

/// How a handshake ended.
pub(super) enum Outcome {
    /// The reader is to be served.
    Accepted(Accepted),
    /// Refused: the reader is told why, nothing else.
    Refused(Refused),
    /// The peer closed the connection before its first frame.
    Closed,
}

/// An accepted reader: who it is, both engines' descriptors, and the session's secret when
/// this engine has a key.
pub(super) struct Accepted {
    pub(super) reader: Reader,
    pub(super) theirs: Box<Descriptor>,
    pub(super) ours: Arc<Descriptor>,
    pub(super) secret: Option<SessionSecret>,
}

/// A refused handshake: the reason the reader is told and, for a reader refused only for its
/// layout (it proved the key, where there is one, and its descriptor is valid), that reader:
/// its `Abort` notices are still taken for a while (`server::aborts_after_refusal`).
pub(super) struct Refused {
    pub(super) reason: Refusal,
    pub(super) aborts_from: Option<Reader>,
}

impl From<Refusal> for Refused {
    fn from(reason: Refusal) -> Self {
        Refused {
            reason,
            aborts_from: None,
        }
    }
}

/// Runs the handshake: the first frame must be a `Hello` (an `AuthHello` and the challenge
/// first, on an engine with a key) within the handshake deadline, with a valid descriptor
/// compatible with this engine's. Before a peer proves the key, a keyed engine reads at most a
/// small frame from it, and tells it nothing about itself.
pub(super) async fn handshake(
    stream: &mut TcpStream,
    peer: SocketAddr,
    handler: &dyn ControlHandler,
    timeouts: ControlTimeouts,
) -> Outcome {
    let hello = match hello(stream, peer, handler.auth_key(), timeouts).await {
        Ok(Some(h)) => h,
        Ok(None) => return Outcome::Closed,
        Err(why) => return Outcome::Refused(why.into()),
    };
    let (theirs, secret) = hello;
    if let Err(e) = theirs.validate() {
        return Outcome::Refused(Refusal::new(RefusalKind::Malformed, e.to_string()).into());
    }
    let Some(ours) = handler.descriptor() else {
        return Outcome::Refused(
            Refusal::new(
                RefusalKind::NotReady,
                "this engine has no KV layout registered yet; retry once it has",
            )
            .into(),
        );
    };
    let reader = Reader {
        engine: theirs.engine_id.clone(),
        tp: TpRank::new(theirs.tp_rank, theirs.tp_size),
    };
    let diffs = ours.differences(&theirs);
    if !diffs.is_empty() {
        return Outcome::Refused(Refused {
            reason: Refusal::new(
                RefusalKind::Incompatible,
                format!(
                    "incompatible with engine {} (its value vs yours): {}",
                    ours.engine_id,
                    diffs.join("; ")
                ),
            ),
            aborts_from: Some(reader),
        });
    }
    Outcome::Accepted(Accepted {
        reader,
        theirs,
        ours,
        secret,
    })
}

/// The reader's `Hello` (authenticated first where `key` is set), with the session's secret;
/// `None` when the peer closed before its first frame; the reason to refuse it otherwise.
async fn hello(
    stream: &mut TcpStream,
    peer: SocketAddr,
    key: Option<&AuthKey>,
    timeouts: ControlTimeouts,
) -> std::result::Result<Option<Hello>, Refusal> {
    let first_limit = match key {
        Some(_) => frame::MAX_UNAUTHENTICATED_FRAME_BYTES,
        None => frame::MAX_FRAME_BYTES,
    };
    let first = match timeout(
        timeouts.handshake,
        frame::read_frame_up_to(stream, first_limit),
    )
    .await
    {
        Err(_) => return Err(silent(format!("no Hello within {:?}", timeouts.handshake))),
        Ok(Ok(None)) => return Ok(None),
        Ok(Ok(Some(f))) => f,
        // With a key, most likely a Hello from an engine without it: say what to do.
        Ok(Err(e)) if key.is_some() => {
            return Err(unauthenticated(format!("{KEY_REQUIRED} ({e})")))
        }
        Ok(Err(e)) => return Err(malformed(e.to_string())),
    };
    match (key, frame::decode::<Message>(first.0, &first.1)) {
        (
            None,
            Ok(Message::Hello {
                descriptor,
                session,
            }),
        ) => Ok(Some((descriptor, session.map(SessionSecret::unkeyed)))),
        (None, Ok(Message::AuthHello { .. })) => Err(unauthenticated(
            "this engine has no authentication key; give every engine the same \
             KVLINK_AUTH_KEY, or none",
        )),
        (Some(key), Ok(Message::AuthHello { client_nonce })) => {
            authenticate(stream, peer, key, client_nonce, timeouts)
                .await
                .map(Some)
        }
        // Nothing about this engine goes to a peer that has not proved the key.
        (Some(_), Ok(_)) => Err(unauthenticated(KEY_REQUIRED)),
        (None, Ok(other)) => Err(malformed(format!("expected Hello first, got {other:?}"))),
        (_, Err(e)) => Err(malformed(e.to_string())),
    }
}

fn silent(reason: impl Into<String>) -> Refusal {
    Refusal::new(RefusalKind::Silent, reason)
}

fn unauthenticated(reason: impl Into<String>) -> Refusal {
    Refusal::new(RefusalKind::Unauthenticated, reason)
}

fn malformed(reason: impl Into<String>) -> Refusal {
    Refusal::new(RefusalKind::Malformed, reason)
}

/// What a keyed engine tells a peer that did not prove the key.
const KEY_REQUIRED: &str = "this engine requires authentication: set the deployment key \
     (KVLINK_AUTH_KEY or KVLINK_AUTH_KEY_FILE) on every engine";

/// A reader's descriptor and, on an engine with a key, the session's secret.
type Hello = (Box<Descriptor>, Option<SessionSecret>);

/// The server's side of the challenge-response: answers the reader's nonce with its own and its
/// proof, expects the reader's proof (a small frame), then reads its Hello. The refusal says
/// only that authentication failed.
async fn authenticate(
    stream: &mut TcpStream,
    peer: SocketAddr,
    key: &AuthKey,
    client_nonce: [u8; 32],
    timeouts: ControlTimeouts,
) -> std::result::Result<Hello, Refusal> {
    let server_nonce = auth::nonce().map_err(|e| unauthenticated(e.to_string()))?;
    let challenge = frame::encode(&Message::AuthChallenge {
        server_nonce,
        server_proof: auth::server_proof(key, &client_nonce, &server_nonce),
    })
    .map_err(|e| unauthenticated(e.to_string()))?;
    match timeout(timeouts.handshake, write_frame(stream, &challenge)).await {
        Ok(Ok(())) => {}
        _ => return Err(silent("could not send the authentication challenge")),
    }
    let proof = timeout(
        timeouts.handshake,
        frame::read_frame_up_to(stream, frame::MAX_UNAUTHENTICATED_FRAME_BYTES),
    );
    let frame = match proof.await {
        Ok(Ok(Some(f))) => f,
        Err(_) => {
            return Err(silent(format!(
                "no answer to the challenge within {:?}",
                timeouts.handshake
            )))
        }
        Ok(Ok(None)) | Ok(Err(_)) => return Err(unauthenticated("authentication failed")),
    };
    match frame::decode::<Message>(frame.0, &frame.1) {
        Ok(Message::AuthProof { client_proof })
            if auth::client_proof_checks(key, &client_nonce, &server_nonce, &client_proof) => {}
        _ => return Err(unauthenticated("authentication failed")),
    }
    tracing::debug!(%peer, "reader authenticated");
    // Authenticated: the Hello may be as large as any frame.
    let frame = match timeout(timeouts.handshake, read_frame(stream)).await {
        Ok(Ok(Some(f))) => f,
        Err(_) => return Err(silent(format!("no Hello within {:?}", timeouts.handshake))),
        Ok(Ok(None)) => return Err(silent("the reader closed before its Hello")),
        Ok(Err(e)) => return Err(malformed(e.to_string())),
    };
    match frame::decode::<Message>(frame.0, &frame.1) {
        Ok(Message::Hello { descriptor, .. }) => Ok((
            descriptor,
            Some(SessionSecret::derive(key, &client_nonce, &server_nonce)),
        )),
        Ok(other) => Err(malformed(format!(
            "expected Hello after authentication, got {other:?}"
        ))),
        Err(e) => Err(malformed(e.to_string())),
    }
}
