//! Memory of another process of this host: what the same-host transport shares.
//!
//! A reader exports its registered destination regions ([`Region::export_local`]): host memory
//! kvlink allocated is a sealed memfd, handed over as a descriptor; GPU memory is an IPC handle
//! of its runtime. The engine it reads from opens them ([`PeerMemory`]) and copies granted
//! bytes of its own regions straight into them ([`PeerMemory::write_from`]): one copy, by the
//! side that checks the grant.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::{Backing, Region, RegionSpan};
use crate::error::{Error, Result};
use crate::gpu::{CopyKind, DeviceRuntime, GpuApi};
use crate::shm::{ShareError, SharedMap};

/// What a peer needs to open a region for writing.
#[derive(Debug)]
pub(crate) struct LocalExport {
    /// `None` for host memory; the runtime for device memory.
    pub(crate) api: Option<GpuApi>,
    /// The runtime's IPC handle (empty for host memory).
    pub(crate) handle: Vec<u8>,
    /// The memfd (host memory, emulated device memory).
    pub(crate) fd: Option<OwnedFd>,
    /// Where the region starts in what the handle or descriptor opens.
    pub(crate) offset: u64,
    /// The region's length.
    pub(crate) len: u64,
}

impl Region {
    /// What a peer of this host needs to open this region for writing, or why it cannot be
    /// shared (host memory registered from a caller's pointer has no descriptor to hand over).
    pub(crate) fn export_local(&self) -> std::result::Result<LocalExport, ShareError> {
        match &self._backing {
            Backing::Shared(map) if map.is_huge() => Err(format!(
                "{} is huge-page host memory, which is not shared with another process",
                self.id
            )
            .into()),
            Backing::Shared(map) => Ok(LocalExport {
                api: None,
                handle: Vec::new(),
                fd: Some(
                    map.fd()
                        .ok_or("the region's memfd is closed")?
                        .try_clone_to_owned()
                        .map_err(|e| format!("duplicating the region's memfd: {e}"))?,
                ),
                offset: 0,
                len: self.len,
            }),
            Backing::External => Err(format!(
                "{} is host memory registered from a pointer, which cannot be shared with \
                 another process (allocate it with allocate_host, or register GPU memory)",
                self.id
            )
            .into()),
            Backing::Device { rt, ordinal, .. } => {
                let e = rt
                    .ipc_export(*ordinal, self.ptr.as_ptr() as u64, self.len)
                    .map_err(|e| format!("{}: {e}", self.id))?;
                Ok(LocalExport {
                    api: Some(rt.api()),
                    handle: e.handle,
                    fd: e.fd,
                    offset: e.offset,
                    len: self.len,
                })
            }
        }
    }
}

/// Where a peer's region was opened.
#[derive(Debug)]
enum Target {
    /// Kept mapped while open.
    Host(#[allow(dead_code)] SharedMap),
    Device {
        rt: Arc<dyn DeviceRuntime>,
        ordinal: i32,
        /// The opened allocation's address in this process.
        base: u64,
    },
}

/// A region of another process of this host, opened here for writing; closed on drop.
#[derive(Debug)]
pub(crate) struct PeerMemory {
    target: Target,
    /// The region's first byte, in this process.
    start: u64,
    len: u64,
}

impl PeerMemory {
    /// Opens a peer's host region from its memfd (checked: sealed, long enough).
    pub(crate) fn open_host(fd: OwnedFd, len: u64) -> std::result::Result<PeerMemory, ShareError> {
        let map = SharedMap::open_peer(fd, len)?;
        Ok(PeerMemory {
            start: map.as_ptr() as u64,
            target: Target::Host(map),
            len,
        })
    }

    /// Opens a same-host prefill's host region read-only from the read-only memfd it handed
    /// over (checked as [`open_host`](Self::open_host) checks), for its reader to copy from
    /// ([`read_into`](Self::read_into)).
    pub(crate) fn open_host_readonly(
        fd: OwnedFd,
        len: u64,
    ) -> std::result::Result<PeerMemory, ShareError> {
        let map = SharedMap::open_peer_readonly(fd, len)?;
        Ok(PeerMemory {
            start: map.as_ptr() as u64,
            target: Target::Host(map),
            len,
        })
    }

