//! What a run moves: the KV caches (registered memory, filled and laid out as the model's
//! blocks) and the block ids of each request, drawn by pattern from a deterministic generator.

use kvlink::{BlockId, Engine, KvLayout, Region, TpRank};

use crate::args::{Args, Memory, Pattern};

pub(crate) struct Cache {
    pub(crate) region: std::sync::Arc<Region>,
    pub(crate) layout: KvLayout,
}

/// The KV cache of rank `tp` (its share of the model's KV heads, declared so that ranks of
/// other TP sizes can read it; layers dealt round-robin over `--groups` block groups), filled
/// with the pattern of `seed`.
pub(crate) fn make_cache(
    engine: &Engine,
    args: &Args,
    blocks: u32,
    seed: u64,
    tp: TpRank,
) -> Result<Cache, String> {
    make_cache_of(engine, args, &args.shape, blocks, seed, tp)
}

/// [`make_cache`] of `shape` (the prefill's, when its blocks hold other numbers of tokens).
pub(crate) fn make_cache_of(
    engine: &Engine,
    args: &Args,
    shape: &kvlink::ModelShape,
    blocks: u32,
    seed: u64,
    tp: TpRank,
) -> Result<Cache, String> {
    let attention = shape
        .region_bytes_tp(blocks, tp.size)
        .map_err(|e| e.to_string())?;
    let page = args.state.map_or(0, |s| s.page_bytes / u64::from(tp.size));
    let states = args.state.map_or(0, |s| s.layers);
    let bytes = attention + page * u64::from(blocks) * u64::from(states);
    let region = match args.memory {
        Memory::Host => engine.allocate_host(bytes, false),
        Memory::Gpu(api) => engine.allocate_device(api, args.gpu, bytes),
        // Emulated device memory the engine allocates (a memfd): the device paths of every
        // transport, the same-host path's IPC included.
        Memory::Emulated => engine.allocate_device(kvlink::GpuApi::Emulated, 0, bytes),
    }
    .map_err(|e| e.to_string())?;
    // Fill (this also faults every page in, so the run measures transfers, not page faults).
    kvlink::verify::fill(&region, seed).map_err(|e| e.to_string())?;
    let mut layout = shape
        .layout_tp(region.id(), blocks, tp, args.head_major)
        .map_err(|e| e.to_string())?;
    for (i, t) in layout.tensors.iter_mut().enumerate() {
        t.group = (i as u32 / shape.tensors_per_layer) % args.groups;
    }
    // A hybrid model's state pages: one per layer and block, read whole, in group 1.
    for layer in 0..states {
        layout.tensors.push(kvlink::TensorLayout {
            name: format!("state{layer}"),
            region: region.id(),
            offset: attention + u64::from(layer) * page * u64::from(blocks),
            block_stride: page,
            block_bytes: page,
            num_blocks: blocks,
            group: 1,
            heads: None,
            token_runs: None,
        });
    }
    engine
        .set_layout(layout.clone())
        .map_err(|e| e.to_string())?;
    Ok(Cache { region, layout })
}

/// A tiny deterministic generator for block ids.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The generator a run of fill seed `seed` draws its block ids from (runs, sweeps and
    /// `dump` alike, so that they pick the same blocks).
    pub(crate) fn for_run(seed: u64) -> Rng {
        Rng(0x5EED ^ seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = self.0;
        (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd) ^ (x >> 29)
    }

    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n.max(1))) as u32
    }

    /// `k` distinct values of `0..n`, in random order.
    fn sample(&mut self, n: u32, k: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in 0..k as usize {
            let j = i + (self.next() % (n as u64 - i as u64)) as usize;
            v.swap(i, j);
        }
        v.truncate(k as usize);
        v
    }
}

/// Block ids for one request: `per.0` local ids inside `[base, base + span)`, `per.1` remote
/// ids inside `[0, remote_blocks)` (the same count, unless the sides' blocks hold different
/// numbers of tokens).
pub(crate) fn pick(
    rng: &mut Rng,
    pattern: Pattern,
    (per_l, per_r): (u32, u32),
    base: u32,
    span: u32,
    remote_blocks: u32,
) -> (Vec<BlockId>, Vec<BlockId>) {
    match pattern {
        Pattern::Contiguous => {
            let l0 = base + rng.below(span - per_l + 1);
            let r0 = rng.below(remote_blocks - per_r + 1);
            ((l0..l0 + per_l).collect(), (r0..r0 + per_r).collect())
        }
        Pattern::Random => {
            let l = rng
                .sample(span, per_l)
                .into_iter()
                .map(|b| b + base)
                .collect();
            (l, rng.sample(remote_blocks, per_r))
        }
        Pattern::Fragmented => {
            // Runs of 4 consecutive blocks at random places on both sides.
            let expand = |starts: Vec<u32>, off: u32, per: u32| -> Vec<u32> {
                starts
                    .into_iter()
                    .flat_map(|s| (0..4).map(move |i| off + s * 4 + i))
                    .take(per as usize)
                    .collect()
            };
            let l = expand(rng.sample(span / 4, per_l.div_ceil(4)), base, per_l);
            let r = expand(rng.sample(remote_blocks / 4, per_r.div_ceil(4)), 0, per_r);
            (l, r)
        }
    }
}
