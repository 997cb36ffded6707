//! Tensor parallelism across a prefill and a decode of different sizes, by arithmetic: which
//! prefill ranks a decode rank reads, how many decode ranks read one prefill rank, and which of
//! a model's KV heads each rank holds. Pure functions, no I/O.
//!
//! The sizes must divide one another. With a decode `ratio` times larger than the prefill,
//! decode ranks `p * ratio .. (p + 1) * ratio` all read prefill rank `p` (each its own heads of
//! `p`'s heads; a layout without heads, such as MLA's latent, whole). With a prefill `ratio`
//! times larger, decode rank `d` reads prefill ranks `d * ratio .. (d + 1) * ratio` (each one's
//! heads land side by side in `d`'s blocks; tensors without heads are shared out among them).
//! With equal sizes, decode rank `d` reads prefill rank `d`.

use std::fmt;
use std::ops::Range;

/// A rank of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpRank {
    /// The rank, below `size`.
    pub rank: u32,
    /// Ranks in the group.
    pub size: u32,
}

impl TpRank {
    /// Rank `rank` of a group of `size`.
    pub const fn new(rank: u32, size: u32) -> TpRank {
        TpRank { rank, size }
    }

    /// The only rank of a group of one.
    pub const SOLO: TpRank = TpRank::new(0, 1);
}

impl fmt::Display for TpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.size)
    }
}

/// Why two TP groups cannot pair, or a rank is not one of its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpError {
    /// A group of size 0.
    ZeroSize {
        /// The prefill's size.
        prefill: u32,
        /// The decode's size.
        decode: u32,
    },
    /// Neither size is a multiple of the other.
    NotMultiples {
        /// The prefill's size.
        prefill: u32,
        /// The decode's size.
        decode: u32,
    },
    /// A rank outside its group (or in a group of size 0).
    BadRank {
        /// The rank.
        rank: u32,
        /// Its group's size.
        size: u32,
    },
}

impl std::fmt::Display for TpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TpError::ZeroSize { prefill, decode } => {
                write!(f, "TP sizes {prefill} and {decode}: a size is 0")
            }
            TpError::NotMultiples { prefill, decode } => write!(
                f,
                "TP sizes {prefill} and {decode}: neither is a multiple of the other"
            ),
            TpError::BadRank { rank, size } => write!(f, "TP rank {rank} of size {size}"),
        }
    }
}

impl std::error::Error for TpError {}

/// How a prefill group and a decode group of given sizes pair up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    /// Same size: decode rank `d` reads prefill rank `d`.
    Same,
    /// The decode is `ratio` times larger: each prefill rank is read by `ratio` decode ranks.
    DecodeLarger {
        /// Decode ranks per prefill rank.
        ratio: u32,
    },
    /// The prefill is `ratio` times larger: each decode rank reads `ratio` prefill ranks.
    PrefillLarger {
        /// Prefill ranks per decode rank.
        ratio: u32,
    },
}

impl Relation {
    /// The relation of a prefill of `prefill` ranks and a decode of `decode` ranks, or why they
    /// cannot pair (zero, or neither size a multiple of the other).
    pub fn of(prefill: u32, decode: u32) -> Result<Relation, TpError> {
        if prefill == 0 || decode == 0 {
            return Err(TpError::ZeroSize { prefill, decode });
        }
        if prefill == decode {
            Ok(Relation::Same)
        } else if decode.is_multiple_of(prefill) {
            Ok(Relation::DecodeLarger {
                ratio: decode / prefill,
            })
        } else if prefill.is_multiple_of(decode) {
            Ok(Relation::PrefillLarger {
                ratio: prefill / decode,
            })
        } else {
            Err(TpError::NotMultiples { prefill, decode })
        }
    }

    /// The relation between two engines whose roles are not known yet (a handshake): either
    /// may be the prefill. States it in words, or says why the sizes cannot pair.
    pub fn describe(a: u32, b: u32) -> Result<String, TpError> {
        let (small, large) = (a.min(b), a.max(b));
        Ok(match Relation::of(small, large)? {
            Relation::Same => format!("same TP size {a}"),
            Relation::DecodeLarger { ratio } | Relation::PrefillLarger { ratio } => format!(
                "TP {small} with TP {large}: when the TP-{small} side is the prefill, each of its \
                 ranks is read by {ratio} ranks, each taking its own share of the KV heads; \
                 when it is the decode, each of its ranks gathers {ratio} prefill ranks"
            ),
        })
    }
}

/// The prefill ranks decode rank `decode` reads from a prefill of `prefill_size` ranks.
pub fn sources(decode: TpRank, prefill_size: u32) -> Result<Range<u32>, TpError> {
    check(decode)?;
    Ok(match Relation::of(prefill_size, decode.size)? {
        Relation::Same => decode.rank..decode.rank + 1,
        Relation::DecodeLarger { ratio } => {
            let p = decode.rank / ratio;
            p..p + 1
        }
        Relation::PrefillLarger { ratio } => decode.rank * ratio..(decode.rank + 1) * ratio,
    })
}

