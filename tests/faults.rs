//! Faults and hostile input: a peer that never answers, nobody listening, malformed and
//! oversized control frames, wrong protocol versions, incompatible descriptors, and read
//! requests outside exported memory. Each gets a clear error, nothing panics, and the engine
//! keeps serving well-behaved peers.

mod common;
// The fuzz targets' descriptors: the hostile ones are sent to a live engine here.
#[allow(dead_code)]
#[path = "fuzz/targets.rs"]
mod fuzz;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use kvlink::internal::frame::{self, PROTOCOL_VERSION};
use kvlink::internal::messages::Message;
use kvlink::internal::tcp_wire as wire;
use kvlink::{ModelShape, RegionId};

#[test]
fn silent_handshake_peer_fails_at_the_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Accepts and then says nothing, until the test is done with it.
    let (release, released) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let _ = released.recv_timeout(Duration::from_secs(30));
        drop(s);
    });
    let decode = side(&ModelShape::LLAMA3_8B, 4, None, quick_config());
    let t0 = Instant::now();
    decode
        .engine
        .read_blocks(&addr, "silent", &[0], &[0])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(15), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed.len(), 1, "{f:?}");
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Connection);
    assert!(
        f.failed[0].reason.contains("timed out"),
        "{:?}",
        f.failed[0]
    );
    assert!(
        f.failed[0].reason.contains("handshake reply"),
        "{:?}",
        f.failed[0]
    );
    // A silent peer is a connection failure, not the request's own deadline.
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Connection);
    // Ends at the handshake deadline (0.5 s), far inside the request deadline (20 s).
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    release.send(()).unwrap();
    holder.join().unwrap();
}

#[test]
fn nobody_listening_fails_with_the_os_reason() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let decode = side(&ModelShape::LLAMA3_8B, 4, None, quick_config());
    decode
        .engine
        .read_blocks(&addr, "nobody", &[0], &[0])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(15), |f| {
        !f.failed.is_empty()
    });
    assert!(f.failed[0].reason.contains("refused"), "{:?}", f.failed[0]);
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Connection);
    // Unresolvable names fail too, without hanging.
    decode
        .engine
        .read_blocks("no-such-host.invalid:1", "dns", &[0], &[0])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(15), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed.len(), 1, "{f:?}");
}

/// Sends raw bytes to a control port and returns the refusal message it answers with.
fn control_exchange(addr: &str, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(bytes).unwrap();
    let mut head = [0u8; 4];
    s.read_exact(&mut head).unwrap();
    let len = u32::from_be_bytes(head) as usize;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    let version = u16::from_be_bytes([body[0], body[1]]);
    match frame::decode::<Message>(version, &body[2..]).unwrap() {
        Message::Error { message } => message,
        other => panic!("expected an Error frame, got {other:?}"),
    }
}

fn raw_frame(version: u16, body: &[u8]) -> Vec<u8> {
    let mut v = ((body.len() + 2) as u32).to_be_bytes().to_vec();
    v.extend_from_slice(&version.to_be_bytes());
    v.extend_from_slice(body);
    v
}

