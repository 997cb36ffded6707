//! The hold table a prefill shares with same-host readers: one slot per live hold (request id,
//! token, a fingerprint of its granted blocks, and a sequence word), in a memfd the readers map read-only, so that a reader can
//! check, with no round trip, that a hold was live for the whole of a copy it made itself.
//!
//! A slot's sequence word is odd while its hold is live and even otherwise; it only grows. The
//! owner (the prefill engine, under the lock where holds end) fills a free slot's id and token,
//! then makes its word odd; when the hold ends it makes the word even again and fences before
//! it returns, so the blocks the hold granted are reused only after the word moved. A reader
//! finds the slot of its request ([`HoldTable::find`]: the id, and the token when it names
//! one), copies the blocks, and keeps the copy only if the word is still the one it found
//! ([`HoldTable::unchanged`]): a word that moved means the hold ended (or the slot was reused)
//! while it copied, and the copy may hold bytes of a later request.
//!
//! Every word is accessed as an atomic: the reader's view of a slot may be torn while the owner
//! rewrites it, which the sequence word exposes (it moves before the slot is rewritten).
//!
//! **Receipts.** A reader's `Done` travels on its control connection, which may be gone when
//! it copied (a reader stopped and resumed finds its connection closed): the prefill would
//! then expire a hold whose bytes the reader kept. So each reader also gets a receipt page of
//! its own ([`HoldTable::receipts_for`]: a memfd the owner creates, sealed at its size, one
//! word per slot), and keeps a copy only after it signed it there. The two sides order their
//! steps as Dekker's mutual exclusion does, with sequentially consistent fences between:
//!
//! - the reader copies, checks that the word did not move (else the copy may be torn), writes
//!   the word it found into its receipt for that slot, and checks the word again;
//! - the owner, ending a hold, moves the word, then reads the receipts of that slot
//!   ([`HoldTable::end`]) and says whether the hold counts as read ([`Ending::settle`]).
//!
//! A reader whose second check finds the word unmoved signed before the owner read the
//! receipts, so the owner sees the receipt and counts the read even if the `Done` is lost; a
//! reader whose second check finds it moved waits for the owner's verdict, which the slot's
//! outcome word carries ([`HoldTable::outcome`]).

use std::sync::atomic::{fence, AtomicU64, Ordering};

use std::os::fd::OwnedFd;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::ids::RequestId;
use crate::shm::SharedMap;
use crate::tp::Reader;

/// Slots in a table: the live holds one engine can share (further holds are served over the
/// socket, as before).
pub(crate) const SLOTS: usize = 4096;
/// Words per slot: sequence, token, blocks' fingerprint, id length, outcome, then the id (at
/// most 256 bytes).
const WORDS: usize = ID + crate::ids::MAX_REQUEST_ID_LEN / 8;
/// Where each field of a slot is, in words.
const SEQ: usize = 0;
const TOKEN: usize = 1;
const BLOCKS: usize = 2;
const ID_LEN: usize = 3;
/// The last ended hold's verdict: its word while live shifted left once, plus one when the
/// owner counted a reader's receipt for it.
const OUTCOME: usize = 4;
const ID: usize = 5;
/// Bytes of a table.
pub(crate) const TABLE_BYTES: usize = SLOTS * WORDS * 8;
/// Bytes of a reader's receipt page: one word per slot.
pub(crate) const RECEIPT_BYTES: usize = SLOTS * 8;
/// Receipt pages one table keeps (one per reader engine and rank); readers beyond them are
/// served by the owner's copy.
const MAX_RECEIPT_PAGES: usize = 256;
/// Slots probed from the one an id hashes to.
const PROBES: usize = 16;

/// A hold table: the owner's (read-write, with its free slots) or a reader's mapping of it.
#[derive(Debug)]
pub(crate) struct HoldTable {
    map: SharedMap,
    /// Which slots hold a live hold (the owner's own record; `None` in a reader's mapping).
    used: Option<Mutex<Vec<bool>>>,
    /// Each reader's receipt page (the owner's; empty in a reader's mapping).
    receipts: Mutex<Vec<(Reader, Arc<SharedMap>)>>,
}

