//! Reading over two RDMA devices at once, inside the SoftRoCE VM (`tools/softroce/run.sh` sets
//! up `rxe0` on `dummy0` and `rxe1` on `dummy1` and exports KVLINK_RDMA_DEVICES=rxe0,rxe1):
//! reads are striped over both; one device's link taken down in the middle of reads (they all
//! finish on the other; the device is paused, then used again after its cool-down); both down
//! before reads (they fail over to TCP and finish). Every byte checked. Elsewhere the test says it
//! skipped.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::rdma::VM_KEEPALIVE;
use common::*;
use kvlink::{ModelShape, RdmaSettings, TransportChoice};

/// The netdev under each device (tools/softroce/run.sh).
const LINKS: [(&str, &str); 2] = [("rxe0", "dummy0"), ("rxe1", "dummy1")];

fn two_devices() -> Option<String> {
    let devs = std::env::var("KVLINK_RDMA_DEVICES").unwrap_or_default();
    let n = devs.split(',').filter(|d| !d.is_empty()).count();
    let why = if n < 2 {
        Some(format!("KVLINK_RDMA_DEVICES names {n} devices"))
    } else {
        kvlink::internal::probe_rdma(&RdmaSettings {
            device: Some(devs.clone()),
            ..RdmaSettings::default()
        })
        .err()
        .or_else(|| {
            (std::env::var("KVLINK_SOFTROCE").is_err())
                .then(|| "not inside the SoftRoCE VM (links are switched here)".to_string())
        })
    };
    match why {
        None => Some(devs),
        Some(why) => {
            skip("fewer than two RDMA devices", &why);
            None
        }
    }
}

fn link(dev: &str, up: bool) {
    let netdev = LINKS
        .iter()
        .find(|(d, _)| *d == dev)
        .expect("known device")
        .1;
    let state = if up { "up" } else { "down" };
    let ok = Command::new("ip")
        .args(["link", "set", netdev, state])
        .status()
        .expect("ip")
        .success();
    assert!(ok, "ip link set {netdev} {state}");
}

fn bytes_on(e: &kvlink::Engine, dev: &str) -> u64 {
    e.rdma_device_bytes()
        .into_iter()
        .find(|(d, _)| d == dev)
        .map_or(0, |(_, b)| b)
}

/// Reads `n` requests of `per` blocks (ids from `first`), all issued before any ends, with
/// `during` run right after they are issued; checks every byte.
fn reads(
    prefill: &Side,
    decode: &Side,
    first: usize,
    n: usize,
    per: u32,
    seed: u64,
    during: impl FnOnce(),
) {
    let peer = prefill.engine.handshake_address().to_string();
    assert!(
        n as u32 * per <= 64,
        "the requests of one call write distinct blocks"
    );
    let mut want = Vec::new();
    for (k, i) in (first..first + n).enumerate() {
        let remote: Vec<u32> = (0..per).map(|b| (b * 7 + i as u32) % 64).collect();
        let local: Vec<u32> = (0..per).map(|b| b + k as u32 * per).collect();
        prefill
            .engine
            .hold_blocks(format!("r{i}"), &remote)
            .unwrap();
        decode
            .engine
            .read_blocks(&peer, format!("r{i}"), &local, &remote)
            .unwrap();
        want.push((local, remote));
    }
    during();
    let got = collect(&decode.engine, Duration::from_secs(300), |f| {
        f.receiving.len() + f.failed.len() == n
    });
    assert!(got.failed.is_empty(), "{:?}", got.failed);
    assert_eq!(got.receiving.len(), n);
    for (l, r) in &want {
        verify(decode, &prefill.layout, seed, l, r);
    }
}

