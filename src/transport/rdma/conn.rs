//! A connection to one peer: RC queue pairs, READ posting and completion accounting.
//!
//! Work requests come from the sans-I/O builder (`wr`), are chained `DOORBELL` at a time on one
//! queue pair per post, round-robin, and are accounted in each queue pair's ledger (`ledger`):
//! a chain is posted only with credits for all of it (the completion queue is sized for every
//! send slot, so it cannot overflow), and a request ends only when none of its work requests
//! can write any more. At the deadline or on cancellation the connection is flushed (rebuilt on
//! next use); queue pairs that cannot be flushed are destroyed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
    WorkRequestFlags,
};

use super::device::RdmaDevice;
use super::ledger::{wr_id, QpLedger, Refusal};
use super::qp::Qp;
use super::wr::{RdmaFault, Wr, WrBuilder};
use super::RdmaRegionInfo;
use crate::error::{Error, RdmaError, RdmaErrorKind, Result};
use crate::ids::{RegionId, RequestId};
use crate::transport::{ConfirmAsk, ReadDone, ReadFuture, ReadOp, RequestCtl, Transport};

mod completion;
mod setup;

/// Work requests chained in one post.
const DOORBELL: usize = 32;
/// How long chains may wait for flush completions after an error.
const FLUSH_GRACE: Duration = Duration::from_secs(1);

/// Outstanding chains of one request. Every posted chain holds it, so the request's local
/// regions and their registrations (`_keep`) live until the last chain is retired, even if the
/// request's future is dropped.
struct Pending {
    remaining: AtomicUsize,
    failure: Mutex<Option<RdmaError>>,
    notify: tokio::sync::Notify,
    /// The request's control: a chain that completes marks its first bytes landed.
    ctl: Arc<RequestCtl>,
    _keep: (Vec<ReadOp>, Vec<Arc<super::mr::RegionMrs>>),
}

impl Pending {
    fn finish(&self, failure: Option<&RdmaError>) {
        match failure {
            Some(f) => {
                let mut slot = self.failure.lock();
                if slot.is_none() {
                    *slot = Some(f.clone());
                }
            }
            None => self.ctl.note_data(),
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.notify.notify_waiters();
        }
    }
}

struct QpState {
    /// `None` once torn down.
    qp: Option<Qp>,
    ledger: QpLedger<Arc<Pending>>,
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
    reason: Mutex<Option<RdmaError>>,
    peer: String,
    /// Held while the completion queue is polled: by the device's poller, or by a request
    /// polling it itself while it waits ([`RdmaConnection::poll_while_waiting`]).
    polling: Mutex<()>,
}

impl ConnShared {
    /// Breaks the connection: records `reason` and moves every queue pair to the error state,
    /// so the device stops executing their reads and flushes them. Idempotent.
    fn mark_broken(&self, reason: &RdmaError) {
        {
            let mut r = self.reason.lock();
            if r.is_none() {
                *r = Some(reason.clone());
            }
        }
        if self.broken.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(peer = %self.peer, %reason, "RDMA connection broken; it will be rebuilt on next use");
        let now = Instant::now();
        for slot in &self.qps {
            let mut guard = slot.state.lock();
            let st = &mut *guard;
            if let (false, Some(qp)) = (st.ledger.in_error_state(), st.qp.as_mut()) {
                let mut attr = QueuePairAttribute::new();
                attr.setup_state(QueuePairState::Error);
                match qp.modify(&attr) {
                    Ok(()) => st.ledger.set_error_state(),
                    Err(e) => tracing::error!(
                        error = %e,
                        "moving a queue pair to the error state failed; its reads are retired only by completions"
                    ),
                }
            }
            st.ledger.fail(reason, now);
        }
    }

