//! Two processes: this test binary re-runs itself as a prefill worker (`prefill_child`), the
//! parent is the decode worker. Covers realistic layouts with every byte checked, the done
//! notices reaching the other process, and the prefill process killed mid-transfer.

mod common;

use std::time::Duration;

use common::*;
use kvlink::ModelShape;

/// The prefill worker of the two-process tests. A helper, not a test: ignored, so that test runs
/// neither run nor count it; `ChildPrefill::spawn` runs it with `--ignored --exact`.
#[test]
#[ignore = "helper: run as a child process by the two-process tests"]
fn prefill_child() {
    prefill_child_main();
}

fn two_process_transfer(
    shape: ModelShape,
    prefill_blocks: u32,
    decode_blocks: u32,
    requests: usize,
    per: usize,
) {
    let seed = 77 + u64::from(shape.layers);
    let child = ChildPrefill::spawn(shape.name, prefill_blocks, seed, requests, "tcp");
    let decode = side(&shape, decode_blocks, None, quick_config());
    let remote_layout = shape.layout(kvlink::RegionId(1), prefill_blocks);
    let mut rng = Rng(7);
    let reqs = random_requests(&mut rng, decode_blocks, prefill_blocks, requests, per);
    for (i, (l, r)) in reqs.iter().enumerate() {
        decode
            .engine
            .read_blocks(&child.addr, format!("req-{i}"), l, r)
            .unwrap();
    }
    let f = collect(&decode.engine, Duration::from_secs(60), |f| {
        f.receiving.len() + f.failed.len() == requests
    });
    assert!(f.failed.is_empty(), "{:?}", f.failed);
    assert_eq!(f.receiving.len(), requests);
    for (l, r) in &reqs {
        verify(&decode, &remote_layout, seed, l, r);
    }
    let sent = child.wait_lines("KVLINK_SENT ", requests, Duration::from_secs(30));
    assert_eq!(
        sent.len(),
        requests,
        "the prefill process confirmed {sent:?}"
    );
}

#[test]
fn two_process_llama3_8b() {
    two_process_transfer(ModelShape::LLAMA3_8B, 128, 128, 8, 16);
}

#[test]
fn two_process_deepseek_mla() {
    two_process_transfer(ModelShape::DEEPSEEK_V3_MLA, 256, 256, 16, 16);
}

#[test]
fn prefill_killed_mid_transfer_fails_requests_then_a_new_peer_works() {
    let shape = ModelShape::LLAMA3_8B;
    let blocks = 256;
    let n = 24;
    let mut child = ChildPrefill::spawn(shape.name, blocks, 5, n, "tcp");
    let decode = side(&shape, blocks, None, quick_config());
    // Many large requests (all 256 blocks each, 512 MiB per request); local blocks overlap
    // across requests, which is fine here since bytes are not checked.
    let all: Vec<u32> = (0..blocks).collect();
    // Kill the prefill process as soon as the first request lands.
    let (f, took) = kill_peer_mid_transfer(&decode, &mut child, &all, n, Duration::from_secs(60));
    assert_eq!(
        f.receiving.len() + f.failed.len(),
        n,
        "every request ended: {f:?}"
    );
    assert!(
        !f.failed.is_empty(),
        "killing the peer failed none of {n} requests"
    );
    for fr in &f.failed {
        assert!(
            !fr.expired,
            "failed by the connection loss, not the deadline: {fr:?}"
        );
        let r = fr.reason.to_lowercase();
        assert!(
            r.contains("lost")
                || r.contains("closed")
                || r.contains("reset")
                || r.contains("connection refused")
                // A read whose bytes had all arrived: the dead prefill never confirmed it.
                || fr.cause == kvlink::FailureCause::Unconfirmed,
            "{fr:?}"
        );
    }
    // Within the request deadline (20 s), with room to spare.
    assert!(took < Duration::from_secs(40), "took {took:?}");
    assert_eq!(decode.engine.in_flight(), (0, 0));

    // A fresh prefill process: the session is rebuilt and reads work again.
    let child2 = ChildPrefill::spawn(shape.name, blocks, 9, 1, "tcp");
    let (l, r) = (vec![5u32, 9, 200], vec![17u32, 3, 250]);
    decode
        .engine
        .read_blocks(&child2.addr, "req-0", &l, &r)
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(
        &decode,
        &shape.layout(kvlink::RegionId(1), blocks),
        9,
        &l,
        &r,
    );
    assert_eq!(
        child2
            .wait_lines("KVLINK_SENT ", 1, Duration::from_secs(30))
            .len(),
        1
    );
}

