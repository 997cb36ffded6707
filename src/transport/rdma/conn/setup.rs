//! Setting a connection up: the reader's queue pairs created before the exchange, then
//! connected to the peer's and registered with the device's poller.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use sideway::ibverbs::completion::BasicCompletionQueue;

use super::{ConnShared, QpSlot, QpState, RdmaConnection};
use crate::error::RdmaError;
use crate::transport::rdma::device::RdmaDevice;
use crate::transport::rdma::ledger::QpLedger;
use crate::transport::rdma::poller::CqHandler;
use crate::transport::rdma::qp::{connect_qp, create_qp, endpoint, random_psn, Qp};
use crate::transport::rdma::wr::RdmaFault;
use crate::transport::rdma::{QpEndpoint, RdmaRegionInfo};

/// Queue pairs created by a reader before the exchange, waiting for the peer's endpoints.
pub(crate) struct PreparedConn {
    dev: Arc<RdmaDevice>,
    cq_id: u64,
    cq: Arc<BasicCompletionQueue>,
    qps: Vec<(Qp, u32)>,
    max_send_wr: u32,
}

impl RdmaConnection {
    /// Creates `count` queue pairs in INIT and returns their endpoints for the peer.
    pub(crate) fn prepare(
        dev: &Arc<RdmaDevice>,
        count: u16,
    ) -> std::result::Result<(PreparedConn, Vec<QpEndpoint>), RdmaError> {
        let count = u32::from(count.clamp(1, 64));
        let max_send_wr = dev.max_qp_wr.min(512);
        let (cq_id, cq) = dev.create_cq(count * max_send_wr)?;
        let mut qps = Vec::new();
        let mut eps = Vec::new();
        for _ in 0..count {
            let qp = create_qp(dev, &cq, &cq, max_send_wr)?;
            let psn = random_psn();
            eps.push(endpoint(dev, &qp, psn));
            qps.push((qp, psn));
        }
        Ok((
            PreparedConn {
                dev: dev.clone(),
                cq_id,
                cq,
                qps,
                max_send_wr,
            },
            eps,
        ))
    }
}

impl PreparedConn {
    /// Connects to the peer's queue pairs (one for one) and readies the connection.
    pub(crate) fn connect(
        self,
        peer: &str,
        theirs: &[QpEndpoint],
        remote: Vec<RdmaRegionInfo>,
        fault: RdmaFault,
        fault_budget: Arc<std::sync::atomic::AtomicU32>,
    ) -> std::result::Result<RdmaConnection, RdmaError> {
        if theirs.len() != self.qps.len() {
            return Err(format!(
                "peer answered with {} queue pairs for our {}",
                theirs.len(),
                self.qps.len()
            )
            .into());
        }
        let mut slots = Vec::new();
        for ((mut qp, psn), t) in self.qps.into_iter().zip(theirs) {
            connect_qp(&self.dev, &mut qp, psn, t)?;
            slots.push(QpSlot {
                state: Mutex::new(QpState {
                    qp: Some(qp),
                    ledger: QpLedger::new(self.max_send_wr),
                }),
                credit: tokio::sync::Notify::new(),
            });
        }
        let shared = Arc::new(ConnShared {
            dev: self.dev.clone(),
            cq_id: self.cq_id,
            cq: self.cq,
            qps: slots,
            broken: AtomicBool::new(false),
            reason: Mutex::new(None),
            peer: peer.to_string(),
            polling: Mutex::new(()),
        });
        let handler: Arc<dyn CqHandler> = shared.clone();
        self.dev.attach(self.cq_id, &handler);
        Ok(RdmaConnection {
            shared,
            remote: remote.into_iter().map(|r| (r.id, r)).collect(),
            next: AtomicUsize::new(0),
            fault,
            fault_budget,
            spin: Duration::ZERO,
        })
    }
}
