//! KV-event encode/decode throughput, in block entries (one hash of a BlockStored) per second.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvlink::events::{
    decode_batch, encode_batch, Encoding, EventBatch, KvEvent, PageHash, PageSplitter,
};

/// One scheduler step: 64 requests storing 4,096 tokens each, split into 16-token pages.
fn batch() -> EventBatch {
    let s = PageSplitter::new(16, PageHash::VllmU64);
    let mut events = Vec::new();
    for r in 0..64u32 {
        let tokens: Vec<u32> = (0..4096).map(|t| t ^ r).collect();
        events.extend(
            s.split(None, &tokens, 0, Some("GPU"))
                .events
                .into_iter()
                .map(KvEvent::BlockStored),
        );
    }
    EventBatch {
        ts: 1.0,
        events,
        dp_rank: Some(0),
    }
}

fn bench(c: &mut Criterion) {
    let b = batch();
    let entries = b.events.len() as u64;
    let mut g = c.benchmark_group("events");
    g.throughput(Throughput::Elements(entries));
    for enc in [Encoding::Current, Encoding::Legacy] {
        let mut buf = Vec::new();
        g.bench_function(format!("encode_{enc:?}"), |bn| {
            bn.iter(|| encode_batch(black_box(&b), enc, &mut buf))
        });
        encode_batch(&b, enc, &mut buf);
        g.bench_function(format!("decode_{enc:?}"), |bn| {
            bn.iter(|| decode_batch(black_box(&buf)).unwrap())
        });
    }
    g.throughput(Throughput::Elements(4096 / 16));
    let tokens: Vec<u32> = (0..4096).collect();
    g.bench_function("split_4096_tokens_sha256", |bn| {
        let s = PageSplitter::new(16, PageHash::SglangI64);
        bn.iter(|| s.split(None, black_box(&tokens), 0, None))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
