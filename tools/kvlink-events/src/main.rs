//! kvlink-events: tail, publish, merge and index KV-cache event streams in the wire formats of vLLM,
//! SGLang and ATOM.
//!
//! ```text
//! kvlink-events tail --endpoint tcp://host:5557 --replay tcp://host:5558 [--from SEQ]
//! kvlink-events publish --endpoint 'tcp://*:5557' --replay 'tcp://*:5558' < batches.jsonl
//! kvlink-events merge --input tcp://a:5557,tcp://a:5558 --input tcp://b:5557 --endpoint 'tcp://*:6557'
//! kvlink-events index --listen 127.0.0.1:8090 --engine a=tcp://a:5557,tcp://a:5558
//! ```
//! Batches are JSON lines on stdout (tail) and stdin (publish); progress and counts go to
//! stderr. See docs/kv-events.md.

mod cpu;
mod index;
mod json;

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvlink_events::{
    BatchBuilder, BlockHash, BlockStored, BlockStoredRef, Encoding, EventBatch, HashRef, HashesRef,
    KvEvent, Merger, MergerConfig, MergerInput, Publisher, PublisherConfig, ReplayFormat, SubItem,
    Subscriber, SubscriberConfig,
};

const USAGE: &str = "\
usage: kvlink-events tail|publish|merge|index [options]

tail      follow a stream, one JSON line per batch on stdout (in sequence, each once)
  --endpoint E          the publisher's live endpoint (tcp://host:port)       [required]
  --replay R            its replay endpoint: fills gaps, bootstraps late joins
  --topic T             topic prefix                                          [all]
  --from SEQ            replay from SEQ first (needs --replay)
  --snapshots           when a kvlink publisher's ring no longer holds the history, take
                        its snapshot of live blocks (a snapshot line)
  --count N             exit after N batches
  --idle-exit S         exit after S seconds without a batch
  --replay-timeout-ms M time allowed for a replay answer                      [2000]
  --quiet               no batch lines; one JSON summary line on stdout at exit