/// A hold whose word [`HoldTable::end`] moved, with the readers that signed a receipt for it
/// before; [`settle`](Ending::settle) publishes the verdict and frees the slot (dropping it
/// settles as not counted).
#[derive(Debug)]
pub(crate) struct Ending {
    table: Arc<HoldTable>,
    slot: usize,
    /// The word the hold had while live (`None`: the slot held no live hold).
    ended: Option<u64>,
    /// The readers whose receipt names this hold.
    pub(crate) receipts: Vec<Reader>,
    settled: bool,
}

impl Ending {
    /// Publishes whether the owner counted a receipt (`counted`), then frees the slot.
    pub(crate) fn settle(mut self, counted: bool) {
        self.finish(counted);
    }

    fn finish(&mut self, counted: bool) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        if let Some(ended) = self.ended {
            let verdict = (ended << 1) | u64::from(counted);
            self.table
                .word(self.slot, OUTCOME)
                .store(verdict, Ordering::Release);
        }
        if let Some(used) = &self.table.used {
            used.lock()[self.slot] = false;
        }
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// A reader's receipt page, mapped writable (the owner created and sealed it).
#[derive(Debug)]
pub(crate) struct ReceiptPage {
    map: SharedMap,
}

impl ReceiptPage {
    /// A reader's mapping of the page its prefill shared (checked to be [`RECEIPT_BYTES`]
    /// long).
    pub(crate) fn reader(map: SharedMap) -> Option<ReceiptPage> {
        (map.len() == RECEIPT_BYTES).then_some(ReceiptPage { map })
    }

    /// Signs the hold `found`: the reader copied its bytes and found its word unmoved after.
    /// The fence orders the receipt before the reader looks at the word again.
    pub(crate) fn sign(&self, found: Found) {
        receipt_word(&self.map, found.slot).store(found.seq, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }
}

/// Word `slot` of a receipt page.
fn receipt_word(map: &SharedMap, slot: usize) -> &AtomicU64 {
    assert!(slot < SLOTS && map.len() == RECEIPT_BYTES);
    // SAFETY: `slot * 8 + 8` is within the mapping (its length checked above), the mapping is
    // page aligned so the word is 8-byte aligned, it lives as long as `map`, and every access
    // to a receipt page, in both processes, is atomic.
    unsafe { &*map.as_ptr().add(slot * 8).cast::<AtomicU64>() }
}

/// Where a reader found its hold, and the sequence word it read there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    slot: usize,
    seq: u64,
}

impl HoldTable {
    /// A new, empty table of the owner's.
    pub(crate) fn create() -> std::io::Result<HoldTable> {
        let map = SharedMap::create("kvlink-holds", TABLE_BYTES, false)?;
        Ok(HoldTable {
            map,
            used: Some(Mutex::new(vec![false; SLOTS])),
            receipts: Mutex::new(Vec::new()),
        })
    }

    /// A reader's view of a peer's table (mapped read-only by the caller; checked to be
    /// [`TABLE_BYTES`] long).
    pub(crate) fn reader(map: SharedMap) -> Option<HoldTable> {
        (map.len() == TABLE_BYTES).then_some(HoldTable {
            map,
            used: None,
            receipts: Mutex::new(Vec::new()),
        })
    }

    /// A writable descriptor of `reader`'s receipt page (made on first ask, the same page
    /// after: a reader that reconnects signs where its earlier receipts are) and its length.
    /// Refused when the table keeps [`MAX_RECEIPT_PAGES`] already, or in a reader's mapping.
    pub(crate) fn receipts_for(&self, reader: &Reader) -> std::io::Result<(OwnedFd, u64)> {
        if self.used.is_none() {
            return Err(std::io::Error::other("a reader's mapping has no receipts"));
        }
        let mut pages = self.receipts.lock();
        let page = match pages.iter().find(|(r, _)| r == reader) {
            Some((_, p)) => p.clone(),
            None if pages.len() >= MAX_RECEIPT_PAGES => {
                return Err(std::io::Error::other(format!(
                    "{MAX_RECEIPT_PAGES} readers hold receipt pages already"
                )))
            }
            None => {
                let p = Arc::new(SharedMap::create("kvlink-receipts", RECEIPT_BYTES, false)?);
                pages.push((reader.clone(), p.clone()));
                p
            }
        };
        let fd = page
            .fd()
            .ok_or_else(|| std::io::Error::other("no page file"))?;
        Ok((fd.try_clone_to_owned()?, RECEIPT_BYTES as u64))
    }

