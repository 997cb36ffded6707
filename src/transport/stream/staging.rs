//! Staging of device memory for the TCP transport.
//!
//! The kernel cannot read or write GPU memory, so device spans travel through pinned host
//! buffers, one chunk at a time, pipelined: the server copies chunk k+1 (device to host) on a
//! blocking thread while it writes chunk k to the socket; the reader receives chunk k+1 while
//! chunk k is copied (host to device). Host spans of the same response still go straight from
//! or to registered memory with `writev`/`readv`.
//!
//! The server's buffers come from one bounded pool per engine. A serving pipeline only waits
//! for a free buffer when it holds none itself (otherwise it first sends its own oldest chunk).
//! Each reader stream has its own two buffers and never waits for the pool, so readers always
//! drain their sockets and serving pipelines always make progress: no pipeline, in this engine
//! or a peer, can wait on another forever.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::timeout;

use crate::error::{Error, Result};
use crate::memory::{RegionSpan, StagingBuf};
use crate::transport::RequestCtl;

/// Chunks in flight per pipeline (one being copied, one on the wire, one spare).
pub(crate) const DEPTH: usize = 3;

/// The engine's staging buffers for serving: at most `buffers` of `chunk` bytes, allocated (and
/// pinned) on first use and kept for reuse; and the engine's staging counters.
pub(crate) struct StagingPool {
    chunk: usize,
    slots: Arc<Semaphore>,
    free: Mutex<Vec<StagingBuf>>,
    staged_out: AtomicU64,
    staged_in: AtomicU64,
}

/// The right to one staging buffer; returns it to the pool on drop.
pub(crate) struct Slot {
    buf: Option<StagingBuf>,
    pool: Arc<StagingPool>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.free.lock().push(b);
        }
    }
}

impl Slot {
    /// The buffer, allocated and pinned with the span's runtime on first use.
    fn buf(&mut self, span: &RegionSpan) -> Result<&mut StagingBuf> {
        if self.buf.is_none() {
            let (rt, ordinal) = span
                .region()
                .device_runtime()
                .ok_or_else(|| Error::invalid("staging a host span"))?;
            self.buf = Some(StagingBuf::new(self.pool.chunk, rt, ordinal)?);
        }
        Ok(self.buf.as_mut().expect("set above"))
    }
}

impl StagingPool {
    /// A pool of at most `buffers` buffers of `chunk` bytes.
    pub(crate) fn new(chunk: usize, buffers: usize) -> Arc<StagingPool> {
        Arc::new(StagingPool {
            chunk: chunk.max(4096),
            slots: Arc::new(Semaphore::new(buffers.max(1))),
            free: Mutex::new(Vec::new()),
            staged_out: AtomicU64::new(0),
            staged_in: AtomicU64::new(0),
        })
    }

    /// Device bytes copied out to staging buffers (to be sent).
    pub(crate) fn staged_out(&self) -> u64 {
        self.staged_out.load(Ordering::Relaxed)
    }

    /// Received bytes copied from staging buffers into device memory.
    pub(crate) fn staged_in(&self) -> u64 {
        self.staged_in.load(Ordering::Relaxed)
    }

    fn slot(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        Slot {
            buf: self.free.lock().pop(),
            pool: self.clone(),
            _permit: permit,
        }
    }

    fn try_take(self: &Arc<Self>) -> Option<Slot> {
        self.slots
            .clone()
            .try_acquire_owned()
            .ok()
            .map(|p| self.slot(p))
    }

    async fn take(self: &Arc<Self>, wait: Duration) -> Result<Slot> {
        let permit = timeout(wait, self.slots.clone().acquire_owned())
            .await
            .map_err(|_| Error::Timeout {
                what: "waiting for a free staging buffer (raise staging_buffers)".into(),
                after: wait,
            })?
            .map_err(|_| Error::Shutdown)?;
        Ok(self.slot(permit))
    }

