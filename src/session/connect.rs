//! Connecting to a peer: name lookup, handshake, transport negotiation (RDMA when both engines
//! have it and the configuration allows, TCP otherwise) and the queue-pair exchange.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use super::{ConnectFuture, Connector, NoticeFuture, PeerConn};
use crate::auth::SessionSecret;
use crate::config::TransportChoice;
use crate::control::messages::Descriptor;
use crate::control::messages::Message;
use crate::control::ControlClient;
use crate::error::{Error, RdmaError, RdmaErrorKind, Result};
use crate::shm::ShareError;
use crate::state::EngineState;
use crate::transport::local::LocalTransport;
use crate::transport::rails::{Rail, Rails, TcpConnect};
use crate::transport::rdma::{RdmaConnection, RdmaFault};
use crate::transport::tcp::TcpTransport;
use crate::transport::{Transport, Waits};

/// The address of `peer` (an address, or a name to look up).
async fn resolve(peer: &str) -> Result<SocketAddr> {
    match peer.parse() {
        Ok(a) => Ok(a),
        Err(_) => tokio::net::lookup_host(peer)
            .await
            .map_err(|e| Error::invalid(format!("peer address {peer:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::invalid(format!("peer address {peer:?} resolves to nothing"))),
    }
}

/// This engine's descriptor, which a reader needs before it greets a peer.
fn our_descriptor(shared: &EngineState) -> Result<Arc<Descriptor>> {
    shared
        .descriptor()
        .ok_or_else(|| Error::invalid("set a KV layout on this engine before reading from peers"))
}

async fn connect(
    shared: &Arc<EngineState>,
    peer: &str,
    generation: u64,
    faults: Option<&FaultPlan>,
) -> Result<PeerConn> {
    let cfg = shared.config();
    let addr = resolve(peer).await?;
    let ours = our_descriptor(shared)?;
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
    let transport: Box<dyn Transport> = match (local, &shared.rdma(), theirs.rdma(), cfg.transport)
    {
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
            let secret = secret.as_ref();
            network(shared, &mut hs, &theirs, peer, generation, secret, faults).await?
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
        control: Box::new(hs.start(shared.closing_flag())),
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
) -> std::result::Result<Box<dyn Transport>, ShareError> {
    let cfg = shared.config();
    if !matches!(
        cfg.transport,
        TransportChoice::Auto | TransportChoice::Local
    ) {
        return Err("not allowed by configuration".into());
    }
    let Some((host, socket)) = theirs.local() else {
        return Err("the peer offers no same-host path".into());
    };
    match &shared.local() {
        Some((ours, _)) if ours == host => {}
        Some(_) => return Err("the peer runs on another host".into()),
        None => return Err("this engine has no same-host path".into()),
    }
    if let Some(why) = shared.unshareable() {
        return Err(why.into());
    }
    // CUDA and HIP open only another process's allocations through IPC.
    if socket.starts_with(&format!("kvlink-{}-", std::process::id())) && shared.has_gpu_memory() {
        return Err(
            "both engines run in this process, and GPU IPC opens only another \
                    process's memory"
                .into(),
        );
    }
    let waits = Waits {
        connect: cfg.connect_timeout,
        io: cfg.io_timeout,
    };
    let t = LocalTransport::connect(socket, peer, secret, waits, cfg.batch_bytes)
        .await
        .map_err(|e| format!("{e} (another network namespace?)"))?;
    tracing::info!(peer, "transport local: both engines share this host");
    Ok(Box::new(t))
}

/// RDMA when both engines have it and the configuration allows, else TCP.
// Long: the transport choice in the order it is made (why not RDMA, each device pair tried or
//   skipped in its cool-down, the TCP fallback); each step reads the ones before it.
async fn network(
    shared: &Arc<EngineState>,
    hs: &mut crate::control::Handshake,
    theirs: &Descriptor,
    peer: &str,
    generation: u64,
    secret: Option<&SessionSecret>,
    faults: Option<&FaultPlan>,
) -> Result<Box<dyn Transport>> {
    let cfg = shared.config();
    let their_rdma = theirs.rdma();
    let why_not = if cfg.transport == TransportChoice::Tcp {
        Some("tcp forced by configuration".to_string())
    } else if shared.rdma().is_empty() {
        Some(format!(
            "this engine has no RDMA ({})",
            shared.rdma_unavailable().unwrap_or("unknown")
        ))
    } else if their_rdma.is_empty() {
        Some("the peer offers no RDMA".to_string())
    } else {
        None
    };
    let fallback = tcp_fallback(shared, theirs, peer, secret)?;
    if let Some(why) = why_not {
        if cfg.transport == TransportChoice::Rdma {
            return Err(Error::RdmaUnavailable(format!("to {peer}: {why}")));
        }
        let t = fallback().await?;
        tracing::info!(peer, streams = cfg.tcp_streams, reason = %why, "transport tcp");
        return Ok(Box::new(t));
    }
    // Device pairs: this engine's i-th device with the peer's i-th, as many as the engine with
    // fewer devices has.
    let pairs = shared.rdma().len().min(their_rdma.len());
    let key = |i: usize| format!("{peer} {}>{}", shared.rdma()[i].name(), their_rdma[i].0);
    let now = std::time::Instant::now();
    let paused: Vec<Option<std::time::Instant>> = {
        let h = shared.rails().health.lock();
        (0..pairs).map(|i| h.paused_until(&key(i), now)).collect()
    };
    // RDMA only, and every pair paused: try them all rather than fail without trying.
    let try_paused = cfg.transport == TransportChoice::Rdma && paused.iter().all(Option::is_some);
    let mut resume_at: Option<std::time::Instant> = None;
    let mut later = |t: std::time::Instant| resume_at = Some(resume_at.map_or(t, |r| r.min(t)));
    let mut rails = Vec::new();
    let mut last = None;
    for i in 0..pairs {
        let dev = &shared.rdma()[i];
        let (their_dev, regions) = their_rdma[i];
        if let (Some(until), false) = (paused[i], try_paused) {
            tracing::info!(
                peer,
                local = dev.name(),
                remote = their_dev,
                "RDMA device pair paused: not used until its cool-down ends"
            );
            later(until);
            continue;
        }
        match rail(shared, hs, i, regions, peer, generation, faults).await? {
            Ok(conn) => rails.push(Rail::new(key(i), dev.name().to_string(), conn)),
            Err(why) => {
                let pause = shared.rails().health.lock().failed(&key(i), now);
                later(now + pause);
                tracing::warn!(peer, local = dev.name(), remote = their_dev, %why, ?pause, "RDMA device pair failed to connect: paused");
                last = Some(why);
            }
        }
    }
    let fallback = matches!(
        cfg.transport,
        TransportChoice::Auto | TransportChoice::Network
    )
    .then_some(fallback);
    if rails.is_empty() && fallback.is_none() {
        return Err(Error::Rdma(RdmaError::new(
            RdmaErrorKind::Setup,
            format!(
                "no RDMA device pair to {peer} could connect: {}",
                last.unwrap_or_else(|| "every pair is paused".into())
            ),
        )));
    }
    let names: Vec<String> = rails.iter().map(|r| r.device.clone()).collect();
    tracing::info!(
        peer,
        devices = %names.join(","),
        pairs,
        qps = cfg.rdma.qps,
        "transport rdma: both engines have RDMA"
    );
    Ok(Box::new(Rails::new(
        peer.to_string(),
        rails,
        shared.rails().clone(),
        fallback,
        resume_at,
    )))
}

/// Connects this engine's `i`-th RDMA device to the peer's `i`-th. The outer error ends the
/// session (the control connection failed); the inner one only this device pair.
async fn rail(
    shared: &Arc<EngineState>,
    hs: &mut crate::control::Handshake,
    i: usize,
    regions: &[crate::transport::rdma::RdmaRegionInfo],
    peer: &str,
    generation: u64,
    faults: Option<&FaultPlan>,
) -> Result<std::result::Result<RdmaConnection, RdmaError>> {
    let dev = &shared.rdma()[i];
    let (prepared, qps) = match RdmaConnection::prepare(dev, shared.config().rdma.qps) {
        Ok(p) => p,
        Err(why) => return Ok(Err(why)),
    };
    // A refusal (`Error`) ends only this pair: the server goes on with the session.
    let reply = hs
        .exchange(&Message::RdmaConnect {
            generation,
            device: i as u32,
            qps,
        })
        .await?;
    Ok(match reply {
        Message::RdmaAccept { generation: g, qps } if g == generation => prepared
            .connect(
                peer,
                &qps,
                regions.to_vec(),
                faults.map_or_else(RdmaFault::default, |f| f.fault),
                faults.map_or_else(|| Arc::new(AtomicU32::new(0)), |f| f.budget.clone()),
            )
            .map(|c| c.with_spin(shared.config().spin)),
        Message::RdmaAccept { generation: g, .. } => {
            return Err(Error::Handshake {
                peer: peer.to_string(),
                reason: format!("stale RDMA answer for generation {g}, expected {generation}"),
            })
        }
        Message::Error { message } => Err(message.into()),
        other => {
            return Err(Error::Handshake {
                peer: peer.to_string(),
                reason: format!("unexpected answer to RdmaConnect: {other:?}"),
            })
        }
    })
}

/// How to connect the peer's TCP data server (now, or later as RDMA's failover).
fn tcp_fallback(
    shared: &Arc<EngineState>,
    theirs: &Descriptor,
    peer: &str,
    secret: Option<&SessionSecret>,
) -> Result<TcpConnect> {
    let cfg = shared.config();
    let (data_addr, _) = theirs.tcp().ok_or_else(|| Error::Handshake {
        peer: peer.to_string(),
        reason: "the peer offers no transport this engine can use".into(),
    })?;
    let (streams, batch, spin) = (usize::from(cfg.tcp_streams), cfg.batch_bytes, cfg.spin);
    let waits = Waits {
        connect: cfg.connect_timeout,
        io: cfg.io_timeout,
    };
    let staging = shared.staging().clone();
    let secret = secret.cloned();
    Ok(Box::new(move || {
        let staging = staging.clone();
        let secret = secret.clone();
        Box::pin(async move {
            TcpTransport::connect(data_addr, streams, waits, batch, staging, secret.as_ref())
                .await
                .map(|t| t.with_spin(spin))
        })
    }))
}

/// Sessions over the network: name lookup, handshake, then RDMA or TCP.
#[derive(Default)]
pub(crate) struct Network {
    /// RDMA fault injection, for the tests of the verbs error paths only.
    faults: Option<FaultPlan>,
}

impl Network {
    /// Sessions whose RDMA connections corrupt what they post as `fault` says, for its first
    /// `fault.requests` requests of the engine (`internal::start_with_rdma_fault`).
    pub(crate) fn with_rdma_fault(fault: RdmaFault) -> Network {
        let budget = Arc::new(AtomicU32::new(fault.requests));
        Network {
            faults: Some(FaultPlan { fault, budget }),
        }
    }
}

/// An RDMA fault and how many of the engine's requests it still corrupts.
struct FaultPlan {
    fault: RdmaFault,
    budget: Arc<AtomicU32>,
}

impl Connector for Network {
    fn connect<'a>(
        &'a self,
        state: &'a Arc<EngineState>,
        peer: &'a str,
        generation: u64,
    ) -> ConnectFuture<'a> {
        Box::pin(connect(state, peer, generation, self.faults.as_ref()))
    }

    fn send_aborts<'a>(
        &'a self,
        state: &'a Arc<EngineState>,
        peer: &'a str,
        aborts: Vec<Message>,
    ) -> NoticeFuture<'a> {
        Box::pin(async move {
            let addr = resolve(peer).await?;
            let ours = our_descriptor(state)?;
            let key = state.config().auth_key.as_ref();
            ControlClient::send_aborts(addr, &ours, key, state.control_timeouts(), &aborts).await
        })
    }
}
