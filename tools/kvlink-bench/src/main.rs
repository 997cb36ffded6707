//! kvlink-bench: moves KV-cache blocks between two kvlink engines and reports what the link
//! delivers for a model's layout.
//!
//! ```text
//! kvlink-bench                      # loopback: prefill and decode engines in this process
//! kvlink-bench loopback [options]
//! kvlink-bench serve --listen 0.0.0.0:7400 --advertise 10.0.0.5 [options]   # prefill side
//! kvlink-bench read --peer 10.0.0.5:7400 [options]                          # decode side
//! ```

mod chart;

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvlink::{
    BlockId, Engine, EngineConfig, GpuApi, KvLayout, ModelShape, Region, RequestId, TransferReport,
    TransportChoice,
};

const USAGE: &str = "\
usage: kvlink-bench [loopback|serve|read|sweep] [options]

modes:
  loopback            prefill and decode engines in this process (default)
  serve               run a prefill engine and wait for readers (use with `read` elsewhere)
  read                read from a `serve` engine given by --peer
  sweep               loopback runs over the values of one parameter; writes a table,
                      <out>.csv and a chart <out>.png (bandwidth against the parameter)

options:
  --transport T       auto (RDMA when both engines have it), tcp or rdma [auto]
  --preset NAME       llama-3-8b, llama-3-70b-tp8, deepseek-v3-mla, qwen2.5-7b [llama-3-8b]
  --block-bytes N     custom layout instead of a preset: blocks of N bytes (K/M suffixes),
                      one token per block, so --tokens counts blocks
  --tensors N         custom layout: tensors per block                   [1]
  --block-tokens N    tokens per block of a preset                      [16]
  --tokens N          tokens per request                                [4096]
  --pattern P         block ids: random, contiguous or fragmented       [random]
  --requests N        measured requests                                 [16]
  --warmup N          requests before measuring                         [2]
  --concurrency N     requests in flight                                [2]
  --streams N         TCP streams per peer                              [4]
  --qps N             RDMA queue pairs per peer                         [4]
  --rdma-device NAME  RDMA device (first active one by default)
  --batch-bytes N     bytes per pipelined TCP request (K/M suffixes)    [4M]
  --blocks N          blocks per tensor in each cache        [2 x blocks/request x concurrency]
  --memory M          where both KV caches live: host, cuda, hip, or emulated (host memory
                      taking the GPU staging paths; for testing without a GPU)   [host]
  --gpu N             GPU ordinal for --memory cuda or hip                [0]
  --verify            check every byte at the destination (slows the run)
  --json              print one JSON object instead of text
  --seed N            fill pattern of the prefill cache                 [1]
  --listen ADDR       serve: handshake listen address                   [0.0.0.0:7400]
  --advertise HOST    serve: address readers should use                 [127.0.0.1]
  --peer ADDR         read: the serve engine's handshake address
  --param P           sweep: message-bytes, tokens, concurrency, qps or streams
  --values LIST       sweep: comma-separated values (K/M suffixes for sizes)
  --out PREFIX        sweep: output files <PREFIX>.csv and <PREFIX>.png    [kvlink-sweep]
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Loopback,
    Serve,
    Read,
    Sweep,
}

/// Where the benchmark's KV caches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Memory {
    Host,
    Gpu(GpuApi),
    Emulated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pattern {
    Random,
    Contiguous,
    Fragmented,
}

