//! The reader's side of a TCP stream against a hand-driven server: responses that arrive
//! together, split, late, or unasked for.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;
use crate::ids::RegionId;
use crate::memory::{Region, RegionSpan};
use crate::transport::ConfirmAsk;

/// Reads one request off `s`: its tag and the bytes it asks for.
async fn request(s: &mut TcpStream) -> (u64, u64) {
    let mut h = [0u8; wire::REQUEST_HEADER];
    s.read_exact(&mut h).await.unwrap();
    let head = wire::decode_request_header(&h).unwrap();
    let entries = head.count as usize * wire::ENTRY;
    let mut rest = vec![0u8; head.id_len + Extras::len_of(head.flags) + entries];
    s.read_exact(&mut rest).await.unwrap();
    let asked = wire::decode_entries(&rest[rest.len() - entries..]).map(|e| e.len);
    (head.tag, asked.sum())
}

/// A data response of `data`, with a confirmation (held 7 us) after it when `confirm`.
fn response(tag: u64, data: &[u8], confirm: bool) -> Vec<u8> {
    let mut v = wire::encode_response_header(tag, wire::STATUS_OK, data.len() as u64).to_vec();
    v.extend_from_slice(data);
    if confirm {
        v.extend_from_slice(&wire::encode_response_header(
            tag,
            wire::STATUS_CONFIRMED,
            8,
        ));
        v.extend_from_slice(&7u64.to_le_bytes());
    }
    v
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A transport of one stream to a server on `listener`, and the server's end of it.
async fn pair(listener: &TcpListener, io: Duration) -> (TcpTransport, TcpStream) {
    let addr = listener.local_addr().unwrap();
    let waits = Waits {
        connect: Duration::from_secs(5),
        io,
    };
    let staging = StagingPool::new(1 << 16, 2);
    let connect = TcpTransport::connect(addr, 1, waits, 1 << 20, staging, None);
    let (t, accepted) = tokio::join!(connect, listener.accept());
    (t.unwrap(), accepted.unwrap().0)
}

/// One read of all of `region` (remote offsets are the server's business here).
fn read<'a>(
    t: &'a TcpTransport,
    id: &'a RequestId,
    region: &Arc<Region>,
    confirm: bool,
) -> ReadFuture<'a> {
    let len = region.len();
    let ops = vec![ReadOp {
        local: RegionSpan::new(region.clone(), 0, len).unwrap(),
        remote_region: RegionId(9),
        remote_offset: 0,
    }];
    let ask = confirm.then_some(ConfirmAsk {
        hold: Some(5),
        blocks: 0,
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    t.read(id, ops, Arc::new(RequestCtl::default()), deadline, ask)
}

fn contents(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len() as usize];
    region.read_at(0, &mut out).unwrap();
    out
}

async fn listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

/// Two responses (one confirmed) in one segment land in their own requests' memory: what the
/// stream read ahead for the second is not lost or given to the first.
#[tokio::test]
async fn responses_that_arrive_together_each_land_in_their_own_memory() {
    let l = listener().await;
    let (t, mut server) = pair(&l, Duration::from_secs(10)).await;
    let (a, b) = (
        Arc::new(Region::allocate(RegionId(1), 4096, false).unwrap()),
        Arc::new(Region::allocate(RegionId(2), 1000, false).unwrap()),
    );
    let (ia, ib) = (RequestId::new("a"), RequestId::new("b"));
    let serve = async {
        let (ta, na) = request(&mut server).await;
        let (tb, nb) = request(&mut server).await;
        let mut both = response(ta, &pattern(na as usize, 1), true);
        both.extend(response(tb, &pattern(nb as usize, 2), false));
        server.write_all(&both).await.unwrap();
    };
    let (ra, rb, ()) = tokio::join!(read(&t, &ia, &a, true), read(&t, &ib, &b, false), serve);
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.confirmed, Some(Ok(Duration::from_micros(7))));
    assert_eq!(rb.confirmed, None);
    assert_eq!(contents(&a), pattern(4096, 1));
    assert_eq!(contents(&b), pattern(1000, 2));
    assert!(!t.is_broken());
}

