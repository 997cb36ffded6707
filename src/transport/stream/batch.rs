//! Cutting a read into TCP batches, without I/O: consecutive ops are grouped, in order, into
//! batches of at most `max_bytes` (an op larger than that travels alone) and `max_entries` ops.
//! Each batch becomes one pipelined data request on one stream.

/// Groups `ops` in order into batches of at most `max_bytes` bytes (by `len`) and
/// `max_entries` ops; an op longer than `max_bytes` forms a batch of its own. No batch is
/// empty; concatenated, the batches are `ops`.
pub(crate) fn batches<T>(
    ops: Vec<T>,
    len: impl Fn(&T) -> u64,
    max_bytes: u64,
    max_entries: usize,
) -> Vec<Vec<T>> {
    let max_entries = max_entries.max(1);
    let mut out: Vec<Vec<T>> = Vec::new();
    let mut cur: Vec<T> = Vec::new();
    let mut cur_bytes = 0u64;
    for op in ops {
        let n = len(&op);
        let full = cur_bytes.saturating_add(n) > max_bytes || cur.len() == max_entries;
        if full && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur_bytes = cur_bytes.saturating_add(n);
        cur.push(op);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn batches_fill_up_to_the_byte_and_entry_limits() {
        let b = batches(vec![3u64, 3, 3, 10, 1, 1, 1, 1], |x| *x, 6, 3);
        assert_eq!(
            b,
            vec![vec![3, 3], vec![3], vec![10], vec![1, 1, 1], vec![1]]
        );
        assert!(batches(Vec::<u64>::new(), |x| *x, 6, 3).is_empty());
    }

    proptest! {
        #[test]
        fn batches_keep_order_and_respect_the_limits(
            ops in prop::collection::vec(1u64..5000, 0..200),
            max_bytes in 1u64..8000,
            max_entries in 1usize..20,
        ) {
            let b = batches(ops.clone(), |x| *x, max_bytes, max_entries);
            prop_assert_eq!(b.concat(), ops);
            for (i, batch) in b.iter().enumerate() {
                prop_assert!(!batch.is_empty());
                prop_assert!(batch.len() <= max_entries);
                let bytes: u64 = batch.iter().sum();
                prop_assert!(bytes <= max_bytes || batch.len() == 1);
                // Greedy: the next batch's first op did not fit into this one.
                if let Some(next) = b.get(i + 1) {
                    prop_assert!(
                        bytes + next[0] > max_bytes || batch.len() == max_entries
                    );
                }
            }
        }
    }
}
