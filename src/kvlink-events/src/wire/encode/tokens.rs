//! Token ids, the bulk of a BlockStored, in msgpack's shortest form per id: the writer, built
//! twice (baseline and LZCNT/BMI2), and the table it chooses each id's form by.

use super::put_array_len;

pub(super) use fast::put_tokens;

/// For the leading zero bits of a u32 (0 to 31; a zero counts as a one): the big-endian word
/// of its shortest msgpack form with the value left out (the marker in the top byte), what
/// places the value below the marker, and the form's length. Token ids spread over a
/// vocabulary land in the 2-, 3- and 5-byte forms at random, so choosing the form by table
/// rather than by branches spares a mispredicted branch per token. The shift is stored as a
/// power of two to multiply by (one instruction, where a shift by a variable is three on x86
/// without BMI2).
const U32_FORMS: [(u64, u64, usize); 32] = {
    let mut t = [(0u64, 1u64 << 56, 1usize); 32];
    let mut zeros = 0;
    while zeros <= 24 {
        t[zeros] = match 31 - zeros {
            7 => (0xcc << 56, 1 << 48, 2),
            8..=15 => (0xcd << 56, 1 << 40, 3),
            _ => (0xce << 56, 1 << 24, 5),
        };
        zeros += 1;
    }
    t
};

/// A u32 in msgpack's shortest form, as the first bytes of a big-endian word, and its length.
#[inline(always)]
pub(super) fn u32_form(v: u32) -> (u64, usize) {
    let (mark, place, len) = U32_FORMS[(v | 1).leading_zeros() as usize];
    (mark | (u64::from(v) * place), len)
}

/// Token ids, the bulk of a BlockStored, each written as a whole 8-byte word with the position
/// advanced by its form's length. Short lists go straight into `out` (room for the longest
/// forms made once, then cut back to what was written); long ones a chunk at a time through a
/// buffer on the stack, hot in the first-level cache, then copied out whole: a payload being
/// filled is often fresh memory, where scattered word stores cost more than one copy (see
/// docs/benchmarks.md). Compiled twice ([`put_tokens`]).
#[inline(always)]
fn put_tokens_with(out: &mut Vec<u8>, ts: &[u32]) {
    put_array_len(out, ts.len());
    if ts.len() < TOKEN_CHUNK {
        put_token_words(out, ts);
    } else {
        put_token_chunks(out, ts);
    }
}

/// Token ids through a buffer on the stack, a chunk at a time.
#[inline(always)]
fn put_token_chunks(out: &mut Vec<u8>, ts: &[u32]) {
    let mut stage = [0u8; 5 * TOKEN_CHUNK + 8];
    for chunk in ts.chunks(TOKEN_CHUNK) {
        let mut n = 0;
        for &t in chunk {
            let (word, len) = u32_form(t);
            // `n` never passes `5 * TOKEN_CHUNK`; the `min` says so to the compiler, which
            // then checks no bounds in the loop.
            let at = n.min(5 * TOKEN_CHUNK);
            stage[at..at + 8].copy_from_slice(&word.to_be_bytes());
            n = at + len;
        }
        out.extend_from_slice(&stage[..n]);
    }
}

/// Token ids written into `out` in place: room for the longest forms made once, then cut back.
#[inline(always)]
fn put_token_words(out: &mut Vec<u8>, ts: &[u32]) {
    let start = out.len();
    // At most 5 bytes a token, and the last word's 8.
    let last = 5 * ts.len();
    out.resize(start + last + 8, 0);
    let dst = &mut out[start..start + last + 8];
    let mut n = 0;
    for &t in ts {
        let (word, len) = u32_form(t);
        // `n` never passes `last`; the `min` says so to the compiler, which then checks no
        // bounds in the loop.
        let at = n.min(last);
        dst[at..at + 8].copy_from_slice(&word.to_be_bytes());
        n = at + len;
    }
    out.truncate(start + n);
}

/// Token ids a long list is written through the stack at a time.
const TOKEN_CHUNK: usize = 64;

/// The token-id writer compiled a second time for x86-64 CPUs with LZCNT and BMI2 (every x86
/// server core of the last decade), chosen at run time: the baseline target has neither, and
/// its bit scan costs several micro-ops on AMD cores where LZCNT is one; that is a third of
/// the writer's time. The one `unsafe` call of the events code is here.
#[allow(unsafe_code)]
mod fast {
    /// [`super::put_token_words`] with LZCNT and BMI2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "lzcnt,bmi2")]
    fn put_token_words_lzcnt(out: &mut Vec<u8>, ts: &[u32]) {
        super::put_token_words(out, ts)
    }

    /// [`super::put_token_chunks`] with LZCNT and BMI2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "lzcnt,bmi2")]
    fn put_token_chunks_lzcnt(out: &mut Vec<u8>, ts: &[u32]) {
        super::put_token_chunks(out, ts)
    }

    /// Token ids as [`super::put_tokens_with`] writes them, by the fastest build this CPU runs.
    #[inline]
    pub(crate) fn put_tokens(out: &mut Vec<u8>, ts: &[u32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("lzcnt")
            && std::arch::is_x86_feature_detected!("bmi2")
        {
            super::put_array_len(out, ts.len());
            // SAFETY: both functions are safe code whose only requirement is that the CPU
            // has LZCNT and BMI2, and it was just found to have both (std caches the answer).
            unsafe {
                if ts.len() < super::TOKEN_CHUNK {
                    put_token_words_lzcnt(out, ts)
                } else {
                    put_token_chunks_lzcnt(out, ts)
                }
            }
            return;
        }
        super::put_tokens_with(out, ts)
    }

    #[cfg(test)]
    mod tests {
        use proptest::prelude::*;

        proptest! {
            /// Both builds write the same bytes, token ids of every form mixed.
            #[test]
            fn both_builds_write_the_same_bytes(
                ts in prop::collection::vec(prop_oneof![0u32..0x100, 0u32..0x1_0000, any::<u32>()], 0..300),
            ) {
                let (mut a, mut b) = (vec![0x90], vec![0x90]);
                super::put_tokens(&mut a, &ts);
                super::super::put_tokens_with(&mut b, &ts);
                prop_assert_eq!(a, b);
            }
        }
    }
}
