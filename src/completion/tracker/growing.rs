//! Holds that grow, and their followers (progressive reads): a hold opened before all its
//! blocks are final is extended part by part and then sealed; the readers that follow it are
//! told of each part as it is held, and of its end. A reader may follow a request before it is
//! held: it waits, bounded in number and in time, for the hold.

use super::*;

/// Most followers of requests not held yet, over all requests: more are refused (each costs
/// a little memory until its deadline).
pub(crate) const MAX_PENDING_FOLLOWS: usize = 4096;
/// Most followers of one hold (one per decode rank that reads it, and their retries).
const MAX_FOLLOWERS: usize = 64;
/// Most parts one hold grows by.
pub(crate) const MAX_PARTS: usize = 4096;

/// How a hold is made, beside its blocks ([`CompletionTracker::open_hold`]).
#[derive(Debug, Clone)]
pub struct HoldTerms {
    /// The only engine allowed to read and confirm, when the holder named one.
    pub reader: Option<String>,
    /// How long the readers have to confirm.
    pub abort_timeout: Duration,
    /// The hold's token (readers that name it are matched to this hold only).
    pub token: u64,
    /// Whether the hold is complete; `false`: it grows ([`CompletionTracker::extend_hold`])
    /// until [`CompletionTracker::seal_hold`], and confirms no read before.
    pub sealed: bool,
}

/// The last part of a hold while only its first tensors are final (a part of one step's
/// blocks, made final layer by layer).
#[derive(Debug)]
pub(super) struct Tail {
    /// Per block group, where its blocks start among the hold's.
    first: Vec<u32>,
    /// Per block group, its blocks.
    blocks: Vec<Vec<BlockId>>,
    /// Its tensors `[0, done)` are final.
    done: u32,
}

/// A reader that follows a request not held yet.
#[derive(Debug)]
pub(super) struct PendingFollow {
    reader: Reader,
    hold: Option<u64>,
    follower: Arc<dyn Follower>,
    pub(super) until: Instant,
    /// Why the reader gave the request up before it was held, if it did: the hold, once
    /// opened, fails at once instead of waiting its abort timeout for a read that will not
    /// come.
    aborted: Option<String>,
}

impl Held {
    /// Tells every follower `a`, dropping those that cannot take it.
    fn tell(&mut self, id: &RequestId, a: &Announcement) {
        self.followers.retain(|f| f.announce(id, a.clone()));
    }

    /// What a follower that joins now is told first: every block held so far whose tensors
    /// are all final (when there is any, or the hold is sealed), then the last part's blocks
    /// and their final tensors, if only some are.
    fn so_far(&self) -> Vec<Announcement> {
        let mut out = Vec::new();
        let whole: Vec<Vec<BlockId>> = match &self.tail {
            Some(t) => self
                .order
                .iter()
                .zip(&t.first)
                .map(|(g, f)| g[..*f as usize].to_vec())
                .collect(),
            None => self.order.clone(),
        };
        if whole.iter().any(|g| !g.is_empty()) || self.sealed {
            out.push(Announcement::Part {
                token: self.token,
                first: vec![0; self.order.len()],
                blocks: whole,
                tensors: None,
                sealed: self.sealed,
            });
        }
        if let Some(t) = &self.tail {
            out.push(Announcement::Part {
                token: self.token,
                first: t.first.clone(),
                blocks: t.blocks.clone(),
                tensors: Some((0, t.done)),
                sealed: false,
            });
        }
        out
    }

    /// Makes tensors `tensors` of the last part's blocks final (no new block: `new` false,
    /// from where the last part ended), and tells the followers.
    fn continue_tail(
        &mut self,
        id: &RequestId,
        new: bool,
        tensors: Option<std::ops::Range<u32>>,
        total: u32,
    ) -> Result<()> {
        let tail = self.tail.as_mut().expect("a tail");
        let Some(r) = tensors.filter(|r| !new && r.start == tail.done) else {
            return Err(Error::invalid(format!(
                "request {id}'s last part has tensors {}.. to come: extend it with tensors from \
                 {} on and no block first",
                tail.done, tail.done
            )));
        };
        tail.done = r.end;
        let part = Announcement::Part {
            token: self.token,
            first: tail.first.clone(),
            blocks: vec![Vec::new(); tail.blocks.len()],
            tensors: Some((r.start, r.end)),
            sealed: false,
        };
        if r.end == total {
            self.tail = None;
        }
        self.tell(id, &part);
        Ok(())
    }

