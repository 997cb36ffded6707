//! kvlink-bench's arguments: defaults, every option, each mistake's message.

use super::*;

#[test]
fn transport_names_are_the_engines() {
    for t in TransportChoice::ALL {
        let a = parse_from(["--transport", t.as_str()]).unwrap();
        assert_eq!(a.transport, t);
    }
    let none: [&str; 0] = [];
    assert_eq!(
        parse_from(none).unwrap().transport,
        TransportChoice::Network
    );
    let e = parse_from(["--transport", "ipc"]).unwrap_err();
    assert!(e.contains("got \"ipc\""), "{e}");
}

#[test]
fn defaults() {
    let none: [&str; 0] = [];
    let a = parse_from(none).unwrap();
    assert_eq!(a.mode, Mode::Loopback);
    assert_eq!(a.shape.name, "llama-3-8b");
    assert_eq!(
        (a.tokens, a.requests, a.warmup, a.concurrency),
        (4096, 16, 2, 2)
    );
    assert_eq!(
        (a.streams, a.qps, a.batch_bytes, a.seed),
        (4, 4, 4 << 20, 1)
    );
    assert_eq!((a.pattern, a.memory), (Pattern::Random, Memory::Host));
    assert_eq!(
        (a.listen.as_str(), a.advertise.as_str()),
        ("0.0.0.0:7400", "127.0.0.1")
    );
    assert_eq!(
        (a.prefill_tp, a.decode_tp, a.tp_rank, a.groups),
        (1, 1, 0, 1)
    );
    assert!(!a.tp_given && !a.verify && !a.json && !a.head_major);
    assert_eq!(a.out, "kvlink-sweep");
}

// Long: one command line with every option, each then checked against its field.
#[test]
fn every_option_lands_in_its_field() {
    let a = parse_from([
        "sweep",
        "--preset",
        "qwen2.5-7b",
        "--tokens",
        "512",
        "--pattern",
        "fragmented",
        "--requests",
        "3",
        "--warmup",
        "0",
        "--concurrency",
        "5",
        "--streams",
        "6",
        "--batch-bytes",
        "2MiB",
        "--blocks",
        "99",
        "--verify",
        "--json",
        "--seed",
        "7",
        "--listen",
        "1.2.3.4:5",
        "--advertise",
        "9.9.9.9",
        "--peer",
        "p:1",
        "--qps",
        "3",
        "--rdma-device",
        "mlx5_0",
        "--rdma-device",
        "mlx5_1",
        "--param",
        "tokens",
        "--values",
        "64,1K",
        "--out",
        "o",
        "--memory",
        "emulated",
        "--gpu",
        "2",
        "--decode-tp",
        "2",
        "--tp-rank",
        "1",
        "--groups",
        "2",
        "--head-layout",
        "hnd",
        "--block-tokens",
        "32",
    ])
    .unwrap();
    assert_eq!(a.mode, Mode::Sweep);
    assert_eq!(a.shape.name, "qwen2.5-7b");
    assert_eq!(a.shape.tokens_per_block, 32);
    assert_eq!((a.tokens, a.pattern), (512, Pattern::Fragmented));
    assert_eq!(
        (a.requests, a.warmup, a.concurrency, a.streams),
        (3, 0, 5, 6)
    );
    assert_eq!((a.batch_bytes, a.blocks, a.seed), (2 << 20, Some(99), 7));
    assert!(a.verify && a.json && a.head_major && a.tp_given);
    assert_eq!(
        (a.listen.as_str(), a.advertise.as_str()),
        ("1.2.3.4:5", "9.9.9.9")
    );
    assert_eq!((a.peer.as_deref(), a.qps), (Some("p:1"), 3));
    assert_eq!(a.rdma_device.as_deref(), Some("mlx5_0,mlx5_1"));
    assert_eq!(
        (a.param.as_deref(), a.values.clone()),
        (Some("tokens"), vec![64, 1024])
    );
    assert_eq!(
        (a.out.as_str(), a.memory, a.gpu),
        ("o", Memory::Emulated, 2)
    );
    assert_eq!(
        (a.prefill_tp, a.decode_tp, a.tp_rank, a.groups),
        (1, 2, 1, 2)
    );
    let c = parse_from(["--block-bytes", "4K", "--tensors", "3", "--memory", "cuda"]).unwrap();
    assert_eq!(
        (c.shape.name, c.shape.layers, c.shape.bytes_per_token),
        ("custom", 3, 4096)
    );
    assert_eq!(c.memory, Memory::Gpu(GpuApi::Cuda));
    let d = parse_from(["--prefill-block-tokens", "32"]).unwrap();
    assert_eq!((d.prefill_tokens(), d.shape.tokens_per_block), (32, 16));
}

