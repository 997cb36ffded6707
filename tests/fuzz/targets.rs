//! Fuzzing entry points: each takes arbitrary bytes, runs one decoder that faces the network,
//! and panics only when an invariant breaks (a decoder's panic counts as one). The cargo-fuzz
//! targets under `tests/fuzz` call them, and `tests/fuzz_corpus.rs` runs them over the stored
//! corpora as ordinary tests.

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

use kvlink::internal::frame::{self, MAX_UNAUTHENTICATED_FRAME_BYTES, PROTOCOL_VERSION};
use kvlink::internal::messages::{Descriptor, Message, TransportInfo};
use kvlink::internal::tcp_wire as wire;
use kvlink::internal::Grant;
use kvlink::RegionId;
use kvlink::RegionInfo;
use kvlink::{KvLayout, ModelShape, TensorLayout};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime")
    })
}

/// A stream that hands out its bytes in pieces of the sizes it is given (cycled), as a socket
/// might.
struct Pieces<'a> {
    data: &'a [u8],
    sizes: &'a [u8],
    turn: usize,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let size = match self.sizes.len() {
            0 => usize::MAX,
            n => usize::from(self.sizes[self.turn % n]).max(1),
        };
        self.turn += 1;
        let n = size.min(buf.remaining()).min(self.data.len());
        let (now, rest) = self.data.split_at(n);
        buf.put_slice(now);
        self.data = rest;
        Poll::Ready(Ok(()))
    }
}

/// The control plane as a server reads it: frames from a stream delivered in arbitrary pieces
/// (the first byte picks the piece sizes and the pre-authentication cap), each decoded as a
/// message; descriptors are validated and compared with a valid one.
pub fn control_stream(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (sizes, stream) = rest.split_at(usize::from(mode & 7).min(rest.len()));
    let limit = if mode & 8 != 0 {
        MAX_UNAUTHENTICATED_FRAME_BYTES
    } else {
        frame::MAX_FRAME_BYTES
    };
    let mut r = Pieces {
        data: stream,
        sizes,
        turn: 0,
    };
    runtime().block_on(async {
        for _ in 0..64 {
            match frame::read_frame_up_to(&mut r, limit).await {
                Ok(Some((version, body))) => {
                    assert!(body.len() + 2 <= limit as usize, "frame over its cap");
                    message(version, &body);
                }
                Ok(None) | Err(_) => return,
            }
        }
    });
}

fn message(version: u16, body: &[u8]) {
    match frame::decode::<Message>(version, body) {
        Ok(Message::Hello { descriptor, .. }) | Ok(Message::Descriptor(descriptor)) => {
            check_descriptor(&descriptor)
        }
        Ok(m) => {
            // Whatever decodes encodes again.
            frame::encode(&m).expect("a decoded message encodes");
        }
        Err(_) => {}
    }
}

/// A descriptor as a handshake meets it: decoded from msgpack, validated, compared.
pub fn descriptor(data: &[u8]) {
    if let Ok(d) = rmp_serde::from_slice::<Descriptor>(data) {
        check_descriptor(&d);
    }
}

fn check_descriptor(d: &Descriptor) {
    if d.validate().is_ok() {
        // A valid descriptor survives a round trip and compares with itself as equal.
        let again = rmp_serde::to_vec_named(d).expect("encodes");
        let back: Descriptor = rmp_serde::from_slice(&again).expect("decodes");
        assert_eq!(&back, d);
        assert!(d.differences(d).is_empty());
        let _ = d.differences(&example_descriptor());
    }
}

/// A valid descriptor (a seed for the corpora, and the peer descriptors are compared with).
pub fn example_descriptor() -> Descriptor {
    let shape = ModelShape::LLAMA3_8B;
    Descriptor {
        protocol_version: PROTOCOL_VERSION,
        engine_id: "fuzz-host-1-rank0".into(),
        generation: 7,
        tp_rank: 0,
        tp_size: 1,
        layout: shape.layout(RegionId(1), 4),
        regions: vec![RegionInfo {
            id: RegionId(1),
            len: shape.region_bytes(4),
        }],
        transports: vec![TransportInfo::Tcp {
            addr: "127.0.0.1:7401".into(),
            streams: 4,
        }],
    }
}

/// Hostile descriptors that must be refused, each under 4 MiB encoded, as a raw-socket peer
/// would send them in a `Hello`: 4,096 regions with RDMA key lists that name the last region
/// over and over, or that carry 340,000 keys for it. (Validation once took 0.48 s of CPU on
/// the first; `benches/descriptor.rs` measures them.)
pub fn hostile_descriptors() -> Vec<(&'static str, Descriptor)> {
    let base = example_descriptor();
    let mut regions = base.regions.clone();
    for id in 2..=4096u32 {
        regions.push(RegionInfo {
            id: RegionId(id),
            len: 1 << 20,
        });
    }
    let last = RegionId(4096);
    let key = |rkeys: Vec<u32>| kvlink::internal::RdmaRegionInfo {
        id: last,
        addr: 1 << 40,
        chunk_bytes: 4096,
        rkeys,
    };
    let with_keys = |keys: Vec<kvlink::internal::RdmaRegionInfo>| {
        let mut d = base.clone();
        d.regions = regions.clone();
        d.transports.push(TransportInfo::Rdma {
            device: "rxe0".into(),
            gid: [0; 16],
            lid: 0,
            mtu: 1024,
            regions: keys,
        });
        d
    };
    vec![
        (
            "the last region keyed 4,096 times",
            with_keys((0..4096).map(|_| key(vec![7; 256])).collect()),
        ),
        (
            "340,000 keys for the last region",
            with_keys(vec![key(vec![7; 340_000])]),
        ),
    ]
}

