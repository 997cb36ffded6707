//! kvlink's publisher incarnation: a 64-bit id drawn when a publisher starts, carried as a
//! fourth element of each batch (`[ts, events, dp_rank, incarnation]`, msgpack uint64), where
//! consumers that read three elements (vLLM's msgspec structs, SGLang's, Dynamo's) do not look.
//! A subscriber that sees it change knows the publisher restarted, even once the new process's
//! sequence has passed the old one's (which the sequence alone cannot show).

/// msgpack's fixarray headers of 2, 3 and 4 elements, nil, and uint64.
const ARRAY2: u8 = 0x92;
const ARRAY3: u8 = 0x93;
const ARRAY4: u8 = 0x94;
const NIL: u8 = 0xc0;
const UINT64: u8 = 0xcf;

/// The incarnation a batch payload carries, if it has one (a four-element array whose last
/// element is a uint64; read from the payload's ends, without decoding it).
pub fn incarnation_of(payload: &[u8]) -> Option<u64> {
    let n = payload.len();
    if n < 10 || payload[0] != ARRAY4 || payload[n - 9] != UINT64 {
        return None;
    }
    let tail: [u8; 8] = payload[n - 8..].try_into().ok()?;
    Some(u64::from_be_bytes(tail))
}

/// Stamps `incarnation` into a batch payload in place: a two- or three-element batch gains it
/// as its fourth element (a nil DP rank before it for two), a stamped one has it replaced. Any
/// other payload is left as it is.
pub(crate) fn stamp(payload: &mut Vec<u8>, incarnation: u64) {
    match payload.first() {
        Some(&ARRAY4) if incarnation_of(payload).is_some() => {
            let n = payload.len();
            payload[n - 8..].copy_from_slice(&incarnation.to_be_bytes());
        }
        Some(&ARRAY3) => append(payload, incarnation),
        Some(&ARRAY2) => {
            payload.push(NIL);
            append(payload, incarnation);
        }
        _ => {}
    }
}

/// Whether [`stamp`] would change `payload`.
fn needs_stamp(payload: &[u8], incarnation: u64) -> bool {
    match payload.first() {
        Some(&ARRAY4) => incarnation_of(payload).is_some_and(|i| i != incarnation),
        Some(&ARRAY3) | Some(&ARRAY2) => true,
        _ => false,
    }
}

/// `payload` with `incarnation` stamped (`None`: as it is); copied only when it must change.
pub(crate) fn stamped(payload: bytes::Bytes, incarnation: Option<u64>) -> bytes::Bytes {
    match incarnation {
        Some(i) if needs_stamp(&payload, i) => {
            let mut v = payload.to_vec();
            stamp(&mut v, i);
            bytes::Bytes::from(v)
        }
        _ => payload,
    }
}

/// A fresh random 64-bit value (the standard library's per-process random keys, mixed with
/// the clock): a publisher's incarnation, an index's hashing key.
pub(crate) fn fresh_u64() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one(now)
}

fn append(payload: &mut Vec<u8>, incarnation: u64) {
    payload[0] = ARRAY4;
    payload.push(UINT64);
    payload.extend_from_slice(&incarnation.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_batch, encode_batch, Encoding, EventBatch, KvEvent};

    #[test]
    fn a_stamped_batch_decodes_as_before_and_carries_its_incarnation() {
        let b = EventBatch {
            ts: 1.5,
            events: vec![KvEvent::all_cleared(None)],
            dp_rank: Some(2),
        };
        let mut v = Vec::new();
        encode_batch(&b, Encoding::Current, &mut v);
        assert_eq!(incarnation_of(&v), None);
        assert!(needs_stamp(&v, 7));
        stamp(&mut v, 7);
        assert_eq!(incarnation_of(&v), Some(7));
        assert_eq!(
            decode_batch(&v).unwrap().batch,
            b,
            "a fourth element is ignored"
        );
        assert!(!needs_stamp(&v, 7));
        stamp(&mut v, u64::MAX);
        assert_eq!(incarnation_of(&v), Some(u64::MAX));
        // A batch of two elements gets a nil DP rank first.
        let mut two = vec![ARRAY2, 0xcb];
        two.extend_from_slice(&1.5f64.to_be_bytes());
        two.push(0x90);
        stamp(&mut two, 9);
        let d = decode_batch(&two).unwrap();
        assert_eq!((d.batch.dp_rank, incarnation_of(&two)), (None, Some(9)));
        // Anything else is left alone.
        let mut odd = vec![0x95, 1, 2, 3, 4, 5];
        stamp(&mut odd, 9);
        assert_eq!(odd, [0x95, 1, 2, 3, 4, 5]);
        assert!(!needs_stamp(&odd, 9));
    }
}
