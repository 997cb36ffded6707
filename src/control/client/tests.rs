//! The control client's keep-alive against a peer on a plain thread: a client whose own process
//! stalls past the silence window keeps its connection, and a peer that never answers is found
//! dead within a few intervals.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use super::*;

const KEEPALIVE: Duration = Duration::from_millis(100);

/// A peer on its own thread that answers each `Ping` with a `Pong` (`answer`), or reads and
/// never answers, until the client closes.
fn peer(answer: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        loop {
            let mut head = [0u8; 4];
            if s.read_exact(&mut head).is_err() {
                return;
            }
            let mut rest = vec![0u8; u32::from_be_bytes(head) as usize];
            if s.read_exact(&mut rest).is_err() {
                return;
            }
            let version = u16::from_be_bytes([rest[0], rest[1]]);
            let msg: Message = frame::decode(version, &rest[2..]).expect("a frame");
            if let (Message::Ping { nonce }, true) = (msg, answer) {
                let pong = frame::encode(&Message::Pong { nonce }).expect("encode");
                if s.write_all(&pong).is_err() {
                    return;
                }
            }
        }
    });
    addr
}

/// A client of `addr` on a runtime of one thread, so that blocking it stalls every task of the
/// client as a stopped process would.
fn client(rt: &tokio::runtime::Runtime, addr: SocketAddr) -> ControlClient {
    rt.block_on(async {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let timeouts = ControlTimeouts {
            connect: Duration::from_secs(1),
            handshake: Duration::from_secs(1),
            keepalive: KEEPALIVE,
        };
        Handshake {
            stream,
            peer: addr,
            timeouts,
        }
        .start(Arc::default())
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn a_client_stalled_past_the_silence_window_keeps_its_connection() {
    let rt = runtime();
    let c = client(&rt, peer(true));
    rt.block_on(async { tokio::time::sleep(KEEPALIVE * 3).await });
    assert!(!c.is_closed(), "pings answered");
    // The whole runtime stops for longer than three intervals, as a process under SIGSTOP: its
    // silence timer is overdue when it resumes, though it sent no ping meanwhile. Three times:
    // a pong of the last ping before a stall, read first, would hide the mistake.
    for stall in 1..=3 {
        std::thread::sleep(KEEPALIVE * 5);
        rt.block_on(async { tokio::time::sleep(KEEPALIVE * 4).await });
        assert!(
            !c.is_closed(),
            "stall {stall}: its own stall is not the peer's silence"
        );
    }
}

#[test]
fn a_peer_that_never_answers_is_found_dead_within_a_few_intervals() {
    let rt = runtime();
    let c = client(&rt, peer(false));
    let start = Instant::now();
    rt.block_on(async {
        while !c.is_closed() && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(KEEPALIVE / 4).await;
        }
    });
    assert!(c.is_closed(), "never found dead");
    // Three silent intervals, by which time at least two pings went unanswered; a little more
    // on a loaded machine.
    assert!(start.elapsed() < KEEPALIVE * 10, "{:?}", start.elapsed());
}

#[test]
fn a_silent_peer_with_a_stalled_client_is_still_found_dead() {
    let rt = runtime();
    let c = client(&rt, peer(false));
    std::thread::sleep(KEEPALIVE * 5);
    let resumed = Instant::now();
    rt.block_on(async {
        while !c.is_closed() && resumed.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(KEEPALIVE / 4).await;
        }
    });
    assert!(c.is_closed(), "never found dead");
    assert!(
        resumed.elapsed() < KEEPALIVE * 10,
        "{:?}",
        resumed.elapsed()
    );
}

/// Each `Confirm` answers the oldest `Done` of its id: a notice whose answer nobody waits for
/// (its receiver dropped) keeps its place, so its answer never reaches a later read of the id.
#[test]
fn confirms_answer_the_dones_of_their_id_in_order() {
    let waiters = Waiters::default();
    let confirms = waiters.confirms.clone();
    let id = RequestId::from("r");
    let (first, dropped) = oneshot::channel();
    let (second, mut waiting) = oneshot::channel();
    drop(dropped);
    confirms
        .lock()
        .entry(id.clone())
        .or_default()
        .extend([first, second]);
    let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let confirm = |refused: Option<&str>| {
        Ok(Message::Confirm {
            request_id: id.clone(),
            refused: refused.map(str::to_string),
            held_us: 5,
        })
    };
    assert!(on_frame(peer, confirm(None), &waiters));
    assert!(
        waiting.try_recv().is_err(),
        "the first answer is the first notice's"
    );
    assert!(on_frame(peer, confirm(Some("held again")), &waiters));
    let got = waiting.try_recv().expect("the second answer");
    assert!(got.is_err_and(|r| r.reason().contains("held again")));
    assert!(confirms.lock().is_empty(), "nothing left behind");
}

/// Parts go to the follow of their request, in order, until the sealed one or its end; parts
/// of a request nobody follows (any more) are dropped, and the session goes on.
#[test]
fn parts_reach_the_follow_of_their_request_until_the_last() {
    let waiters = Waiters::default();
    let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let (tx, mut rx) = mpsc::channel(4);
    waiters.follows.lock().insert("r".into(), tx);
    let part = |id: &str, sealed: bool| {
        Ok(Message::Part {
            request_id: id.into(),
            token: 3,
            first: vec![0],
            blocks: vec![vec![1]],
            tensors: None,
            sealed,
        })
    };
    assert!(on_frame(peer, part("other", false), &waiters));
    assert!(on_frame(peer, part("r", false), &waiters));
    assert!(matches!(
        rx.try_recv(),
        Ok(Announcement::Part { sealed: false, .. })
    ));
    assert!(on_frame(peer, part("r", true), &waiters));
    assert!(matches!(
        rx.try_recv(),
        Ok(Announcement::Part { sealed: true, .. })
    ));
    assert!(
        waiters.follows.lock().is_empty(),
        "the last part ends the follow"
    );
    assert!(rx.try_recv().is_err());
    let (tx, mut rx) = mpsc::channel(4);
    waiters.follows.lock().insert("r".into(), tx);
    let ended = Message::Ended {
        request_id: "r".into(),
        reason: "released".into(),
    };
    assert!(on_frame(peer, Ok(ended), &waiters));
    assert!(matches!(rx.try_recv(), Ok(Announcement::Ended { .. })));
    assert!(waiters.follows.lock().is_empty());
}