#[derive(Debug, Clone)]
struct Args {
    mode: Mode,
    shape: ModelShape,
    tokens: u32,
    pattern: Pattern,
    requests: usize,
    warmup: usize,
    concurrency: usize,
    streams: u16,
    batch_bytes: u64,
    blocks: Option<u32>,
    verify: bool,
    json: bool,
    seed: u64,
    listen: String,
    advertise: String,
    peer: Option<String>,
    transport: TransportChoice,
    qps: u16,
    rdma_device: Option<String>,
    param: Option<String>,
    values: Vec<u64>,
    out: String,
    memory: Memory,
    gpu: i32,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.trim().to_ascii_uppercase() {
        t if t.ends_with("KIB") || t.ends_with('K') => (
            t.trim_end_matches("KIB").trim_end_matches('K').to_string(),
            1 << 10,
        ),
        t if t.ends_with("MIB") || t.ends_with('M') => (
            t.trim_end_matches("MIB").trim_end_matches('M').to_string(),
            1 << 20,
        ),
        t if t.ends_with("GIB") || t.ends_with('G') => (
            t.trim_end_matches("GIB").trim_end_matches('G').to_string(),
            1 << 30,
        ),
        t => (t, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|e| format!("size {s:?}: {e}"))
}

fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut a = Args {
        mode: Mode::Loopback,
        shape: ModelShape::LLAMA3_8B,
        tokens: 4096,
        pattern: Pattern::Random,
        requests: 16,
        warmup: 2,
        concurrency: 2,
        streams: 4,
        batch_bytes: 4 << 20,
        blocks: None,
        verify: false,
        json: false,
        seed: 1,
        listen: "0.0.0.0:7400".into(),
        advertise: "127.0.0.1".into(),
        peer: None,
        transport: TransportChoice::Auto,
        qps: 4,
        rdma_device: None,
        param: None,
        values: Vec::new(),
        out: "kvlink-sweep".into(),
        memory: Memory::Host,
        gpu: 0,
    };
    let mut block_tokens: Option<u32> = None;
    let mut block_bytes: Option<u64> = None;
    let mut tensors: u32 = 1;
    let mut p = lexopt::Parser::from_env();
    let err = |e: lexopt::Error| e.to_string();
    let val = |p: &mut lexopt::Parser| -> Result<String, String> {
        p.value()
            .map_err(err)?
            .string()
            .map_err(|_| "an option value is not valid UTF-8".to_string())
    };
    while let Some(arg) = p.next().map_err(err)? {
        match arg {
            Value(v) => {
                a.mode = match v.to_string_lossy().as_ref() {
                    "loopback" => Mode::Loopback,
                    "serve" => Mode::Serve,
                    "read" => Mode::Read,
                    "sweep" => Mode::Sweep,
                    other => return Err(format!("unknown mode {other:?}")),
                }
            }
            Long("transport") => {
                a.transport = match val(&mut p)?.as_str() {
                    "auto" => TransportChoice::Auto,
                    "tcp" => TransportChoice::Tcp,
                    "rdma" => TransportChoice::Rdma,
                    t => return Err(format!("unknown transport {t:?} (auto, tcp, rdma)")),
                }
            }
            Long("memory") => {
                a.memory = match val(&mut p)?.as_str() {
                    "host" => Memory::Host,
                    "cuda" => Memory::Gpu(GpuApi::Cuda),
                    "hip" => Memory::Gpu(GpuApi::Hip),
                    "emulated" => Memory::Emulated,
                    m => return Err(format!("unknown memory {m:?} (host, cuda, hip, emulated)")),
                }
            }
            Long("gpu") => a.gpu = val(&mut p)?.parse().map_err(|e| format!("--gpu: {e}"))?,
            Long("block-bytes") => block_bytes = Some(parse_size(&val(&mut p)?)?),
            Long("tensors") => {
                tensors = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--tensors: {e}"))?
            }
            Long("qps") => a.qps = val(&mut p)?.parse().map_err(|e| format!("--qps: {e}"))?,
            Long("rdma-device") => a.rdma_device = Some(val(&mut p)?),
            Long("block-tokens") => {
                block_tokens = Some(
                    val(&mut p)?
                        .parse()
                        .map_err(|e| format!("--block-tokens: {e}"))?,
                )
            }
            Long("param") => a.param = Some(val(&mut p)?),
            Long("values") => {
                a.values = val(&mut p)?
                    .split(',')
                    .map(|v| parse_size(v.trim()))
                    .collect::<Result<_, _>>()?
            }
            Long("out") => a.out = val(&mut p)?,
            Long("preset") => {
                let name = val(&mut p)?;
                a.shape = ModelShape::preset(&name).ok_or_else(|| {
                    let names: Vec<&str> = ModelShape::PRESETS.iter().map(|p| p.name).collect();
                    format!("unknown preset {name:?}; known: {}", names.join(", "))
                })?;
            }
            Long("tokens") => {
                a.tokens = val(&mut p)?.parse().map_err(|e| format!("--tokens: {e}"))?
            }
            Long("pattern") => {
                a.pattern = match val(&mut p)?.as_str() {
                    "random" => Pattern::Random,
                    "contiguous" => Pattern::Contiguous,
                    "fragmented" => Pattern::Fragmented,
                    p => {
                        return Err(format!(
                            "unknown pattern {p:?} (random, contiguous, fragmented)"
                        ))
                    }
                }
            }
            Long("requests") => {
                a.requests = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--requests: {e}"))?
            }
            Long("warmup") => {
                a.warmup = val(&mut p)?.parse().map_err(|e| format!("--warmup: {e}"))?
            }
            Long("concurrency") => {
                a.concurrency = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--concurrency: {e}"))?
            }
            Long("streams") => {
                a.streams = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--streams: {e}"))?
            }
            Long("batch-bytes") => a.batch_bytes = parse_size(&val(&mut p)?)?,
            Long("blocks") => {
                a.blocks = Some(val(&mut p)?.parse().map_err(|e| format!("--blocks: {e}"))?)
            }
            Long("verify") => a.verify = true,
            Long("json") => a.json = true,
            Long("seed") => a.seed = val(&mut p)?.parse().map_err(|e| format!("--seed: {e}"))?,
            Long("listen") => a.listen = val(&mut p)?,
            Long("advertise") => a.advertise = val(&mut p)?,
            Long("peer") => a.peer = Some(val(&mut p)?),
            Short('h') | Long("help") => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(arg.unexpected().to_string()),
        }
    }
    if let Some(b) = block_bytes {
        if b == 0 || tensors == 0 {
            return Err("--block-bytes and --tensors must be at least 1".into());
        }
        a.shape = ModelShape {
            name: "custom",
            layers: tensors,
            tensors_per_layer: 1,
            bytes_per_token: b,
            tokens_per_block: 1,
            dtype: "u8",
        };
    }
    if let Some(t) = block_tokens {
        if t == 0 || block_bytes.is_some() {
            return Err(
                "--block-tokens must be at least 1 and applies to presets, not --block-bytes"
                    .into(),
            );
        }
        a.shape.tokens_per_block = t;
    }
    if a.mode == Mode::Sweep {
        match a.param.as_deref() {
            Some("message-bytes" | "tokens" | "concurrency" | "qps" | "streams") => {}
            Some(p) => return Err(format!("unknown sweep parameter {p:?}")),
            None => return Err("sweep needs --param and --values".into()),
        }
        if a.values.is_empty() || a.values.contains(&0) {
            return Err("sweep needs --values with positive numbers".into());
        }
    }
    if a.tokens == 0 || a.concurrency == 0 || a.requests == 0 {
        return Err("--tokens, --concurrency and --requests must be at least 1".into());
    }
    if a.mode == Mode::Read && a.peer.is_none() {
        return Err(
            "read needs --peer HOST:PORT (the address `kvlink-bench serve` printed)".into(),
        );
    }
    Ok(a)
}