    /// The chunk size.
    pub(crate) fn chunk(&self) -> usize {
        self.chunk
    }
}

/// A run of a response's spans, in order: host spans moved by the kernel straight from or to
/// registered memory, or device spans packed into one staging buffer.
#[derive(Debug)]
pub(crate) enum Group {
    /// Consecutive host spans.
    Host(Vec<RegionSpan>),
    /// Consecutive device pieces totalling at most one chunk.
    Device(Vec<RegionSpan>),
}

/// Cuts `spans` into [`Group`]s: device spans are packed (and split where needed) into groups
/// of at most `chunk` bytes, so that many small KV blocks share one staging buffer and one
/// copy job.
pub(crate) fn group(spans: &[RegionSpan], chunk: u64) -> Result<Vec<Group>> {
    let mut out = Vec::new();
    let mut host: Vec<RegionSpan> = Vec::new();
    let mut dev: Vec<RegionSpan> = Vec::new();
    let mut dev_bytes = 0u64;
    for span in spans {
        if !span.is_device() {
            if !dev.is_empty() {
                out.push(Group::Device(std::mem::take(&mut dev)));
                dev_bytes = 0;
            }
            host.push(span.clone());
            continue;
        }
        if !host.is_empty() {
            out.push(Group::Host(std::mem::take(&mut host)));
        }
        let mut off = 0;
        while off < span.len() {
            if dev_bytes == chunk {
                out.push(Group::Device(std::mem::take(&mut dev)));
                dev_bytes = 0;
            }
            let n = (chunk - dev_bytes).min(span.len() - off);
            dev.push(span.sub(off, n)?);
            dev_bytes += n;
            off += n;
        }
    }
    if !dev.is_empty() {
        out.push(Group::Device(dev));
    }
    if !host.is_empty() {
        out.push(Group::Host(host));
    }
    Ok(out)
}

fn total(pieces: &[RegionSpan]) -> usize {
    pieces.iter().map(|p| p.len() as usize).sum()
}

/// Waits for a blocking copy, bounded by `wait`.
async fn join<T>(h: JoinHandle<Result<T>>, wait: Duration, what: &str) -> Result<T> {
    match timeout(wait, h).await {
        Err(_) => Err(Error::Timeout {
            what: format!("{what} (the GPU copy did not finish)"),
            after: wait,
        }),
        Ok(Err(e)) => Err(Error::Gpu(format!("{what}: copy task failed: {e}").into())),
        Ok(Ok(r)) => r,
    }
}

/// The server side: produces a response's device chunks, in order, as filled staging buffers.
pub(crate) struct Outbound {
    pool: Arc<StagingPool>,
    queue: VecDeque<JoinHandle<Result<(Slot, usize)>>>,
    wait: Duration,
}

impl Outbound {
    pub(crate) fn new(pool: Arc<StagingPool>, wait: Duration) -> Outbound {
        Outbound {
            pool,
            queue: VecDeque::new(),
            wait,
        }
    }

    /// Whether chunks are waiting to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether the pipeline is full: the caller must write the oldest chunk before adding one.
    pub(crate) fn is_full(&self) -> bool {
        self.queue.len() >= DEPTH
    }

    /// Starts copying `pieces` (at most one chunk of device memory, from [`group`]) into a
    /// staging buffer, back to back. Gives the pieces back when no buffer is free and this
    /// pipeline holds some: write the oldest chunk first, then call again.
    pub(crate) async fn start(
        &mut self,
        pieces: Vec<RegionSpan>,
    ) -> Result<std::result::Result<(), Vec<RegionSpan>>> {
        let n = total(&pieces);
        if n > self.pool.chunk || pieces.is_empty() {
            return Err(Error::invalid(format!(
                "{} staged pieces of {n} bytes for {}-byte buffers",
                pieces.len(),
                self.pool.chunk
            )));
        }
        let mut slot = match self.pool.try_take() {
            Some(s) => s,
            None if !self.queue.is_empty() => return Ok(Err(pieces)),
            None => self.pool.take(self.wait).await?,
        };
        self.queue.push_back(tokio::task::spawn_blocking(move || {
            let buf = slot.buf(&pieces[0])?.bytes_mut();
            let mut at = 0;
            for p in &pieces {
                let len = p.len() as usize;
                p.region().read_at(p.offset(), &mut buf[at..at + len])?;
                at += len;
            }
            slot.pool.staged_out.fetch_add(n as u64, Ordering::Relaxed);
            Ok((slot, n))
        }));
        Ok(Ok(()))
    }

