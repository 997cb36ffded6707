//! Reading from one peer over several RDMA devices ("rails", one connection per device pair).
//!
//! A read is cut among the rails that work, in proportion to the bandwidth each delivered
//! ([`stripe::split`]). A rail whose path fails (its link or port down, the peer's NIC gone) is
//! paused for a cool-down ([`HealthBook`]) and its part of the read runs again on the others
//! (reads are idempotent, and a failed RDMA read returns only once nothing writes into its
//! memory). With every rail down, reads fail over to TCP when the configuration allows, logged
//! with the reason. When a pause ends, the session reports itself broken so that the next
//! request builds a new one with every device again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::rdma::RdmaConnection;
use super::stripe::{self, HealthBook, Verdict};
use super::tcp::TcpTransport;
use super::{ConfirmAsk, ReadDone, ReadFuture, ReadOp, RequestCtl, Transport};
use crate::error::{Error, Result};
use crate::ids::RequestId;

/// What an engine keeps across sessions about its device pairs: their health and the bytes
/// each of its devices moved.
#[derive(Debug)]
pub(crate) struct RailBook {
    pub(crate) health: Mutex<HealthBook>,
    bytes: Mutex<HashMap<String, u64>>,
    /// Device pairs paused after a path failure, ever.
    paused: std::sync::atomic::AtomicU64,
}

