//! Unit tests of the C API: status mapping, panic containment, argument checks and an engine
//! round trip without peers.

use std::ffi::{c_char, CStr};
use std::time::Duration;

use kvlink::{Error, RegionId};

use super::*;
use crate::args::{opt_str_arg, str_arg};
use crate::config::engine_config;
use crate::guard::{guard, guard_value, to_cstring};
use crate::status::{invalid, status_of};

fn last_error() -> String {
    // SAFETY: kvlink_last_error never returns NULL, and the string lives until the next call.
    unsafe { CStr::from_ptr(kvlink_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn a_panic_becomes_an_internal_error() {
    let code = guard(|| panic!("deliberate"));
    assert_eq!(code, KVLINK_E_INTERNAL);
    assert!(last_error().contains("deliberate"), "{}", last_error());
    let code = guard(|| std::panic::panic_any(17_u8));
    assert_eq!(code, KVLINK_E_INTERNAL);
    assert!(last_error().contains("internal error"), "{}", last_error());
    assert!(guard_value(|_| std::ptr::null::<c_char>(), || panic!("x")).is_null());
}

#[test]
fn success_clears_the_last_error() {
    assert_eq!(guard(|| Err(invalid("nope"))), KVLINK_E_INVALID);
    assert_eq!(last_error(), "nope");
    assert_eq!(guard(|| Ok(())), KVLINK_OK);
    assert_eq!(last_error(), "");
}

#[test]
fn errors_map_to_status_codes() {
    let cases = [
        (Error::InvalidArgument("a".into()), KVLINK_E_INVALID),
        (Error::UnknownRegion(RegionId(3)), KVLINK_E_INVALID),
        (
            Error::Timeout {
                what: "w".into(),
                after: Duration::from_secs(1),
            },
            KVLINK_E_TIMEOUT,
        ),
        (
            Error::Incompatible {
                peer: "p".into(),
                differences: "d".into(),
            },
            KVLINK_E_INCOMPATIBLE,
        ),
        (Error::io("x", &std::io::Error::other("y")), KVLINK_E_IO),
        (Error::Protocol("p".into()), KVLINK_E_CONNECTION),
        (Error::RdmaUnavailable("r".into()), KVLINK_E_RDMA),
        (Error::Memory("m".into()), KVLINK_E_MEMORY),
        (Error::Gpu("g".into()), KVLINK_E_GPU),
        (Error::Shutdown, KVLINK_E_SHUTDOWN),
    ];
    for (e, code) in cases {
        assert_eq!(status_of(&e), code, "{e}");
    }
}

#[test]
fn nul_bytes_never_truncate_messages() {
    assert_eq!(to_cstring("a\0b").to_str().unwrap(), "a\u{fffd}b");
}

#[test]
fn string_arguments_are_checked() {
    let bad = [0xff_u8, 0];
    // SAFETY: a NUL-terminated buffer that outlives the call.
    let e = unsafe { str_arg(bad.as_ptr().cast(), "s") }.unwrap_err();
    assert!(e.message.contains("UTF-8"), "{}", e.message);
    // SAFETY: NULL is allowed.
    let e = unsafe { str_arg(std::ptr::null(), "s") }.unwrap_err();
    assert_eq!(e.message, "s is NULL");
    // SAFETY: NULL is allowed.
    assert_eq!(unsafe { opt_str_arg(std::ptr::null(), "s") }.unwrap(), None);
}

/// A kvlink_config of this release filled by kvlink_config_default.
fn default_config() -> kvlink_config {
    // SAFETY: every field of kvlink_config is an integer or a raw pointer: all zeros is valid.
    let mut config: kvlink_config = unsafe { std::mem::zeroed() };
    config.size = KVLINK_CONFIG_SIZE as u64;
    // SAFETY: a whole kvlink_config with its size set.
    let rc = unsafe { kvlink_config_default(&mut config) };
    assert_eq!(rc, KVLINK_OK, "{}", last_error());
    assert_eq!(config.size, KVLINK_CONFIG_SIZE as u64, "the size is kept");
    config
}

#[test]
fn a_config_without_its_size_or_from_a_newer_header_is_refused() {
    // SAFETY: as in default_config.
    let mut config: kvlink_config = unsafe { std::mem::zeroed() };
    for size in [0, 4, 12, KVLINK_CONFIG_SIZE as u64 + 8] {
        config.size = size;
        // SAFETY: a whole kvlink_config; only its size is read before the refusal.
        let rc = unsafe { kvlink_config_default(&mut config) };
        assert_eq!(rc, KVLINK_E_INVALID, "size {size}");
        assert!(last_error().contains("config->size is"), "{}", last_error());
    }
}

#[test]
fn the_durations_reach_the_engine_config() {
    let config = default_config();
    let d = kvlink::EngineConfig::default();
    assert_eq!(config.session_idle_ms, 120_000);
    assert_eq!(engine_config(&config).unwrap().session_idle, d.session_idle);
    let set = kvlink_config {
        session_idle_ms: 0,
        lease_ms: 2_500,
        ..config
    };
    let converted = engine_config(&set).unwrap();
    assert_eq!(converted.session_idle, Duration::ZERO);
    assert_eq!(converted.lease, Duration::from_millis(2_500));
    let too_long = kvlink_config {
        session_idle_ms: KVLINK_TIMEOUT_MAX_MS + 1,
        ..config
    };
    let err = engine_config(&too_long).unwrap_err();
    assert_eq!(err.code, KVLINK_E_INVALID);
    assert!(
        err.message.contains("config->session_idle_ms"),
        "{}",
        err.message
    );
}

#[test]
fn engine_round_trip_without_peers() {
    let mut config = default_config();
    config.transport = KVLINK_TRANSPORT_TCP;
    let mut engine = std::ptr::null_mut();
    let bad = kvlink_config { gpu: 2, ..config };
    // SAFETY: valid config and out-pointer; refused before any engine exists.
    let rc = unsafe { kvlink_engine_start(&bad, &mut engine) };
    assert_eq!(rc, KVLINK_E_INVALID);
    assert!(last_error().contains("config->gpu"), "{}", last_error());
    let bad = kvlink_config {
        staging_buffers: 0,
        ..config
    };
    // SAFETY: as above.
    let rc = unsafe { kvlink_engine_start(&bad, &mut engine) };
    assert_eq!(rc, KVLINK_E_INVALID);
    assert!(engine.is_null());
    config.gpu = 0;
    // SAFETY: valid config and out-pointer.
    let rc = unsafe { kvlink_engine_start(&config, &mut engine) };
    assert_eq!(rc, KVLINK_OK, "{}", last_error());
    let mut buf = [0 as c_char; KVLINK_ADDRESS_MAX];
    // SAFETY: live engine, buffer of the given length.
    let rc = unsafe { kvlink_engine_handshake_address(engine, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(rc, KVLINK_OK);
    // SAFETY: NUL-terminated by the call above.
    let addr = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    // The capabilities report, and the error when the buffer is too small.
    let mut caps = [0 as c_char; 4096];
    // SAFETY: live engine, buffer of the given length.
    let rc = unsafe { kvlink_engine_capabilities(engine, caps.as_mut_ptr(), caps.len()) };
    assert_eq!(rc, KVLINK_OK, "{}", last_error());
    // SAFETY: NUL-terminated by the call above.
    let text = unsafe { CStr::from_ptr(caps.as_ptr()) }.to_str().unwrap();
    assert!(
        text.contains("memory cuda:")
            && text.contains("transport tcp:")
            && text.contains("disabled by configuration (gpu: false)"),
        "{text}"
    );
    // SAFETY: live engine, buffer of the given length.
    let rc = unsafe { kvlink_engine_capabilities(engine, caps.as_mut_ptr(), 8) };
    assert_eq!(rc, KVLINK_E_INVALID);
    assert!(last_error().contains("too small"), "{}", last_error());
    // Device memory that no runtime knows: KVLINK_E_GPU (no runtime) or KVLINK_E_INVALID (a
    // runtime says it is host memory); never a crash.
    let mut host = vec![0u8; 4096];
    let mut region = 0u32;
    // SAFETY: live engine; the address is refused before any access.
    let rc = unsafe {
        kvlink_engine_register_device(engine, host.as_mut_ptr() as u64, 4096, &mut region)
    };
    assert!(rc == KVLINK_E_GPU || rc == KVLINK_E_INVALID, "{rc}");
    assert!(
        last_error().contains("GPU") || last_error().contains("device"),
        "{}",
        last_error()
    );
    let mut f = std::ptr::null_mut();
    // SAFETY: live engine, valid out-pointer.
    let rc = unsafe { kvlink_engine_wait_finished(engine, 0, &mut f) };
    assert_eq!(rc, KVLINK_OK);
    // SAFETY: f was just made.
    assert_eq!(unsafe { kvlink_finished_count(f, KVLINK_RECEIVING) }, 0);
    // SAFETY: both are live and freed once.
    unsafe {
        kvlink_finished_free(f);
        kvlink_engine_free(engine);
    }
}

#[test]
fn cause_names_match_the_core() {
    use kvlink::{FailureCause, RdmaErrorKind};
    let all = [
        FailureCause::Expired,
        FailureCause::Peer,
        FailureCause::Connection,
        FailureCause::Rdma(RdmaErrorKind::Post),
        FailureCause::Gpu { code: None },
        FailureCause::Cancelled,
        FailureCause::Unconfirmed,
        FailureCause::Other,
    ];
    for c in all {
        assert_eq!(crate::finished::cause_name(&c).to_str().unwrap(), c.name());
    }
}

// Long: one scenario, start to stats, step by step through the C calls.
#[test]
fn the_c_event_publisher_is_read_by_the_subscriber() {
    use kvlink::events::{KvEvent, SubItem, Subscriber, SubscriberConfig};
    use std::ptr::null;

    let mut publisher = std::ptr::null_mut();
    // SAFETY: NUL-terminated literals and a writable out-pointer.
    let rc = unsafe {
        kvlink_event_publisher_start(
            c"tcp://*:0".as_ptr(),
            null(),
            c"kv@c".as_ptr(),
            0,
            KVLINK_EVENTS_CURRENT,
            &mut publisher,
        )
    };
    assert_eq!(rc, KVLINK_OK, "{}", last_error());
    let mut buf = [0 as c_char; 80];
    // SAFETY: a live publisher and a buffer of 80 bytes.
    let rc = unsafe { kvlink_event_publisher_endpoint(publisher, buf.as_mut_ptr(), 80) };
    assert_eq!(rc, KVLINK_OK);
    // SAFETY: NUL-terminated by the call above.
    let ep = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .replace('*', "127.0.0.1");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = SubscriberConfig::new(ep);
    cfg.topic = "kv@".into();
    let mut sub = rt.block_on(Subscriber::connect(cfg)).unwrap();
    std::thread::sleep(Duration::from_millis(1000)); // the subscription reaches the PUB

    let mut batch = std::ptr::null_mut();
    // SAFETY: a writable out-pointer.
    let rc = unsafe { kvlink_event_batch_new(12.5, 3, &mut batch) };
    assert_eq!(rc, KVLINK_OK);
    let hashes = [u64::MAX, 7];
    let parent = 6u64;
    let tokens: Vec<u32> = (0..32).collect();
    // SAFETY: live batch; the pointers cover the counts given.
    unsafe {
        assert_eq!(
            kvlink_event_batch_block_stored(
                batch,
                hashes.as_ptr(),
                2,
                &parent,
                tokens.as_ptr(),
                32,
                16,
                c"GPU".as_ptr()
            ),
            KVLINK_OK
        );
        assert_eq!(
            kvlink_event_batch_block_removed(batch, hashes.as_ptr(), 1, null()),
            KVLINK_OK
        );
        assert_eq!(kvlink_event_batch_all_cleared(batch, null()), KVLINK_OK);
        // Refusals: no hash, NULL tokens with a count.
        assert_eq!(
            kvlink_event_batch_block_removed(batch, hashes.as_ptr(), 0, null()),
            KVLINK_E_INVALID
        );
        assert!(last_error().contains("at least one block hash"));
        assert_eq!(
            kvlink_event_batch_block_stored(
                batch,
                hashes.as_ptr(),
                1,
                null(),
                null(),
                4,
                16,
                null()
            ),
            KVLINK_E_INVALID
        );
        assert_eq!(
            kvlink_event_publisher_publish(publisher, batch),
            KVLINK_OK,
            "{}",
            last_error()
        );
        // The batch was emptied: publishing it again sends an empty batch.
        assert_eq!(kvlink_event_publisher_publish(publisher, batch), KVLINK_OK);
        let mut now_batch = std::ptr::null_mut();
        assert_eq!(kvlink_event_batch_new(-1.0, -1, &mut now_batch), KVLINK_OK);
        assert_eq!(kvlink_event_batch_all_cleared(now_batch, null()), KVLINK_OK);
        assert_eq!(
            kvlink_event_publisher_publish(publisher, now_batch),
            KVLINK_OK
        );
        kvlink_event_batch_free(now_batch);
    }
    let mut items = Vec::new();
    while items.len() < 3 {
        match rt.block_on(sub.next(Duration::from_secs(10))).unwrap() {
            Some(i) => items.push(i),
            None => panic!("no batch within 10 s; got {items:?}"),
        }
    }
    let SubItem::Batch { seq, batch: b, .. } = &items[0] else {
        panic!("{items:?}")
    };
    assert_eq!((*seq, b.ts, b.dp_rank), (Some(0), 12.5, Some(3)));
    let SubItem::Batch { batch: second, .. } = &items[1] else {
        panic!("{items:?}")
    };
    // A reused batch keeps its own timestamp and rank.
    assert_eq!((second.ts, second.dp_rank), (12.5, Some(3)));
    // A batch with neither takes the publisher's rank and the time of publishing.
    let SubItem::Batch { batch: third, .. } = &items[2] else {
        panic!("{items:?}")
    };
    assert_eq!(third.dp_rank, Some(0));
    assert!(third.ts > 1.7e9, "{}", third.ts);
    assert_eq!(b.events.len(), 3);
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(s.block_hashes[0].as_u64(), u64::MAX);
    assert_eq!(s.parent_block_hash.as_ref().map(|h| h.as_u64()), Some(6));
    assert_eq!(
        (s.token_ids.len(), s.block_size, s.medium.as_deref()),
        (32, 16, Some("GPU"))
    );
    assert_eq!(b.events[2], KvEvent::all_cleared(None));
    let SubItem::Batch { batch: empty, .. } = &items[1] else {
        panic!("{items:?}")
    };
    assert!(empty.events.is_empty());
    let mut stats = kvlink_event_stats::default();
    // SAFETY: live publisher, writable out.
    let rc = unsafe { kvlink_event_publisher_stats(publisher, &mut stats) };
    assert_eq!(rc, KVLINK_OK);
    assert_eq!((stats.published, stats.dropped), (3, 0));
    // SAFETY: each freed once, not used afterwards.
    unsafe {
        kvlink_event_batch_free(batch);
        kvlink_event_publisher_free(publisher, 2000);
        kvlink_event_publisher_free(std::ptr::null_mut(), 0);
    }
}
