//! Completion-tracking throughput: the per-worker tracker and the TP aggregator, the two pieces
//! every request passes through on both sides.

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvlink::internal::{CompletionTracker, Grant, SendNotice};
use kvlink::{
    FailedRequest, FailureCause, Finished, RequestId, Side, TpAggregator, TransferReport,
};

const REQUESTS: usize = 4096;

fn ids() -> Vec<RequestId> {
    (0..REQUESTS)
        .map(|i| RequestId::from(format!("cmpl-{i:08x}-0")))
        .collect()
}

fn bench_tracker(c: &mut Criterion) {
    let ids = ids();
    let mut g = c.benchmark_group("tracker");
    g.throughput(Throughput::Elements(REQUESTS as u64));
    g.bench_function("recv_start_done_take", |b| {
        b.iter(|| {
            let now = Instant::now();
            let mut t = CompletionTracker::new();
            for id in &ids {
                t.start_recv(id.clone(), now).unwrap();
            }
            for id in &ids {
                t.recv_done(TransferReport {
                    id: id.clone(),
                    peer: "127.0.0.1:1".into(),
                    bytes: 1,
                    segments: 1,
                    blocks: 1,
                    work_requests: 1,
                    transport: "tcp",
                    elapsed: Duration::ZERO,
                    timeline: Default::default(),
                });
            }
            black_box(t.take_finished())
        })
    });
    g.bench_function("send_hold_notice_take", |b| {
        let layout = kvlink::ModelShape::LLAMA3_8B.layout(kvlink::RegionId(1), 64);
        let grant =
            std::sync::Arc::new(Grant::new(std::sync::Arc::new(layout), &[[1, 2, 3, 4]]).unwrap());
        let reader = kvlink::internal::Reader {
            engine: "decode".into(),
            tp: kvlink::TpRank::SOLO,
        };
        b.iter(|| {
            let now = Instant::now();
            let mut t = CompletionTracker::new();
            for id in &ids {
                t.hold_send(
                    id.clone(),
                    grant.clone(),
                    None,
                    now,
                    Duration::from_secs(480),
                    1,
                )
                .unwrap();
            }
            for id in &ids {
                t.handle_notice(id, &reader, SendNotice::Done, Some(1))
                    .unwrap();
            }
            t.poll(now);
            black_box(t.take_finished())
        })
    });
    g.finish();
}

fn bench_aggregator(c: &mut Criterion) {
    let ids = ids();
    let ranks = 8;
    let report = Finished {
        sending: ids[..REQUESTS / 2].to_vec(),
        receiving: ids[REQUESTS / 2..REQUESTS - 16].to_vec(),
        failed: ids[REQUESTS - 16..]
            .iter()
            .map(|id| FailedRequest {
                id: id.clone(),
                side: Side::Recv,
                expired: false,
                reason: "x".into(),
                cause: FailureCause::Other,
            })
            .collect(),
        reports: vec![],
    };
    let mut g = c.benchmark_group("tp_aggregator");
    // Elements: (request, rank) reports handled.
    g.throughput(Throughput::Elements((REQUESTS * ranks) as u64));
    g.bench_function("8_ranks_4096_requests", |b| {
        b.iter_batched(
            || TpAggregator::new(ranks, Duration::from_secs(60)).unwrap(),
            |mut a| {
                let now = Instant::now();
                for rank in (0..ranks).rev() {
                    a.handle_report(rank, &report, now).unwrap();
                }
                black_box(a.take_finished())
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench_tracker, bench_aggregator);
criterion_main!(benches);
