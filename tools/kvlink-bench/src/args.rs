//! Command-line options of kvlink-bench: the usage text, the modes, where the caches live,
//! block-id patterns, model presets and custom layouts, and what the options derive.

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
    settle_shape(&mut a, shape)?;
    check(&a)?;
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
            a.shape = ModelShape::preset(&name).ok_or_else(|| {
                let names: Vec<&str> = ModelShape::PRESETS.iter().map(|p| p.name).collect();
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

/// Applies the shape options: `--block-bytes` (with `--tensors`) makes a custom shape; the
/// TP sizes, groups and heads are checked against the shape; `--block-tokens` sets a
/// preset's block size.
fn settle_shape(a: &mut Args, shape: ShapeOptions) -> Result<(), String> {
    if let Some(b) = shape.block_bytes {
        let tensors = shape.tensors.unwrap_or(1);
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
    check_tp(a)?;
    if let Some(t) = shape.block_tokens {
        if t == 0 || shape.block_bytes.is_some() {
            return Err(
                "--block-tokens must be at least 1 and applies to presets, not --block-bytes"
                    .into(),
            );
        }
        a.shape.tokens_per_block = t;
    }
    check_block_sizes(a, shape.block_bytes.is_some())
}

/// The TP sizes pair, the rank is one of its group's, the groups fit the layers, and the
/// model's heads spread over both TP sizes.
fn check_tp(a: &Args) -> Result<(), String> {
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
    Ok(())
}

/// What each mode needs: a sweep its parameter and values, a read its peer; and nothing
/// empty.
fn check(a: &Args) -> Result<(), String> {
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
    Ok(())
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

    #[test]
    fn defaults() {
        let none: [&str; 0] = [];
        let a = parse_from(none).unwrap();
        assert_eq!(a.mode, Mode::Loopback);
        assert_eq!(a.shape.name, "llama-3-8b");
        assert_eq!(
            (a.tokens, a.requests, a.warmup, a.concurrency),
            (4096, 16, 2, 2)
        );
        assert_eq!(
            (a.streams, a.qps, a.batch_bytes, a.seed),
            (4, 4, 4 << 20, 1)
        );
        assert_eq!((a.pattern, a.memory), (Pattern::Random, Memory::Host));
        assert_eq!(
            (a.listen.as_str(), a.advertise.as_str()),
            ("0.0.0.0:7400", "127.0.0.1")
        );
        assert_eq!(
            (a.prefill_tp, a.decode_tp, a.tp_rank, a.groups),
            (1, 1, 0, 1)
        );
        assert!(!a.tp_given && !a.verify && !a.json && !a.head_major);
        assert_eq!(a.out, "kvlink-sweep");
    }

    #[test]
    fn every_option_lands_in_its_field() {
        let a = parse_from([
            "sweep",
            "--preset",
            "qwen2.5-7b",
            "--tokens",
            "512",
            "--pattern",
            "fragmented",
            "--requests",
            "3",
            "--warmup",
            "0",
            "--concurrency",
            "5",
            "--streams",
            "6",
            "--batch-bytes",
            "2MiB",
            "--blocks",
            "99",
            "--verify",
            "--json",
            "--seed",
            "7",
            "--listen",
            "1.2.3.4:5",
            "--advertise",
            "9.9.9.9",
            "--peer",
            "p:1",
            "--qps",
            "3",
            "--rdma-device",
            "mlx5_0",
            "--rdma-device",
            "mlx5_1",
            "--param",
            "tokens",
            "--values",
            "64,1K",
            "--out",
            "o",
            "--memory",
            "emulated",
            "--gpu",
            "2",
            "--decode-tp",
            "2",
            "--tp-rank",
            "1",
            "--groups",
            "2",
            "--head-layout",
            "hnd",
            "--block-tokens",
            "32",
        ])
        .unwrap();
        assert_eq!(a.mode, Mode::Sweep);
        assert_eq!(a.shape.name, "qwen2.5-7b");
        assert_eq!(a.shape.tokens_per_block, 32);
        assert_eq!((a.tokens, a.pattern), (512, Pattern::Fragmented));
        assert_eq!(
            (a.requests, a.warmup, a.concurrency, a.streams),
            (3, 0, 5, 6)
        );
        assert_eq!((a.batch_bytes, a.blocks, a.seed), (2 << 20, Some(99), 7));
        assert!(a.verify && a.json && a.head_major && a.tp_given);
        assert_eq!(
            (a.listen.as_str(), a.advertise.as_str()),
            ("1.2.3.4:5", "9.9.9.9")
        );
        assert_eq!((a.peer.as_deref(), a.qps), (Some("p:1"), 3));
        assert_eq!(a.rdma_device.as_deref(), Some("mlx5_0,mlx5_1"));
        assert_eq!(
            (a.param.as_deref(), a.values.clone()),
            (Some("tokens"), vec![64, 1024])
        );
        assert_eq!(
            (a.out.as_str(), a.memory, a.gpu),
            ("o", Memory::Emulated, 2)
        );
        assert_eq!(
            (a.prefill_tp, a.decode_tp, a.tp_rank, a.groups),
            (1, 2, 1, 2)
        );
        let c = parse_from(["--block-bytes", "4K", "--tensors", "3", "--memory", "cuda"]).unwrap();
        assert_eq!(
            (c.shape.name, c.shape.layers, c.shape.bytes_per_token),
            ("custom", 3, 4096)
        );
        assert_eq!(c.memory, Memory::Gpu(GpuApi::Cuda));
        let d = parse_from(["--prefill-block-tokens", "32"]).unwrap();
        assert_eq!((d.prefill_tokens(), d.shape.tokens_per_block), (32, 16));
    }

    #[test]
    fn each_mistake_is_named() {
        let cases: &[(&[&str], &str)] = &[
            (&["fly"], "unknown mode \"fly\""),
            (&["--memory", "disk"], "unknown memory \"disk\""),
            (&["--pattern", "x"], "unknown pattern \"x\""),
            (&["--head-layout", "x"], "unknown head layout \"x\""),
            (&["--preset", "x"], "unknown preset \"x\""),
            (&["--tokens", "x"], "--tokens: "),
            (&["--batch-bytes", "2X"], "size \"2X\""),
            (&["--bogus"], "invalid option '--bogus'"),
            (
                &["--prefill-tp", "3", "--decode-tp", "2"],
                "--prefill-tp 3 --decode-tp 2: ",
            ),
            (
                &["--tp-rank", "1"],
                "--tp-rank 1 is not a rank of a TP group of 1",
            ),
            (&["--groups", "0"], "--groups 0 (1 to 32"),
            (
                &["--decode-tp", "3"],
                "pick TP sizes that divide the model's heads",
            ),
            (
                &["--block-bytes", "0"],
                "--block-bytes and --tensors must be at least 1",
            ),
            (
                &["--block-tokens", "0"],
                "--block-tokens must be at least 1",
            ),
            (
                &["--block-bytes", "1K", "--block-tokens", "4"],
                "applies to presets",
            ),
            (
                &["--prefill-block-tokens", "24"],
                "one must be a multiple of the other",
            ),
            (
                &["--prefill-block-tokens", "32", "--groups", "2"],
                "applies to loopback runs",
            ),
            (&["sweep"], "sweep needs --param and --values"),
            (
                &["sweep", "--param", "x", "--values", "1"],
                "unknown sweep parameter \"x\"",
            ),
            (
                &["sweep", "--param", "qps", "--values", "0"],
                "positive numbers",
            ),
            (&["--tokens", "0"], "must be at least 1"),
            (&["read"], "read needs --peer"),
        ];
        for (args, want) in cases {
            let e = parse_from(args.iter().copied()).unwrap_err();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }
}
