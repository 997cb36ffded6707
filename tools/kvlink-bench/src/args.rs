//! Command-line options of kvlink-bench: the usage text, the modes, where the caches live,
//! block-id patterns, model presets and custom layouts, and what the options derive.

mod check;

use std::str::FromStr;
use std::time::Duration;

use kvlink::{EngineConfig, GpuApi, ModelShape, TransportChoice};

pub(crate) const USAGE: &str = "\
usage: kvlink-bench [loopback|serve|read|sweep|dump] [options]

modes:
  loopback            prefill and decode engines in this process (default)
  serve               run a prefill engine and wait for readers (use with `read` elsewhere)
  read                read from a `serve` engine given by --peer
  sweep               loopback runs over the values of one parameter; writes a table,
                      <out>.csv and a chart <out>.png (bandwidth against the parameter)
  dump                write the byte ranges a loopback run of these options reads to
                      --out (for other engines to read the same pieces: bench-peers.sh)

options:
  --transport T       network (RDMA when both engines have it, else TCP), auto
                      (the same-host path first when the engines share a host
                      and their memory can be shared), tcp, rdma or local
                      (same host only)                                  [network]
  --preset NAME       llama-3-8b, llama-3-70b-tp8, deepseek-v3-mla, qwen2.5-7b, or the
                      hybrid nemotron-h-8b (4 attention layers, 24 Mamba-2 state layers:
                      each request one state page per state layer beside its attention
                      blocks; loopback also runs llama-3-8b for comparison) [llama-3-8b]
  --block-bytes N     custom layout instead of a preset: blocks of N bytes (K/M suffixes),
                      one token per block, so --tokens counts blocks
  --tensors N         custom layout: tensors per block                   [1]
  --block-tokens N    tokens per block of a preset                      [16]
  --prefill-block-tokens N
                      loopback: the prefill's tokens per block, when it differs from
                      --block-tokens (one a multiple of the other): each prefill block
                      is read token range by token range       [--block-tokens]
  --tokens N          tokens per request                                [4096]
  --pattern P         block ids: random, contiguous or fragmented       [random]
  --requests N        measured requests                                 [16]
  --warmup N          requests before measuring                         [2]
  --concurrency N     requests in flight                                [2]
  --streams N         TCP streams per peer                              [4]
  --qps N             RDMA queue pairs per peer                         [4]
  --rdma-device NAME  RDMA device (first active one by default); repeat it, or give
                      a comma-separated list, to stripe over several; `all` for
                      every active device on this NUMA node
  --batch-bytes N     bytes per pipelined TCP request (K/M suffixes)    [4M]
  --spin-us N         microseconds a waiting caller polls while reads are in
                      flight before it sleeps (0: never)                [the engine's, 50]
  --idle-secs N       loopback: after the run, the CPU both engines use over N s
                      idle with their session open, callers waiting     [off]
  --blocks N          blocks per tensor in each cache        [2 x blocks/request x concurrency]
  --memory M          where both KV caches live: host, cuda, hip, or emulated (host memory
                      taking the GPU staging paths; for testing without a GPU)   [host]
  --gpu N             GPU ordinal for --memory cuda or hip                [0]
  --verify            check every byte at the destination (slows the run)
  --json              print one JSON object instead of text
  --seed N            fill pattern of the prefill cache                 [1]
  --listen ADDR       serve: handshake listen address                   [0.0.0.0:7400]
  --advertise HOST    serve: address readers should use                 [127.0.0.1]
  --peer ADDR         read: the serve engine's handshake address; with --prefill-tp N,
                      the N serve ranks' addresses, comma-separated, in rank order
  --prefill-tp N      TP size of the prefill: loopback runs every rank of both sides in this
                      process; `serve` is rank --tp-rank of it               [1]
  --decode-tp M       TP size of the decode (N and M multiples of one another): each decode
                      rank reads its share of the KV heads of one prefill rank, or gathers
                      several prefill ranks; `read` is rank --tp-rank of it  [1]
  --tp-rank R         serve / read: this process's rank in its TP group      [0]
  --head-layout L     per-head blocks: nhd (token-major) or hnd (head-major) [nhd]
  --groups G          block groups (layers dealt round-robin, block ids per group, as vLLM's
                      hybrid KV cache groups)                                [1]
  --param P           sweep: message-bytes, tokens, concurrency, qps or streams
  --values LIST       sweep: comma-separated values (K/M suffixes for sizes)
  --out PREFIX        sweep: output files <PREFIX>.csv and <PREFIX>.png; dump: the file
                                                                         [kvlink-sweep]
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Loopback,
    Serve,
    Read,
    Sweep,
    Dump,
}

