//! A connection to one peer: RC queue pairs, READ posting and completion accounting.
//!
//! Posting: segments are split at registration-chunk boundaries of both sides and at
//! `max_wr_bytes`, sorted by remote address, and pieces that are contiguous on the remote side
//! share one work request with a scatter list of local pieces. Work requests are chained
//! `DOORBELL` at a time on one queue pair per post, round-robin over the queue pairs; only the
//! last of each chain is signaled. A chain is posted only when the queue pair has send-queue
//! credits for all of it (the completion queue is sized for every send slot of every queue pair,
//! so it cannot overflow).
//!
//! Completions: work request ids carry (queue pair, sequence). Send queues complete in order, so
//! the completion of a chain's signaled last request retires every earlier chain of that queue
//! pair. An error completion fails its chain, marks the queue pair broken (the connection is
//! rebuilt on next use) and the flush completions that follow fail the rest; chains still
//! outstanding a second after an error are failed without waiting further.

use std::collections::{HashMap, VecDeque};
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::device::{arm, mtu_bytes, mtu_from_bytes, RdmaDevice};
use super::{QpEndpoint, RdmaRegionInfo};
use crate::error::{Error, Result};
use crate::ids::RegionId;
use crate::transport::{ReadFuture, ReadOp, RequestCtl, Transport};

/// Work requests chained in one post.
const DOORBELL: usize = 32;
/// How long chains may wait for flush completions after an error.
const FLUSH_GRACE: Duration = Duration::from_secs(1);
/// Sequence bits of a work request id (the queue pair index takes the rest).
const SEQ_BITS: u32 = 48;

/// Test-only corruption of what is posted, to exercise the verbs error paths.
#[derive(Debug, Clone, Copy, Default)]
pub struct RdmaFault {
    /// XORed into every remote key.
    pub rkey_xor: u32,
    /// Added to every remote address.
    pub addr_add: u64,
    /// How many requests (engine-wide, from the start) are corrupted; 0 disables the fault.
    pub requests: u32,
}

/// Outstanding chains of one request. Every posted chain holds it, so the request's local
/// regions and their registrations (`_keep`) live until the last chain is retired, even if the
/// request's future is dropped.
struct Pending {
    remaining: AtomicUsize,
    failure: Mutex<Option<String>>,
    notify: tokio::sync::Notify,
    _keep: (Vec<ReadOp>, Vec<Arc<super::device::RegionMrs>>),
}

impl Pending {
    fn finish(&self, failure: Option<&str>) {
        if let Some(f) = failure {
            let mut slot = self.failure.lock();
            if slot.is_none() {
                *slot = Some(f.to_string());
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.notify.notify_waiters();
        }
    }
}

struct Posted {
    last: u64,
    wrs: u32,
    pending: Arc<Pending>,
}

struct QpState {
    qp: BasicQueuePair,
    credits: u32,
    next_seq: u64,
    fifo: VecDeque<Posted>,
    error: Option<(String, Instant)>,
    in_error_state: bool,
}

struct QpSlot {
    state: Mutex<QpState>,
    credit: tokio::sync::Notify,
}

/// State shared between a connection's posting side and the device's poller.
pub(crate) struct ConnShared {
    dev: Arc<RdmaDevice>,
    cq_id: u64,
    cq: Arc<BasicCompletionQueue>,
    qps: Vec<QpSlot>,
    broken: AtomicBool,
    reason: Mutex<Option<String>>,
    peer: String,
}

fn status_name(status: u32) -> String {
    use WorkCompletionStatus as S;
    let known = [
        (S::LocalLengthError, "IBV_WC_LOC_LEN_ERR (local length error)"),
        (S::LocalQueuePairOperationError, "IBV_WC_LOC_QP_OP_ERR (local QP operation error)"),
        (S::LocalProtectionError, "IBV_WC_LOC_PROT_ERR (local protection error: destination not registered)"),
        (S::WorkRequestFlushedError, "IBV_WC_WR_FLUSH_ERR (flushed: the queue pair was in error)"),
        (S::BadResponseError, "IBV_WC_BAD_RESP_ERR (bad response)"),
        (S::LocalAccessError, "IBV_WC_LOC_ACCESS_ERR (local access error)"),
        (S::RemoteInvalidRequestError, "IBV_WC_REM_INV_REQ_ERR (remote invalid request)"),
        (S::RemoteAccessError, "IBV_WC_REM_ACCESS_ERR (remote access error: wrong remote key or address outside the peer's registered memory)"),
        (S::RemoteOperationError, "IBV_WC_REM_OP_ERR (remote operation error)"),
        (S::RetryCounterExceededError, "IBV_WC_RETRY_EXC_ERR (retry count exceeded: the peer stopped answering)"),
        (S::ResponderNotReadyRetryCounterExceededError, "IBV_WC_RNR_RETRY_EXC_ERR (receiver not ready)"),
        (S::FatalError, "IBV_WC_FATAL_ERR (fatal device error)"),
        (S::ResponseTimeoutError, "IBV_WC_RESP_TIMEOUT_ERR (response timeout)"),
        (S::GeneralError, "IBV_WC_GENERAL_ERR (general error)"),
    ];
    known
        .iter()
        .find(|(s, _)| *s as u32 == status)
        .map(|(_, n)| n.to_string())
        .unwrap_or_else(|| format!("work completion status {status}"))
}

impl ConnShared {
    pub(crate) fn arm(&self) {
        arm(&self.cq);
    }