/// Names the decode child's task: "<prefill handshake address> <request to read first>".
const DECODE_ENV: &str = "KVLINK_TEST_DECODE";

/// The decode worker of the lease test (engine id `decode-child`). A helper, not a test: it
/// reads one request from the prefill in its parent (so it has a control session there), says
/// `KVLINK_READ`, then waits to be killed.
#[test]
#[ignore = "helper: run as a child process by the two-process tests"]
fn decode_child() {
    let Ok(spec) = std::env::var(DECODE_ENV) else {
        return;
    };
    let (addr, id) = spec.split_once(' ').expect("address and request");
    let config = quick_config().with(|c| {
        c.engine_id = Some("decode-child".into());
    });
    let decode = side(&ModelShape::LLAMA3_8B, 8, None, config);
    decode
        .engine
        .read_blocks(addr, id, &[1, 2], &[3, 4])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    println!("KVLINK_READ {id}");
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_decode_killed_with_sigkill_gives_its_blocks_back_within_the_lease() {
    let lease = Duration::from_secs(2);
    let config = quick_config().with(|c| {
        c.lease = lease;
    });
    let prefill = side(&ModelShape::LLAMA3_8B, 8, Some(3), config);
    let e = &prefill.engine;
    e.hold_blocks("warm", &[3, 4]).unwrap();
    e.hold_blocks_for("for-the-decode", &[5, 6], Some("decode-child"), None)
        .unwrap();
    e.hold_blocks_for("for-another", &[7], Some("another-decode"), None)
        .unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["decode_child", "--exact", "--ignored", "--nocapture"])
        .env(DECODE_ENV, format!("{} warm", e.handshake_address()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let read = std::io::BufRead::lines(out)
        .map_while(Result::ok)
        .find(|l| l.contains("KVLINK_READ warm"));
    assert!(read.is_some(), "the decode child read its request");
    let f = collect(e, Duration::from_secs(10), |f| !f.sending.is_empty());
    assert_eq!(f.sending, ["warm".into()], "{f:?}");

    child.kill().unwrap();
    let killed = std::time::Instant::now();
    child.wait().unwrap();
    let f = collect(e, lease + Duration::from_secs(5), |f| !f.failed.is_empty());
    let took = killed.elapsed();
    assert_eq!(f.failed.len(), 1, "{f:?}");
    let fr = &f.failed[0];
    assert_eq!(fr.id.as_str(), "for-the-decode");
    assert!(
        fr.expired && fr.cause == kvlink::FailureCause::Expired,
        "{fr:?}"
    );
    assert!(fr.reason.contains("lease"), "{}", fr.reason);
    // Not before the lease (less the moment the prefill saw the connection close), and well
    // before the 480 s abort timeout.
    assert!(
        took >= lease - Duration::from_millis(100),
        "expired after {took:?}"
    );
    assert!(
        took < lease + Duration::from_secs(3),
        "expired after {took:?}"
    );
    let t = e.stats().totals;
    assert_eq!((t.sends_lease_expired, t.sends_expired), (1, 1));
    // The hold for an engine that never connected waits for it.
    assert_eq!(e.in_flight().1, 1, "for-another is still held");
}