#[test]
fn hostile_control_frames_are_refused_and_serving_goes_on() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(11), quick_config());
    let addr = prefill.engine.handshake_address().to_string();

    let m = control_exchange(&addr, &[0x7f, 0xff, 0xff, 0xff]);
    assert!(m.contains("exceeds"), "{m}");
    let hello = frame::encode(&Message::Ping { nonce: 1 }).unwrap();
    let m = control_exchange(&addr, &raw_frame(PROTOCOL_VERSION + 7, &hello[6..]));
    let want = format!("protocol version {} is not supported", PROTOCOL_VERSION + 7);
    assert!(m.contains(&want), "{m}");
    let m = control_exchange(&addr, &raw_frame(PROTOCOL_VERSION, &[0xc1, 0x00, 0xff]));
    assert!(m.contains("malformed"), "{m}");
    let m = control_exchange(&addr, &raw_frame(PROTOCOL_VERSION, &[0x92, 0x01]));
    assert!(m.contains("malformed"), "{m}");
    let m = control_exchange(&addr, &hello);
    assert!(m.contains("expected Hello"), "{m}");
    let m = control_exchange(&addr, &raw_frame(PROTOCOL_VERSION, &[]));
    assert!(m.contains("malformed"), "{m}");

    // A Hello whose descriptor is invalid, and one that is incompatible.
    let mut bad = prefill.engine.descriptor().unwrap();
    bad.tp_rank = 5;
    let m = control_exchange(
        &addr,
        &frame::encode(&Message::Hello {
            descriptor: Box::new(bad),
            session: None,
        })
        .unwrap(),
    );
    assert!(m.contains("tp_rank 5 of tp_size 1"), "{m}");
    let mut bad = prefill.engine.descriptor().unwrap();
    bad.layout.tensors[3].offset = u64::MAX - 10;
    let m = control_exchange(
        &addr,
        &frame::encode(&Message::Hello {
            descriptor: Box::new(bad),
            session: None,
        })
        .unwrap(),
    );
    assert!(m.contains("run past the end"), "{m}");
    let mut other = prefill.engine.descriptor().unwrap();
    other.layout.dtype = "fp8_e4m3".into();
    other.layout.tensors.pop();
    let m = control_exchange(
        &addr,
        &frame::encode(&Message::Hello {
            descriptor: Box::new(other),
            session: None,
        })
        .unwrap(),
    );
    assert!(
        m.contains("dtype") && m.contains("tensor count 64 vs 63"),
        "{m}"
    );

    // A connection that sends half a header and stalls is dropped at the handshake deadline.
    let mut stall = TcpStream::connect(&addr).unwrap();
    stall.write_all(&[0, 0]).unwrap();
    stall
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 256];
    let _ = stall.read(&mut buf); // Error frame or close, both fine; it must not hang.

    assert_eq!(prefill.engine.stats().handshakes_refused, 10);
    // Well-behaved peers are still served.
    let decode = side(&shape, 16, None, quick_config());
    prefill.engine.hold_blocks("ok", &[12, 1]).unwrap();
    decode
        .engine
        .read_blocks(&addr, "ok", &[3, 7], &[12, 1])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 11, &[3, 7], &[12, 1]);
}

fn data_request(s: &mut TcpStream, tag: u64, id: &str, entries: &[wire::Entry]) -> (u8, Vec<u8>) {
    data_request_with(s, tag, id, &wire::Extras::default(), entries)
}

fn data_request_with(
    s: &mut TcpStream,
    tag: u64,
    id: &str,
    extras: &wire::Extras,
    entries: &[wire::Entry],
) -> (u8, Vec<u8>) {
    let mut buf = Vec::new();
    wire::encode_request(tag, id, extras, entries.iter().copied(), &mut buf);
    s.write_all(&buf).unwrap();
    response(s, tag)
}

fn response(s: &mut TcpStream, tag: u64) -> (u8, Vec<u8>) {
    let mut head = [0u8; wire::RESPONSE_HEADER];
    s.read_exact(&mut head).unwrap();
    let (t, status, len) = wire::decode_response_header(&head).unwrap();
    assert_eq!(t, tag);
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).unwrap();
    (status, body)
}

/// A data request that asks for its read to be confirmed (protocol 8) is confirmed only for
/// the reader of a control session that is open, and only once: without a session it gets its
/// bytes but no confirmation; a session never opened is refused; an open one confirms the read
/// (the prefill reports the send done), after which the request is no longer held.
#[test]
fn a_confirmation_with_the_data_needs_an_open_session_and_a_live_hold() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 8, Some(22), quick_config());
    let layout = &prefill.layout;
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    prefill.engine.hold_blocks("conf", &[2]).unwrap();
    let block = wire::Entry {
        region: prefill.region.id(),
        offset: layout.tensors[0].offset + 2 * layout.tensors[0].block_stride,
        len: layout.tensors[0].block_bytes,
    };
    let mut s = TcpStream::connect(data).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let confirm = |session| wire::Extras {
        confirm: true,
        hold: None,
        session,
    };
    // No session: the bytes, then no confirmation.
    let (st, body) = data_request_with(&mut s, 1, "conf", &confirm(None), &[block]);
    assert_eq!((st, body.len() as u64), (wire::STATUS_OK, block.len));
    let (st, why) = response(&mut s, 1);
    assert_eq!(st, wire::STATUS_UNCONFIRMED);
    assert!(String::from_utf8_lossy(&why).contains("no control session"));
    // A session that was never opened: refused before any byte.
    let (st, why) = data_request_with(&mut s, 2, "conf", &confirm(Some([9; 16])), &[block]);
    assert_eq!(st, wire::STATUS_REFUSED);
    assert!(String::from_utf8_lossy(&why).contains("control session that is not open"));
    // An open session (a Hello that names it, kept open): confirmed.
    let mut c = TcpStream::connect(prefill.engine.handshake_address()).unwrap();
    let hello = Message::Hello {
        descriptor: Box::new(prefill.engine.descriptor().unwrap()),
        session: Some([7; 16]),
    };
    c.write_all(&frame::encode(&hello).unwrap()).unwrap();
    let mut len = [0u8; 4];
    c.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u32::from_be_bytes(len) as usize];
    c.read_exact(&mut answer).unwrap();
    let (st, _) = data_request_with(&mut s, 3, "conf", &confirm(Some([7; 16])), &[block]);
    assert_eq!(st, wire::STATUS_OK);
    let (st, held) = response(&mut s, 3);
    assert_eq!((st, held.len()), (wire::STATUS_CONFIRMED, 8));
    let sent = collect(&prefill.engine, Duration::from_secs(5), |f| !f.is_empty());
    assert_eq!(sent.sending.len(), 1, "{sent:?}");
    // Confirmed once: the request is no longer held.
    let (st, why) = data_request_with(&mut s, 4, "conf", &confirm(Some([7; 16])), &[block]);
    assert_eq!(
        st,
        wire::STATUS_REFUSED,
        "{}",
        String::from_utf8_lossy(&why)
    );
}

