//! The service's index, split by engine into shards: each shard is an `Index` of its own with
//! a one-thread runtime of its own for its engines' subscribers (socket, decode, apply), so
//! that shards ingest side by side, each thread keeping its own tables in its own core's
//! cache. A query asks every shard and merges their answers (an engine's blocks are all in
//! its shard, so an engine's match comes whole from one of them).

use std::sync::Mutex;

use kvlink_events::{HolderKey, HolderState, Index, IndexConfig, IndexStats, Overlap};

/// One shard: its index and the runtime its engines' followers run on.
pub(crate) struct Shard {
    pub(crate) index: Mutex<Index>,
    pub(crate) runtime: tokio::runtime::Handle,
}

/// Every shard (at least one).
pub(crate) struct Shards {
    all: Vec<Shard>,
}

impl Shards {
    /// `n` shards (at least one) holding `max_blocks` blocks between them, and their runtimes
    /// (the caller stops them).
    pub(crate) fn new(
        n: usize,
        max_blocks: usize,
    ) -> Result<(Shards, Vec<tokio::runtime::Runtime>), String> {
        let n = n.max(1);
        let mut runtimes = Vec::with_capacity(n);
        let all = (0..n)
            .map(|i| {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name(format!("index-shard-{i}"))
                    .enable_all()
                    .build()
                    .map_err(|e| format!("runtime: {e}"))?;
                let config = IndexConfig {
                    max_blocks: max_blocks.div_ceil(n),
                    ..IndexConfig::default()
                };
                let shard = Shard {
                    index: Mutex::new(Index::new(config)),
                    runtime: runtime.handle().clone(),
                };
                runtimes.push(runtime);
                Ok(shard)
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok((Shards { all }, runtimes))
    }

    /// The shard engine `name` is in (the same for a name every time).
    pub(crate) fn of(&self, name: &str) -> &Shard {
        // FNV-1a: stable across runs and builds, unlike the standard hasher's seed.
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        &self.all[(h % self.all.len() as u64) as usize]
    }

    /// `ask` of every shard, merged: most blocks first, ties in holder order.
    pub(crate) fn overlap(&self, ask: impl Fn(&Index) -> Overlap) -> Overlap {
        let mut matches = Vec::new();
        for s in &self.all {
            matches.extend(ask(&s.index.lock().expect("index lock")).matches);
        }
        if self.all.len() > 1 {
            matches.sort_by(|a, b| {
                b.blocks
                    .cmp(&a.blocks)
                    .then_with(|| a.holder.cmp(&b.holder))
            });
        }
        Overlap { matches }
    }

    /// Every shard's counters, added up.
    pub(crate) fn stats(&self) -> IndexStats {
        let mut t = IndexStats::default();
        for s in &self.all {
            t += s.index.lock().expect("index lock").stats();
        }
        t
    }

    /// Every holder in use (holder order), with its state, blocks held and withheld.
    pub(crate) fn holders(&self) -> Vec<(HolderKey, HolderState, usize, usize)> {
        self.merged(Index::holders, |x| &x.0)
    }

    /// Every holder in use (holder order), with its state and its blocks' engine hashes.
    pub(crate) fn dump(&self) -> Vec<(HolderKey, HolderState, Vec<u64>)> {
        self.merged(Index::dump, |x| &x.0)
    }

    fn merged<T>(&self, each: impl Fn(&Index) -> Vec<T>, key: impl Fn(&T) -> &HolderKey) -> Vec<T> {
        let mut out = Vec::new();
        for s in &self.all {
            out.extend(each(&s.index.lock().expect("index lock")));
        }
        out.sort_by(|a, b| key(a).cmp(key(b)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlink_events::{BlockHash, BlockStored, EventBatch, KvEvent, Salt};

    /// Engine `engine` stores the first `blocks` blocks (4 tokens each) of a prompt.
    fn store(s: &Shards, engine: &str, blocks: usize) {
        let tokens: Vec<u32> = (1..=4 * blocks as u32).collect();
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: (1..=blocks as u64).map(BlockHash::U64).collect(),
                token_ids: tokens,
                block_size: 4,
                ..Default::default()
            })],
            dp_rank: None,
        };
        let mut ix = s.of(engine).index.lock().expect("index lock");
        ix.apply_batch(engine, &batch);
    }

    #[test]
    fn answers_merge_every_shard_most_blocks_first_and_counts_add_up() {
        let (s, _runtimes) = Shards::new(3, 1 << 20).expect("shards");
        let engines = ["a", "b", "c", "d", "e", "f"];
        // The engines land in more than one shard (else this tests nothing).
        let homes: std::collections::HashSet<_> = engines
            .iter()
            .map(|e| s.of(e) as *const Shard as usize)
            .collect();
        assert!(homes.len() > 1);
        for (i, e) in engines.iter().enumerate() {
            store(&s, e, i + 1);
        }
        let prompt: Vec<u32> = (1..=24).collect();
        let o = s.overlap(|ix| ix.overlap_tokens(&prompt, 4, &Salt::default()));
        let got: Vec<(&str, usize)> = o
            .matches
            .iter()
            .map(|m| (m.holder.engine.as_str(), m.blocks))
            .collect();
        let want = [("f", 6), ("e", 5), ("d", 4), ("c", 3), ("b", 2), ("a", 1)];
        assert_eq!(got, want);
        assert_eq!(s.stats().blocks, 21);
        let names: Vec<String> = s.holders().into_iter().map(|h| h.0.engine).collect();
        assert_eq!(names, engines);
        assert_eq!(s.dump().iter().map(|d| d.2.len()).sum::<usize>(), 21);
    }
}
