//! Helpers shared by the integration tests: engines with patterned KV caches, random block
//! lists, and byte-for-byte verification.

#![allow(dead_code)]

pub mod rdma;
pub mod tp;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::{Engine, EngineConfig, Finished, HoldRequest, KvLayout, ModelShape, Region};

/// Turns on logs when KVLINK_LOG is set (e.g. `KVLINK_LOG=debug`).
pub fn init_logs() {
    if let Ok(level) = std::env::var("KVLINK_LOG") {
        let level = level.parse().unwrap_or(tracing::Level::INFO);
        let _ = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_test_writer()
            .try_init();
    }
}

#[allow(unused_imports)]
pub use kvlink::verify::pattern;

/// One engine with one region holding a whole KV cache of `shape`.
pub struct Side {
    pub engine: Engine,
    pub region: Arc<Region>,
    pub layout: KvLayout,
    /// Host memory behind an emulated device or external region; dropped after the engine.
    _emulated: Option<Box<[u8]>>,
}

/// Where a test KV cache lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mem {
    /// Host memory allocated by the engine.
    Host,
    /// Host memory registered as emulated device memory (the staging paths, no GPU needed).
    Emulated,
    /// Host memory registered from a pointer (as engines register their caches): it cannot
    /// be shared with another process, so the same-host path does not take it.
    External,
    /// Emulated device memory allocated by the engine (a memfd: its IPC works between
    /// processes, as CUDA's does).
    EmulatedAlloc,
    /// CUDA device memory on GPU 0 (only where CUDA is loaded).
    Cuda,
}

/// Starts an engine with `num_blocks` blocks of `shape`, filled with `seed` when given.
pub fn side(shape: &ModelShape, num_blocks: u32, seed: Option<u64>, config: EngineConfig) -> Side {
    side_in(Mem::Host, shape, num_blocks, seed, config)
}

/// [`side`] with the KV cache in `mem`.
pub fn side_in(
    mem: Mem,
    shape: &ModelShape,
    num_blocks: u32,
    seed: Option<u64>,
    config: EngineConfig,
) -> Side {
    init_logs();
    side_on(Engine::start(config).unwrap(), mem, shape, num_blocks, seed)
}

/// [`side_in`] on an engine the caller started (with fault injection, say).
pub fn side_on(
    engine: Engine,
    mem: Mem,
    shape: &ModelShape,
    num_blocks: u32,
    seed: Option<u64>,
) -> Side {
    init_logs();
    let bytes = shape.region_bytes(num_blocks);
    let mut emulated = None;
    let region = match mem {
        Mem::Host => engine.allocate_host(bytes, false).unwrap(),
        Mem::Emulated => {
            let mut buf = vec![0u8; bytes as usize].into_boxed_slice();
            // SAFETY: the buffer lives in the returned Side, which drops it after the engine.
            let m = unsafe { kvlink::ExternalMemory::new(buf.as_mut_ptr(), bytes) }.unwrap();
            let r = kvlink::internal::register_emulated_device(&engine, m).unwrap();
            emulated = Some(buf);
            r
        }
        Mem::External => {
            let mut buf = vec![0u8; bytes as usize].into_boxed_slice();
            // SAFETY: the buffer lives in the returned Side, which drops it after the engine.
            let m = unsafe { kvlink::ExternalMemory::new(buf.as_mut_ptr(), bytes) }.unwrap();
            let r = engine.register_host(m).unwrap();
            emulated = Some(buf);
            r
        }
        Mem::EmulatedAlloc => engine
            .allocate_device(kvlink::GpuApi::Emulated, 0, bytes)
            .unwrap(),
        Mem::Cuda => engine
            .allocate_device(kvlink::GpuApi::Cuda, 0, bytes)
            .unwrap(),
    };
    if let Some(seed) = seed {
        kvlink::verify::fill(&region, seed).unwrap();
    }
    let layout = shape.layout(region.id(), num_blocks);
    engine.set_layout(layout.clone()).unwrap();
    Side {
        engine,
        region,
        layout,
        _emulated: emulated,
    }
}

/// Checks every byte of every tensor of every pair: our block `l` equals the prefill's block
/// `r`, the prefill's memory being the pattern of `seed` laid out as `remote`.
pub fn verify(decode: &Side, remote: &KvLayout, seed: u64, local: &[u32], remote_ids: &[u32]) {
    let checked = kvlink::verify::check_blocks(
        &decode.region,
        &decode.layout,
        remote,
        seed,
        local,
        remote_ids,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        checked,
        decode.layout.bytes_per_block() * local.len() as u64
    );
}

