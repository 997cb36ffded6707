//! The accept loop of kvlink's three servers (handshake, TCP data, same host): each connection
//! admitted first, then served on a task of its own that holds its admission until it ends.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::conn_limit::ConnLimit;
use crate::log_limit::{warn_limited, LogLimit};

/// The pause after a failed accept (out of descriptors, say) before the next one.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// A listening socket of one of the servers.
pub(crate) trait Listener: Send {
    /// An accepted connection.
    type Stream: Send + 'static;
    /// The address it came from.
    type Peer: Send + 'static;
    /// The next connection.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Self::Peer)>> + Send;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    type Peer = std::net::SocketAddr;
    fn accept(&self) -> impl Future<Output = io::Result<(TcpStream, Self::Peer)>> + Send {
        TcpListener::accept(self)
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    type Peer = tokio::net::unix::SocketAddr;
    fn accept(&self) -> impl Future<Output = io::Result<(UnixStream, Self::Peer)>> + Send {
        UnixListener::accept(self)
    }
}

/// [`serve_admitted`] for a TCP server (control or data): each connection admitted by `slots`
/// (at most [`MAX_CONNECTIONS`](crate::conn_limit::MAX_CONNECTIONS) at once, a share per
/// address; a refusal logged through `refused`, one line per its interval, with the count),
/// Nagle off, then served by `serve`.
pub(crate) async fn serve_tcp<S, F>(
    listener: TcpListener,
    what: &str,
    slots: Arc<ConnLimit>,
    refused: &'static LogLimit,
    serve: S,
) where
    S: Fn(TcpStream, SocketAddr) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let admit = |peer: &SocketAddr| match slots.admit(peer.ip()) {
        Ok(slot) => Some(slot),
        Err(full) => {
            warn_limited!(refused, %peer, "refusing a {what} connection: {full}");
            None
        }
    };
    serve_admitted(listener, what, admit, |stream: TcpStream, peer| {
        let _ = stream.set_nodelay(true);
        serve(stream, peer)
    })
    .await
}

/// Accepts connections on `listener` until the task is dropped. Each one `admit` lets in (it
/// logs its own refusals) is served by `serve` on a task of its own, which holds the admission
/// until the connection ends; a failed accept is logged as one of `what` connections and
/// retried after a pause.
pub(crate) async fn serve_admitted<L, A, S, F>(
    listener: L,
    what: &str,
    mut admit: impl FnMut(&L::Peer) -> Option<A>,
    serve: S,
) where
    L: Listener,
    A: Send + 'static,
    S: Fn(L::Stream, L::Peer) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Some(admission) = admit(&peer) else {
                    continue;
                };
                let connection = serve(stream, peer);
                tokio::spawn(async move {
                    let _admission = admission;
                    connection.await;
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a {what} connection failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
}
