//! Work-request building, without verbs: a read's segments become RDMA READ work requests.
//!
//! Each segment is split at the registration chunks of both sides (a key covers one chunk) and
//! at `max_wr_bytes`; the pieces are sorted by remote key and address, and pieces contiguous on
//! the remote side share one work request with a scatter list of local pieces (at most
//! `max_sge` entries; local pieces contiguous under the same key merge into one entry).

use super::RdmaRegionInfo;
use crate::error::RdmaError;

/// Test-only corruption of what is posted, to exercise the verbs error paths.
#[derive(Debug, Clone, Copy, Default)]
pub struct RdmaFault {
    /// XORed into every remote key.
    pub rkey_xor: u32,
    /// Added to every remote address.
    pub addr_add: u64,
    /// How many requests (engine-wide, from the start) are corrupted; 0 disables the fault.
    pub requests: u32,
}

/// One local scatter entry (the fields of `ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sge {
    pub(crate) addr: u64,
    pub(crate) length: u32,
    pub(crate) lkey: u32,
}

/// One work request: a remote range and the local pieces it scatters into, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Wr {
    pub(crate) rkey: u32,
    pub(crate) raddr: u64,
    pub(crate) len: u64,
    pub(crate) sges: Vec<Sge>,
}

/// The local keys of a registered region: its address and, for an offset, the key covering it
/// and how many bytes from there stay under that key.
pub(crate) trait LocalKeys {
    /// Address of byte 0 of the region.
    fn addr(&self) -> u64;
    /// The key covering `offset` and the bytes left in its chunk from there.
    fn lkey(&self, offset: u64) -> (u32, u64);
}

/// A piece of a segment that lies inside one chunk on each side.
#[derive(Debug, Clone, Copy)]
struct Piece {
    rkey: u32,
    raddr: u64,
    lkey: u32,
    laddr: u64,
    len: u64,
}

/// Builds work requests from segments. Inputs are validated by their owners (local spans are
/// bounds-checked `RegionSpan`s); the remote side is checked here against the peer's keys.
pub(crate) struct WrBuilder {
    max_wr: u64,
    max_sge: usize,
    fault: RdmaFault,
    pieces: Vec<Piece>,
}

impl WrBuilder {
    /// A builder for work requests of at most `max_wr_bytes` (at least 4 KiB is used) and
    /// `max_sge` scatter entries (at least 1), corrupted by `fault` (tests only).
    pub(crate) fn new(max_wr_bytes: u64, max_sge: u32, fault: RdmaFault) -> WrBuilder {
        WrBuilder {
            max_wr: max_wr_bytes.max(4096),
            max_sge: (max_sge as usize).max(1),
            fault,
            pieces: Vec::new(),
        }
    }

    /// Adds a segment: `len` bytes at `remote_offset` of the peer's `remote` region into
    /// `local_offset` of a local region with keys `local`.
    pub(crate) fn add(
        &mut self,
        local: &impl LocalKeys,
        local_offset: u64,
        remote: &RdmaRegionInfo,
        remote_offset: u64,
        len: u64,
    ) -> Result<(), RdmaError> {
        if remote.chunk_bytes == 0 {
            return Err(format!("the peer's keys for {} have no chunk size", remote.id).into());
        }
        let (mut loff, mut roff, mut left) = (local_offset, remote_offset, len);
        while left > 0 {
            let (lkey, lroom) = local.lkey(loff);
            let ri = roff / remote.chunk_bytes;
            let rkey = usize::try_from(ri)
                .ok()
                .and_then(|i| remote.rkeys.get(i))
                .ok_or_else(|| {
                    format!(
                        "remote offset {roff} of {} is past its registration",
                        remote.id
                    )
                })?;
            let rroom = (ri + 1) * remote.chunk_bytes - roff;
            let n = left.min(lroom).min(rroom).min(self.max_wr);
            if n == 0 {
                return Err(format!("local offset {loff} is past its registration").into());
            }
            self.pieces.push(Piece {
                rkey: rkey ^ self.fault.rkey_xor,
                raddr: remote
                    .addr
                    .wrapping_add(roff)
                    .wrapping_add(self.fault.addr_add),
                lkey,
                laddr: local.addr() + loff,
                len: n,
            });
            loff += n;
            roff += n;
            left -= n;
        }
        Ok(())
    }