    /// Waits for the oldest chunk's copy; `None` when none is queued. The staging buffer goes
    /// back to the pool when the returned [`Filled`] drops.
    pub(crate) async fn next(&mut self) -> Result<Option<Filled>> {
        let Some(h) = self.queue.pop_front() else {
            return Ok(None);
        };
        let (slot, len) = join(h, self.wait, "staging device memory for a response").await?;
        Ok(Some(Filled { slot, len }))
    }
}

/// A staging buffer holding one chunk ready to send.
pub(crate) struct Filled {
    slot: Slot,
    len: usize,
}

impl Filled {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.slot.buf.as_ref().expect("filled").bytes()[..self.len]
    }
}

/// Staging buffers per reader stream: one receiving while the other's copy to the GPU runs.
pub(crate) const IN_DEPTH: usize = 2;

/// The reader side of one stream: lands received chunks in device memory, pipelined. Its
/// buffers are its own (allocated on first use, kept for the stream's life), never taken from
/// the engine's shared pool: a reader must always be able to drain its socket, or serving
/// pipelines (which hold pool buffers while they write) could wait on each other across engines.
pub(crate) struct Inbound {
    staging: Arc<StagingPool>,
    free: Vec<StagingBuf>,
    queue: VecDeque<JoinHandle<(StagingBuf, Result<()>)>>,
    wait: Duration,
    /// The first copy failure of the current batch; later chunks are still received (to keep
    /// the stream in step) but the batch fails with this.
    pub(crate) failed: Option<Error>,
}

impl Inbound {
    pub(crate) fn new(staging: Arc<StagingPool>, wait: Duration) -> Inbound {
        Inbound {
            staging,
            free: Vec::new(),
            queue: VecDeque::new(),
            wait,
            failed: None,
        }
    }

    /// Bytes per staging buffer.
    pub(crate) fn chunk(&self) -> usize {
        self.staging.chunk
    }

    /// A buffer for the next chunk, whose first piece is `first`: an idle one, a new one (while
    /// this stream holds fewer than [`IN_DEPTH`]; mapped and pinned off the async runtime), or
    /// the oldest one in use once its copy finishes. The caller holds at most one buffer at a
    /// time, so the stream's buffers are the idle and queued ones: a buffer lost to an error is
    /// simply replaced.
    pub(crate) async fn buffer(&mut self, first: &RegionSpan) -> Result<StagingBuf> {
        loop {
            if let Some(b) = self.free.pop() {
                return Ok(b);
            }
            if self.free.len() + self.queue.len() < IN_DEPTH {
                let (rt, ordinal) = first
                    .region()
                    .device_runtime()
                    .map(|(rt, o)| (rt.clone(), o))
                    .ok_or_else(|| Error::invalid("staging a host span"))?;
                let chunk = self.staging.chunk;
                let h = tokio::task::spawn_blocking(move || StagingBuf::new(chunk, &rt, ordinal));
                return join(h, self.wait, "allocating a staging buffer").await;
            }
            self.finish_one().await?;
        }
    }

