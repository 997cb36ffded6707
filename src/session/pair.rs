//! The pair harness: a prefill engine's state and a decode engine's sessions joined in memory,
//! with no socket, on tokio's paused (virtual) clock. An in-memory transport copies blocks from
//! the prefill's regions; a fault plan per connection makes it fail after N reads, hang or run
//! slow; an in-memory control link delivers the decode's done/abort notices to the prefill's
//! tracker; a scripted connector counts connects and can fail or hang them. The completion,
//! expiry, abort, cancellation and session-rebuild paths are then checked exactly and fast.
//! What needs real verbs (a wrong remote key, a flush) stays in the SoftRoCE VM.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{
    run_read, ConnectFuture, Connector, ControlLink, NoticeFuture, PeerConn, ReadJob, Sessions,
};
use crate::completion::{FailureCause, Finished, SendNotice, Side};
use crate::config::{EngineConfig, TransportChoice};
use crate::control::messages::Message;
use crate::control::Confirmation;
use crate::control::ControlHandler;
use crate::error::{Error, Result};
use crate::gpu::Runtimes;
use crate::ids::{BlockId, RegionId, RequestId};
use crate::layout::ModelShape;
use crate::memory::Region;
use crate::state::{EngineState, Identity, Rdma};
use crate::transport::{ConfirmAsk, ReadDone, ReadFuture, ReadOp, RequestCtl, Transport};

/// What a connection's transport does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Reads every byte.
    None,
    /// Fails (and breaks the connection) once this many reads (ops) went through.
    FailAfter(u32),
    /// Never answers: the read ends at its deadline.
    Hang,
    /// Answers after this long.
    Delay(Duration),
}

/// What the next connects do, and what happened.
#[derive(Default)]
struct Script {
    /// Fault of each new connection, in order (then `Fault::None`).
    faults: VecDeque<Fault>,
    /// Connects to fail before one succeeds.
    fail_connects: u32,
    /// Whether connects never finish.
    hang_connects: bool,
    /// Whether connects are refused by the prefill (as for an incompatible layout).
    refuse_connects: bool,
    /// Connects attempted.
    connects: u32,
    /// Aborts sent on connections of their own (`Connector::send_aborts`).
    aborts_sent: u32,
    /// Sessions closed in order (`Bye`).
    byes: u32,
}

/// The prefill's control server, in memory: notices go straight to its tracker.
struct MemControl {
    prefill: Arc<EngineState>,
    closed: AtomicBool,
    /// Wakes `gone` when `closed` is set.
    gone: tokio::sync::Notify,
    script: Arc<Mutex<Script>>,
}

/// A follower whose announcements go straight to the following read.
#[derive(Debug)]
struct MemFollower(tokio::sync::mpsc::Sender<crate::completion::Announcement>);

impl crate::completion::Follower for MemFollower {
    fn announce(&self, _id: &RequestId, a: crate::completion::Announcement) -> bool {
        self.0.try_send(a).is_ok()
    }
}

/// The decode as the prefill's control server knows it.
fn reader() -> (SocketAddr, crate::tp::Reader) {
    let peer = "127.0.0.1:1".parse().expect("address");
    let reader = crate::tp::Reader {
        engine: "decode".into(),
        tp: crate::tp::TpRank::SOLO,
    };
    (peer, reader)
}

impl ControlLink for MemControl {
    fn notify(&self, msg: Message) -> bool {
        let (peer, from) = reader();
        let from = &from;
        // A refused notice is dropped, as the control server drops it.
        let _ = match msg {
            Message::Done { request_id, hold } | Message::Received { request_id, hold } => self
                .prefill
                .notice(peer, from, request_id, SendNotice::Done, hold)
                .map(drop),
            Message::Abort {
                request_id,
                reason,
                hold,
            } => {
                let aborted = SendNotice::Aborted(reason);
                self.prefill
                    .notice(peer, from, request_id, aborted, hold)
                    .map(drop)
            }
            Message::Reading { request_id, hold } => self.prefill.reading(from, &request_id, hold),
            other => panic!("unexpected notice {other:?}"),
        };
        true
    }

