//! Reporting results: byte and latency formatting, the text or JSON summary of a run, and the
//! sweep's table, CSV file and PNG chart.

use std::time::Duration;

use crate::args::{Args, Memory};
use crate::outcome::Outcome;

pub(crate) fn fmt_bytes(b: f64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", U[i])
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

/// What a run's reports add up to.
struct Summary {
    bytes: u64,
    segments: usize,
    wrs: u64,
    /// Requests (at least 1, to divide by).
    n: usize,
    per_bytes: u64,
    secs: f64,
    gbps: f64,
    p50: Duration,
    p99: Duration,
    max: Duration,
    pieces: u64,
    pattern: String,
    transport: &'static str,
}

impl Summary {
    fn of(args: &Args, o: &Outcome) -> Summary {
        let bytes: u64 = o.reports.iter().map(|r| r.bytes).sum();
        let n = o.reports.len().max(1);
        let secs = o.wall.as_secs_f64().max(1e-9);
        let mut lat: Vec<Duration> = o.reports.iter().map(|r| r.elapsed).collect();
        lat.sort();
        Summary {
            bytes,
            segments: o.reports.iter().map(|r| r.segments).sum(),
            wrs: o.reports.iter().map(|r| r.work_requests).sum(),
            n,
            per_bytes: bytes / n as u64,
            secs,
            gbps: bytes as f64 / secs / 1e9,
            p50: percentile(&lat, 0.5),
            p99: percentile(&lat, 0.99),
            max: lat.last().copied().unwrap_or_default(),
            pieces: u64::from(args.blocks_per_request())
                * (args.shape.layers * args.shape.tensors_per_layer) as u64
                + args.state.map_or(0, |s| u64::from(s.layers)),
            pattern: format!("{:?}", args.pattern).to_lowercase(),
            transport: o.reports.first().map(|r| r.transport).unwrap_or("tcp"),
        }
    }
}

/// Prints a run's report: one JSON line with `--json`, else a table for people.
pub(crate) fn report(args: &Args, mode: &str, o: &Outcome) {
    let sum = Summary::of(args, o);
    if args.json {
        print_json(args, mode, o, &sum);
    } else {
        print_text(args, mode, o, &sum);
    }
}

fn print_json(args: &Args, mode: &str, o: &Outcome, s: &Summary) {
    println!(
            "{{\"mode\":\"{mode}\",\"transport\":\"{transport}\",\"preset\":\"{}\",\"tokens\":{},\"pattern\":\"{pattern}\",\"requests\":{},\"concurrency\":{},\"streams\":{},\"qps\":{},\"batch_bytes\":{},\"bytes\":{bytes},\"seconds\":{secs:.6},\"gb_per_s\":{gbps:.4},\"bytes_per_request\":{per_bytes},\"segments_per_request\":{},\"pieces_per_request\":{pieces},\"segments_per_s\":{:.1},\"work_requests_per_s\":{:.1},\"cpu_seconds\":{:.3},\"latency_ms\":{{\"p50\":{:.3},\"p99\":{:.3},\"max\":{:.3}}},\"verified_bytes\":{},\"memory\":\"{}\",\"reference_gb_per_s\":{},\"bytes_staged_out\":{},\"bytes_staged_in\":{},\"prefill_tp\":{},\"decode_tp\":{},\"groups\":{},\"head_layout\":\"{}\"{extra}}}",
            args.shape.name, args.tokens, o.reports.len(), args.concurrency, args.streams, args.qps, args.batch_bytes,
            s.segments / s.n, s.segments as f64 / s.secs, s.wrs as f64 / s.secs, o.cpu,
            s.p50.as_secs_f64() * 1e3, s.p99.as_secs_f64() * 1e3, s.max.as_secs_f64() * 1e3, o.verified,
            memory_name(args.memory), o.reference_gbps.map_or("null".to_string(), |r| format!("{r:.4}")),
            o.staged.0, o.staged.1, args.prefill_tp, args.decode_tp, args.groups + u32::from(args.state.is_some()),
            if args.head_major { "hnd" } else { "nhd" },
            transport = s.transport, pattern = s.pattern, bytes = s.bytes, secs = s.secs,
            gbps = s.gbps, per_bytes = s.per_bytes, pieces = s.pieces, extra = hybrid_json(args, o) + &steps_json(o) + &observed_json(o),
        );
}

/// The latency callers observed (`observed_ms`: from the read call to `wait_finished`
/// returning the request), p50 and p99.
fn observed_json(o: &Outcome) -> String {
    let mut v = o.observed.clone();
    v.sort();
    let ms = |p| percentile(&v, p).as_secs_f64() * 1e3;
    let idle = o
        .idle_cpu
        .map_or(String::new(), |c| format!(",\"idle_cpu_seconds\":{c:.3}"));
    let per = o.reports.len().max(1) as f64;
    format!(
        ",\"observed_ms\":{{\"p50\":{:.3},\"p99\":{:.3}}},\"cpu_us_per_request\":{:.1},\"switches_per_request\":{:.2}{idle}",
        ms(0.5),
        ms(0.99),
        o.cpu * 1e6 / per,
        o.switches as f64 / per
    )
}

/// The median of each step of a request's timeline, in microseconds from the read call
/// (`steps_us`): where a read's time goes (session up, first byte, last byte, confirmed).
fn steps_json(o: &Outcome) -> String {
    type Step = fn(&kvlink::Timeline) -> Option<Duration>;
    let steps: [(&str, Step); 4] = [
        ("connected", |t| t.connected),
        ("first_byte", |t| t.first_byte),
        ("last_byte", |t| t.last_byte),
        ("confirmed", |t| t.confirmed),
    ];
    let fields: Vec<String> = steps
        .iter()
        .filter_map(|(name, step)| {
            let mut v: Vec<Duration> = o.reports.iter().filter_map(|r| step(&r.timeline)).collect();
            v.sort();
            (!v.is_empty())
                .then(|| format!("\"{name}\":{:.1}", percentile(&v, 0.5).as_secs_f64() * 1e6))
        })
        .collect();
    format!(",\"steps_us\":{{{}}}", fields.join(","))
}

/// A hybrid preset's state and the dense preset's run beside it, as JSON fields (with their
/// leading comma), or nothing.
fn hybrid_json(args: &Args, o: &Outcome) -> String {
    let Some(state) = args.state else {
        return String::new();
    };
    let mut out = format!(
        ",\"state_layers\":{},\"state_page_bytes\":{}",
        state.layers, state.page_bytes
    );
    if let Some(d) = &o.dense {
        let ds = Summary::of(&d.0, &d.1);
        out += &format!(
            ",\"dense\":{{\"preset\":\"{}\",\"bytes_per_request\":{},\"gb_per_s\":{:.4},\"latency_ms\":{{\"p50\":{:.3},\"p99\":{:.3}}}}}",
            d.0.shape.name,
            ds.per_bytes,
            ds.gbps,
            ds.p50.as_secs_f64() * 1e3,
            ds.p99.as_secs_f64() * 1e3
        );
    }
    out
}

/// A hybrid preset's lines: its state, and the dense preset's run beside it.
fn print_hybrid(args: &Args, o: &Outcome, gbps: f64) {
    let Some(state) = args.state else {
        return;
    };
    println!(
        "  state      {} state layers, one page of {} each per request (block group 1, beside the attention blocks' group 0), read whole",
        state.layers,
        fmt_bytes((state.page_bytes / u64::from(args.decode_tp)) as f64)
    );
    if let Some(d) = &o.dense {
        let ds = Summary::of(&d.0, &d.1);
        println!(
            "  dense      {} in the same run, same options: {:.2} GB/s ({} per request), p50 {:.1} ms p99 {:.1} ms; this run: {:.2}x of its GB/s",
            d.0.shape.name,
            ds.gbps,
            fmt_bytes(ds.per_bytes as f64),
            ds.p50.as_secs_f64() * 1e3,
            ds.p99.as_secs_f64() * 1e3,
            gbps / ds.gbps.max(1e-9)
        );
    }
}

// Long: one println per line of the report, in the order they print.
fn print_text(args: &Args, mode: &str, o: &Outcome, sum: &Summary) {
    let Summary {
        bytes,
        segments,
        wrs,
        n,
        per_bytes,
        secs,
        gbps,
        p50,
        p99,
        max,
        pieces,
        ref pattern,
        transport,
    } = *sum;
    println!(
        "kvlink-bench {mode}: {transport}, {} ({} tensors, {} per block per tensor), {} tokens/request ({} blocks, {}), pattern {pattern}",
        args.shape.name,
        args.shape.layers * args.shape.tensors_per_layer,
        fmt_bytes(args.shape.block_bytes() as f64),
        args.tokens,
        args.blocks_per_request(),
        fmt_bytes(per_bytes as f64),
    );
    if args.tp_run() {
        println!(
            "  tp         prefill TP {} -> decode TP {}{}, {} block group{}, {} blocks: each request read by every decode rank; bandwidth and requests count all decode ranks",
            args.prefill_tp,
            args.decode_tp,
            if args.mode == crate::args::Mode::Read {
                format!(" (this process: decode rank {})", args.tp_rank)
            } else {
                String::new()
            },
            args.groups + u32::from(args.state.is_some()),
            if args.groups == 1 && args.state.is_none() {
                ""
            } else {
                "s"
            },
            if args.head_major {
                "head-major (HND)"
            } else {
                "token-major (NHD)"
            },
        );
    }
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
    let mut seen = o.observed.clone();
    seen.sort();
    println!(
        "  observed   p50 {:.1} us   p99 {:.1} us   (read call to wait_finished returning it)",
        percentile(&seen, 0.5).as_secs_f64() * 1e6,
        percentile(&seen, 0.99).as_secs_f64() * 1e6,
    );
    println!(
        "  per read   {:.1} us of CPU, {:.2} context switches (both engines and the caller)",
        o.cpu * 1e6 / n as f64,
        o.switches as f64 / n as f64
    );
    if let (Some(c), Some(secs)) = (o.idle_cpu, args.idle_secs) {
        println!(
            "  idle       {c:.3} CPU s over {secs} s, both engines, session open, callers waiting"
        );
    }
    print_hybrid(args, o, gbps);
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