    /// Appends `blocks` (per block group) to the hold, under a new grant of all its blocks,
    /// with only tensors `partial` final when given (they become its tail), and tells the
    /// followers.
    fn append(
        &mut self,
        id: &RequestId,
        blocks: &[Vec<BlockId>],
        partial: Option<std::ops::Range<u32>>,
    ) -> Result<()> {
        if blocks.len() != self.order.len() {
            return Err(Error::invalid(format!(
                "{} block lists to extend a hold of {} block groups",
                blocks.len(),
                self.order.len()
            )));
        }
        if self.earlier.len() >= MAX_PARTS {
            return Err(Error::invalid(format!(
                "request {id} grew by {MAX_PARTS} parts already"
            )));
        }
        let mut order = self.order.clone();
        for (g, add) in blocks.iter().enumerate() {
            if let Some(b) = add.iter().find(|b| self.grant.has(g, **b)) {
                return Err(Error::invalid(format!(
                    "block {b} of block group {g} is held for request {id} already"
                )));
            }
            order[g].extend_from_slice(add);
        }
        let grant = Arc::new(Grant::open(self.grant.layout_arc(), &order)?);
        if grant.len() != order.iter().map(Vec::len).sum::<usize>() {
            return Err(Error::invalid(format!(
                "the blocks extending request {id} repeat a block id"
            )));
        }
        let first: Vec<u32> = self.order.iter().map(|g| g.len() as u32).collect();
        let part = Announcement::Part {
            token: self.token,
            first: first.clone(),
            blocks: blocks.to_vec(),
            tensors: partial.as_ref().map(|r| (r.start, r.end)),
            sealed: false,
        };
        self.tail = partial.map(|r| Tail {
            first,
            blocks: blocks.to_vec(),
            done: r.end,
        });
        let before = std::mem::replace(&mut self.grant, grant);
        self.earlier.push(before);
        self.order = order;
        self.tell(id, &part);
        Ok(())
    }

    /// The number of tensors of the hold's layout.
    fn tensor_count(&self) -> u32 {
        self.grant.layout().tensors.len() as u32
    }

    /// Makes `follower` (reader `reader`, following hold `hold`) a follower of this hold, or
    /// says why not.
    fn attach(
        &mut self,
        own: TpRank,
        id: &RequestId,
        reader: &Reader,
        hold: Option<u64>,
        follower: Arc<dyn Follower>,
    ) -> std::result::Result<(), Refusal> {
        if hold.is_some_and(|t| t != self.token) {
            return Err(Refusal::new(
                RefusalKind::NotHeld,
                format!("request {id} is held under another hold than the one followed"),
            ));
        }
        self.admit(own, id, reader, true)?;
        if self.followers.len() >= MAX_FOLLOWERS {
            return Err(Refusal::new(
                RefusalKind::Limit,
                format!("request {id} has {MAX_FOLLOWERS} followers already"),
            ));
        }
        for a in self.so_far() {
            if !follower.announce(id, a) {
                return Ok(());
            }
        }
        self.followers.push(follower);
        Ok(())
    }
}

impl CompletionTracker {
    /// Holds request `id` for its readers: `grant` (its blocks, sorted), `order` (the same
    /// blocks per block group in the holder's order, which readers pair with theirs), on
    /// `terms`. Readers that followed the request before it was held become its followers.
    pub fn open_hold(
        &mut self,
        id: RequestId,
        grant: Arc<Grant>,
        order: Vec<Vec<BlockId>>,
        terms: HoldTerms,
        now: Instant,
    ) -> Result<()> {
        if self.held.contains_key(&id) {
            return Err(Error::invalid(format!(
                "request {id} is already held for sending"
            )));
        }
        // A hold for a reader that is gone gives it a whole lease from now to come back.
        let lease_end = terms
            .reader
            .as_deref()
            .and_then(|r| self.presence.lease_end(r))
            .map(|_| now + self.presence.lease());
        let mut h = Held {
            deadline: now + terms.abort_timeout,
            timeout: terms.abort_timeout,
            lease_end,
            grant,
            token: terms.token,
            named: terms.reader,
            readers: Vec::new(),
            reader_size: None,
            sealed: terms.sealed,
            order,
            earlier: Vec::new(),
            followers: Vec::new(),
            tail: None,
            released: false,
        };
        let mut given_up = None;
        for p in self.pending.remove(&id).unwrap_or_default() {
            if let Some(why) = p.aborted {
                if p.hold.is_none_or(|t| t == h.token) {
                    given_up = Some(why);
                }
                continue;
            }
            let follower = p.follower.clone();
            if let Err(why) = h.attach(self.tp, &id, &p.reader, p.hold, p.follower) {
                let reason = why.into_reason();
                follower.announce(&id, Announcement::Ended { reason });
            }
        }
        if let Some(why) = given_up {
            // A reader aborted the request before it was held: the send fails now, as it
            // would had the abort come after the hold.
            h.end_grants();
            h.tell_ended(&id, &format!("a reader aborted the request: {why}"));
            self.finish_send(id, SendNotice::Aborted(why));
            return Ok(());
        }
        self.deadlines += 1;
        self.held.insert(id, h);
        Ok(())
    }

