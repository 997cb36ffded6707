//! The token cursor the event decoders walk: one msgpack item at a time, borrowed from the
//! input (strings, binaries and runs of small integers are not copied).

use super::{DecodeError, Reader, Value, MAX_DEPTH, MAX_RESERVE};

/// For each first byte: the length of the unsigned-integer form it starts if that form holds at
/// most 32 bits (0 for every other byte), and the shift and mask that cut the value out of the
/// big-endian word starting at that byte.
const UINT32_FORMS: [(u8, u32, u32); 256] = {
    let mut t = [(0u8, 0u32, 0u32); 256];
    let mut b = 0;
    while b < 0x80 {
        t[b] = (1, 56, 0x7f);
        b += 1;
    }
    t[0xcc] = (2, 48, 0xff);
    t[0xcd] = (3, 40, 0xffff);
    t[0xce] = (5, 24, u32::MAX);
    t
};

/// A short string as an encoder writes it (its fixstr marker, then its bytes), for
/// [`Cursor::skip_if`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Encoded {
    bytes: [u8; 32],
    len: usize,
    /// The first `len` bytes of a 16-byte little-endian word (when `len` is at most 16).
    mask: u128,
}

impl Encoded {
    /// `s` (at most 31 bytes) with its fixstr marker.
    pub(crate) const fn str(s: &str) -> Encoded {
        let s = s.as_bytes();
        assert!(s.len() <= 31, "a fixstr holds at most 31 bytes");
        let mut bytes = [0u8; 32];
        bytes[0] = 0xa0 | s.len() as u8;
        let mut i = 0;
        while i < s.len() {
            bytes[i + 1] = s[i];
            i += 1;
        }
        let len = s.len() + 1;
        let mask = if len >= 16 {
            u128::MAX
        } else {
            (1u128 << (8 * len)) - 1
        };
        Encoded { bytes, len, mask }
    }
}

/// Most token ids [`Cursor::small_uints`] reads per call.
const SMALL_UINTS_CHUNK: usize = 256;

/// One msgpack item as a pull parser sees it: scalars whole, containers as their length (the
/// caller then reads that many items, or pairs for a map).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Token<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext(i8, &'a [u8]),
    Array(usize),
    Map(usize),
}

