//! GPU memory: the absence paths (no CUDA, no HIP, a device pointer without a runtime) on every
//! machine; the TCP staging paths with emulated device memory (host memory behind the device
//! interface) on every machine; real CUDA memory on both sides where CUDA is loaded, otherwise
//! that test says "skipped: no CUDA" in its output.

mod common;

use std::time::Duration;

use common::*;
use kvlink::{
    DeviceMemory, Engine, EngineConfig, Error, GpuApi, GpuError, MemoryKind, ModelShape,
    PointerKind, RequestId,
};

/// The prefill worker of the two-process tests. A helper, not a test: ignored, so that test runs
/// neither run nor count it; `ChildPrefill::spawn` runs it with `--ignored --exact`.
#[test]
#[ignore = "helper: run as a child process by the two-process tests"]
fn prefill_child() {
    prefill_child_main();
}

/// A small shape: 4 layers of K and V, 16 tokens of 256 bytes (4 KiB per block and tensor).
const SHAPE: ModelShape = ModelShape {
    name: "test-small",
    layers: 4,
    tensors_per_layer: 2,
    bytes_per_token: 256,
    kv_heads: 0,
    tokens_per_block: 16,
    dtype: "bf16",
};

fn transfer(prefill: &Side, decode: &Side, seed: u64, reqs: &[(Vec<u32>, Vec<u32>)]) {
    let peer = prefill.engine.handshake_address().to_string();
    for (i, (l, r)) in reqs.iter().enumerate() {
        prefill.engine.hold_blocks(format!("req-{i}"), r).unwrap();
        decode
            .engine
            .read_blocks(&peer, format!("req-{i}"), l, r)
            .unwrap();
    }
    let got = collect(&decode.engine, Duration::from_secs(60), |f| {
        f.receiving.len() + f.failed.len() == reqs.len()
    });
    assert!(got.failed.is_empty(), "failed: {:?}", got.failed);
    assert_eq!(got.receiving.len(), reqs.len());
    for (i, (l, r)) in reqs.iter().enumerate() {
        verify(decode, &prefill.layout, seed, l, r);
        assert!(got.receiving.contains(&RequestId::from(format!("req-{i}"))));
    }
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
        f.sending.len() == reqs.len()
    });
    assert_eq!(sent.sending.len(), reqs.len());
}

/// Small staging buffers and only two of them: responses span many chunks, the pool runs dry
/// and pipelines wait on each other.
fn staging_config() -> EngineConfig {
    quick_config().with(|c| {
        c.staging_chunk_bytes = 24 << 10;
        c.staging_buffers = 2;
        c.tcp_streams = 3;
        c.batch_bytes = 200 << 10;
        c.transport = kvlink::TransportChoice::Tcp;
    })
}

#[test]
fn absent_gpu_runtimes_are_reported_with_reasons() {
    init_logs();
    let e = Engine::start(quick_config()).unwrap();
    let caps = e.capabilities();
    let text = caps.to_string();
    assert!(text.contains("memory host:    yes"), "{text}");
    for (name, r) in [("cuda", &caps.gpu.cuda), ("hip", &caps.gpu.hip)] {
        match r {
            Ok(desc) => eprintln!("{name} found: {desc}"),
            Err(why) => {
                assert!(!why.is_empty());
                assert!(text.contains(why.as_str()), "{text}");
                assert!(caps.summary().contains(&format!("{name}: {why}")));
            }
        }
    }
    // Host memory is host memory whatever is loaded.
    let host = e.allocate_host(4096, false).unwrap();
    assert_eq!(
        e.classify_pointer(host.as_ptr() as u64).unwrap(),
        PointerKind::Host
    );
    assert_eq!(host.kind(), MemoryKind::HostMapped);
}

