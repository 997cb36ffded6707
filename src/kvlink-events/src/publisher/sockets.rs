//! Binding or connecting the publisher's sockets by vLLM's endpoint rules; bound TCP endpoints
//! are served through the frame guard.

use tokio::task::JoinHandle;
use zeromq::{PubSocket, Socket};

use crate::endpoint::{self, Attach};
use crate::fanout::{Fanout, QueueBound};
use crate::guard::{self, Limits, PrivateDir};
use crate::EventsError;

/// The live PUB side: the publisher's own for a bound tcp endpoint ([`Fanout`]: payloads
/// written from their own memory, sent to from the callers' threads), the `zeromq` crate's PUB
/// socket for ipc endpoints and connected ones (served by the send loop).
pub(super) enum PubSink {
    Fanout(Fanout),
    Zmq(PubSocket),
}

/// Binds or connects the live PUB endpoint following vLLM's rules; returns the endpoint peers
/// use (the real port when 0 was asked) and the socket.
pub(super) async fn attach_pub(
    endpoint: &str,
    dp_rank: u32,
    dir: &PrivateDir,
    limits: Limits,
    bound: QueueBound,
) -> Result<(String, PubSink), EventsError> {
    let r = endpoint::resolve(endpoint, dp_rank)?;
    if r.attach == Attach::Bind && !r.endpoint.starts_with("ipc://") {
        let (listener, local) = listen(&r.endpoint).await?;
        return Ok((
            format!("tcp://{local}"),
            PubSink::Fanout(Fanout::start(listener, limits, bound)),
        ));
    }
    let mut socket = PubSocket::new();
    let (resolved, front) =
        attach(&mut socket, endpoint, dp_rank, false, dir, "pub", limits).await?;
    debug_assert!(front.is_none(), "only bound tcp endpoints are fronted");
    Ok((resolved, PubSink::Zmq(socket)))
}

/// Binds a tcp listener for `endpoint`; returns it and its local address.
async fn listen(
    endpoint: &str,
) -> Result<(tokio::net::TcpListener, std::net::SocketAddr), EventsError> {
    let addr = endpoint::tcp_listen_addr(endpoint)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| EventsError::Io {
            context: format!("binding {endpoint} ({addr})"),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| EventsError::Io {
        context: "reading the bound address".into(),
        source,
    })?;
    Ok((listener, local))
}

fn zmq_err(context: String) -> impl FnOnce(zeromq::ZmqError) -> EventsError {
    move |source| EventsError::Zmq { context, source }
}

/// Binds or connects `socket` following vLLM's rules; returns the endpoint peers use (the real
/// port when 0 was asked) and the guard task serving it, if any.
pub(super) async fn attach<S: Socket>(
    socket: &mut S,
    endpoint: &str,
    dp_rank: u32,
    force_bind: bool,
    dir: &PrivateDir,
    name: &str,
    limits: Limits,
) -> Result<(String, Option<JoinHandle<()>>), EventsError> {
    let r = endpoint::resolve(endpoint, dp_rank)?;
    if r.attach == Attach::Connect && !force_bind {
        socket
            .connect(&r.endpoint)
            .await
            .map_err(zmq_err(format!("connecting to {}", r.endpoint)))?;
        return Ok((r.endpoint, None));
    }
    if r.endpoint.starts_with("ipc://") {
        let _ = std::fs::remove_file(&r.endpoint["ipc://".len()..]);
        socket
            .bind(&r.endpoint)
            .await
            .map_err(zmq_err(format!("binding {}", r.endpoint)))?;
        return Ok((r.endpoint, None));
    }
    let (listener, local) = listen(&r.endpoint).await?;
    let path = dir.path(name);
    socket
        .bind(&guard::ipc_endpoint(&path))
        .await
        .map_err(zmq_err(format!(
            "binding the local socket {}",
            path.display()
        )))?;
    Ok((
        format!("tcp://{local}"),
        Some(guard::front(listener, path, limits)),
    ))
}