    /// Destroys the queue pairs (the device stops executing their work requests when the
    /// destroy returns) and retires every chain they held. For queue pairs that could not be
    /// moved to the error state.
    fn tear_down(&self) {
        let why = RdmaError::new(
            RdmaErrorKind::ConnectionBroken,
            format!("the queue pairs to {} were destroyed", self.peer),
        );
        self.mark_broken(&why);
        for slot in &self.qps {
            let retired = {
                let mut st = slot.state.lock();
                // Destroying the queue pair stops the device executing its work requests.
                drop(st.qp.take());
                st.ledger.retire_all(&why)
            };
            for (pending, failure) in retired {
                pending.finish(failure.as_ref());
            }
            slot.credit.notify_waiters();
        }
    }
}

impl Drop for ConnShared {
    fn drop(&mut self) {
        self.dev.detach(self.cq_id);
    }
}

/// RDMA data path to one peer.
pub(crate) struct RdmaConnection {
    shared: Arc<ConnShared>,
    remote: HashMap<RegionId, RdmaRegionInfo>,
    next: AtomicUsize,
    fault: RdmaFault,
    fault_budget: Arc<std::sync::atomic::AtomicU32>,
    /// How long a read of one chain polls the completion queue itself before it waits for
    /// the poller (zero: never).
    spin: Duration,
}

/// Why a request stopped before all of its reads completed.
#[derive(Debug, Clone, Copy)]
enum Stop {
    Deadline,
    Cancelled,
}

impl Stop {
    /// The error given to the chains this stop leaves unposted, and to a cancelled request.
    fn error(self, peer: &str) -> RdmaError {
        match self {
            Stop::Deadline => RdmaError::new(
                RdmaErrorKind::ConnectionBroken,
                format!("request deadline passed while waiting for send-queue credits to {peer}"),
            ),
            Stop::Cancelled => RdmaError::new(
                RdmaErrorKind::Cancelled,
                format!("RDMA READs from {peer} cancelled"),
            ),
        }
    }
}

enum PostOutcome {
    Posted,
    NoCredits,
    /// Accounted as posted (it may be partly posted) but failed: the connection is flushing.
    Failed(RdmaError),
}

