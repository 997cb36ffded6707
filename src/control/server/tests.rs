//! How the server waits for a reader's next frame, with the thread that runs the wait blocked as a
//! stopped process would be: frames that arrived during the server's own stall are read, and a
//! reader that sent nothing is silent once its window passed.

use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::task::Poll;
use std::time::Instant;

use super::*;

const IDLE: Duration = Duration::from_millis(100);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The engine's kind of runtime: its workers keep turning the driver while the test thread
/// blocks, so the deadline fires during the stall, before the read is polled again.
fn multi_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A connected pair: the server's end on `rt` (its read half, and its write half to keep it
/// open), the reader's end a plain socket.
fn pair(rt: &tokio::runtime::Runtime) -> (OwnedReadHalf, OwnedWriteHalf, std::net::TcpStream) {
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let reader = std::net::TcpStream::connect(addr).expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let (rd, wr) = server.into_split();
        (rd, wr, reader)
    })
}

/// Polls `fut` once, so that its deadline and its interest in the socket are registered.
async fn poll_once<F: Future>(mut fut: Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
}

#[test]
fn a_server_stalled_past_the_window_reads_the_frames_that_arrived_meanwhile() {
    stalled_past_the_window(&runtime());
    stalled_past_the_window(&multi_thread_runtime());
}

fn stalled_past_the_window(rt: &tokio::runtime::Runtime) {
    let (server, _wr, mut reader) = pair(rt);
    let mut server = Some(tokio::io::BufReader::new(server));
    for stall in 1..=3 {
        let (rd, read) = rt.block_on(async {
            let next = next_frame(server.take().expect("the read half"), IDLE);
            tokio::pin!(next);
            assert!(
                poll_once(next.as_mut()).await.is_pending(),
                "nothing sent yet"
            );
            // The runtime stops past the window while the reader's ping arrives: the deadline
            // is overdue when it resumes, with the ping waiting in the socket.
            let ping = frame::encode(&Message::Ping { nonce: stall }).expect("encode");
            reader.write_all(&ping).expect("write");
            std::thread::sleep(IDLE * 3);
            next.await
        });
        server = Some(rd);
        let (version, body) = read
            .unwrap_or_else(|_| panic!("stall {stall}: the reader counted silent"))
            .expect("a frame")
            .expect("not closed");
        let msg: Message = frame::decode(version, &body).expect("a message");
        assert!(
            matches!(msg, Message::Ping { nonce } if nonce == stall),
            "{msg:?}"
        );
    }
}

#[test]
fn a_reader_that_sends_nothing_is_silent_after_its_window() {
    let rt = runtime();
    let (server, _wr, _reader) = pair(&rt);
    let start = Instant::now();
    let (_, read) = rt.block_on(next_frame(tokio::io::BufReader::new(server), IDLE));
    assert!(read.is_err(), "silent reader not found: {read:?}");
    let took = start.elapsed();
    assert!(took >= IDLE, "{took:?}");
    // The window, and a little more on a loaded machine.
    assert!(took < IDLE * 5, "{took:?}");
}

#[test]
fn a_reader_that_closed_is_told_apart_from_a_silent_one() {
    let rt = runtime();
    let (server, _wr, reader) = pair(&rt);
    drop(reader);
    let (_, read) = rt.block_on(next_frame(tokio::io::BufReader::new(server), IDLE));
    assert!(matches!(read, Ok(Ok(None))), "{read:?}");
}
