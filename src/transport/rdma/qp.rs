//! Queue pairs: creation (INIT), the endpoint a peer needs, the move to ready-to-send against
//! the peer's endpoint, and the passive side's queue pairs that answer a reader's.

use std::net::Ipv6Addr;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};
use sideway::ibverbs::AccessFlags;

use super::device::{mtu_bytes, mtu_from_bytes, RdmaDevice};
use super::QpEndpoint;
use crate::error::{RdmaError, RdmaErrorKind};

pub(crate) fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    (h.finish() as u32) & 0x00ff_ffff
}

/// A queue pair, counted by its device while it exists ([`RdmaDevice::queue_pairs`]).
pub(crate) struct Qp {
    qp: BasicQueuePair,
    live: Arc<AtomicU64>,
}

impl Deref for Qp {
    type Target = BasicQueuePair;
    fn deref(&self) -> &BasicQueuePair {
        &self.qp
    }
}

impl DerefMut for Qp {
    fn deref_mut(&mut self) -> &mut BasicQueuePair {
        &mut self.qp
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) fn create_qp(
    dev: &RdmaDevice,
    send_cq: &Arc<BasicCompletionQueue>,
    recv_cq: &Arc<BasicCompletionQueue>,
    max_send_wr: u32,
) -> std::result::Result<Qp, RdmaError> {
    let mut b = dev.pd.create_qp_builder();
    b.setup_max_send_wr(max_send_wr)
        .setup_max_recv_wr(1)
        .setup_max_send_sge(dev.max_sge)
        .setup_max_recv_sge(1)
        .setup_send_cq(send_cq.clone())
        .setup_recv_cq(recv_cq.clone());
    let qp = b.build().map_err(|e| format!("create queue pair: {e}"))?;
    dev.live_qps.fetch_add(1, Ordering::Relaxed);
    let mut qp = Qp {
        qp,
        live: dev.live_qps.clone(),
    };
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(dev.port)
        .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
    qp.modify(&attr)
        .map_err(|e| format!("queue pair to INIT: {e}"))?;
    Ok(qp)
}

pub(crate) fn endpoint(dev: &RdmaDevice, qp: &BasicQueuePair, psn: u32) -> QpEndpoint {
    QpEndpoint {
        qpn: qp.qp_number(),
        psn,
        gid: Ipv6Addr::from(dev.gid).octets(),
        lid: dev.lid,
        mtu: mtu_bytes(dev.mtu),
    }
}

pub(crate) fn connect_qp(
    dev: &RdmaDevice,
    qp: &mut BasicQueuePair,
    my_psn: u32,
    theirs: &QpEndpoint,
) -> std::result::Result<(), RdmaError> {
    let mtu = mtu_from_bytes(theirs.mtu.min(mtu_bytes(dev.mtu)))
        .ok_or_else(|| format!("peer MTU {} is not a verbs MTU", theirs.mtu))?;
    let mut ah = AddressHandleAttribute::new();
    let dgid = Gid::from(Ipv6Addr::from(theirs.gid));
    ah.setup_port(dev.port)
        .setup_service_level(0)
        .setup_grh(&dgid, 0, dev.gid_index as u8, 64, 0);
    if theirs.lid != 0 {
        ah.setup_dest_lid(theirs.lid);
    }
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu)
        .setup_dest_qp_num(theirs.qpn)
        .setup_rq_psn(theirs.psn)
        .setup_max_dest_read_atomic(dev.max_rd_atom)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&ah);
    qp.modify(&attr)
        .map_err(|e| format!("queue pair to RTR: {e}"))?;
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(my_psn)
        .setup_timeout(14)
        .setup_retry_cnt(7)
        .setup_rnr_retry(7)
        .setup_max_read_atomic(dev.max_rd_atom);
    qp.modify(&attr)
        .map_err(|e| format!("queue pair to RTS: {e}"))?;
    Ok(())
}

/// The passive side's queue pairs for one reader; they live as long as its control connection.
pub(crate) struct ServerQps {
    _qps: Vec<Qp>,
}

impl ServerQps {
    /// Creates queue pairs answering the reader's, connected and ready.
    pub(crate) fn accept(
        dev: &Arc<RdmaDevice>,
        theirs: &[QpEndpoint],
    ) -> std::result::Result<(ServerQps, Vec<QpEndpoint>), RdmaError> {
        let setup = |why: String| RdmaError::new(RdmaErrorKind::Setup, why);
        if theirs.is_empty() || theirs.len() > 64 {
            return Err(setup(format!(
                "{} queue pairs requested (1 to 64 allowed)",
                theirs.len()
            )));
        }
        let cq = dev.passive_cq()?;
        let mut qps = Vec::new();
        let mut eps = Vec::new();
        for t in theirs {
            let mut qp = create_qp(dev, &cq, &cq, 16)?;
            let psn = random_psn();
            connect_qp(dev, &mut qp, psn, t)?;
            eps.push(endpoint(dev, &qp, psn));
            qps.push(qp);
        }
        Ok((ServerQps { _qps: qps }, eps))
    }
}
