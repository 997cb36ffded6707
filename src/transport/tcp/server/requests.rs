//! A data connection's requests, read through the stream's read-ahead buffer: a small request
//! (header, id, entries) costs one receive. Between requests the connection may poll its
//! socket for a bounded time ([`Requests::next`]): a reader that reads back to back sends its
//! next request within a round trip, and a connection that polls sees it without the wake-up
//! of the runtime's event thread, then of this task (on a halted vCPU, tens of microseconds).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::time::timeout;

use super::super::ahead::{Fill, ReadAhead};
use crate::error::{Error, Result};

/// Whether a connection of this process is polling: one at a time, so the CPU a poll takes is
/// at most one core for `spin` after a request, however many connections are open.
static POLLING: AtomicBool = AtomicBool::new(false);

/// A data connection's socket and what is read ahead of its requests.
pub(super) struct Requests<'a> {
    stream: &'a TcpStream,
    ahead: ReadAhead,
}

impl<'a> Requests<'a> {
    pub(super) fn new(stream: &'a TcpStream) -> Requests<'a> {
        Requests {
            stream,
            ahead: ReadAhead::new(),
        }
    }

    /// Waits for the next request's first bytes: polls the socket for up to `spin` first
    /// (when no other connection of the process polls), then sleeps until it is readable.
    /// `false`: the reader closed the stream, or sent nothing for `idle_timeout`.
    pub(super) async fn next(&mut self, spin: Duration, idle_timeout: Duration) -> Result<bool> {
        if !self.ahead.is_empty() {
            return Ok(true);
        }
        let polled = self.poll(spin);
        let found = match polled {
            Ok(Fill::Nothing) => {
                match timeout(idle_timeout, self.ahead.fill_from(self.stream)).await {
                    Err(_) => return Ok(false),
                    Ok(found) => found,
                }
            }
            found => found,
        };
        match found.map_err(|e| Error::io("reading a data request", &e))? {
            Fill::Closed => Ok(false),
            _ => Ok(true),
        }
    }

    /// Fills `out` from what is read ahead, then the socket, within `io_timeout` in all.
    pub(super) async fn read_exact(
        &mut self,
        out: &mut [u8],
        io_timeout: Duration,
        what: &str,
    ) -> Result<()> {
        let filled = async {
            let mut got = self.ahead.take_into(out);
            while got < out.len() {
                if let Fill::Closed = self.ahead.fill_from(self.stream).await? {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                got += self.ahead.take_into(&mut out[got..]);
            }
            Ok(())
        };
        timeout(io_timeout, filled)
            .await
            .map_err(|_| super::timed_out(what, io_timeout))?
            .map_err(|e| Error::io(what, &e))
    }

    /// Asks the kernel for the next request from this thread for up to `spin`, yielding the
    /// CPU between looks; `Nothing` when none came, or another connection is polling.
    fn poll(&mut self, spin: Duration) -> io::Result<Fill> {
        if spin.is_zero() {
            return Ok(Fill::Nothing);
        }
        let Some(_turn) = Turn::take() else {
            return Ok(Fill::Nothing);
        };
        let until = Instant::now() + spin;
        loop {
            match self.ahead.try_fill(self.stream, false)? {
                Fill::Nothing if Instant::now() < until => std::thread::yield_now(),
                found => return Ok(found),
            }
        }
    }
}

/// This process's one polling connection, for as long as it lives.
struct Turn;

impl Turn {
    fn take() -> Option<Turn> {
        POLLING
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Turn)
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        POLLING.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::{Duration, Instant};

    use super::*;

    /// A connected pair: the server's end in the runtime, the reader's a plain socket.
    async fn pair() -> (TcpStream, std::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let reader = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (server, reader)
    }

    /// Polls until a request is found; another connection of this test process may hold the
    /// turn for a moment. Gives up after 10 s.
    fn poll_until_found(requests: &mut Requests<'_>) -> Fill {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match requests.poll(Duration::from_secs(1)).unwrap() {
                Fill::Nothing if Instant::now() < until => {}
                found => return found,
            }
        }
    }

    #[test]
    fn a_polling_connection_receives_a_request_the_runtime_was_not_told_of() {
        // One thread: while the poll runs, the runtime's event loop does not, so whatever
        // it finds it asked the kernel for.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (server, mut reader) = pair().await;
            let mut requests = Requests::new(&server);
            let writer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                reader.write_all(b"request").unwrap();
                reader
            });
            assert!(matches!(poll_until_found(&mut requests), Fill::Bytes));
            assert_eq!(requests.ahead.buffered(), b"request");
            requests.ahead.consume(b"request".len());
            // The reader closes: the poll finds the end as it finds bytes.
            drop(writer.join().unwrap());
            assert!(matches!(poll_until_found(&mut requests), Fill::Closed));
        });
    }

    #[tokio::test]
    async fn one_connection_of_a_process_polls_at_a_time() {
        let (server, mut reader) = pair().await;
        let mut requests = Requests::new(&server);
        reader.write_all(b"x").unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let turn = loop {
            match Turn::take() {
                Some(turn) => break turn,
                None if Instant::now() < until => std::thread::yield_now(),
                None => panic!("the polling turn stayed taken for 10 s"),
            }
        };
        // The byte is there, but the turn is another connection's: this one does not poll.
        assert!(matches!(
            requests.poll(Duration::from_secs(1)),
            Ok(Fill::Nothing)
        ));
        drop(turn);
        assert!(matches!(poll_until_found(&mut requests), Fill::Bytes));
    }

    #[tokio::test]
    async fn a_request_is_read_whole_across_pieces_and_its_end_is_reported() {
        let (server, mut reader) = pair().await;
        let mut requests = Requests::new(&server);
        let writer = std::thread::spawn(move || {
            for piece in [&b"head"[..], b"er-", b"and-id"] {
                reader.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
            reader.write_all(b"part").unwrap();
        });
        let (idle, io) = (Duration::from_secs(10), Duration::from_secs(10));
        assert!(requests.next(Duration::ZERO, idle).await.unwrap());
        let mut out = [0u8; 13];
        requests
            .read_exact(&mut out, io, "a request")
            .await
            .unwrap();
        assert_eq!(&out, b"header-and-id");
        writer.join().unwrap();
        // Four bytes then the end: a request cut short is an error, then the stream is over.
        let mut out = [0u8; 8];
        let e = requests
            .read_exact(&mut out, io, "the rest")
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Io {
                    kind: io::ErrorKind::UnexpectedEof,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!requests
            .next(Duration::from_micros(50), idle)
            .await
            .unwrap());
    }

    #[tokio::test]
    async fn a_quiet_stream_ends_at_its_idle_timeout_and_a_stalled_request_at_io_timeout() {
        let (server, mut reader) = pair().await;
        let mut requests = Requests::new(&server);
        let short = Duration::from_millis(50);
        assert!(!requests
            .next(Duration::from_micros(50), short)
            .await
            .unwrap());
        reader.write_all(b"abc").unwrap();
        let mut out = [0u8; 8];
        let e = requests
            .read_exact(&mut out, short, "a request header")
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
    }
}
