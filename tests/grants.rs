//! Read grants and connection limits, played by an attacker who holds the deployment key or
//! shares the network: a reader reads only the blocks held for it, under its own request;
//! another engine can neither read them nor confirm or abort them; notices for requests never
//! held are refused and forgotten; held connections from one address do not lock out a reader
//! from another; idle data streams close early and readers carry on.

mod common;

use std::io::Read;
use std::net::{IpAddr, TcpStream};
use std::time::Duration;

use common::*;
use kvlink::{AuthKey, EngineConfig, FailureCause, ModelShape};

const KEY: &str = "grants-deployment-key-0123456789";

fn keyed() -> EngineConfig {
    quick_config().with(|c| {
        c.auth_key = Some(AuthKey::new(KEY.as_bytes().to_vec()).unwrap());
    })
}

#[test]
fn a_key_holder_reads_only_what_is_held_for_it() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(41), keyed());
    let a = side(&shape, 16, None, keyed());
    let b = side(&shape, 16, None, keyed());
    let peer = prefill.engine.handshake_address().to_string();
    let a_id = a.engine.descriptor().unwrap().engine_id;

    // Held for A: B, with the key, can neither read it nor abort it.
    prefill
        .engine
        .hold_blocks_for("for-a", &[2, 5], Some(&a_id), None)
        .unwrap();
    b.engine
        .read_blocks(&peer, "for-a", &[1, 6], &[2, 5])
        .unwrap();
    let f = collect(&b.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert!(
        f.failed[0].reason.contains("not held for this reader"),
        "{f:?}"
    );
    assert_eq!(f.failed[0].cause, FailureCause::Peer);
    // B's abort of A's request was refused, and the request is still held.
    eventually("B's abort refused", || {
        prefill.engine.stats().notices_refused >= 1
    });
    assert!(prefill.engine.get_finished().is_empty());
    assert_eq!(prefill.engine.in_flight().1, 1);

    // A reads what is held for it, every byte right.
    a.engine
        .read_blocks(&peer, "for-a", &[0, 9], &[2, 5])
        .unwrap();
    let f = collect(&a.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&a, &prefill.layout, 41, &[0, 9], &[2, 5]);
    let s = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(s.sending.len(), 1, "{s:?}");

    // A block outside the grant is refused, even to the right reader under the right id.
    prefill.engine.hold_blocks("narrow", &[3]).unwrap();
    a.engine
        .read_blocks(&peer, "narrow", &[1, 2], &[3, 4])
        .unwrap();
    let f = collect(&a.engine, Duration::from_secs(20), |f| !f.is_empty());
    let why = &f.failed[0].reason;
    assert_eq!(f.failed[0].cause, FailureCause::Peer, "{why}");
    assert!(why.contains("block 4") && why.contains("not held"), "{why}");
    // That reader's own abort does end the request.
    let s = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(s.failed[0].id.as_str(), "narrow", "{s:?}");

    // A request never held: the read is refused, its abort is refused and not stored, so a
    // later hold of the same id is not finished by it.
    let before = prefill.engine.stats().notices_refused;
    b.engine.read_blocks(&peer, "ghost", &[1], &[1]).unwrap();
    let f = collect(&b.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.failed[0].cause, FailureCause::Peer, "{f:?}");
    assert!(f.failed[0].reason.contains("not held"), "{f:?}");
    eventually("the ghost abort refused", || {
        prefill.engine.stats().notices_refused > before
    });
    // The refused abort was stored nowhere: nothing can finish this hold (checked at once;
    // the refusal above came first).
    prefill.engine.hold_blocks("ghost", &[1]).unwrap();
    assert!(prefill.engine.get_finished().is_empty());
    assert_eq!(prefill.engine.in_flight().1, 1);

    // The first engine to read a request held without a named reader becomes its reader.
    prefill.engine.hold_blocks("first", &[7]).unwrap();
    a.engine.read_blocks(&peer, "first", &[3], &[7]).unwrap();
    let f = collect(&a.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    let s = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(s.sending[0].as_str(), "first");
}

/// Whether the server closed `s` (EOF, or an error frame then EOF) within `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn held_connections_from_one_address_do_not_lock_out_another() {
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let config = keyed().with(|c| {
        c.max_connections_per_ip = 16;
        c.handshake_timeout = Duration::from_secs(3);
    });
    let prefill = side(&shape, 8, Some(43), config);
    let control = prefill.engine.handshake_address();
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    let attacker: IpAddr = "127.0.0.2".parse().unwrap();
    let dialer = Dialer::new();
    // The attacker fills its share of both ports with silent connections.
    let mut held: Vec<TcpStream> = (0..16)
        .flat_map(|_| {
            [
                dialer.connect(attacker, control),
                dialer.connect(attacker, data),
            ]
        })
        .collect();
    eventually(
        "the attacker's 16 control and 16 data connections admitted",
        || {
            let s = prefill.engine.stats();
            s.control_connections >= 16 && s.data_connections >= 16
        },
    );
    // One more from the same address is closed at once.
    let mut extra = dialer.connect(attacker, control);
    assert!(closed_within(&mut extra, Duration::from_secs(2)));
    let mut extra = dialer.connect(attacker, data);
    assert!(closed_within(&mut extra, Duration::from_secs(2)));
    // A reader from 127.0.0.1 is served meanwhile.
    let decode = side(&shape, 8, None, keyed());
    let peer = control.to_string();
    prefill.engine.hold_blocks("through", &[1, 4]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "through", &[0, 2], &[1, 4])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 43, &[0, 2], &[1, 4]);
    // Unauthenticated connections are closed within seconds (handshake and proof deadlines).
    for s in &mut held {
        assert!(closed_within(s, Duration::from_secs(8)), "still open");
    }
    // Then the address may connect again.
    let mut again = dialer.connect(attacker, control);
    assert!(!closed_within(&mut again, Duration::from_millis(300)));
}