impl RdmaConnection {
    /// The work requests of `ops`, and the local registrations they use (kept alive by the
    /// request until every work request has completed or flushed).
    fn build(&self, ops: &[ReadOp]) -> Result<(Vec<Wr>, Vec<Arc<super::mr::RegionMrs>>)> {
        let dev = &self.shared.dev;
        let fault = if self
            .fault_budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            self.fault
        } else {
            RdmaFault::default()
        };
        let mut builder = WrBuilder::new(dev.settings.max_wr_bytes, dev.max_sge, fault);
        let mut keep: Vec<Arc<super::mr::RegionMrs>> = Vec::new();
        for op in ops {
            let (lregion, loff) = op.local.position();
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
            builder
                .add(&*mrs, loff, rinfo, op.remote_offset, op.local.len())
                .map_err(|e| Error::invalid(e.to_string()))?;
            if !keep.iter().any(|k| Arc::ptr_eq(k, &mrs)) {
                keep.push(mrs);
            }
        }
        Ok((builder.finish(), keep))
    }

    fn post_chain(
        &self,
        qi: usize,
        chain: &[Wr],
        pending: &Arc<Pending>,
    ) -> std::result::Result<PostOutcome, RdmaError> {
        let slot = &self.shared.qps[qi];
        let mut guard = slot.state.lock();
        let st = &mut *guard;
        let n = chain.len() as u32;
        let first = match st.ledger.reserve(n) {
            Ok(first) => first,
            Err(Refusal::NoCredits) => return Ok(PostOutcome::NoCredits),
            Err(Refusal::Failed(why)) => return Err(why),
        };
        let Some(qp) = st.qp.as_mut() else {
            return Err(RdmaError::new(
                RdmaErrorKind::ConnectionBroken,
                format!("the queue pairs to {} were destroyed", self.shared.peer),
            ));
        };
        let mut post = qp.start_post_send();
        let mut sges: Vec<ibv_sge> = Vec::new();
        for (i, wr) in chain.iter().enumerate() {
            let seq = first + i as u64;
            let flags = if i + 1 == chain.len() {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let h = post
                .construct_wr(wr_id(qi, seq), flags)
                .setup_read(wr.rkey, wr.raddr);
            sges.clear();
            sges.extend(wr.sges.iter().map(|s| ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }));
            // SAFETY: every SGE addresses bytes inside a registered local region (built from a
            // bounds-checked RegionSpan and split at registration chunks); the request holds the
            // spans' regions and the MRs until all of its work requests complete or flush.
            unsafe { h.setup_sge_list(&sges) };
        }
        let posted = post.post();
        // Account the chain even when posting failed: the verbs call may have posted a prefix
        // of it, and those reads may still write; the flush (below) retires them.
        st.ledger.record(n, pending.clone());
        match posted {
            Ok(()) => Ok(PostOutcome::Posted),
            Err(e) => {
                let why = RdmaError::new(
                    RdmaErrorKind::Post,
                    format!("posting RDMA READs to {} failed: {e}", self.shared.peer),
                );
                drop(guard);
                self.shared.mark_broken(&why);
                Ok(PostOutcome::Failed(why))
            }
        }
    }

    async fn run(
        &self,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
    ) -> Result<u64> {
        let started = tokio::time::Instant::now();
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
            ctl: ctl.clone(),
            _keep: (ops, mrs),
        });
        let (stopped, unposted) = self.post_chains(&chains, &pending, &ctl, deadline).await;
        if chains.len() == 1 && stopped.is_none() && unposted.is_none() {
            self.poll_while_waiting(&pending, &ctl);
        }
        // Chains never posted end here, with the reason they were not.
        if let Some((first_unposted, why)) = unposted {
            for _ in first_unposted..chains.len() {
                pending.finish(Some(&why));
            }
        }
        let stopped = self.wait_retired(&pending, stopped, &ctl, deadline).await;
        match stopped {
            Some(Stop::Deadline) => Err(Error::Timeout {
                what: format!("RDMA READs from {} (request deadline)", self.shared.peer),
                after: started.elapsed(),
            }),
            Some(Stop::Cancelled) => Err(Error::Rdma(Stop::Cancelled.error(&self.shared.peer))),
            None => match pending.failure.lock().take() {
                Some(why) => Err(Error::Rdma(why)),
                None => Ok(work_requests),
            },
        }
    }

    /// Posts the chains round-robin over the queue pairs, waiting for credits, until all are
    /// posted or the request stops (its deadline, a cancel) or fails. Returns why it stopped,
    /// and the first chain not posted with the reason.
    async fn post_chains(
        &self,
        chains: &[&[Wr]],
        pending: &Arc<Pending>,
        ctl: &RequestCtl,
        deadline: tokio::time::Instant,
    ) -> (Option<Stop>, Option<(usize, RdmaError)>) {
        let nq = self.shared.qps.len();
        let start = self.next.fetch_add(chains.len(), Ordering::Relaxed);
        for (i, chain) in chains.iter().enumerate() {
            if ctl.is_cancelled() {
                let why = Stop::Cancelled.error(&self.shared.peer);
                return (Some(Stop::Cancelled), Some((i, why)));
            }
            if let Some(why) = pending.failure.lock().clone() {
                return (None, Some((i, why)));
            }
            let qi = (start + i) % nq;
            loop {
                let slot = &self.shared.qps[qi];
                let notified = slot.credit.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                match self.post_chain(qi, chain, pending) {
                    Ok(PostOutcome::Posted) => break,
                    // This chain is accounted (its completions or the flush retire it).
                    Ok(PostOutcome::Failed(why)) => return (None, Some((i + 1, why))),
                    Ok(PostOutcome::NoCredits) => {
                        let stop = tokio::select! {
                            _ = &mut notified => None,
                            _ = tokio::time::sleep_until(deadline) => Some(Stop::Deadline),
                            _ = ctl.cancelled() => Some(Stop::Cancelled),
                        };
                        if let Some(stop) = stop {
                            return (Some(stop), Some((i, stop.error(&self.shared.peer))));
                        }
                    }
                    Err(why) => return (None, Some((i, why))),
                }
            }
        }
        (None, None)
    }

    /// Waits for every posted chain to complete, fail or flush. At the deadline or on
    /// cancellation the connection is flushed (queue pairs to the error state) so the NIC
    /// stops writing into this request's memory; flushed chains then retire by completion
    /// or, a grace period after a confirmed flush, by the poller's tick. Queue pairs that
    /// cannot be flushed are destroyed. Returns only when no work request of the request can
    /// write any more, with why it stopped early, if it did.
    async fn wait_retired(
        &self,
        pending: &Pending,
        mut stopped: Option<Stop>,
        ctl: &RequestCtl,
        deadline: tokio::time::Instant,
    ) -> Option<Stop> {
        let mut flushed = false;
        loop {
            let notified = pending.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if pending.remaining.load(Ordering::Acquire) == 0 {
                return stopped;
            }
            if stopped.is_none() {
                stopped = tokio::select! {
                    _ = notified.as_mut() => None,
                    _ = tokio::time::sleep_until(deadline) => Some(Stop::Deadline),
                    _ = ctl.cancelled() => Some(Stop::Cancelled),
                };
                continue;
            }
            if !flushed {
                flushed = true;
                let why = match stopped {
                    Some(Stop::Cancelled) => "a request was cancelled with RDMA READs outstanding",
                    _ => "a request deadline passed with RDMA READs outstanding",
                };
                self.shared
                    .mark_broken(&RdmaError::new(RdmaErrorKind::ConnectionBroken, why));
                continue;
            }
            if tokio::time::timeout(FLUSH_GRACE * 3, notified)
                .await
                .is_err()
                && pending.remaining.load(Ordering::Acquire) != 0
            {
                // The queue pairs could not be moved to the error state: destroy them, which
                // stops the device, then retire what they held.
                tracing::error!(peer = %self.shared.peer, "RDMA reads still outstanding after the flush grace; destroying the queue pairs");
                self.shared.tear_down();
            }
        }
    }

    /// Polls the completion queue for up to `spin` while the request's chain is outstanding,
    /// before the request waits for the poller's wake-up (which costs a thread hand-off or two
    /// where a small READ takes microseconds on a NIC). Bounded; only while this request has
    /// work in flight; the poller keeps the queue armed meanwhile, so a completion polled
    /// here also raises an event it will find already taken.
    fn poll_while_waiting(&self, pending: &Pending, ctl: &RequestCtl) {
        if self.spin.is_zero() {
            return;
        }
        let until = Instant::now() + self.spin;
        while pending.remaining.load(Ordering::Acquire) != 0
            && !ctl.is_cancelled()
            && Instant::now() < until
        {
            if let Some(_polling) = self.shared.polling.try_lock() {
                if self.shared.poll_cq().is_none() {
                    return;
                }
            }
            std::thread::yield_now();
        }
    }

    /// Sets how long a read of one chain polls the completion queue itself (zero: never).
    pub(crate) fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// The error of a request on a connection that had already failed.
    fn lost(&self) -> Error {
        let message = match &*self.shared.reason.lock() {
            Some(why) => format!(
                "RDMA connection to {} broken earlier: {why}",
                self.shared.peer
            ),
            None => format!("RDMA connection to {} broken", self.shared.peer),
        };
        Error::Rdma(RdmaError::new(RdmaErrorKind::ConnectionBroken, message))
    }
}

impl Transport for RdmaConnection {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn read<'a>(
        &'a self,
        _id: &'a RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        _confirm: Option<ConfirmAsk>,
    ) -> ReadFuture<'a> {
        Box::pin(async move {
            let n = self.run(ops, ctl, deadline).await?;
            Ok(ReadDone::unconfirmed(n))
        })
    }

    fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Acquire)
    }
}

impl RdmaConnection {
    /// The error that broke the connection first, once it is broken: later requests see
    /// flushes and "broken earlier", which say nothing of the cause.
    pub(crate) fn first_error(&self) -> Option<RdmaError> {
        self.shared.reason.lock().clone()
    }
}
