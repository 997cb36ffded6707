//! The session proof of a data connection, both sides: on an engine with a deployment key,
//! the data server sends a fresh nonce ([`challenge`]) and the reader answers with its
//! authenticated control session's id and that session's proof over the nonce ([`answer`]).
//! Nothing is served before the proof checks.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::timeout;

use super::access::{Exports, SessionReader};
use super::frame::{AUTH_NONCE, AUTH_REPLY};
use crate::auth::{self, SessionSecret};
use crate::error::{Error, Result};

/// How long a new data connection has to prove its session.
const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// The data server's side of the session proof: sends a fresh nonce, expects the session id and
/// the session's proof over the nonce (`AUTH_REPLY` bytes) within a few seconds. Returns the
/// session's id and the reader it declared.
pub(crate) async fn challenge<S>(
    stream: &mut S,
    exports: &dyn Exports,
    io_timeout: Duration,
) -> Result<SessionReader>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let deadline = PROOF_DEADLINE.min(io_timeout);
    let timed_out = |what: &str| Error::Timeout {
        what: what.into(),
        after: deadline,
    };
    let nonce = auth::nonce()?;
    timeout(deadline, stream.write_all(&nonce))
        .await
        .map_err(|_| timed_out("sending the session challenge"))?
        .map_err(|e| Error::io("sending the session challenge", &e))?;
    let mut reply = [0u8; AUTH_REPLY];
    timeout(deadline, stream.read_exact(&mut reply))
        .await
        .map_err(|_| timed_out("waiting for the session proof"))?
        .map_err(|e| Error::io("reading the session proof", &e))?;
    let (id, proof) = reply.split_at(16);
    let id: [u8; 16] = id.try_into().expect("16 bytes");
    match exports.data_session(&id) {
        Some((s, engine)) if s.verify_data(&nonce, proof) => Ok((id, engine)),
        _ => Err(Error::Protocol(
            "data connection without a valid session proof".into(),
        )),
    }
}

/// The reader's side of the data server's session challenge: reads its nonce, answers with the
/// session id and the session's proof over it.
pub(crate) async fn answer<S>(
    s: &mut S,
    session: &SessionSecret,
    peer: impl std::fmt::Display,
    limit: Duration,
) -> Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let what = format!("proving the session to the data server {peer}");
    let mut nonce = [0u8; AUTH_NONCE];
    timeout(limit, s.read_exact(&mut nonce))
        .await
        .map_err(|_| Error::Timeout {
            what: what.clone(),
            after: limit,
        })?
        .map_err(|e| Error::io(&what, &e))?;
    let mut reply = [0u8; AUTH_REPLY];
    reply[..16].copy_from_slice(&session.id);
    reply[16..].copy_from_slice(&session.data_proof(&nonce));
    timeout(limit, s.write_all(&reply))
        .await
        .map_err(|_| Error::Timeout {
            what: what.clone(),
            after: limit,
        })?
        .map_err(|e| Error::io(&what, &e))
}