    /// Reader `reader` follows request `id` (hold `hold`, when it names one): it is told of the
    /// hold's blocks so far and of every part after, through `follower`. A request not held
    /// yet is waited for until `until`. Refused (and nothing kept) when the reader may not
    /// read the request, or too many followers wait.
    pub fn follow(
        &mut self,
        id: &RequestId,
        reader: &Reader,
        hold: Option<u64>,
        follower: Arc<dyn Follower>,
        until: Instant,
    ) -> std::result::Result<(), Refusal> {
        let own = self.tp;
        if let Some(h) = self.held.get_mut(id) {
            return h.attach(own, id, reader, hold, follower);
        }
        let waiting: usize = self.pending.values().map(Vec::len).sum();
        if waiting >= MAX_PENDING_FOLLOWS {
            return Err(Refusal::new(
                RefusalKind::Limit,
                format!("{MAX_PENDING_FOLLOWS} reads already follow requests this engine does not hold yet"),
            ));
        }
        self.pending
            .entry(id.clone())
            .or_default()
            .push(PendingFollow {
                reader: reader.clone(),
                hold,
                follower,
                until,
                aborted: None,
            });
        self.deadlines += 1;
        Ok(())
    }

    /// Reader `reader` aborted request `id` (hold `hold`, when it names one) before it was
    /// held: its follows of it are marked, so that the hold fails once opened. Whether it
    /// followed the request (nothing is kept otherwise: the abort is refused).
    pub(super) fn abort_pending(
        &mut self,
        id: &RequestId,
        reader: &Reader,
        hold: Option<u64>,
        why: &str,
    ) -> bool {
        let Some(waiting) = self.pending.get_mut(id) else {
            return false;
        };
        let mut any = false;
        for p in waiting.iter_mut().filter(|p| p.reader == *reader) {
            if hold.is_none() || p.hold.is_none() || p.hold == hold {
                p.hold = p.hold.or(hold);
                p.aborted = Some(why.to_string());
                any = true;
            }
        }
        any
    }

    /// Grows the growing hold of request `id` by a part, and tells its followers: `blocks`
    /// (per block group, in the holder's order) with all their tensors (`tensors` `None`), or
    /// with tensors `[0, end)` only, the next parts then naming no block and adding the next
    /// tensors of those blocks (`[start, end)`, from where the last ended) until the last
    /// tensor. Refused for a request not held, a sealed hold, block ids it holds already or
    /// outside the layout, tensors out of order, new blocks while the last part's tensors are
    /// not all final, and past [`MAX_PARTS`] parts.
    pub fn extend_hold(
        &mut self,
        id: &RequestId,
        blocks: &[Vec<BlockId>],
        tensors: Option<std::ops::Range<u32>>,
    ) -> Result<()> {
        let h = self.growing(id)?;
        let total = h.tensor_count();
        if let Some(r) = &tensors {
            if r.start >= r.end || r.end > total {
                return Err(Error::invalid(format!(
                    "tensors {r:?} of a layout of {total} tensors"
                )));
            }
        }
        let new = blocks.iter().any(|b| !b.is_empty());
        if h.tail.is_some() {
            return h.continue_tail(id, new, tensors, total);
        }
        if !new || tensors.as_ref().is_some_and(|r| r.start != 0) {
            return Err(Error::invalid(format!(
                "a part of request {id} adds blocks, with their tensors from 0 on"
            )));
        }
        h.append(id, blocks, tensors.filter(|r| r.end < total))
    }

    /// Seals the growing hold of request `id`: it is complete, its readers may confirm, and
    /// its followers are told. Refused for a request not held, a sealed hold, and a hold of no
    /// block at all.
    pub fn seal_hold(&mut self, id: &RequestId) -> Result<()> {
        let h = self.growing(id)?;
        if let Some(t) = &h.tail {
            return Err(Error::invalid(format!(
                "request {id}'s last part has tensors {}.. to come: extend it before sealing",
                t.done
            )));
        }
        if h.grant.is_empty() {
            return Err(Error::invalid(format!(
                "request {id} holds no block: extend its hold before sealing it (or release it)"
            )));
        }
        h.sealed = true;
        let part = Announcement::Part {
            token: h.token,
            first: h.order.iter().map(|g| g.len() as u32).collect(),
            blocks: vec![Vec::new(); h.order.len()],
            tensors: None,
            sealed: true,
        };
        h.tell(id, &part);
        Ok(())
    }

    /// The growing (unsealed) hold of request `id`.
    fn growing(&mut self, id: &RequestId) -> Result<&mut Held> {
        match self.held.get_mut(id) {
            Some(h) if !h.sealed => Ok(h),
            Some(_) => Err(Error::invalid(format!(
                "request {id} is sealed: its hold grows no more"
            ))),
            None => Err(Error::invalid(format!(
                "request {id} is not held by this engine (it ended, or was never held)"
            ))),
        }
    }

    /// Ends the follows of requests not held by their deadline, telling their readers.
    pub(super) fn expire_follows(&mut self, now: Instant) {
        self.pending.retain(|id, waiting| {
            waiting.retain(|p| {
                if p.until > now {
                    return true;
                }
                let reason = format!("request {id} was not held within the follow's wait");
                p.follower.announce(id, Announcement::Ended { reason });
                false
            });
            !waiting.is_empty()
        });
    }
}
