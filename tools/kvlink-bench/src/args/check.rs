//! What the options must agree on once all are read: the cache's shape, the TP sizes, ranks
//! and groups against it, and what each mode needs.

use kvlink::ModelShape;

use super::{Args, Mode, ShapeOptions};

/// Applies the shape options: `--block-bytes` (with `--tensors`) makes a custom shape; the
/// TP sizes, groups and heads are checked against the shape; `--block-tokens` sets a
/// preset's block size.
pub(super) fn settle_shape(a: &mut Args, shape: ShapeOptions) -> Result<(), String> {
    if let Some(b) = shape.block_bytes {
        let tensors = shape.tensors.unwrap_or(1);
        if b == 0 || tensors == 0 {
            return Err("--block-bytes and --tensors must be at least 1".into());
        }
        a.shape = ModelShape {
            name: "custom",
            layers: tensors,
            tensors_per_layer: 1,
            bytes_per_token: b,
            kv_heads: 0,
            tokens_per_block: 1,
            dtype: "u8",
        };
    }
    check_tp(a)?;
    check_state(a, shape.block_bytes.is_some())?;
    if let Some(t) = shape.block_tokens {
        if t == 0 || shape.block_bytes.is_some() {
            return Err(
                "--block-tokens must be at least 1 and applies to presets, not --block-bytes"
                    .into(),
            );
        }
        a.shape.tokens_per_block = t;
    }
    check_block_sizes(a, shape.block_bytes.is_some())
}

/// A hybrid preset's state: read whole by a decode of the prefill's TP size (its pages
/// declare no heads), in the block group after the attention layers' one.
fn check_state(a: &Args, custom: bool) -> Result<(), String> {
    let Some(state) = a.state else {
        return Ok(());
    };
    if custom {
        return Err("--block-bytes makes a custom layout, which has no state layers".into());
    }
    if a.prefill_tp != a.decode_tp {
        return Err(format!(
            "{}: the state pages are read whole, so the prefill and decode TP sizes must be equal (got {} and {})",
            a.shape.name, a.prefill_tp, a.decode_tp
        ));
    }
    if a.groups != 1 || a.prefill_block_tokens.is_some() {
        return Err(format!(
            "{}: its attention layers are block group 0 and its state layers group 1; --groups and --prefill-block-tokens do not apply",
            a.shape.name
        ));
    }
    if state.page_bytes % u64::from(a.prefill_tp) != 0 {
        return Err(format!(
            "{}: a state page of {} bytes does not split evenly over TP {}",
            a.shape.name, state.page_bytes, a.prefill_tp
        ));
    }
    Ok(())
}

/// The TP sizes pair, the rank is one of its group's, the groups fit the layers, and the
/// model's heads spread over both TP sizes.
fn check_tp(a: &Args) -> Result<(), String> {
    kvlink::tp_sources(kvlink::TpRank::new(0, a.decode_tp.max(1)), a.prefill_tp).map_err(|e| {
        format!(
            "--prefill-tp {} --decode-tp {}: {e}",
            a.prefill_tp, a.decode_tp
        )
    })?;
    let own = if a.mode == Mode::Serve {
        a.prefill_tp
    } else {
        a.decode_tp
    };
    if a.tp_rank >= own {
        return Err(format!(
            "--tp-rank {} is not a rank of a TP group of {own}",
            a.tp_rank
        ));
    }
    if a.groups == 0 || a.groups > a.shape.layers.min(64) {
        return Err(format!(
            "--groups {} (1 to {}: at most one per layer)",
            a.groups,
            a.shape.layers.min(64)
        ));
    }
    if a.shape.kv_heads > 0 {
        for size in [a.prefill_tp, a.decode_tp] {
            a.shape
                .rank_bytes_per_token(size)
                .map_err(|e| format!("{e}; pick TP sizes that divide the model's heads"))?;
        }
    }
    Ok(())
}

/// What each mode needs: a sweep its parameter and values, a read its peer; and nothing
/// empty.
pub(super) fn check(a: &Args) -> Result<(), String> {
    if a.mode == Mode::Sweep {
        match a.param.as_deref() {
            Some("message-bytes" | "tokens" | "concurrency" | "qps" | "streams") => {}
            Some(p) => return Err(format!("unknown sweep parameter {p:?}")),
            None => return Err("sweep needs --param and --values".into()),
        }
        if a.values.is_empty() || a.values.contains(&0) {
            return Err("sweep needs --values with positive numbers".into());
        }
    }
    if a.tokens == 0 || a.concurrency == 0 || a.requests == 0 {
        return Err("--tokens, --concurrency and --requests must be at least 1".into());
    }
    if a.mode == Mode::Read && a.peer.is_none() {
        return Err(
            "read needs --peer HOST:PORT (the address `kvlink-bench serve` printed)".into(),
        );
    }
    Ok(())
}

/// `--prefill-block-tokens`: loopback runs of a preset on one TP rank each, one block size a
/// multiple of the other.
fn check_block_sizes(a: &Args, custom: bool) -> Result<(), String> {
    let Some(p) = a.prefill_block_tokens else {
        return Ok(());
    };
    let d = a.shape.tokens_per_block;
    if custom || a.mode != Mode::Loopback || a.tp_run() {
        return Err(
            "--prefill-block-tokens applies to loopback runs of a preset without TP sizes or groups"
                .into(),
        );
    }
    if p == 0 || p.max(d) % p.min(d) != 0 {
        return Err(format!(
            "--prefill-block-tokens {p} and --block-tokens {d}: one must be a multiple of the other"
        ));
    }
    Ok(())
}
