//! Memory shared between processes of one host, and handing its file descriptor over a Unix
//! socket.
//!
//! - [`SharedMap::create`]: a `memfd` mapping that another process can map too. Its size is
//!   sealed (`F_SEAL_SHRINK | F_SEAL_GROW`), so no holder of the descriptor can truncate the
//!   pages from under a process that mapped them.
//! - [`SharedMap::open_peer`]: maps a descriptor a peer handed over, after checking it is such a
//!   sealed memfd of at least the size the peer claimed: a truncated or unsealed file would turn
//!   a later access into `SIGBUS`, and a pipe or device file is no memory at all.
//! - [`send_with_fd`] / [`recv_with_fd`]: `sendmsg`/`recvmsg` with one descriptor as
//!   `SCM_RIGHTS` ancillary data, on non-blocking stream sockets.
//!
//! One of the few modules allowed `unsafe` (raw `mmap` and socket calls); each block says why it
//! holds.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

/// Why memory cannot be shared with, or mapped from, another process of this host: the text
/// says what is wrong, for the logs and for the reader that asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShareError(pub(crate) String);

impl std::fmt::Display for ShareError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for ShareError {
    fn from(why: String) -> Self {
        ShareError(why)
    }
}

impl From<&str> for ShareError {
    fn from(why: &str) -> Self {
        ShareError(why.to_string())
    }
}

/// Seals every shared mapping carries: its size is fixed.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// A shared (`MAP_SHARED`) read-write mapping of a memfd, unmapped on drop.
#[derive(Debug)]
pub(crate) struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
    /// The memfd, kept by the owner (to hand to peers); a peer's mapping closes it at once.
    fd: Option<OwnedFd>,
    huge: bool,
}

