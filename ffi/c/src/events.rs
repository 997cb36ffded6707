//! The KV-event publisher for C and C++ engines (`kvlink_event_publisher`), and the batch it
//! publishes (`kvlink_event_batch`): the same publisher as Rust's and Python's, byte-compatible
//! with vLLM's and SGLang's streams. Numbering, encoding, replay and sending run on the
//! publisher's own thread.

use std::ffi::{c_char, c_int};
use std::sync::Mutex;

use kvlink::events::{
    BlockHash, BlockRemoved, BlockStored, Encoding, EventBatch, EventsError, KvEvent, Publisher,
    PublisherConfig, PublisherStats,
};

use crate::args::{check_out, millis, opt_str_arg, ref_arg, slice_arg, str_arg, write_out};
use crate::guard::guard;
use crate::status::{invalid, FfiError, FfiResult, KVLINK_E_INVALID, KVLINK_E_IO};

/// `kvlink_event_publisher_start`: the current encoding (tagged maps: vLLM >= 0.24, SGLang).
pub const KVLINK_EVENTS_CURRENT: c_int = 0;
/// `kvlink_event_publisher_start`: the legacy encoding (tagged arrays: older vLLM, ATOM).
pub const KVLINK_EVENTS_LEGACY: c_int = 1;

fn events_error(e: EventsError) -> FfiError {
    let code = match e {
        EventsError::Endpoint(_) | EventsError::Config(_) => KVLINK_E_INVALID,
        _ => KVLINK_E_IO,
    };
    FfiError {
        code,
        message: e.to_string(),
    }
}

/// A KV-event publisher. Opaque: made by `kvlink_event_publisher_start`, freed by
/// `kvlink_event_publisher_free`. Usable from several threads at once, except
/// `kvlink_event_publisher_free`.
pub struct kvlink_event_publisher {
    inner: Mutex<Option<Publisher>>,
    /// Put in batches that name no rank of their own.
    dp_rank: i64,
}

/// The events of one batch (one scheduler step), built with the `kvlink_event_batch_*`
/// functions. Opaque: made by `kvlink_event_batch_new`, freed by `kvlink_event_batch_free`.
/// Not for concurrent use.
pub struct kvlink_event_batch {
    batch: EventBatch,
    /// The batch's timestamp was left to publish time (a negative `ts`).
    ts_now: bool,
}

/// The publisher's counters (`kvlink_event_publisher_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvlink_event_stats {
    /// Batches numbered and handed to the PUB socket.
    pub published: u64,
    /// Batches refused because the queue was full.
    pub dropped: u64,
    /// Batches waiting in the queue.
    pub queued: u64,
    /// The sequence number the next batch gets.
    pub next_seq: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
}

const _: () = assert!(std::mem::size_of::<kvlink_event_stats>() == 40);

impl From<PublisherStats> for kvlink_event_stats {
    fn from(s: PublisherStats) -> Self {
        kvlink_event_stats {
            published: s.published,
            dropped: s.dropped,
            queued: s.queued,
            next_seq: s.next_seq,
            replay_requests: s.replay_requests,
        }
    }
}

