//! Runs between TP groups and with block groups: every rank of a prefill of `--prefill-tp`
//! ranks and a decode of `--decode-tp` ranks in this process (loopback), or one decode rank
//! reading a group of `serve` ranks in other processes (read). Each request is held by every
//! prefill rank and read by every decode rank from the prefill's TP group; it counts as done
//! once every decode rank read its part, and the bandwidth is the bytes all decode ranks
//! moved.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvlink::verify::{check_read, PrefillRank, ReadMemory};
use kvlink::{BlockId, Engine, HoldRequest, KvLayout, ReadFrom, ReadRequest, RequestId, TpRank};

use crate::args::Args;
use crate::outcome::{context_switches, cpu_seconds, Outcome};
use crate::workload::{make_cache, pick, Cache, Rng};

/// The fill seed of prefill rank `rank`: its own per rank where ranks hold their own heads, the
/// same on every rank where they hold the tensors whole (as an engine's MLA latent is).
pub(crate) fn prefill_seed(args: &Args, rank: u32) -> u64 {
    if args.shape.kv_heads > 0 {
        args.seed.wrapping_add(u64::from(rank))
    } else {
        args.seed
    }
}

/// A decode rank of the run.
pub(crate) struct DecodeRank<'a> {
    pub(crate) engine: &'a Engine,
    pub(crate) cache: &'a Cache,
    pub(crate) tp: TpRank,
}

/// A prefill rank as the run verifies it: its layout and rank, and its bytes.
pub(crate) struct Source {
    pub(crate) layout: KvLayout,
    pub(crate) tp: TpRank,
    pub(crate) bytes: Box<ReadMemory>,
}

/// Block ids per block group for one request.
type Groups = Vec<Vec<BlockId>>;

/// The engines of a run: every decode rank of `decode` reads from the prefill group at
/// `peers`; `holders` are the prefill engines in this process (they hold each request before
/// it is read; without them the prefill serves open reads); `sources` verify what arrived.
pub(crate) struct TpRun<'a> {
    pub(crate) args: &'a Args,
    pub(crate) decode: &'a [DecodeRank<'a>],
    pub(crate) holders: &'a [&'a Engine],
    pub(crate) peers: &'a [String],
    pub(crate) sources: &'a [Source],
}

/// Sizes of a run's requests: blocks per request, local blocks per slot, remote blocks, block
/// groups.
type Sizes = (u32, u32, u32, usize);