    /// Copies the received bytes in `buf` to `pieces` (from [`group`]), back to back, on a
    /// blocking thread, through the request's write guard (discarded once the request is
    /// cancelled).
    pub(crate) fn land(&mut self, buf: StagingBuf, pieces: Vec<RegionSpan>, ctl: Arc<RequestCtl>) {
        let staging = self.staging.clone();
        self.queue.push_back(tokio::task::spawn_blocking(move || {
            let bytes = buf.bytes();
            let r = ctl.guarded(
                || {
                    let mut at = 0;
                    for p in &pieces {
                        let len = p.len() as usize;
                        p.region().write_at(p.offset(), &bytes[at..at + len])?;
                        at += len;
                    }
                    staging.staged_in.fetch_add(at as u64, Ordering::Relaxed);
                    Ok(())
                },
                || Ok(()),
            );
            (buf, r)
        }));
    }

    async fn finish_one(&mut self) -> Result<()> {
        let Some(h) = self.queue.pop_front() else {
            return Ok(());
        };
        match timeout(self.wait, h).await {
            Err(_) => Err(Error::Timeout {
                what: "landing received data in device memory (the GPU copy did not finish)".into(),
                after: self.wait,
            }),
            Ok(Err(e)) => {
                self.failed
                    .get_or_insert(Error::Gpu(format!("copy task failed: {e}").into()));
                Ok(())
            }
            Ok(Ok((buf, r))) => {
                self.free.push(buf);
                if let Err(e) = r {
                    self.failed.get_or_insert(e);
                }
                Ok(())
            }
        }
    }

    /// Waits for every queued copy. Always called before a batch is reported, so no copy
    /// writes into the request's memory after its outcome is known.
    pub(crate) async fn drain(&mut self) -> Result<()> {
        while !self.queue.is_empty() {
            self.finish_one().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::Emulated;
    use crate::ids::RegionId;
    use crate::memory::{DeviceMemory, Region};

    #[test]
    fn groups_pack_small_device_spans_and_split_large_ones() {
        let mut host_mem = vec![0u8; 1 << 16];
        let dev = Arc::new(Region::device(
            RegionId(1),
            DeviceMemory {
                ptr: host_mem.as_mut_ptr() as u64,
                len: 1 << 16,
            },
            Arc::new(Emulated),
            0,
        ));
        let host = Arc::new(Region::allocate(RegionId(2), 1 << 16, false).unwrap());
        let d = |o, n| RegionSpan::new(dev.clone(), o, n).unwrap();
        let h = |o, n| RegionSpan::new(host.clone(), o, n).unwrap();
        // 3 small device spans, a large one, host spans, one more device span.
        let spans = vec![
            d(0, 300),
            d(1000, 300),
            d(2000, 300),
            d(4000, 2500),
            h(0, 10),
            h(50, 10),
            d(9000, 100),
        ];
        let groups = group(&spans, 1024).unwrap();
        let shape: Vec<(char, Vec<(u64, u64)>)> = groups
            .iter()
            .map(|g| match g {
                Group::Host(v) => ('h', v.iter().map(|s| (s.offset(), s.len())).collect()),
                Group::Device(v) => ('d', v.iter().map(|s| (s.offset(), s.len())).collect()),
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                ('d', vec![(0, 300), (1000, 300), (2000, 300), (4000, 124)]),
                ('d', vec![(4124, 1024)]),
                ('d', vec![(5148, 1024)]),
                ('d', vec![(6172, 328)]),
                ('h', vec![(0, 10), (50, 10)]),
                ('d', vec![(9000, 100)]),
            ]
        );
        // Every device group fits one buffer; bytes are conserved.
        for g in &groups {
            if let Group::Device(v) = g {
                assert!(total(v) <= 1024);
            }
        }
        let sum: u64 = groups
            .iter()
            .map(|g| match g {
                Group::Host(v) | Group::Device(v) => v.iter().map(RegionSpan::len).sum::<u64>(),
            })
            .sum();
        assert_eq!(sum, spans.iter().map(RegionSpan::len).sum::<u64>());
        drop(groups);
        drop(spans);
        drop(dev);
    }
}
