//! A small msgpack reader for hostile input: every length is checked against the bytes that
//! remain before anything is allocated, nesting is capped, and any malformed input is an error,
//! never a panic. (Generic decoders preallocate from the length prefix a peer sends.)

pub(crate) use cursor::{Cursor, Encoded, Token};

/// Deepest nesting accepted.
pub const MAX_DEPTH: usize = 32;

/// Most items reserved ahead for a container: a length only says how many items may follow (at
/// one byte each), while each costs far more in memory, so vectors start at most this large and
/// grow with what actually arrives.
pub(crate) const MAX_RESERVE: usize = 1024;

/// A decoded msgpack value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// nil
    Nil,
    /// true / false
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    /// A float (32-bit floats are widened).
    Float(f64),
    /// A UTF-8 string (invalid UTF-8 is replaced, never rejected).
    Str(String),
    /// Binary data.
    Bin(Vec<u8>),
    /// An array.
    Array(Vec<Value>),
    /// A map, in wire order.
    Map(Vec<(Value, Value)>),
    /// An extension value (type, data).
    Ext(i8, Vec<u8>),
}

impl Value {
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::UInt(v) => Some(*v),
            _ => None,
        }
    }

    /// The value as a signed integer, if it fits.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::UInt(v) => i64::try_from(*v).ok(),
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// The value as a float (integers convert).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(v) => Some(*v),
            Value::UInt(v) => Some(*v as f64),
            Value::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    /// True for nil.
    pub fn is_nil(&self) -> bool {
        matches!(self, Value::Nil)
    }
}

/// Why bytes are not one msgpack value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// An item announced more bytes than are left.
    #[error("malformed msgpack: {announced} bytes announced, {left} left")]
    Truncated {
        /// The bytes the item announced.
        announced: usize,
        /// The bytes left in the buffer.
        left: usize,
    },
    /// A collection announced more items than the bytes left can hold.
    #[error("malformed msgpack: {items} items announced, {left} bytes left")]
    TooManyItems {
        /// The items the collection announced.
        items: usize,
        /// The bytes left in the buffer.
        left: usize,
    },
    /// The byte 0xc1, which msgpack reserves.
    #[error("malformed msgpack: reserved byte 0xc1")]
    ReservedByte,
    /// Collections nested deeper than the decoder follows.
    #[error("malformed msgpack: nested deeper than {0}")]
    TooDeep(usize),
    /// Bytes after the one value.
    #[error("malformed msgpack: {0} trailing bytes")]
    TrailingBytes(usize),
}

#[derive(Debug)]
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// The error for an item longer than the bytes left (out of line: the hot paths stay small).
#[cold]
#[inline(never)]
fn short(n: usize, left: usize) -> DecodeError {
    DecodeError::Truncated { announced: n, left }
}

#[cold]
#[inline(never)]
fn too_many(len: usize, left: usize) -> DecodeError {
    DecodeError::TooManyItems { items: len, left }
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.remaining() {
            return Err(short(n, self.remaining()));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// A big-endian unsigned integer of `N` (1, 2, 4 or 8) bytes.
    #[inline(always)]
    fn be<const N: usize>(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(N)?;
        let mut a = [0u8; 8];
        a[8 - N..].copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// A collection of `len` items, each at least `min_item` bytes: refused before allocating
    /// when the bytes cannot hold it.
    fn check_len(&self, len: usize, min_item: usize) -> Result<(), DecodeError> {
        if len.saturating_mul(min_item) > self.remaining() {
            return Err(too_many(len, self.remaining()));
        }
        Ok(())
    }
}

impl Value {
    /// Writes the value in msgpack's shortest form for each item (as msgspec and rmp do).
    pub fn encode(&self, out: &mut Vec<u8>) {
        use rmp::encode as w;
        // Writing into a Vec cannot fail: the results are ignored.
        match self {
            Value::Nil => {
                let _ = w::write_nil(out);
            }
            Value::Bool(b) => {
                let _ = w::write_bool(out, *b);
            }
            Value::UInt(v) => {
                let _ = w::write_uint(out, *v);
            }
            Value::Int(v) => {
                let _ = w::write_sint(out, *v);
            }
            Value::Float(v) => {
                let _ = w::write_f64(out, *v);
            }
            Value::Str(s) => {
                let _ = w::write_str(out, s);
            }
            Value::Bin(b) => {
                let _ = w::write_bin(out, b);
            }
            Value::Array(items) => {
                let _ = w::write_array_len(out, items.len() as u32);
                for v in items {
                    v.encode(out);
                }
            }
            Value::Map(pairs) => {
                let _ = w::write_map_len(out, pairs.len() as u32);
                for (k, v) in pairs {
                    k.encode(out);
                    v.encode(out);
                }
            }
            Value::Ext(t, data) => {
                let _ = w::write_ext_meta(out, data.len() as u32, *t);
                out.extend_from_slice(data);
            }
        }
    }
}

/// Decodes exactly one value from `buf` (trailing bytes are an error).
pub fn decode(buf: &[u8]) -> Result<Value, DecodeError> {
    let mut c = Cursor::new(buf);
    let v = c.value(0)?;
    if c.remaining() != 0 {
        return Err(DecodeError::TrailingBytes(c.remaining()));
    }
    Ok(v)
}

mod cursor;
#[cfg(test)]
mod tests;
