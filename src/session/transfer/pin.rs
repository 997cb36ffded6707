//! The reader's side of pins (`completion::tracker::pin`): an RDMA read asks the prefill, as
//! it is posted, to pin its hold, and counts as confirmed once the prefill said the hold was
//! live and the read completed within the pin. A `Received`, which the prefill does not
//! answer, then tells it the send is over. The `Done` / `Confirm` round trip after the read
//! runs beside the read instead.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::ReadJob;
use crate::config::MAX_PIN_READ_BYTES;
use crate::control::messages::Message;
use crate::control::{Confirmation, Sent};
use crate::session::PeerConn;
use crate::tp::TpRank;
use crate::transport::Confirmed;

/// A pin asked for: when it was sent, for how long, and where its answer arrives.
pub(super) struct PinAsk {
    sent: Instant,
    pin: Duration,
    answer: oneshot::Receiver<Confirmation>,
}

/// Tells the prefill of a read of `bytes` about to be posted, when its transport does not (an
/// RDMA read reaches no CPU there): the prefill then knows who reads, so its hold ends on this
/// engine's lease should this engine go away. A read of at most [`MAX_PIN_READ_BYTES`] asks
/// for a pin of `pin` (zero: never), which admits the reader as well; a larger one sends
/// `Reading`, as does a read of a prefill rank that several decode ranks read (this engine's
/// TP size the larger: each of them confirms, and the prefill pins no such hold). TCP and same-host data requests name this engine's session, which tells the
/// prefill as much.
pub(super) async fn announce(
    conn: &PeerConn,
    job: &ReadJob,
    ours: TpRank,
    bytes: u64,
    pin: Duration,
) -> Option<PinAsk> {
    if conn.transport.names_reader() {
        return None;
    }
    let shared = conn.descriptor.tp_size < ours.size;
    let ask = if pin.is_zero() || shared || bytes == 0 || bytes > MAX_PIN_READ_BYTES {
        None
    } else {
        // Taken before the Pin leaves: the prefill's pin starts later than this.
        let sent = Instant::now();
        let answer = conn.control.pin(job.remote_id.clone(), job.hold, pin);
        answer.map(|(answer, how)| (PinAsk { sent, pin, answer }, how))
    };
    let how = match &ask {
        Some((_, how)) => *how,
        None => {
            let reading = Message::Reading {
                request_id: job.remote_id.clone(),
                hold: job.hold,
            };
            conn.control.send(reading)
        }
    };
    // Queued, the writer task that sends it was woken on this worker thread, where it would
    // wait until this task next yields; posting RDMA reads may not yield for a long time
    // (SoftRoCE posts in the caller's thread), so let it go out first.
    if how == Sent::Queued {
        tokio::task::yield_now().await;
    }
    ask.map(|(ask, _)| ask)
}

/// The confirmation a pin gives a read whose bytes are all in place now (call it as soon as
/// they are): the prefill's answer said held, and now is within the pin of the moment the
/// `Pin` was sent (less 1%, for the two hosts' clocks; the runtime's clock, which tests may
/// pause). The prefill kept the hold live from its grant to the end of
/// the pin, and its pin began after this engine's clock started, so every byte was read while
/// held. The answer is waited for up to `wait`. `None`: the read's `Done` must confirm it (the
/// pin was refused, its answer did not come, or the read outlasted it).
pub(super) async fn pinned(ask: PinAsk, wait: Duration) -> Option<Confirmed> {
    let within = ask.pin - ask.pin / 100;
    if ask.sent.elapsed() > within {
        return None;
    }
    match tokio::time::timeout(wait, ask.answer).await {
        Ok(Ok(Ok(held))) => Some(Ok(held)),
        _ => None,
    }
}
