//! The completion poller: one thread per device blocks on the device's completion channel
//! (`poll(2)`, no spinning while idle), then drains the completion queue that fired through the
//! handler registered for it. Connections register as [`CqHandler`]s with the device's
//! [`CqEvents`], so the device never names a connection type and the poller never names the
//! device.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, WorkCompletionStatus,
};

/// What the poller drives: the owner of one completion queue.
pub(crate) trait CqHandler: Send + Sync {
    /// Arms the completion queue for the next event notification.
    fn arm(&self);
    /// Drains the completion queue (and re-arms it).
    fn drain(&self);
    /// Called every poller round (at least every 100 ms): time-based work such as retiring
    /// reads of a flushed queue pair.
    fn tick(&self);
}

/// A device's completion events: its completion channel, and the handler of each completion
/// queue made on it (by the id the queue carries as its context).
pub(crate) struct CqEvents {
    /// The device's name, for logs.
    device: String,
    channel: Arc<CompletionChannel>,
    handlers: Mutex<HashMap<u64, Weak<dyn CqHandler>>>,
}

impl CqEvents {
    pub(super) fn new(device: &str, channel: Arc<CompletionChannel>) -> Self {
        CqEvents {
            device: device.to_string(),
            channel,
            handlers: Mutex::new(HashMap::new()),
        }
    }

    /// The channel completion queues are made on.
    pub(super) fn channel(&self) -> &Arc<CompletionChannel> {
        &self.channel
    }

    /// Routes the events of completion queue `cq_id` to `conn`, and arms the queue.
    pub(super) fn attach(&self, cq_id: u64, conn: &Arc<dyn CqHandler>) {
        self.handlers.lock().insert(cq_id, Arc::downgrade(conn));
        conn.arm();
    }

    pub(super) fn detach(&self, cq_id: u64) {
        self.handlers.lock().remove(&cq_id);
    }

    /// Acknowledges every pending event and drains the queue each one names.
    fn handle(&self) {
        loop {
            let mut cq: *mut rdma_mummy_sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is valid while `self` lives; out-pointers are valid locals.
            let rc = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut cq,
                    &mut ctx,
                )
            };
            if rc != 0 {
                return; // EAGAIN: no more events
            }
            let id = ctx as usize as u64;
            // Take a strong reference before acknowledging: a CQ is destroyed only after all of
            // its events are acknowledged, so `cq` is valid until the ack below.
            let conn = self.handlers.lock().get(&id).and_then(Weak::upgrade);
            // SAFETY: `cq` came from ibv_get_cq_event and is not destroyed before this ack.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
            if let Some(c) = conn {
                c.drain();
            }
        }
    }

    /// Every live handler's time-based work.
    fn tick(&self) {
        let conns: Vec<Arc<dyn CqHandler>> = self
            .handlers
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for c in conns {
            c.tick();
        }
    }
}

/// The poller: waits on the completion channel (no spinning while idle), then drains the
/// connection whose queue fired. A 100 ms wake-up also lets connections time out stuck work.
/// Returns once `stop` is set or the device dropped its events.
pub(super) fn poll_loop(events: Weak<CqEvents>, stop: Arc<AtomicBool>) {
    let fd = match events.upgrade() {
        Some(e) => std::os::fd::AsRawFd::as_raw_fd(&*e.channel),
        None => return,
    };
    while !stop.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: pfd is a valid pollfd for the duration of the call; fd belongs to the
        // completion channel, which lives as long as the events (checked by the upgrade below
        // before any use of the channel).
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        let Some(e) = events.upgrade() else { return };
        // A panic here (the verbs bindings assert when destroying objects) must not stop the
        // poller: every connection on the device depends on it.
        let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if n > 0 {
                e.handle();
            }
            e.tick();
        }));
        if round.is_err() {
            tracing::error!(
                device = e.device,
                "the completion poller caught a panic; continuing"
            );
        }
        drop(e);
        if n < 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Arms a completion queue for one event notification.
pub(crate) fn arm(cq: &BasicCompletionQueue) {
    // SAFETY: the CQ is alive (borrowed) and was created on a completion channel.
    unsafe {
        rdma_mummy_sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0);
    }
}

/// The verbs name of a work completion status, with what it means.
pub(crate) fn status_name(status: u32) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::wc_status as wc;

    #[test]
    fn named_statuses_are_the_verbs_values() {
        use WorkCompletionStatus as S;
        for (ours, verbs) in [
            (wc::LOC_QP_OP_ERR, S::LocalQueuePairOperationError),
            (wc::WR_FLUSH_ERR, S::WorkRequestFlushedError),
            (wc::BAD_RESP_ERR, S::BadResponseError),
            (wc::REM_ACCESS_ERR, S::RemoteAccessError),
            (wc::RETRY_EXC_ERR, S::RetryCounterExceededError),
            (
                wc::RNR_RETRY_EXC_ERR,
                S::ResponderNotReadyRetryCounterExceededError,
            ),
            (wc::GENERAL_ERR, S::GeneralError),
        ] {
            assert_eq!(ours, verbs as u32, "{}", status_name(ours));
        }
    }
}