impl Args {
    fn blocks_per_request(&self) -> u32 {
        self.tokens.div_ceil(self.shape.tokens_per_block)
    }

    fn cache_blocks(&self) -> u32 {
        self.blocks
            .unwrap_or(self.blocks_per_request() * 2 * self.concurrency as u32)
    }

    fn config(&self, listen: &str, advertise: Option<String>) -> EngineConfig {
        EngineConfig {
            listen: listen.to_string(),
            advertise_host: advertise,
            tcp_streams: self.streams,
            batch_bytes: self.batch_bytes,
            request_timeout: Duration::from_secs(120),
            transport: self.transport,
            rdma: kvlink::transport::rdma::RdmaSettings {
                device: self.rdma_device.clone(),
                qps: self.qps,
                ..Default::default()
            },
            ..EngineConfig::default()
        }
    }
}

struct Cache {
    region: std::sync::Arc<Region>,
    layout: KvLayout,
    /// Host memory behind an emulated device region (declared last: dropped after the region).
    _emulated: Option<Box<[u8]>>,
}

fn make_cache(engine: &Engine, args: &Args, blocks: u32, seed: u64) -> Result<Cache, String> {
    let shape = &args.shape;
    let bytes = shape.region_bytes(blocks);
    let mut emulated = None;
    let region = match args.memory {
        Memory::Host => engine.allocate_host(bytes, false),
        Memory::Gpu(api) => engine.allocate_device(api, args.gpu, bytes),
        Memory::Emulated => {
            let mut buf = vec![0u8; bytes as usize].into_boxed_slice();
            // SAFETY: the buffer is kept in the returned Cache, which callers drop after the
            // engine (declared after it), so it outlives the registration.
            let mem = unsafe { kvlink::ExternalMemory::new(buf.as_mut_ptr(), bytes) }
                .map_err(|e| e.to_string())?;
            let r = engine.register_emulated_device(mem);
            emulated = Some(buf);
            r
        }
    }
    .map_err(|e| e.to_string())?;
    // Fill (this also faults every page in, so the run measures transfers, not page faults).
    kvlink::verify::fill(&region, seed).map_err(|e| e.to_string())?;
    let layout = shape.layout(region.id(), blocks);
    engine
        .set_layout(layout.clone())
        .map_err(|e| e.to_string())?;
    Ok(Cache {
        region,
        layout,
        _emulated: emulated,
    })
}

