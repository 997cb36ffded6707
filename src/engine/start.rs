//! The steps of `Engine::start`: settling the configuration, opening RDMA, binding the
//! handshake, data and same-host sockets, choosing the address peers are told, and starting
//! the servers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use tokio::net::{TcpListener, UnixListener};
use tokio::runtime::Runtime;

use crate::auth::AuthKey;
use crate::config::{EngineConfig, TransportChoice};
use crate::control;
use crate::error::{Error, Result};
use crate::state::EngineState;
use crate::transport::rdma::{self, RdmaDevice};
use crate::transport::{local, stream, tcp};

/// The configuration as the engine runs it: validated, the key and the insecure opt-in read
/// from the environment where the configuration has none.
pub(super) fn settle(mut config: EngineConfig) -> Result<EngineConfig> {
    config.validate()?;
    if config.auth_key.is_none() {
        config.auth_key = AuthKey::from_env()?;
    }
    config.insecure |= std::env::var("KVLINK_INSECURE").is_ok_and(|v| v == "1");
    Ok(config)
}

/// The RDMA devices the configuration asks for, or why there are none (fatal only when RDMA
/// is required).
pub(super) fn open_rdma(config: &EngineConfig) -> Result<(Vec<Arc<RdmaDevice>>, Option<String>)> {
    Ok(match config.transport {
        TransportChoice::Tcp | TransportChoice::Local => (
            Vec::new(),
            Some(format!(
                "disabled by configuration (transport: {})",
                config.transport
            )),
        ),
        choice => match rdma::probe(&config.rdma) {
            Ok(devs) => (devs, None),
            Err(why) if choice == TransportChoice::Rdma => {
                return Err(Error::RdmaUnavailable(why.to_string()))
            }
            Err(why) => (Vec::new(), Some(why.to_string())),
        },
    })
}

/// The address to listen on. Protected mode: without a key, only this host may reach the
/// engine, unless the configuration opts in to serving anyone.
pub(super) fn listen_addr(config: &EngineConfig) -> Result<SocketAddr> {
    let listen: SocketAddr = config
        .listen
        .parse()
        .map_err(|e| Error::invalid(format!("listen address {:?}: {e}", config.listen)))?;
    if config.auth_key.is_none() && !listen.ip().is_loopback() {
        if !config.insecure {
            return Err(Error::invalid(format!(
                "refusing to listen on {listen} without authentication: set the deployment \
                 key (KVLINK_AUTH_KEY, KVLINK_AUTH_KEY_FILE or auth_key), the same on every \
                 engine, or opt in to serving anyone who can reach this address with \
                 insecure=true (KVLINK_INSECURE=1)"
            )));
        }
        tracing::warn!(%listen, "listening beyond loopback WITHOUT authentication (insecure): any host that reaches these ports can read the exported KV cache");
    }
    Ok(listen)
}

/// The same-host socket, in the abstract namespace of this network namespace: this host's id,
/// the socket's name and its listener; `None` (logged) when there is none.
pub(super) fn bind_same_host(
    runtime: &Runtime,
    generation: u64,
) -> Option<(String, String, UnixListener)> {
    let Some(host) = crate::shm::host_id() else {
        tracing::warn!("no same-host path: this host has no boot id to recognise it by");
        return None;
    };
    let name = local::socket_name(generation);
    match bind_abstract(runtime, &name) {
        Ok(l) => Some((host, name, l)),
        Err(e) => {
            tracing::warn!(error = %e, "no same-host path: binding its socket failed");
            None
        }
    }
}

/// Binds a Unix socket in the abstract namespace inside the engine's runtime.
fn bind_abstract(runtime: &Runtime, name: &str) -> std::io::Result<UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let l = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    l.set_nonblocking(true)?;
    let _guard = runtime.enter();
    UnixListener::from_std(l)
}

/// The handshake service's listener on `listen`, and the data server's on the same address
/// with a port of its own.
pub(super) fn bind_servers(
    runtime: &Runtime,
    listen: SocketAddr,
) -> Result<(TcpListener, TcpListener)> {
    runtime.block_on(async {
        let control = TcpListener::bind(listen)
            .await
            .map_err(|e| Error::io(format!("binding the handshake service to {listen}"), &e))?;
        let data = TcpListener::bind(SocketAddr::new(listen.ip(), 0))
            .await
            .map_err(|e| Error::io(format!("binding the data server on {}", listen.ip()), &e))?;
        Ok((control, data))
    })
}

/// The port a listener got; `what` names it in the error.
pub(super) fn port(l: &TcpListener, what: &str) -> Result<u16> {
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io(format!("{what} address"), &e))
}

/// The address peers are told: `advertise_host`, else the listen address (127.0.0.1 for a
/// wildcard one, with a warning).
pub(super) fn advertise_ip(config: &EngineConfig, listen: SocketAddr) -> Result<IpAddr> {
    Ok(match &config.advertise_host {
        Some(h) => h
            .parse()
            .map_err(|e| Error::invalid(format!("advertise_host {h:?}: {e}")))?,
        None if listen.ip().is_unspecified() => {
            tracing::warn!(
                "listening on a wildcard address without advertise_host; advertising 127.0.0.1"
            );
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        }
        None => listen.ip(),
    })
}

/// Starts the handshake service, the TCP data server and the same-host server (when bound).
pub(super) fn spawn_servers(
    runtime: &Runtime,
    shared: &Arc<EngineState>,
    control: TcpListener,
    data: TcpListener,
    same_host: Option<UnixListener>,
) {
    let limits = stream::ServeLimits {
        io_timeout: shared.config().io_timeout,
        idle_timeout: shared.config().idle_timeout,
        spin: shared.config().spin,
    };
    let (timeouts, slots) = (shared.control_timeouts(), shared.control_slots().clone());
    runtime.spawn(control::serve(control, shared.clone(), timeouts, slots));
    let slots = shared.data_slots().clone();
    runtime.spawn(tcp::serve(data, shared.clone(), limits, slots));
    if let Some(listener) = same_host {
        runtime.spawn(local::serve(listener, shared.clone(), limits));
    }
    if shared.config().open_reads {
        tracing::warn!(
            "open_reads is on: the data server serves any exported byte without a hold \
             (benchmarks and debugging only)"
        );
    }
}

/// `host-pid-rankN-xxxxxxxx`, the suffix random: engines of one process, or of containers that
/// share a hostname and a pid, never share an id (grants name readers by engine id).
pub(super) fn default_engine_id(rank: u32) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    let suffix = generation_nonce() as u32;
    format!("{host}-{}-rank{rank}-{suffix:08x}", std::process::id())
}

/// A random number for this start: its generation, and the same-host socket's name.
pub(super) fn generation_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}