/// A small deterministic generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = self.0;
        (x ^ (x >> 33)).wrapping_mul(0xff51afd7ed558ccd) ^ (x >> 29)
    }

    pub fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }

    /// A random permutation of `0..n`.
    pub fn shuffled(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// `requests` disjoint lists of `per` random, non-contiguous local blocks, and for each a list
/// of `per` random remote blocks (repeats allowed across requests).
pub fn random_requests(
    rng: &mut Rng,
    local_blocks: u32,
    remote_blocks: u32,
    requests: usize,
    per: usize,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let local = rng.shuffled(local_blocks);
    assert!(requests * per <= local.len());
    (0..requests)
        .map(|i| {
            let l = local[i * per..(i + 1) * per].to_vec();
            let r = rng.shuffled(remote_blocks)[..per].to_vec();
            (l, r)
        })
        .collect()
}

/// Collects finished entries until `done(&acc)` or `limit` passes.
pub fn collect(engine: &Engine, limit: Duration, done: impl Fn(&Finished) -> bool) -> Finished {
    let end = Instant::now() + limit;
    let mut acc = Finished::default();
    while !done(&acc) && Instant::now() < end {
        acc.extend(engine.wait_finished(end.saturating_duration_since(Instant::now())));
    }
    acc
}

/// Checks the timeline of a read of one source: every step seen, in order, within the
/// report's elapsed time, and the prefill's hold seen.
pub fn check_timeline(r: &kvlink::TransferReport) {
    let t = r.timeline;
    let steps = [t.connected, t.first_byte, t.last_byte, t.confirmed];
    let steps: Vec<Duration> = steps
        .iter()
        .map(|s| s.unwrap_or_else(|| panic!("a step not seen: {t:?}")))
        .collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{t:?}");
    assert!(steps[3] <= r.elapsed, "{t:?} vs {:?}", r.elapsed);
    assert!(t.held.is_some(), "{t:?}");
}

/// Says that the running test did not run for real, and why: the one way a test of these
/// suites says so. Two lines: "`test`: skipped: `reason` (`detail`)" for people, and the
/// record the test command's tally counts (tools/test/tally.py),
/// `kvlink-skip {"test":…,"reason":…,"detail":…}`. The test's name is its thread's: libtest
/// runs each test on a thread named after it. Written to the process's stderr directly
/// (libtest does not capture that, so the skip shows in every run's output), in one write, so
/// that parallel tests cannot interleave inside it.
pub fn skip(reason: &str, detail: &str) {
    use std::io::Write;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test off its own thread");
    let record = format!(
        "{{\"test\":{},\"reason\":{},\"detail\":{}}}",
        json_string(test),
        json_string(reason),
        json_string(detail)
    );
    let lines = format!("{test}: skipped: {reason} ({detail})\nkvlink-skip {record}\n");
    let _ = std::io::stderr().lock().write_all(lines.as_bytes());
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Whether CUDA is loaded here; when it is not, the test is skipped ("no CUDA").
pub fn cuda_loaded() -> bool {
    let e = Engine::start(quick_config()).unwrap();
    match e.capabilities().gpu.cuda {
        Ok(_) => true,
        Err(why) => {
            skip("no CUDA", &why);
            false
        }
    }
}

/// The engine's `bytes_served` once it reaches `want` (or after 5 s): a server counts a
/// response when its write returned, which its reader may see after reporting the read.
pub fn served(engine: &Engine, want: u64) -> u64 {
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while engine.stats().bytes_served < want && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    engine.stats().bytes_served
}

/// An engine configuration with short deadlines for fault tests. Reads go over TCP (the
/// engines of a test share a host; tests/local.rs covers the same-host path).
pub fn quick_config() -> EngineConfig {
    EngineConfig::default().with(|c| {
        c.transport = kvlink::TransportChoice::Tcp;
        c.connect_timeout = Duration::from_secs(2);
        c.handshake_timeout = Duration::from_millis(500);
        c.request_timeout = Duration::from_secs(20);
        c.io_timeout = Duration::from_secs(5);
        c.keepalive = Duration::from_secs(1);
    })
}

const CHILD_ENV: &str = "KVLINK_TEST_CHILD";

/// Body of each test binary's `prefill_child` helper (an ignored test): when this process was
/// spawned by [`ChildPrefill::spawn`], it serves as a prefill worker until its parent goes away;
/// run by hand with `--ignored` and without the spawn's environment, it returns at once.
pub fn prefill_child_main() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    // spec: "<preset> <num_blocks> <seed> <held requests> <tcp|rdma> [growing]"
    let p: Vec<&str> = spec.split_whitespace().collect();
    let shape = ModelShape::preset(p[0]).unwrap();
    let blocks: u32 = p[1].parse().unwrap();
    let seed: u64 = p[2].parse().unwrap();
    let held: usize = p[3].parse().unwrap();
    let mut config = quick_config();
    let mem = if p[4] == "cuda" { Mem::Cuda } else { Mem::Host };
    if p[4] != "cuda" {
        config.transport = p[4].parse().unwrap();
    }
    if config.transport == kvlink::TransportChoice::Rdma {
        config.rdma.device = std::env::var("KVLINK_RDMA_DEVICE").ok();
    }
    let prefill = side_in(mem, &shape, blocks, Some(seed), config);
    // The parent picks the blocks: every block is granted to each held request; a growing
    // hold has its first half only, and never grows (a prompt cut off mid-way).
    let all: Vec<u32> = (0..blocks).collect();
    let growing = p.get(5) == Some(&"growing");
    for i in 0..held {
        let id = format!("req-{i}");
        let hold = HoldRequest::blocks(id, &all[..all.len() / 2]);
        match growing {
            true => prefill.engine.hold_growing(hold).map(drop).unwrap(),
            false => prefill.engine.hold_blocks(hold.id, &all).map(drop).unwrap(),
        }
    }
    // Exit when the parent goes away (stdin closes).
    std::thread::spawn(|| {
        let mut s = String::new();
        while std::io::stdin()
            .read_line(&mut s)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
        std::process::exit(0);
    });
    println!("KVLINK_ADDR {}", prefill.engine.handshake_address());
    loop {
        let f = prefill.engine.wait_finished(Duration::from_secs(1));
        for id in f.sending {
            println!("KVLINK_SENT {id}");
        }
        for fr in f.failed {
            println!("KVLINK_FAILED {} {}", fr.id, fr.reason);
        }
    }
}

/// A prefill worker in a child process (this test binary, re-run as `prefill_child`).
pub struct ChildPrefill {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub addr: String,
}

impl ChildPrefill {
    /// Starts the child and waits for its handshake address.
    pub fn spawn(
        preset: &str,
        blocks: u32,
        seed: u64,
        held: usize,
        transport: &str,
    ) -> ChildPrefill {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "prefill_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                CHILD_ENV,
                format!("{preset} {blocks} {seed} {held} {transport}"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // libtest may print "test prefill_child ... " before the first line.
                if let Some(at) = line.find("KVLINK_") {
                    if tx.send(line[at..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("child prefill started");
        let addr = first
            .strip_prefix("KVLINK_ADDR ")
            .expect("address line")
            .to_string();
        ChildPrefill { child, lines, addr }
    }

    /// Lines with `prefix` seen within `limit`, until `want` of them.
    pub fn wait_lines(&self, prefix: &str, want: usize, limit: Duration) -> Vec<String> {
        let end = Instant::now() + limit;
        let mut got = Vec::new();
        while got.len() < want {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => got.push(l),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        got
    }
}

impl Drop for ChildPrefill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issues `n` reads of `blocks` from the child, kills the child as soon as the first request
/// ends, and collects until all `n` have ended (or `limit` passes). Returns everything that
/// finished and how long it took from the first read. The child must hold `req-0` to
/// `req-{n-1}` (spawn it with `n` held requests).
pub fn kill_peer_mid_transfer(
    decode: &Side,
    child: &mut ChildPrefill,
    blocks: &[u32],
    n: usize,
    limit: Duration,
) -> (Finished, Duration) {
    let t0 = Instant::now();
    for i in 0..n {
        decode
            .engine
            .read_blocks(&child.addr, format!("req-{i}"), blocks, blocks)
            .unwrap();
    }
    let mut f = collect(&decode.engine, limit, |f| !f.is_empty());
    child.child.kill().unwrap();
    child.child.wait().unwrap();
    let rest = collect(&decode.engine, limit, |acc| {
        acc.receiving.len() + acc.failed.len() + f.receiving.len() + f.failed.len() == n
    });
    f.extend(rest);
    (f, t0.elapsed())
}

/// Opens TCP connections from chosen loopback addresses.
pub struct Dialer(tokio::runtime::Runtime);

impl Dialer {
    pub fn new() -> Dialer {
        Dialer(
            tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .unwrap(),
        )
    }

    /// A TCP connection from `src` (a loopback address of the caller's choice) to `dst`.
    pub fn connect(&self, src: std::net::IpAddr, dst: std::net::SocketAddr) -> std::net::TcpStream {
        let s = self
            .0
            .block_on(async {
                let s = tokio::net::TcpSocket::new_v4()?;
                s.bind(std::net::SocketAddr::new(src, 0))?;
                s.connect(dst).await
            })
            .unwrap()
            .into_std()
            .unwrap();
        s.set_nonblocking(false).unwrap();
        s
    }
}

/// Waits (up to 10 s) until `f` holds, checking every few milliseconds; fails naming `what`.
pub fn eventually(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads `d` until it closes, is reset, or stays silent for 10 s; returns the bytes read (a
/// response that stops when its hold ends is judged by their count).
pub fn drain(d: &mut std::net::TcpStream) -> u64 {
    use std::io::Read;
    d.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match d.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return got
            }
            Err(e) => panic!("{e}"),
        }
    }
}
