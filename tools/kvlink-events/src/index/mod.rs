//! `kvlink-events index`: a KV-event index service. It follows many engines' streams (one
//! subscriber each, with replay), keeps one `kvlink_events::Index` of them, and answers a
//! router's overlap queries over HTTP, with a dump and Prometheus metrics. Engines come from
//! `--engine` flags, an engines file re-read when it changes, and `POST /register`; they can
//! be removed while it runs. SIGINT or SIGTERM stops it cleanly.

mod conn;
mod http;
mod metrics;
mod shards;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use kvlink_events::{
    HolderState, Index, IndexConfig, Resync, SubItem, Subscriber, SubscriberConfig,
};

use shards::Shards;

pub(crate) const USAGE: &str = "\
index     follow engines' streams and answer overlap queries over HTTP
  --listen ADDR         HTTP address (POST /query, /query_by_hash, /register,
                        /unregister; GET /engines, /dump, /metrics, /health) [127.0.0.1:8090]
  --engine SPEC         NAME=ENDPOINT[,REPLAY], repeated once per engine
  --engines-file F      one engine per line, as --engine (# comments); re-read when it
                        changes: engines added, removed or moved follow it
  --block-size N        tokens per block of /query without block_size        [16]
  --max-blocks N        blocks the index holds at most, over its shards       [16777216]
  --shards N            indexes side by side, engines split between them by
                        name, each ingesting on a thread of its own   [CPUs, at most 8]
  --replay-timeout-ms M time allowed for a replay answer                      [2000]
";

/// One engine followed: where, and what its stream did.
pub(crate) struct Engine {
    pub(crate) endpoint: String,
    pub(crate) replay: Option<String>,
    pub(crate) stats: Arc<EngineStats>,
    task: tokio::task::JoinHandle<()>,
    /// Cleared (before its blocks are removed) when the engine is no longer followed: its
    /// follower, which checks it under the index's lock, applies nothing after.
    followed: Arc<AtomicBool>,
}

/// What an engine's stream did (for `/engines` and `/metrics`).
#[derive(Default)]
pub(crate) struct EngineStats {
    pub(crate) batches: AtomicU64,
    pub(crate) restarts: AtomicU64,
    pub(crate) lost: AtomicU64,
    pub(crate) gaps_filled: AtomicU64,
    pub(crate) snapshots: AtomicU64,
    pub(crate) malformed: AtomicU64,
    /// The last batch's publisher timestamp, in microseconds since the epoch.
    pub(crate) last_ts_us: AtomicU64,
    pub(crate) connected: AtomicBool,
}

/// What the HTTP side and the followers share.
pub(crate) struct Service {
    pub(crate) shards: Shards,
    pub(crate) engines: Mutex<HashMap<String, Engine>>,
    pub(crate) block_size: u32,
    replay_timeout: Duration,
}

struct Opts {
    listen: String,
    engines: Vec<(String, String, Option<String>)>,
    file: Option<std::path::PathBuf>,
    block_size: u32,
    max_blocks: usize,
    shards: usize,
    replay_timeout_ms: u64,
}

/// A holder state's name in answers and metrics.
pub(crate) fn state_name(s: HolderState) -> &'static str {
    match s {
        HolderState::Exact => "exact",
        HolderState::Recovering => "recovering",
        HolderState::Stale => "stale",
    }
}

/// Parses `NAME=ENDPOINT[,REPLAY]`.
pub(crate) fn engine_spec(s: &str) -> Result<(String, String, Option<String>), String> {
    let (name, eps) = s
        .split_once('=')
        .ok_or_else(|| format!("engine {s:?}: expected NAME=ENDPOINT[,REPLAY]"))?;
    let mut parts = eps.split(',');
    let endpoint = parts.next().unwrap_or_default().trim().to_string();
    let replay = parts.next().map(|r| r.trim().to_string());
    if name.trim().is_empty() || endpoint.is_empty() || parts.next().is_some() {
        return Err(format!("engine {s:?}: expected NAME=ENDPOINT[,REPLAY]"));
    }
    Ok((name.trim().to_string(), endpoint, replay))
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        listen: "127.0.0.1:8090".into(),
        engines: Vec::new(),
        file: None,
        block_size: 16,
        max_blocks: IndexConfig::default().max_blocks,
        shards: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
        replay_timeout_ms: 2000,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let num = |v: String| -> Result<u64, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--listen" => o.listen = val()?,
            "--engine" => o.engines.push(engine_spec(&val()?)?),
            "--engines-file" => o.file = Some(val()?.into()),
            "--block-size" => o.block_size = num(val()?)?.clamp(1, 1 << 20) as u32,
            "--max-blocks" => o.max_blocks = num(val()?)? as usize,
            "--shards" => o.shards = num(val()?)?.clamp(1, 64) as usize,
            "--replay-timeout-ms" => o.replay_timeout_ms = num(val()?)?,
            f => return Err(format!("unknown option {f:?}")),
        }
    }
    Ok(o)
}