/// A pull parser over one buffer, with the same hostile-input checks as [`decode`]: lengths
/// are checked against the bytes left before anything is sized from them.
#[derive(Debug)]
pub(crate) struct Cursor<'a>(Reader<'a>);

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Cursor(Reader { buf, pos: 0 })
    }

    pub(crate) fn pos(&self) -> usize {
        self.0.pos
    }

    /// Moves back to a position returned by [`Cursor::pos`].
    pub(crate) fn rewind(&mut self, pos: usize) {
        self.0.pos = pos.min(self.0.buf.len());
    }

    pub(crate) fn remaining(&self) -> usize {
        self.0.remaining()
    }

    /// The next item (a container's header only).
    #[inline]
    pub(crate) fn token(&mut self) -> Result<Token<'a>, DecodeError> {
        let r = &mut self.0;
        let b = r.take(1)?[0];
        Ok(match b {
            0x00..=0x7f => Token::UInt(u64::from(b)),
            0x80..=0x8f => self.container(usize::from(b & 0x0f), true)?,
            0x90..=0x9f => self.container(usize::from(b & 0x0f), false)?,
            0xa0..=0xbf => Token::Str(r.take(usize::from(b & 0x1f))?),
            0xc0 => Token::Nil,
            0xc2 => Token::Bool(false),
            0xc3 => Token::Bool(true),
            0xc4 => {
                let n = r.be::<1>()? as usize;
                Token::Bin(r.take(n)?)
            }
            0xc5 => {
                let n = r.be::<2>()? as usize;
                Token::Bin(r.take(n)?)
            }
            0xc6 => {
                let n = r.be::<4>()? as usize;
                Token::Bin(r.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = match b {
                    0xc7 => r.be::<1>()?,
                    0xc8 => r.be::<2>()?,
                    _ => r.be::<4>()?,
                } as usize;
                let t = r.take(1)?[0] as i8;
                Token::Ext(t, r.take(n)?)
            }
            0xca => Token::Float(f64::from(f32::from_bits(r.be::<4>()? as u32))),
            0xcb => Token::Float(f64::from_bits(r.be::<8>()?)),
            0xcc => Token::UInt(r.be::<1>()?),
            0xcd => Token::UInt(r.be::<2>()?),
            0xce => Token::UInt(r.be::<4>()?),
            0xcf => Token::UInt(r.be::<8>()?),
            0xd0 => int_token(r.be::<1>()? as u8 as i8 as i64),
            0xd1 => int_token(r.be::<2>()? as u16 as i16 as i64),
            0xd2 => int_token(r.be::<4>()? as u32 as i32 as i64),
            0xd3 => int_token(r.be::<8>()? as i64),
            0xd4..=0xd8 => {
                let t = r.take(1)?[0] as i8;
                Token::Ext(t, r.take(1 << (b - 0xd4))?)
            }
            0xd9 => {
                let n = r.be::<1>()? as usize;
                Token::Str(r.take(n)?)
            }
            0xda => {
                let n = r.be::<2>()? as usize;
                Token::Str(r.take(n)?)
            }
            0xdb => {
                let n = r.be::<4>()? as usize;
                Token::Str(r.take(n)?)
            }
            0xdc => {
                let n = r.be::<2>()? as usize;
                self.container(n, false)?
            }
            0xdd => {
                let n = r.be::<4>()? as usize;
                self.container(n, false)?
            }
            0xde => {
                let n = r.be::<2>()? as usize;
                self.container(n, true)?
            }
            0xdf => {
                let n = r.be::<4>()? as usize;
                self.container(n, true)?
            }
            0xe0..=0xff => Token::Int(i64::from(b as i8)),
            0xc1 => return Err(DecodeError::ReservedByte),
        })
    }

    fn container(&self, len: usize, map: bool) -> Result<Token<'a>, DecodeError> {
        if map {
            self.0.check_len(len, 2)?;
            Ok(Token::Map(len))
        } else {
            self.0.check_len(len, 1)?;
            Ok(Token::Array(len))
        }
    }

    /// Reads up to `n` (and at most 256) unsigned integers of at most 32 bits (token ids) into
    /// `out`, stopping at the first item of another form (or at the end of the bytes); returns
    /// how many it read.
    /// One pass over the bytes, one cursor update: the bulk of a BlockStored. Where eight bytes
    /// are left, each item is read as a big-endian word and cut by a table indexed by its
    /// marker, with no branch on the form (token ids come in the 1-, 2-, 3- and 5-byte forms at
    /// random).
    #[inline]
    pub(crate) fn small_uints(&mut self, n: usize, out: &mut Vec<u32>) -> usize {
        let r = &mut self.0;
        let rest = &r.buf[r.pos..];
        let start = out.len();
        // Room for at most as many as there are bytes left and at most a chunk at a time
        // (callers come back for the rest after an item of another form, so the zero-fill stays
        // linear), written by index and cut back to what was read.
        let n = n.min(rest.len()).min(SMALL_UINTS_CHUNK);
        if rest
            .first()
            .is_none_or(|&b| UINT32_FORMS[usize::from(b)].0 == 0)
        {
            return 0; // not one of these forms: nothing to make room for
        }
        out.resize(start + n, 0);
        let dst = &mut out[start..];
        let mut i = 0;
        let mut done = 0;
        // While eight bytes are left from `i`: one word read, one table lookup per item.
        let words_end = rest.len().saturating_sub(7);
        while done < n && i < words_end {
            // The next position is worked out from the marker byte alone, by arithmetic: the
            // chain from one item to the next is one load and three operations, with no table
            // load and no byte swap on it (the value is cut out beside it).
            let m = rest[i];
            let len = if m < 0x80 {
                1
            } else {
                let k = m.wrapping_sub(0xcc); // 0xcc, 0xcd, 0xce: 1 + 1, 2, 4 bytes
                if k > 2 {
                    break;
                }
                (1usize << k) + 1
            };
            let word = u64::from_be_bytes(rest[i..i + 8].try_into().expect("8 bytes"));
            let (_, shift, mask) = UINT32_FORMS[usize::from(m)];
            dst[done] = (word >> shift) as u32 & mask;
            i += len;
            done += 1;
        }
        // The last few bytes of the buffer, one at a time.
        while done < n {
            let Some(&b) = rest.get(i) else { break };
            let (v, len) = match (b, rest.get(i + 1..)) {
                (0x00..=0x7f, _) => (u32::from(b), 1),
                (0xcc, Some([x, ..])) => (u32::from(*x), 2),
                (0xcd, Some([x, y, ..])) => (u32::from(u16::from_be_bytes([*x, *y])), 3),
                (0xce, Some([a, b, c, d, ..])) => (u32::from_be_bytes([*a, *b, *c, *d]), 5),
                _ => break,
            };
            dst[done] = v;
            i += len;
            done += 1;
        }
        out.truncate(start + done);
        r.pos += i;
        done
    }

    /// The next item if it is an unsigned integer (any form); `None` (nothing consumed)
    /// otherwise, or when its bytes are not all there. Hashes, sizes and counts take this
    /// path rather than [`Cursor::token`]'s.
    #[inline]
    pub(crate) fn uint(&mut self) -> Option<u64> {
        let r = &mut self.0;
        let rest = &r.buf[r.pos..];
        let (len, v) = match *rest.first()? {
            b @ 0x00..=0x7f => (1, u64::from(b)),
            0xcc => (2, u64::from(*rest.get(1)?)),
            0xcd => (
                3,
                u64::from(u16::from_be_bytes(*rest.get(1..)?.first_chunk()?)),
            ),
            0xce => (
                5,
                u64::from(u32::from_be_bytes(*rest.get(1..)?.first_chunk()?)),
            ),
            0xcf => (9, u64::from_be_bytes(*rest.get(1..)?.first_chunk()?)),
            _ => return None,
        };
        r.pos += len;
        Some(v)
    }

    /// The next item's length if it is an array (`map` false) or a map (`map` true) whose items
    /// the bytes left can hold; `None` (nothing consumed) otherwise, and [`Cursor::token`]
    /// says why.
    #[inline]
    pub(crate) fn container_len(&mut self, map: bool) -> Option<usize> {
        let r = &mut self.0;
        let rest = &r.buf[r.pos..];
        let (fix, w16, w32) = if map {
            (0x80, 0xde, 0xdf)
        } else {
            (0x90, 0xdc, 0xdd)
        };
        let b = *rest.first()?;
        let (head, n) = if b & 0xf0 == fix {
            (1, usize::from(b & 0x0f))
        } else if b == w16 {
            (
                3,
                usize::from(u16::from_be_bytes(*rest.get(1..)?.first_chunk()?)),
            )
        } else if b == w32 {
            (
                5,
                u32::from_be_bytes(*rest.get(1..)?.first_chunk()?) as usize,
            )
        } else {
            return None;
        };
        // Each item is at least one byte (a key and a value for a map).
        if n.saturating_mul(1 + usize::from(map)) > rest.len() - head {
            return None;
        }
        r.pos += head;
        Some(n)
    }

    /// Consumes the next item if it is nil; says whether it was.
    #[inline]
    pub(crate) fn nil(&mut self) -> bool {
        let r = &mut self.0;
        let is = r.buf.get(r.pos) == Some(&0xc0);
        r.pos += usize::from(is);
        is
    }

    /// Consumes the next bytes if they are exactly `want` (an item as an encoder writes it,
    /// such as a map key with its marker, at most 32 bytes); says whether they were. Compared
    /// a 16-byte word at a time where 32 bytes are left, so a key costs a few instructions
    /// rather than a parse, a length check and a call to `memcmp`.
    #[inline(always)]
    pub(crate) fn skip_if(&mut self, want: &Encoded) -> bool {
        let r = &mut self.0;
        let rest = &r.buf[r.pos..];
        let n = want.len;
        let same = match rest.first_chunk::<32>() {
            Some(have) => {
                let word = |b: &[u8; 32], at: usize| {
                    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
                };
                if n <= 16 {
                    (word(have, 0) ^ word(&want.bytes, 0)) & want.mask == 0
                } else {
                    // The first 16 bytes, then the last 16 (overlapping).
                    word(have, 0) == word(&want.bytes, 0)
                        && word(have, n - 16) == word(&want.bytes, n - 16)
                }
            }
            None => rest.starts_with(&want.bytes[..n]),
        };
        r.pos += if same { n } else { 0 };
        same
    }

    /// The next item if it is a string of at most 255 bytes (a map key, an event's tag);
    /// `None` (nothing consumed) otherwise, or when the bytes are not all there.
    #[inline]
    pub(crate) fn short_str(&mut self) -> Option<&'a [u8]> {
        let r = &mut self.0;
        let rest = &r.buf[r.pos..];
        let (start, len) = match *rest.first()? {
            b @ 0xa0..=0xbf => (1, usize::from(b & 0x1f)),
            0xd9 => (2, usize::from(*rest.get(1)?)),
            _ => return None,
        };
        let s = rest.get(start..start + len)?;
        r.pos += start + len;
        Some(s)
    }

    /// One whole item as a tree (nesting capped at [`MAX_DEPTH`]).
    pub(crate) fn value(&mut self, depth: usize) -> Result<Value, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep(MAX_DEPTH));
        }
        Ok(match self.token()? {
            Token::Nil => Value::Nil,
            Token::Bool(b) => Value::Bool(b),
            Token::UInt(v) => Value::UInt(v),
            Token::Int(v) => Value::Int(v),
            Token::Float(v) => Value::Float(v),
            Token::Str(s) => Value::Str(String::from_utf8_lossy(s).into_owned()),
            Token::Bin(b) => Value::Bin(b.to_vec()),
            Token::Ext(t, d) => Value::Ext(t, d.to_vec()),
            // Lengths were checked against the bytes left by `token`.
            Token::Array(n) => {
                let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    v.push(self.value(depth + 1)?);
                }
                Value::Array(v)
            }
            Token::Map(n) => {
                let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    let k = self.value(depth + 1)?;
                    v.push((k, self.value(depth + 1)?));
                }
                Value::Map(v)
            }
        })
    }

    /// Skips one whole item, however deeply nested (iteratively: no recursion to exhaust).
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            match self.token()? {
                Token::Array(n) => pending += n,
                Token::Map(n) => pending += 2 * n,
                _ => {}
            }
        }
        Ok(())
    }
}

fn int_token(v: i64) -> Token<'static> {
    if v >= 0 {
        Token::UInt(v as u64)
    } else {
        Token::Int(v)
    }
}
