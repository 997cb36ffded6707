//! The hybrid preset end to end: a loopback run of `kvlink-bench --preset nemotron-h-8b`
//! reads each request's attention blocks and its state pages (one per state layer), every byte
//! checked at the destination, and reports the dense preset's run beside it.

use std::process::Command;

/// The number after `"key":` in a JSON line (enough for the bench's flat fields).
fn field(json: &str, key: &str) -> f64 {
    let at = json
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("no {key} in {json}"));
    let rest = &json[at + key.len() + 3..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {e} in {json}"))
}

#[test]
fn hybrid_preset_reads_state_pages_beside_attention_blocks() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlink-bench"))
        .args([
            "--preset",
            "nemotron-h-8b",
            "--tokens",
            "1040",
            "--requests",
            "2",
            "--warmup",
            "0",
            "--concurrency",
            "1",
            "--transport",
            "tcp",
            "--verify",
            "--json",
        ])
        .output()
        .expect("kvlink-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = stdout.lines().last().expect("one JSON line");
    // Per request: one 1,040-token block of K and V in each of 4 attention layers, and one
    // state page in each of 24 state layers.
    let page = 3.0 * 10_240.0 * 2.0 + 128.0 * 64.0 * 128.0 * 4.0;
    let per_request = 4.0 * 2.0 * 1040.0 * 2048.0 + 24.0 * page;
    assert_eq!(field(json, "bytes_per_request"), per_request, "{json}");
    assert_eq!(
        field(json, "verified_bytes"),
        field(json, "bytes"),
        "{json}"
    );
    assert_eq!(field(json, "state_layers"), 24.0);
    assert_eq!(field(json, "groups"), 2.0);
    let dense = &json[json.find("\"dense\":").expect("the dense run beside it")..];
    assert!(dense.contains("\"preset\":\"llama-3-8b\""), "{dense}");
    assert!(field(dense, "gb_per_s") > 0.0, "{dense}");
}