impl TpRun<'_> {
    /// Runs `count` requests, `--concurrency` in flight.
    pub(crate) fn drive(&self, count: usize, tag: &str, rng: &mut Rng) -> Result<Outcome, String> {
        let TpRun {
            args,
            decode,
            sources,
            ..
        } = *self;
        let per = args.blocks_per_request();
        let layout = &decode[0].cache.layout;
        let groups = layout.num_groups();
        let span = (0..groups)
            .map(|g| layout.group_blocks(g))
            .min()
            .unwrap_or(0)
            / args.concurrency as u32;
        let remote_blocks = (0..groups)
            .map(|g| sources[0].layout.group_blocks(g))
            .min()
            .unwrap_or(0);
        if span < per || remote_blocks < per {
            return Err(format!(
            "caches too small: {per} blocks per request, {span} local blocks per slot, {remote_blocks} remote blocks (raise --blocks)"
        ));
        }
        // Each decode engine's finished reads, through a channel: one waiting thread per engine.
        let (tx, rx) = mpsc::channel();
        let mut out = Outcome::default();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            for (i, d) in decode.iter().enumerate() {
                let (tx, stop) = (tx.clone(), &stop);
                scope.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        let f = d.engine.wait_finished(Duration::from_millis(200));
                        if !f.is_empty() && tx.send((i, f)).is_err() {
                            break;
                        }
                    }
                });
            }
            let result = self.requests(
                count,
                tag,
                rng,
                (per, span, remote_blocks, groups),
                &rx,
                &mut out,
            );
            stop.store(true, std::sync::atomic::Ordering::Release);
            result
        })?;
        Ok(out)
    }

    // Long: builds each decode rank's request over every prefill rank it reads, for each TP pairing
    //   the benchmark drives.
    fn requests(
        &self,
        count: usize,
        tag: &str,
        rng: &mut Rng,
        (per, span, remote_blocks, groups): Sizes,
        rx: &mpsc::Receiver<(usize, kvlink::Finished)>,
        out: &mut Outcome,
    ) -> Result<(), String> {
        let TpRun {
            args,
            decode,
            holders,
            peers,
            sources,
        } = *self;
        let mut free_slots: Vec<u32> = (0..args.concurrency as u32).rev().collect();
        // Request -> (slot, block ids, decode ranks still reading).
        let mut in_flight: HashMap<RequestId, (u32, Groups, Groups, usize)> = HashMap::new();
        let mut submitted = 0;
        let mut done = 0;
        let t0 = Instant::now();
        let cpu0 = cpu_seconds();
        let switches0 = context_switches();
        while done < count {
            while submitted < count {
                let Some(slot) = free_slots.pop() else { break };
                let (mut l, mut r) = (Vec::new(), Vec::new());
                for g in 0..groups {
                    // A hybrid model's state group: one page per request.
                    let n = if args.state.is_some() && g == 1 {
                        1
                    } else {
                        per
                    };
                    let (lg, rg) =
                        pick(rng, args.pattern, (n, n), slot * span, span, remote_blocks);
                    l.push(lg);
                    r.push(rg);
                }
                let id = RequestId::from(format!("{tag}-{submitted}"));
                // One token for every prefill rank's hold, as a scheduler hands it out.
                let token = submitted as u64 + 1;
                for h in holders {
                    h.hold(HoldRequest {
                        id: id.clone(),
                        blocks: r.clone(),
                        reader: None,
                        abort_timeout: None,
                        token: Some(token),
                    })
                    .map_err(|e| e.to_string())?;
                }
                for d in decode {
                    d.engine
                        .read(ReadRequest {
                            id: id.clone(),
                            remote_id: id.clone(),
                            from: ReadFrom::TpGroup(peers.to_vec()),
                            local: l.clone(),
                            remote: r.clone(),
                            remote_tokens_per_block: None,
                            first_tokens: Vec::new(),
                            hold: Some(token),
                        })
                        .map_err(|e| e.to_string())?;
                }
                in_flight.insert(id, (slot, l, r, decode.len()));
                submitted += 1;
            }
            let (rank, f) = rx
                .recv_timeout(Duration::from_secs(130))
                .map_err(|_| "no decode rank reported anything for 130 s".to_string())?;
            for h in holders {
                if let Some(fr) = h.get_finished().failed.first() {
                    return Err(format!("sending {} failed: {}", fr.id, fr.reason));
                }
            }
            if let Some(fr) = f.failed.first() {
                return Err(format!(
                    "request {} failed at decode {}: {}",
                    fr.id, decode[rank].tp, fr.reason
                ));
            }
            for rep in f.reports {
                let entry = in_flight
                    .get_mut(&rep.id)
                    .ok_or("unknown request finished")?;
                entry.3 -= 1;
                if args.verify {
                    out.verified += verify(&decode[rank], sources, &entry.1, &entry.2)
                        .map_err(|e| format!("verification failed for {}: {e}", rep.id))?;
                }
                if entry.3 == 0 {
                    let (slot, ..) = in_flight.remove(&rep.id).expect("present");
                    free_slots.push(slot);
                    done += 1;
                }
                out.reports.push(rep);
            }
        }
        out.wall = t0.elapsed();
        out.cpu = cpu_seconds() - cpu0;
        out.switches = context_switches().saturating_sub(switches0);
        Ok(())
    }
}

fn verify(d: &DecodeRank<'_>, sources: &[Source], l: &Groups, r: &Groups) -> kvlink::Result<u64> {
    let ranks: Vec<PrefillRank<'_>> = sources
        .iter()
        .map(|s| PrefillRank {
            layout: &s.layout,
            tp: s.tp,
            bytes: s.bytes.as_ref(),
        })
        .collect();
    check_read(&d.cache.region, &d.cache.layout, d.tp, &ranks, l, r)
}

