//! The accept loop of kvlink's three servers (handshake, TCP data, same host): each connection
//! admitted first, then served on a task of its own that holds its admission until it ends.

use std::future::Future;
use std::io;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

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