    fn done(
        &self,
        id: RequestId,
        hold: Option<u64>,
    ) -> Option<tokio::sync::oneshot::Receiver<Confirmation>> {
        // Answered at once, as the control server answers: held for this reader, or why not.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (peer, from) = reader();
        let _ = tx.send(self.prefill.notice(peer, &from, id, SendNotice::Done, hold));
        Some(rx)
    }

    fn pin(
        &self,
        id: RequestId,
        hold: Option<u64>,
        pin: Duration,
    ) -> Option<(
        tokio::sync::oneshot::Receiver<Confirmation>,
        crate::control::Sent,
    )> {
        // Answered at once, as the control server answers.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (_, from) = reader();
        let _ = tx.send(self.prefill.pin(&from, &id, hold, pin));
        Some((rx, crate::control::Sent::Written))
    }

    fn follow(
        &self,
        id: RequestId,
        hold: Option<u64>,
        wait: Duration,
    ) -> Option<tokio::sync::mpsc::Receiver<crate::completion::Announcement>> {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let (_, from) = reader();
        let follower = Arc::new(MemFollower(tx));
        let refused = self
            .prefill
            .follow(&from, &id, hold, wait, follower.clone())
            .err();
        if let Some(why) = refused {
            let reason = why.into_reason();
            let ended = crate::completion::Announcement::Ended { reason };
            crate::completion::Follower::announce(&*follower, &id, ended);
        }
        Some(rx)
    }

    fn unfollow(&self, _id: &RequestId) {}

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn gone(&self) -> super::GoneFuture<'_> {
        Box::pin(async move {
            loop {
                let woken = self.gone.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                if self.is_closed() {
                    return;
                }
                woken.await;
            }
        })
    }

    fn close(&self, _within: Duration) -> super::CloseFuture<'_> {
        // The control server's part of a Bye: the reader leaves in order.
        let (_, from) = reader();
        self.prefill.reader_left(&from);
        self.closed.store(true, Ordering::Release);
        self.gone.notify_waiters();
        self.script.lock().byes += 1;
        Box::pin(std::future::ready(true))
    }
}

/// Reads from the prefill's regions in memory.
struct MemTransport {
    prefill: Arc<EngineState>,
    fault: Fault,
    reads: AtomicU32,
    broken: AtomicBool,
}

impl MemTransport {
    async fn run(&self, ops: Vec<ReadOp>, ctl: &RequestCtl) -> Result<u64> {
        if let Fault::Delay(d) = self.fault {
            tokio::time::sleep(d).await;
        }
        if self.fault == Fault::Hang {
            std::future::pending::<()>().await;
        }
        let n = ops.len() as u64;
        for op in ops {
            if let Fault::FailAfter(limit) = self.fault {
                if self.reads.load(Ordering::Acquire) >= limit {
                    self.broken.store(true, Ordering::Release);
                    return Err(Error::ConnectionLost {
                        peer: "prefill".into(),
                        reason: format!("injected failure after {limit} reads"),
                    });
                }
            }
            let remote = self
                .prefill
                .region(op.remote_region)
                .ok_or(Error::UnknownRegion(op.remote_region))?;
            let mut buf = vec![0u8; op.local.len() as usize];
            remote.read_at(op.remote_offset, &mut buf)?;
            ctl.guarded(
                || op.local.region().write_at(op.local.offset(), &buf),
                || Ok(()),
            )?;
            self.reads.fetch_add(1, Ordering::AcqRel);
        }
        Ok(n)
    }
}