/// Every rank of both sides in this process: warm-up, then the measured requests.
pub(crate) fn loopback_tp(args: &Args, rng: &mut Rng) -> Result<Outcome, String> {
    let blocks = args.cache_blocks();
    let start = |rank: u32, size: u32| {
        Engine::start(args.config("127.0.0.1:0", None).with(|c| {
            c.tp_rank = rank;
            c.tp_size = size;
        }))
        .map_err(|e| e.to_string())
    };
    let prefill: Vec<Engine> = (0..args.prefill_tp)
        .map(|r| start(r, args.prefill_tp))
        .collect::<Result<_, _>>()?;
    let decode: Vec<Engine> = (0..args.decode_tp)
        .map(|r| start(r, args.decode_tp))
        .collect::<Result<_, _>>()?;
    eprintln!("kvlink-bench: {}", prefill[0].capabilities().summary());
    let p_caches: Vec<Cache> = prefill
        .iter()
        .enumerate()
        .map(|(r, e)| {
            let tp = TpRank::new(r as u32, args.prefill_tp);
            make_cache(e, args, blocks, prefill_seed(args, tp.rank), tp)
        })
        .collect::<Result<_, _>>()?;
    let d_caches: Vec<Cache> = decode
        .iter()
        .enumerate()
        .map(|(r, e)| {
            make_cache(
                e,
                args,
                blocks,
                !args.seed,
                TpRank::new(r as u32, args.decode_tp),
            )
        })
        .collect::<Result<_, _>>()?;
    let peers: Vec<String> = prefill
        .iter()
        .map(|e| e.handshake_address().to_string())
        .collect();
    let sources: Vec<Source> = p_caches
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let region = c.region.clone();
            Source {
                layout: c.layout.clone(),
                tp: TpRank::new(r as u32, args.prefill_tp),
                bytes: Box::new(move |_, off, out: &mut [u8]| region.read_at(off, out)),
            }
        })
        .collect();
    let ranks: Vec<DecodeRank<'_>> = decode
        .iter()
        .zip(&d_caches)
        .enumerate()
        .map(|(r, (engine, cache))| DecodeRank {
            engine,
            cache,
            tp: TpRank::new(r as u32, args.decode_tp),
        })
        .collect();
    let holders: Vec<&Engine> = prefill.iter().collect();
    let run = TpRun {
        args,
        decode: &ranks,
        holders: &holders,
        peers: &peers,
        sources: &sources,
    };
    let out = run
        .drive(args.warmup, "warmup", rng)
        .and_then(|_| run.drive(args.requests, "req", rng));
    drop(ranks);
    drop(decode);
    drop(prefill);
    out
}

/// One decode rank (`--tp-rank` of `--decode-tp`) reading the `serve` ranks at `peers`, whose
/// caches hold the fill of their rank's seed (`--seed` plus the rank, for per-head layouts).
pub(crate) fn read_tp(args: &Args, peers: Vec<String>, rng: &mut Rng) -> Result<Outcome, String> {
    if peers.len() != args.prefill_tp as usize {
        return Err(format!(
            "--peer lists {} addresses for --prefill-tp {}: give every serve rank's, in rank order",
            peers.len(),
            args.prefill_tp
        ));
    }
    let blocks = args.cache_blocks();
    let tp = TpRank::new(args.tp_rank, args.decode_tp);
    let engine = Engine::start(args.config("0.0.0.0:0", Some(args.advertise.clone())))
        .map_err(|e| e.to_string())?;
    let cache = make_cache(&engine, args, blocks, !args.seed, tp)?;
    let mut sources = Vec::new();
    for (r, peer) in peers.iter().enumerate() {
        let d = engine
            .connect(peer, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let seed = prefill_seed(args, r as u32);
        sources.push(Source {
            layout: d.layout,
            tp: TpRank::new(d.tp_rank, d.tp_size),
            bytes: Box::new(move |_, off, out: &mut [u8]| {
                kvlink::verify::pattern_into(seed, off, out);
                Ok(())
            }),
        });
    }
    let ranks = [DecodeRank {
        engine: &engine,
        cache: &cache,
        tp,
    }];
    let run = TpRun {
        args,
        decode: &ranks,
        holders: &[],
        peers: &peers,
        sources: &sources,
    };
    run.drive(args.warmup, "warmup", rng)?;
    let staged0 = engine.stats().bytes_staged_in;
    let mut o = run.drive(args.requests, "req", rng)?;
    o.staged = (0, engine.stats().bytes_staged_in - staged0);
    Ok(o)
}
