//! A stream's read-ahead buffer ([`ReadAhead`]), shared by both ends of a TCP stream: the
//! reader's responses and the server's requests are read through it, so that a small message
//! (a request's header, id and entries; a response's header, data and confirmation) costs one
//! receive. [`ReadAhead::try_fill`] reads without waiting, either through the runtime or by
//! asking the kernel from the caller's thread (what a bounded poll does).

use std::os::fd::AsRawFd;

use tokio::net::TcpStream;

use crate::memory;

/// The most a stream reads ahead; a response's data beyond half of it is read straight into
/// place.
pub(super) const AHEAD: usize = 16 << 10;

/// Bytes a stream read off its socket beyond what its messages consumed so far.
pub(super) struct ReadAhead {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl ReadAhead {
    pub(super) fn new() -> ReadAhead {
        ReadAhead {
            buf: vec![0u8; AHEAD].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// Whether nothing is buffered.
    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    pub(super) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    pub(super) fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// The whole buffer, for bytes to be thrown away (nothing may be buffered).
    pub(super) fn spare(&mut self) -> &mut [u8] {
        debug_assert!(self.is_empty());
        &mut self.buf
    }

    /// Moves what is buffered, up to `out.len()` bytes, into `out`; returns how much.
    pub(super) fn take_into(&mut self, out: &mut [u8]) -> usize {
        let n = self.buffered().len().min(out.len());
        out[..n].copy_from_slice(&self.buffered()[..n]);
        self.consume(n);
        n
    }

    /// Reads what the socket has now into the (empty) buffer, without waiting. Through the
    /// runtime (`from_runtime`: a socket it was not told is readable is not read, and one found
    /// empty is waited on again), or by asking the kernel from this thread, which sees the
    /// bytes before the runtime's event thread does (a bounded poll).
    pub(super) fn try_fill(
        &mut self,
        stream: &TcpStream,
        from_runtime: bool,
    ) -> std::io::Result<Fill> {
        debug_assert!(self.is_empty());
        let got = match from_runtime {
            true => stream.try_read(&mut self.buf),
            false => memory::recv_now(stream.as_raw_fd(), &mut self.buf),
        };
        match got {
            Ok(0) => Ok(Fill::Closed),
            Ok(n) => {
                self.start = 0;
                self.end = n;
                Ok(Fill::Bytes)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(Fill::Nothing),
            Err(e) => Err(e),
        }
    }

    /// Reads what the socket has, at least one byte or its end, into the (empty) buffer,
    /// sleeping until the runtime finds it readable. Unbounded: the caller sets the deadline.
    pub(super) async fn fill_from(&mut self, stream: &TcpStream) -> std::io::Result<Fill> {
        loop {
            stream.readable().await?;
            match self.try_fill(stream, true)? {
                Fill::Nothing => {}
                found => return Ok(found),
            }
        }
    }
}

/// What [`ReadAhead::try_fill`] found on the socket.
pub(super) enum Fill {
    Bytes,
    Nothing,
    /// The end of the stream.
    Closed,
}