/// Where the benchmark's KV caches live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    Host,
    Gpu(GpuApi),
    Emulated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    Random,
    Contiguous,
    Fragmented,
}

#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) mode: Mode,
    pub(crate) shape: ModelShape,
    pub(crate) tokens: u32,
    pub(crate) pattern: Pattern,
    pub(crate) requests: usize,
    pub(crate) warmup: usize,
    pub(crate) concurrency: usize,
    pub(crate) streams: u16,
    pub(crate) batch_bytes: u64,
    /// The engines' `spin` (`None`: theirs).
    pub(crate) spin_us: Option<u64>,
    /// Seconds to measure the idle engines' CPU after a loopback run.
    pub(crate) idle_secs: Option<u64>,
    pub(crate) blocks: Option<u32>,
    pub(crate) verify: bool,
    pub(crate) json: bool,
    pub(crate) seed: u64,
    pub(crate) listen: String,
    pub(crate) advertise: String,
    pub(crate) peer: Option<String>,
    pub(crate) transport: TransportChoice,
    pub(crate) qps: u16,
    pub(crate) rdma_device: Option<String>,
    pub(crate) param: Option<String>,
    pub(crate) values: Vec<u64>,
    pub(crate) out: String,
    pub(crate) memory: Memory,
    pub(crate) gpu: i32,
    pub(crate) prefill_tp: u32,
    pub(crate) decode_tp: u32,
    pub(crate) tp_rank: u32,
    pub(crate) head_major: bool,
    pub(crate) groups: u32,
    /// Whether --prefill-tp, --decode-tp or --groups was given (the multi-rank driver runs).
    pub(crate) tp_given: bool,
    /// The prefill's tokens per block when they differ from the decode's (`shape`'s).
    pub(crate) prefill_block_tokens: Option<u32>,
    /// A hybrid preset's per-request state (its attention layers are `shape`).
    pub(crate) state: Option<StateShape>,
}

/// The state layers of a hybrid model (Mamba-2's conv and SSM state): each request holds one
/// page per state layer, in a block group of their own beside the attention blocks, as vLLM's
/// hybrid KV cache groups hold them (one page size for both groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StateShape {
    /// State layers.
    pub(crate) layers: u32,
    /// Bytes of one layer's state at TP 1 (each rank holds an equal share of it).
    pub(crate) page_bytes: u64,
}

/// Nemotron-H 8B: 52 layers, of which 4 attention (8 KV heads of 128, bf16) and 24 Mamba-2
/// (128 heads of 64, state 128, 8 groups, conv kernel 4): a state page of 3 x 10,240 bf16 conv
/// values and 128 x 64 x 128 float32 SSM values. The attention blocks hold 1,040 tokens, the
/// smallest multiple of 16 whose K and V pages are as large as a state page (vLLM raises the
/// attention block size of a hybrid model the same way to give both groups one page size).
pub(crate) const NEMOTRON_H_8B: (ModelShape, StateShape) = (
    ModelShape {
        name: "nemotron-h-8b",
        layers: 4,
        tensors_per_layer: 2,
        bytes_per_token: 8 * 128 * 2,
        kv_heads: 8,
        tokens_per_block: 1040,
        dtype: "bf16",
    },
    StateShape {
        layers: 24,
        page_bytes: 3 * 10_240 * 2 + 128 * 64 * 128 * 4,
    },
);

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

pub(crate) fn parse_args() -> Result<Args, String> {
    parse_from(std::env::args_os().skip(1))
}

impl Default for Args {
    fn default() -> Self {
        Args {
            mode: Mode::Loopback,
            shape: ModelShape::LLAMA3_8B,
            tokens: 4096,
            pattern: Pattern::Random,
            requests: 16,
            warmup: 2,
            concurrency: 2,
            streams: 4,
            batch_bytes: 4 << 20,
            spin_us: None,
            idle_secs: None,
            blocks: None,
            verify: false,
            json: false,
            seed: 1,
            listen: "0.0.0.0:7400".into(),
            advertise: "127.0.0.1".into(),
            peer: None,
            transport: TransportChoice::Network,
            qps: 4,
            rdma_device: None,
            param: None,
            values: Vec::new(),
            out: "kvlink-sweep".into(),
            memory: Memory::Host,
            gpu: 0,
            prefill_tp: 1,
            decode_tp: 1,
            tp_rank: 0,
            head_major: false,
            groups: 1,
            tp_given: false,
            prefill_block_tokens: None,
            state: None,
        }
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "loopback" => Mode::Loopback,
            "serve" => Mode::Serve,
            "read" => Mode::Read,
            "sweep" => Mode::Sweep,
            "dump" => Mode::Dump,
            other => return Err(format!("unknown mode {other:?}")),
        })
    }
}