impl Transport for MemTransport {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn read<'a>(
        &'a self,
        _id: &'a RequestId,
        ops: Vec<ReadOp>,
        ctl: Arc<RequestCtl>,
        deadline: tokio::time::Instant,
        _confirm: Option<ConfirmAsk>,
    ) -> ReadFuture<'a> {
        let started = tokio::time::Instant::now();
        Box::pin(async move {
            tokio::select! {
                r = tokio::time::timeout_at(deadline, self.run(ops, &ctl)) => match r {
                    Ok(r) => r.map(ReadDone::unconfirmed),
                    Err(_) => {
                        ctl.mark_cancelled();
                        Err(Error::Timeout {
                            what: "reading in memory (request deadline)".into(),
                            after: started.elapsed(),
                        })
                    }
                },
                _ = ctl.cancelled() => Err(Error::Cancelled("reading in memory".into())),
            }
        })
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }
}

/// Makes in-memory sessions to the prefill, following the script.
struct MemConnector {
    prefill: Arc<EngineState>,
    script: Arc<Mutex<Script>>,
}

impl Connector for MemConnector {
    fn connect<'a>(
        &'a self,
        _state: &'a Arc<EngineState>,
        peer: &'a str,
        generation: u64,
    ) -> ConnectFuture<'a> {
        Box::pin(async move {
            let (fault, fail, hang) = {
                let mut s = self.script.lock();
                s.connects += 1;
                let fail = s.fail_connects > 0;
                if fail {
                    s.fail_connects -= 1;
                }
                let fault = if fail {
                    Fault::None
                } else {
                    s.faults.pop_front().unwrap_or(Fault::None)
                };
                (fault, fail, s.hang_connects)
            };
            if hang {
                std::future::pending::<()>().await;
            }
            if self.script.lock().refuse_connects {
                return Err(Error::Handshake {
                    peer: peer.to_string(),
                    reason: "refused: incompatible (injected)".into(),
                });
            }
            if fail {
                return Err(Error::ConnectionLost {
                    peer: peer.to_string(),
                    reason: "injected connect failure".into(),
                });
            }
            let descriptor = self.prefill.descriptor().expect("prefill layout set");
            Ok(PeerConn {
                descriptor: (*descriptor).clone(),
                control: Box::new(MemControl {
                    prefill: self.prefill.clone(),
                    closed: AtomicBool::new(false),
                    gone: tokio::sync::Notify::new(),
                    script: self.script.clone(),
                }),
                transport: Box::new(MemTransport {
                    prefill: self.prefill.clone(),
                    fault,
                    reads: AtomicU32::new(0),
                    broken: AtomicBool::new(false),
                }),
                generation,
            })
        })
    }

    fn send_aborts<'a>(
        &'a self,
        _state: &'a Arc<EngineState>,
        _peer: &'a str,
        aborts: Vec<Message>,
    ) -> NoticeFuture<'a> {
        Box::pin(async move {
            // Delivered as the control server takes a refused reader's aborts.
            let control = MemControl {
                prefill: self.prefill.clone(),
                closed: AtomicBool::new(false),
                gone: tokio::sync::Notify::new(),
                script: self.script.clone(),
            };
            for m in aborts {
                self.script.lock().aborts_sent += 1;
                control.notify(m);
            }
            Ok(())
        })
    }
}

/// A small shape: 2 layers of K and V, 4 KiB per block and tensor.
const SHAPE: ModelShape = ModelShape {
    name: "pair",
    layers: 2,
    tensors_per_layer: 2,
    bytes_per_token: 256,
    kv_heads: 0,
    tokens_per_block: 16,
    dtype: "bf16",
};
const BLOCKS: u32 = 16;
const PEER: &str = "prefill:1";

/// One engine's state with a host region of `BLOCKS` blocks, filled from `seed` when given.
fn engine(name: &str, seed: Option<u8>, read_pin: Duration) -> Arc<EngineState> {
    let config = EngineConfig {
        transport: TransportChoice::Tcp,
        gpu: false,
        request_timeout: Duration::from_secs(10),
        read_pin,
        ..EngineConfig::default()
    };
    let cooldown = config.rdma.cooldown;
    let id = Identity {
        config,
        engine_id: name.into(),
        generation: 7,
        data_addr: "127.0.0.1:9".parse().expect("address"),
        local: None,
    };
    let rdma = Rdma::new(Vec::new(), Some("not in the pair harness".into()), cooldown);
    let state = Arc::new(EngineState::new(id, rdma, Runtimes::probe(false)));
    let region =
        Region::allocate(state.next_region_id(), SHAPE.region_bytes(BLOCKS), false).unwrap();
    if let Some(seed) = seed {
        let bytes: Vec<u8> = (0..region.len()).map(|i| byte(seed, i)).collect();
        region.write_at(0, &bytes).unwrap();
    }
    let region = state.add_region(region).unwrap();
    state.set_layout(SHAPE.layout(region.id(), BLOCKS)).unwrap();
    state
}