/// The reference for staged runs, measured in the same run: one plain copy of the whole
/// prefill cache out of its memory into an ordinary host buffer, in 64 MiB pieces (for GPU
/// memory, the runtime's device-to-host copy).
fn copy_out_reference(region: &Region) -> Result<f64, String> {
    let mut buf = vec![0u8; (64 << 20).min(region.len() as usize)];
    buf.fill(1); // fault the pages in before timing
    let t0 = Instant::now();
    let mut off = 0;
    while off < region.len() {
        let n = (buf.len() as u64).min(region.len() - off) as usize;
        region
            .read_at(off, &mut buf[..n])
            .map_err(|e| e.to_string())?;
        off += n as u64;
    }
    Ok(region.len() as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

/// A tiny deterministic generator for block ids.
struct Rng(u64);

impl Rng {
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

/// Block ids for one request: `per` local ids inside `[base, base + span)`, `per` remote ids
/// inside `[0, remote_blocks)`.
fn pick(
    rng: &mut Rng,
    pattern: Pattern,
    per: u32,
    base: u32,
    span: u32,
    remote_blocks: u32,
) -> (Vec<BlockId>, Vec<BlockId>) {
    match pattern {
        Pattern::Contiguous => {
            let l0 = base + rng.below(span - per + 1);
            let r0 = rng.below(remote_blocks - per + 1);
            ((l0..l0 + per).collect(), (r0..r0 + per).collect())
        }
        Pattern::Random => {
            let l = rng
                .sample(span, per)
                .into_iter()
                .map(|b| b + base)
                .collect();
            (l, rng.sample(remote_blocks, per))
        }
        Pattern::Fragmented => {
            // Runs of 4 consecutive blocks at random places on both sides.
            let runs = per.div_ceil(4);
            let expand = |starts: Vec<u32>, off: u32| -> Vec<u32> {
                starts
                    .into_iter()
                    .flat_map(|s| (0..4).map(move |i| off + s * 4 + i))
                    .take(per as usize)
                    .collect()
            };
            let l = expand(rng.sample(span / 4, runs), base);
            let r = expand(rng.sample(remote_blocks / 4, runs), 0);
            (l, r)
        }
    }
}

#[derive(Default)]
struct Outcome {
    reports: Vec<TransferReport>,
    wall: Duration,
    cpu: f64,
    verified: u64,
    /// GB/s of a plain copy out of the caches' memory (staged runs only).
    reference_gbps: Option<f64>,
    /// Bytes staged out (prefill) and in (decode) during the run.
    staged: (u64, u64),
}

/// CPU time (user + system) of this process so far, in seconds, from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ticks / 100.0 // USER_HZ is 100 on Linux
}

/// The decode side of a run: its engine and cache, and the peer it reads from.
struct Reader<'a> {
    engine: &'a Engine,
    local: &'a Cache,
    remote_layout: &'a KvLayout,
    peer: &'a str,
}

/// Runs `count` requests with `concurrency` in flight against the reader's peer.
fn drive(
    args: &Args,
    rd: &Reader<'_>,
    count: usize,
    tag: &str,
    rng: &mut Rng,
) -> Result<Outcome, String> {
    let Reader {
        engine,
        local,
        remote_layout,
        peer,
    } = *rd;
    let per = args.blocks_per_request();
    let span = local.layout.num_blocks() / args.concurrency as u32;
    let remote_blocks = remote_layout.num_blocks();
    let runs = per.div_ceil(4);
    let fragmented_short =
        args.pattern == Pattern::Fragmented && (span / 4 < runs || remote_blocks / 4 < runs);
    if span < per || remote_blocks < per || fragmented_short {
        return Err(format!(
            "caches too small: {per} blocks per request, {span} local blocks per slot, {remote_blocks} remote blocks (raise --blocks)"
        ));
    }
    let mut out = Outcome::default();
    let mut free_slots: Vec<u32> = (0..args.concurrency as u32).rev().collect();
    let mut in_flight: HashMap<RequestId, (u32, Vec<BlockId>, Vec<BlockId>)> = HashMap::new();
    let mut submitted = 0;
    let t0 = Instant::now();
    let cpu0 = cpu_seconds();
    let progress = !args.json && std::io::stderr().is_terminal() && count > 1;
    let mut shown = Instant::now();
    while out.reports.len() < count {
        if progress && shown.elapsed() > Duration::from_millis(250) {
            shown = Instant::now();
            let bytes: u64 = out.reports.iter().map(|r| r.bytes).sum();
            let done = out.reports.len();
            let bar = "#".repeat(done * 30 / count) + &"-".repeat(30 - done * 30 / count);
            let _ = write!(
                std::io::stderr(),
                "\r{tag} [{bar}] {done}/{count} requests, {:.2} GB/s ",
                bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
            );
        }
        while submitted < count {
            let Some(slot) = free_slots.pop() else { break };
            let (l, r) = pick(rng, args.pattern, per, slot * span, span, remote_blocks);
            let id = RequestId::from(format!("{tag}-{submitted}"));
            engine
                .read_blocks(peer, id.clone(), &l, &r)
                .map_err(|e| e.to_string())?;
            in_flight.insert(id, (slot, l, r));
            submitted += 1;
        }
        let f = engine.wait_finished(Duration::from_secs(5));
        if let Some(fr) = f.failed.first() {
            return Err(format!("request {} failed: {}", fr.id, fr.reason));
        }
        for rep in f.reports {
            let (slot, l, r) = in_flight
                .remove(&rep.id)
                .ok_or("unknown request finished")?;
            if args.verify {
                out.verified += kvlink::verify::check_blocks(
                    &local.region,
                    &local.layout,
                    remote_layout,
                    args.seed,
                    &l,
                    &r,
                )
                .map_err(|e| format!("verification failed for {}: {e}", rep.id))?;
            }
            free_slots.push(slot);
            out.reports.push(rep);
        }
    }
    out.wall = t0.elapsed();
    out.cpu = cpu_seconds() - cpu0;
    if progress {
        let _ = write!(std::io::stderr(), "\r{}\r", " ".repeat(70));
    }
    Ok(out)
}

fn fmt_bytes(b: f64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", U[i])
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn report(args: &Args, mode: &str, o: &Outcome) {
    let bytes: u64 = o.reports.iter().map(|r| r.bytes).sum();
    let segments: usize = o.reports.iter().map(|r| r.segments).sum();
    let wrs: u64 = o.reports.iter().map(|r| r.work_requests).sum();
    let n = o.reports.len().max(1);
    let per_bytes = bytes / n as u64;
    let secs = o.wall.as_secs_f64().max(1e-9);
    let gbps = bytes as f64 / secs / 1e9;
    let mut lat: Vec<Duration> = o.reports.iter().map(|r| r.elapsed).collect();
    lat.sort();
    let (p50, p99, max) = (
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or_default(),
    );
    let pieces = u64::from(args.blocks_per_request())
        * (args.shape.layers * args.shape.tensors_per_layer) as u64;
    let pattern = format!("{:?}", args.pattern).to_lowercase();
    let transport = o.reports.first().map(|r| r.transport).unwrap_or("tcp");
    if args.json {
        println!(
            "{{\"mode\":\"{mode}\",\"transport\":\"{transport}\",\"preset\":\"{}\",\"tokens\":{},\"pattern\":\"{pattern}\",\"requests\":{},\"concurrency\":{},\"streams\":{},\"qps\":{},\"batch_bytes\":{},\"bytes\":{bytes},\"seconds\":{secs:.6},\"gb_per_s\":{gbps:.4},\"bytes_per_request\":{per_bytes},\"segments_per_request\":{},\"pieces_per_request\":{pieces},\"segments_per_s\":{:.1},\"work_requests_per_s\":{:.1},\"cpu_seconds\":{:.3},\"latency_ms\":{{\"p50\":{:.3},\"p99\":{:.3},\"max\":{:.3}}},\"verified_bytes\":{},\"memory\":\"{}\",\"reference_gb_per_s\":{},\"bytes_staged_out\":{},\"bytes_staged_in\":{}}}",
            args.shape.name, args.tokens, o.reports.len(), args.concurrency, args.streams, args.qps, args.batch_bytes,
            segments / n, segments as f64 / secs, wrs as f64 / secs, o.cpu,
            p50.as_secs_f64() * 1e3, p99.as_secs_f64() * 1e3, max.as_secs_f64() * 1e3, o.verified,
            memory_name(args.memory), o.reference_gbps.map_or("null".to_string(), |r| format!("{r:.4}")),
            o.staged.0, o.staged.1
        );
        return;
    }
    println!(
        "kvlink-bench {mode}: {transport}, {} ({} tensors, {} per block per tensor), {} tokens/request ({} blocks, {}), pattern {pattern}",
        args.shape.name,
        args.shape.layers * args.shape.tensors_per_layer,
        fmt_bytes(args.shape.block_bytes() as f64),
        args.tokens,
        args.blocks_per_request(),
        fmt_bytes(per_bytes as f64),
    );
    let path = if transport == "rdma" {
        format!("{} queue pairs", args.qps)
    } else {
        format!(
            "{} streams, {} batches",
            args.streams,
            fmt_bytes(args.batch_bytes as f64)
        )
    };
    println!(
        "  bandwidth  {gbps:.2} GB/s   ({} requests, {} in {secs:.2} s, concurrency {}, {path})",
        o.reports.len(),
        fmt_bytes(bytes as f64),
        args.concurrency
    );
    println!(
        "  segments   {} per request from {pieces} block pieces ({:.2} M segments/s)",
        segments / n,
        segments as f64 / secs / 1e6
    );
    println!(
        "  requests   {} work requests per transfer request ({:.0} work requests/s)",
        wrs / n as u64,
        wrs as f64 / secs
    );
    println!(
        "  cpu        {:.2} s ({:.2} cores busy on average, {})",
        o.cpu,
        o.cpu / secs,
        if mode == "loopback" {
            "both engines"
        } else {
            "this engine"
        }
    );
    println!(
        "  latency    p50 {:.1} ms   p99 {:.1} ms   max {:.1} ms",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3
    );
    if args.memory != Memory::Host {
        let (out, inn) = o.staged;
        println!(
            "  staging    {} out, {} in, through host buffers ({transport} moves {} memory {})",
            fmt_bytes(out as f64),
            fmt_bytes(inn as f64),
            memory_name(args.memory),
            if transport == "rdma" {
                "directly"
            } else {
                "through them"
            }
        );
    }
    if let Some(r) = o.reference_gbps {
        println!(
            "  reference  {r:.2} GB/s plain copy of the prefill cache out of {} memory into a host buffer; this run: {:.2}x of it",
            memory_name(args.memory),
            gbps / r
        );
    }
    if args.verify {
        println!(
            "  verified   {} at the destination, every byte",
            fmt_bytes(o.verified as f64)
        );
    }
}

fn memory_name(m: Memory) -> String {
    match m {
        Memory::Host => "host".into(),
        Memory::Gpu(api) => api.to_string(),
        Memory::Emulated => "emulated device".into(),
    }
}

/// Two engines in this process: warm-up, then the measured requests.
fn loopback(args: &Args, rng: &mut Rng) -> Result<Outcome, String> {
    let blocks = args.cache_blocks();
    let prefill = Engine::start(args.config("127.0.0.1:0", None)).map_err(|e| e.to_string())?;
    let decode = Engine::start(args.config("127.0.0.1:0", None)).map_err(|e| e.to_string())?;
    eprintln!("kvlink-bench: {}", prefill.capabilities().summary());
    let remote = make_cache(&prefill, args, blocks, args.seed)?;
    let local = make_cache(&decode, args, blocks, !args.seed)?;
    let peer = prefill.handshake_address().to_string();
    let reference = match args.memory {
        Memory::Host => None,
        _ => Some(copy_out_reference(&remote.region)?),
    };
    let out = {
        let rd = Reader {
            engine: &decode,
            local: &local,
            remote_layout: &remote.layout,
            peer: &peer,
        };
        drive(args, &rd, args.warmup, "warmup", rng).and_then(|_| {
            let staged0 = (
                prefill.stats().bytes_staged_out,
                decode.stats().bytes_staged_in,
            );
            let mut o = drive(args, &rd, args.requests, "req", rng)?;
            o.reference_gbps = reference;
            o.staged = (
                prefill.stats().bytes_staged_out - staged0.0,
                decode.stats().bytes_staged_in - staged0.1,
            );
            Ok(o)
        })
    };
    // The engines go before the caches: emulated device memory must outlive its registration.
    drop(decode);
    drop(prefill);
    out
}

/// Loopback runs over the values of one parameter: a table on stdout, `<out>.csv` and a chart
/// `<out>.png` of bandwidth against the parameter.
fn sweep(args: &Args) -> Result<(), String> {
    let param = args.param.clone().expect("checked in parse_args");
    let mut rows = Vec::new();
    println!("| {param} | transport | GB/s | segments/request | p50 ms | p99 ms |");
    println!("|---|---|---|---|---|---|");
    for &v in &args.values {
        let mut a = args.clone();
        a.json = true; // no progress bars inside a sweep
        match param.as_str() {
            "message-bytes" => {
                a.shape = ModelShape {
                    name: "custom",
                    layers: 1,
                    tensors_per_layer: 1,
                    bytes_per_token: v,
                    tokens_per_block: 1,
                    dtype: "u8",
                };
                // About 64 MiB per request, whatever the message size.
                a.tokens = ((64u64 << 20) / v).clamp(1, 4096) as u32;
            }
            "tokens" => a.tokens = v as u32,
            "concurrency" => a.concurrency = v as usize,
            "qps" => a.qps = v as u16,
            "streams" => a.streams = v as u16,
            _ => unreachable!("checked in parse_args"),
        }
        let o = loopback(&a, &mut Rng(0x5EED ^ a.seed))?;
        let bytes: u64 = o.reports.iter().map(|r| r.bytes).sum();
        let gbps = bytes as f64 / o.wall.as_secs_f64().max(1e-9) / 1e9;
        let n = o.reports.len().max(1);
        let mut lat: Vec<Duration> = o.reports.iter().map(|r| r.elapsed).collect();
        lat.sort();
        let transport = o.reports.first().map(|r| r.transport).unwrap_or("-");
        let label = if param == "message-bytes" {
            fmt_bytes(v as f64).replace(".0 ", "")
        } else {
            v.to_string()
        };
        let segs = o.reports.iter().map(|r| r.segments).sum::<usize>() / n;
        let (p50, p99) = (
            percentile(&lat, 0.5).as_secs_f64() * 1e3,
            percentile(&lat, 0.99).as_secs_f64() * 1e3,
        );
        println!("| {label} | {transport} | {gbps:.3} | {segs} | {p50:.1} | {p99:.1} |");
        rows.push((label, v, transport, gbps, segs, p50, p99));
    }
    let mut csv = format!("{param},transport,gb_per_s,segments_per_request,p50_ms,p99_ms\n");
    for (_, v, t, g, s, p50, p99) in &rows {
        csv.push_str(&format!("{v},{t},{g:.4},{s},{p50:.3},{p99:.3}\n"));
    }
    let csv_path = format!("{}.csv", args.out);
    std::fs::write(&csv_path, csv).map_err(|e| format!("writing {csv_path}: {e}"))?;
    let transport = rows.first().map(|r| r.2).unwrap_or("tcp");
    let png = chart::line_chart(
        &format!(
            "KVLINK {} BANDWIDTH ({})",
            transport.to_uppercase(),
            if param == "message-bytes" {
                "RANDOM READS".to_string()
            } else {
                args.shape.name.to_uppercase()
            }
        ),
        &param.to_uppercase(),
        "GB/S",
        &rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
        &[chart::Series {
            name: "KVLINK".into(),
            color: [31, 119, 180],
            values: rows.iter().map(|r| r.3).collect(),
        }],
    );
    let png_path = format!("{}.png", args.out);
    std::fs::write(&png_path, png).map_err(|e| format!("writing {png_path}: {e}"))?;
    eprintln!("kvlink-bench sweep: wrote {csv_path} and {png_path}");
    Ok(())
}

fn run(args: Args) -> Result<(), String> {
    let blocks = args.cache_blocks();
    let mut rng = Rng(0x5EED ^ args.seed);
    match args.mode {
        Mode::Loopback => {
            let o = loopback(&args, &mut rng)?;
            report(&args, "loopback", &o);
        }
        Mode::Sweep => sweep(&args)?,
        Mode::Serve => {
            let engine = Engine::start(args.config(&args.listen, Some(args.advertise.clone())))
                .map_err(|e| e.to_string())?;
            let _cache = make_cache(&engine, &args, blocks, args.seed)?;
            eprintln!(
                "kvlink-bench serve: {} with {blocks} blocks per tensor, seed {}; readers use --peer {}",
                args.shape.name,
                args.seed,
                engine.handshake_address()
            );
            let mut last = engine.stats();
            loop {
                std::thread::sleep(Duration::from_secs(5));
                let s = engine.stats();
                if s != last {
                    eprintln!(
                        "served {} requests, {} ({} refused)",
                        s.data_requests_served,
                        fmt_bytes(s.bytes_served as f64),
                        s.data_requests_refused
                    );
                    last = s;
                }
            }
        }
        Mode::Read => {
            let peer = args.peer.clone().expect("checked in parse_args");
            let engine = Engine::start(args.config("0.0.0.0:0", Some(args.advertise.clone())))
                .map_err(|e| e.to_string())?;
            let local = make_cache(&engine, &args, blocks, !args.seed)?;
            let theirs = engine
                .connect(&peer, Duration::from_secs(10))
                .map_err(|e| e.to_string())?;
            let rd = Reader {
                engine: &engine,
                local: &local,
                remote_layout: &theirs.layout,
                peer: &peer,
            };
            drive(&args, &rd, args.warmup, "warmup", &mut rng)?;
            let staged0 = engine.stats().bytes_staged_in;
            let mut o = drive(&args, &rd, args.requests, "req", &mut rng)?;
            o.staged = (0, engine.stats().bytes_staged_in - staged0);
            report(&args, "read", &o);
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let level = std::env::var("KVLINK_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(tracing::Level::WARN);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvlink-bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvlink-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