/// A response larger than the read-ahead, sent in pieces with pauses between them: its start
/// comes through the buffer, the rest straight into place, the confirmation after it.
#[tokio::test]
async fn a_large_response_in_pieces_lands_whole() {
    let l = listener().await;
    let (t, mut server) = pair(&l, Duration::from_secs(10)).await;
    let region = Arc::new(Region::allocate(RegionId(1), 100_000, false).unwrap());
    let id = RequestId::new("large");
    let serve = async {
        let (tag, n) = request(&mut server).await;
        let all = response(tag, &pattern(n as usize, 3), true);
        for piece in [
            &all[..30],
            &all[30..1000],
            &all[1000..60_000],
            &all[60_000..],
        ] {
            server.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (r, ()) = tokio::join!(read(&t, &id, &region, true), serve);
    assert_eq!(r.unwrap().confirmed, Some(Ok(Duration::from_micros(7))));
    assert_eq!(contents(&region), pattern(100_000, 3));
}

/// A server that takes a request and never answers breaks the stream once the response is
/// io_timeout late, failing the read then rather than at its own deadline (20 s here).
#[tokio::test]
async fn a_response_io_timeout_late_breaks_the_stream() {
    let l = listener().await;
    let (t, mut server) = pair(&l, Duration::from_millis(300)).await;
    let region = Arc::new(Region::allocate(RegionId(1), 4096, false).unwrap());
    let id = RequestId::new("late");
    let started = std::time::Instant::now();
    let (r, _) = tokio::join!(read(&t, &id, &region, true), request(&mut server));
    let e = r.unwrap_err();
    assert!(e.to_string().contains("waiting for a data response"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(t.is_broken());
}

/// Bytes nobody asked for break the stream, and the next read says why.
#[tokio::test]
async fn bytes_with_no_request_break_the_stream() {
    let l = listener().await;
    let (t, mut server) = pair(&l, Duration::from_secs(10)).await;
    server.write_all(b"unasked").await.unwrap();
    broken(&t).await;
    let region = Arc::new(Region::allocate(RegionId(1), 64, false).unwrap());
    let e = read(&t, &RequestId::new("after"), &region, false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no request outstanding"), "{e}");
}

/// A server closing an idle stream marks the transport broken before anything is read.
#[tokio::test]
async fn an_idle_stream_the_server_closed_is_broken() {
    let l = listener().await;
    let (t, server) = pair(&l, Duration::from_secs(10)).await;
    drop(server);
    broken(&t).await;
    let region = Arc::new(Region::allocate(RegionId(1), 64, false).unwrap());
    let e = read(&t, &RequestId::new("after"), &region, false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("closed an idle data stream"), "{e}");
}

/// Waits (5 s at most) for the transport to count itself broken.
async fn broken(t: &TcpTransport) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !t.is_broken() {
        assert!(std::time::Instant::now() < deadline, "never broken");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Serves one request on a thread of its own (blocking): answers `answer(tag, bytes asked)`,
/// pausing 50 ms at each of `cuts` (offsets into the answer).
fn serve_on_a_thread(
    server: TcpStream,
    cuts: &'static [usize],
    answer: impl FnOnce(u64, usize) -> Vec<u8> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    use std::io::{Read, Write};
    let mut s = server.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    std::thread::spawn(move || {
        let mut h = [0u8; wire::REQUEST_HEADER];
        s.read_exact(&mut h).unwrap();
        let head = wire::decode_request_header(&h).unwrap();
        let entries = head.count as usize * wire::ENTRY;
        let mut rest = vec![0u8; head.id_len + Extras::len_of(head.flags) + entries];
        s.read_exact(&mut rest).unwrap();
        let asked: u64 = wire::decode_entries(&rest[rest.len() - entries..])
            .map(|e| e.len)
            .sum();
        let all = answer(head.tag, asked as usize);
        let mut from = 0;
        for &cut in cuts.iter().chain([all.len()].iter()) {
            s.write_all(&all[from..cut]).unwrap();
            from = cut;
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}

/// A transport of one stream whose reads wait for up to 5 s on their own threads; without
/// its reader task when `reader` is false (only a waiting read can receive then).
async fn waiting(l: &TcpListener, reader: bool) -> (TcpTransport, TcpStream) {
    let (t, server) = pair(l, Duration::from_secs(10)).await;
    if !reader {
        let task = &t.streams[0].tasks[1];
        task.abort();
        while !task.is_finished() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    (t.with_spin(Duration::from_secs(5)), server)
}

/// A data response of `n` bytes of `pattern(n, seed)` followed by a confirmation that the hold
/// had ended.
fn unconfirmed(tag: u64, n: usize, seed: u8) -> Vec<u8> {
    let why = b"hold 5 ended";
    let mut v = wire::encode_response_header(tag, wire::STATUS_OK, n as u64).to_vec();
    v.extend_from_slice(&pattern(n, seed));
    v.extend_from_slice(&wire::encode_response_header(
        tag,
        wire::STATUS_UNCONFIRMED,
        why.len() as u64,
    ));
    v.extend_from_slice(why);
    v
}

/// A read of one batch waiting on its own thread receives a response the socket holds
/// itself: with the stream's reader task gone, the read still ends, its bytes in place and
/// confirmed, whether the response fits the read-ahead (4 KiB) or its data is mostly left in
/// the socket and lands straight into place (60,000 bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_waiting_read_receives_a_response_the_socket_holds_itself() {
    for len in [4096, 60_000] {
        let l = listener().await;
        let (t, server) = waiting(&l, false).await;
        let region = Arc::new(Region::allocate(RegionId(1), len, false).unwrap());
        let server = serve_on_a_thread(server, &[], |tag, n| response(tag, &pattern(n, 4), true));
        let r = read(&t, &RequestId::new("here"), &region, true).await;
        assert_eq!(
            r.unwrap().confirmed,
            Some(Ok(Duration::from_micros(7))),
            "{len}"
        );
        assert_eq!(contents(&region), pattern(len as usize, 4));
        assert!(!t.is_broken());
        server.join().unwrap();
    }
}

/// A read that receives its response on its own thread reports what the server's
/// confirmation said: a hold that ended before the server's check is never reported
/// confirmed, though its bytes arrived; also when the confirmation came after a pause and the
/// reader task finished the response the waiting read began.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_waiting_read_reports_an_unconfirmed_response_unconfirmed() {
    const AFTER_THE_DATA: &[usize] = &[wire::RESPONSE_HEADER + 4096];
    for (reader, cuts) in [(false, &[][..]), (true, AFTER_THE_DATA)] {
        let l = listener().await;
        let (t, server) = waiting(&l, reader).await;
        let region = Arc::new(Region::allocate(RegionId(1), 4096, false).unwrap());
        let server = serve_on_a_thread(server, cuts, |tag, n| unconfirmed(tag, n, 5));
        let r = read(&t, &RequestId::new("stale"), &region, true).await;
        let refusal = r.unwrap().confirmed.expect("a confirmation").unwrap_err();
        assert!(refusal.to_string().contains("hold 5 ended"), "{refusal}");
        assert!(!t.is_broken());
        server.join().unwrap();
    }
}

/// Responses a waiting read cannot finish at once (one in pieces; one whose confirmation comes
/// after a pause; one larger than the read-ahead, confirmed or not) land whole, the reader
/// task finishing what the waiting read left.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn responses_a_waiting_read_cannot_finish_at_once_land_whole() {
    const PIECES: &[usize] = &[1400, 2800];
    const AFTER_THE_DATA: &[usize] = &[wire::RESPONSE_HEADER + 4096];
    const IN_THE_DATA: &[usize] = &[30_000];
    let cases = [
        (4096, PIECES, true),
        (4096, AFTER_THE_DATA, true),
        (100_000, IN_THE_DATA, false),
        (100_000, IN_THE_DATA, true),
    ];
    for (len, cuts, confirm) in cases {
        let l = listener().await;
        let (t, server) = waiting(&l, true).await;
        let region = Arc::new(Region::allocate(RegionId(1), len, false).unwrap());
        let server = serve_on_a_thread(server, cuts, move |tag, n| {
            response(tag, &pattern(n, 6), confirm)
        });
        let r = read(&t, &RequestId::new("left"), &region, confirm).await;
        let want = confirm.then_some(Ok(Duration::from_micros(7)));
        assert_eq!(r.unwrap().confirmed, want, "{len} bytes cut at {cuts:?}");
        assert_eq!(contents(&region), pattern(len as usize, 6));
        assert!(!t.is_broken());
        server.join().unwrap();
    }
}