publish   publish batches read as JSON lines on stdin (seq 0, 1, ...)
  --endpoint E          live endpoint; bound if it has * or :: or is ipc      [tcp://*:5557]
  --replay R            replay endpoint (bound)                               [off]
  --topic T             topic frame                                           []
  --dp-rank N           data-parallel rank: tcp port + N, ipc path + _dpN     [0]
  --encoding E          current (maps) or legacy (arrays)                     [current]
  --replay-format F     current (with topic frame) or legacy                  [current]
  --buffer-steps N      batches kept for replay                               [10000]
  --snapshot-max-blocks N  live blocks kept for snapshots (with --replay; 0: none) [1048576]
  --linger-ms M         keep serving replay after stdin ends                  [1000]
  --synthetic N         publish N generated batches instead of stdin (benchmark), then
                        print a JSON summary line on stdout
  --events-per-batch N, --hashes-per-event N, --block-size N   synthetic shape [32, 16, 16]
  --start-delay-ms M    synthetic: wait before publishing (subscribers join)  [500]
  --subscriber-hwm-mib M  bytes queued toward one subscriber before it loses
                        messages, in MiB (the message bound is vLLM's 100,000)  [256]
  --owned-events        synthetic: build an EventBatch of owned events per batch and
                        publish it, instead of encoding each event from the pool's
                        hashes and tokens in place (Publisher::builder)

merge     re-publish several ranks' streams as one (global sequence, own replay)
  --input SPEC          ENDPOINT[,REPLAY][@DP_RANK], repeated once per rank   [required]
  --endpoint E, --replay R, --topic T, --encoding E, --buffer-steps N   the merged stream
                        (--topic is also the prefix subscribed to on the inputs)
  --keep-topics         publish each batch under its input's topic frame (llm-d's
                        kv@<pod>@<model>) instead of --topic
  --tp-size N           vLLM's TP rule: inputs in groups of N TP workers of one DP rank;
                        an event goes out once all N emitted it                [1: off]
  --duration-s S        stop after S seconds                                  [run until killed]
";

fn main() -> ExitCode {
    let level = std::env::var("KVLINK_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(tracing::Level::WARN);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let r = match mode.as_str() {
        "tail" => Opts::parse(&rest).and_then(tail),
        "publish" => Opts::parse(&rest).and_then(publish),
        "merge" => Opts::parse(&rest).and_then(merge),
        "index" => index::run(&rest),
        "-h" | "--help" | "help" => {
            print!("{USAGE}\n{}", index::USAGE);
            return ExitCode::SUCCESS;
        }
        m => Err(format!("unknown mode {m:?}")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvlink-events: {e}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

#[derive(Default)]
struct Opts {
    endpoint: Option<String>,
    replay: Option<String>,
    topic: String,
    from: Option<u64>,
    count: Option<u64>,
    idle_exit: Option<f64>,
    replay_timeout_ms: u64,
    quiet: bool,
    snapshots: bool,
    snapshot_max_blocks: usize,
    dp_rank: u32,
    encoding: Encoding,
    replay_format: ReplayFormat,
    buffer_steps: usize,
    linger_ms: u64,
    synthetic: Option<u64>,
    events_per_batch: usize,
    hashes_per_event: usize,
    block_size: u32,
    start_delay_ms: u64,
    owned_events: bool,
    subscriber_hwm_mib: usize,
    inputs: Vec<MergerInput>,
    duration_s: Option<f64>,
    keep_topics: bool,
    tp_size: usize,
}

fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{name}: {v:?} is not a valid number"))
}

fn seconds(name: &str, v: &str) -> Result<f64, String> {
    let s: f64 = num(name, v)?;
    if (0.0..1e9).contains(&s) {
        Ok(s)
    } else {
        Err(format!("{name}: {v:?} is not a number of seconds"))
    }
}

fn input_spec(s: &str) -> Result<MergerInput, String> {
    let (eps, dp) = match s.rsplit_once('@') {
        Some((e, d)) => (e, Some(num::<i64>("--input dp rank", d)?)),
        None => (s, None),
    };
    let mut parts = eps.split(',');
    let endpoint = parts.next().unwrap_or_default().to_string();
    if endpoint.is_empty() {
        return Err(format!("--input {s:?}: no endpoint"));
    }
    let replay_endpoint = parts.next().map(str::to_string);
    if parts.next().is_some() {
        return Err(format!(
            "--input {s:?}: expected ENDPOINT[,REPLAY][@DP_RANK]"
        ));
    }
    Ok(MergerInput {
        endpoint,
        replay_endpoint,
        dp_rank: dp,
    })
}

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let mut o = Opts {
            replay_timeout_ms: 2000,
            buffer_steps: 10_000,
            linger_ms: 1000,
            events_per_batch: 32,
            hashes_per_event: 16,
            block_size: 16,
            start_delay_ms: 500,
            owned_events: false,
            subscriber_hwm_mib: 256,
            snapshot_max_blocks: 1 << 20,
            ..Default::default()
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut val = || {
                it.next()
                    .cloned()
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag.as_str() {
                "--endpoint" => o.endpoint = Some(val()?),
                "--replay" => o.replay = Some(val()?),
                "--topic" => o.topic = val()?,
                "--from" => o.from = Some(num(flag, &val()?)?),
                "--count" => o.count = Some(num(flag, &val()?)?),
                "--idle-exit" => o.idle_exit = Some(seconds(flag, &val()?)?),
                "--replay-timeout-ms" => o.replay_timeout_ms = num(flag, &val()?)?,
                "--quiet" => o.quiet = true,
                "--snapshots" => o.snapshots = true,
                "--snapshot-max-blocks" => o.snapshot_max_blocks = num(flag, &val()?)?,
                "--owned-events" => o.owned_events = true,
                "--subscriber-hwm-mib" => o.subscriber_hwm_mib = num(flag, &val()?)?,
                "--dp-rank" => o.dp_rank = num(flag, &val()?)?,
                "--encoding" => {
                    o.encoding = match val()?.as_str() {
                        "current" => Encoding::Current,
                        "legacy" => Encoding::Legacy,
                        e => return Err(format!("--encoding {e:?}: current or legacy")),
                    }
                }
                "--replay-format" => {
                    o.replay_format = match val()?.as_str() {
                        "current" => ReplayFormat::Current,
                        "legacy" => ReplayFormat::Legacy,
                        e => return Err(format!("--replay-format {e:?}: current or legacy")),
                    }
                }
                "--buffer-steps" => o.buffer_steps = num(flag, &val()?)?,
                "--linger-ms" => o.linger_ms = num(flag, &val()?)?,
                "--synthetic" => o.synthetic = Some(num(flag, &val()?)?),
                "--events-per-batch" => o.events_per_batch = num(flag, &val()?)?,
                "--hashes-per-event" => o.hashes_per_event = num(flag, &val()?)?,
                "--block-size" => o.block_size = num(flag, &val()?)?,
                "--start-delay-ms" => o.start_delay_ms = num(flag, &val()?)?,
                "--input" => o.inputs.push(input_spec(&val()?)?),
                "--duration-s" => o.duration_s = Some(seconds(flag, &val()?)?),
                "--keep-topics" => o.keep_topics = true,
                "--tp-size" => o.tp_size = num(flag, &val()?)?,
                f => return Err(format!("unknown option {f:?}")),
            }
        }
        Ok(o)
    }

    fn publisher(&self) -> PublisherConfig {
        PublisherConfig {
            endpoint: self
                .endpoint
                .clone()
                .unwrap_or_else(|| "tcp://*:5557".into()),
            replay_endpoint: self.replay.clone(),
            topic: self.topic.clone(),
            dp_rank: self.dp_rank,
            encoding: self.encoding,
            replay_format: self.replay_format,
            buffer_steps: self.buffer_steps,
            subscriber_hwm_bytes: self.subscriber_hwm_mib.saturating_mul(1 << 20),
            snapshot_max_blocks: self.snapshot_max_blocks,
            ..Default::default()
        }
    }
}

/// One thread: the SUB socket's reader task and the decoding run together (no hand-off of each
/// message between threads, no buffer freed on another thread than the one that filled it).
fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))
}