#[test]
fn each_mistake_is_named() {
    let cases: &[(&[&str], &str)] = &[
        (&["fly"], "unknown mode \"fly\""),
        (&["--memory", "disk"], "unknown memory \"disk\""),
        (&["--pattern", "x"], "unknown pattern \"x\""),
        (&["--head-layout", "x"], "unknown head layout \"x\""),
        (&["--preset", "x"], "unknown preset \"x\""),
        (&["--tokens", "x"], "--tokens: "),
        (&["--batch-bytes", "2X"], "size \"2X\""),
        (&["--bogus"], "invalid option '--bogus'"),
        (
            &["--prefill-tp", "3", "--decode-tp", "2"],
            "--prefill-tp 3 --decode-tp 2: ",
        ),
        (
            &["--tp-rank", "1"],
            "--tp-rank 1 is not a rank of a TP group of 1",
        ),
        (&["--groups", "0"], "--groups 0 (1 to 32"),
        (
            &["--decode-tp", "3"],
            "pick TP sizes that divide the model's heads",
        ),
        (
            &["--block-bytes", "0"],
            "--block-bytes and --tensors must be at least 1",
        ),
        (
            &["--block-tokens", "0"],
            "--block-tokens must be at least 1",
        ),
        (
            &["--block-bytes", "1K", "--block-tokens", "4"],
            "applies to presets",
        ),
        (
            &["--prefill-block-tokens", "24"],
            "one must be a multiple of the other",
        ),
        (
            &["--prefill-block-tokens", "32", "--groups", "2"],
            "applies to loopback runs",
        ),
        (&["sweep"], "sweep needs --param and --values"),
        (
            &["sweep", "--param", "x", "--values", "1"],
            "unknown sweep parameter \"x\"",
        ),
        (
            &["sweep", "--param", "qps", "--values", "0"],
            "positive numbers",
        ),
        (&["--tokens", "0"], "must be at least 1"),
        (&["read"], "read needs --peer"),
    ];
    for (args, want) in cases {
        let e = parse_from(args.iter().copied()).unwrap_err();
        assert!(e.contains(want), "{args:?}: {e}");
    }
}

#[test]
fn the_hybrid_preset_has_state_and_pairs_equal_tp_sizes_only() {
    let a = parse_from(["--preset", "nemotron-h-8b"]).unwrap();
    let state = a.state.expect("state layers");
    assert_eq!((a.shape.layers, state.layers), (4, 24));
    // A state page: 3 x 10,240 bf16 conv values and 128 x 64 x 128 float32 SSM values; the
    // attention blocks' K and V pages at least as large.
    assert_eq!(state.page_bytes, 61_440 + 4_194_304);
    assert!(a.shape.block_bytes() * 2 >= state.page_bytes);
    assert!(a.tp_run(), "block groups take the TP-group driver");
    let a = parse_from([
        "--preset",
        "nemotron-h-8b",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
    ])
    .unwrap();
    assert_eq!((a.prefill_tp, a.decode_tp), (2, 2));
    // Choosing another preset after it drops the state.
    let a = parse_from(["--preset", "nemotron-h-8b", "--preset", "qwen2.5-7b"]).unwrap();
    assert!(a.state.is_none());
    for (args, says) in [
        (
            &[
                "--preset",
                "nemotron-h-8b",
                "--prefill-tp",
                "1",
                "--decode-tp",
                "2",
            ][..],
            "TP sizes must be equal (got 1 and 2)",
        ),
        (
            &["--preset", "nemotron-h-8b", "--groups", "2"][..],
            "--groups",
        ),
        (
            &["--preset", "nemotron-h-8b", "--block-bytes", "4K"][..],
            "no state layers",
        ),
        (&["--preset", "mamba"][..], "nemotron-h-8b"),
    ] {
        let e = parse_from(args.iter().copied()).unwrap_err();
        assert!(e.contains(says), "{args:?}: {e}");
    }
}
