//! A read of one batch waiting on its own thread ([`RecvSide::wait_here`]) receives its
//! response itself when the socket already holds it: all of it read ahead, or its header read
//! ahead and the rest of its data waiting in the socket (`FIONREAD`), landed then straight
//! into place with `readv`. No thread is woken to receive it, and none to tell the read. It
//! asks the kernel (`recv` with `MSG_DONTWAIT`), not the runtime, whose event thread learns of
//! the bytes only after a wake-up of its own.
//!
//! The stream's receiving side is taken by whoever receives: the reader task, or a waiting
//! read, which only tries its lock. What a waiting read cannot finish without waiting it
//! leaves to the reader task: a response whose data is not all there yet, device memory, a
//! refusal, malformed bytes; or, its data landed, the confirmation still on its way
//! ([`Resume`]).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::mpsc;

use super::super::ahead::{Fill, ReadAhead};
use super::super::wire;
use super::pending::Pending;
use super::receive::{buffered_head, confirmation, copy_into, Rx};
use super::Batch;
use crate::error::Result;
use crate::memory::{self, RegionSpan};
use crate::transport::{Confirmed, RequestCtl};

/// A stream's receiving side, shared by its reader task and the reads waiting on their own
/// threads.
pub(super) struct RecvSide {
    pub(super) rd: OwnedReadHalf,
    /// Whoever holds it receives (the reader task waits for it; a waiting read only tries).
    pub(super) state: tokio::sync::Mutex<RecvState>,
    /// Tells the reader task to look again: a waiting read left it bytes read ahead or a
    /// response to finish, or found the stream closed or failed (which the reader reports).
    pub(super) kick: tokio::sync::Notify,
    /// The batches whose responses are due, oldest first.
    pub(super) pending: Arc<Pending>,
}

/// What is read ahead of the stream's responses, the last response's tag, and a response a
/// waiting read began.
pub(super) struct RecvState {
    pub(super) ahead: ReadAhead,
    pub(super) tag: u64,
    pub(super) resume: Option<Resume>,
}

impl RecvState {
    /// The last response's tag, and the socket with what is read ahead of it.
    pub(super) fn rx<'a>(
        &'a mut self,
        rd: &'a OwnedReadHalf,
        peer: SocketAddr,
        io_timeout: Duration,
    ) -> (u64, Rx<'a>) {
        let rx = Rx {
            rd,
            ahead: &mut self.ahead,
            peer,
            io_timeout,
        };
        (self.tag, rx)
    }
}

/// A response a waiting read began and left to the reader task (under the last tag): its
/// batch, and how many bytes of its data landed (all of them when its confirmation is due).
pub(super) struct Resume {
    pub(super) batch: Batch,
    pub(super) got: u64,
}

/// How much of a response a waiting read found: the length of its data, and how much of it
/// was read ahead (the rest is waiting in the socket).
struct Found {
    len: u64,
    ahead: usize,
}

impl RecvSide {
    /// Waits on this thread, for up to `spin`, for the end of a read's one batch, receiving
    /// it here when the socket holds it. Bounded, and only while that batch is in flight;
    /// yields the CPU between looks. `None`: not ended yet (the read then waits for the
    /// reader task as any does).
    pub(super) fn wait_here(
        &self,
        spin: Duration,
        done: &mut mpsc::Receiver<Result<Option<Confirmed>>>,
        ctl: &RequestCtl,
    ) -> Option<Result<Option<Confirmed>>> {
        if spin.is_zero() {
            return None;
        }
        let until = Instant::now() + spin;
        loop {
            self.receive_here();
            if let Ok(r) = done.try_recv() {
                return Some(r);
            }
            if ctl.is_cancelled() || Instant::now() >= until {
                return None;
            }
            std::thread::yield_now();
        }
    }