fn entries(b: &EventBatch) -> u64 {
    b.events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
            _ => 0,
        })
        .sum()
}

// Long: the tail command's one loop over the subscriber's items: its counters, output and exit
//   rules are used by every arm.
fn tail(o: Opts) -> Result<(), String> {
    let endpoint = o.endpoint.clone().ok_or("tail needs --endpoint")?;
    let cfg = SubscriberConfig {
        replay_endpoint: o.replay.clone(),
        topic: o.topic.clone(),
        replay_timeout: Duration::from_millis(o.replay_timeout_ms),
        start_from: o.from,
        snapshots: o.snapshots,
        ..SubscriberConfig::new(endpoint.clone())
    };
    let rt = runtime()?;
    rt.block_on(async move {
        let mut sub = Subscriber::connect(cfg).await.map_err(|e| e.to_string())?;
        eprintln!("kvlink-events: subscribed to {endpoint}");
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        let (mut batches, mut events, mut n_entries) = (0u64, 0u64, 0u64);
        let (mut first, mut last_at) = (None::<Instant>, Instant::now());
        let mut last_progress = Instant::now();
        let idle = o.idle_exit.map(Duration::from_secs_f64);
        loop {
            if o.count.is_some_and(|c| batches >= c) {
                break;
            }
            if idle.is_some_and(|i| last_at.elapsed() >= i) {
                break;
            }
            let wait = idle.map_or(Duration::from_secs(1), |i| {
                i.saturating_sub(last_at.elapsed()).min(Duration::from_secs(1))
            });
            let item = sub.next(wait).await.map_err(|e| e.to_string())?;
            if last_progress.elapsed() >= Duration::from_secs(2) {
                last_progress = Instant::now();
                let s = sub.stats();
                eprintln!(
                    "kvlink-events: {batches} batches, {events} events, {n_entries} block entries; \
                     last seq {:?}, {} replays, {} duplicates, {} resyncs, {} malformed, {} skipped events",
                    sub.last_seq(), s.replays, s.duplicates, s.resyncs, s.malformed_batches, s.skipped_events
                );
            }
            let Some(item) = item else { continue };
            match &item {
                SubItem::Batch { batch, .. } => {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last_at = now;
                    batches += 1;
                    events += batch.events.len() as u64;
                    n_entries += entries(batch);
                }
                SubItem::Malformed { .. } => {
                    batches += 1;
                    last_at = Instant::now();
                }
                SubItem::Resync(_) | SubItem::Snapshot { .. } => {}
                // Everything arrived in order: stdout carries only what a consumer acts on.
                SubItem::GapFilled { from, through } => {
                    eprintln!("kvlink-events: gap filled by replay: batches {from}..={through} delivered in order");
                    continue;
                }
            }
            if !o.quiet {
                let line = match &item {
                    SubItem::Batch { seq, batch, skipped, topic, .. } => {
                        json::batch_line(*seq, topic, batch, skipped)
                    }
                    SubItem::Malformed { seq, reason } => {
                        serde_json::json!({"malformed": seq, "reason": reason.to_string()})
                    }
                    SubItem::Resync(r) => json::resync_line(r),
                    SubItem::Snapshot { seq, batches, skipped, topic } => {
                        json::snapshot_line(*seq, topic, batches, skipped)
                    }
                    SubItem::GapFilled { .. } => unreachable!("handled above"),
                };
                serde_json::to_writer(&mut out, &line).map_err(|e| e.to_string())?;
                out.write_all(b"\n").and_then(|_| out.flush()).map_err(|e| e.to_string())?;
            }
            if let SubItem::Batch { batch, .. } = item {
                sub.recycle(batch);
            }
        }
        let secs = match first {
            Some(f) => last_at.duration_since(f).as_secs_f64(),
            None => 0.0,
        };
        let s = sub.stats();
        let summary = serde_json::json!({
            "subscriber": "kvlink", "batches": batches, "events": events, "entries": n_entries,
            "seconds": secs, "entries_per_s": if secs > 0.0 { n_entries as f64 / secs } else { 0.0 },
            "replays": s.replays, "duplicates": s.duplicates, "resyncs": s.resyncs,
            "malformed": s.malformed_batches, "skipped_events": s.skipped_events,
            "bad_messages": s.bad_messages, "cpu_s": cpu::seconds(),
        });
        eprintln!("kvlink-events: done: {summary}");
        if o.quiet {
            writeln!(out, "{summary}").map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// The benchmark workload: `events` BlockStored events of `hashes` blocks each per batch,
/// hashes and tokens made beforehand (as an engine has them), events built per batch.
struct Synthetic {
    hashes: Vec<Vec<u64>>,
    parents: Vec<u64>,
    tokens: Vec<Vec<u32>>,
    block_size: u32,
}

impl Synthetic {
    fn new(events: usize, hashes: usize, block_size: u32) -> Synthetic {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        Synthetic {
            hashes: (0..events)
                .map(|_| (0..hashes).map(|_| next()).collect())
                .collect(),
            parents: (0..events).map(|_| next()).collect(),
            tokens: (0..events)
                .map(|_| {
                    (0..hashes * block_size as usize)
                        .map(|_| (next() % 150_000) as u32)
                        .collect()
                })
                .collect(),
            block_size,
        }
    }

    /// The batch encoded event by event from the pool (what an engine holding its hashes and
    /// tokens does: nothing is copied into owned events).
    fn build(&self, p: &Publisher) -> BatchBuilder {
        let mut b = p.builder(json::now());
        for i in 0..self.hashes.len() {
            b.push_stored(&BlockStoredRef {
                block_hashes: HashesRef::U64(&self.hashes[i]),
                parent_block_hash: Some(HashRef::U64(self.parents[i])),
                token_ids: &self.tokens[i],
                block_size: self.block_size,
                lora_id: None,
                medium: Some("GPU"),
                lora_name: None,
                group_idx: None,
            });
        }
        b
    }

    /// The batch as owned events.
    fn batch(&self) -> EventBatch {
        let events = (0..self.hashes.len())
            .map(|i| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes: self.hashes[i].iter().map(|&h| BlockHash::U64(h)).collect(),
                    parent_block_hash: Some(BlockHash::U64(self.parents[i])),
                    token_ids: self.tokens[i].clone(),
                    block_size: self.block_size,
                    medium: Some("GPU".into()),
                    ..Default::default()
                })
            })
            .collect();
        EventBatch {
            ts: json::now(),
            events,
            dp_rank: Some(0),
        }
    }
}

fn publish(o: Opts) -> Result<(), String> {
    let mut p = Publisher::start(o.publisher()).map_err(|e| e.to_string())?;
    eprintln!(
        "kvlink-events: listening on {} (replay {})",
        p.endpoint(),
        p.replay_endpoint().unwrap_or("off")
    );
    let wait = Duration::from_secs(10);
    if let Some(n) = o.synthetic {
        let w = Synthetic::new(o.events_per_batch, o.hashes_per_event, o.block_size);
        std::thread::sleep(Duration::from_millis(o.start_delay_ms));
        let cpu = cpu::seconds();
        let t = Instant::now();
        for _ in 0..n {
            if o.owned_events {
                p.publish_timeout(w.batch(), wait)
            } else {
                p.publish_built_timeout(w.build(&p), Some(0), wait)
            }
            .map_err(|e| e.to_string())?;
        }
        let s = p.close(Duration::from_secs(60));
        let secs = t.elapsed().as_secs_f64();
        let cpu = cpu::seconds() - cpu;
        let n_entries = n * (o.events_per_batch * o.hashes_per_event) as u64;
        println!(
            "{}",
            serde_json::json!({"publisher": "kvlink", "batches": s.published, "entries": n_entries,
                "seconds": secs, "entries_per_s": n_entries as f64 / secs, "dropped": s.dropped,
                "cpu_s": cpu})
        );
    } else {
        for (i, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.map_err(|e| format!("reading stdin: {e}"))?;
            if line.trim().is_empty() {
                continue;
            }
            let batch =
                json::parse_batch(&line).map_err(|e| format!("stdin line {}: {e}", i + 1))?;
            p.publish_timeout(batch, wait).map_err(|e| e.to_string())?;
        }
        p.close(Duration::from_secs(30));
    }
    std::thread::sleep(Duration::from_millis(o.linger_ms));
    let s = p.stats();
    eprintln!(
        "kvlink-events: published {} batches ({} dropped); {} replay requests, {} batches replayed",
        s.published, s.dropped, s.replay_requests, s.replayed_batches
    );
    Ok(())
}

fn merge(o: Opts) -> Result<(), String> {
    if o.inputs.is_empty() {
        return Err("merge needs at least one --input".into());
    }
    let m = Merger::start(MergerConfig {
        topic: o.topic.clone(),
        replay_timeout: Duration::from_millis(o.replay_timeout_ms),
        keep_input_topics: o.keep_topics,
        tp_size: o.tp_size.max(1),
        ..MergerConfig::new(o.inputs.clone(), o.publisher())
    })
    .map_err(|e| e.to_string())?;
    eprintln!(
        "kvlink-events: merging {} inputs; listening on {} (replay {})",
        o.inputs.len(),
        m.endpoint(),
        m.replay_endpoint().unwrap_or("off")
    );
    let start = Instant::now();
    let end = o.duration_s.map(|s| start + Duration::from_secs_f64(s));
    loop {
        let step = Duration::from_secs(5);
        match end {
            Some(e) if Instant::now() >= e => break,
            Some(e) => std::thread::sleep(step.min(e.saturating_duration_since(Instant::now()))),
            None => std::thread::sleep(step),
        }
        let (out, inputs) = m.stats();
        eprintln!(
            "kvlink-events: merged {} batches ({} dropped, {} replay requests)",
            out.published, out.dropped, out.replay_requests
        );
        for i in inputs {
            eprintln!(
                "  {}: {} last seq {:?}, {} batches, {} resyncs, {} malformed, {} dropped",
                i.endpoint,
                if i.connected { "up" } else { "DOWN" },
                i.last_seq,
                i.batches,
                i.resyncs,
                i.malformed,
                i.dropped
            );
        }
        for (k, g) in m.tp_stats().iter().enumerate() {
            eprintln!(
                "  TP group {k}: {} events forwarded, {} held, {} evicted",
                g.forwarded, g.held, g.evicted
            );
        }
    }
    Ok(())
}
