//! Binding or connecting the publisher's sockets by vLLM's endpoint rules; bound TCP endpoints
//! are served through the frame guard.

use tokio::task::JoinHandle;
use zeromq::Socket;

use crate::events::endpoint::{self, Attach};
use crate::events::guard::{self, Limits, PrivateDir};
use crate::events::EventsError;

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
    let addr = endpoint::tcp_listen_addr(&r.endpoint)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| EventsError::Io {
            context: format!("binding {} ({addr})", r.endpoint),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| EventsError::Io {
        context: "reading the bound address".into(),
        source,
    })?;
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