#[test]
fn idle_data_streams_close_early_and_readers_carry_on() {
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let config = keyed().with(|c| {
        c.idle_timeout = Duration::from_secs(1);
    });
    let prefill = side(&shape, 8, Some(44), config);
    let decode = side(&shape, 8, None, keyed());
    let peer = prefill.engine.handshake_address().to_string();
    for (i, (l, r)) in [([0u32, 1], [5u32, 6]), ([2, 3], [7, 0])]
        .iter()
        .enumerate()
    {
        let id = format!("idle-{i}");
        prefill.engine.hold_blocks(id.as_str(), r).unwrap();
        decode.engine.read_blocks(&peer, id.as_str(), l, r).unwrap();
        let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
        assert_eq!(f.receiving.len(), 1, "{f:?}");
        verify(&decode, &prefill.layout, 44, l, r);
        // Past the server's idle timeout it closes the streams; the next read rebuilds the
        // session and succeeds.
        eventually("the idle data streams closed", || {
            prefill.engine.stats().data_connections == 0
        });
    }
    assert_eq!(prefill.engine.stats().handshakes_accepted, 2);
}

#[test]
fn a_response_stops_when_its_hold_ends() {
    use kvlink::internal::frame;
    use kvlink::internal::messages::Message;
    use kvlink::internal::tcp_wire as wire;
    use std::io::Write;
    // A reader that asks for the whole cache (32 MiB) and does not read the answer: the server
    // stalls on a full socket. When the hold ends (here the reader's own Done), the rest of the
    // response is not sent: the blocks may be reused from then on.
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(45), quick_config());
    let all: Vec<u32> = (0..16).collect();
    prefill.engine.hold_blocks("slow", &all).unwrap();
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    let mut d = TcpStream::connect(data).unwrap();
    let len = prefill.region.len();
    let mut req = Vec::new();
    let entry = wire::Entry {
        region: prefill.region.id(),
        offset: 0,
        len,
    };
    wire::encode_request(
        1,
        "slow",
        &wire::Extras::default(),
        std::iter::once(entry),
        &mut req,
    );
    d.write_all(&req).unwrap();
    // The response has started (and stalls on the full socket).
    d.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(d.peek(&mut [0u8; 1]).unwrap() > 0);
    // The reader's control session says it is done.
    let mut c = TcpStream::connect(prefill.engine.handshake_address()).unwrap();
    let hello = Message::Hello {
        descriptor: Box::new(prefill.engine.descriptor().unwrap()),
        session: None,
    };
    c.write_all(&frame::encode(&hello).unwrap()).unwrap();
    let mut head = [0u8; 4];
    c.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(head) as usize];
    c.read_exact(&mut body).unwrap();
    let done = Message::Done {
        request_id: "slow".into(),
        hold: None,
    };
    c.write_all(&frame::encode(&done).unwrap()).unwrap();
    let s = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(s.sending.len(), 1, "{s:?}");
    // Now drain: the connection closes before the whole response arrived.
    let got = drain(&mut d);
    let whole = wire::RESPONSE_HEADER as u64 + len;
    assert!(
        got < whole,
        "{got} of {whole} bytes arrived after the hold ended"
    );
}
