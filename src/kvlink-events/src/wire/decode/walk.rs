//! The walks over one event: a map's fields (the current encoding), an array's places (the
//! legacy one), and the event its type makes of what was read. Inlined into the decoder.

use std::mem::take;

use super::fields::{F, KEYS, TYPE_FIRST};
use super::{field, malformed, type_of, Raw, REMOVED_LEGACY_UPSTREAM, STORED_LEGACY_UPSTREAM};
use crate::msgpack::{Cursor, Token};
use crate::wire::{BlockRemoved, BlockTransferred, EventError, ExtraField, FieldKey, KvEvent};

/// The fields of a map event (the current encoding), `n` of them, into `raw`. Inlined into
/// [`event`], the decoder's hot path.
#[inline(always)]
pub(super) fn map_event<'a>(
    c: &mut Cursor<'a>,
    raw: &mut Raw<'a, '_>,
    n: usize,
) -> Result<(), EventError> {
    // The fields still expected, in the order encoders write them: the next key is most
    // likely the first of these, checked before looking the name up.
    let mut expect: &[F] = &TYPE_FIRST;
    for _ in 0..n {
        // The expected key, compared with its marker as encoders write it; any other key is
        // read and looked up.
        let (f, k) = match expect.first() {
            Some(&f) if c.skip_if(&KEYS[f as usize]) => {
                expect = &expect[1..];
                (Some(f), f.name().as_bytes())
            }
            _ => {
                let k = match c.short_str() {
                    Some(k) => k,
                    None => match c.token().map_err(malformed)? {
                        Token::Str(k) => k,
                        _ => return Err(EventError::KeyNotAString),
                    },
                };
                let f = F::of(k);
                if let Some(p) = f.and_then(|f| expect.iter().position(|&g| g == f)) {
                    expect = &expect[p + 1..];
                }
                (f, k)
            }
        };
        field(c, raw, f, || {
            FieldKey::Name(String::from_utf8_lossy(k).into_owned())
        })?;
        if f == Some(F::Type) {
            expect = raw.order;
        }
    }
    if raw.ty.is_none() {
        return Err(EventError::MapWithoutType);
    }
    Ok(())
}

/// The elements of an array event (the legacy encoding), `n` of them with the tag, into
/// `raw`. Inlined into `event`, the decoder's hot path.
#[inline(always)]
pub(super) fn array_event<'a>(
    c: &mut Cursor<'a>,
    raw: &mut Raw<'a, '_>,
    n: usize,
) -> Result<(), EventError> {
    let Some(Token::Str(tag)) = (n > 0).then(|| c.token()).transpose().map_err(malformed)? else {
        return Err(EventError::ArrayWithoutTag);
    };
    raw.ty = Some(tag);
    (raw.fields, raw.order) = type_of(tag);
    let order = raw.order;
    // Places past the upstream fields are kvlink's extension: an element of another type
    // there is some other publisher's field, kept as a positional extra.
    let upstream = match tag {
        b"BlockStored" => STORED_LEGACY_UPSTREAM,
        b"BlockRemoved" => REMOVED_LEGACY_UPSTREAM,
        _ => order.len(),
    };
    for i in 1..n {
        let start = c.pos();
        match order.get(i - 1) {
            Some(&f) if i > upstream => {
                if field(c, raw, Some(f), || FieldKey::Position(i)).is_err() {
                    c.rewind(start);
                    let value = c.value(0).map_err(malformed)?;
                    raw.stored.extra.push(ExtraField {
                        key: FieldKey::Position(i),
                        value,
                    });
                }
            }
            Some(&f) => field(c, raw, Some(f), || FieldKey::Position(i))?,
            None => {
                // A nil between kept elements is padding the encoder writes again; a trailing
                // one is kept, so that the array keeps its length.
                let value = c.value(0).map_err(malformed)?;
                if !value.is_nil() || i + 1 == n {
                    raw.stored.extra.push(ExtraField {
                        key: FieldKey::Position(i),
                        value,
                    });
                }
            }
        }
    }
    Ok(())
}

/// The event `raw` read, by its type: `None` for a BlockStored (it stays in its slot, checked
/// that its tokens fit its blocks), else the event to put in the slot.
#[inline(always)]
pub(super) fn typed(raw: Raw<'_, '_>) -> Result<Option<KvEvent>, EventError> {
    let s = raw.stored;
    Ok(Some(match raw.ty.unwrap_or_default() {
        b"BlockStored" => {
            let capacity = s.block_hashes.len() as u64 * u64::from(s.block_size);
            if s.block_size > 0 && s.token_ids.len() as u64 > capacity {
                return Err(EventError::TokensExceedBlocks {
                    tokens: s.token_ids.len(),
                    blocks: s.block_hashes.len(),
                    block_size: s.block_size,
                });
            }
            return Ok(None);
        }
        b"BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: take(&mut s.block_hashes),
            medium: s.medium.take(),
            group_idx: s.group_idx,
            locality: s.locality.take(),
            ownership: s.ownership.take(),
            extra: take(&mut s.extra),
        }),
        b"AllBlocksCleared" => KvEvent::AllBlocksCleared {
            medium: s.medium.take(),
            extra: take(&mut s.extra),
        },
        b"BlockTransferred" => KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: take(&mut s.block_hashes),
            from_medium: raw.from_medium,
            to_medium: raw.to_medium,
            group_idx: s.group_idx,
            extra: take(&mut s.extra),
        }),
        other => {
            return Err(EventError::UnknownType(
                String::from_utf8_lossy(other).into_owned(),
            ))
        }
    }))
}