// SAFETY: a SharedMap is a mapping valid until drop plus a descriptor; it hands out only its
// address, and every access through that address is a raw copy (the memory module's rules).
unsafe impl Send for SharedMap {}
// SAFETY: as for Send; its own fields are immutable after construction.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// A new zeroed memfd of `len` bytes, sealed at that size and mapped. With `huge_pages`,
    /// asks for 2 MiB huge pages (`MFD_HUGETLB`, the size rounded up to a whole page) and falls
    /// back to regular pages when none are reserved; [`is_huge`](Self::is_huge) says which.
    pub(crate) fn create(name: &str, len: usize, huge_pages: bool) -> io::Result<SharedMap> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        if huge_pages {
            let huge_len = len.div_ceil(2 << 20) * (2 << 20);
            match Self::create_with(name, huge_len, libc::MFD_HUGETLB | libc::MFD_HUGE_2MB) {
                Ok(mut m) => {
                    m.huge = true;
                    return Ok(m);
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    "huge pages unavailable for shared memory (reserve some with \
                     /proc/sys/vm/nr_hugepages); falling back to regular pages"
                ),
            }
        }
        let m = Self::create_with(name, len, 0)?;
        if huge_pages {
            // SAFETY: the range is this live mapping; madvise changes no memory contents.
            let _ = unsafe { libc::madvise(m.ptr.as_ptr().cast(), m.len, libc::MADV_HUGEPAGE) };
        }
        Ok(m)
    }

    fn create_with(name: &str, len: usize, flags: libc::c_uint) -> io::Result<SharedMap> {
        let cname = std::ffi::CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name with a NUL"))?;
        // SAFETY: cname is a valid C string for the call.
        let raw = unsafe {
            libc::memfd_create(
                cname.as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | flags,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "mapping too large"))?;
        // SAFETY: plain syscalls on the descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let m = Self::map(fd, len)?;
        // Fault the pages in now rather than during the first transfer (best effort: older
        // kernels lack MADV_POPULATE_WRITE).
        // SAFETY: the range is this live mapping; madvise changes no memory contents.
        let _ = unsafe { libc::madvise(m.ptr.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
        Ok(m)
    }

    /// Maps `len` bytes of a descriptor a peer handed over, once it passed every check: a
    /// memfd (a regular file that takes seals) sealed against shrinking, at least `len` bytes
    /// long. The reason names what failed.
    pub(crate) fn open_peer(fd: OwnedFd, len: u64) -> Result<SharedMap, ShareError> {
        Self::open_peer_as(fd, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// [`open_peer`](Self::open_peer), mapped read-only: a same-host prefill's memory (and its
    /// hold table) as its reader copies from it. The peer hands over a read-only descriptor
    /// ([`readonly_fd`]), so nothing here could map it writable.
    pub(crate) fn open_peer_readonly(fd: OwnedFd, len: u64) -> Result<SharedMap, ShareError> {
        Self::open_peer_as(fd, len, libc::PROT_READ)
    }

    fn open_peer_as(fd: OwnedFd, len: u64, prot: libc::c_int) -> Result<SharedMap, ShareError> {
        let len = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit in memory"))?;
        if len == 0 {
            return Err("an empty mapping".into());
        }
        // SAFETY: fstat writes into the zeroed struct we pass; the descriptor is ours.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(format!("fstat: {}", io::Error::last_os_error()).into());
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err("the descriptor is not a memory file (memfd)".into());
        }
        // SAFETY: a plain fcntl on our descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("the memory file is not sealed against shrinking (F_SEAL_SHRINK)".into());
        }
        if (st.st_size as u64) < len as u64 {
            return Err(format!(
                "the memory file holds {} bytes, {len} were announced",
                st.st_size
            )
            .into());
        }
        // Huge-page files can lose pages to hole punching (a seal against shrinking does not
        // stop it), and their mappings need whole huge pages: not taken from peers.
        // SAFETY: fstatfs writes into the zeroed struct we pass; the descriptor is ours.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } != 0 {
            return Err(format!("fstatfs: {}", io::Error::last_os_error()).into());
        }
        // `f_type`'s integer type differs between targets.
        #[allow(clippy::unnecessary_cast)]
        let hugetlbfs = fs.f_type as i64 == libc::HUGETLBFS_MAGIC as i64;
        if hugetlbfs {
            return Err("huge-page memory files are not mapped from peers".into());
        }
        // A file whose every page exists (a registered cache, filled by its engine) is mapped
        // with its page table populated, so copies into it do not fault page by page (the
        // first reads of a session ran at 0.7x of their steady speed). Populating allocates
        // nothing then: the file is exactly the mapping, and its allocated blocks cover it. A
        // sparse or larger file is mapped lazily: a peer must not make this process allocate
        // memory it never writes.
        let resident = st.st_size as u64 == len as u64
            && (st.st_blocks as u64).saturating_mul(512) >= len as u64;
        let flags = if resident { libc::MAP_POPULATE } else { 0 };
        let mut m = Self::map_with(fd, len, flags, prot)
            .map_err(|e| format!("mmap of {len} bytes: {e}"))?;
        // The mapping holds the pages: the descriptor is not needed any more.
        m.fd = None;
        Ok(m)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<SharedMap> {
        Self::map_with(fd, len, 0, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// [`Self::map`] with extra `mmap` flags (`MAP_POPULATE`) and the protection asked for.
    fn map_with(
        fd: OwnedFd,
        len: usize,
        flags: libc::c_int,
        prot: libc::c_int,
    ) -> io::Result<SharedMap> {
        // SAFETY: a fresh shared mapping of `len` bytes of a file at least that long (sized by
        // us, or checked and sealed against shrinking); the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED | flags,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedMap {
            ptr: NonNull::new(p.cast()).expect("mmap never returns null on success"),
            len,
            fd: Some(fd),
            huge: false,
        })
    }

    /// The mapping's address.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether it is backed by explicit huge pages.
    pub(crate) fn is_huge(&self) -> bool {
        self.huge
    }

    /// The memfd, for handing to a peer (`None` for a peer's memory mapped here).
    pub(crate) fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and nothing uses it once its owner drops it (every user
        // holds the owner alive while copying).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A read-only descriptor of the same memory file as `fd` (opened anew through `/proc/self/fd`,
/// so its holder cannot map the file writable, whatever `fd` allows).
pub(crate) fn readonly_fd(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let f = std::fs::OpenOptions::new().read(true).open(path)?;
    Ok(OwnedFd::from(f))
}

/// This process's real user id.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Room for one descriptor's control message.
const CMSG_ROOM: usize = 64;

/// Sends `data` (some of it: returns how many bytes went) on a non-blocking stream socket, with
/// `fd` attached to its first byte when given. `WouldBlock` when the socket is full.
pub(crate) fn send_with_fd(
    sock: RawFd,
    data: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: msghdr is plain data; zeroed is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE is pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        debug_assert!(space <= CMSG_ROOM);
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` bytes of aligned room (a u64 array), so the
        // first header and its data lie inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
        }
    }
    // SAFETY: every pointer in msg points at live locals for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Receives into `buf` from a non-blocking stream socket, with the descriptors that came with
/// those bytes (close-on-exec; every one is owned, so none leaks). `Ok((0, _))` at end of
/// stream; `WouldBlock` when nothing is there.
pub(crate) fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: msghdr is plain data; zeroed is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM as _;
    // SAFETY: every pointer in msg points at live locals for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of well-formed headers;
    // CMSG_FIRSTHDR/NXTHDR stay inside them. Each SCM_RIGHTS payload is an array of new
    // descriptors this process now owns, so wrapping each in an OwnedFd is sound.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a peer sent more descriptors than one message carries",
        ));
    }
    Ok((n as usize, fds))
}

/// Shuts down the sending side of a socket: the peer reads end of stream once it has read what
/// was sent.
pub(crate) fn shutdown_write(sock: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a plain syscall on a live descriptor.
    if unsafe { libc::shutdown(sock.as_raw_fd(), libc::SHUT_WR) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// This host's identity for the same-host check: the kernel's boot id, which every process
/// under one running kernel shares (containers included) and no other host has.
pub(crate) fn host_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_maps_pass_between_sockets_and_refuse_bad_descriptors() {
        let a = SharedMap::create("kvlink-test", 10_000, false).unwrap();
        // SAFETY: inside the live mapping.
        unsafe { a.as_ptr().add(9_999).write(7) };
        let (s1, s2) = std::os::unix::net::UnixStream::pair().unwrap();
        s1.set_nonblocking(true).unwrap();
        s2.set_nonblocking(true).unwrap();
        assert_eq!(
            send_with_fd(s1.as_raw_fd(), b"map", Some(a.fd().unwrap())).unwrap(),
            3
        );
        let mut buf = [0u8; 8];
        let (n, mut fds) = recv_with_fd(s2.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (3, 1));
        let fd = fds.pop().unwrap();
        let dup = fd.try_clone().unwrap();
        let b = SharedMap::open_peer(fd, 10_000).unwrap();
        assert!(b.fd().is_none(), "a peer's mapping keeps no descriptor");
        // SAFETY: inside both live mappings of the same pages.
        unsafe {
            assert_eq!(b.as_ptr().add(9_999).read(), 7);
            b.as_ptr().write(9);
            assert_eq!(a.as_ptr().read(), 9);
        }
        assert!(SharedMap::open_peer(dup, 10_001)
            .unwrap_err()
            .0
            .contains("10001 were announced"));
        // A pipe is no memory; an unsealed file is refused.
        let (r, _w) = std::io::pipe().unwrap();
        assert!(SharedMap::open_peer(r.into(), 1)
            .unwrap_err()
            .0
            .contains("not a memory file"));
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(SharedMap::open_peer(f.into(), 1)
            .unwrap_err()
            .0
            .contains("sealed"));
        assert!(host_id().is_some());
    }

    /// Bytes of memory the file behind `fd` holds.
    fn allocated(fd: BorrowedFd<'_>) -> u64 {
        // SAFETY: fstat writes into the zeroed struct we pass.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the descriptor is open.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        st.st_blocks as u64 * 512
    }

    /// Bytes of the mapping at `at` that are in this process's page table (`/proc/self/smaps`).
    fn resident(at: *mut u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", at as usize);
        let vma = smaps.split_once(&start).expect("the mapping is listed").1;
        let rss = vma.split_once("\nRss:").unwrap().1.trim_start();
        let kb: u64 = rss.split_whitespace().next().unwrap().parse().unwrap();
        kb * 1024
    }

    #[test]
    fn a_peers_sparse_file_is_mapped_without_allocating_a_full_one_populated() {
        const LEN: usize = 64 << 20;
        // A sealed memfd whose pages were never touched (`create` would populate it).
        // SAFETY: a C string literal; the new descriptor is owned at once.
        let sparse = unsafe {
            OwnedFd::from_raw_fd(libc::memfd_create(
                c"kvlink-test-sparse".as_ptr(),
                libc::MFD_ALLOW_SEALING,
            ))
        };
        // SAFETY: plain syscalls on the descriptor we own.
        unsafe {
            assert_eq!(libc::ftruncate(sparse.as_raw_fd(), LEN as libc::off_t), 0);
            let shrink = libc::F_SEAL_SHRINK; // what open_peer asks for; it may still grow
            assert_eq!(
                libc::fcntl(sparse.as_raw_fd(), libc::F_ADD_SEALS, shrink),
                0
            );
        }
        let peer = SharedMap::open_peer(sparse.try_clone().unwrap(), LEN as u64).unwrap();
        assert_eq!(
            allocated(sparse.as_fd()),
            0,
            "mapping a peer's sparse file allocated its pages"
        );
        // SAFETY: inside the live mapping.
        unsafe { peer.as_ptr().add(LEN - 1).write(1) };
        assert_eq!(allocated(sparse.as_fd()), 4096, "one page written");
        drop(peer);

        // Pages allocated past the announced length do not make the announced part populated.
        // SAFETY: plain syscalls on the descriptor we own; its seal allows growing.
        unsafe {
            assert_eq!(
                libc::ftruncate(sparse.as_raw_fd(), 2 * LEN as libc::off_t),
                0
            );
            let (at, n) = (LEN as libc::off_t, LEN as libc::off_t);
            assert_eq!(libc::fallocate(sparse.as_raw_fd(), 0, at, n), 0);
        }
        let before = allocated(sparse.as_fd());
        let peer = SharedMap::open_peer(sparse.try_clone().unwrap(), LEN as u64).unwrap();
        assert_eq!(
            allocated(sparse.as_fd()),
            before,
            "a larger file was populated"
        );
        assert_eq!(resident(peer.as_ptr()), 0);

        let full = SharedMap::create("kvlink-test-full", LEN, false).unwrap();
        // SAFETY: the whole live mapping.
        unsafe { std::ptr::write_bytes(full.as_ptr(), 3, LEN) };
        let fd = full.fd().unwrap().try_clone_to_owned().unwrap();
        let peer = SharedMap::open_peer(fd, LEN as u64).unwrap();
        assert_eq!(resident(peer.as_ptr()), LEN as u64, "not populated");
        // SAFETY: inside the live mapping.
        assert_eq!(unsafe { peer.as_ptr().add(LEN / 2).read() }, 3);
    }
}
