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

use std::sync::atomic::{fence, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::ids::RequestId;
use crate::shm::SharedMap;

/// Slots in a table: the live holds one engine can share (further holds are served over the
/// socket, as before).
pub(crate) const SLOTS: usize = 4096;
/// Words per slot: sequence, token, blocks' fingerprint, id length, then the id (at most 256
/// bytes).
const WORDS: usize = ID + crate::ids::MAX_REQUEST_ID_LEN / 8;
/// Where each field of a slot is, in words.
const SEQ: usize = 0;
const TOKEN: usize = 1;
const BLOCKS: usize = 2;
const ID_LEN: usize = 3;
const ID: usize = 4;
/// Bytes of a table.
pub(crate) const TABLE_BYTES: usize = SLOTS * WORDS * 8;
/// Slots probed from the one an id hashes to.
const PROBES: usize = 16;

/// A hold table: the owner's (read-write, with its free slots) or a reader's mapping of it.
#[derive(Debug)]
pub(crate) struct HoldTable {
    map: SharedMap,
    /// Which slots hold a live hold (the owner's own record; `None` in a reader's mapping).
    used: Option<Mutex<Vec<bool>>>,
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
        })
    }

    /// A reader's view of a peer's table (mapped read-only by the caller; checked to be
    /// [`TABLE_BYTES`] long).
    pub(crate) fn reader(map: SharedMap) -> Option<HoldTable> {
        (map.len() == TABLE_BYTES).then_some(HoldTable { map, used: None })
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
    /// letting the engine reuse the hold's blocks.
    pub(crate) fn end(&self, slot: usize) {
        let Some(used) = &self.used else { return };
        let seq = self.word(slot, SEQ).load(Ordering::Relaxed);
        if seq % 2 == 1 {
            self.word(slot, SEQ).store(seq + 1, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        used.lock()[slot] = false;
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
        let owner = HoldTable::create().unwrap();
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
        owner.end(slot);
        assert!(!reader.unchanged(found), "ended while copying");
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
        let owner = HoldTable::create().unwrap();
        let id = RequestId::from("same");
        let slots: Vec<usize> = (0..PROBES)
            .map(|t| owner.insert(&id, t as u64, 1).unwrap())
            .collect();
        assert_eq!(owner.insert(&id, 99, 1), None, "every probe taken");
        owner.end(slots[3]);
        assert_eq!(owner.insert(&id, 99, 1), Some(slots[3]));
    }
}