/// Starts a KV-event publisher on `endpoint` (a tcp endpoint whose host is a star binds, as
/// vLLM's does, for example "tcp://" then "*:5557"; port 0 picks one, see
/// `kvlink_event_publisher_endpoint`), with a replay socket on `replay_endpoint` (NULL: none),
/// `topic` (NULL: none), `dp_rank` (added to tcp ports, put in each batch unless the batch
/// says otherwise) and `encoding` (`KVLINK_EVENTS_CURRENT` or `KVLINK_EVENTS_LEGACY`). Stores
/// it in `*out`; the caller frees it with `kvlink_event_publisher_free`.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID` (bad endpoint or settings) or `KVLINK_E_IO` (cannot
/// bind).
///
/// # Safety
/// `endpoint` is NULL or NUL-terminated; `replay_endpoint` and `topic` are NULL or
/// NUL-terminated; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_publisher_start(
    endpoint: *const c_char,
    replay_endpoint: *const c_char,
    topic: *const c_char,
    dp_rank: u32,
    encoding: c_int,
    out: *mut *mut kvlink_event_publisher,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        // SAFETY: the caller promised NUL-terminated strings or NULL.
        let endpoint = unsafe { str_arg(endpoint, "endpoint") }?;
        // SAFETY: as above.
        let replay = unsafe { opt_str_arg(replay_endpoint, "replay_endpoint") }?;
        // SAFETY: as above.
        let topic = unsafe { opt_str_arg(topic, "topic") }?;
        let encoding = match encoding {
            KVLINK_EVENTS_CURRENT => Encoding::Current,
            KVLINK_EVENTS_LEGACY => Encoding::Legacy,
            e => {
                return Err(invalid(format!(
                    "encoding {e} is neither KVLINK_EVENTS_CURRENT nor KVLINK_EVENTS_LEGACY"
                )))
            }
        };
        let cfg = PublisherConfig {
            endpoint: endpoint.to_string(),
            replay_endpoint: replay.map(str::to_string),
            topic: topic.unwrap_or("").to_string(),
            dp_rank,
            encoding,
            ..PublisherConfig::default()
        };
        let p = Publisher::start(cfg).map_err(events_error)?;
        let handle = Box::into_raw(Box::new(kvlink_event_publisher {
            inner: Mutex::new(Some(p)),
            dp_rank: i64::from(dp_rank),
        }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Copies the live endpoint (with the real port) into `buf` of `len` bytes, NUL-terminated.
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (NULL argument, buffer too small).
///
/// # Safety
/// `publisher` is NULL or live; `buf` is NULL or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_publisher_endpoint(
    publisher: *const kvlink_event_publisher,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live publisher or NULL.
        let p = unsafe { ref_arg(publisher, "publisher") }?;
        let guard = p.inner.lock().unwrap_or_else(|e| e.into_inner());
        let pubr = guard
            .as_ref()
            .ok_or_else(|| invalid("the publisher is closed"))?;
        let ep = pubr.endpoint().as_bytes();
        check_out(buf, "buf")?;
        if ep.len() + 1 > len {
            return Err(invalid(format!(
                "buf of {len} bytes; the endpoint needs {}",
                ep.len() + 1
            )));
        }
        // SAFETY: `buf` is non-NULL and the caller promised `len` writable bytes; `ep.len() + 1`
        // fits, and the source is a distinct Rust string.
        unsafe {
            std::ptr::copy_nonoverlapping(ep.as_ptr(), buf.cast::<u8>(), ep.len());
            *buf.add(ep.len()) = 0;
        }
        Ok(())
    })
}

fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Publishes the events of `batch` as one batch and empties `batch` (it may be reused). Never
/// blocks. Returns `KVLINK_OK`, `KVLINK_E_IO` when the queue is full (ipc and connected
/// endpoints; the batch is dropped and counted) or `KVLINK_E_INVALID` (NULL argument, closed
/// publisher).
///
/// # Safety
/// `publisher` is NULL or live; `batch` is NULL or live and not used by another thread.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_publisher_publish(
    publisher: *const kvlink_event_publisher,
    batch: *mut kvlink_event_batch,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live publisher or NULL.
        let p = unsafe { ref_arg(publisher, "publisher") }?;
        // SAFETY: the caller promised a live batch or NULL, used by this thread only.
        let b = unsafe { crate::args::mut_arg(batch, "batch") }?;
        let guard = p.inner.lock().unwrap_or_else(|e| e.into_inner());
        let pubr = guard
            .as_ref()
            .ok_or_else(|| invalid("the publisher is closed"))?;
        let events = std::mem::take(&mut b.batch.events);
        let batch = EventBatch {
            ts: if b.ts_now { now_ts() } else { b.batch.ts },
            events,
            dp_rank: b.batch.dp_rank.or(Some(p.dp_rank)),
        };
        pubr.publish(batch).map_err(events_error)
    })
}

/// Stores the publisher's counters in `*out`. Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `publisher` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_publisher_stats(
    publisher: *const kvlink_event_publisher,
    out: *mut kvlink_event_stats,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live publisher or NULL.
        let p = unsafe { ref_arg(publisher, "publisher") }?;
        check_out(out, "out")?;
        let guard = p.inner.lock().unwrap_or_else(|e| e.into_inner());
        let pubr = guard
            .as_ref()
            .ok_or_else(|| invalid("the publisher is closed"))?;
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, pubr.stats().into()) };
        Ok(())
    })
}

/// Sends what is queued (waiting up to `timeout_ms`, at most 7 days), closes the sockets and frees the
/// publisher. NULL is ignored. The publisher must not be used after this call.
///
/// # Safety
/// `publisher` is NULL or a live publisher from `kvlink_event_publisher_start`, not in use by
/// another thread.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_publisher_free(
    publisher: *mut kvlink_event_publisher,
    timeout_ms: u64,
) {
    let _ = guard(|| {
        if publisher.is_null() {
            return Ok(());
        }
        // Longer than the limit is clamped to it: freeing must not fail (and leak).
        let timeout = millis(
            timeout_ms.min(crate::status::KVLINK_TIMEOUT_MAX_MS),
            "timeout_ms",
        )?;
        // SAFETY: the caller promised a live publisher from `kvlink_event_publisher_start`
        // (made by `Box::into_raw`) that nothing else uses; it is freed exactly once here.
        let boxed = unsafe { Box::from_raw(publisher) };
        let taken = boxed.inner.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(mut p) = taken {
            p.close(timeout);
        }
        Ok(())
    });
}

