//! KV-event throughput, in block entries (one hash of a BlockStored) per second: encoding,
//! decoding (afresh, and into the last batch's allocations), and end to end from
//! `Publisher::publish` to `Subscriber::next` over tcp loopback.

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvlink_events::{
    decode_batch, decode_batch_reusing, encode_batch, Encoding, EventBatch, KvEvent, PageHash,
    PageSplitter, Publisher, PublisherConfig, SubItem, Subscriber, SubscriberConfig,
};

/// One scheduler step: 64 requests storing 4,096 tokens each, split into 16-token pages. Token
/// ids spread over a 150,000-token vocabulary, as real ones do (their msgpack forms vary).
fn batch() -> EventBatch {
    let s = PageSplitter::new(16, PageHash::VllmU64);
    let mut events = Vec::new();
    for r in 0..64u32 {
        let tokens: Vec<u32> = (0..4096)
            .map(|t| (t * 7919 + r * 104_729) % 150_000)
            .collect();
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
        // Each batch decoded into the last one's allocations (`Subscriber::recycle`).
        let mut spare = EventBatch::default();
        g.bench_function(format!("decode_reusing_{enc:?}"), |bn| {
            bn.iter(|| {
                let d = decode_batch_reusing(black_box(&buf), std::mem::take(&mut spare)).unwrap();
                spare = d.batch;
            })
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

/// One scheduler step of fixed-size pages: 256 BlockStored events of one 16-token page each
/// (what kvlink's page splitter emits, and what `kvlink-events publish --synthetic` and
/// tools/events-reference-publisher.py send by default).
fn page_batch() -> EventBatch {
    let s = PageSplitter::new(16, PageHash::VllmU64);
    let tokens: Vec<u32> = (0..256 * 16).map(|t| (t * 7919) % 150_000).collect();
    EventBatch {
        ts: 1.0,
        events: s
            .split(None, &tokens, 0, Some("GPU"))
            .events
            .into_iter()
            .map(KvEvent::BlockStored)
            .collect(),
        dp_rank: Some(0),
    }
}

fn end_to_end(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let b = page_batch();
    let mut g = c.benchmark_group("events_e2e");
    g.throughput(Throughput::Elements(b.events.len() as u64));
    g.sample_size(10);
    for enc in [Encoding::Current, Encoding::Legacy] {
        let p = Publisher::start(PublisherConfig {
            endpoint: "tcp://*:0".into(),
            encoding: enc,
            ..Default::default()
        })
        .unwrap();
        let ep = p.endpoint().replace("0.0.0.0", "127.0.0.1");
        let mut sub = rt
            .block_on(Subscriber::connect(SubscriberConfig::new(ep)))
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        g.bench_function(format!("publish_to_receive_{enc:?}"), |bn| {
            bn.iter_custom(|iters| {
                let t = Instant::now();
                let mut got = 0;
                // Published from another thread while this one receives: a subscriber that
                // read nothing until everything was published would fill its queue at the
                // publisher (bounded, as a ZeroMQ high-water mark) and lose batches.
                std::thread::scope(|s| {
                    s.spawn(|| {
                        for _ in 0..iters {
                            p.publish_timeout(b.clone(), Duration::from_secs(10))
                                .unwrap();
                        }
                    });
                    rt.block_on(async {
                        while got < iters {
                            match sub.next(Duration::from_secs(10)).await.unwrap() {
                                Some(SubItem::Batch { batch, .. }) => {
                                    sub.recycle(black_box(batch));
                                    got += 1;
                                }
                                Some(other) => {
                                    panic!("end-to-end bench: {other:?} instead of a batch")
                                }
                                None => panic!("end-to-end bench: a batch never arrived"),
                            }
                        }
                    });
                });
                t.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench, end_to_end);
criterion_main!(benches);
