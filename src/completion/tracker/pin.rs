//! Pins: a reader's early confirmation of a one-sided (RDMA) read.
//!
//! A reader sends `Pin` as it posts its reads. The hold is checked as a `Done` is (live, this
//! reader's, sealed, the token named) and, when it passes, nothing ends it for `pin` from
//! then on but this reader's own `Done` or `Abort`: not the holder's [`release`], not its
//! abort timeout, not the reader's lease. A hold only moves from live to ended, and its token
//! changes when its id is held again, so a hold found live when the `Pin` arrived was live
//! from its grant on, and the pin keeps it so until the pin lapses: a read that completed
//! within `pin` of the moment the reader sent its `Pin` (by the reader's own clock, which
//! started first) read blocks held for it the whole time, and counts as confirmed without the
//! `Done` round trip after it. A read that took longer confirms with its `Done` as before.
//!
//! The holder's [`release`] of a pinned hold ends its grants at once but returns
//! [`Release::Pinned`]: the blocks may be reused only once the pin lapses or the reader's
//! `Done` or `Abort` ends it, which the engine waits for. A reader pins a hold once, so a
//! release waits one pin at most.
//!
//! [`release`]: CompletionTracker::release

use super::*;

/// What the holder's release of a hold came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The id was not held.
    NotHeld,
    /// The hold ended: its blocks may be reused.
    Released,
    /// A reader's pin keeps the hold until this moment (or until that reader's `Done` or
    /// `Abort`, sooner): its blocks may not be reused before; ask again then.
    Pinned(Instant),
}

impl CompletionTracker {
    /// Reader `reader` pins the hold of request `id` (`hold`: the token it names) for `pin`
    /// from `now` (see the module docs). Refused when a `Done` would be, when the hold was
    /// released, when it waits for several readers (each would hold the others' blocks), or
    /// when this reader pinned it before. Returns when the hold began.
    pub fn pin(
        &mut self,
        id: &RequestId,
        reader: &Reader,
        hold: Option<u64>,
        now: Instant,
        pin: Duration,
    ) -> std::result::Result<Instant, Refusal> {
        let own = self.tp;
        let h = Self::held(&mut self.held, id, hold)?;
        let refuse = |why: String| Err(Refusal::new(RefusalKind::NotHeld, why));
        if h.released {
            return refuse(format!("request {id} was released by the prefill"));
        }
        // Admitted as a `Reading` admits it, pinned or not.
        let slot = h.admit(own, id, reader, true)?.expect("admitted");
        if h.lease_end.is_none() {
            h.lease_end = h.gone_readers_lease(&self.presence);
            if h.lease_end.is_some() {
                self.deadlines += 1;
            }
        }
        if !h.sealed {
            return refuse(format!("request {id} is still being held part by part"));
        }
        let readers = h.expected(own);
        if readers != 1 {
            return refuse(format!(
                "request {id} waits for {readers} readers: it is confirmed by each reader's Done"
            ));
        }
        let r = &mut h.readers[slot];
        if r.done || r.pinned_until.is_some() {
            return refuse(format!(
                "request {id} was pinned or confirmed by this reader before"
            ));
        }
        r.pinned_until = Some(now + pin);
        Ok(h.deadline - h.timeout)
    }

    /// Drops the hold of send `id` at the holder's own request (its request was aborted or
    /// preempted): its grants end at once and nothing is reported for it. While a reader's
    /// pin keeps it, it stays (refusing new pins and `Done`s) until the pin ends: ask again at
    /// the moment [`Release::Pinned`] names, or when the tracker changes.
    pub fn release(&mut self, id: &RequestId, now: Instant) -> Release {
        let Some(h) = self.held.get_mut(id) else {
            return Release::NotHeld;
        };
        if !h.released {
            h.released = true;
            h.end_grants();
            h.tell_ended(id, "the prefill released the request");
        }
        match h.pin_end().filter(|&p| p > now) {
            Some(until) => Release::Pinned(until),
            None => {
                self.held.remove(id);
                Release::Released
            }
        }
    }

    /// A reader's notice about a hold its holder released while pinned: the reader's pin (if
    /// any) ends, so the release waiting for it goes on; the notice itself is refused.
    pub(super) fn notice_on_released(&mut self, id: &RequestId, reader: &Reader) -> Refusal {
        if let Some(h) = self.held.get_mut(id) {
            let own = self.tp;
            if let Ok(Some(slot)) = h.admit(own, id, reader, false) {
                h.readers[slot].pinned_until = None;
            }
            // A release waiting for the pin looks again.
            self.deadlines += 1;
        }
        Refusal::new(
            RefusalKind::NotHeld,
            format!("request {id} was released by the prefill"),
        )
    }
}
