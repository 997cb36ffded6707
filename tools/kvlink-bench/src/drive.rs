//! Running the engines: measured requests with a number in flight, the loopback, serve and
//! read modes, and the plain-copy reference of staged runs.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use kvlink::{BlockId, Engine, KvLayout, ReadRequest, Region, RequestId, TpRank, TransportChoice};

use crate::args::{Args, Memory, Pattern};
use crate::outcome::{context_switches, cpu_seconds, Outcome};
use crate::report::fmt_bytes;
use crate::workload::{make_cache, make_cache_of, pick, Cache, Rng};

/// The decode side of a run: its engine and cache, and the peer it reads from.
struct Reader<'a> {
    engine: &'a Engine,
    /// The prefill engine when it runs in this process: it holds (grants) each request's
    /// blocks before the read, as a prefill does. `None` for a `serve` peer (open reads).
    holder: Option<&'a Engine>,
    local: &'a Cache,
    remote_layout: &'a KvLayout,
    peer: &'a str,
}

/// Runs `count` requests with `concurrency` in flight against the reader's peer.
// Long: the benchmark's request loop: keeps `concurrency` requests in flight, refills, times and
//   verifies each; its counters are the report.
fn drive(
    args: &Args,
    rd: &Reader<'_>,
    count: usize,
    tag: &str,
    rng: &mut Rng,
) -> Result<Outcome, String> {
    let Reader {
        engine,
        holder,
        local,
        remote_layout,
        peer,
    } = *rd;
    let per = args.blocks_per_request();
    // The prefill's blocks of the same tokens (its block size may differ).
    let per_r = if remote_layout.tokens_per_block == local.layout.tokens_per_block {
        per
    } else {
        args.prefill_blocks_per_request()
    };
    let span = local.layout.num_blocks() / args.concurrency as u32;
    let remote_blocks = remote_layout.num_blocks();
    let fragmented_short = args.pattern == Pattern::Fragmented
        && (span / 4 < per.div_ceil(4) || remote_blocks / 4 < per_r.div_ceil(4));
    if span < per || remote_blocks < per_r || fragmented_short {
        return Err(format!(
            "caches too small: {per} blocks per request, {span} local blocks per slot, {remote_blocks} remote blocks (raise --blocks)"
        ));
    }
    let mut out = Outcome::default();
    let mut free_slots: Vec<u32> = (0..args.concurrency as u32).rev().collect();
    type Slot = (u32, Vec<BlockId>, Vec<BlockId>, Instant);
    let mut in_flight: HashMap<RequestId, Slot> = HashMap::new();
    let mut submitted = 0;
    let t0 = Instant::now();
    let cpu0 = cpu_seconds();
    let switches0 = context_switches();
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
            let (l, r) = pick(
                rng,
                args.pattern,
                (per, per_r),
                slot * span,
                span,
                remote_blocks,
            );
            let id = RequestId::from(format!("{tag}-{submitted}"));
            let hold = match holder {
                Some(h) => Some(h.hold_blocks(id.clone(), &r).map_err(|e| e.to_string())?),
                None => None,
            };
            let submitted_at = Instant::now();
            engine
                .read(ReadRequest {
                    remote_tokens_per_block: Some(remote_layout.tokens_per_block),
                    hold,
                    ..ReadRequest::blocks(peer, id.clone(), &l, &r)
                })
                .map_err(|e| e.to_string())?;
            in_flight.insert(id, (slot, l, r, submitted_at));
            submitted += 1;
        }
        let f = engine.wait_finished(Duration::from_secs(5));
        if let Some(h) = holder {
            // The prefill's finished sends: a failed one fails the run.
            if let Some(fr) = h.get_finished().failed.first() {
                return Err(format!("sending {} failed: {}", fr.id, fr.reason));
            }
        }
        if let Some(fr) = f.failed.first() {
            return Err(format!("request {} failed: {}", fr.id, fr.reason));
        }
        let seen = Instant::now();
        for rep in f.reports {
            let (slot, l, r, at) = in_flight
                .remove(&rep.id)
                .ok_or("unknown request finished")?;
            out.observed.push(seen - at);
            if args.verify {
                out.verified += verify(args, local, remote_layout, &l, &r)
                    .map_err(|e| format!("verification failed for {}: {e}", rep.id))?;
            }
            free_slots.push(slot);
            out.reports.push(rep);
        }
    }
    out.wall = t0.elapsed();
    out.cpu = cpu_seconds() - cpu0;
    out.switches = context_switches().saturating_sub(switches0);
    if progress {
        let _ = write!(std::io::stderr(), "\r{}\r", " ".repeat(70));
    }
    Ok(out)
}

/// Checks one request's bytes: block by block, or token by token when the prefill's blocks
/// hold another number of tokens.
fn verify(
    args: &Args,
    local: &Cache,
    remote_layout: &KvLayout,
    l: &[BlockId],
    r: &[BlockId],
) -> kvlink::Result<u64> {
    if remote_layout.tokens_per_block == local.layout.tokens_per_block {
        return kvlink::verify::check_blocks(
            &local.region,
            &local.layout,
            remote_layout,
            args.seed,
            l,
            r,
        );
    }
    kvlink::verify::check_tokens(
        &local.region,
        &local.layout,
        remote_layout,
        args.seed,
        (l, r),
        0,
        u64::from(args.tokens),
    )
}

