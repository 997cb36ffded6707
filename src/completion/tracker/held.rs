//! One held request on the send side ([`Held`]): its deadline and lease, the readers it
//! admitted, their grants and confirmations.

use super::*;

#[derive(Debug)]
pub(super) struct Held {
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    /// When the lease of a gone reader ends (the earliest, with several readers gone).
    pub(super) lease_end: Option<Instant>,
    pub(super) grant: Arc<Grant>,
    /// The hold's token: readers that name it are matched to this hold only, not to an
    /// earlier or later hold of the same request id.
    pub(super) token: u64,
    /// The only engine allowed to read and confirm, when the holder named one.
    pub(super) named: Option<String>,
    /// The readers admitted so far (engines that read or confirmed the request), one per
    /// decode rank, and whether each confirmed.
    pub(super) readers: Vec<Admitted>,
    /// The decode's TP size, fixed by the first reader admitted; it sets how many readers
    /// the request waits for (`tp::readers`).
    pub(super) reader_size: Option<u32>,
    /// Whether the hold is complete: a hold that grows (`open_hold` unsealed) confirms no read
    /// before it is sealed.
    pub(super) sealed: bool,
    /// The hold's block ids per block group in the order the holder gave them (the grant's are
    /// sorted): the positions followers pair with their own blocks.
    pub(super) order: Vec<Vec<BlockId>>,
    /// The grants of the hold before its last extension: they end with it.
    pub(super) earlier: Vec<Arc<Grant>>,
    /// The readers told of the hold's parts as they come (progressive reads).
    pub(super) followers: Vec<Arc<dyn Follower>>,
    /// The last part, while only some of its tensors are final.
    pub(super) tail: Option<growing::Tail>,
    /// The holder released the hold while a reader's pin kept it (`pin.rs`): it ends, with
    /// nothing reported, once no pin does.
    pub(super) released: bool,
}

#[derive(Debug)]
pub(super) struct Admitted {
    pub(super) engine: String,
    pub(super) rank: u32,
    pub(super) done: bool,
    /// Until when this reader's pin keeps the hold (`pin.rs`): nothing ends it before then
    /// but this reader's own `Done` or `Abort`.
    pub(super) pinned_until: Option<Instant>,
}

impl Held {
    /// How many readers must confirm before the send is done: one until the first reader
    /// says how large the decode is; then every decode rank that reads this rank.
    pub(super) fn expected(&self, own: TpRank) -> u32 {
        match (&self.named, self.reader_size) {
            (None, Some(size)) => tp::readers(own, size).unwrap_or(1),
            _ => 1,
        }
    }

    /// Whether engine `e` is this hold's reader (named, or admitted).
    pub(super) fn involves(&self, e: &str) -> bool {
        self.named.as_deref() == Some(e) || self.readers.iter().any(|r| r.engine == e)
    }

    /// When the hold ends unless confirmed: its abort timeout, or sooner its lease; never
    /// before a reader's pin lapses (and then, when the holder released it).
    pub(super) fn ends(&self) -> Instant {
        let end = self
            .lease_end
            .map_or(self.deadline, |l| l.min(self.deadline));
        match self.pin_end() {
            // Released: it ends as its pin does.
            Some(p) if self.released => p,
            Some(p) => p.max(end),
            None => end,
        }
    }

    /// When the last pin of a reader that has not confirmed lapses (it may be past).
    pub(super) fn pin_end(&self) -> Option<Instant> {
        self.readers
            .iter()
            .filter(|r| !r.done)
            .filter_map(|r| r.pinned_until)
            .max()
    }

    /// The lease end of the earliest gone reader among this hold's, if any is gone.
    pub(super) fn gone_readers_lease(&self, presence: &Presence) -> Option<Instant> {
        let named = self.named.iter();
        let admitted = self.readers.iter().map(|r| &r.engine);
        named
            .chain(admitted)
            .filter_map(|e| presence.lease_end(e))
            .min()
    }

    /// Ends the hold's grants (its current one and those before its extensions): nothing more
    /// is served from any of them.
    pub(super) fn end_grants(&self) {
        self.end_earlier();
        self.grant.end();
    }

    /// Ends the grants the hold had before its last extension.
    pub(super) fn end_earlier(&self) {
        self.earlier.iter().for_each(|g| g.end());
    }

    /// Tells the hold's followers that it ended before they confirmed, and why.
    pub(super) fn tell_ended(&self, id: &RequestId, reason: &str) {
        for f in &self.followers {
            let reason = reason.to_string();
            f.announce(id, Announcement::Ended { reason });
        }
    }

    pub(super) fn confirmed(&self) -> u32 {
        self.readers.iter().filter(|r| r.done).count() as u32
    }

    /// The slot of `reader` among the request's readers, admitting it when it may read: the
    /// named engine only, or else one engine per decode rank that reads this rank (`own`),
    /// all of one decode TP group. With `admit` false it only checks.
    pub(super) fn admit(
        &mut self,
        own: TpRank,
        id: &RequestId,
        reader: &Reader,
        admit: bool,
    ) -> std::result::Result<Option<usize>, Refusal> {
        let who = &reader.engine;
        // The same engine at the same rank (a named reader at any rank) is the same reader.
        if let Some(i) = self
            .readers
            .iter()
            .position(|r| &r.engine == who && (self.named.is_some() || r.rank == reader.tp.rank))
        {
            return Ok(Some(i));
        }
        if let Some(n) = &self.named {
            if n != who {
                return Err(Refusal::new(
                    RefusalKind::OtherReader,
                    format!("request {id} is held for another reader engine, not {who:?}"),
                ));
            }
        } else {
            if self.reader_size.is_some_and(|s| s != reader.tp.size) {
                return Err(Refusal::new(
                    RefusalKind::WrongTp,
                    format!(
                        "request {id} is held for a decode of TP {}; engine {who:?} is {}",
                        self.reader_size.unwrap_or(0),
                        reader.tp
                    ),
                ));
            }
            if !tp::reads(reader.tp, own) {
                return Err(Refusal::new(
                    RefusalKind::WrongTp,
                    format!(
                        "request {id}: engine {who:?} ({} of a decode) does not read this prefill \
                     {own} (a decode rank reads the prefill ranks tp::sources names)",
                        reader.tp
                    ),
                ));
            }
            if self.readers.iter().any(|r| r.rank == reader.tp.rank) {
                return Err(Refusal::new(
                    RefusalKind::OtherReader,
                    format!(
                    "request {id} is held for another reader engine at decode rank {}, not {who:?}",
                    reader.tp.rank
                    ),
                ));
            }
        }
        if !admit {
            return Ok(None);
        }
        self.reader_size = Some(reader.tp.size);
        self.readers.push(Admitted {
            engine: who.clone(),
            rank: reader.tp.rank,
            done: false,
            pinned_until: None,
        });
        Ok(Some(self.readers.len() - 1))
    }
}
