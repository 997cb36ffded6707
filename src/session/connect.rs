//! Connecting to a peer: name lookup, handshake, transport negotiation (RDMA when both engines
//! have it and the configuration allows, TCP otherwise) and the queue-pair exchange.

use std::net::SocketAddr;
use std::sync::Arc;

use super::{ConnectFuture, Connector, PeerConn};
use crate::auth::SessionSecret;
use crate::config::TransportChoice;
use crate::control::messages::Descriptor;
use crate::control::messages::Message;
use crate::control::ControlClient;
use crate::error::{Error, RdmaError, RdmaErrorKind, Result};
use crate::state::EngineState;
use crate::transport::local::LocalTransport;
use crate::transport::rdma::RdmaConnection;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;

async fn connect(shared: &Arc<EngineState>, peer: &str, generation: u64) -> Result<PeerConn> {
    let cfg = &shared.config;
    let addr: SocketAddr = match peer.parse() {
        Ok(a) => a,
        Err(_) => tokio::net::lookup_host(peer)
            .await
            .map_err(|e| Error::invalid(format!("peer address {peer:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::invalid(format!("peer address {peer:?} resolves to nothing")))?,
    };
    let ours = shared.descriptor().ok_or_else(|| {
        Error::invalid("set a KV layout on this engine before reading from peers")
    })?;
    let (mut hs, theirs, secret) = ControlClient::handshake(
        addr,
        &ours,
        cfg.auth_key.as_ref(),
        shared.control_timeouts(),
    )
    .await?;
    if theirs.tp_size != ours.tp_size {
        tracing::info!(
            peer,
            rank = theirs.tp_rank,
            "TP relation: {}",
            ours.tp_relation(&theirs)
        );
    }
    let local = same_host(shared, &theirs, peer, secret.as_ref()).await;
    let transport: Box<dyn Transport> = match (local, &shared.rdma, theirs.rdma(), cfg.transport) {
        (Ok(t), ..) => t,
        (Err(why), ..) if cfg.transport == TransportChoice::Local => {
            return Err(Error::invalid(format!(
                "no same-host path to {peer} (transport: local): {why}"
            )))
        }
        (Err(why), ..) => {
            if cfg.transport == TransportChoice::Auto {
                tracing::debug!(peer, reason = %why, "no same-host path");
            }
            network(shared, &mut hs, &theirs, peer, generation, secret.as_ref()).await?
        }
    };
    tracing::info!(
        peer,
        engine = %theirs.engine_id,
        peer_generation = theirs.generation,
        generation,
        transport = transport.name(),
        "session ready"
    );
    Ok(PeerConn {
        descriptor: theirs,
        control: Box::new(hs.start()),
        transport,
        generation,
    })
}

/// The same-host path, when the configuration allows it, both engines share a host and every
/// region of this engine can be shared with the peer; else why not.
async fn same_host(
    shared: &Arc<EngineState>,
    theirs: &Descriptor,
    peer: &str,
    secret: Option<&SessionSecret>,
) -> std::result::Result<Box<dyn Transport>, String> {
    let cfg = &shared.config;
    if !matches!(
        cfg.transport,
        TransportChoice::Auto | TransportChoice::Local
    ) {
        return Err("not allowed by configuration".into());
    }
    let Some((host, socket)) = theirs.local() else {
        return Err("the peer offers no same-host path".into());
    };
    match &shared.local {
        Some((ours, _)) if ours == host => {}
        Some(_) => return Err("the peer runs on another host".into()),
        None => return Err("this engine has no same-host path".into()),
    }
    if let Some(why) = shared.unshareable() {
        return Err(why);
    }
    // CUDA and HIP open only another process's allocations through IPC.
    if socket.starts_with(&format!("kvlink-{}-", std::process::id())) && shared.has_gpu_memory() {
        return Err(
            "both engines run in this process, and GPU IPC opens only another \
                    process's memory"
                .into(),
        );
    }
    let t = LocalTransport::connect(
        socket,
        peer,
        secret,
        cfg.connect_timeout,
        cfg.io_timeout,
        cfg.batch_bytes,
    )
    .await
    .map_err(|e| format!("{e} (another network namespace?)"))?;
    tracing::info!(peer, "transport local: both engines share this host");
    Ok(Box::new(t))
}

/// RDMA when both engines have it and the configuration allows, else TCP.
async fn network(
    shared: &Arc<EngineState>,
    hs: &mut crate::control::Handshake,
    theirs: &Descriptor,
    peer: &str,
    generation: u64,
    secret: Option<&SessionSecret>,
) -> Result<Box<dyn Transport>> {
    let cfg = &shared.config;
    let transport: Box<dyn Transport> = match (&shared.rdma, theirs.rdma(), cfg.transport) {
        (Some(dev), Some((their_dev, regions)), choice) if choice != TransportChoice::Tcp => {
            let (prepared, qps) = RdmaConnection::prepare(dev, cfg.rdma.qps).map_err(rdma_setup)?;
            let reply = hs
                .request(&Message::RdmaConnect { generation, qps })
                .await?;
            let conn = match reply {
                Message::RdmaAccept { generation: g, qps } if g == generation => prepared
                    .connect(
                        peer,
                        &qps,
                        regions.to_vec(),
                        shared.rdma_fault,
                        shared.rdma_fault_budget.clone(),
                    )
                    .map_err(rdma_setup)?,
                Message::RdmaAccept { generation: g, .. } => {
                    return Err(Error::Handshake {
                        peer: peer.to_string(),
                        reason: format!(
                            "stale RDMA answer for generation {g}, expected {generation}"
                        ),
                    })
                }
                other => {
                    return Err(Error::Handshake {
                        peer: peer.to_string(),
                        reason: format!("unexpected answer to RdmaConnect: {other:?}"),
                    })
                }
            };
            tracing::info!(
                peer,
                local = dev.name(),
                remote = their_dev,
                qps = cfg.rdma.qps,
                "transport rdma: both engines have RDMA"
            );
            Box::new(conn)
        }
        (ours_dev, their_rdma, choice) => {
            let why = match (ours_dev, their_rdma) {
                _ if choice == TransportChoice::Tcp => "tcp forced by configuration".to_string(),
                (None, _) => format!(
                    "this engine has no RDMA ({})",
                    shared.rdma_unavailable.as_deref().unwrap_or("unknown")
                ),
                _ => "the peer offers no RDMA".to_string(),
            };
            if choice == TransportChoice::Rdma {
                return Err(Error::RdmaUnavailable(format!("to {peer}: {why}")));
            }
            let (data_addr, _) = theirs.tcp().ok_or_else(|| Error::Handshake {
                peer: peer.to_string(),
                reason: "the peer offers no transport this engine can use".into(),
            })?;
            let t = TcpTransport::connect(
                data_addr,
                usize::from(cfg.tcp_streams),
                cfg.connect_timeout,
                cfg.io_timeout,
                cfg.batch_bytes,
                shared.staging.clone(),
                secret,
            )
            .await?;
            tracing::info!(peer, streams = cfg.tcp_streams, reason = %why, "transport tcp");
            Box::new(t)
        }
    };
    Ok(transport)
}

fn rdma_setup(why: String) -> Error {
    Error::Rdma(RdmaError::new(RdmaErrorKind::Setup, why))
}

/// Sessions over the network: name lookup, handshake, then RDMA or TCP.
pub(crate) struct Network;

impl Connector for Network {
    fn connect<'a>(
        &'a self,
        state: &'a Arc<EngineState>,
        peer: &'a str,
        generation: u64,
    ) -> ConnectFuture<'a> {
        Box::pin(connect(state, peer, generation))
    }
}