    /// The table's mapping (its memfd, `SharedMap::fd`, is what the owner hands to readers).
    pub(crate) fn map(&self) -> &SharedMap {
        &self.map
    }

    fn word(&self, slot: usize, i: usize) -> &AtomicU64 {
        assert!(slot < SLOTS && i < WORDS);
        let at = (slot * WORDS + i) * 8;
        // SAFETY: `at + 8` is within the mapping (checked above against its fixed size), the
        // mapping is page aligned so `at` is 8-byte aligned, it lives as long as `self`, and
        // every access to the table, here and in every process that maps it, is atomic.
        unsafe { &*self.map.as_ptr().add(at).cast::<AtomicU64>() }
    }

    /// Publishes a live hold of `id` under `token`, granting the blocks `blocks` fingerprints
    /// (`grant::blocks_hash`); its slot, or `None` when every slot the id may use is taken
    /// (that hold is then served over the socket only).
    pub(crate) fn insert(&self, id: &RequestId, token: u64, blocks: u64) -> Option<usize> {
        let mut used = self.used.as_ref()?.lock();
        let slot = probes(id).find(|s| !used[*s])?;
        used[slot] = true;
        let seq = self.word(slot, SEQ).load(Ordering::Relaxed);
        debug_assert!(seq.is_multiple_of(2), "a free slot's word is even");
        self.word(slot, TOKEN).store(token, Ordering::Relaxed);
        self.word(slot, BLOCKS).store(blocks, Ordering::Relaxed);
        let bytes = id.as_str().as_bytes();
        self.word(slot, ID_LEN)
            .store(bytes.len() as u64, Ordering::Relaxed);
        for (i, chunk) in bytes.chunks(8).enumerate() {
            self.word(slot, ID + i)
                .store(pack(chunk), Ordering::Relaxed);
        }
        // The fields are in place before the word says the slot is live.
        self.word(slot, SEQ).store(seq + 1, Ordering::Release);
        Some(slot)
    }