    /// Copies `[offset, offset + dst.len())` of the peer's host region into `dst` (this
    /// process's registered host memory). The peer may be writing those bytes meanwhile: the
    /// copy is of raw bytes, never read as anything else here, and its caller keeps it only
    /// when the peer's hold table says the hold was live throughout (`crate::holds`).
    pub(crate) fn read_into(&self, offset: u64, dst: &RegionSpan) -> Result<()> {
        let len = dst.len();
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} run past the peer's {}-byte region",
                self.len
            )));
        }
        if !matches!(self.target, Target::Host(_)) || dst.region().device_runtime().is_some() {
            return Err(Error::invalid(
                "a reader-side copy is between host memory only",
            ));
        }
        let n = usize::try_from(len).map_err(|_| Error::invalid("copy too large"))?;
        let from = self.start + offset;
        let to = dst.region().as_ptr() as u64 + dst.offset();
        // SAFETY: `[from, +n)` lies inside the peer's live mapping (checked above; it lives as
        // long as self), `[to, +n)` inside the live destination region (RegionSpan was
        // bounds-checked when made and holds its region alive). Both are plain host memory,
        // distinct mappings; the source may change under the copy, which only copies bytes.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy(from as *const u8, to as *mut u8, n)
        };
        Ok(())
    }

    /// Opens a peer's device region through `rt`'s IPC on GPU `ordinal`; the region is `len`
    /// bytes at `offset` of the opened allocation, which must hold them.
    pub(crate) fn open_device(
        rt: Arc<dyn DeviceRuntime>,
        ordinal: i32,
        handle: &[u8],
        fd: Option<OwnedFd>,
        offset: u64,
        len: u64,
    ) -> std::result::Result<PeerMemory, ShareError> {
        let (base, size) = rt
            .ipc_open(ordinal, handle, fd)
            .map_err(|e| e.to_string())?;
        let mem = PeerMemory {
            target: Target::Device { rt, ordinal, base },
            start: base.saturating_add(offset),
            len,
        };
        if offset.checked_add(len).is_none_or(|end| end > size) {
            // Dropping `mem` closes the allocation again.
            return Err(format!(
                "{len} bytes at offset {offset} do not fit the {size}-byte allocation the \
                 handle opens"
            )
            .into());
        }
        Ok(mem)
    }

    /// The region's length.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Copies `src` (this process's registered memory) to `[offset, offset + src.len())` of the
    /// peer's region, returning when the bytes are in place.
    pub(crate) fn write_from(&self, offset: u64, src: &RegionSpan) -> Result<()> {
        let len = src.len();
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} run past the reader's {}-byte region",
                self.len
            )));
        }
        let n = usize::try_from(len).map_err(|_| Error::invalid("copy too large"))?;
        let dst = self.start + offset;
        let from = src.region().as_ptr() as u64 + src.offset();
        let device_src = src.region().device_runtime();
        match (&self.target, device_src) {
            (Target::Host(_), None) => {
                // SAFETY: `[from, +n)` lies inside the live source region (RegionSpan was
                // bounds-checked when made, and holds its region alive); `[dst, +n)` lies
                // inside the peer's mapping (checked above), which lives as long as self.
                // Both are plain host memory; `copy` tolerates overlap.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy(from as *const u8, dst as *mut u8, n)
                };
                Ok(())
            }
            (Target::Host(_), Some((rt, ordinal))) => {
                // SAFETY: the destination is host memory valid for `n` bytes (checked above)
                // that nothing else in this process touches during the call; the source lies
                // inside the live device region.
                #[allow(unsafe_code)]
                unsafe { rt.copy_to_host(ordinal, dst as *mut u8, from, n) }.map_err(Error::Gpu)
            }
            (Target::Device { rt, ordinal, .. }, None) => {
                // SAFETY: the source is live host memory of `n` bytes; the destination lies
                // inside the opened allocation (checked above and at open).
                #[allow(unsafe_code)]
                unsafe { rt.copy_from_host(*ordinal, dst, from as *const u8, n) }
                    .map_err(Error::Gpu)
            }
            (Target::Device { rt, ordinal, .. }, Some((src_rt, _))) => {
                if src_rt.api() != rt.api() {
                    return Err(Error::invalid(format!(
                        "cannot copy {} memory into {} memory of a peer",
                        src_rt.api(),
                        rt.api()
                    )));
                }
                // SAFETY: both ranges lie inside live device allocations reachable from the
                // opening context (the source is this process's own, unified addressing).
                #[allow(unsafe_code)]
                unsafe { rt.copy_device(*ordinal, dst, from, n) }.map_err(Error::Gpu)
            }
        }
    }
}

