//! The worker's loop: takes commands, polls the engine, checks every read's bytes, overwrites
//! a hold's blocks once it ends, and reports it all as events.

use std::collections::HashMap;
use std::io::Write;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::{Engine, Finished, HoldRequest, KvLayout, ReadFrom, ReadRequest, Region, Side};

use crate::memory;
use crate::proto::{line, Command, Event, Groups, Stats};

/// How long one poll of the engine waits.
const POLL: Duration = Duration::from_millis(20);
/// How often the stats go out.
const STATS_EVERY: Duration = Duration::from_secs(1);

/// A read in flight: what it should find.
struct Pending {
    local: Groups,
    remote: Groups,
    seed: u64,
}

/// One engine and its cache.
pub struct Worker {
    engine: Engine,
    region: Arc<Region>,
    layout: KvLayout,
    /// Prefill: the blocks and seed of each hold, overwritten when it ends.
    holds: HashMap<String, (Groups, u64)>,
    /// Decode: each read in flight.
    reads: HashMap<String, Pending>,
}

/// What the loop does after a command.
enum Next {
    Go,
    Stall(Duration),
    Exit,
}

impl Worker {
    /// A worker of `engine`, its cache `region` laid out as `layout`.
    pub fn new(engine: Engine, region: Arc<Region>, layout: KvLayout) -> Worker {
        Worker {
            engine,
            region,
            layout,
            holds: HashMap::new(),
            reads: HashMap::new(),
        }
    }

    /// Runs until `exit`, or until stdin closes (the orchestrator is gone).
    pub fn run(mut self, commands: Receiver<Result<Command, String>>) {
        let mut stats_at = Instant::now();
        loop {
            let next = loop {
                match commands.try_recv() {
                    Ok(Ok(c)) => match self.apply(c) {
                        Next::Go => continue,
                        other => break other,
                    },
                    Ok(Err(why)) => emit(&refused("parse", None, why)),
                    Err(TryRecvError::Empty) => break Next::Go,
                    Err(TryRecvError::Disconnected) => break Next::Exit,
                }
            };
            match next {
                Next::Exit => break,
                Next::Stall(d) => std::thread::sleep(d),
                Next::Go => {}
            }
            let f = self.engine.wait_finished(POLL);
            self.finished(f);
            if stats_at.elapsed() >= STATS_EVERY {
                stats_at = Instant::now();
                emit(&Event::Stats(self.stats()));
            }
        }
        self.engine.close();
    }

    /// Carries out one command.
    fn apply(&mut self, c: Command) -> Next {
        match c {
            Command::Hold {
                id,
                blocks,
                seed,
                abort_ms,
                reader,
            } => self.hold(
                id,
                blocks,
                seed,
                abort_ms.map(Duration::from_millis),
                reader,
            ),
            Command::Read {
                id,
                peer,
                local,
                remote,
                seed,
                hold,
            } => self.read(
                id,
                peer,
                Pending {
                    local,
                    remote,
                    seed,
                },
                hold,
            ),
            Command::Cancel { id } => {
                let found = self.engine.cancel(id.as_str());
                emit(&Event::Cancelled { id, found });
            }
            Command::Release { id } => {
                if self.engine.release(id.as_str()) {
                    self.overwrite(&id);
                }
            }
            Command::Connect { peer, timeout_ms } => {
                let t = Instant::now();
                let r = self
                    .engine
                    .connect(&peer, Duration::from_millis(timeout_ms));
                emit(&Event::Connected {
                    peer,
                    ms: t.elapsed().as_secs_f64() * 1e3,
                    error: r.err().map(|e| e.to_string()),
                });
            }
            Command::Stall { ms } => return Next::Stall(Duration::from_millis(ms)),
            Command::Exit => return Next::Exit,
        }
        Next::Go
    }

    fn hold(
        &mut self,
        id: String,
        blocks: Groups,
        seed: u64,
        abort_timeout: Option<Duration>,
        reader: Option<String>,
    ) {
        let held = memory::write(&self.region, &self.layout, &blocks, seed).and_then(|()| {
            self.engine.hold(HoldRequest {
                id: id.as_str().into(),
                blocks: blocks.clone(),
                reader,
                abort_timeout,
                token: None,
            })
        });
        match held {
            Ok(token) => {
                self.holds.insert(id.clone(), (blocks, seed));
                emit(&Event::Held { id, token });
            }
            Err(e) => emit(&refused("hold", Some(id), e.to_string())),
        }
    }