#[test]
fn reads_outside_exported_memory_are_refused() {
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let prefill = side(&shape, 8, Some(21), quick_config());
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    let region = prefill.region.id();
    let len = prefill.region.len();
    let all: Vec<u32> = (0..8).collect();
    prefill.engine.hold_blocks("raw", &all).unwrap();
    let mut s = TcpStream::connect(data).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let e = |region, offset, len| wire::Entry {
        region,
        offset,
        len,
    };

    let (st, body) = data_request(&mut s, 1, "raw", &[e(RegionId(999), 0, 8)]);
    assert_eq!(st, wire::STATUS_REFUSED);
    assert!(String::from_utf8_lossy(&body).contains("region#999 is not exported"));
    let (st, body) = data_request(&mut s, 2, "raw", &[e(region, 0, 8), e(region, len - 4, 8)]);
    assert_eq!(st, wire::STATUS_REFUSED);
    assert!(
        String::from_utf8_lossy(&body).contains("entry 1: range"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    let (st, _) = data_request(&mut s, 3, "raw", &[e(region, u64::MAX, 2)]);
    assert_eq!(st, wire::STATUS_REFUSED);
    let (st, _) = data_request(
        &mut s,
        4,
        "raw",
        &[e(region, 0, wire::MAX_REQUEST_BYTES + 1)],
    );
    assert_eq!(st, wire::STATUS_REFUSED);
    // The same stream still serves a valid request, with the right bytes.
    let (st, body) = data_request(
        &mut s,
        5,
        "raw",
        &[e(region, 100, 50), e(region, len - 10, 10)],
    );
    assert_eq!(st, wire::STATUS_OK);
    assert_eq!(&body[..50], &pattern(21, 100, 50)[..]);
    assert_eq!(&body[50..], &pattern(21, len - 10, 10)[..]);

    // Reads name a held request and stay inside its blocks.
    let t = &prefill.layout.tensors[1];
    let (st, body) = data_request(&mut s, 6, "never-held", &[e(region, 100, 50)]);
    assert_eq!(st, wire::STATUS_REFUSED);
    let why = String::from_utf8_lossy(&body).to_string();
    assert!(why.contains("never-held is not held"), "{why}");
    prefill.engine.hold_blocks("part", &[2]).unwrap();
    let (st, body) = data_request(&mut s, 7, "part", &[e(region, t.block_offset(2), 64)]);
    assert_eq!(st, wire::STATUS_OK);
    assert_eq!(body, pattern(21, t.block_offset(2), 64));
    let (st, body) = data_request(
        &mut s,
        8,
        "part",
        &[e(region, t.block_offset(2), t.block_bytes + 1)],
    );
    assert_eq!(st, wire::STATUS_REFUSED);
    let why = String::from_utf8_lossy(&body).to_string();
    assert!(why.contains("block 3") && why.contains("not held"), "{why}");

    // Garbage and oversized entry counts drop that connection only.
    let mut g = TcpStream::connect(data).unwrap();
    g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    g.write_all(&[0xAB; 16]).unwrap();
    let mut one = [0u8; 1];
    assert_eq!(
        g.read(&mut one).unwrap_or(0),
        0,
        "connection closed after a bad magic"
    );
    let mut g = TcpStream::connect(data).unwrap();
    g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hdr = Vec::new();
    wire::encode_request(
        1,
        "raw",
        &wire::Extras::default(),
        std::iter::empty(),
        &mut hdr,
    );
    hdr[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    g.write_all(&hdr).unwrap();
    assert_eq!(
        g.read(&mut one).unwrap_or(0),
        0,
        "connection closed after a huge count"
    );

    let stats = prefill.engine.stats();
    assert_eq!(stats.data_requests_refused, 6, "{stats:?}");
    assert_eq!(stats.data_requests_served, 2, "{stats:?}");
    // Other peers are unaffected.
    let decode = side(&shape, 8, None, quick_config());
    let peer = prefill.engine.handshake_address().to_string();
    prefill.engine.hold_blocks("fine", &[7, 2]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "fine", &[0, 5], &[7, 2])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 21, &[0, 5], &[7, 2]);
}

/// Reads one control frame.
fn read_message(s: &mut TcpStream) -> Message {
    let mut head = [0u8; 4];
    s.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(head) as usize];
    s.read_exact(&mut body).unwrap();
    frame::decode::<Message>(u16::from_be_bytes([body[0], body[1]]), &body[2..]).unwrap()
}

#[test]
fn a_notice_with_an_invalid_id_is_refused_alone() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(11), quick_config());
    let addr = prefill.engine.handshake_address().to_string();
    prefill.engine.hold_blocks("req-ok", &[0]).unwrap();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Message::Hello {
        descriptor: Box::new(prefill.engine.descriptor().unwrap()),
        session: None,
    };
    s.write_all(&frame::encode(&hello).unwrap()).unwrap();
    assert!(matches!(read_message(&mut s), Message::Descriptor(_)));
    // A 300-byte id is over the limit: that notice is dropped, the session goes on.
    let long = Message::Done {
        request_id: "x".repeat(300).into(),
        hold: None,
    };
    s.write_all(&frame::encode(&long).unwrap()).unwrap();
    let ok = Message::Done {
        request_id: "req-ok".into(),
        hold: None,
    };
    s.write_all(&frame::encode(&ok).unwrap()).unwrap();
    // A valid Done is answered: held, so confirmed; the same again is refused (no longer held).
    let confirm = |m: Message| match m {
        Message::Confirm {
            request_id,
            refused,
            ..
        } => (request_id.as_str().to_string(), refused),
        other => panic!("expected a Confirm, got {other:?}"),
    };
    assert_eq!(confirm(read_message(&mut s)), ("req-ok".to_string(), None));
    s.write_all(&frame::encode(&ok).unwrap()).unwrap();
    let (id, refused) = confirm(read_message(&mut s));
    assert_eq!(id, "req-ok");
    assert!(refused.is_some_and(|why| why.contains("not held")));
    s.write_all(&frame::encode(&Message::Ping { nonce: 9 }).unwrap())
        .unwrap();
    assert!(
        matches!(read_message(&mut s), Message::Pong { nonce: 9 }),
        "the session is still open"
    );
    let f = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(f.sending, vec![kvlink::RequestId::from("req-ok")], "{f:?}");
}

#[test]
fn crafted_descriptors_are_refused_and_serving_goes_on() {
    // Hellos built to make validation expensive (many regions, key lists naming one region
    // again and again, or hundreds of thousands of keys): refused, each with its reason. What
    // validating them costs is measured in benches/descriptor.rs.
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let prefill = side(&shape, 8, Some(12), quick_config());
    let addr = prefill.engine.handshake_address().to_string();
    for (what, d) in fuzz::hostile_descriptors() {
        let hello = frame::encode(&Message::Hello {
            descriptor: Box::new(d),
            session: None,
        })
        .unwrap();
        assert!(hello.len() < 4 << 20, "{what}: {} bytes", hello.len());
        let m = control_exchange(&addr, &hello);
        assert!(m.contains("invalid peer descriptor"), "{what}: {m}");
    }
    assert_eq!(prefill.engine.stats().handshakes_refused, 2);
    let decode = side(&shape, 8, None, quick_config());
    prefill.engine.hold_blocks("after", &[6]).unwrap();
    decode
        .engine
        .read_blocks(&addr, "after", &[1], &[6])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
}