/// The reference for staged and same-host runs, measured in the same run: one plain copy
/// (one thread) of the whole prefill cache out of its memory into an ordinary host buffer, in
/// 64 MiB pieces (for GPU memory, the runtime's device-to-host copy).
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

/// Two engines in this process: warm-up, then the measured requests.
pub(crate) fn loopback(args: &Args, rng: &mut Rng) -> Result<Outcome, String> {
    let blocks = args.cache_blocks();
    let prefill = Engine::start(args.config("127.0.0.1:0", None)).map_err(|e| e.to_string())?;
    let decode = Engine::start(args.config("127.0.0.1:0", None)).map_err(|e| e.to_string())?;
    eprintln!("kvlink-bench: {}", prefill.capabilities().summary());
    // The prefill's cache holds as many tokens as the decode's, in blocks of its own size.
    let shape = kvlink::ModelShape {
        tokens_per_block: args.prefill_tokens(),
        ..args.shape.clone()
    };
    let remote_blocks = (u64::from(blocks) * u64::from(args.shape.tokens_per_block))
        .div_ceil(u64::from(shape.tokens_per_block)) as u32;
    let remote = make_cache_of(
        &prefill,
        args,
        &shape,
        remote_blocks,
        args.seed,
        TpRank::SOLO,
    )?;
    let local = make_cache(&decode, args, blocks, !args.seed, TpRank::SOLO)?;
    let peer = prefill.handshake_address().to_string();
    // Staged runs and same-host runs are compared with one plain copy of the same bytes.
    let reference = match (args.memory, args.transport) {
        (Memory::Host, TransportChoice::Tcp | TransportChoice::Rdma) => None,
        _ => Some(copy_out_reference(&remote.region)?),
    };
    let out = {
        let rd = Reader {
            engine: &decode,
            holder: Some(&prefill),
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
            o.idle_cpu = idle_cpu(args, &decode, &prefill);
            Ok(o)
        })
    };
    // The engines go before the caches.
    drop(decode);
    drop(prefill);
    out
}

/// With `--idle-secs`: the CPU seconds both engines use over that time with their session open
/// and nothing to move, while each has a caller waiting for finished requests
/// (`wait_finished`, 100 ms at a time, as a scheduler loop would).
fn idle_cpu(args: &Args, decode: &Engine, prefill: &Engine) -> Option<f64> {
    let secs = args.idle_secs?;
    let end = Instant::now() + Duration::from_secs(secs);
    let cpu0 = cpu_seconds();
    std::thread::scope(|s| {
        s.spawn(|| {
            while Instant::now() < end {
                prefill.wait_finished(Duration::from_millis(100));
            }
        });
        while Instant::now() < end {
            decode.wait_finished(Duration::from_millis(100));
        }
    });
    Some(cpu_seconds() - cpu0)
}

/// The prefill side in its own process: serves its cache to readers elsewhere until killed,
/// printing what it served every 5 s when that changed.
pub(crate) fn serve(args: &Args) -> Result<(), String> {
    let blocks = args.cache_blocks();
    // Readers in other processes name requests this engine never held: serve every
    // exported byte (authentication, when a key is set, still applies).
    let config = args
        .config(&args.listen, Some(args.advertise.clone()))
        .with(|c| {
            c.open_reads = true;
        });
    let engine = Engine::start(config).map_err(|e| e.to_string())?;
    let tp = TpRank::new(args.tp_rank, args.prefill_tp);
    let seed = crate::tp::prefill_seed(args, tp.rank);
    let _cache = make_cache(&engine, args, blocks, seed, tp)?;
    eprintln!(
        "kvlink-bench serve: {} ({tp}) with {blocks} blocks per tensor, seed {seed}; readers use --peer {}",
        args.shape.name,
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

/// The decode side in its own process: reads from `--peer` as a loopback run does.
pub(crate) fn read(args: &Args, rng: &mut Rng) -> Result<Outcome, String> {
    let blocks = args.cache_blocks();
    let peer = args.peer.clone().expect("checked in parse_args");
    let engine = Engine::start(args.config("0.0.0.0:0", Some(args.advertise.clone())))
        .map_err(|e| e.to_string())?;
    let local = make_cache(&engine, args, blocks, !args.seed, TpRank::SOLO)?;
    let theirs = engine
        .connect(&peer, Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    let rd = Reader {
        engine: &engine,
        holder: None,
        local: &local,
        remote_layout: &theirs.layout,
        peer: &peer,
    };
    drive(args, &rd, args.warmup, "warmup", rng)?;
    let staged0 = engine.stats().bytes_staged_in;
    let mut o = drive(args, &rd, args.requests, "req", rng)?;
    o.staged = (0, engine.stats().bytes_staged_in - staged0);
    Ok(o)
}