impl PeerMemory {
    /// [`write_from`](Self::write_from) for several pieces, `(offset, source)`: pieces that
    /// a GPU runtime copies (device memory on either side) are queued together and waited for
    /// once.
    pub(crate) fn write_many(&self, pieces: &[(u64, RegionSpan)]) -> Result<()> {
        let device_dst = matches!(self.target, Target::Device { .. });
        let any_device_src = pieces.iter().any(|(_, s)| s.is_device());
        if !device_dst && !any_device_src {
            return pieces
                .iter()
                .try_for_each(|(at, src)| self.write_from(*at, src));
        }
        // The runtime doing the copies: the destination's, else the sources' (all of one
        // region's runtime here: a batch mixing runtimes goes piece by piece).
        let (rt, ordinal) = match &self.target {
            Target::Device { rt, ordinal, .. } => (rt.clone(), *ordinal),
            Target::Host(_) => match pieces[0].1.region().device_runtime() {
                Some((rt, o)) => (rt.clone(), o),
                None => {
                    return pieces
                        .iter()
                        .try_for_each(|(at, src)| self.write_from(*at, src))
                }
            },
        };
        let mut batch: Vec<(u64, u64, usize)> = Vec::with_capacity(pieces.len());
        let mut kind = None;
        for (at, src) in pieces {
            let len = src.len();
            if at.checked_add(len).is_none_or(|end| end > self.len) {
                return Err(Error::invalid(format!(
                    "{len} bytes at offset {at} run past the reader's {}-byte region",
                    self.len
                )));
            }
            let this = match (device_dst, src.region().device_runtime()) {
                (true, None) => CopyKind::FromHost,
                (true, Some((r, _))) if r.api() == rt.api() => CopyKind::Device,
                (false, Some((r, o))) if r.api() == rt.api() && o == ordinal => CopyKind::ToHost,
                _ => {
                    // Mixed runtimes or GPUs: one at a time, through write_from's checks.
                    self.write_from(*at, src)?;
                    continue;
                }
            };
            if kind.is_some_and(|k| k != this) {
                self.flush(&rt, ordinal, kind.take().expect("kind"), &mut batch)?;
            }
            kind = Some(this);
            let from = src.region().as_ptr() as u64 + src.offset();
            batch.push((self.start + at, from, len as usize));
        }
        if let Some(k) = kind {
            self.flush(&rt, ordinal, k, &mut batch)?;
        }
        Ok(())
    }

    fn flush(
        &self,
        rt: &Arc<dyn DeviceRuntime>,
        ordinal: i32,
        kind: CopyKind,
        batch: &mut Vec<(u64, u64, usize)>,
    ) -> Result<()> {
        // SAFETY: every piece's destination lies inside this peer region (checked in
        // write_many) and its source inside a live registered region of the matching kind
        // (RegionSpan bounds, kind matched against the copy's direction); host ends are mapped
        // for the call.
        #[allow(unsafe_code)]
        let r = unsafe { rt.copy_many(ordinal, kind, batch) };
        batch.clear();
        r.map_err(Error::Gpu)
    }
}

impl Drop for PeerMemory {
    fn drop(&mut self) {
        if let Target::Device { rt, ordinal, base } = &self.target {
            // SAFETY: `base` came from ipc_open; dropping self means no copy uses it (copies
            // borrow self).
            #[allow(unsafe_code)]
            unsafe {
                rt.ipc_close(*ordinal, *base)
            };
        }
    }
}