#[test]
fn rdma_two_devices_stripe_fail_over_and_come_back() {
    let Some(devs) = two_devices() else {
        return;
    };
    let cooldown = Duration::from_secs(8);
    let config = quick_config().with(|c| {
        c.transport = TransportChoice::Auto;
        c.rdma = RdmaSettings {
            device: Some(devs),
            qps: 2,
            cooldown,
            ..RdmaSettings::default()
        };
        c.io_timeout = Duration::from_secs(20);
        c.request_timeout = Duration::from_secs(120);
        // The confirmation's round trip is bounded by it: in a loaded VM, 500 ms was not
        // always enough (the verdict must not depend on the machine's speed).
        c.handshake_timeout = Duration::from_secs(10);
        c.keepalive = VM_KEEPALIVE;
    });
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let seed = 0x2A11;
    let prefill = side(&shape, 64, Some(seed), config.clone());
    // Memory registered from a pointer: the same-host path cannot take it, RDMA does.
    let decode = side_in(Mem::External, &shape, 64, None, config);

    // Both devices carry each read.
    reads(&prefill, &decode, 0, 4, 16, seed, || {});
    let (a0, b0) = (
        bytes_on(&decode.engine, "rxe0"),
        bytes_on(&decode.engine, "rxe1"),
    );
    assert!(a0 > 0 && b0 > 0, "striped over both: rxe0 {a0}, rxe1 {b0}");

    // A cancelled read breaks the queue pairs it had reads on: no device is paused for it,
    // and the next read runs over RDMA again (a new session), not over TCP.
    let peer = prefill.engine.handshake_address().to_string();
    let all: Vec<u32> = (0..48).collect();
    prefill.engine.hold_blocks("c", &all).unwrap();
    decode.engine.read_blocks(&peer, "c", &all, &all).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    decode.engine.cancel("c");
    collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    let served = prefill.engine.stats().bytes_served;
    reads(&prefill, &decode, 100, 2, 16, seed, || {});
    assert_eq!(
        decode.engine.stats().rdma_pairs_paused,
        0,
        "a cancel pauses no device"
    );
    assert_eq!(
        prefill.engine.stats().bytes_served,
        served,
        "nothing went over TCP"
    );
    let a0 = bytes_on(&decode.engine, "rxe0");

    // rxe1's link goes down while reads are in flight: they all finish on rxe0.
    reads(&prefill, &decode, 4, 8, 8, seed, || link("rxe1", false));
    let (a1, b1) = (
        bytes_on(&decode.engine, "rxe0"),
        bytes_on(&decode.engine, "rxe1"),
    );
    assert!(a1 > a0, "rxe0 carried the reads");
    let paused = decode.engine.stats().rdma_pairs_paused;
    assert!(paused >= 1, "rxe1 was paused");
    // While rxe1 is paused, reads go to rxe0 only: rxe1 is not even tried (a try on its down
    // link would fail and pause it again).
    reads(&prefill, &decode, 12, 2, 16, seed, || {});
    assert_eq!(bytes_on(&decode.engine, "rxe1"), b1, "rxe1 carried nothing");
    assert_eq!(
        decode.engine.stats().rdma_pairs_paused,
        paused,
        "rxe1 was not tried"
    );

    // Its link back, and its cool-down over: rxe1 carries reads again.
    link("rxe1", true);
    std::thread::sleep(cooldown + Duration::from_secs(2));
    let b2 = bytes_on(&decode.engine, "rxe1");
    let t0 = Instant::now();
    while bytes_on(&decode.engine, "rxe1") == b2 && t0.elapsed() < Duration::from_secs(60) {
        reads(&prefill, &decode, 14, 2, 16, seed, || {});
    }
    assert!(
        bytes_on(&decode.engine, "rxe1") > b2,
        "rxe1 used again after its cool-down"
    );

    // Both links down: the reads fail over to TCP and finish.
    let served = prefill.engine.stats().bytes_served;
    link("rxe0", false);
    link("rxe1", false);
    reads(&prefill, &decode, 16, 4, 16, seed, || {});
    link("rxe0", true);
    link("rxe1", true);
    assert!(
        prefill.engine.stats().bytes_served > served,
        "the prefill's TCP server served the failed-over reads"
    );
}

#[test]
fn rdma_a_reader_with_fewer_devices_pairs_with_the_first() {
    let Some(devs) = two_devices() else {
        return;
    };
    let config = |device: &str| {
        quick_config().with(|c| {
            c.transport = TransportChoice::Rdma;
            c.rdma = RdmaSettings {
                device: Some(device.to_string()),
                qps: 2,
                ..RdmaSettings::default()
            };
            c.handshake_timeout = Duration::from_secs(10);
            c.keepalive = VM_KEEPALIVE;
        })
    };
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let seed = 0xFE;
    // The prefill offers two devices; the decode has one: one pair, rxe0 with rxe0.
    let prefill = side(&shape, 64, Some(seed), config(&devs));
    let decode = side_in(Mem::External, &shape, 64, None, config("rxe0"));
    assert_eq!(prefill.engine.rdma_status().unwrap(), "rxe0,rxe1");
    reads(&prefill, &decode, 0, 2, 16, seed, || {});
    assert!(bytes_on(&decode.engine, "rxe0") > 0);
    // And the other way round: a decode with two devices reading a prefill with one.
    let prefill = side(&shape, 64, Some(seed), config("rxe0"));
    let decode = side_in(Mem::External, &shape, 64, None, config(&devs));
    reads(&prefill, &decode, 0, 2, 16, seed, || {});
    assert!(bytes_on(&decode.engine, "rxe0") > 0);
    assert_eq!(bytes_on(&decode.engine, "rxe1"), 0, "no pair for rxe1");
}
