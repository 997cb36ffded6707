//! The index service's routes: each request answered from the shared index under its lock,
//! on the thread of its connection (`conn`).

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvlink_events::{HolderKey, HolderMatch, HolderState, Overlap, Salt};
use serde_json::{json, Value};

use super::conn::{self, Request};
use super::{metrics, state_name, Service};

/// Largest request body taken (a query of a million tokens is about 7 MB of JSON).
const MAX_BODY: usize = 16 << 20;

/// Answers requests until `stop` is set (and [`conn::wake`] wakes the accept).
pub(super) fn serve(listener: &TcpListener, s: &Arc<Service>, stop: &Arc<AtomicBool>) {
    let s = s.clone();
    conn::serve(listener, stop, MAX_BODY, move |req| answer(&s, req));
}

/// The status, body and content type of the answer to `req`.
fn answer(s: &Arc<Service>, req: &Request) -> (u16, String, &'static str) {
    const JSON: &str = "application/json";
    let r = match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/health") => return (200, "ok\n".into(), "text/plain"),
        ("GET", "/metrics") => return (200, metrics::render(s), "text/plain; version=0.0.4"),
        ("GET", "/engines") => Ok(engines(s).to_string()),
        ("GET", "/dump") => Ok(dump(s).to_string()),
        ("POST", "/query") => query(s, &req.body),
        ("POST", p) => body(&req.body).and_then(|b| post(s, p, &b)),
        (m, p) => Err((404, format!("no route {m} {p}"))),
    };
    match r {
        Ok(text) => (200, text, JSON),
        Err((status, why)) => (status, json!({ "error": why }).to_string(), JSON),
    }
}

fn body(bytes: &[u8]) -> Result<Value, (u16, String)> {
    serde_json::from_slice(bytes).map_err(|e| (400, format!("the body is not JSON: {e}")))
}

fn post(s: &Arc<Service>, path: &str, b: &Value) -> Result<String, (u16, String)> {
    match path {
        "/query_by_hash" => {
            let hashes = b["block_hashes"]
                .as_array()
                .ok_or_else(|| bad("block_hashes: a list of integers"))?
                .iter()
                .map(|h| h.as_u64().or_else(|| h.as_i64().map(|i| i as u64)))
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| bad("block_hashes: a list of integers"))?;
            let o = s.shards.overlap(|ix| ix.overlap_hashes(&hashes));
            Ok(overlap(&o))
        }
        "/register" => {
            let name = text(b, "name")?;
            let endpoint = text(b, "endpoint")?;
            let replay = b["replay_endpoint"].as_str().map(str::to_string);
            s.follow(&name, &endpoint, replay);
            Ok(json!({ "registered": name }).to_string())
        }
        "/unregister" => {
            let name = text(b, "name")?;
            Ok(json!({ "unregistered": s.forget(&name) }).to_string())
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

/// The body of `POST /query` (other fields, such as Dynamo's `model_name`, are ignored).
#[derive(serde::Deserialize)]
struct QueryBody {
    token_ids: Vec<u32>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
}

/// `POST /query {"token_ids": [...], "block_size"?, "lora_id"?, "lora_name"?, "cache_salt"?}`,
/// read straight into its fields (no JSON tree).
fn query(s: &Arc<Service>, body: &[u8]) -> Result<String, (u16, String)> {
    let q: QueryBody = serde_json::from_slice(body).map_err(|e| {
        bad(&format!(
            "token_ids: a list of token ids (0 to 2^32-1); block_size: a positive integer; {e}"
        ))
    })?;
    let block_size = match q.block_size {
        None => s.block_size,
        Some(0) => return Err(bad("block_size: a positive integer")),
        Some(b) => b,
    };
    let salt = Salt {
        lora_id: q.lora_id,
        lora_name: q.lora_name,
        cache_salt: q.cache_salt,
    };
    let o = s
        .shards
        .overlap(|ix| ix.overlap_tokens(&q.token_ids, block_size, &salt));
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

/// One match as a JSON object, written straight into `out`.
fn matched(out: &mut String, m: &HolderMatch) {
    use std::fmt::Write;
    let k = &m.holder;
    let quoted = |v: &str| serde_json::to_string(v).unwrap_or_default();
    let _ = write!(
        out,
        "{{\"engine\":{},\"dp_rank\":{},\"medium\":{},\"group\":{},\"state\":\"{}\",\
         \"blocks\":{},\"tokens\":{}}}",
        quoted(&k.engine),
        k.dp_rank,
        quoted(&k.medium),
        k.group,
        state_name(m.state),
        m.blocks,
        m.tokens
    );
}

/// `{"matches": [...], "best": ... | null}`, written without a JSON tree (an answer names
/// every holder of the prompt's first block: dozens of objects).
fn overlap(o: &Overlap) -> String {
    let mut out = String::with_capacity(64 + 160 * o.matches.len());
    out.push_str("{\"matches\":[");
    for (i, m) in o.matches.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        matched(&mut out, m);
    }
    out.push_str("],\"best\":");
    match o.best() {
        Some(m) => matched(&mut out, m),
        None => out.push_str("null"),
    }
    out.push('}');
    out
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
    let all = s.shards.dump();
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
