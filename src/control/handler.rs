//! What the handshake service needs from the engine ([`ControlHandler`]): its descriptor and
//! key, and what to do with each reader's notices, messages and queue-pair requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::messages::Descriptor;
use crate::auth::{AuthKey, SessionSecret};
use crate::completion::SendNotice;
use crate::error::{RdmaError, Refusal};
use crate::ids::RequestId;
use crate::tp::Reader;
use crate::transport::rdma::{QpEndpoint, ServerQps};

/// What the handshake service needs from the engine.
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
    ) -> std::result::Result<Duration, Refusal>;
    /// An application message from reader engine `from` (after its handshake); refused, with
    /// the reason, when too large or when the inbox is full.
    fn message(
        &self,
        peer: SocketAddr,
        from: &str,
        body: Vec<u8>,
    ) -> std::result::Result<(), Refusal>;
    /// A handshake ended: accepted or refused.
    fn handshake(&self, accepted: bool);
    /// A reader asks for queue pairs connected to its own. Returns ours and a guard that keeps
    /// them alive for as long as the control connection lives.
    fn rdma_accept(
        &self,
        peer: SocketAddr,
        device: u32,
        qps: &[QpEndpoint],
    ) -> std::result::Result<(Vec<QpEndpoint>, ServerQps), RdmaError>;
    /// The deployment key readers must prove; `None` serves readers without authentication.
    fn auth_key(&self) -> Option<&AuthKey>;
    /// An authenticated session of `reader` began: its data connections present this secret's
    /// proofs.
    fn session_opened(&self, secret: SessionSecret, reader: Reader);
    /// That session ended: its secret no longer opens data connections.
    fn session_closed(&self, id: [u8; 16]);
    /// An accepted control session of `reader` began (authenticated, where there is a key).
    fn reader_connected(&self, reader: &Reader);
    /// That session ended, for whatever reason but a `Bye`: the reader's holds go on a lease
    /// once it has no session left.
    fn reader_disconnected(&self, reader: &Reader);
    /// That session ended in order (the reader said `Bye`, closing it idle): its holds keep
    /// their abort timeouts.
    fn reader_left(&self, reader: &Reader);
    /// `from` announces it is reading request `id` (under hold `hold`, when named); refused,
    /// with the reason, when the request is not held for it.
    fn reading(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
    ) -> std::result::Result<(), Refusal>;
    /// `from` pins request `id`'s hold (`hold`, when named) for `pin` as it posts an RDMA
    /// read (`completion::tracker::pin`), being admitted as by [`reading`](Self::reading);
    /// refused, with the reason, when it may not be (nothing pinned then). Returns how long
    /// the request had been held.
    fn pin(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
        pin: Duration,
    ) -> std::result::Result<Duration, Refusal>;
    /// `from` follows request `id` (hold `hold`, when named): `follower` is told of its hold's
    /// blocks as they are held, and a request not held yet is waited for up to `wait` (bounded
    /// by the engine). Refused, with the reason, when the reader may not read the request or
    /// too many follows wait.
    fn follow(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
        wait: std::time::Duration,
        follower: std::sync::Arc<dyn crate::completion::Follower>,
    ) -> std::result::Result<(), Refusal>;
}