/// Stores a new, empty batch in `*out`: timestamp `ts` (seconds since the epoch; a negative
/// value means the time of each `kvlink_event_publisher_publish`) and `dp_rank` (negative: the
/// publisher's). Freed by `kvlink_event_batch_free`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_batch_new(
    ts: f64,
    dp_rank: i64,
    out: *mut *mut kvlink_event_batch,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        if !ts.is_finite() {
            return Err(invalid("ts is not a finite number"));
        }
        let handle = Box::into_raw(Box::new(kvlink_event_batch {
            batch: EventBatch {
                ts: ts.max(0.0),
                events: Vec::new(),
                dp_rank: (dp_rank >= 0).then_some(dp_rank),
            },
            ts_now: ts < 0.0,
        }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// The `n` hashes at `p` as published hashes.
///
/// # Safety
/// `p` is NULL or points to `n` readable values.
unsafe fn hash_list(p: *const u64, n: usize, what: &str) -> FfiResult<Vec<BlockHash>> {
    if n == 0 {
        return Err(invalid(format!(
            "{what}: an event needs at least one block hash"
        )));
    }
    // SAFETY: the caller promised `n` readable values or NULL.
    let s = unsafe { slice_arg(p, n, what) }?;
    Ok(s.iter().map(|&h| BlockHash::U64(h)).collect())
}

/// Adds a `BlockStored` event: `count` block hashes at `block_hashes`, the parent's hash at
/// `parent` (NULL: none), `num_tokens` token ids at `tokens` (NULL when 0), `block_size`
/// tokens per block, `medium` (NULL: none, else for example "GPU"). Hashes are published as
/// unsigned 64-bit integers, as vLLM's are. Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `batch` is NULL or live; `block_hashes` points to `count` readable values; `parent` is NULL or
/// readable; `tokens` is NULL or points to `num_tokens` readable values; `medium` is NULL or
/// NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_batch_block_stored(
    batch: *mut kvlink_event_batch,
    block_hashes: *const u64,
    count: usize,
    parent: *const u64,
    tokens: *const u32,
    num_tokens: usize,
    block_size: u32,
    medium: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live batch or NULL, used by this thread only.
        let b = unsafe { crate::args::mut_arg(batch, "batch") }?;
        // SAFETY: the caller promised `count` readable values.
        let hashes = unsafe { hash_list(block_hashes, count, "block_hashes") }?;
        let parent_block_hash = if parent.is_null() {
            None
        } else {
            // SAFETY: non-NULL; the caller promised it is readable.
            Some(BlockHash::U64(unsafe { *ref_arg(parent, "parent")? }))
        };
        let token_ids = if num_tokens == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller promised `num_tokens` readable values.
            unsafe { slice_arg(tokens, num_tokens, "tokens") }?.to_vec()
        };
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let medium = unsafe { opt_str_arg(medium, "medium") }?.map(str::to_string);
        b.batch.events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            ..BlockStored::default()
        }));
        Ok(())
    })
}

/// Adds a `BlockRemoved` event for the `count` block hashes at `block_hashes`, from `medium` (NULL:
/// none). Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `batch` is NULL or live; `block_hashes` points to `count` readable values; `medium` is NULL or
/// NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_batch_block_removed(
    batch: *mut kvlink_event_batch,
    block_hashes: *const u64,
    count: usize,
    medium: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live batch or NULL, used by this thread only.
        let b = unsafe { crate::args::mut_arg(batch, "batch") }?;
        // SAFETY: the caller promised `count` readable values.
        let hashes = unsafe { hash_list(block_hashes, count, "block_hashes") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let medium = unsafe { opt_str_arg(medium, "medium") }?.map(str::to_string);
        b.batch.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes,
            medium,
            ..Default::default()
        }));
        Ok(())
    })
}

/// Adds an `AllBlocksCleared` event (`medium`: NULL for none). Returns `KVLINK_OK` or
/// `KVLINK_E_INVALID`.
///
/// # Safety
/// `batch` is NULL or live; `medium` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_batch_all_cleared(
    batch: *mut kvlink_event_batch,
    medium: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live batch or NULL, used by this thread only.
        let b = unsafe { crate::args::mut_arg(batch, "batch") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let medium = unsafe { opt_str_arg(medium, "medium") }?.map(str::to_string);
        b.batch.events.push(KvEvent::all_cleared(medium));
        Ok(())
    })
}

/// Frees a batch. NULL is ignored.
///
/// # Safety
/// `batch` is NULL or a live batch from `kvlink_event_batch_new`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvlink_event_batch_free(batch: *mut kvlink_event_batch) {
    if !batch.is_null() {
        // SAFETY: the caller promised a live batch from `kvlink_event_batch_new` (made by
        // `Box::into_raw`), freed exactly once here.
        drop(unsafe { Box::from_raw(batch) });
    }
}
