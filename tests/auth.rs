//! Authentication from a deployment key, played from both sides: engines sharing the key
//! transfer as before; a peer without it, or with another, gets no descriptor and no data byte;
//! the data port serves only connections that prove an authenticated control session; without
//! a key an engine listens on loopback only unless told it may be insecure.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use kvlink::internal::frame;
use kvlink::internal::messages::Message;
use kvlink::internal::tcp_wire as wire;
use kvlink::{AuthKey, Engine, EngineConfig, FailureCause, ModelShape, RegionId};

fn keyed(key: &str) -> EngineConfig {
    quick_config().with(|c| {
        c.auth_key = Some(AuthKey::new(key.as_bytes().to_vec()).unwrap());
    })
}

const KEY: &str = "test-deployment-key-0123456789";

#[test]
fn engines_sharing_the_key_transfer_every_byte() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(21), keyed(KEY));
    let decode = side(&shape, 16, None, keyed(KEY));
    let peer = prefill.engine.handshake_address().to_string();
    prefill.engine.hold_blocks("auth-ok", &[15, 2, 8]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "auth-ok", &[0, 9, 4], &[15, 2, 8])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 21, &[0, 9, 4], &[15, 2, 8]);
    let s = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(s.sending.len(), 1, "{s:?}");
}

#[test]
fn a_peer_without_the_key_learns_nothing() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(22), keyed(KEY));
    let addr = prefill.engine.handshake_address().to_string();
    // A raw Hello (what an unauthenticated peer or an engine without a key sends) is answered
    // by one refusal that says nothing about the engine.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Message::Hello {
        descriptor: Box::new(prefill.engine.descriptor().unwrap()),
        session: None,
    };
    s.write_all(&frame::encode(&hello).unwrap()).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("requires authentication"), "{text}");
    let ours = prefill.engine.descriptor().unwrap();
    // Nothing of the engine: its id, dtype, tensors, blocks or regions.
    for secret in [
        ours.engine_id.as_str(),
        &ours.layout.dtype,
        "tensor",
        "block",
        "region",
    ] {
        assert!(!text.contains(secret), "{secret:?} leaked: {text}");
    }
    // An engine without the key fails its read with the reason.
    let decode = side(&shape, 16, None, quick_config());
    decode
        .engine
        .read_blocks(&addr, "no-key", &[0], &[0])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert!(
        f.failed[0].reason.contains("requires authentication"),
        "{f:?}"
    );
    assert_eq!(f.failed[0].cause, FailureCause::Connection);
    assert_eq!(prefill.engine.stats().handshakes_accepted, 0);
}

#[test]
fn a_different_key_fails_on_both_sides() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(23), keyed(KEY));
    let decode = side(&shape, 16, None, keyed("another-deployment-key-98765"));
    let addr = prefill.engine.handshake_address().to_string();
    decode
        .engine
        .read_blocks(&addr, "wrong-key", &[0], &[0])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.failed[0].cause, FailureCause::Connection, "{f:?}");
    assert!(
        f.failed[0]
            .reason
            .contains("failed to prove the deployment key"),
        "{f:?}"
    );
    assert_eq!(prefill.engine.stats().handshakes_accepted, 0);
}

#[test]
fn the_data_port_serves_nothing_without_a_session_proof() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(24), keyed(KEY));
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    let mut s = TcpStream::connect(data).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A well-formed read of region 1, sent without the session proof.
    let mut req = Vec::new();
    let entry = wire::Entry {
        region: RegionId(1),
        offset: 0,
        len: 4096,
    };
    wire::encode_request(
        1,
        "any",
        &wire::Extras::default(),
        [entry, entry, entry].into_iter(),
        &mut req,
    );
    s.write_all(&req).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    // Only the server's challenge comes back, then the connection closes.
    assert_eq!(
        answer.len(),
        wire::AUTH_NONCE,
        "{} bytes came back",
        answer.len()
    );
    let stats = prefill.engine.stats();
    assert_eq!((stats.data_requests_served, stats.bytes_served), (0, 0));
    assert!(stats.data_requests_refused >= 1);
}

#[test]
fn without_a_key_only_loopback_is_served_unless_insecure() {
    let wildcard = quick_config().with(|c| {
        c.listen = "0.0.0.0:0".into();
    });
    let e = Engine::start(wildcard.clone()).err().expect("refused");
    assert!(matches!(e, kvlink::Error::InvalidArgument(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("KVLINK_AUTH_KEY") && msg.contains("insecure"),
        "{msg}"
    );
    Engine::start(wildcard.clone().with(|c| {
        c.insecure = true;
    }))
    .unwrap();
    Engine::start(wildcard.with(|c| {
        c.auth_key = Some(AuthKey::new(KEY.as_bytes().to_vec()).unwrap());
    }))
    .unwrap();
}

#[test]
fn before_authentication_only_small_frames_are_read() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(25), keyed(KEY));
    let addr = prefill.engine.handshake_address().to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // Announces a 1 MiB frame (allowed after authentication, or without a key).
    s.write_all(&(1u32 << 20).to_be_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("exceeds the 4096-byte limit"), "{text}");
    assert!(text.contains("requires authentication"), "{text}");
    // After the challenge too: the frame that must carry the proof is capped as well.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Message::AuthHello {
        client_nonce: [7; 32],
    };
    s.write_all(&frame::encode(&hello).unwrap()).unwrap();
    let mut head = [0u8; 4];
    s.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(head) as usize];
    s.read_exact(&mut body).unwrap();
    let challenge = frame::decode::<Message>(u16::from_be_bytes([body[0], body[1]]), &body[2..]);
    assert!(
        matches!(challenge, Ok(Message::AuthChallenge { .. })),
        "{challenge:?}"
    );
    s.write_all(&(1u32 << 20).to_be_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("authentication failed"), "{text}");
    assert_eq!(prefill.engine.stats().handshakes_accepted, 0);
}

#[test]
fn messages_reach_an_engine_only_through_an_authenticated_session() {
    let shape = ModelShape::LLAMA3_8B;
    let server = side(&shape, 4, None, keyed(KEY));
    let addr = server.engine.handshake_address().to_string();
    // A message as the first frame, without authentication: refused, nothing queued.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let msg = Message::AppMessage {
        body: kvlink::internal::MessageBody(b"forged".to_vec()),
    };
    s.write_all(&frame::encode(&msg).unwrap()).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert!(
        String::from_utf8_lossy(&answer).contains("requires authentication"),
        "{answer:?}"
    );
    // Engines with another key, or none: their messages never arrive.
    let other = side(&shape, 4, None, keyed("another-deployment-key-98765"));
    let none = side(&shape, 4, None, quick_config());
    other.engine.send_message(&addr, b"x".to_vec()).unwrap();
    none.engine.send_message(&addr, b"y".to_vec()).unwrap();
    // The same key: delivered, with the sender's engine id.
    let friend = side(&shape, 4, None, keyed(KEY));
    friend.engine.send_message(&addr, b"ok".to_vec()).unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while (other.engine.stats().messages_unsent == 0
        || none.engine.stats().messages_unsent == 0
        || got.is_empty())
        && std::time::Instant::now() < end
    {
        got.extend(server.engine.take_messages());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    got.extend(server.engine.take_messages());
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].body, b"ok");
    assert_eq!(got[0].from, friend.engine.engine_id());
    assert_eq!(other.engine.stats().messages_unsent, 1);
    assert_eq!(none.engine.stats().messages_unsent, 1);
    assert_eq!(server.engine.stats().messages_received, 1);
}