    /// One look at the socket from a waiting read's thread, without waiting: lands the
    /// responses the socket holds at the front of the stream (oldest batch first), and leaves
    /// anything else to the reader task.
    fn receive_here(&self) {
        let Ok(mut state) = self.state.try_lock() else {
            return;
        };
        if state.resume.is_some() {
            return;
        }
        if state.ahead.is_empty() {
            match state.ahead.try_fill(self.rd.as_ref(), false) {
                Ok(Fill::Bytes) => {}
                Ok(Fill::Nothing) => return,
                Ok(Fill::Closed) | Err(_) => {
                    drop(state);
                    self.kick.notify_one();
                    return;
                }
            }
        }
        while !state.ahead.is_empty() && state.resume.is_none() {
            let tag = state.tag + 1;
            let Some(found) = find(&state.ahead, tag, &self.rd) else {
                break;
            };
            let Some((batch, ())) = self.pending.pop_with(|b| found.fits(b).then_some(())) else {
                break;
            };
            state.tag = tag;
            if let Some((batch, outcome)) = land_here(&mut state, &self.rd, batch, found) {
                self.pending.done();
                batch.finish(outcome);
            }
        }
        let left = !state.ahead.is_empty() || state.resume.is_some();
        drop(state);
        if left {
            self.kick.notify_one();
        }
    }
}

/// The data response of tag `tag` at the front of the stream, when a waiting read can land it
/// without waiting: its header is read ahead, and the rest of its data is read ahead or
/// waiting in the socket.
fn find(ahead: &ReadAhead, tag: u64, rd: &OwnedReadHalf) -> Option<Found> {
    let buf = ahead.buffered();
    let (status, len) = buffered_head(buf, tag)?;
    if status != wire::STATUS_OK {
        return None;
    }
    let read_ahead = (buf.len() - wire::RESPONSE_HEADER).min(len);
    let rest = len - read_ahead;
    if rest > 0 && memory::bytes_waiting(rd.as_ref().as_raw_fd()).ok()? < rest {
        return None;
    }
    Some(Found {
        len: len as u64,
        ahead: read_ahead,
    })
}

impl Found {
    /// Whether it is `batch`'s response to land here: data of the batch's length, into host
    /// memory. Checked under the queue's lock, so it does no system call.
    fn fits(&self, batch: &Batch) -> bool {
        self.len == batch.bytes && !batch.ops.iter().any(|o| o.local.is_device())
    }
}

/// Lands a response [`find`] found: its data, then its confirmation when the batch asked for
/// one and it is there. Returns the batch with its outcome, or `None` when it left the rest to
/// the reader task ([`Resume`]; the socket unexpectedly short of the data, the confirmation
/// not all there, or the copy failing, which the reader task then reports).
fn land_here(
    state: &mut RecvState,
    rd: &OwnedReadHalf,
    batch: Batch,
    found: Found,
) -> Option<(Batch, Result<Option<Confirmed>>)> {
    let fd = rd.as_ref().as_raw_fd();
    let spans: Vec<RegionSpan> = batch.ops.iter().map(|o| o.local.clone()).collect();
    let ctl = &batch.ctl;
    state.ahead.consume(wire::RESPONSE_HEADER);
    let bytes = &state.ahead.buffered()[..found.ahead];
    if ctl
        .guarded(|| copy_into(&spans, 0, bytes), || Ok(()))
        .is_err()
    {
        state.resume = Some(Resume { batch, got: 0 });
        return None;
    }
    state.ahead.consume(found.ahead);
    let mut got = found.ahead as u64;
    while got < found.len {
        // The rest is in the socket (FIONREAD said so), and nothing is read ahead.
        let n = ctl.guarded(
            || memory::readv(fd, &spans, got),
            || {
                let spare = state.ahead.spare();
                let want = ((found.len - got) as usize).min(spare.len());
                memory::recv_now(fd, &mut spare[..want])
            },
        );
        match n {
            Ok(n) if n > 0 => got += n as u64,
            _ => {
                state.resume = Some(Resume { batch, got });
                return None;
            }
        }
    }
    if !batch.extras.confirm {
        return Some((batch, Ok(None)));
    }
    match confirmation_here(state, rd) {
        Some(c) => Some((batch, Ok(Some(c)))),
        None => {
            state.resume = Some(Resume { batch, got });
            None
        }
    }
}

/// The confirmation after a response's data (tag `state.tag`), when all of it is read ahead
/// or waiting in the socket; consumed then.
fn confirmation_here(state: &mut RecvState, rd: &OwnedReadHalf) -> Option<Confirmed> {
    if state.ahead.is_empty()
        && !matches!(state.ahead.try_fill(rd.as_ref(), false), Ok(Fill::Bytes))
    {
        return None;
    }
    let buf = state.ahead.buffered();
    let (status, len) = buffered_head(buf, state.tag)?;
    let end = wire::RESPONSE_HEADER.checked_add(len)?;
    let c = confirmation(status, buf.get(wire::RESPONSE_HEADER..end)?)?;
    state.ahead.consume(end);
    Some(c)
}