    fn mark_broken(&self, reason: &str) {
        {
            let mut r = self.reason.lock();
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        if self.broken.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(peer = %self.peer, reason, "RDMA connection broken; it will be rebuilt on next use");
        for slot in &self.qps {
            let mut st = slot.state.lock();
            if !st.in_error_state {
                let mut attr = QueuePairAttribute::new();
                attr.setup_state(QueuePairState::Error);
                match st.qp.modify(&attr) {
                    Ok(()) => st.in_error_state = true,
                    Err(e) => tracing::error!(
                        error = %e,
                        "moving a queue pair to the error state failed; its reads are retired only by completions"
                    ),
                }
            }
            if st.error.is_none() {
                st.error = Some((reason.to_string(), Instant::now()));
            }
        }
    }

    /// Drains the completion queue, then re-arms it (polling once more to close the race).
    pub(crate) fn drain(&self) {
        let mut armed = false;
        loop {
            let mut got = 0usize;
            match self.cq.start_poll() {
                Ok(poller) => {
                    for wc in poller {
                        got += 1;
                        self.complete(wc.wr_id(), wc.status());
                    }
                }
                Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
                Err(e) => {
                    self.mark_broken(&format!("polling the completion queue failed: {e}"));
                    return;
                }
            }
            if got == 0 {
                if armed {
                    return;
                }
                self.arm();
                armed = true;
            } else {
                armed = false;
            }
        }
    }

    fn complete(&self, wr_id: u64, status: u32) {
        let idx = (wr_id >> SEQ_BITS) as usize;
        let seq = wr_id & ((1 << SEQ_BITS) - 1);
        let Some(slot) = self.qps.get(idx) else {
            return;
        };
        let ok = status == WorkCompletionStatus::Success as u32;
        if !ok {
            tracing::warn!(peer = %self.peer, qp = idx, seq, status = %status_name(status), "RDMA work completion error");
        }
        let mut newly_broken = None;
        {
            let mut st = slot.state.lock();
            if !ok && st.error.is_none() {
                let why = format!(
                    "RDMA READ from {} failed: {}",
                    self.peer,
                    status_name(status)
                );
                st.error = Some((why.clone(), Instant::now()));
                newly_broken = Some(why);
            }
            let failure = st.error.as_ref().map(|e| e.0.clone());
            let mut returned = 0;
            while let Some(front) = st.fifo.front() {
                let first = front.last + 1 - u64::from(front.wrs);
                if front.last <= seq || (!ok && first <= seq) {
                    let p = st.fifo.pop_front().expect("front exists");
                    returned += p.wrs;
                    p.pending.finish(failure.as_deref());
                } else {
                    break;
                }
            }
            st.credits += returned;
        }
        slot.credit.notify_waiters();
        if let Some(why) = newly_broken {
            self.mark_broken(&why);
        }
    }

    /// Fails chains that outlived the flush grace after an error.
    pub(crate) fn tick(&self) {
        for slot in &self.qps {
            let mut st = slot.state.lock();
            let Some((why, at)) = st.error.clone() else {
                continue;
            };
            // Only a queue pair known to be in the error state has stopped writing; its
            // remaining chains are retired once the flush grace has passed.
            if !st.in_error_state || at.elapsed() < FLUSH_GRACE {
                continue;
            }
            while let Some(p) = st.fifo.pop_front() {
                st.credits += p.wrs;
                p.pending.finish(Some(&why));
            }
        }
    }
}

impl Drop for ConnShared {
    fn drop(&mut self) {
        self.dev.detach(self.cq_id);
    }
}

fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    (h.finish() as u32) & 0x00ff_ffff
}

fn create_qp(
    dev: &RdmaDevice,
    send_cq: &Arc<BasicCompletionQueue>,
    recv_cq: &Arc<BasicCompletionQueue>,
    max_send_wr: u32,
) -> std::result::Result<BasicQueuePair, String> {
    let mut b = dev.pd.create_qp_builder();
    b.setup_max_send_wr(max_send_wr)
        .setup_max_recv_wr(1)
        .setup_max_send_sge(dev.max_sge)
        .setup_max_recv_sge(1)
        .setup_send_cq(send_cq.clone())
        .setup_recv_cq(recv_cq.clone());
    let mut qp = b.build().map_err(|e| format!("create queue pair: {e}"))?;
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(dev.port)
        .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
    qp.modify(&attr)
        .map_err(|e| format!("queue pair to INIT: {e}"))?;
    Ok(qp)
}

fn endpoint(dev: &RdmaDevice, qp: &BasicQueuePair, psn: u32) -> QpEndpoint {
    QpEndpoint {
        qpn: qp.qp_number(),
        psn,
        gid: Ipv6Addr::from(dev.gid).octets(),
        lid: dev.lid,
        mtu: mtu_bytes(dev.mtu),
    }
}

fn connect_qp(
    dev: &RdmaDevice,
    qp: &mut BasicQueuePair,
    my_psn: u32,
    theirs: &QpEndpoint,
) -> std::result::Result<(), String> {
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

/// Queue pairs created by a reader before the exchange, waiting for the peer's endpoints.
pub(crate) struct PreparedConn {
    dev: Arc<RdmaDevice>,
    cq_id: u64,
    cq: Arc<BasicCompletionQueue>,
    qps: Vec<(BasicQueuePair, u32)>,
    max_send_wr: u32,
}

/// The passive side's queue pairs for one reader; they live as long as its control connection.
pub(crate) struct ServerQps {
    _qps: Vec<BasicQueuePair>,
}

impl ServerQps {
    /// Creates queue pairs answering the reader's, connected and ready.
    pub(crate) fn accept(
        dev: &Arc<RdmaDevice>,
        theirs: &[QpEndpoint],
    ) -> std::result::Result<(ServerQps, Vec<QpEndpoint>), String> {
        if theirs.is_empty() || theirs.len() > 64 {
            return Err(format!(
                "{} queue pairs requested (1 to 64 allowed)",
                theirs.len()
            ));
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

/// RDMA data path to one peer.
pub(crate) struct RdmaConnection {
    shared: Arc<ConnShared>,
    remote: HashMap<RegionId, RdmaRegionInfo>,
    next: AtomicUsize,
    fault: RdmaFault,
    fault_budget: Arc<std::sync::atomic::AtomicU32>,
}

impl RdmaConnection {
    /// Creates `count` queue pairs in INIT and returns their endpoints for the peer.
    pub(crate) fn prepare(
        dev: &Arc<RdmaDevice>,
        count: u16,
    ) -> std::result::Result<(PreparedConn, Vec<QpEndpoint>), String> {
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
    ) -> std::result::Result<RdmaConnection, String> {
        if theirs.len() != self.qps.len() {
            return Err(format!(
                "peer answered with {} queue pairs for our {}",
                theirs.len(),
                self.qps.len()
            ));
        }
        let mut slots = Vec::new();
        for ((mut qp, psn), t) in self.qps.into_iter().zip(theirs) {
            connect_qp(&self.dev, &mut qp, psn, t)?;
            slots.push(QpSlot {
                state: Mutex::new(QpState {
                    qp,
                    credits: self.max_send_wr,
                    next_seq: 0,
                    fifo: VecDeque::new(),
                    error: None,
                    in_error_state: false,
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
        });
        self.dev.attach(self.cq_id, &shared);
        Ok(RdmaConnection {
            shared,
            remote: remote.into_iter().map(|r| (r.id, r)).collect(),
            next: AtomicUsize::new(0),
            fault,
            fault_budget,
        })
    }
}

/// One work request: a remote range and the local pieces it scatters into.
struct Wr {
    rkey: u32,
    raddr: u64,
    len: u64,
    sges: Vec<ibv_sge>,
}

enum PostOutcome {
    Posted,
    NoCredits,
    /// Accounted as posted (it may be partly posted) but failed: the connection is flushing.
    Failed(String),
}

impl RdmaConnection {
    fn build(&self, ops: &[ReadOp]) -> Result<(Vec<Wr>, Vec<Arc<super::device::RegionMrs>>)> {
        let dev = &self.shared.dev;
        let max_wr = dev.settings.max_wr_bytes.max(4096);
        let fault = if self
            .fault_budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            self.fault
        } else {
            RdmaFault::default()
        };
        let mut pieces: Vec<(u32, u64, u32, u64, u64)> = Vec::with_capacity(ops.len());
        let mut keep: Vec<Arc<super::device::RegionMrs>> = Vec::new();
        for op in ops {
            let (lregion, mut loff) = op.local.position();
            let mrs = dev.region_mrs(lregion).ok_or_else(|| {
                Error::invalid(format!(
                    "{lregion} is not registered with RDMA device {}",
                    dev.name()
                ))
            })?;
            let rinfo = self.remote.get(&op.remote_region).ok_or_else(|| {
                Error::invalid(format!(
                    "the peer exported no RDMA keys for {}",
                    op.remote_region
                ))
            })?;
            if !keep.iter().any(|k| Arc::ptr_eq(k, &mrs)) {
                keep.push(mrs.clone());
            }
            let mut roff = op.remote_offset;
            let mut left = op.local.len();
            while left > 0 {
                let (lkey, lroom) = mrs.lkey(loff);
                let ri = (roff / rinfo.chunk_bytes) as usize;
                let rkey = *rinfo.rkeys.get(ri).ok_or_else(|| {
                    Error::invalid(format!(
                        "remote offset {roff} of {} is past its registration",
                        op.remote_region
                    ))
                })?;
                let rroom = (ri as u64 + 1) * rinfo.chunk_bytes - roff;
                let n = left.min(lroom).min(rroom).min(max_wr);
                pieces.push((
                    rkey ^ fault.rkey_xor,
                    rinfo.addr.wrapping_add(roff).wrapping_add(fault.addr_add),
                    lkey,
                    mrs.addr + loff,
                    n,
                ));
                loff += n;
                roff += n;
                left -= n;
            }
        }
        // Remote order lets remote-contiguous pieces share a work request (scatter list).
        pieces.sort_unstable_by_key(|p| (p.0, p.1));
        let max_sge = dev.max_sge as usize;
        let mut wrs: Vec<Wr> = Vec::with_capacity(pieces.len());
        for (rkey, raddr, lkey, laddr, n) in pieces {
            if let Some(w) = wrs.last_mut() {
                if w.rkey == rkey && w.raddr + w.len == raddr && w.len + n <= max_wr {
                    let last = w.sges.last_mut().expect("a work request has a piece");
                    if last.lkey == lkey && last.addr + u64::from(last.length) == laddr {
                        last.length += n as u32;
                        w.len += n;
                        continue;
                    }
                    if w.sges.len() < max_sge {
                        w.sges.push(ibv_sge {
                            addr: laddr,
                            length: n as u32,
                            lkey,
                        });
                        w.len += n;
                        continue;
                    }
                }
            }
            wrs.push(Wr {
                rkey,
                raddr,
                len: n,
                sges: vec![ibv_sge {
                    addr: laddr,
                    length: n as u32,
                    lkey,
                }],
            });
        }
        Ok((wrs, keep))
    }

    fn post_chain(
        &self,
        qi: usize,
        chain: &[Wr],
        pending: &Arc<Pending>,
    ) -> std::result::Result<PostOutcome, String> {
        let slot = &self.shared.qps[qi];
        let mut guard = slot.state.lock();
        let st = &mut *guard;
        if let Some((why, _)) = &st.error {
            return Err(why.clone());
        }
        let n = chain.len() as u32;
        if st.credits < n {
            return Ok(PostOutcome::NoCredits);
        }
        let first = st.next_seq;
        let mut post = st.qp.start_post_send();
        for (i, wr) in chain.iter().enumerate() {
            let seq = first + i as u64;
            let flags = if i + 1 == chain.len() {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let h = post
                .construct_wr(((qi as u64) << SEQ_BITS) | seq, flags)
                .setup_read(wr.rkey, wr.raddr);
            // SAFETY: every SGE addresses bytes inside a registered local region (built from a
            // bounds-checked RegionSpan and split at registration chunks); the request holds the
            // spans' regions and the MRs until all of its work requests complete or flush.
            unsafe { h.setup_sge_list(&wr.sges) };
        }
        let posted = post.post();
        // Account the chain even when posting failed: the verbs call may have posted a prefix
        // of it, and those reads may still write; the flush (below) retires them.
        st.next_seq += u64::from(n);
        st.credits -= n;
        st.fifo.push_back(Posted {
            last: first + u64::from(n) - 1,
            wrs: n,
            pending: pending.clone(),
        });
        match posted {
            Ok(()) => Ok(PostOutcome::Posted),
            Err(e) => {
                let why = format!("posting RDMA READs to {} failed: {e}", self.shared.peer);
                drop(guard);
                self.shared.mark_broken(&why);
                Ok(PostOutcome::Failed(why))
            }
        }
    }

    async fn run(&self, ops: Vec<ReadOp>, deadline: tokio::time::Instant) -> Result<u64> {
        if self.is_broken() {
            return Err(self.lost());
        }
        // `ops` (holding the local regions) and `_mrs` (their registrations) stay alive until
        // every work request has completed or flushed.
        let (wrs, mrs) = self.build(&ops)?;
        let work_requests = wrs.len() as u64;
        let chains: Vec<&[Wr]> = wrs.chunks(DOORBELL).collect();
        if chains.is_empty() {
            return Ok(0);
        }
        let pending = Arc::new(Pending {
            remaining: AtomicUsize::new(chains.len()),
            failure: Mutex::new(None),
            notify: tokio::sync::Notify::new(),
            _keep: (ops, mrs),
        });
        let nq = self.shared.qps.len();
        let start = self.next.fetch_add(chains.len(), Ordering::Relaxed);
        let mut timed_out = false;
        // Index of the first chain that will not be posted, and why.
        let mut stop: Option<(usize, String)> = None;
        'chains: for (i, chain) in chains.iter().enumerate() {
            if let Some(why) = pending.failure.lock().clone() {
                stop = Some((i, why));
                break;
            }
            let qi = (start + i) % nq;
            loop {
                let slot = &self.shared.qps[qi];
                let notified = slot.credit.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                match self.post_chain(qi, chain, &pending) {
                    Ok(PostOutcome::Posted) => break,
                    Ok(PostOutcome::Failed(why)) => {
                        // This chain is accounted (its completions or the flush retire it).
                        stop = Some((i + 1, why));
                        break 'chains;
                    }
                    Ok(PostOutcome::NoCredits) => {
                        if tokio::time::timeout_at(deadline, notified).await.is_err() {
                            timed_out = true;
                            let why =
                                "request deadline passed while waiting for send-queue credits";
                            stop = Some((i, why.to_string()));
                            break 'chains;
                        }
                    }
                    Err(why) => {
                        stop = Some((i, why));
                        break 'chains;
                    }
                }
            }
        }
        // Chains never posted end here, with the reason they were not.
        if let Some((first_unposted, why)) = stop {
            for _ in first_unposted..chains.len() {
                pending.finish(Some(&why));
            }
        }
        // Wait for every posted chain to complete, fail or flush. At the deadline the
        // connection is flushed (queue pairs to the error state) so the NIC stops writing into
        // this request's memory; flushed chains then retire by completion or, a grace period
        // after a confirmed flush, by the poller's tick.
        let mut flushed = false;
        loop {
            let notified = pending.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if pending.remaining.load(Ordering::Acquire) == 0 {
                break;
            }
            if !timed_out {
                if tokio::time::timeout_at(deadline, notified.as_mut())
                    .await
                    .is_ok()
                {
                    continue;
                }
                timed_out = true;
            }
            if !flushed {
                flushed = true;
                self.shared
                    .mark_broken("a request deadline passed with RDMA READs outstanding");
                continue;
            }
            if tokio::time::timeout(FLUSH_GRACE * 3, notified)
                .await
                .is_err()
                && pending.remaining.load(Ordering::Acquire) != 0
            {
                // The queue pairs could not be flushed; report the request, but its memory
                // (held by `pending`) stays alive until the last chain retires.
                tracing::error!(peer = %self.shared.peer, "RDMA reads still outstanding after the flush grace");
                break;
            }
        }
        if timed_out {
            return Err(Error::Timeout {
                what: format!("RDMA READs from {} (request deadline)", self.shared.peer),
                after: Duration::ZERO,
            });
        }
        if let Some(why) = pending.failure.lock().take() {
            return Err(Error::Rdma(why));
        }
        Ok(work_requests)
    }

    fn lost(&self) -> Error {
        Error::Rdma(
            self.shared
                .reason
                .lock()
                .clone()
                .unwrap_or_else(|| format!("RDMA connection to {} broken", self.shared.peer)),
        )
    }
}

impl Transport for RdmaConnection {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn read(
        &self,
        ops: Vec<ReadOp>,
        _ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
    ) -> ReadFuture<'_> {
        Box::pin(self.run(ops, deadline))
    }

    fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Acquire)
    }
}
