//! Publisher and subscriber halves of the transport comparison, one process each (see
//! tools/zmq-compare.sh): `[topic, seq, payload]` messages as kvlink's publisher sends them.
//!
//! ```text
//! zmq-compare pub zeromq|libzmq ENDPOINT COUNT SIZE
//! zmq-compare sub zeromq|libzmq ENDPOINT COUNT [DELAY_US]
//! ```
//! Each prints one JSON line: messages, seconds, CPU seconds of the whole process (user+sys),
//! peak RSS. The publisher reports once its socket has handed everything to the kernel (it
//! lingers up to 10 s), so CPU spent by background writer threads or tasks is counted. Each
//! message's payload is a fresh buffer (as a publisher's encoder makes one per batch), handed to
//! the socket without a further copy on either library.

use std::time::{Duration, Instant};

fn cpu_and_rss() -> (f64, i64) {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF and a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    (t(u.ru_utime) + t(u.ru_stime), u.ru_maxrss)
}

fn report(role: &str, lib: &str, n: u64, secs: f64) {
    let (cpu, rss) = cpu_and_rss();
    println!(
        "{{\"role\":\"{role}\",\"lib\":\"{lib}\",\"messages\":{n},\"secs\":{secs:.4},\"cpu_s\":{cpu:.4},\"max_rss_kb\":{rss}}}"
    );
}

fn payload(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 31 % 251) as u8).collect()
}

fn libzmq_pub(ep: &str, n: u64, size: usize) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::PUB).unwrap();
    s.set_sndhwm(100_000).unwrap();
    s.bind(ep).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let p = payload(size);
    let start = Instant::now();
    for seq in 0..n {
        s.send(&b""[..], zmq::SNDMORE).unwrap();
        s.send(&seq.to_be_bytes()[..], zmq::SNDMORE).unwrap();
        // Zero-copy: libzmq takes ownership of the buffer.
        s.send(zmq::Message::from(p.to_vec().into_boxed_slice()), 0)
            .unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    s.set_linger(10_000).unwrap();
    drop(s);
    drop(ctx); // waits until queued messages are sent (linger)
    report("pub", "libzmq", n, secs);
}

fn libzmq_sub(ep: &str, n: u64, delay_us: u64) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_rcvhwm(100_000).unwrap();
    s.set_subscribe(b"").unwrap();
    s.connect(ep).unwrap();
    s.set_rcvtimeo(3000).unwrap();
    let mut got = 0u64;
    let mut start = None;
    let mut frames = [
        zmq::Message::new(),
        zmq::Message::new(),
        zmq::Message::new(),
    ];
    'outer: while got < n {
        for (i, f) in frames.iter_mut().enumerate() {
            if s.recv(f, 0).is_err() {
                break 'outer;
            }
            assert_eq!(s.get_rcvmore().unwrap(), i < 2);
        }
        start.get_or_insert_with(Instant::now);
        got += 1;
        if delay_us > 0 {
            std::thread::sleep(Duration::from_micros(delay_us));
        }
    }
    let secs = start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    report("sub", "libzmq", got, secs);
}

fn zeromq_pub(ep: &str, n: u64, size: usize) {
    use zeromq::{Socket, SocketSend};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut s = zeromq::PubSocket::new();
        s.bind(ep).await.unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let p = payload(size);
        let start = Instant::now();
        for seq in 0..n {
            let m = zeromq::ZmqMessage::try_from(vec![
                bytes::Bytes::new(),
                bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                bytes::Bytes::from(p.to_vec()),
            ])
            .unwrap();
            s.send(m).await.unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        // The crate has no linger: give its writer tasks time to send what they queued.
        tokio::time::sleep(Duration::from_millis(3000)).await;
        report("pub", "zeromq", n, secs);
    });
}

fn zeromq_sub(ep: &str, n: u64, delay_us: u64) {
    use zeromq::{Socket, SocketRecv};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut s = zeromq::SubSocket::new();
        s.connect(ep).await.unwrap();
        s.subscribe("").await.unwrap();
        let mut got = 0u64;
        let mut start = None;
        while got < n {
            match tokio::time::timeout(Duration::from_secs(3), s.recv()).await {
                Ok(Ok(m)) => {
                    assert_eq!(m.len(), 3);
                    start.get_or_insert_with(Instant::now);
                    got += 1;
                    if delay_us > 0 {
                        std::thread::sleep(Duration::from_micros(delay_us));
                    }
                }
                _ => break,
            }
        }
        let secs = start.map_or(0.0, |t: Instant| t.elapsed().as_secs_f64());
        report("sub", "zeromq", got, secs);
    });
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| a.get(i).map_or(0, |v| v.parse::<u64>().expect("a number"));
    match (a[0].as_str(), a[1].as_str()) {
        ("pub", "libzmq") => libzmq_pub(&a[2], num(3), num(4) as usize),
        ("pub", "zeromq") => zeromq_pub(&a[2], num(3), num(4) as usize),
        ("sub", "libzmq") => libzmq_sub(&a[2], num(3), num(4)),
        ("sub", "zeromq") => zeromq_sub(&a[2], num(3), num(4)),
        _ => panic!("usage: zmq-compare pub|sub zeromq|libzmq ENDPOINT COUNT SIZE|DELAY_US"),
    }
}