impl RailBook {
    /// A book whose first pause is `cooldown`.
    pub(crate) fn new(cooldown: Duration) -> RailBook {
        RailBook {
            health: Mutex::new(HealthBook::new(cooldown)),
            bytes: Mutex::new(HashMap::new()),
            paused: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How many times a device pair was paused after a path failure.
    pub(crate) fn pauses(&self) -> u64 {
        self.paused.load(Ordering::Relaxed)
    }

    /// Bytes read through each of this engine's RDMA devices, by name.
    pub(crate) fn device_bytes(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self
            .bytes
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        v.sort();
        v
    }
}

/// One device pair's connection.
pub(crate) struct Rail {
    /// Health key: peer and device pair.
    pub(crate) key: String,
    /// This engine's device.
    pub(crate) device: String,
    pub(crate) conn: RdmaConnection,
    failed: AtomicBool,
}

impl Rail {
    /// A rail over `conn`, through this engine's `device`, keyed `key` in the health book.
    pub(crate) fn new(key: String, device: String, conn: RdmaConnection) -> Rail {
        Rail {
            key,
            device,
            conn,
            failed: AtomicBool::new(false),
        }
    }

    fn usable(&self) -> bool {
        !self.failed.load(Ordering::Acquire) && !self.conn.is_broken()
    }
}

/// Connects the TCP transport a session fails over to.
pub(crate) type TcpConnect =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Result<TcpTransport>> + Send>> + Send + Sync>;

/// A session's RDMA data path over one or more device pairs, with TCP behind it.
pub(crate) struct Rails {
    peer: String,
    rails: Vec<Rail>,
    book: Arc<RailBook>,
    fallback: Option<(TcpConnect, tokio::sync::OnceCell<TcpTransport>)>,
    /// When a device pair this session does not use (paused at its start, or failed since)
    /// may be used again: the session is rebuilt then.
    resume_at: Mutex<Option<Instant>>,
    failed_over: AtomicBool,
}

impl Rails {
    /// The path to `peer` over `rails` (at least one, unless `fallback` is given), TCP through
    /// `fallback` when every rail is down; `resume_at` is when a pair left out may be used.
    pub(crate) fn new(
        peer: String,
        rails: Vec<Rail>,
        book: Arc<RailBook>,
        fallback: Option<TcpConnect>,
        resume_at: Option<Instant>,
    ) -> Rails {
        Rails {
            peer,
            rails,
            book,
            fallback: fallback.map(|f| (f, tokio::sync::OnceCell::new())),
            resume_at: Mutex::new(resume_at),
            failed_over: AtomicBool::new(false),
        }
    }

    fn fail(&self, rail: &Rail, e: &Error) {
        if rail.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        let now = Instant::now();
        let pause = self.book.health.lock().failed(&rail.key, now);
        self.book.paused.fetch_add(1, Ordering::Relaxed);
        let mut r = self.resume_at.lock();
        *r = Some(r.map_or(now + pause, |t| t.min(now + pause)));
        tracing::warn!(peer = %self.peer, device = %rail.device, error = %e, ?pause,
            "RDMA device pair failed: paused, its reads go to the other devices");
    }

    async fn over_tcp(
        &self,
        id: &RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        why: Error,
    ) -> Result<u64> {
        let Some((connect, tcp)) = &self.fallback else {
            return Err(why);
        };
        if !self.failed_over.swap(true, Ordering::AcqRel) {
            tracing::warn!(peer = %self.peer, reason = %why,
                "every RDMA device towards the peer failed: reads fail over to TCP until a cool-down ends");
        }
        let t = tcp
            .get_or_try_init(connect)
            .await
            .map_err(|e| Error::ConnectionLost {
                peer: self.peer.clone(),
                reason: format!("RDMA failed ({why}); TCP failover: {e}"),
            })?;
        // Failed over: confirmed by `Done` as every RDMA read is.
        let done = t.read(id, ops, ctl, deadline, None).await?;
        Ok(done.work_requests)
    }

    // Long: the striping loop: share out, read on every rail, judge each result and re-share the
    //   failed parts until done or out of time; the rounds carry the rails' measurements.
    async fn run(
        &self,
        id: &RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
    ) -> Result<u64> {
        let mut pending = ops;
        let mut work_requests = 0;
        let mut last: Option<Error> = None;
        loop {
            let live: Vec<&Rail> = self.rails.iter().filter(|r| r.usable()).collect();
            if live.is_empty() {
                let why = last.unwrap_or_else(|| Error::ConnectionLost {
                    peer: self.peer.clone(),
                    reason: "every RDMA device pair towards the peer failed or is paused".into(),
                });
                return Ok(work_requests + self.over_tcp(id, pending, ctl, deadline, why).await?);
            }
            let weights: Vec<f64> = {
                let h = self.book.health.lock();
                let rates: Vec<Option<f64>> = live.iter().map(|r| h.rate(&r.key)).collect();
                // Unmeasured rails count as the best measured one, so they get work to measure.
                let best = rates.iter().flatten().cloned().fold(0.0, f64::max);
                rates.iter().map(|r| r.unwrap_or(best.max(1.0))).collect()
            };
            let lens: Vec<u64> = pending.iter().map(|o| o.local.len()).collect();
            let runs = stripe::split(&lens, &weights);
            let mut parts: Vec<Vec<ReadOp>> = Vec::with_capacity(runs.len());
            let mut rest = pending;
            for r in runs.iter().rev() {
                parts.push(rest.split_off(r.start));
            }
            parts.reverse();
            let reads =
                live.iter()
                    .zip(parts)
                    .filter(|(_, p)| !p.is_empty())
                    .map(|(rail, part)| {
                        let ctl = ctl.clone();
                        let bytes: u64 = part.iter().map(|o| o.local.len()).sum();
                        let keep = part.clone();
                        let fut: Pin<Box<dyn Future<Output = _> + Send + '_>> =
                            Box::pin(async move {
                                let t0 = Instant::now();
                                let r = rail.conn.read(id, part, ctl, deadline, None).await;
                                (*rail, keep, bytes, t0.elapsed(), r)
                            });
                        fut
                    });
            let results = join_all(reads.collect()).await;
            let mut again = Vec::new();
            let mut fatal = None;
            for (rail, part, bytes, took, r) in results {
                let e = match r {
                    Ok(n) => {
                        work_requests += n.work_requests;
                        self.book.health.lock().delivered(&rail.key, bytes, took);
                        *self
                            .book
                            .bytes
                            .lock()
                            .entry(rail.device.clone())
                            .or_default() += bytes;
                        continue;
                    }
                    Err(e) => e,
                };
                let first = rail.conn.first_error();
                let broken = rail.conn.is_broken();
                match stripe::judge(&e, first.as_ref(), ctl.is_cancelled(), broken) {
                    Verdict::Fail => {
                        fatal.get_or_insert(e);
                        continue;
                    }
                    Verdict::Pause => self.fail(rail, &e),
                    Verdict::Reroute => {}
                }
                again.extend(part);
                last = Some(e);
            }
            if let Some(e) = fatal {
                return Err(e);
            }
            if again.is_empty() {
                return Ok(work_requests);
            }
            if tokio::time::Instant::now() >= deadline {
                // No time left to read the failed part elsewhere: the failure is the answer.
                return Err(last.take().expect("a failed part has its error"));
            }
            pending = again;
        }
    }
}

/// Waits for every future, returning their outputs in order.
async fn join_all<'a, T>(futs: Vec<Pin<Box<dyn Future<Output = T> + Send + 'a>>>) -> Vec<T> {
    let mut futs: Vec<Option<_>> = futs.into_iter().map(Some).collect();
    let mut out: Vec<Option<T>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, o) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *o = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

impl Transport for Rails {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn read<'a>(
        &'a self,
        id: &'a RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        _confirm: Option<ConfirmAsk>,
    ) -> ReadFuture<'a> {
        // RDMA reads reach no CPU on the server: confirmed by `Done`.
        Box::pin(async move {
            let n = self.run(id, ops, ctl, deadline).await?;
            Ok(ReadDone::unconfirmed(n))
        })
    }

    fn is_broken(&self) -> bool {
        if self.resume_at.lock().is_some_and(|t| Instant::now() >= t) {
            return true;
        }
        // A pair broken without a path failure (a cancel, a deadline, a bad key): rebuilt at
        // once, as a single connection was before.
        if self
            .rails
            .iter()
            .any(|r| !r.failed.load(Ordering::Acquire) && r.conn.is_broken())
        {
            return true;
        }
        if self.rails.iter().any(Rail::usable) {
            return false;
        }
        match &self.fallback {
            None => true,
            Some((_, tcp)) => tcp.get().is_some_and(|t| t.is_broken()),
        }
    }
}
