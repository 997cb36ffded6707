//! Planner throughput: block-to-segment mappings per second for 4,096-token requests.
//!
//! Throughput is reported in elements, one element being one (block, tensor) piece mapped to a
//! segment, so criterion's "elem/s" reads directly as mappings per second.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvlink::internal::{plan, plan_read, tensor_reads, Grant, PlanOptions};
use kvlink::{ModelShape, RegionId, TpRank};

fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, ((x >> 33) % (i as u64 + 1)) as usize);
    }
    v
}

fn bench_planner(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_4096_tokens");
    for shape in [ModelShape::DEEPSEEK_V3_MLA, ModelShape::LLAMA3_8B] {
        let blocks = 4096 / shape.tokens_per_block;
        let local = shape.layout(RegionId(1), 4 * blocks);
        let remote = shape.layout(RegionId(2), 4 * blocks);
        let pieces = u64::from(blocks) * local.tensors.len() as u64;
        g.throughput(Throughput::Elements(pieces));
        for (pattern, l, r) in [
            ("random", shuffled(4 * blocks, 1), shuffled(4 * blocks, 2)),
            (
                "contiguous",
                (0..4 * blocks).collect(),
                (0..4 * blocks).collect(),
            ),
        ] {
            let (l, r) = (&l[..blocks as usize], &r[..blocks as usize]);
            g.bench_function(format!("{}/{pattern}", shape.name), |b| {
                b.iter(|| {
                    plan(
                        &local,
                        &remote,
                        black_box(l),
                        black_box(r),
                        PlanOptions::default(),
                    )
                    .unwrap()
                })
            });
        }
    }
    g.finish();
}

/// Planning a decode rank's head slices: Llama-3-8B, prefill TP 1 read by decode rank 1 of
/// TP 2 (half the heads of every block), head-major and token-major blocks, random ids; in
/// (block, tensor) pieces per second as above (token-major blocks make 16 pieces of each).
fn bench_head_slices(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_4096_tokens_tp1_to_tp2");
    let shape = ModelShape::LLAMA3_8B;
    let blocks = 4096 / shape.tokens_per_block;
    let l = shuffled(4 * blocks, 1);
    let r = shuffled(4 * blocks, 2);
    let (l, r) = (&l[..blocks as usize], &r[..blocks as usize]);
    let ours = TpRank::new(1, 2);
    for (name, head_major) in [("hnd", true), ("nhd", false)] {
        let local = shape
            .layout_tp(RegionId(1), 4 * blocks, ours, head_major)
            .unwrap();
        let remote = shape
            .layout_tp(RegionId(2), 4 * blocks, TpRank::SOLO, head_major)
            .unwrap();
        g.throughput(Throughput::Elements(
            u64::from(blocks) * local.tensors.len() as u64,
        ));
        g.bench_function(format!("{}/{name}", shape.name), |b| {
            b.iter(|| {
                let reads = tensor_reads(&local, ours, &remote, TpRank::SOLO, 0..1).unwrap();
                plan_read(
                    &local,
                    &remote,
                    &reads,
                    &[black_box(l)],
                    &[black_box(r)],
                    PlanOptions::default(),
                )
                .unwrap()
            })
        });
    }
    g.finish();
}

/// The data server's grant check over the remote side of a planned 4,096-token request: every
/// segment a reader would send, checked against the request's grant, in pieces per second.
fn bench_grant_check(c: &mut Criterion) {
    let mut g = c.benchmark_group("grant_check_4096_tokens");
    for shape in [ModelShape::DEEPSEEK_V3_MLA, ModelShape::LLAMA3_8B] {
        let blocks = 4096 / shape.tokens_per_block;
        let local = shape.layout(RegionId(1), 4 * blocks);
        let remote = shape.layout(RegionId(2), 4 * blocks);
        let pieces = u64::from(blocks) * local.tensors.len() as u64;
        g.throughput(Throughput::Elements(pieces));
        let l = shuffled(4 * blocks, 1);
        let r = shuffled(4 * blocks, 2);
        let (l, r) = (&l[..blocks as usize], &r[..blocks as usize]);
        let p = plan(&local, &remote, l, r, PlanOptions::default()).unwrap();
        let grant = Grant::new(std::sync::Arc::new(remote.clone()), &[r]).unwrap();
        g.bench_function(format!("{}/random", shape.name), |b| {
            b.iter(|| {
                let mut c = grant.checker();
                for s in &p.segments {
                    c.check(s.remote_region, s.remote_offset, s.len).unwrap();
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_planner, bench_head_slices, bench_grant_check);
criterion_main!(benches);