    /// Ends the hold in `slot`: its word moves (even), and no reader's copy made across this
    /// moment is kept. The fence orders the move before anything the caller does next, such as
    /// letting the engine reuse the hold's blocks, and before the receipts are read: the
    /// readers that signed for the hold are in the returned [`Ending`], which the caller
    /// settles. `None` in a reader's mapping.
    pub(crate) fn end(self: &Arc<Self>, slot: usize) -> Option<Ending> {
        self.used.as_ref()?;
        let seq = self.word(slot, SEQ).load(Ordering::Relaxed);
        let live = seq % 2 == 1;
        if live {
            self.word(slot, SEQ).store(seq + 1, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        let receipts = if live {
            self.receipts
                .lock()
                .iter()
                .filter(|(_, page)| receipt_word(page, slot).load(Ordering::Relaxed) == seq)
                .map(|(r, _)| r.clone())
                .collect()
        } else {
            Vec::new()
        };
        Some(Ending {
            table: self.clone(),
            slot,
            ended: live.then_some(seq),
            receipts,
            settled: false,
        })
    }

    /// The live hold of `id` (under `token` when the reader names one) granting exactly the
    /// blocks `blocks` fingerprints, if the table has it.
    pub(crate) fn find(&self, id: &RequestId, token: Option<u64>, blocks: u64) -> Option<Found> {
        probes(id).find_map(|slot| {
            let seq = self.word(slot, SEQ).load(Ordering::Acquire);
            let ours = seq % 2 == 1 && self.holds(slot, id, token, blocks);
            // The fields read belong to that word only if it has not moved since.
            fence(Ordering::Acquire);
            let stable = self.word(slot, SEQ).load(Ordering::Relaxed) == seq;
            (ours && stable).then_some(Found { slot, seq })
        })
    }

    /// Whether `slot` names `id`, `blocks` (and `token`, when given).
    fn holds(&self, slot: usize, id: &RequestId, token: Option<u64>, blocks: u64) -> bool {
        let bytes = id.as_str().as_bytes();
        let word = |i| self.word(slot, i).load(Ordering::Relaxed);
        word(ID_LEN) == bytes.len() as u64
            && word(BLOCKS) == blocks
            && token.is_none_or(|t| word(TOKEN) == t)
            && bytes
                .chunks(8)
                .enumerate()
                .all(|(i, c)| word(ID + i) == pack(c))
    }

    /// Whether the hold `found` was live from [`find`](Self::find) until now: call it after the
    /// copy; the fence orders every byte the copy read before the word is read again.
    pub(crate) fn unchanged(&self, found: Found) -> bool {
        fence(Ordering::Acquire);
        self.word(found.slot, SEQ).load(Ordering::Relaxed) == found.seq
    }

    /// The owner's verdict on the hold `found` once it ended: `Some(true)` when it counted
    /// this table's reader's receipt, `Some(false)` when not, `None` while it has not said (or
    /// when the slot has since held and ended another hold, whose verdict replaced it).
    pub(crate) fn outcome(&self, found: Found) -> Option<bool> {
        let verdict = self.word(found.slot, OUTCOME).load(Ordering::Acquire);
        (verdict >> 1 == found.seq).then_some(verdict & 1 == 1)
    }
}

/// Up to eight bytes of an id as one word (little-endian, zero-padded).
fn pack(chunk: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..chunk.len()].copy_from_slice(chunk);
    u64::from_le_bytes(w)
}

/// The slots an id may use: [`PROBES`] of them from the one its bytes hash to (FNV-1a, the same
/// in every process of a build).
fn probes(id: &RequestId) -> impl Iterator<Item = usize> {
    let h = id.as_str().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (0..PROBES).map(move |i| (h as usize).wrapping_add(i) % SLOTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader_of(owner: &HoldTable) -> HoldTable {
        // The same memory, as a reader maps it (here through the same mapping's address).
        let fd = owner.map().fd().unwrap().try_clone_to_owned().unwrap();
        let map = SharedMap::open_peer_readonly(fd, TABLE_BYTES as u64).unwrap();
        HoldTable::reader(map).unwrap()
    }

    #[test]
    fn a_live_hold_is_found_by_id_and_token_and_a_moved_word_is_seen() {
        let owner = Arc::new(HoldTable::create().unwrap());
        let reader = reader_of(&owner);
        let id = RequestId::from("req-with-a-long-id-0123456789");
        assert_eq!(reader.find(&id, None, 5), None, "not held yet");
        let slot = owner.insert(&id, 77, 5).unwrap();
        let found = reader.find(&id, Some(77), 5).expect("held");
        assert_eq!(
            reader.find(&id, None, 5),
            Some(found),
            "no token matches any"
        );
        assert_eq!(reader.find(&id, Some(78), 5), None, "another token");
        assert_eq!(reader.find(&id, Some(77), 6), None, "other blocks");
        let shorter = RequestId::from("req-with-a-long-id-012345678");
        assert_eq!(reader.find(&shorter, None, 5), None);
        assert!(reader.unchanged(found));
        owner.end(slot).unwrap().settle(false);
        assert!(!reader.unchanged(found), "ended while copying");
        assert_eq!(reader.outcome(found), Some(false), "not counted");
        assert_eq!(reader.find(&id, None, 5), None);
        // Held again in the same slot: a new word, so an old copy stays refused.
        let again = owner.insert(&id, 77, 5).unwrap();
        assert_eq!(again, slot);
        let now = reader.find(&id, Some(77), 5).unwrap();
        assert_ne!(now, found);
        assert!(!reader.unchanged(found));
        assert!(reader.unchanged(now));
    }

    #[test]
    fn an_id_uses_its_probes_then_none() {
        let owner = Arc::new(HoldTable::create().unwrap());
        let id = RequestId::from("same");
        let slots: Vec<usize> = (0..PROBES)
            .map(|t| owner.insert(&id, t as u64, 1).unwrap())
            .collect();
        assert_eq!(owner.insert(&id, 99, 1), None, "every probe taken");
        let ending = owner.end(slots[3]).unwrap();
        assert_eq!(
            owner.insert(&id, 99, 1),
            None,
            "not free before it is settled"
        );
        drop(ending);
        assert_eq!(owner.insert(&id, 99, 1), Some(slots[3]));
    }

    fn reader_engine(name: &str) -> Reader {
        Reader {
            engine: name.into(),
            tp: crate::tp::TpRank { rank: 0, size: 1 },
        }
    }

    fn receipt_page(owner: &HoldTable, reader: &Reader) -> ReceiptPage {
        let (fd, len) = owner.receipts_for(reader).unwrap();
        ReceiptPage::reader(SharedMap::open_peer(fd, len).unwrap()).unwrap()
    }

    #[test]
    fn a_receipt_signed_while_the_hold_lived_is_seen_when_it_ends() {
        let owner = Arc::new(HoldTable::create().unwrap());
        let table = reader_of(&owner);
        let (d1, d2) = (reader_engine("d1"), reader_engine("d2"));
        let (page1, page2) = (receipt_page(&owner, &d1), receipt_page(&owner, &d2));
        let again = receipt_page(&owner, &d1);
        let id = RequestId::from("r1");
        let slot = owner.insert(&id, 1, 9).unwrap();
        let found = table.find(&id, Some(1), 9).unwrap();
        page1.sign(found);
        assert!(table.unchanged(found), "signed while live");
        let ending = owner.end(slot).unwrap();
        assert_eq!(ending.receipts, vec![d1.clone()], "d1 signed, d2 did not");
        assert_eq!(
            table.outcome(found),
            None,
            "no verdict before it is settled"
        );
        ending.settle(true);
        assert_eq!(table.outcome(found), Some(true));
        // The next hold in that slot: the old receipts name an older word.
        let slot = owner.insert(&id, 2, 9).unwrap();
        let found = table.find(&id, Some(2), 9).unwrap();
        page2.sign(found);
        assert_eq!(
            table.outcome(found),
            None,
            "the verdict named the earlier hold"
        );
        let ending = owner.end(slot).unwrap();
        assert_eq!(ending.receipts, vec![d2]);
        drop(ending);
        assert_eq!(table.outcome(found), Some(false), "dropped: not counted");
        // A reader that comes back signs on the same page.
        let slot = owner.insert(&id, 3, 9).unwrap();
        again.sign(table.find(&id, Some(3), 9).unwrap());
        assert_eq!(owner.end(slot).unwrap().receipts, vec![d1]);
        assert!(
            table.receipts_for(&reader_engine("d3")).is_err(),
            "a reader's mapping"
        );
    }

    #[test]
    fn a_receipt_races_the_end_and_exactly_one_side_sees_the_other() {
        // Reader: sign, then look at the word; owner: move the word, then read receipts. For
        // every interleaving, a reader that saw the word unmoved is among the receipts.
        for round in 0..200u64 {
            let owner = Arc::new(HoldTable::create().unwrap());
            let table = Arc::new(reader_of(&owner));
            let d1 = reader_engine("d1");
            let page = receipt_page(&owner, &d1);
            let id = RequestId::from(format!("r{round}").as_str());
            let slot = owner.insert(&id, round, 1).unwrap();
            let found = table.find(&id, None, 1).unwrap();
            let reader = std::thread::spawn(move || {
                page.sign(found);
                table.unchanged(found)
            });
            let ending = owner.end(slot).unwrap();
            let kept = reader.join().unwrap();
            assert!(!kept || ending.receipts == vec![d1], "round {round}");
        }
    }
}
