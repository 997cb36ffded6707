//! Reporting results: byte and latency formatting, the text or JSON summary of a run, and the
//! sweep's table, CSV file and PNG chart.

use std::time::Duration;

use kvlink::ModelShape;

use crate::args::{Args, Memory};
use crate::chart;
use crate::drive::{loopback, Outcome};
use crate::workload::Rng;

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

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

pub(crate) fn report(args: &Args, mode: &str, o: &Outcome) {
    let bytes: u64 = o.reports.iter().map(|r| r.bytes).sum();
    let segments: usize = o.reports.iter().map(|r| r.segments).sum();
    let wrs: u64 = o.reports.iter().map(|r| r.work_requests).sum();
    let n = o.reports.len().max(1);
    let per_bytes = bytes / n as u64;
    let secs = o.wall.as_secs_f64().max(1e-9);
    let gbps = bytes as f64 / secs / 1e9;
    let mut lat: Vec<Duration> = o.reports.iter().map(|r| r.elapsed).collect();
    lat.sort();
    let (p50, p99, max) = (
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or_default(),
    );
    let pieces = u64::from(args.blocks_per_request())
        * (args.shape.layers * args.shape.tensors_per_layer) as u64;
    let pattern = format!("{:?}", args.pattern).to_lowercase();
    let transport = o.reports.first().map(|r| r.transport).unwrap_or("tcp");
    if args.json {
        println!(
            "{{\"mode\":\"{mode}\",\"transport\":\"{transport}\",\"preset\":\"{}\",\"tokens\":{},\"pattern\":\"{pattern}\",\"requests\":{},\"concurrency\":{},\"streams\":{},\"qps\":{},\"batch_bytes\":{},\"bytes\":{bytes},\"seconds\":{secs:.6},\"gb_per_s\":{gbps:.4},\"bytes_per_request\":{per_bytes},\"segments_per_request\":{},\"pieces_per_request\":{pieces},\"segments_per_s\":{:.1},\"work_requests_per_s\":{:.1},\"cpu_seconds\":{:.3},\"latency_ms\":{{\"p50\":{:.3},\"p99\":{:.3},\"max\":{:.3}}},\"verified_bytes\":{},\"memory\":\"{}\",\"reference_gb_per_s\":{},\"bytes_staged_out\":{},\"bytes_staged_in\":{},\"prefill_tp\":{},\"decode_tp\":{},\"groups\":{},\"head_layout\":\"{}\"}}",
            args.shape.name, args.tokens, o.reports.len(), args.concurrency, args.streams, args.qps, args.batch_bytes,
            segments / n, segments as f64 / secs, wrs as f64 / secs, o.cpu,
            p50.as_secs_f64() * 1e3, p99.as_secs_f64() * 1e3, max.as_secs_f64() * 1e3, o.verified,
            memory_name(args.memory), o.reference_gbps.map_or("null".to_string(), |r| format!("{r:.4}")),
            o.staged.0, o.staged.1, args.prefill_tp, args.decode_tp, args.groups,
            if args.head_major { "hnd" } else { "nhd" }
        );
        return;
    }
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
            args.groups,
            if args.groups == 1 { "" } else { "s" },
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

/// Loopback runs over the values of one parameter: a table on stdout, `<out>.csv` and a chart
/// `<out>.png` of bandwidth against the parameter.
pub(crate) fn sweep(args: &Args) -> Result<(), String> {
    let param = args.param.clone().expect("checked in parse_args");
    let mut rows = Vec::new();
    println!("| {param} | transport | GB/s | segments/request | p50 ms | p99 ms |");
    println!("|---|---|---|---|---|---|");
    for &v in &args.values {
        let mut a = args.clone();
        a.json = true; // no progress bars inside a sweep
        match param.as_str() {
            "message-bytes" => {
                a.shape = ModelShape {
                    name: "custom",
                    layers: 1,
                    tensors_per_layer: 1,
                    bytes_per_token: v,
                    kv_heads: 0,
                    tokens_per_block: 1,
                    dtype: "u8",
                };
                // About 64 MiB per request, whatever the message size.
                a.tokens = ((64u64 << 20) / v).clamp(1, 4096) as u32;
            }
            "tokens" => a.tokens = v as u32,
            "concurrency" => a.concurrency = v as usize,
            "qps" => a.qps = v as u16,
            "streams" => a.streams = v as u16,
            _ => unreachable!("checked in parse_args"),
        }
        let o = loopback(&a, &mut Rng::for_run(a.seed))?;
        let bytes: u64 = o.reports.iter().map(|r| r.bytes).sum();
        let gbps = bytes as f64 / o.wall.as_secs_f64().max(1e-9) / 1e9;
        let n = o.reports.len().max(1);
        let mut lat: Vec<Duration> = o.reports.iter().map(|r| r.elapsed).collect();
        lat.sort();
        let transport = o.reports.first().map(|r| r.transport).unwrap_or("-");
        let label = if param == "message-bytes" {
            fmt_bytes(v as f64).replace(".0 ", "")
        } else {
            v.to_string()
        };
        let segs = o.reports.iter().map(|r| r.segments).sum::<usize>() / n;
        let (p50, p99) = (
            percentile(&lat, 0.5).as_secs_f64() * 1e3,
            percentile(&lat, 0.99).as_secs_f64() * 1e3,
        );
        println!("| {label} | {transport} | {gbps:.3} | {segs} | {p50:.1} | {p99:.1} |");
        rows.push((label, v, transport, gbps, segs, p50, p99));
    }
    let mut csv = format!("{param},transport,gb_per_s,segments_per_request,p50_ms,p99_ms\n");
    for (_, v, t, g, s, p50, p99) in &rows {
        csv.push_str(&format!("{v},{t},{g:.4},{s},{p50:.3},{p99:.3}\n"));
    }
    let csv_path = format!("{}.csv", args.out);
    std::fs::write(&csv_path, csv).map_err(|e| format!("writing {csv_path}: {e}"))?;
    let transport = rows.first().map(|r| r.2).unwrap_or("tcp");
    let png = chart::line_chart(
        &format!(
            "KVLINK {} BANDWIDTH ({})",
            transport.to_uppercase(),
            if param == "message-bytes" {
                "RANDOM READS".to_string()
            } else {
                args.shape.name.to_uppercase()
            }
        ),
        &param.to_uppercase(),
        "GB/S",
        &rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
        &[chart::Series {
            name: "KVLINK".into(),
            color: [31, 119, 180],
            values: rows.iter().map(|r| r.3).collect(),
        }],
    );
    let png_path = format!("{}.png", args.out);
    std::fs::write(&png_path, png).map_err(|e| format!("writing {png_path}: {e}"))?;
    eprintln!("kvlink-bench sweep: wrote {csv_path} and {png_path}");
    Ok(())
}
