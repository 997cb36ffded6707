//! Reads between a prefill and a decode of different TP sizes, all ranks in this process: each
//! prefill rank holds every request, each decode rank reads the prefill's TP group, and every
//! byte of every decode rank is checked head by head against the prefill ranks' own memory.

use std::time::Duration;

use kvlink::verify::{check_read, PrefillRank, ReadMemory};
use kvlink::{
    Engine, EngineConfig, KvLayout, ModelShape, ReadFrom, ReadRequest, Region, RegionId, RequestId,
    TpRank, TransferReport,
};

use super::{collect, init_logs, Rng};

/// One rank's engine, its KV cache region and layout.
pub struct Rank {
    pub engine: Engine,
    pub region: std::sync::Arc<Region>,
    pub layout: KvLayout,
    pub tp: TpRank,
}

/// The layout of rank `tp` of `shape` (heads declared), with odd layers in block group 1 when
/// `groups` (as a hybrid model's sliding-window layers have block ids of their own).
pub fn rank_layout(
    shape: &ModelShape,
    region: RegionId,
    blocks: u32,
    tp: TpRank,
    head_major: bool,
    groups: bool,
) -> KvLayout {
    let mut layout = shape.layout_tp(region, blocks, tp, head_major).unwrap();
    if groups {
        for (i, t) in layout.tensors.iter_mut().enumerate() {
            t.group = (i as u32 / shape.tensors_per_layer) % 2;
        }
    }
    layout
}

/// Starts rank `tp` with `blocks` blocks of `shape`, its memory filled with `seed` when given.
pub fn rank(
    shape: &ModelShape,
    tp: TpRank,
    blocks: u32,
    seed: Option<u64>,
    head_major: bool,
    groups: bool,
    config: EngineConfig,
) -> Rank {
    init_logs();
    let engine = Engine::start(config.with(|c| {
        c.tp_rank = tp.rank;
        c.tp_size = tp.size;
    }))
    .unwrap();
    let bytes = shape.region_bytes_tp(blocks, tp.size).unwrap();
    let region = engine.allocate_host(bytes, false).unwrap();
    if let Some(seed) = seed {
        kvlink::verify::fill(&region, seed).unwrap();
    }
    let layout = rank_layout(shape, region.id(), blocks, tp, head_major, groups);
    engine.set_layout(layout.clone()).unwrap();
    Rank {
        engine,
        region,
        layout,
        tp,
    }
}

/// Block ids per block group.
pub type Groups = Vec<Vec<u32>>;

/// A case of [`run`].
pub struct Case {
    pub shape: ModelShape,
    pub prefill: u32,
    pub decode: u32,
    pub head_major: bool,
    pub groups: bool,
    pub requests: usize,
    pub per: u32,
    pub blocks: u32,
    pub config: fn() -> EngineConfig,
}

/// What a run leaves for the caller to check further.
pub struct Ran {
    pub prefill: Vec<Rank>,
    pub decode: Vec<Rank>,
    pub reports: Vec<TransferReport>,
}