impl FromStr for Memory {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "host" => Memory::Host,
            "cuda" => Memory::Gpu(GpuApi::Cuda),
            "hip" => Memory::Gpu(GpuApi::Hip),
            "emulated" => Memory::Emulated,
            m => return Err(format!("unknown memory {m:?} (host, cuda, hip, emulated)")),
        })
    }
}

impl FromStr for Pattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "random" => Pattern::Random,
            "contiguous" => Pattern::Contiguous,
            "fragmented" => Pattern::Fragmented,
            p => {
                return Err(format!(
                    "unknown pattern {p:?} (random, contiguous, fragmented)"
                ))
            }
        })
    }
}

/// Options that shape the cache together, applied once every option is read.
#[derive(Default)]
struct ShapeOptions {
    block_tokens: Option<u32>,
    block_bytes: Option<u64>,
    tensors: Option<u32>,
}

/// An option's value as a string.
fn val(p: &mut lexopt::Parser) -> Result<String, String> {
    use lexopt::ValueExt;
    p.value()
        .map_err(|e| e.to_string())?
        .string()
        .map_err(|_| "an option value is not valid UTF-8".to_string())
}

/// An option's value parsed; a bad one is named by its option (`--flag: why`).
fn num<T: FromStr>(p: &mut lexopt::Parser, flag: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    val(p)?.parse().map_err(|e| format!("--{flag}: {e}"))
}

/// [`parse_args`] of these arguments (the program name left out).
pub(crate) fn parse_from(
    args: impl IntoIterator<Item = impl Into<std::ffi::OsString>>,
) -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut a = Args::default();
    let mut shape = ShapeOptions::default();
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Value(v) => a.mode = v.to_string_lossy().parse()?,
            Short('h') | Long("help") => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            Long(flag) => {
                let flag = flag.to_string();
                let taken = workload_option(&mut a, &mut shape, &flag, &mut p)?
                    || engine_option(&mut a, &flag, &mut p)?
                    || output_option(&mut a, &flag, &mut p)?;
                if !taken {
                    return Err(Long(&flag).unexpected().to_string());
                }
            }
            _ => return Err(arg.unexpected().to_string()),
        }
    }
    check::settle_shape(&mut a, shape)?;
    check::check(&a)?;
    Ok(a)
}

/// The model, the requests and their blocks: whether `flag` is one of these (then read).
fn workload_option(
    a: &mut Args,
    shape: &mut ShapeOptions,
    flag: &str,
    p: &mut lexopt::Parser,
) -> Result<bool, String> {
    match flag {
        "preset" => {
            let name = val(p)?;
            a.state = None;
            if name == NEMOTRON_H_8B.0.name {
                (a.shape, a.state) = (NEMOTRON_H_8B.0, Some(NEMOTRON_H_8B.1));
                return Ok(true);
            }
            a.shape = ModelShape::preset(&name).ok_or_else(|| {
                let mut names: Vec<&str> = ModelShape::PRESETS.iter().map(|p| p.name).collect();
                names.push(NEMOTRON_H_8B.0.name);
                format!("unknown preset {name:?}; known: {}", names.join(", "))
            })?;
        }
        "tokens" => a.tokens = num(p, flag)?,
        "pattern" => a.pattern = val(p)?.parse()?,
        "requests" => a.requests = num(p, flag)?,
        "warmup" => a.warmup = num(p, flag)?,
        "concurrency" => a.concurrency = num(p, flag)?,
        "blocks" => a.blocks = Some(num(p, flag)?),
        "seed" => a.seed = num(p, flag)?,
        "verify" => a.verify = true,
        "groups" => {
            a.tp_given = true;
            a.groups = num(p, flag)?;
        }
        "head-layout" => {
            a.head_major = match val(p)?.as_str() {
                "nhd" => false,
                "hnd" => true,
                l => return Err(format!("unknown head layout {l:?} (nhd, hnd)")),
            }
        }
        "block-bytes" => shape.block_bytes = Some(parse_size(&val(p)?)?),
        "tensors" => shape.tensors = Some(num(p, flag)?),
        "block-tokens" => shape.block_tokens = Some(num(p, flag)?),
        "prefill-block-tokens" => a.prefill_block_tokens = Some(num(p, flag)?),
        _ => return Ok(false),
    }
    Ok(true)
}

