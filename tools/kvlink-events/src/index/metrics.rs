//! The index service's Prometheus metrics (text format 0.0.4).

use std::fmt::Write;
use std::sync::atomic::Ordering;

use super::{state_name, Service};

/// A label value, escaped as the text format wants.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Every metric, rendered.
pub(super) fn render(s: &Service) -> String {
    let mut out = String::new();
    holders(s, &mut out);
    engines(s, &mut out);
    let st = s.shards.stats();
    for (name, help, v) in [
        (
            "kvlink_index_blocks_stored_total",
            "Blocks stored.",
            st.stored,
        ),
        (
            "kvlink_index_blocks_removed_total",
            "Blocks removed.",
            st.removed,
        ),
        (
            "kvlink_index_unknown_removed_total",
            "Removals of blocks not held.",
            st.unknown_removed,
        ),
        (
            "kvlink_index_unknown_parent_total",
            "Stores whose parent was not held.",
            st.unknown_parent,
        ),
        (
            "kvlink_index_dropped_total",
            "Blocks dropped at the index's limits.",
            st.dropped,
        ),
    ] {
        head(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {v}");
    }
    out
}

fn holders(s: &Service, out: &mut String) {
    let all = s.shards.holders();
    head(
        out,
        "kvlink_index_holder_blocks",
        "gauge",
        "Blocks a holder holds.",
    );
    let key = |k: &kvlink_events::HolderKey| {
        format!(
            "engine=\"{}\",dp_rank=\"{}\",medium=\"{}\",group=\"{}\"",
            label(&k.engine),
            k.dp_rank,
            label(&k.medium),
            k.group
        )
    };
    for (k, _, blocks, _) in &all {
        let _ = writeln!(out, "kvlink_index_holder_blocks{{{}}} {blocks}", key(k));
    }
    head(
        out,
        "kvlink_index_holder_withheld_blocks",
        "gauge",
        "Blocks withheld from answers (held from before a loss).",
    );
    for (k, _, _, withheld) in &all {
        let _ = writeln!(
            out,
            "kvlink_index_holder_withheld_blocks{{{}}} {withheld}",
            key(k)
        );
    }
    head(
        out,
        "kvlink_index_holder_state",
        "gauge",
        "1 for the holder's state (exact, recovering, stale).",
    );
    for (k, state, _, _) in &all {
        let _ = writeln!(
            out,
            "kvlink_index_holder_state{{{},state=\"{}\"}} 1",
            key(k),
            state_name(*state)
        );
    }
}

fn engines(s: &Service, out: &mut String) {
    let engines = s.engines.lock().expect("engines lock");
    let mut names: Vec<&String> = engines.keys().collect();
    names.sort();
    let series = [
        ("kvlink_index_batches_total", "counter", "Batches applied."),
        (
            "kvlink_index_resyncs_total",
            "counter",
            "Resyncs, by reason.",
        ),
        (
            "kvlink_index_gaps_filled_total",
            "counter",
            "Gaps filled by replay.",
        ),
        (
            "kvlink_index_snapshots_total",
            "counter",
            "Snapshots of the engine's live blocks loaded.",
        ),
        (
            "kvlink_index_malformed_total",
            "counter",
            "Unreadable batches.",
        ),
        (
            "kvlink_index_lag_seconds",
            "gauge",
            "Seconds since the last batch's publisher timestamp.",
        ),
        (
            "kvlink_index_engine_connected",
            "gauge",
            "1 while the engine's subscriber is up.",
        ),
    ];
    for (name, kind, help) in series {
        head(out, name, kind, help);
        for n in &names {
            let st = &engines[*n].stats;
            let e = format!("engine=\"{}\"", label(n));
            let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let _ = match name {
                "kvlink_index_batches_total" => writeln!(out, "{name}{{{e}}} {}", get(&st.batches)),
                "kvlink_index_resyncs_total" => writeln!(
                    out,
                    "{name}{{{e},reason=\"publisher_restart\"}} {}\n{name}{{{e},reason=\"history_lost\"}} {}",
                    get(&st.restarts),
                    get(&st.lost)
                ),
                "kvlink_index_gaps_filled_total" => writeln!(out, "{name}{{{e}}} {}", get(&st.gaps_filled)),
                "kvlink_index_snapshots_total" => writeln!(out, "{name}{{{e}}} {}", get(&st.snapshots)),
                "kvlink_index_malformed_total" => writeln!(out, "{name}{{{e}}} {}", get(&st.malformed)),
                "kvlink_index_lag_seconds" => match st.lag_s() {
                    Some(l) => writeln!(out, "{name}{{{e}}} {l:.3}"),
                    None => Ok(()),
                },
                _ => writeln!(out, "{name}{{{e}}} {}", u8::from(st.connected.load(Ordering::Relaxed))),
            };
        }
    }
}
