//! Hostile load on one engine, each test alone in this binary (they measure the process):
//! a partial-frame flood from many addresses keeps the engine's memory under a stated bound,
//! and connection churn keeps its log to a few lines per second.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use kvlink::{AuthKey, ModelShape};

/// The tests here measure the whole process: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// The soft limit on open files.
fn fd_limit() -> usize {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    line.split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
}

const MIB: u64 = 1 << 20;

/// Resident memory once it stopped moving: three samples 20 ms apart within 64 KiB of each
/// other (at most 10 s).
fn settled_rss() -> u64 {
    let end = Instant::now() + Duration::from_secs(10);
    let mut last = [rss(), u64::MAX, 0];
    loop {
        std::thread::sleep(Duration::from_millis(20));
        last = [rss(), last[0], last[1]];
        let (lo, hi) = (last.iter().min().unwrap(), last.iter().max().unwrap());
        if hi - lo <= 64 << 10 || Instant::now() > end {
            return last[0];
        }
    }
}

#[test]
fn a_partial_frame_flood_stays_under_its_memory_bound() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let config = quick_config().with(|c| {
        c.auth_key = Some(AuthKey::new(b"flood-deployment-key-0123456789".to_vec()).unwrap());
        // Long enough that every flooding connection is still open when memory is measured.
        c.handshake_timeout = Duration::from_secs(20);
    });
    let prefill = side(&shape, 8, Some(51), config);
    let control = prefill.engine.handshake_address();
    let dialer = Dialer::new();
    // 64 connections from each of up to 32 addresses (each under the per-address cap), as
    // many as this process's open-file limit allows (both ends live here).
    let per_addr = 64;
    let conns = 2048.min((fd_limit().saturating_sub(256)) / 2) / per_addr * per_addr;
    assert!(conns >= 256, "open-file limit too low: {}", fd_limit());
    let before = rss();
    let t0 = Instant::now();
    let mut flood = Vec::with_capacity(conns);
    for i in 0..conns {
        let src = IpAddr::V4(Ipv4Addr::new(127, 0, 1, (10 + i / per_addr) as u8));
        let mut s = dialer.connect(src, control);
        // The largest frame an unauthenticated peer may announce, all but its last byte sent.
        let len = 4096u32;
        s.write_all(&len.to_be_bytes()).unwrap();
        s.write_all(&vec![0x5a; len as usize - 1]).unwrap();
        flood.push(s);
    }
    eventually("every flooding connection admitted", || {
        prefill.engine.stats().control_connections == conns as u64
    });
    let during = settled_rss();
    let sent = conns as u64 * 4099;
    let growth = during.saturating_sub(before);
    eprintln!(
        "flood: {conns} connections sent {:.1} MiB of partial frames in {:.1} s; RSS {:.1} -> {:.1} MiB (+{:.1} MiB, {:.1} KiB per connection)",
        sent as f64 / MIB as f64,
        t0.elapsed().as_secs_f64(),
        before as f64 / MIB as f64,
        during as f64 / MIB as f64,
        growth as f64 / MIB as f64,
        growth as f64 / 1024.0 / conns as f64,
    );
    // The bound: before authentication a connection costs at most its 4 KiB frame buffer plus
    // its task; 32 KiB per connection leaves room for the allocator.
    let bound = conns as u64 * 32 * 1024;
    assert!(growth < bound, "RSS grew {growth} bytes, bound {bound}");
    assert_eq!(prefill.engine.stats().handshakes_accepted, 0);
    drop(flood);
    eventually("every flooding connection closed", || {
        prefill.engine.stats().control_connections == 0
    });
    let after = settled_rss();
    eprintln!(
        "flood: after the connections closed, RSS {:.1} MiB",
        after as f64 / MIB as f64
    );
    assert!(after.saturating_sub(before) < bound);
    // The engine still serves a reader.
    let decode = side(
        &shape,
        8,
        None,
        quick_config().with(|c| {
            c.auth_key = Some(AuthKey::new(b"flood-deployment-key-0123456789".to_vec()).unwrap());
        }),
    );
    prefill.engine.hold_blocks("after-flood", &[3]).unwrap();
    decode
        .engine
        .read_blocks(&control.to_string(), "after-flood", &[1], &[3])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
}

/// Lines and bytes the engine logged at WARN and above.
static LINES: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

struct Counting;

impl Write for Counting {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LINES.fetch_add(
            buf.iter().filter(|b| **b == b'\n').count(),
            Ordering::Relaxed,
        );
        BYTES.fetch_add(buf.len(), Ordering::Relaxed);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn connection_churn_logs_a_few_lines_per_second() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(|| Counting)
        .try_init()
        .expect("the only subscriber of this binary");
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let prefill = side(&shape, 8, Some(52), quick_config());
    let control = prefill.engine.handshake_address();
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    let lines0 = LINES.load(Ordering::Relaxed);
    let bytes0 = BYTES.load(Ordering::Relaxed);
    let t0 = Instant::now();
    // At least 1,500 rounds and 2.5 s, so that several one-second intervals pass.
    let mut rounds = 0;
    let mut sink = Vec::new();
    while rounds < 1500 || t0.elapsed() < Duration::from_millis(2500) {
        rounds += 1;
        // A frame too short to be one: refused, with an Error frame, then closed.
        let mut c = TcpStream::connect(control).unwrap();
        c.write_all(&1u32.to_be_bytes()).unwrap();
        sink.clear();
        let _ = c.read_to_end(&mut sink);
        // A data request with a bad magic: dropped.
        let mut d = TcpStream::connect(data).unwrap();
        d.write_all(&[0xAB; 20]).unwrap();
        let _ = d.read_to_end(&mut sink);
    }
    let took = t0.elapsed();
    let lines = LINES.load(Ordering::Relaxed) - lines0;
    let bytes = BYTES.load(Ordering::Relaxed) - bytes0;
    let events = 2 * rounds;
    eprintln!(
        "churn: {events} refused connections in {:.1} s logged {lines} lines ({bytes} bytes)",
        took.as_secs_f64()
    );
    assert_eq!(prefill.engine.stats().handshakes_refused, rounds as u64);
    // Each kind of refusal logs at most one line per second (with the count in between).
    let bound = 4 * (took.as_secs() as usize + 2);
    assert!(
        lines <= bound,
        "{lines} lines for {events} events in {took:?}"
    );
    assert!(lines >= 2, "the refusals were logged at all: {lines} lines");
}