/// The engines, their memory and their TP ranks: whether `flag` is one of these (then read).
fn engine_option(a: &mut Args, flag: &str, p: &mut lexopt::Parser) -> Result<bool, String> {
    match flag {
        "transport" => a.transport = val(p)?.parse().map_err(|e: kvlink::Error| e.to_string())?,
        "memory" => a.memory = val(p)?.parse()?,
        "gpu" => a.gpu = num(p, flag)?,
        "qps" => a.qps = num(p, flag)?,
        // Repeated: several devices, striped.
        "rdma-device" => {
            let d = val(p)?;
            a.rdma_device = Some(match a.rdma_device.take() {
                Some(prev) => format!("{prev},{d}"),
                None => d,
            });
        }
        "streams" => a.streams = num(p, flag)?,
        "batch-bytes" => a.batch_bytes = parse_size(&val(p)?)?,
        "spin-us" => a.spin_us = Some(num(p, flag)?),
        "idle-secs" => a.idle_secs = Some(num(p, flag)?),
        "listen" => a.listen = val(p)?,
        "advertise" => a.advertise = val(p)?,
        "peer" => a.peer = Some(val(p)?),
        "prefill-tp" => {
            a.tp_given = true;
            a.prefill_tp = num(p, flag)?;
        }
        "decode-tp" => {
            a.tp_given = true;
            a.decode_tp = num(p, flag)?;
        }
        "tp-rank" => a.tp_rank = num(p, flag)?,
        _ => return Ok(false),
    }
    Ok(true)
}

/// What the run writes: whether `flag` is one of these (then read).
fn output_option(a: &mut Args, flag: &str, p: &mut lexopt::Parser) -> Result<bool, String> {
    match flag {
        "param" => a.param = Some(val(p)?),
        "values" => {
            a.values = val(p)?
                .split(',')
                .map(|v| parse_size(v.trim()))
                .collect::<Result<_, _>>()?
        }
        "out" => a.out = val(p)?,
        "json" => a.json = true,
        _ => return Ok(false),
    }
    Ok(true)
}

impl Args {
    /// The prefill's tokens per block.
    pub(crate) fn prefill_tokens(&self) -> u32 {
        self.prefill_block_tokens
            .unwrap_or(self.shape.tokens_per_block)
    }

    /// Prefill blocks per request.
    pub(crate) fn prefill_blocks_per_request(&self) -> u32 {
        self.tokens.div_ceil(self.prefill_tokens())
    }

    /// Whether the run takes the TP-group driver (TP sizes or block groups given, even 1).
    pub(crate) fn tp_run(&self) -> bool {
        self.tp_given
            || self.prefill_tp != 1
            || self.decode_tp != 1
            || self.groups != 1
            || self.state.is_some()
    }

    pub(crate) fn blocks_per_request(&self) -> u32 {
        self.tokens.div_ceil(self.shape.tokens_per_block)
    }

    pub(crate) fn cache_blocks(&self) -> u32 {
        self.blocks
            .unwrap_or(self.blocks_per_request() * 2 * self.concurrency as u32)
    }

    pub(crate) fn config(&self, listen: &str, advertise: Option<String>) -> EngineConfig {
        EngineConfig::default().with(|c| {
            c.tp_rank = self.tp_rank;
            c.tp_size = if self.mode == Mode::Serve {
                self.prefill_tp
            } else {
                self.decode_tp
            };
            c.listen = listen.to_string();
            c.advertise_host = advertise;
            c.tcp_streams = self.streams;
            c.batch_bytes = self.batch_bytes;
            if let Some(us) = self.spin_us {
                c.spin = Duration::from_micros(us);
            }
            c.request_timeout = Duration::from_secs(120);
            c.transport = self.transport;
            c.rdma = kvlink::RdmaSettings {
                device: self.rdma_device.clone(),
                qps: self.qps,
                ..Default::default()
            };
        })
    }
}

#[cfg(test)]
mod tests;
