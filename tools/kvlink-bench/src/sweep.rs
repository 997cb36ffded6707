//! `sweep`: loopback runs over the values of one parameter, as a table, a CSV file and a chart.

use std::time::Duration;

use kvlink::ModelShape;

use crate::args::Args;
use crate::chart;
use crate::drive::loopback;
use crate::report::{fmt_bytes, percentile};
use crate::workload::Rng;

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