/// How many ranks of a decode of `decode_size` read prefill rank `prefill`.
pub fn readers(prefill: TpRank, decode_size: u32) -> Result<u32, TpError> {
    check(prefill)?;
    Ok(match Relation::of(prefill.size, decode_size)? {
        Relation::DecodeLarger { ratio } => ratio,
        Relation::Same | Relation::PrefillLarger { .. } => 1,
    })
}

/// Whether decode rank `decode` reads prefill rank `prefill` (false for sizes that cannot pair).
pub fn reads(decode: TpRank, prefill: TpRank) -> bool {
    check(prefill).is_ok() && sources(decode, prefill.size).is_ok_and(|s| s.contains(&prefill.rank))
}

/// Heads of `total` KV heads that each rank of a group of `size` holds: `total / size`, or 1
/// when there are more ranks than heads (each head then lives on `size / total` ranks). `None`
/// when the heads cannot be spread evenly.
pub fn heads_per_rank(total: u32, size: u32) -> Option<u32> {
    if total == 0 || size == 0 {
        None
    } else if size <= total {
        total.is_multiple_of(size).then_some(total / size)
    } else {
        size.is_multiple_of(total).then_some(1)
    }
}

/// The model's KV heads (of `total`) that rank `at` holds, as global head indices.
pub fn heads(at: TpRank, total: u32) -> Range<u32> {
    if at.size <= total {
        let n = total / at.size;
        at.rank * n..(at.rank + 1) * n
    } else {
        let h = (u64::from(at.rank) * u64::from(total) / u64::from(at.size)) as u32;
        h..h + 1
    }
}

fn check(at: TpRank) -> Result<(), TpError> {
    if at.size == 0 || at.rank >= at.size {
        Err(TpError::BadRank {
            rank: at.rank,
            size: at.size,
        })
    } else {
        Ok(())
    }
}

/// A reading engine as a holder of blocks sees it: its engine id (from its handshake) and its
/// TP rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reader {
    /// The reader's engine id.
    pub engine: String,
    /// The reader's rank in its TP group.
    pub tp: TpRank,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relations_and_sources_in_both_directions() {
        assert_eq!(Relation::of(2, 2), Ok(Relation::Same));
        assert_eq!(Relation::of(1, 4), Ok(Relation::DecodeLarger { ratio: 4 }));
        assert_eq!(Relation::of(4, 2), Ok(Relation::PrefillLarger { ratio: 2 }));
        assert_eq!(
            Relation::of(2, 3),
            Err(TpError::NotMultiples {
                prefill: 2,
                decode: 3
            })
        );
        assert!(matches!(
            Relation::of(2, 3),
            Err(TpError::NotMultiples { .. })
        ));
        assert!(matches!(Relation::of(0, 3), Err(TpError::ZeroSize { .. })));
        assert!(matches!(
            sources(TpRank::new(4, 4), 2),
            Err(TpError::BadRank { rank: 4, size: 4 })
        ));
        // Decode 4 from prefill 2: ranks 0, 1 read 0; 2, 3 read 1.
        let got: Vec<_> = (0..4)
            .map(|d| sources(TpRank::new(d, 4), 2).unwrap())
            .collect();
        assert_eq!(got, [0..1, 0..1, 1..2, 1..2]);
        assert_eq!(readers(TpRank::new(1, 2), 4), Ok(2));
        // Decode 1 from prefill 4: all four.
        assert_eq!(sources(TpRank::SOLO, 4), Ok(0..4));
        assert_eq!(readers(TpRank::new(3, 4), 1), Ok(1));
        assert!(reads(TpRank::new(3, 4), TpRank::new(1, 2)));
        assert!(!reads(TpRank::new(1, 4), TpRank::new(1, 2)));
        assert!(!reads(TpRank::new(0, 3), TpRank::new(0, 2)));
        assert!(sources(TpRank::new(4, 4), 2).is_err());
        assert!(Relation::describe(4, 1).unwrap().contains("gathers 4"));
    }

    #[test]
    fn every_prefill_rank_has_exactly_its_readers() {
        for p in [1u32, 2, 4, 8] {
            for d in [1u32, 2, 4, 8] {
                let mut count = vec![0u32; p as usize];
                for r in 0..d {
                    for s in sources(TpRank::new(r, d), p).unwrap() {
                        count[s as usize] += 1;
                    }
                }
                for (s, c) in count.iter().enumerate() {
                    assert_eq!(*c, readers(TpRank::new(s as u32, p), d).unwrap());
                }
            }
        }
    }

    #[test]
    fn heads_split_evenly_or_replicate() {
        assert_eq!(heads_per_rank(8, 2), Some(4));
        assert_eq!(heads_per_rank(8, 16), Some(1));
        assert_eq!(heads_per_rank(8, 3), None);
        assert_eq!(heads_per_rank(6, 4), None);
        assert_eq!(heads(TpRank::new(1, 2), 8), 4..8);
        // 2 heads on 8 ranks: ranks 0-3 hold head 0, 4-7 head 1.
        let h: Vec<_> = (0..8).map(|r| heads(TpRank::new(r, 8), 2).start).collect();
        assert_eq!(h, [0, 0, 0, 0, 1, 1, 1, 1]);
    }
}