/// Runs the service until SIGINT or SIGTERM.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let o = parse(args)?;
    // Each shard's subscribers (socket, decode and apply) on one thread of its own: one
    // thread keeping its tables in its own core's cache ingests faster than two applying in
    // turns to one index under its lock (tools/bench-index.sh: about 400,000 against 290,000
    // events/s on two vCPUs), and shards of their own engines ingest side by side. HTTP
    // queries run on their connections' threads.
    let (shards, runtimes) = Shards::new(o.shards, o.max_blocks)?;
    let rt = runtimes[0].handle().clone();
    let server = listen(&o.listen)?;
    let service = Arc::new(Service {
        shards,
        engines: Mutex::new(HashMap::new()),
        block_size: o.block_size,
        replay_timeout: Duration::from_millis(o.replay_timeout_ms),
    });
    for (name, ep, replay) in &o.engines {
        service.follow(name, ep, replay.clone());
    }
    let stop = Arc::new(AtomicBool::new(false));
    rt.spawn(on_signal(stop.clone(), server.local_addr().ok()));
    if let Some(f) = o.file.clone() {
        rt.spawn(watch_file(service.clone(), f, stop.clone()));
    }
    eprintln!("kvlink-events index: listening on http://{}", o.listen);
    http::serve(&server, &service, &stop);
    service.stop_all();
    let st = service.shards.stats();
    eprintln!(
        "kvlink-events index: stopped; {} blocks in {} holders, {} stored, {} removed",
        st.blocks, st.holders, st.stored, st.removed
    );
    for r in runtimes {
        r.shutdown_timeout(Duration::from_secs(2));
    }
    Ok(())
}

/// The HTTP listener on `addr`.
fn listen(addr: &str) -> Result<std::net::TcpListener, String> {
    std::net::TcpListener::bind(addr).map_err(|e| format!("--listen {addr}: {e}"))
}

/// Sets `stop` on SIGINT or SIGTERM, and wakes the HTTP accept at `wake`.
async fn on_signal(stop: Arc<AtomicBool>, wake: Option<std::net::SocketAddr>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    stop.store(true, Ordering::Release);
    if let Some(addr) = wake {
        tokio::task::spawn_blocking(move || conn::wake(addr));
    }
}

impl Service {
    /// Starts following engine `name` (replacing an engine of that name).
    pub(crate) fn follow(self: &Arc<Self>, name: &str, endpoint: &str, replay: Option<String>) {
        self.forget(name);
        let stats = Arc::new(EngineStats::default());
        let mut cfg = SubscriberConfig::new(endpoint);
        // With a replay endpoint, everything the publisher's ring holds is applied first; a
        // ring that no longer starts at 0 is lost history, which a kvlink publisher answers
        // with a snapshot of its live blocks (exact at once); others' blocks are withheld
        // until they clear or restart.
        cfg.start_from = replay.is_some().then_some(0);
        cfg.snapshots = true;
        cfg.replay_endpoint = replay.clone();
        cfg.replay_timeout = self.replay_timeout;
        let followed = Arc::new(AtomicBool::new(true));
        let f = Follower {
            s: self.clone(),
            name: name.to_string(),
            stats: stats.clone(),
            followed: followed.clone(),
        };
        let task = self.shards.of(name).runtime.spawn(follower(f, cfg));
        let engine = Engine {
            endpoint: endpoint.to_string(),
            replay,
            stats,
            task,
            followed,
        };
        self.engines
            .lock()
            .expect("engines lock")
            .insert(name.to_string(), engine);
    }

    /// Stops following engine `name` and drops its blocks; whether it was followed.
    pub(crate) fn forget(&self, name: &str) -> bool {
        let old = self.engines.lock().expect("engines lock").remove(name);
        if let Some(e) = &old {
            // An aborted task may be in the middle of its poll, about to apply another item.
            e.followed.store(false, Ordering::Release);
            e.task.abort();
            let shard = self.shards.of(name);
            shard.index.lock().expect("index lock").remove_engine(name);
        }
        old.is_some()
    }

    fn stop_all(&self) {
        for (_, e) in self.engines.lock().expect("engines lock").drain() {
            e.task.abort();
        }
    }
}

