//! The completion side of a connection: its completion queue polled (by the device's poller,
//! or by a request waiting for a small read) and each completion retired in its queue pair's
//! ledger.

use std::time::Instant;

use sideway::ibverbs::completion::{PollCompletionQueueError, WorkCompletionStatus};

use super::{ConnShared, FLUSH_GRACE};
use crate::error::{RdmaError, RdmaErrorKind};
use crate::transport::rdma::ledger::split_wr_id;
use crate::transport::rdma::poller::{arm, status_name, CqHandler};

impl ConnShared {
    /// Takes what the completion queue holds now (the caller holds `polling`): the number of
    /// completions, or `None` when polling failed (the connection is then broken).
    pub(super) fn poll_cq(&self) -> Option<usize> {
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
                self.mark_broken(&RdmaError::new(
                    RdmaErrorKind::Poll,
                    format!("polling the completion queue failed: {e}"),
                ));
                return None;
            }
        }
        Some(got)
    }

    fn complete(&self, id: u64, status: u32) {
        let (idx, seq) = split_wr_id(id);
        let Some(slot) = self.qps.get(idx) else {
            return;
        };
        let ok = status == WorkCompletionStatus::Success as u32;
        let why = (!ok).then(|| {
            let name = status_name(status);
            // Flushed work requests follow a queue pair's first error, logged at warn already:
            // one line per request in flight would drown it.
            if status == WorkCompletionStatus::WorkRequestFlushedError as u32 {
                tracing::debug!(peer = %self.peer, qp = idx, seq, status = %name, "RDMA work request flushed");
            } else {
                tracing::warn!(peer = %self.peer, qp = idx, seq, status = %name, "RDMA work completion error");
            }
            RdmaError::new(
                RdmaErrorKind::WorkCompletion { status },
                format!("RDMA READ from {} failed: {name}", self.peer),
            )
        });
        let (retired, newly_broken) = {
            let mut st = slot.state.lock();
            st.ledger
                .complete(seq, why.map_or(Ok(()), Err), Instant::now())
        };
        for (pending, failure) in retired {
            pending.finish(failure.as_ref());
        }
        slot.credit.notify_waiters();
        if let Some(why) = newly_broken {
            self.mark_broken(&why);
        }
    }
}

impl CqHandler for ConnShared {
    fn arm(&self) {
        arm(&self.cq);
    }

    /// Drains the completion queue, then re-arms it (polling once more to close the race).
    fn drain(&self) {
        let _polling = self.polling.lock();
        let mut armed = false;
        loop {
            match self.poll_cq() {
                None => return,
                Some(0) if armed => return,
                Some(0) => {
                    self.arm();
                    armed = true;
                }
                Some(_) => armed = false,
            }
        }
    }

    /// Retires chains that outlived the flush grace on queue pairs in the error state.
    fn tick(&self) {
        let now = Instant::now();
        for slot in &self.qps {
            let retired = slot.state.lock().ledger.tick(now, FLUSH_GRACE);
            let any = !retired.is_empty();
            for (pending, failure) in retired {
                pending.finish(failure.as_ref());
            }
            if any {
                slot.credit.notify_waiters();
            }
        }
    }
}
