//! Data transports behind one trait. A transport takes the planner's segments, already resolved
//! to local registered spans, and reads the peer's bytes into them.

pub(crate) mod local;
pub(crate) mod rails;
#[allow(unsafe_code)]
pub(crate) mod rdma;
pub(crate) mod stream;
pub(crate) mod stripe;
pub(crate) mod tcp;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::error::Result;
use crate::ids::{RegionId, RequestId};
use crate::memory::RegionSpan;

/// How long a transport waits for a connection, and for each step of its I/O.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waits {
    pub(crate) connect: std::time::Duration,
    pub(crate) io: std::time::Duration,
}

/// One read: the peer's `[remote_offset, +local.len())` of `remote_region` into `local`.
#[derive(Debug, Clone)]
pub(crate) struct ReadOp {
    pub local: RegionSpan,
    pub remote_region: RegionId,
    pub remote_offset: u64,
}

/// Per-request control shared with the transport: cancellation that is safe against in-flight
/// writes into local memory.
#[derive(Debug, Default)]
pub(crate) struct RequestCtl {
    cancelled: AtomicBool,
    /// Held by a transport while it writes into the request's local memory.
    write_guard: parking_lot::Mutex<()>,
    /// Wakes transports waiting on the request when it is cancelled.
    woken: tokio::sync::Notify,
    /// Copies another process is making into the request's memory (the same-host transport's
    /// server writes the reader's blocks): a cancel waits for them too.
    remote: AtomicUsize,
    /// Wakes a cancel waiting for `remote` to reach zero.
    drained: tokio::sync::Notify,
    /// When the first of the request's bytes landed in its memory (for its timeline).
    first_data: std::sync::OnceLock<std::time::Instant>,
}

impl RequestCtl {
    /// Stops further writes into the request's memory. When this returns, no transport is
    /// writing into it and none will.
    pub(crate) fn cancel(&self) {
        self.mark_cancelled();
        drop(self.write_guard.lock());
    }

    /// [`cancel`](Self::cancel) without blocking an async thread: new writes stop at once, and
    /// a write in progress (a GPU copy, for staged memory) is waited out on a blocking thread
    /// for at most `wait`. Returns false, with an error logged, if it is still running then: a
    /// hung GPU copy may yet land in the request's blocks.
    pub(crate) async fn cancel_async(
        self: &std::sync::Arc<Self>,
        wait: std::time::Duration,
    ) -> bool {
        self.mark_cancelled();
        let me = self.clone();
        let waited = tokio::time::timeout(wait, async {
            let _ = tokio::task::spawn_blocking(move || me.cancel()).await;
            self.remote_drained().await;
        })
        .await;
        if waited.is_err() {
            tracing::error!(
                ?wait,
                "a copy into a cancelled request's memory is still running (hung GPU copy, or \
                 a same-host peer still copying?); the request is reported failed, but its \
                 blocks may still be written"
            );
        }
        waited.is_ok()
    }

    /// A peer process starts a copy into the request's memory; [`remote_end`] when it
    /// answered (or its connection closed, which it does only once its copies ended).
    ///
    /// [`remote_end`]: RequestCtl::remote_end
    pub(crate) fn remote_begin(&self) {
        self.remote.fetch_add(1, Ordering::AcqRel);
    }

    /// A copy begun with [`remote_begin`](RequestCtl::remote_begin) ended.
    pub(crate) fn remote_end(&self) {
        if self.remote.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.drained.notify_waiters();
        }
    }

    /// Resolves once no peer process copies into the request's memory.
    async fn remote_drained(&self) {
        loop {
            let woken = self.drained.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.remote.load(Ordering::Acquire) == 0 {
                return;
            }
            woken.await;
        }
    }

    /// Stops new writes into the request's memory without waiting for one in progress.
    pub(crate) fn mark_cancelled(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.woken.notify_waiters();
    }

    /// Resolves once the request is cancelled.
    pub(crate) async fn cancelled(&self) {
        loop {
            let woken = self.woken.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.is_cancelled() {
                return;
            }
            woken.await;
        }
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Runs `write` (a copy into the request's memory) unless cancelled; `discard` otherwise.
    pub(crate) fn guarded<R>(&self, write: impl FnOnce() -> R, discard: impl FnOnce() -> R) -> R {
        let _g = self.write_guard.lock();
        if self.is_cancelled() {
            discard()
        } else {
            let r = write();
            self.note_data();
            r
        }
    }

    /// Some of the request's bytes landed in its memory (a transport calls it as they do; the
    /// first call is kept).
    pub(crate) fn note_data(&self) {
        let _ = self.first_data.set(std::time::Instant::now());
    }

    /// When the first bytes landed, if any did.
    pub(crate) fn first_data(&self) -> Option<std::time::Instant> {
        self.first_data.get().copied()
    }
}

/// The controls of every attempt of one read (one per source, and per retry), so that a
/// cancel reaches all of them, attempts that start after it included.
#[derive(Debug, Default)]
pub(crate) struct ReadCancel {
    /// The caller cancelled the read (`Engine::cancel`).
    by_caller: AtomicBool,
    /// The read is failing (a source failed): the other sources stop.
    stopped: AtomicBool,
    attempts: parking_lot::Mutex<Vec<std::sync::Arc<RequestCtl>>>,
}

impl ReadCancel {
    /// A new attempt's control, cancelled at once when the read already was.
    pub(crate) fn attempt(&self) -> std::sync::Arc<RequestCtl> {
        let ctl = std::sync::Arc::new(RequestCtl::default());
        let mut attempts = self.attempts.lock();
        if self.is_stopped() {
            ctl.mark_cancelled();
        }
        attempts.push(ctl.clone());
        ctl
    }

    /// The caller cancels the read: every attempt stops writing.
    pub(crate) fn cancel_by_caller(&self) {
        self.by_caller.store(true, Ordering::Release);
        self.stop();
    }

    /// Every attempt stops writing (a source failed, or the caller cancelled).
    pub(crate) fn stop(&self) {
        let attempts = self.attempts.lock();
        self.stopped.store(true, Ordering::Release);
        for a in attempts.iter() {
            a.mark_cancelled();
        }
    }

    /// Every attempt's control so far.
    pub(crate) fn attempts(&self) -> Vec<std::sync::Arc<RequestCtl>> {
        self.attempts.lock().clone()
    }

    /// Whether the caller cancelled the read.
    pub(crate) fn by_caller(&self) -> bool {
        self.by_caller.load(Ordering::Acquire)
    }

    /// Whether the read was stopped (by the caller, or by a failing source).
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }
}