/// One engine's follower: the service, the engine's name and counters, and whether it is
/// still followed.
struct Follower {
    s: Arc<Service>,
    name: String,
    stats: Arc<EngineStats>,
    followed: Arc<AtomicBool>,
}

impl Follower {
    /// Changes the index (`false`: the engine is no longer followed, nothing was changed).
    fn change(&self, f: impl FnOnce(&mut Index)) -> bool {
        let mut ix = self
            .s
            .shards
            .of(&self.name)
            .index
            .lock()
            .expect("index lock");
        let followed = self.followed.load(Ordering::Acquire);
        if followed {
            f(&mut ix);
        }
        followed
    }
}

/// Follows one engine's stream into the index, reconnecting when its subscriber fails; while
/// it is down, the engine's blocks count for nothing (`set_stale`).
async fn follower(f: Follower, cfg: SubscriberConfig) {
    let (name, stats) = (&f.name, &f.stats);
    loop {
        let mut sub = match Subscriber::connect(cfg.clone()).await {
            Ok(sub) => sub,
            Err(e) => {
                tracing::warn!(engine = %name, "KV-event subscriber: {e}; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        stats.connected.store(true, Ordering::Release);
        if !f.change(|ix| ix.set_stale(name, false)) {
            return;
        }
        loop {
            match sub.next(Duration::from_secs(1)).await {
                Ok(Some(item)) => {
                    stats.count(&item);
                    if !f.change(|ix| ix.apply_item(name, &item)) {
                        return;
                    }
                    // The next batch is decoded into this one's allocations.
                    if let SubItem::Batch { batch, .. } = item {
                        sub.recycle(batch);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(engine = %name, "KV-event subscriber failed: {e}");
                    break;
                }
            }
        }
        stats.connected.store(false, Ordering::Release);
        if !f.change(|ix| ix.set_stale(name, true)) {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

impl EngineStats {
    fn count(&self, item: &SubItem) {
        let c = match item {
            SubItem::Batch { batch, .. } => {
                let us = (batch.ts * 1e6).clamp(0.0, u64::MAX as f64) as u64;
                self.last_ts_us.store(us, Ordering::Relaxed);
                &self.batches
            }
            SubItem::Malformed { .. } => &self.malformed,
            SubItem::Resync(Resync::PublisherRestart { .. }) => &self.restarts,
            SubItem::Resync(Resync::HistoryLost { .. }) => &self.lost,
            SubItem::GapFilled { .. } => &self.gaps_filled,
            SubItem::Snapshot { .. } => &self.snapshots,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Seconds since the publisher stamped the last batch (`None` before any).
    pub(crate) fn lag_s(&self) -> Option<f64> {
        let ts = self.last_ts_us.load(Ordering::Relaxed);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .ok()?
            .as_micros() as f64;
        (ts > 0).then(|| ((now - ts as f64) / 1e6).max(0.0))
    }
}

/// Re-reads the engines file whenever its modification time changes: engines it adds are
/// followed, engines it drops forgotten, engines it moves followed anew.
async fn watch_file(s: Arc<Service>, path: std::path::PathBuf, stop: Arc<AtomicBool>) {
    let mut seen = None;
    let mut listed: HashMap<String, (String, Option<String>)> = HashMap::new();
    while !stop.load(Ordering::Acquire) {
        let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        if mtime.is_some() && mtime != seen {
            seen = mtime;
            match std::fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| read_engines(&t))
            {
                Ok(now) => reconcile(&s, &mut listed, now),
                Err(e) => tracing::warn!(file = %path.display(), "engines file not read: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The engines a file lists (`NAME=ENDPOINT[,REPLAY]` per line, `#` comments).
pub(crate) fn read_engines(
    text: &str,
) -> Result<HashMap<String, (String, Option<String>)>, String> {
    let mut out = HashMap::new();
    for line in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
    {
        if !line.is_empty() {
            let (name, ep, replay) = engine_spec(line)?;
            out.insert(name, (ep, replay));
        }
    }
    Ok(out)
}

fn reconcile(
    s: &Arc<Service>,
    listed: &mut HashMap<String, (String, Option<String>)>,
    now: HashMap<String, (String, Option<String>)>,
) {
    for name in listed.keys().filter(|n| !now.contains_key(*n)) {
        s.forget(name);
    }
    for (name, spec) in &now {
        if listed.get(name) != Some(spec) {
            s.follow(name, &spec.0, spec.1.clone());
        }
    }
    *listed = now;
}