fn byte(seed: u8, offset: u64) -> u8 {
    (offset.wrapping_mul(31) as u8) ^ seed
}

struct Pair {
    prefill: Arc<EngineState>,
    decode: Arc<Sessions>,
    script: Arc<Mutex<Script>>,
}

impl Pair {
    fn new(faults: &[Fault]) -> Pair {
        Pair::pinning(faults, crate::config::DEFAULT_READ_PIN)
    }

    /// A pair whose engines ask for and grant pins of `read_pin`. The decode times its pins
    /// on the runtime's clock, which these tests pause, and the prefill's tracker on the
    /// system's: a test whose reads take virtual seconds gives pins longer than those.
    fn pinning(faults: &[Fault], read_pin: Duration) -> Pair {
        let prefill = engine("prefill", Some(0x5A), read_pin);
        let decode = engine("decode", None, read_pin);
        let script = Arc::new(Mutex::new(Script {
            faults: faults.iter().copied().collect(),
            ..Script::default()
        }));
        let connector = MemConnector {
            prefill: prefill.clone(),
            script: script.clone(),
        };
        Pair {
            prefill,
            decode: Arc::new(Sessions::with_connector(decode, Box::new(connector))),
            script,
        }
    }

    /// Holds `id` on the prefill side and runs the decode's read of `remote` into `local` to its
    /// end, as `Engine::read_blocks` does.
    async fn read(&self, id: &str, local: &[BlockId], remote: &[BlockId]) {
        let now = std::time::Instant::now();
        let abort = Duration::from_secs(60);
        let token = self
            .prefill
            .hold(id.into(), &[remote], None, abort, None)
            .unwrap();
        let state = &self.decode.state;
        state
            .completions()
            .update(|t| t.start_recv(id.into(), now))
            .unwrap();
        let job = ReadJob {
            sources: vec![super::Source {
                peer: PEER.into(),
                rank: None,
            }],
            id: RequestId::from(id),
            remote_id: RequestId::from(id),
            local: vec![local.to_vec()],
            remote: vec![remote.to_vec()],
            remote_tokens: SHAPE.tokens_per_block,
            first_tokens: Vec::new(),
            hold: Some(token),
            confirm_with_data: true,
            tensors: None,
            started: now,
            deadline: tokio::time::Instant::now() + state.config().request_timeout,
        };
        run_read(self.decode.clone(), job).await;
    }

    fn decode_finished(&self) -> Finished {
        self.decode
            .state
            .completions()
            .update(|t| t.take_finished())
    }

    fn prefill_finished(&self) -> Finished {
        self.prefill.completions().update(|t| t.take_finished())
    }

    fn connects(&self) -> u32 {
        self.script.lock().connects
    }

    /// Whether local blocks hold the prefill's remote blocks, in every tensor.
    fn holds(&self, local: &[BlockId], remote: &[BlockId]) -> bool {
        let layout = self.decode.state.layout().unwrap();
        let region = self.decode.state.region(layout.tensors[0].region).unwrap();
        layout.tensors.iter().all(|t| {
            local.iter().zip(remote).all(|(&l, &r)| {
                let mut got = vec![0u8; t.block_bytes as usize];
                region.read_at(t.block_offset(l), &mut got).unwrap();
                let at = t.block_offset(r);
                got.iter()
                    .enumerate()
                    .all(|(i, &b)| b == byte(0x5A, at + i as u64))
            })
        })
    }
}

mod tests;