#[test]
fn device_pointer_without_a_runtime_is_a_clear_error() {
    init_logs();
    let e = Engine::start(quick_config()).unwrap();
    let caps = e.capabilities();
    // An address no runtime knows, passed as device memory.
    let mut fake = vec![0u8; 8192];
    // SAFETY: never dereferenced: registration is refused before any access.
    let mem = unsafe { DeviceMemory::new(fake.as_mut_ptr() as u64, 8192) }.unwrap();
    match e.register_device(mem) {
        Err(Error::Gpu(GpuError { message: msg, .. })) => {
            assert!(caps.gpu.cuda.is_err() && caps.gpu.hip.is_err());
            assert!(msg.contains("no GPU runtime is loaded"), "{msg}");
            assert!(msg.contains("CUDA:") && msg.contains("HIP:"), "{msg}");
        }
        Err(Error::InvalidArgument(msg)) => {
            // A runtime is loaded and says this is host memory.
            assert!(caps.gpu.cuda.is_ok() || caps.gpu.hip.is_ok());
            assert!(msg.contains("not GPU device memory"), "{msg}");
        }
        other => panic!("host memory registered as device memory: {other:?}"),
    }
    // Allocation through a missing runtime names the runtime and why it is missing.
    for (api, probe) in [(GpuApi::Cuda, &caps.gpu.cuda), (GpuApi::Hip, &caps.gpu.hip)] {
        if let Err(why) = probe {
            match e.allocate_device(api, 0, 1 << 20) {
                Err(Error::Gpu(GpuError { message: msg, .. })) => {
                    assert!(
                        msg.contains(&format!("cannot allocate {api} memory")),
                        "{msg}"
                    );
                    assert!(msg.contains(why.as_str()), "{msg}");
                }
                other => panic!("{api} allocation without {api}: {other:?}"),
            }
        }
    }
    // Emulated device memory can be allocated (a memfd, so that its IPC works between
    // processes); it is device memory to every transfer path.
    let emulated = e.allocate_device(GpuApi::Emulated, 0, 4096).unwrap();
    assert!(emulated.is_device());
    let id = emulated.id();
    drop(emulated);
    e.deregister(id).unwrap();
    // SAFETY: arguments are refused before any use.
    assert!(unsafe { DeviceMemory::new(0, 10) }.is_err());
    assert!(unsafe { DeviceMemory::new(u64::MAX - 4, 10) }.is_err());
    assert!(unsafe { DeviceMemory::new(4096, 0) }.is_err());

    // None of this disturbs host transfers.
    let seed = 77;
    let prefill = side(&SHAPE, 32, Some(seed), quick_config());
    let decode = side(&SHAPE, 32, None, quick_config());
    transfer(&prefill, &decode, seed, &[(vec![1, 5, 9], vec![30, 2, 17])]);
}