/// Runs `case`: every prefill rank holds each request (per block group), every decode rank
/// reads it from the prefill's TP group, all concurrently; checks every decode rank's every
/// byte, that each prefill rank saw each request finish sending exactly once, and returns the
/// engines and the decode ranks' reports.
pub fn run(case: &Case) -> Ran {
    let shape = &case.shape;
    // Ranks hold distinct bytes for their own heads; a tensor every rank holds whole (MLA's)
    // is the same on all of them, as in a real engine.
    let seed = |p: u32| {
        if shape.kv_heads == 0 {
            0xA11
        } else {
            0xB00 + u64::from(p)
        }
    };
    let prefill: Vec<Rank> = (0..case.prefill)
        .map(|p| {
            rank(
                shape,
                TpRank::new(p, case.prefill),
                case.blocks,
                Some(seed(p)),
                case.head_major,
                case.groups,
                (case.config)(),
            )
        })
        .collect();
    let decode: Vec<Rank> = (0..case.decode)
        .map(|d| {
            rank(
                shape,
                TpRank::new(d, case.decode),
                case.blocks,
                None,
                case.head_major,
                case.groups,
                (case.config)(),
            )
        })
        .collect();
    let addrs: Vec<String> = prefill
        .iter()
        .map(|r| r.engine.handshake_address().to_string())
        .collect();
    let groups = prefill[0].layout.num_groups();
    let mut rng = Rng(0x7E57 ^ u64::from(case.prefill * 16 + case.decode));
    // Per request and group: distinct random local blocks, random remote blocks.
    let reqs: Vec<(Groups, Groups)> = {
        let locals: Vec<Vec<u32>> = (0..groups).map(|_| rng.shuffled(case.blocks)).collect();
        (0..case.requests)
            .map(|i| {
                let per = case.per as usize;
                let l = (0..groups)
                    .map(|g| locals[g][i * per..(i + 1) * per].to_vec())
                    .collect();
                let r = (0..groups)
                    .map(|_| rng.shuffled(case.blocks)[..per].to_vec())
                    .collect();
                (l, r)
            })
            .collect()
    };
    // Every prefill rank holds a request under the same token, as a scheduler hands it out;
    // the reads name it.
    let token = |i: usize| 1000 + i as u64;
    for (i, (_, r)) in reqs.iter().enumerate() {
        for p in &prefill {
            let held = p
                .engine
                .hold(kvlink::HoldRequest {
                    token: Some(token(i)),
                    blocks: r.clone(),
                    ..kvlink::HoldRequest::blocks(format!("req-{i}"), &[])
                })
                .unwrap();
            assert_eq!(held, token(i));
        }
    }
    for (i, (l, r)) in reqs.iter().enumerate() {
        for d in &decode {
            d.engine
                .read(ReadRequest {
                    id: RequestId::from(format!("req-{i}")),
                    remote_id: RequestId::from(format!("req-{i}")),
                    from: ReadFrom::TpGroup(addrs.clone()),
                    local: l.clone(),
                    remote: r.clone(),
                    remote_tokens_per_block: None,
                    first_tokens: Vec::new(),
                    hold: Some(token(i)),
                })
                .unwrap();
        }
    }
    let mut reports = Vec::new();
    for d in &decode {
        let got = collect(&d.engine, Duration::from_secs(120), |f| {
            f.receiving.len() + f.failed.len() == case.requests
        });
        assert!(
            got.failed.is_empty(),
            "decode {} failed: {:?}",
            d.tp,
            got.failed
        );
        assert_eq!(got.receiving.len(), case.requests, "decode {}", d.tp);
        reports.extend(got.reports);
    }
    // Each decode rank's bytes, head by head, against the prefill ranks' memory.
    let readers: Vec<Box<ReadMemory>> = prefill
        .iter()
        .map(|p| {
            let region = p.region.clone();
            Box::new(move |id: RegionId, off: u64, out: &mut [u8]| {
                assert_eq!(id, region.id());
                region.read_at(off, out)
            }) as Box<ReadMemory>
        })
        .collect();
    let ranks: Vec<PrefillRank<'_>> = prefill
        .iter()
        .zip(&readers)
        .map(|(p, f)| PrefillRank {
            layout: &p.layout,
            tp: p.tp,
            bytes: f.as_ref(),
        })
        .collect();
    for d in &decode {
        for (l, r) in &reqs {
            let checked = check_read(&d.region, &d.layout, d.tp, &ranks, l, r)
                .unwrap_or_else(|e| panic!("decode {}: {e}", d.tp));
            let blocks: u64 = l.iter().map(|g| g.len() as u64).sum::<u64>() / groups as u64;
            assert_eq!(
                checked,
                d.layout.bytes_per_block() * blocks,
                "decode {}",
                d.tp
            );
        }
    }
    // Every prefill rank finishes sending each request once, after all its readers confirmed.
    for p in &prefill {
        let sent = collect(&p.engine, Duration::from_secs(30), |f| {
            f.sending.len() + f.failed.len() == case.requests
        });
        assert!(
            sent.failed.is_empty(),
            "prefill {}: {:?}",
            p.tp,
            sent.failed
        );
        assert_eq!(sent.sending.len(), case.requests, "prefill {}", p.tp);
        assert!(p.engine.wait_finished(Duration::from_millis(50)).is_empty());
        assert_eq!(
            p.engine.in_flight(),
            (0, 0),
            "prefill {} holds nothing",
            p.tp
        );
    }
    drop(ranks);
    Ran {
        prefill,
        decode,
        reports,
    }
}
