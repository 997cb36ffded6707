//! The index's apply, measured without sockets: the prefix-caching trace of
//! `tools/bench_index.py` (32 engines; each request stores one of 64 shared system prompts once
//! per engine and a suffix of its own, 8 requests per batch; an engine past 4,000 blocks removes
//! its oldest suffixes), applied batch by batch, engines taken round robin as a service would
//! get them. Prints one JSON line: the median of 5 runs (fresh index each) in ns per event and
//! per block stored, then the query p50 and p99 by tokens over 2,000 prompts.
//!
//! `cargo bench -p kvlink-events --bench index`

use std::time::Instant;

use kvlink_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, Index, IndexConfig, KvEvent, Salt,
};

const BS: usize = 16;
const ENGINES: usize = 32;
const REQUESTS: usize = 4000;
const PREFIXES: usize = 64;
const CAPACITY: usize = 4000;
const PER_BATCH: usize = 8;

/// xorshift64*: a seeded stream, the same every run.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
    fn tokens(&mut self, blocks: usize) -> Vec<u32> {
        (0..blocks * BS)
            .map(|_| 1 + self.below(150_000) as u32)
            .collect()
    }
}

/// The engine hash of a block: its tokens and its parent's (the same on every engine).
fn chain(parent: u64, toks: &[u32]) -> u64 {
    toks.iter().fold(parent ^ 0x9e37_79b9, |h, t| {
        (h ^ u64::from(*t)).wrapping_mul(0x100_0000_01b3)
    }) | 1
}

fn stored(hashes: &[u64], parent: Option<u64>, toks: &[u32]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| BlockHash::U64(*h)).collect(),
        parent_block_hash: parent.map(BlockHash::U64),
        token_ids: toks.to_vec(),
        block_size: BS as u32,
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

/// Per engine, its batches; and some prompts to query.
fn trace() -> (Vec<Vec<EventBatch>>, Vec<Vec<u32>>, usize) {
    let mut rnd = Rng(0x5eed);
    let systems: Vec<Vec<u32>> = (0..PREFIXES)
        .map(|_| {
            let n = 8 + rnd.below(25);
            rnd.tokens(n)
        })
        .collect();
    let (mut out, mut prompts, mut events) = (Vec::new(), Vec::new(), 0);
    for _ in 0..ENGINES {
        let (mut batches, mut held, mut live) = (Vec::<EventBatch>::new(), 0, Vec::new());
        let mut stored_prefix = [false; PREFIXES];
        for r in 0..REQUESTS {
            let p = rnd.below(PREFIXES);
            let n = 2 + rnd.below(23);
            let toks: Vec<u32> = systems[p].iter().copied().chain(rnd.tokens(n)).collect();
            let mut hashes = Vec::new();
            let mut parent = 0;
            for b in toks.chunks_exact(BS) {
                parent = chain(parent, b);
                hashes.push(parent);
            }
            let sys = systems[p].len() / BS;
            let mut batch = Vec::new();
            if !stored_prefix[p] {
                stored_prefix[p] = true;
                batch.push(stored(&hashes[..sys], None, &toks[..sys * BS]));
                held += sys;
            }
            batch.push(stored(
                &hashes[sys..],
                Some(hashes[sys - 1]),
                &toks[sys * BS..],
            ));
            held += hashes.len() - sys;
            live.push(hashes[sys..].to_vec());
            while held > CAPACITY && live.len() > 1 {
                let old = live.remove(0);
                held -= old.len();
                batch.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: old.iter().rev().map(|h| BlockHash::U64(*h)).collect(),
                    medium: Some("GPU".into()),
                    ..Default::default()
                }));
            }
            events += batch.len();
            match batches.last_mut() {
                Some(last) if r % PER_BATCH != 0 => last.events.extend(batch),
                _ => batches.push(EventBatch {
                    ts: 0.0,
                    events: batch,
                    dp_rank: None,
                }),
            }
            if r % 64 == 0 {
                prompts.push(toks);
            }
        }
        out.push(batches);
    }
    (out, prompts, events)
}

fn main() {
    let (engines, prompts, events) = trace();
    let names: Vec<String> = (0..ENGINES).map(|e| format!("engine-{e}")).collect();
    let blocks: usize = engines
        .iter()
        .flatten()
        .flat_map(|b| &b.events)
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len(),
            _ => 0,
        })
        .sum();
    let longest = engines.iter().map(Vec::len).max().unwrap_or(0);
    let mut runs = Vec::new();
    let mut ix = Index::new(IndexConfig::default());
    for _ in 0..5 {
        ix = Index::new(IndexConfig::default());
        let t = Instant::now();
        for i in 0..longest {
            for (e, batches) in engines.iter().enumerate() {
                if let Some(b) = batches.get(i) {
                    ix.apply_batch(&names[e], b);
                }
            }
        }
        runs.push(t.elapsed().as_nanos() as f64);
    }
    runs.sort_by(f64::total_cmp);
    let ns = runs[runs.len() / 2];
    let salt = Salt::default();
    let mut lat: Vec<f64> = prompts
        .iter()
        .cycle()
        .take(2000)
        .map(|p| {
            let t = Instant::now();
            std::hint::black_box(ix.overlap_tokens(p, BS as u32, &salt));
            t.elapsed().as_nanos() as f64 / 1e3
        })
        .collect();
    lat.sort_by(f64::total_cmp);
    println!(
        "{{\"events\": {events}, \"blocks_stored\": {blocks}, \"apply_ns_per_event\": {:.0}, \
         \"apply_ns_per_block\": {:.1}, \"query_p50_us\": {:.1}, \"query_p99_us\": {:.1}}}",
        ns / events as f64,
        ns / blocks as f64,
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
}