#[test]
fn gpu_disabled_by_configuration() {
    let e = Engine::start(quick_config().with(|c| {
        c.gpu = false;
    }))
    .unwrap();
    let caps = e.capabilities();
    assert!(caps
        .gpu
        .cuda
        .unwrap_err()
        .contains("disabled by configuration"));
    let mut fake = vec![0u8; 64];
    // SAFETY: never dereferenced (refused).
    let mem = unsafe { DeviceMemory::new(fake.as_mut_ptr() as u64, 64) }.unwrap();
    match e.register_device(mem) {
        Err(Error::Gpu(GpuError { message: msg, .. })) => {
            assert!(msg.contains("disabled by configuration"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    assert!(Engine::start(quick_config().with(|c| {
        c.staging_buffers = 0;
    }))
    .is_err());
    assert!(Engine::start(quick_config().with(|c| {
        c.staging_chunk_bytes = 100;
    }))
    .is_err());
}

fn staged(prefill_mem: Mem, decode_mem: Mem) {
    let seed = 0x5747 ^ prefill_mem as u64 ^ ((decode_mem as u64) << 8);
    let prefill = side_in(prefill_mem, &SHAPE, 96, Some(seed), staging_config());
    let decode = side_in(decode_mem, &SHAPE, 112, None, staging_config());
    for s in [&prefill, &decode] {
        let device = s.region.kind()
            == MemoryKind::Device {
                api: GpuApi::Emulated,
                ordinal: 0,
            };
        assert_eq!(device, s.region.is_device());
    }
    let mut rng = Rng(seed);
    // Random blocks (4 KiB segments, many per staging chunk) and one contiguous run on both
    // sides (64 KiB segments, each split over three 24 KiB chunks).
    let mut reqs = random_requests(&mut rng, 96, 96, 6, 12);
    reqs.push(((96..112).collect(), (10..26).collect()));
    transfer(&prefill, &decode, seed, &reqs);
    let bytes: u64 = reqs.iter().map(|(l, _)| l.len() as u64).sum::<u64>() * SHAPE.region_bytes(1);
    assert_eq!(served(&prefill.engine, bytes), bytes);
    // Device memory went through staging buffers, host memory did not.
    let out = if prefill_mem == Mem::Host { 0 } else { bytes };
    let inn = if decode_mem == Mem::Host { 0 } else { bytes };
    assert_eq!(prefill.engine.stats().bytes_staged_out, out);
    assert_eq!(decode.engine.stats().bytes_staged_in, inn);
    assert_eq!(prefill.engine.stats().bytes_staged_in, 0);
    assert_eq!(decode.engine.stats().bytes_staged_out, 0);
}

#[test]
fn device_to_device_over_tcp_through_staging() {
    staged(Mem::Emulated, Mem::Emulated);
}

#[test]
fn host_to_device_over_tcp_through_staging() {
    staged(Mem::Host, Mem::Emulated);
}

#[test]
fn device_to_host_over_tcp_through_staging() {
    staged(Mem::Emulated, Mem::Host);
}

#[test]
fn cuda_device_memory_over_tcp_every_byte_checked() {
    if !cuda_loaded() {
        return;
    }
    let seed = 0xC0DA;
    let config = quick_config().with(|c| {
        c.transport = kvlink::TransportChoice::Tcp;
    });
    let prefill = side_in(
        Mem::Cuda,
        &ModelShape::LLAMA3_8B,
        64,
        Some(seed),
        config.clone(),
    );
    let decode = side_in(Mem::Cuda, &ModelShape::LLAMA3_8B, 64, None, config.clone());
    assert!(matches!(
        prefill.region.kind(),
        MemoryKind::Device {
            api: GpuApi::Cuda,
            ..
        }
    ));
    assert!(matches!(
        decode
            .engine
            .classify_pointer(decode.region.as_ptr() as u64)
            .unwrap(),
        PointerKind::Device {
            api: GpuApi::Cuda,
            ordinal: 0
        }
    ));
    let mut rng = Rng(seed);
    let reqs = random_requests(&mut rng, 64, 64, 4, 16);
    transfer(&prefill, &decode, seed, &reqs);
    // Host memory on one side, CUDA on the other.
    let host = side(&ModelShape::LLAMA3_8B, 64, None, config);
    transfer(&prefill, &host, seed, &reqs);
    // A device pointer offered as host memory is refused, naming the device.
    // SAFETY: refused before any access.
    let m = unsafe { kvlink::ExternalMemory::new(prefill.region.as_ptr(), 4096) }.unwrap();
    match decode.engine.register_host(m) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("GPU 0"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn peer_killed_mid_staged_transfer_fails_requests_then_a_new_peer_works() {
    // The decode side receives into (emulated) device memory through staging buffers while the
    // prefill process is killed: every request ends (failed with the connection's reason, none
    // expired), nothing stays in flight, and a new peer serves the same engine.
    let shape = ModelShape::LLAMA3_8B;
    let blocks = 64;
    let n = 8;
    let mut child = ChildPrefill::spawn(shape.name, blocks, 5, n, "tcp");
    let decode = side_in(Mem::Emulated, &shape, blocks, None, quick_config());
    let all: Vec<u32> = (0..blocks).collect();
    let (f, _) = kill_peer_mid_transfer(&decode, &mut child, &all, n, Duration::from_secs(60));
    assert_eq!(f.receiving.len() + f.failed.len(), n, "{f:?}");
    assert!(!f.failed.is_empty(), "killing the peer failed no request");
    for fr in &f.failed {
        assert!(!fr.expired, "{fr:?}");
        let r = fr.reason.to_lowercase();
        // A read whose bytes had all arrived fails by the dead prefill's missing confirmation.
        assert!(
            r.contains("lost")
                || r.contains("closed")
                || r.contains("reset")
                || fr.cause == kvlink::FailureCause::Unconfirmed,
            "{fr:?}"
        );
    }
    assert_eq!(decode.engine.in_flight(), (0, 0));
    let child2 = ChildPrefill::spawn(shape.name, blocks, 9, 1, "tcp");
    let (l, r) = (vec![5u32, 9, 60], vec![17u32, 3, 63]);
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
    assert!(decode.engine.stats().bytes_staged_in > 0);
}

#[test]
fn engines_reading_device_memory_from_each_other_do_not_stall() {
    // Two engines each serve and read device memory at once, with one shared serving buffer
    // each and many requests in flight both ways: serving pipelines hold the pool while they
    // write, so readers must never depend on it (they have their own buffers), or the two
    // engines could wait on each other until io_timeout.
    let config = staging_config().with(|c| {
        c.staging_buffers = 1;
    });
    let (sa, sb) = (11, 22);
    let a = side_in(Mem::Emulated, &SHAPE, 96, Some(sa), config.clone());
    let b = side_in(Mem::Emulated, &SHAPE, 96, Some(sb), config);
    let (pa, pb) = (
        a.engine.handshake_address().to_string(),
        b.engine.handshake_address().to_string(),
    );
    // A reads into its blocks 0..48 from B's 48..96, B into its 0..48 from A's 48..96.
    let mut rng = Rng(5);
    let mut reqs = Vec::new();
    for i in 0..8 {
        let l: Vec<u32> = (i * 6..i * 6 + 6).collect();
        let r: Vec<u32> = rng
            .shuffled(48)
            .into_iter()
            .take(6)
            .map(|x| x + 48)
            .collect();
        reqs.push((l, r));
    }
    // A stall would end in io_timeout (5 s) tearing streams down: failed requests below.
    for (i, (l, r)) in reqs.iter().enumerate() {
        b.engine.hold_blocks(format!("a{i}"), r).unwrap();
        a.engine.hold_blocks(format!("b{i}"), r).unwrap();
        a.engine.read_blocks(&pb, format!("a{i}"), l, r).unwrap();
        b.engine.read_blocks(&pa, format!("b{i}"), l, r).unwrap();
    }
    for (reader, n) in [(&a, "a"), (&b, "b")] {
        let f = collect(&reader.engine, Duration::from_secs(30), |f| {
            f.receiving.len() + f.failed.len() == reqs.len()
        });
        assert!(f.failed.is_empty(), "{n}: {:?}", f.failed);
        assert_eq!(f.receiving.len(), reqs.len(), "{n}");
    }
    for (l, r) in &reqs {
        verify(&a, &b.layout, sb, l, r);
        verify(&b, &a.layout, sa, l, r);
    }
}
