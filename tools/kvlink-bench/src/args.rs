//! Command-line options of kvlink-bench: the usage text, the modes, where the caches live,
//! block-id patterns, model presets and custom layouts, and what the options derive.

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
  --preset NAME       llama-3-8b, llama-3-70b-tp8, deepseek-v3-mla, qwen2.5-7b [llama-3-8b]
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

pub(crate) fn parse_args() -> Result<Args, String> {
    parse_from(std::env::args_os().skip(1))
}

/// [`parse_args`] of these arguments (the program name left out).
pub(crate) fn parse_from(
    args: impl IntoIterator<Item = impl Into<std::ffi::OsString>>,
) -> Result<Args, String> {
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
    };
    let mut block_tokens: Option<u32> = None;
    let mut block_bytes: Option<u64> = None;
    let mut tensors: u32 = 1;
    let mut p = lexopt::Parser::from_args(args);
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
                    "dump" => Mode::Dump,
                    other => return Err(format!("unknown mode {other:?}")),
                }
            }
            Long("transport") => {
                a.transport = val(&mut p)?
                    .parse()
                    .map_err(|e: kvlink::Error| e.to_string())?
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
            Long("prefill-tp") => {
                a.tp_given = true;
                a.prefill_tp = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--prefill-tp: {e}"))?
            }
            Long("decode-tp") => {
                a.tp_given = true;
                a.decode_tp = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--decode-tp: {e}"))?
            }
            Long("tp-rank") => {
                a.tp_rank = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--tp-rank: {e}"))?
            }
            Long("groups") => {
                a.tp_given = true;
                a.groups = val(&mut p)?.parse().map_err(|e| format!("--groups: {e}"))?
            }
            Long("head-layout") => {
                a.head_major = match val(&mut p)?.as_str() {
                    "nhd" => false,
                    "hnd" => true,
                    l => return Err(format!("unknown head layout {l:?} (nhd, hnd)")),
                }
            }
            Long("block-bytes") => block_bytes = Some(parse_size(&val(&mut p)?)?),
            Long("tensors") => {
                tensors = val(&mut p)?
                    .parse()
                    .map_err(|e| format!("--tensors: {e}"))?
            }
            Long("qps") => a.qps = val(&mut p)?.parse().map_err(|e| format!("--qps: {e}"))?,
            // Repeated: several devices, striped.
            Long("rdma-device") => {
                let d = val(&mut p)?;
                a.rdma_device = Some(match a.rdma_device.take() {
                    Some(prev) => format!("{prev},{d}"),
                    None => d,
                });
            }
            Long("block-tokens") => {
                block_tokens = Some(
                    val(&mut p)?
                        .parse()
                        .map_err(|e| format!("--block-tokens: {e}"))?,
                )
            }
            Long("prefill-block-tokens") => {
                a.prefill_block_tokens = Some(
                    val(&mut p)?
                        .parse()
                        .map_err(|e| format!("--prefill-block-tokens: {e}"))?,
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
            kv_heads: 0,
            tokens_per_block: 1,
            dtype: "u8",
        };
    }
    kvlink::tp_sources(kvlink::TpRank::new(0, a.decode_tp.max(1)), a.prefill_tp).map_err(|e| {
        format!(
            "--prefill-tp {} --decode-tp {}: {e}",
            a.prefill_tp, a.decode_tp
        )
    })?;
    let own = if a.mode == Mode::Serve {
        a.prefill_tp
    } else {
        a.decode_tp
    };
    if a.tp_rank >= own {
        return Err(format!(
            "--tp-rank {} is not a rank of a TP group of {own}",
            a.tp_rank
        ));
    }
    if a.groups == 0 || a.groups > a.shape.layers.min(64) {
        return Err(format!(
            "--groups {} (1 to {}: at most one per layer)",
            a.groups,
            a.shape.layers.min(64)
        ));
    }
    if a.shape.kv_heads > 0 {
        for size in [a.prefill_tp, a.decode_tp] {
            a.shape
                .rank_bytes_per_token(size)
                .map_err(|e| format!("{e}; pick TP sizes that divide the model's heads"))?;
        }
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
    check_block_sizes(&a, block_bytes.is_some())?;
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

/// `--prefill-block-tokens`: loopback runs of a preset on one TP rank each, one block size a
/// multiple of the other.
fn check_block_sizes(a: &Args, custom: bool) -> Result<(), String> {
    let Some(p) = a.prefill_block_tokens else {
        return Ok(());
    };
    let d = a.shape.tokens_per_block;
    if custom || a.mode != Mode::Loopback || a.tp_run() {
        return Err(
            "--prefill-block-tokens applies to loopback runs of a preset without TP sizes or groups"
                .into(),
        );
    }
    if p == 0 || p.max(d) % p.min(d) != 0 {
        return Err(format!(
            "--prefill-block-tokens {p} and --block-tokens {d}: one must be a multiple of the other"
        ));
    }
    Ok(())
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
        self.tp_given || self.prefill_tp != 1 || self.decode_tp != 1 || self.groups != 1
    }

    pub(crate) fn blocks_per_request(&self) -> u32 {
        self.tokens.div_ceil(self.shape.tokens_per_block)
    }

    pub(crate) fn cache_blocks(&self) -> u32 {
        self.blocks
            .unwrap_or(self.blocks_per_request() * 2 * self.concurrency as u32)
    }

    pub(crate) fn config(&self, listen: &str, advertise: Option<String>) -> EngineConfig {
        EngineConfig {
            tp_rank: self.tp_rank,
            tp_size: if self.mode == Mode::Serve {
                self.prefill_tp
            } else {
                self.decode_tp
            },
            listen: listen.to_string(),
            advertise_host: advertise,
            tcp_streams: self.streams,
            batch_bytes: self.batch_bytes,
            request_timeout: Duration::from_secs(120),
            transport: self.transport,
            rdma: kvlink::RdmaSettings {
                device: self.rdma_device.clone(),
                qps: self.qps,
                ..Default::default()
            },
            ..EngineConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_names_are_the_engines() {
        for t in TransportChoice::ALL {
            let a = parse_from(["--transport", t.as_str()]).unwrap();
            assert_eq!(a.transport, t);
        }
        let none: [&str; 0] = [];
        assert_eq!(
            parse_from(none).unwrap().transport,
            TransportChoice::Network
        );
        let e = parse_from(["--transport", "ipc"]).unwrap_err();
        assert!(e.contains("got \"ipc\""), "{e}");
    }
}