/// The layout the data-plane target grants from: two tensors interleaved in region 1 (with
/// padding between blocks) and one in region 2.
fn grant_layout() -> KvLayout {
    let t = |name: &str, region, offset, stride, bytes| TensorLayout {
        name: name.into(),
        region: RegionId(region),
        offset,
        block_stride: stride,
        block_bytes: bytes,
        num_blocks: 8,
        group: 0,
        heads: None,
        token_runs: None,
    };
    KvLayout {
        tokens_per_block: 16,
        dtype: "bf16".into(),
        tensors: vec![
            t("k", 1, 0, 96, 40),
            t("v", 1, 40, 96, 40),
            t("kv", 2, 16, 64, 64),
        ],
    }
}

/// A data-plane request as the data server reads it: header, request id and entries decoded,
/// then each entry checked against a grant (blocks 1, 2, 5 and 7) and, for short ranges, the
/// verdict compared with a byte-by-byte reference.
pub fn data_request(data: &[u8]) {
    let Some(header) = data.get(..wire::REQUEST_HEADER) else {
        return;
    };
    let header: &[u8; wire::REQUEST_HEADER] = header.try_into().expect("header length");
    let Ok(head) = wire::decode_request_header(header) else {
        return;
    };
    let (count, id_len) = (head.count, head.id_len);
    assert!((1..=wire::MAX_ID).contains(&id_len) && count >= 1);
    assert_eq!(head.flags & !wire::FLAGS, 0, "unknown flags refused");
    let rest = &data[wire::REQUEST_HEADER..];
    let Some(id) = rest.get(..id_len) else {
        return;
    };
    if wire::decode_request_id(id).is_err() {
        return;
    }
    let extra = wire::Extras::len_of(head.flags);
    let Some(extras) = rest.get(id_len..id_len + extra) else {
        return;
    };
    let _ = wire::Extras::decode(head.flags, extras);
    let rest = &rest[extra..];
    let layout = grant_layout();
    let grant =
        Grant::new(std::sync::Arc::new(layout.clone()), &[[1, 2, 5, 7]]).expect("a valid grant");
    let body = &rest[id_len..];
    let mut checker = grant.checker();
    let n = body.len().min(count as usize * wire::ENTRY) / wire::ENTRY * wire::ENTRY;
    for e in wire::decode_entries(&body[..n]) {
        // Keep the numbers in reach of the layout half the time, so the walk gets exercised.
        let (offset, len) = if e.offset >> 63 == 0 {
            (e.offset % 1024, e.len % 512)
        } else {
            (e.offset, e.len)
        };
        let verdict = checker.check(e.region, offset, len).is_ok();
        if len <= 4096 && offset.checked_add(len).is_some() {
            let granted_byte = |x: u64| {
                layout.tensors.iter().any(|t| {
                    t.region == e.region
                        && x >= t.offset
                        && (x - t.offset) / t.block_stride < u64::from(t.num_blocks)
                        && (x - t.offset) % t.block_stride < t.block_bytes
                        && grant.has(0, ((x - t.offset) / t.block_stride) as u32)
                })
            };
            let want = len > 0 && (offset..offset + len).all(granted_byte);
            assert_eq!(verdict, want, "entry {e:?} as {offset}+{len}");
        }
    }
}

/// A KV-event batch as a subscriber reads it: decoded, and what decodes re-encodes (in both
/// encodings) to a batch that decodes to the same, unknown fields included where the encoding
/// can carry them (named ones in maps, positional ones in arrays).
pub fn events_batch(data: &[u8]) {
    #[cfg(feature = "events")]
    {
        use kvlink::events::{decode_batch, encode_batch, Encoding, FieldKey, KvEvent};
        let Ok(decoded) = decode_batch(data) else {
            return;
        };
        for enc in [Encoding::Current, Encoding::Legacy] {
            let mut out = Vec::new();
            encode_batch(&decoded.batch, enc, &mut out);
            let again = decode_batch(&out).expect("an encoded batch decodes");
            assert!(again.skipped.is_empty(), "{:?}", again.skipped);
            let mut want = decoded.batch.clone();
            for e in &mut want.events {
                let extra = match e {
                    KvEvent::BlockStored(x) => &mut x.extra,
                    KvEvent::BlockRemoved(x) => &mut x.extra,
                    KvEvent::AllBlocksCleared { extra, .. } => extra,
                    KvEvent::BlockTransferred(x) => &mut x.extra,
                };
                extra.retain(|f| {
                    matches!(
                        (&f.key, enc),
                        (FieldKey::Name(_), Encoding::Current)
                            | (FieldKey::Position(_), Encoding::Legacy)
                    )
                });
            }
            // Debug text compares NaN timestamps as equal.
            assert_eq!(
                format!("{:?}", again.batch),
                format!("{:?}", want),
                "{enc:?} round trip"
            );
        }
    }
    #[cfg(not(feature = "events"))]
    let _ = data;
}
