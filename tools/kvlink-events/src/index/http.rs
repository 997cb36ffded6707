//! The index service's HTTP side: one thread taking requests (tiny_http), each answered from
//! the shared index under its lock.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvlink_events::{HolderKey, HolderMatch, HolderState, Overlap, Salt};
use serde_json::{json, Value};

use super::{metrics, state_name, Service};

/// Largest request body taken (a query of a million tokens is about 7 MB of JSON).
const MAX_BODY: u64 = 16 << 20;

/// Answers requests until `stop` is set.
pub(super) fn serve(server: &tiny_http::Server, s: &Arc<Service>, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let mut req = match server.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!("HTTP: {e}");
                continue;
            }
        };
        let (status, body, kind) = answer(s, &mut req);
        let header = tiny_http::Header::from_bytes("Content-Type", kind).expect("a valid header");
        let resp = tiny_http::Response::from_string(body)
            .with_status_code(status)
            .with_header(header);
        if let Err(e) = req.respond(resp) {
            tracing::debug!("HTTP answer not sent: {e}");
        }
    }
}

/// The status, body and content type of the answer to `req`.
fn answer(s: &Arc<Service>, req: &mut tiny_http::Request) -> (u16, String, &'static str) {
    const JSON: &str = "application/json";
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let r = match (req.method(), path.as_str()) {
        (tiny_http::Method::Get, "/health") => return (200, "ok\n".into(), "text/plain"),
        (tiny_http::Method::Get, "/metrics") => {
            return (200, metrics::render(s), "text/plain; version=0.0.4")
        }
        (tiny_http::Method::Get, "/engines") => Ok(engines(s)),
        (tiny_http::Method::Get, "/dump") => Ok(dump(s)),
        (tiny_http::Method::Post, p) => body(req).and_then(|b| post(s, p, &b)),
        _ => Err((404, format!("no route {} {path}", req.method()))),
    };
    match r {
        Ok(v) => (200, v.to_string(), JSON),
        Err((status, why)) => (status, json!({ "error": why }).to_string(), JSON),
    }
}

fn body(req: &mut tiny_http::Request) -> Result<Value, (u16, String)> {
    let mut text = String::new();
    req.as_reader()
        .take(MAX_BODY + 1)
        .read_to_string(&mut text)
        .map_err(|e| (400, format!("reading the body: {e}")))?;
    if text.len() as u64 > MAX_BODY {
        return Err((413, format!("a body over {MAX_BODY} bytes")));
    }
    serde_json::from_str(&text).map_err(|e| (400, format!("the body is not JSON: {e}")))
}

fn post(s: &Arc<Service>, path: &str, b: &Value) -> Result<Value, (u16, String)> {
    match path {
        "/query" => query(s, b),
        "/query_by_hash" => {
            let hashes = b["block_hashes"]
                .as_array()
                .ok_or_else(|| bad("block_hashes: a list of integers"))?
                .iter()
                .map(|h| h.as_u64().or_else(|| h.as_i64().map(|i| i as u64)))
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| bad("block_hashes: a list of integers"))?;
            let o = s.index.lock().expect("index lock").overlap_hashes(&hashes);
            Ok(overlap(&o))
        }
        "/register" => {
            let name = text(b, "name")?;
            let endpoint = text(b, "endpoint")?;
            let replay = b["replay_endpoint"].as_str().map(str::to_string);
            s.follow(&name, &endpoint, replay);
            Ok(json!({ "registered": name }))
        }
        "/unregister" => {
            let name = text(b, "name")?;
            Ok(json!({ "unregistered": s.forget(&name) }))
        }
        p => Err((404, format!("no route POST {p}"))),
    }
}

fn bad(why: &str) -> (u16, String) {
    (400, why.to_string())
}

fn text(b: &Value, key: &str) -> Result<String, (u16, String)> {
    b[key]
        .as_str()
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .ok_or_else(|| bad(&format!("{key}: a non-empty string")))
}

/// `POST /query {"token_ids": [...], "block_size"?, "lora_id"?, "lora_name"?, "cache_salt"?}`.
fn query(s: &Arc<Service>, b: &Value) -> Result<Value, (u16, String)> {
    let tokens = b["token_ids"]
        .as_array()
        .ok_or_else(|| bad("token_ids: a list of token ids"))?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| bad("token_ids: a list of token ids (0 to 2^32-1)"))?;
    let block_size = match b.get("block_size") {
        None | Some(Value::Null) => s.block_size,
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
            .ok_or_else(|| bad("block_size: a positive integer"))?,
    };
    let salt = Salt {
        lora_id: b["lora_id"].as_i64(),
        lora_name: b["lora_name"].as_str().map(str::to_string),
        cache_salt: b["cache_salt"].as_str().map(str::to_string),
    };
    let o = s
        .index
        .lock()
        .expect("index lock")
        .overlap_tokens(&tokens, block_size, &salt);
    Ok(overlap(&o))
}

fn holder(k: &HolderKey, state: HolderState) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("engine".into(), json!(k.engine));
    m.insert("dp_rank".into(), json!(k.dp_rank));
    m.insert("medium".into(), json!(k.medium));
    m.insert("group".into(), json!(k.group));
    m.insert("state".into(), json!(state_name(state)));
    m
}

fn matched(m: &HolderMatch) -> Value {
    let mut h = holder(&m.holder, m.state);
    h.insert("blocks".into(), json!(m.blocks));
    h.insert("tokens".into(), json!(m.tokens));
    Value::Object(h)
}

fn overlap(o: &Overlap) -> Value {
    json!({
        "matches": o.matches.iter().map(matched).collect::<Vec<_>>(),
        "best": o.best().map(matched),
    })
}

fn engines(s: &Arc<Service>) -> Value {
    let engines = s.engines.lock().expect("engines lock");
    let mut names: Vec<&String> = engines.keys().collect();
    names.sort();
    let list: Vec<Value> = names
        .into_iter()
        .map(|n| {
            let e = &engines[n];
            let st = &e.stats;
            let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            json!({
                "name": n, "endpoint": e.endpoint, "replay_endpoint": e.replay,
                "connected": st.connected.load(Ordering::Relaxed),
                "batches": get(&st.batches), "restarts": get(&st.restarts),
                "history_lost": get(&st.lost), "gaps_filled": get(&st.gaps_filled),
                "snapshots": get(&st.snapshots),
                "malformed": get(&st.malformed), "lag_s": st.lag_s(),
            })
        })
        .collect();
    json!({ "engines": list })
}

fn dump(s: &Arc<Service>) -> Value {
    let all = s.index.lock().expect("index lock").dump();
    let holders: Vec<Value> = all
        .iter()
        .map(|(k, state, blocks)| {
            let mut h = holder(k, *state);
            h.insert("block_hashes".into(), json!(blocks));
            Value::Object(h)
        })
        .collect();
    json!({ "holders": holders })
}
