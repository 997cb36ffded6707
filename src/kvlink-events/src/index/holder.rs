//! One holder's state (an engine's DP rank, tier and KV-cache group), and the small lists the
//! index keeps per hash of who holds that block, with each holder's copy of it (one lookup
//! finds both).

use std::collections::HashMap;

use crate::keyed::Keyed;

/// One holder: its counts and state (its blocks are its entries in the index's maps).
#[derive(Debug)]
pub(crate) struct Holder {
    /// Blocks held.
    pub(crate) held: usize,
    /// Bumped on every loss: blocks of an older epoch are withheld.
    pub(crate) epoch: u32,
    /// Blocks of an older epoch still held.
    pub(crate) withheld: usize,
    /// Events of its stream were lost (stores among them, maybe): what it holds is a lower
    /// bound until it is cleared, its publisher restarts, or a snapshot replaces it.
    pub(crate) partial: bool,
    /// The caller said the stream is down: nothing counts.
    pub(crate) stale: bool,
    /// Tokens per block, from its last store.
    pub(crate) block_size: u32,
    /// Whether the holder is in use (a removed engine's holders are kept for reuse).
    pub(crate) live: bool,
}

impl Holder {
    pub(crate) fn new() -> Holder {
        Holder {
            held: 0,
            epoch: 0,
            withheld: 0,
            partial: false,
            stale: false,
            block_size: 0,
            live: true,
        }
    }

    /// Whether a block stored in `epoch` counts in answers now.
    pub(crate) fn counts(&self, epoch: u32) -> bool {
        self.live && !self.stale && epoch == self.epoch
    }

    /// Events were lost: every block held now is withheld until removed or confirmed.
    pub(crate) fn lose(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        self.withheld = self.held;
        self.partial = true;
    }

    /// Accounts for block `e` leaving the holder.
    pub(crate) fn forget(&mut self, e: &Entry) {
        self.held -= 1;
        if e.epoch != self.epoch {
            self.withheld = self.withheld.saturating_sub(1);
        }
    }
}

/// Who holds one block: usually one holder, so without an allocation then.
#[derive(Debug, Clone)]
pub(crate) enum Holders {
    One(Entry),
    Many(Vec<Entry>),
}

/// One holder's copy of a block: what the walk of a query needs, and its token hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The index's token hash of the block (`chain::next`: its key in the token-hash map), 0
    /// when its tokens or its parent's are unknown.
    pub(crate) local: u64,
    pub(crate) holder: u32,
    /// The holder's epoch it was stored (or last confirmed) in: it counts only in the current
    /// one.
    pub(crate) epoch: u32,
    /// The position after its last token, 0 when unknown.
    pub(crate) end: u32,
}

impl Holders {
    pub(crate) fn as_slice(&self) -> &[Entry] {
        match self {
            Holders::One(e) => std::slice::from_ref(e),
            Holders::Many(v) => v,
        }
    }

    /// `holder`'s entry, if it holds the block.
    pub(crate) fn of(&self, holder: u32) -> Option<&Entry> {
        let s = self.as_slice();
        s.binary_search_by_key(&holder, |x| x.holder)
            .ok()
            .map(|i| &s[i])
    }

    /// Replaces `e`'s holder's entry (the old one returned), or adds it unless `full`
    /// (entries stay sorted by holder, so that a query intersects them with its own sorted
    /// list in one pass).
    pub(crate) fn put(&mut self, e: Entry, full: bool) -> Put {
        match self {
            Holders::One(one) if one.holder == e.holder => Put::Replaced(std::mem::replace(one, e)),
            Holders::One(_) if full => Put::Full,
            Holders::One(one) => {
                let pair = if one.holder < e.holder {
                    [*one, e]
                } else {
                    [e, *one]
                };
                *self = Holders::Many(pair.to_vec());
                Put::Added
            }
            Holders::Many(v) => match v.binary_search_by_key(&e.holder, |x| x.holder) {
                Ok(i) => Put::Replaced(std::mem::replace(&mut v[i], e)),
                Err(_) if full => Put::Full,
                Err(i) => {
                    v.insert(i, e);
                    Put::Added
                }
            },
        }
    }

    /// Removes `holder`'s entry (returned) and says whether none is left.
    pub(crate) fn drop_holder(&mut self, holder: u32) -> (Option<Entry>, bool) {
        match self {
            Holders::One(one) if one.holder == holder => (Some(*one), true),
            Holders::One(_) => (None, false),
            Holders::Many(v) => {
                let Ok(i) = v.binary_search_by_key(&holder, |x| x.holder) else {
                    return (None, false);
                };
                let gone = v.remove(i);
                if let [one] = v.as_slice() {
                    *self = Holders::One(*one);
                }
                (Some(gone), false)
            }
        }
    }

    /// Drops the entries of the holders `doomed` marks, each passed to `gone`; whether none
    /// is left.
    pub(crate) fn drop_marked(&mut self, doomed: &[bool], mut gone: impl FnMut(Entry)) -> bool {
        let hit = |e: &Entry| doomed.get(e.holder as usize).copied().unwrap_or(false);
        match self {
            Holders::One(one) if hit(one) => {
                gone(*one);
                true
            }
            Holders::One(_) => false,
            Holders::Many(v) => {
                v.retain(|e| {
                    if hit(e) {
                        gone(*e);
                    }
                    !hit(e)
                });
                match v.as_slice() {
                    [] => true,
                    [one] => {
                        *self = Holders::One(*one);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

/// What [`Holders::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Put {
    /// The holder's entry was there: replaced, the old one returned.
    Replaced(Entry),
    /// A new entry.
    Added,
    /// Not there, and the index is full: nothing changed.
    Full,
}

/// Puts `e` in `map` under `key` (one lookup): the holder's old entry, or `Put::Full` when it
/// had none and `full` says no block may be added.
pub(crate) fn put(map: &mut HashMap<u64, Holders, Keyed>, key: u64, e: Entry, full: bool) -> Put {
    use std::collections::hash_map::Entry as Slot;
    match map.entry(key) {
        Slot::Occupied(mut o) => o.get_mut().put(e, full),
        Slot::Vacant(_) if full => Put::Full,
        Slot::Vacant(v) => {
            v.insert(Holders::One(e));
            Put::Added
        }
    }
}

/// Takes `holder`'s entry out of `map` under `key` (one lookup), and returns it.
pub(crate) fn take(map: &mut HashMap<u64, Holders, Keyed>, key: u64, holder: u32) -> Option<Entry> {
    let std::collections::hash_map::Entry::Occupied(mut o) = map.entry(key) else {
        return None;
    };
    let (gone, empty) = o.get_mut().drop_holder(holder);
    if empty {
        o.remove();
    }
    gone
}
