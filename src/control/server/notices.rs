//! A reader's notices that the server answers or acts on: `Done`, `Received` and `Pin`.

use std::time::Duration;

use super::{send, Serving};
use crate::completion::SendNotice;
use crate::control::messages::Message;
use crate::error::{Refusal, Result};
use crate::ids::RequestId;

impl Serving<'_> {
    /// A done notice with a valid id: answered either way, so that the reader reports the
    /// request received only once this engine confirms it still held the blocks for it.
    pub(super) async fn on_done(&mut self, request_id: RequestId, hold: Option<u64>) -> Result<()> {
        let r = self.done(&request_id, hold);
        self.answer(request_id, r, "confirming a done notice").await
    }

    /// A `Received` with a valid id: a `Done` that wants no answer.
    pub(super) fn on_received(&mut self, request_id: RequestId, hold: Option<u64>) {
        let r = self.done(&request_id, hold);
        self.refused(&request_id, r.map(drop));
    }

    /// What the engine says of this reader's `Done` (or `Received`) of `request_id`.
    fn done(
        &self,
        request_id: &RequestId,
        hold: Option<u64>,
    ) -> std::result::Result<Duration, Refusal> {
        let done = SendNotice::Done;
        self.handler
            .notice(self.peer, &self.reader, request_id.clone(), done, hold)
    }

    /// A pin with a valid id (a reader posting an RDMA read): answered either way, as a
    /// `Done` is; the reader counts its read confirmed only on a `Confirm` that refuses
    /// nothing.
    pub(super) async fn on_pin(
        &mut self,
        request_id: RequestId,
        hold: Option<u64>,
        pin_us: u64,
    ) -> Result<()> {
        let pin = Duration::from_micros(pin_us);
        tracing::debug!(peer = %self.peer, id = %request_id, ?hold, ?pin, "reader pins a hold");
        let r = self.handler.pin(&self.reader, &request_id, hold, pin);
        self.answer(request_id, r, "answering a pin").await
    }

    /// Answers a `Done` or a `Pin` of `request_id` with what the engine said (`r`).
    async fn answer(
        &mut self,
        request_id: RequestId,
        r: std::result::Result<Duration, Refusal>,
        what: &str,
    ) -> Result<()> {
        let answer = Message::Confirm {
            request_id: request_id.clone(),
            refused: r.clone().err().map(Refusal::into_reason),
            held_us: r.as_ref().map_or(0, |d| d.as_micros() as u64),
        };
        self.refused(&request_id, r.map(drop));
        let within = self.timeouts.handshake;
        send(&mut self.stream, &answer, what, within).await
    }
}
