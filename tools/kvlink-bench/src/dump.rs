//! `dump`: the byte ranges a loopback run reads, written out so that other transfer engines
//! (tools/bench-peers) can move exactly the same pieces between caches of the same sizes.
//!
//! File format: one JSON line (the sizes and counts), then for each request its pieces as
//! little-endian u64 triples `(remote_offset, local_offset, len)`, the request's count given in
//! the header's `pieces` list. Requests come in the order a run submits them (warm-up first);
//! request `i` uses the local slot `i % concurrency`, as a run with steady completions does.

use std::io::Write;

use kvlink::internal::{plan, PlanOptions};
use kvlink::{RegionId, TpRank};

use crate::args::Args;
use crate::workload::{pick, Rng};

/// Writes the pieces of `args`'s warm-up and measured requests to `args.out`.
pub(crate) fn dump(args: &Args) -> Result<(), String> {
    if args.tp_run() || args.groups != 1 || args.prefill_block_tokens.is_some() {
        return Err("dump supports one TP rank a side, one block group, one block size".into());
    }
    let blocks = args.cache_blocks();
    let layout = |id| {
        args.shape
            .layout_tp(RegionId(id), blocks, TpRank::SOLO, args.head_major)
            .map_err(|e| e.to_string())
    };
    let (local, remote) = (layout(1)?, layout(2)?);
    let region_bytes = args
        .shape
        .region_bytes_tp(blocks, 1)
        .map_err(|e| e.to_string())?;
    let per = args.blocks_per_request();
    let span = blocks / args.concurrency as u32;
    if span < per {
        return Err(format!(
            "caches too small: {per} blocks per request, {span} per slot (raise --blocks)"
        ));
    }
    // As the engine plans: runs split at its batch size.
    let opts = PlanOptions {
        max_segment_bytes: args.batch_bytes,
    };
    let mut rng = Rng::for_run(args.seed);
    let total = args.warmup + args.requests;
    let mut body = Vec::new();
    let mut counts = Vec::with_capacity(total);
    let mut sizes = Vec::with_capacity(total);
    for i in 0..total {
        let slot = (i % args.concurrency) as u32;
        let (l, r) = pick(
            &mut rng,
            args.pattern,
            (per, per),
            slot * span,
            span,
            blocks,
        );
        let p = plan(&local, &remote, &l, &r, opts).map_err(|e| e.to_string())?;
        counts.push(p.segments.len());
        sizes.push(p.bytes);
        for s in &p.segments {
            for v in [s.remote_offset, s.local_offset, s.len] {
                body.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let header = format!(
        "{{\"preset\":\"{}\",\"tokens\":{},\"pattern\":\"{}\",\"local_bytes\":{region_bytes},\"remote_bytes\":{region_bytes},\"bytes\":{sizes:?},\"warmup\":{},\"requests\":{},\"concurrency\":{},\"pieces\":{counts:?}}}\n",
        args.shape.name,
        args.tokens,
        format!("{:?}", args.pattern).to_lowercase(),
        args.warmup,
        args.requests,
        args.concurrency,
    );
    let mut f = std::fs::File::create(&args.out).map_err(|e| format!("{}: {e}", args.out))?;
    f.write_all(header.as_bytes())
        .and_then(|_| f.write_all(&body))
        .map_err(|e| format!("{}: {e}", args.out))?;
    eprintln!(
        "kvlink-bench dump: {total} requests ({} pieces each on average) to {}",
        counts.iter().sum::<usize>() / total.max(1),
        args.out
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's `pieces` counts and the triples that follow it.
    fn read(path: &std::path::Path) -> (String, Vec<usize>, Vec<[u64; 3]>) {
        let raw = std::fs::read(path).unwrap();
        let nl = raw.iter().position(|&b| b == b'\n').unwrap();
        let head = String::from_utf8(raw[..nl].to_vec()).unwrap();
        let list = head.split("\"pieces\":[").nth(1).unwrap();
        let list = &list[..list.find(']').unwrap()];
        let counts = list.split(", ").map(|n| n.parse().unwrap()).collect();
        let words: Vec<u64> = raw[nl + 1..]
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let triples = words.chunks(3).map(|t| [t[0], t[1], t[2]]).collect();
        (head, counts, triples)
    }

    fn dump_to(path: &std::path::Path, extra: &[&str]) -> (String, Vec<usize>, Vec<[u64; 3]>) {
        let mut argv = vec!["dump", "--out", path.to_str().unwrap()];
        argv.extend_from_slice(extra);
        dump(&crate::args::parse_from(argv).unwrap()).unwrap();
        read(path)
    }

    #[test]
    fn pieces_cover_each_request_inside_both_caches() {
        let dir = std::env::temp_dir().join(format!("kvlink-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("w.bin");
        let (head, counts, pieces) = dump_to(&f, &["--tokens", "64", "--requests", "3"]);
        assert_eq!(counts.len(), 5, "2 warm-up and 3 measured requests: {head}");
        assert_eq!(counts.iter().sum::<usize>(), pieces.len());
        // Llama-3-8B: 32 layers x K and V x 8 heads x 128 x 2 bytes per token.
        let per_token = 32 * 2 * 8 * 128 * 2;
        let cache: u64 = per_token * 64 * 2 * 2; // 2 x blocks per request x concurrency
        assert!(head.contains(&format!("\"local_bytes\":{cache}")), "{head}");
        let mut at = 0;
        for n in counts {
            let req = &pieces[at..at + n];
            at += n;
            assert_eq!(req.iter().map(|p| p[2]).sum::<u64>(), per_token * 64);
            for [r, l, len] in req {
                assert!(r + len <= cache && l + len <= cache && *len > 0);
            }
        }
        // The same options draw the same pieces; another seed draws others.
        let again = dump_to(&f, &["--tokens", "64", "--requests", "3"]).2;
        assert_eq!(again, pieces);
        let other = dump_to(&f, &["--tokens", "64", "--requests", "3", "--seed", "9"]).2;
        assert_ne!(other, pieces);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