    fn read(&mut self, id: String, peer: String, p: Pending, hold: u64) {
        // Stale bytes must never pass the check: the local blocks first hold another pattern.
        let poisoned = memory::write(&self.region, &self.layout, &p.local, !p.seed);
        let started = poisoned.and_then(|()| {
            self.engine.read(ReadRequest {
                id: id.as_str().into(),
                remote_id: id.as_str().into(),
                from: ReadFrom::Engine(peer),
                local: p.local.clone(),
                remote: p.remote.clone(),
                remote_tokens_per_block: None,
                first_tokens: Vec::new(),
                hold: Some(hold),
            })
        });
        match started {
            Ok(()) => {
                self.reads.insert(id, p);
            }
            Err(e) => emit(&refused("read", Some(id), e.to_string())),
        }
    }

    /// Reports what finished: reads checked byte for byte, holds ended (and their blocks
    /// overwritten, as a scheduler reusing them would).
    fn finished(&mut self, f: Finished) {
        for id in f.sending {
            let id = id.as_str().to_string();
            self.overwrite(&id);
            emit(&Event::Sent { id });
        }
        for id in f.receiving {
            let id = id.as_str().to_string();
            let report = f.reports.iter().find(|r| r.id.as_str() == id);
            self.received(id, report);
        }
        for fr in f.failed {
            let id = fr.id.as_str().to_string();
            let (cause, expired, reason) = (fr.cause.name().to_string(), fr.expired, fr.reason);
            match fr.side {
                Side::Send => {
                    self.overwrite(&id);
                    emit(&Event::HoldEnd {
                        id,
                        cause,
                        expired,
                        reason,
                    });
                }
                Side::Recv => {
                    self.reads.remove(&id);
                    emit(&Event::ReadFailed {
                        id,
                        cause,
                        expired,
                        reason,
                    });
                }
            }
        }
    }

    fn received(&mut self, id: String, report: Option<&kvlink::TransferReport>) {
        let Some(p) = self.reads.remove(&id) else {
            return emit(&refused("received", Some(id), "a read never issued".into()));
        };
        let bytes = report.map_or(0, |r| r.bytes);
        match memory::check(&self.region, &self.layout, &p.local, &p.remote, p.seed) {
            Ok(verified) => emit(&Event::Received {
                id,
                bytes,
                verified,
                transport: report.map_or("?", |r| r.transport).to_string(),
                ms: report.map_or(0.0, |r| r.elapsed.as_secs_f64() * 1e3),
            }),
            Err(e) => emit(&Event::Corrupt {
                id,
                error: e.to_string(),
            }),
        }
    }

    /// Writes a new pattern over a finished hold's blocks: the bytes a late reader would get.
    fn overwrite(&mut self, id: &str) {
        if let Some((blocks, seed)) = self.holds.remove(id) {
            let reused = seed.rotate_left(17) ^ 0x5eed;
            if let Err(e) = memory::write(&self.region, &self.layout, &blocks, reused) {
                emit(&refused("overwrite", Some(id.to_string()), e.to_string()));
            }
        }
    }

    fn stats(&self) -> Stats {
        let s = self.engine.stats();
        let (receiving, holding) = self.engine.in_flight();
        Stats {
            handshakes_accepted: s.handshakes_accepted,
            handshakes_refused: s.handshakes_refused,
            data_requests_refused: s.data_requests_refused,
            notices_refused: s.notices_refused,
            control_connections: s.control_connections,
            data_connections: s.data_connections,
            rdma_pairs_paused: s.rdma_pairs_paused,
            bytes_read: s.totals.bytes_read,
            bytes_served: s.bytes_served,
            receiving: receiving as u64,
            holding: holding as u64,
            sessions: s.sessions,
            sessions_opened: s.sessions_opened,
            sessions_closed_idle: s.sessions_closed_idle,
            queue_pairs: s.queue_pairs,
        }
    }
}

fn refused(op: &str, id: Option<String>, error: String) -> Event {
    Event::Refused {
        op: op.to_string(),
        id,
        error,
    }
}

/// Writes one event line to stdout, flushed: the orchestrator reads events as they happen.
pub fn emit(ev: &Event) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", line(ev));
    let _ = out.flush();
}
