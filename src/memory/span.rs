//! Region spans: bounds-checked byte ranges of registered regions, and the raw vectored I/O
//! (`readv`/`writev`) over them.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::Region;
use crate::error::{Error, Result};
use crate::ids::RegionId;

/// A bounds-checked byte range of a registered region, holding the region alive.
#[derive(Clone, Debug)]
pub(crate) struct RegionSpan {
    region: Arc<Region>,
    offset: u64,
    len: u64,
}

impl RegionSpan {
    /// Makes a span after checking it lies inside the region.
    pub(crate) fn new(region: Arc<Region>, offset: u64, len: u64) -> Result<Self> {
        region.check_range(offset, len)?;
        Ok(RegionSpan {
            region,
            offset,
            len,
        })
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Whether the span is GPU memory (moved by staging copies, never by `readv`/`writev`).
    pub(crate) fn is_device(&self) -> bool {
        self.region.is_device()
    }

    /// The span's region.
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// The span's start offset in its region.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// `[skip, skip + len)` of this span, as a span of its own.
    pub(crate) fn sub(&self, skip: u64, len: u64) -> Result<RegionSpan> {
        match skip.checked_add(len) {
            Some(end) if end <= self.len => {
                RegionSpan::new(self.region.clone(), self.offset + skip, len)
            }
            _ => Err(Error::invalid(format!(
                "sub-span [{skip}, +{len}) of a {}-byte span",
                self.len
            ))),
        }
    }

    /// The span's region and start offset.
    pub(crate) fn position(&self) -> (RegionId, u64) {
        (self.region.id(), self.offset)
    }
}

/// Most I/O vectors handed to one `readv`/`writev` (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

/// Raw I/O vectors over `head` then `spans`, skipping the first `skip` bytes of their
/// concatenation. Only raw pointers are formed: no Rust reference to region bytes exists, since
/// those bytes may be written or read concurrently by the KV cache's owner, by the kernel or by
/// a NIC.
fn iovecs(head: &[u8], spans: &[RegionSpan], mut skip: u64) -> Vec<libc::iovec> {
    let mut v = Vec::with_capacity(IOV_MAX.min(spans.len() + 1));
    if skip < head.len() as u64 {
        v.push(libc::iovec {
            iov_base: head.as_ptr().wrapping_add(skip as usize) as *mut libc::c_void,
            iov_len: head.len() - skip as usize,
        });
        skip = 0;
    } else {
        skip -= head.len() as u64;
    }
    for span in spans {
        if v.len() == IOV_MAX {
            break;
        }
        // Device memory is never handed to the kernel: callers stage it (see readv/writev).
        assert!(!span.is_device(), "device span given to vectored I/O");
        if skip >= span.len {
            skip -= span.len;
            continue;
        }
        let start = span.offset + skip;
        v.push(libc::iovec {
            iov_base: span.region.ptr.as_ptr().wrapping_add(start as usize) as *mut libc::c_void,
            iov_len: (span.len - skip) as usize,
        });
        skip = 0;
    }
    v
}

/// One send of `head` then the spans' bytes on the socket `fd`, after the first `skip` bytes
/// (`sendmsg(2)`). With `more`, the kernel holds a partial segment back for what the caller
/// sends next (`MSG_MORE`), so a response and the few bytes that follow it leave in one
/// segment. Returns the bytes written (0 when nothing is left).
pub(crate) fn writev(
    fd: RawFd,
    head: &[u8],
    spans: &[RegionSpan],
    skip: u64,
    more: bool,
) -> io::Result<usize> {
    let mut iov = iovecs(head, spans, skip);
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: an all-zero msghdr is a valid empty message; the fields set below are the only
    // ones sendmsg reads here.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let flags = libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
    // SAFETY: every iovec addresses readable bytes: `head` is borrowed for the call, and each
    // span lies inside its region (checked when the span was made) whose Arc `spans` holds for
    // the call. sendmsg only reads them; iov.len() <= IOV_MAX; `msg` points at `iov`, which
    // outlives the call.
    let n = unsafe { libc::sendmsg(fd, &msg, flags) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One `readv(2)` from `fd` into the spans, after the first `skip` bytes of their
/// concatenation. Returns the bytes read (0 at end of stream).
///
/// Callers uphold the transfer contract: while a request reads into its local spans, nothing
/// else kvlink does writes those bytes (the planner refuses duplicate destination blocks within
/// a request; the scheduler owns a request's blocks until the request ends; cancellation waits
/// out a read in progress, see `RequestCtl`).
pub(crate) fn readv(fd: RawFd, spans: &[RegionSpan], skip: u64) -> io::Result<usize> {
    let iov = iovecs(&[], spans, skip);
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: every iovec addresses writable bytes inside a registered region (bounds-checked
    // span, region kept alive by the Arc in `spans` for the call); no Rust reference to them
    // exists, so the kernel writing them is not an aliasing violation. iov.len() <= IOV_MAX.
    let n = unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One `recv(2)` from `fd` into `buf` that never waits (`MSG_DONTWAIT`), whatever the
/// runtime believes of the socket's readiness: a thread polling a socket it does not wait on
/// sees bytes as soon as the kernel has them. Returns the bytes read (0 at end of stream), or
/// `WouldBlock`.
pub(crate) fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, exclusively borrowed slice of `buf.len()` writable bytes for the
    // whole call; recv writes at most that many.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// How many bytes the socket `fd` holds unread (`FIONREAD`).
pub(crate) fn bytes_waiting(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which addresses `n`, live and
    // exclusively borrowed for the call.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(usize::try_from(n).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readv_and_writev_move_span_bytes_through_a_socket() {
        use std::os::fd::AsRawFd;
        let src = Arc::new(Region::allocate(RegionId(3), 64, false).unwrap());
        let dst = Arc::new(Region::allocate(RegionId(4), 64, false).unwrap());
        src.write_at(0, &(0u8..64).collect::<Vec<_>>()).unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let out = vec![
            RegionSpan::new(src.clone(), 8, 8).unwrap(),
            RegionSpan::new(src.clone(), 40, 8).unwrap(),
        ];
        // Skip the 2-byte head and 3 bytes of the first span.
        assert_eq!(writev(a.as_raw_fd(), b"hh", &out, 5, false).unwrap(), 13);
        let into = vec![
            RegionSpan::new(dst.clone(), 0, 5).unwrap(),
            RegionSpan::new(dst.clone(), 32, 8).unwrap(),
        ];
        assert_eq!(readv(b.as_raw_fd(), &into, 0).unwrap(), 13);
        let mut got = [0u8; 5];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, [11, 12, 13, 14, 15]);
        let mut got = [0u8; 8];
        dst.read_at(32, &mut got).unwrap();
        assert_eq!(got, [40, 41, 42, 43, 44, 45, 46, 47]);
        assert_eq!(writev(a.as_raw_fd(), b"", &out, 16, true).unwrap(), 0);
        assert!(RegionSpan::new(src, 60, 8).is_err());
    }
}
