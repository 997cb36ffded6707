//! The fuzz targets' corpora (tests/fuzz/corpus/<target>/), replayed as ordinary tests: every
//! stored input, the seeds and whatever the fuzzer kept, runs through the same entry point the
//! cargo-fuzz target calls (`tests/fuzz/targets.rs`). A finding committed to the corpus thus
//! stays a regression test. `write_seeds` (ignored) regenerates the seeds.

use std::path::{Path, PathBuf};

// The fuzz targets' entry points, shared with the cargo-fuzz crate (tests/fuzz); the hostile
// descriptors are for tests/faults.rs and the descriptor bench.
#[allow(dead_code)]
#[path = "fuzz/targets.rs"]
mod fuzz;

#[cfg(feature = "events")]
use kvlink::events::{
    encode_batch, BlockHash, BlockRemoved, BlockStored, Encoding, EventBatch, KvEvent,
};
use kvlink::internal::messages::Message;
use kvlink::internal::{frame, tcp_wire as wire};
use kvlink::RegionId;

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(target)
}

/// The inputs of `target`'s corpus: its seed files, and the merged corpus the fuzzing runs
/// kept (`corpus/<target>.pack`, see tests/fuzz/pack.py).
fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus(target);
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        out.push((path.display().to_string(), std::fs::read(&path).unwrap()));
    }
    let pack = dir.with_extension("pack");
    if let Ok(blob) = std::fs::read(&pack) {
        let mut at = 0;
        while at < blob.len() {
            let len = u32::from_le_bytes(blob[at..at + 4].try_into().unwrap()) as usize;
            let data = blob[at + 4..at + 4 + len].to_vec();
            out.push((format!("{} at byte {at}", pack.display()), data));
            at += 4 + len;
        }
    }
    out
}

/// Runs `run` over every input of `target`'s corpus; at least the seeds must be there.
fn replay(target: &str, run: fn(&[u8])) {
    let all = inputs(target);
    for (name, data) in &all {
        let ok = std::panic::catch_unwind(|| run(data));
        assert!(ok.is_ok(), "{target}: {name} fails");
    }
    assert!(all.len() >= 3, "{target}: only {} inputs", all.len());
    println!("{target}: {} corpus inputs", all.len());
}

#[test]
fn control_stream_corpus() {
    replay("control_stream", fuzz::control_stream);
}

#[test]
fn descriptor_corpus() {
    replay("descriptor", fuzz::descriptor);
}

#[test]
fn data_request_corpus() {
    replay("data_request", fuzz::data_request);
}

#[cfg(feature = "events")]
#[test]
fn events_batch_corpus() {
    replay("events_batch", fuzz::events_batch);
}

fn frames(messages: &[Message]) -> Vec<u8> {
    messages
        .iter()
        .flat_map(|m| frame::encode(m).unwrap())
        .collect()
}

fn write(target: &str, name: &str, data: &[u8]) {
    let dir = corpus(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), data).unwrap();
}

#[test]
#[ignore = "writes the seed inputs into tests/fuzz/corpus"]
fn write_seeds() {
    let d = fuzz::example_descriptor();
    let hello = Message::Hello {
        descriptor: Box::new(d.clone()),
        session: None,
    };
    let session = [
        Message::AuthHello {
            client_nonce: [1; 32],
        },
        Message::AuthProof {
            client_proof: [2; 32],
        },
        hello.clone(),
        Message::Ping { nonce: 9 },
        Message::Reading {
            request_id: "req-1".into(),
            hold: Some(7),
        },
        Message::Done {
            request_id: "req-1".into(),
            hold: Some(7),
        },
        Message::Abort {
            request_id: "req-2".into(),
            reason: "decode OOM".into(),
            hold: None,
        },
    ];
    let stream = frames(&session);
    // Mode byte: low 3 bits = how many piece sizes follow, bit 3 = the pre-authentication cap.
    write(
        "control_stream",
        "session-whole",
        &[&[0u8][..], &stream].concat(),
    );
    write(
        "control_stream",
        "session-pieces",
        &[&[3u8, 1, 7, 200][..], &stream].concat(),
    );
    write(
        "control_stream",
        "capped-hello",
        &[&[8u8 | 1, 3][..], &frames(&[hello])].concat(),
    );
    write(
        "control_stream",
        "descriptor-reply",
        &[
            &[0u8][..],
            &frames(&[Message::Descriptor(Box::new(d.clone()))]),
        ]
        .concat(),
    );

    write("descriptor", "valid", &rmp_serde::to_vec_named(&d).unwrap());
    let mut two = d.clone();
    two.layout.tensors.truncate(2);
    write(
        "descriptor",
        "two-tensors",
        &rmp_serde::to_vec_named(&two).unwrap(),
    );
    // Heads declared (a TP split) and a second block group.
    let mut split = d.clone();
    split.tp_size = 2;
    for (i, t) in split.layout.tensors.iter_mut().enumerate() {
        t.group = (i % 2) as u32;
        t.heads = Some(kvlink::HeadSplit {
            total: 2,
            local: 1,
            runs: 1,
        });
    }
    write(
        "descriptor",
        "heads-and-groups",
        &rmp_serde::to_vec_named(&split).unwrap(),
    );
    let mut bad = d;
    bad.regions[0].len = 1;
    write(
        "descriptor",
        "too-short",
        &rmp_serde::to_vec_named(&bad).unwrap(),
    );

    let e = |region, offset, len| wire::Entry {
        region: RegionId(region),
        offset,
        len,
    };
    for (name, id, entries) in [
        (
            "granted",
            "req-1",
            vec![e(1, 96, 40), e(1, 136, 40), e(2, 80, 64)],
        ),
        ("padding", "req-2", vec![e(1, 100, 60)]),
        (
            "mixed",
            "r",
            vec![e(1, 0, 10), e(2, 16 + 5 * 64, 128), e(9, 0, 1)],
        ),
    ] {
        let mut out = Vec::new();
        wire::encode_request(
            1,
            id,
            &wire::Extras::default(),
            entries.into_iter(),
            &mut out,
        );
        write("data_request", name, &out);
    }

    #[cfg(feature = "events")]
    write_event_seeds();
}

#[cfg(feature = "events")]
fn write_event_seeds() {
    let batch = EventBatch {
        ts: 1_795_255_560.149_691_3,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![BlockHash::U64(1), BlockHash::Bytes(vec![7; 32])],
                parent_block_hash: Some(BlockHash::I64(-3)),
                token_ids: (0..32).collect(),
                block_size: 16,
                medium: Some("GPU".into()),
                ..Default::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::U64(1)],
                ..Default::default()
            }),
            KvEvent::all_cleared(None),
        ],
        dp_rank: Some(0),
    };
    for (name, enc) in [("current", Encoding::Current), ("legacy", Encoding::Legacy)] {
        let mut out = Vec::new();
        encode_batch(&batch, enc, &mut out);
        write("events_batch", name, &out);
    }
    write(
        "events_batch",
        "empty",
        &[0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0xc0],
    );
}