/// Runs `transfer` (a transport's read of one request) until it ends, `deadline` passes or the
/// request is cancelled. In the last two cases the request's memory is made its own again first
/// (`cancel_async`: no transport, and no same-host peer, writes into it any more, or `wait` has
/// passed), then the deadline or the cancel is reported.
pub(crate) async fn bounded<T>(
    transfer: impl Future<Output = Result<T>>,
    ctl: &std::sync::Arc<RequestCtl>,
    deadline: tokio::time::Instant,
    wait: std::time::Duration,
    peer: &(dyn std::fmt::Display + Sync),
) -> Result<T> {
    let started = tokio::time::Instant::now();
    tokio::select! {
        r = tokio::time::timeout_at(deadline, transfer) => match r {
            Ok(r) => r,
            Err(_) => {
                ctl.cancel_async(wait).await;
                Err(crate::error::Error::Timeout {
                    what: format!("reading from {peer} (request deadline)"),
                    after: started.elapsed(),
                })
            }
        },
        _ = ctl.cancelled() => {
            ctl.cancel_async(wait).await;
            Err(crate::error::Error::Cancelled(format!("reading from {peer}")))
        }
    }
}

/// The server's answer to a confirmation carried by a read's data request (protocol 8): how
/// long it had held the request when it checked, after its bytes were copied (`Ok`), or why it
/// did not hold it for this reader then (`Err`).
pub(crate) type Confirmed = std::result::Result<std::time::Duration, crate::error::Refusal>;

/// What a read asks the server to confirm with its data, when its bytes fit one data request
/// (TCP) or one copy request (same host): the hold the reader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConfirmAsk {
    /// The hold's token (`ReadRequest::hold`), if the reader knows it.
    pub(crate) hold: Option<u64>,
    /// A fingerprint of the remote block ids the read names (`grant::blocks_hash`): a
    /// same-host reader copies on its own only when the hold grants exactly those.
    pub(crate) blocks: u64,
}

/// What a transport's read came to: the work requests it took (RDMA work requests, or data
/// requests) and, where the server confirmed with the data, its confirmation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReadDone {
    /// RDMA work requests, or TCP / same-host data requests.
    pub(crate) work_requests: u64,
    /// The server's confirmation, when the data carried one (the read then waits for no
    /// `Confirm`), or the reader's own from the server's hold table (a same-host copy the
    /// reader made itself).
    pub(crate) confirmed: Option<Confirmed>,
    /// The server has not heard of the read (a reader-side copy): a `Received` tells it, and
    /// nothing is answered.
    pub(crate) tell_received: bool,
}

impl ReadDone {
    /// A read whose data carried no confirmation.
    pub(crate) fn unconfirmed(work_requests: u64) -> ReadDone {
        ReadDone {
            work_requests,
            confirmed: None,
            tell_received: false,
        }
    }
}

/// A boxed transfer future; it yields what the read came to.
pub(crate) type ReadFuture<'a> = Pin<Box<dyn Future<Output = Result<ReadDone>> + Send + 'a>>;

/// A connected data path to one peer.
pub(crate) trait Transport: Send + Sync {
    /// Short name for logs and reports.
    fn name(&self) -> &'static str;
    /// Reads every op; resolves when all bytes are in place, on the first error, or with
    /// `Error::Timeout` at `deadline`. It resolves only once nothing writes into the ops' local
    /// memory any more.
    /// `id` names the request: the peer serves only the blocks it holds for it (TCP; RDMA
    /// reads are one-sided, see docs/security.md).
    /// `confirm`: the server may confirm the read with its data (transports that can, when
    /// the read fits one data request; the others ignore it).
    fn read<'a>(
        &'a self,
        id: &'a RequestId,
        ops: Vec<ReadOp>,
        ctl: std::sync::Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        confirm: Option<ConfirmAsk>,
    ) -> ReadFuture<'a>;
    /// Whether the path has failed and must be rebuilt.
    fn is_broken(&self) -> bool;
    /// Whether the server learns the reader from its data requests (TCP and the same host:
    /// they name the reader's control session), so that no `Reading` notice is needed.
    fn names_reader(&self) -> bool {
        false
    }
}
