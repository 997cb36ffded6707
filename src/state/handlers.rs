//! What the engine's servers call into: the handshake service's [`ControlHandler`] and the
//! data servers' [`Exports`] and [`DataServer`].

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::EngineState;
use crate::auth::{AuthKey, SessionSecret};
use crate::completion::{Follower, SendNotice};
use crate::control::messages::Descriptor;
use crate::control::ControlHandler;
use crate::error::{RdmaError, RdmaErrorKind, Refusal, RefusalKind};
use crate::gpu::{DeviceRuntime, GpuApi};
use crate::grant::Grant;
use crate::holds::HoldTable;
use crate::ids::{RegionId, RequestId};
use crate::inbox::{PeerMessage, Refused};
use crate::memory::Region;
use crate::tp::Reader;
use crate::transport::rdma::{self, ServerQps};
use crate::transport::stream::access::{ConfirmRead, DataServer, DataSession, Exports};
use crate::transport::stream::staging::StagingPool;

impl ControlHandler for EngineState {
    fn descriptor(&self) -> Option<Arc<Descriptor>> {
        EngineState::descriptor(self)
    }

    fn notice(
        &self,
        peer: SocketAddr,
        from: &Reader,
        id: RequestId,
        notice: SendNotice,
        hold: Option<u64>,
    ) -> std::result::Result<Duration, Refusal> {
        tracing::debug!(%peer, %id, ?notice, "send notice");
        let done = matches!(notice, SendNotice::Done);
        let r = self.completions.update(|t| {
            // With open reads (benchmarks) any exported byte is served without a hold, so a
            // read of a request never held is confirmed; one that is held follows its hold.
            if done && self.id.config.open_reads && !t.is_holding(&id) {
                return Ok(Duration::ZERO);
            }
            t.handle_notice(&id, from, notice, hold)
                .map(|since| since.elapsed())
        });
        if r.is_err() {
            self.counters
                .notices_refused
                .fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn message(
        &self,
        peer: SocketAddr,
        from: &str,
        body: Vec<u8>,
    ) -> std::result::Result<(), Refusal> {
        let len = body.len();
        let m = PeerMessage {
            from: from.to_string(),
            peer,
            body,
        };
        let r = self.inbox.lock().push(m);
        let c = &self.counters;
        match r {
            Ok(()) => {
                c.messages_received.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(why) => {
                c.messages_refused.fetch_add(1, Ordering::Relaxed);
                let reason = match why {
                    Refused::TooLarge => format!(
                        "message of {len} bytes is over the {} byte limit",
                        crate::inbox::MAX_MESSAGE_BYTES
                    ),
                    Refused::Full => "inbox full: the application does not take its messages \
                                      (Engine::take_messages)"
                        .to_string(),
                };
                Err(Refusal::new(RefusalKind::Limit, reason))
            }
        }
    }

    fn handshake(&self, accepted: bool) {
        let c = if accepted {
            &self.counters.handshakes_accepted
        } else {
            &self.counters.handshakes_refused
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn rdma_accept(
        &self,
        peer: SocketAddr,
        device: u32,
        qps: &[rdma::QpEndpoint],
    ) -> std::result::Result<(Vec<rdma::QpEndpoint>, ServerQps), RdmaError> {
        let setup = |why: String| RdmaError::new(RdmaErrorKind::Setup, why);
        if self.rdma().is_empty() {
            return Err(setup(format!(
                "this engine has no RDMA device ({})",
                self.rdma_unavailable().unwrap_or("disabled")
            )));
        }
        let dev = self.rdma().get(device as usize).ok_or_else(|| {
            setup(format!(
                "RDMA device {device} asked for, this engine has {}",
                self.rdma().len()
            ))
        })?;
        let (guard, ours) = ServerQps::accept(dev, qps)?;
        tracing::debug!(%peer, qps = ours.len(), "queue pairs created for a reader");
        Ok((ours, guard))
    }

    fn auth_key(&self) -> Option<&AuthKey> {
        self.id.config.auth_key.as_ref()
    }

    fn session_opened(&self, secret: SessionSecret, reader: Reader) {
        self.data_sessions
            .lock()
            .insert(secret.id, (secret, Arc::new(reader)));
    }

    fn session_closed(&self, id: [u8; 16]) {
        self.data_sessions.lock().remove(&id);
    }

    fn reader_connected(&self, reader: &Reader) {
        self.completions
            .update(|t| t.reader_connected(&reader.engine));
    }

    fn reader_disconnected(&self, reader: &Reader) {
        let leased = self
            .completions
            .update(|t| t.reader_disconnected(&reader.engine, Instant::now()));
        if let Some(holds) = leased {
            tracing::info!(engine = %reader.engine, holds, lease = ?self.id.config.lease, "a reader has no control connection left: its holds end after the lease unless it comes back");
        }
    }

    fn reader_left(&self, reader: &Reader) {
        let last = self.completions.update(|t| t.reader_left(&reader.engine));
        if last {
            tracing::debug!(engine = %reader.engine, "a reader closed its idle session in order: its holds keep their abort timeouts");
        }
    }

    fn reading(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
    ) -> std::result::Result<(), Refusal> {
        if self.id.config.open_reads {
            return Ok(());
        }
        self.completions.update(|t| t.claim_checked(id, from, hold))
    }

    fn pin(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
        pin: Duration,
    ) -> std::result::Result<Duration, Refusal> {
        let most = self.id.config.read_pin;
        let r = self.completions.update(|t| {
            if self.id.config.open_reads && !t.is_holding(id) {
                // Every exported byte is served without a hold: nothing to pin.
                return Ok(Duration::ZERO);
            }
            if pin > most {
                return Err(Refusal::new(
                    RefusalKind::NotHeld,
                    format!("this engine pins a hold for at most {most:?}, not {pin:?}"),
                ));
            }
            let now = Instant::now();
            t.pin(id, from, hold, now, pin)
                .map(|since| now.saturating_duration_since(since))
        });
        let c = &self.counters;
        match &r {
            Ok(_) => c.reads_pinned.fetch_add(1, Ordering::Relaxed),
            Err(_) => c.notices_refused.fetch_add(1, Ordering::Relaxed),
        };
        r
    }

    fn follow(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
        wait: Duration,
        follower: Arc<dyn Follower>,
    ) -> std::result::Result<(), Refusal> {
        let until = Instant::now() + wait.min(MAX_FOLLOW_WAIT);
        self.completions
            .update(|t| t.follow(id, from, hold, follower, until))
    }
}

/// The longest a reader's follow waits for a request to be held, whatever it asks.
const MAX_FOLLOW_WAIT: Duration = Duration::from_secs(600);

impl Exports for EngineState {
    fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        EngineState::region(self, id)
    }

    fn auth_required(&self) -> bool {
        self.id.config.auth_key.is_some()
    }

    fn data_session(&self, id: &[u8; 16]) -> Option<DataSession> {
        self.data_sessions.lock().get(id).cloned()
    }

    fn grant(
        &self,
        id: &RequestId,
        reader: Option<&Reader>,
    ) -> std::result::Result<Option<Arc<Grant>>, Refusal> {
        if self.id.config.open_reads {
            return Ok(None);
        }
        self.completions
            .update(|t| t.grant_for(id, reader))
            .map(Some)
    }

    fn claim(&self, id: &RequestId, reader: &Reader) {
        self.completions.update(|t| t.claim(id, reader));
    }

    fn confirm(&self, read: &ConfirmRead<'_>) -> std::result::Result<Duration, Refusal> {
        // Bound to its control session: a reader without one cannot confirm (as its `Done`
        // could not be sent), and its holds are on its lease.
        if !self.data_sessions.lock().contains_key(read.session) {
            self.counters
                .notices_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::new(
                RefusalKind::NotHeld,
                "the reader's control session closed before its read was confirmed",
            ));
        }
        let open = self.id.config.open_reads;
        // Under the tracker's lock, where holds end: a grant seen live here was live while
        // every byte was copied out (they were copied before this check).
        let r = self.completions.update(|t| {
            if read.grant.is_some_and(Grant::is_ended) {
                return Err(Refusal::new(
                    RefusalKind::NotHeld,
                    format!(
                        "request {} was released, expired or held again while its blocks were \
                         being read",
                        read.id
                    ),
                ));
            }
            if open && !t.is_holding(read.id) {
                return Ok(Duration::ZERO);
            }
            t.handle_notice(read.id, read.reader, SendNotice::Done, read.hold)
                .map(|since| since.elapsed())
        });
        if r.is_err() {
            self.counters
                .notices_refused
                .fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn served(&self, bytes: Option<u64>) {
        let c = &self.counters;
        match bytes {
            Some(b) => {
                c.data_requests_served.fetch_add(1, Ordering::Relaxed);
                c.bytes_served.fetch_add(b, Ordering::Relaxed);
            }
            None => {
                c.data_requests_refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl DataServer for EngineState {
    fn device_runtime(&self, api: GpuApi) -> Option<(Arc<dyn DeviceRuntime>, i32)> {
        let rt = self.gpus.get(api).ok()?;
        Some((rt, self.gpu_ordinal(api)))
    }

    fn staging(&self) -> &Arc<StagingPool> {
        EngineState::staging(self)
    }

    fn hold_table(&self) -> Option<Arc<HoldTable>> {
        EngineState::hold_table(self).cloned()
    }
}