    /// The work requests, in remote order.
    pub(crate) fn finish(mut self) -> Vec<Wr> {
        // Remote order lets remote-contiguous pieces share a work request (scatter list).
        self.pieces.sort_unstable_by_key(|p| (p.rkey, p.raddr));
        let mut wrs: Vec<Wr> = Vec::with_capacity(self.pieces.len());
        for p in self.pieces {
            let sge = Sge {
                addr: p.laddr,
                length: p.len as u32,
                lkey: p.lkey,
            };
            if let Some(w) = wrs.last_mut() {
                if w.rkey == p.rkey && w.raddr + w.len == p.raddr && w.len + p.len <= self.max_wr {
                    let last = w.sges.last_mut().expect("a work request has a piece");
                    if last.lkey == p.lkey && last.addr + u64::from(last.length) == p.laddr {
                        last.length += p.len as u32;
                        w.len += p.len;
                        continue;
                    }
                    if w.sges.len() < self.max_sge {
                        w.sges.push(sge);
                        w.len += p.len;
                        continue;
                    }
                }
            }
            wrs.push(Wr {
                rkey: p.rkey,
                raddr: p.raddr,
                len: p.len,
                sges: vec![sge],
            });
        }
        wrs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RegionId;
    use proptest::prelude::*;

    /// A local region registered in chunks; key `base + i` for chunk `i`.
    struct Chunks {
        addr: u64,
        len: u64,
        chunk: u64,
        base: u32,
    }

    impl LocalKeys for Chunks {
        fn addr(&self) -> u64 {
            self.addr
        }
        fn lkey(&self, offset: u64) -> (u32, u64) {
            let i = offset / self.chunk;
            let end = ((i + 1) * self.chunk).min(self.len);
            (self.base + i as u32, end - offset)
        }
    }

    fn remote(len: u64, chunk: u64) -> RdmaRegionInfo {
        RdmaRegionInfo {
            id: RegionId(1),
            addr: 0x7000_0000,
            chunk_bytes: chunk,
            rkeys: (0..len.div_ceil(chunk)).map(|i| 500 + i as u32).collect(),
        }
    }

    #[test]
    fn remote_contiguous_pieces_share_a_request_with_a_scatter_list() {
        let local = Chunks {
            addr: 0x1000_0000,
            len: 1 << 20,
            chunk: 1 << 20,
            base: 10,
        };
        let r = remote(1 << 20, 1 << 20);
        let mut b = WrBuilder::new(1 << 20, 4, RdmaFault::default());
        // Remote [0, 8K) and [8K, 16K) are contiguous; locally they are far apart.
        b.add(&local, 64 << 10, &r, 8 << 10, 8 << 10).unwrap();
        b.add(&local, 0, &r, 0, 8 << 10).unwrap();
        let wrs = b.finish();
        assert_eq!(wrs.len(), 1, "{wrs:?}");
        assert_eq!(wrs[0].raddr, 0x7000_0000);
        assert_eq!(wrs[0].len, 16 << 10);
        assert_eq!(
            wrs[0].sges,
            vec![
                Sge {
                    addr: 0x1000_0000,
                    length: 8 << 10,
                    lkey: 10
                },
                Sge {
                    addr: 0x1001_0000,
                    length: 8 << 10,
                    lkey: 10
                },
            ]
        );
    }

    #[test]
    fn a_remote_offset_past_the_keys_is_refused() {
        let local = Chunks {
            addr: 0,
            len: 1 << 20,
            chunk: 1 << 20,
            base: 0,
        };
        let r = remote(64 << 10, 64 << 10);
        let mut b = WrBuilder::new(1 << 20, 4, RdmaFault::default());
        let e = b.add(&local, 0, &r, 60 << 10, 8 << 10).unwrap_err();
        assert!(e.to_string().contains("past its registration"), "{e}");
    }

    #[test]
    fn the_fault_corrupts_keys_and_addresses() {
        let local = Chunks {
            addr: 0,
            len: 4096,
            chunk: 4096,
            base: 0,
        };
        let r = remote(4096, 4096);
        let fault = RdmaFault {
            rkey_xor: 0xff,
            addr_add: 1 << 40,
            requests: 1,
        };
        let mut b = WrBuilder::new(4096, 1, fault);
        b.add(&local, 0, &r, 0, 4096).unwrap();
        let w = &b.finish()[0];
        assert_eq!(w.rkey, 500 ^ 0xff);
        assert_eq!(w.raddr, 0x7000_0000 + (1 << 40));
    }

    proptest! {
        /// Whatever the chunking and limits, the work requests read exactly the bytes asked
        /// for (byte for byte, remote to local), each within one key on each side and within
        /// the limits.
        #[test]
        fn every_byte_maps_once_within_keys_and_limits(
            lchunk_k in 1u64..64,
            rchunk_k in 1u64..64,
            max_wr_k in 4u64..96,
            max_sge in 1u32..6,
            segs in prop::collection::vec((0u64..240, 0u64..240, 1u64..16), 1..24),
        ) {
            let k = 1024u64;
            let len = 256 * k;
            let local = Chunks { addr: 1 << 32, len, chunk: lchunk_k * k, base: 0 };
            let r = remote(len, rchunk_k * k);
            let mut b = WrBuilder::new(max_wr_k * k, max_sge, RdmaFault::default());
            // Expected map remote byte -> local byte (KiB granularity; remote ranges disjoint).
            let mut want = std::collections::BTreeMap::new();
            let mut used_remote = std::collections::BTreeSet::new();
            for (lo, ro, n) in segs {
                let (lo, ro, n) = (lo.min(255 - n), ro.min(255 - n), n);
                if (ro..ro + n).any(|x| used_remote.contains(&x)) {
                    continue;
                }
                for i in 0..n {
                    used_remote.insert(ro + i);
                    want.insert(ro + i, lo + i);
                }
                b.add(&local, lo * k, &r, ro * k, n * k).unwrap();
            }
            let wrs = b.finish();
            let mut got = std::collections::BTreeMap::new();
            for w in &wrs {
                prop_assert!(w.len <= (max_wr_k * k).max(4096));
                prop_assert!(w.sges.len() <= max_sge as usize);
                prop_assert_eq!(w.len, w.sges.iter().map(|s| u64::from(s.length)).sum::<u64>());
                let roff = w.raddr - r.addr;
                let rchunk = roff / r.chunk_bytes;
                prop_assert_eq!(w.rkey, r.rkeys[rchunk as usize]);
                prop_assert!(roff + w.len <= (rchunk + 1) * r.chunk_bytes);
                let mut at = roff;
                for s in &w.sges {
                    let loff = s.addr - local.addr;
                    let (key, room) = local.lkey(loff);
                    prop_assert_eq!(s.lkey, key);
                    prop_assert!(u64::from(s.length) <= room);
                    for i in 0..u64::from(s.length) / k {
                        prop_assert!(got.insert(at / k + i, loff / k + i).is_none());
                    }
                    at += u64::from(s.length);
                }
            }
            prop_assert_eq!(got, want);
        }
    }
}
