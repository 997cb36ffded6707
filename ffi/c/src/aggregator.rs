//! Tensor-parallel aggregation (`kvlink_aggregator`): combines the finished sets of the ranks
//! of a tensor-parallel group.

use std::ffi::c_int;
use std::sync::Mutex;
use std::time::Instant;

use kvlink::TpAggregator;

use crate::args::{check_out, millis, ref_arg, write_out};
use crate::finished::kvlink_finished;
use crate::guard::guard;
use crate::status::invalid;

/// Combines the finished sets of the ranks of a tensor-parallel group for the scheduler: a
/// request is released once every rank reported it, as finished when every rank succeeded and
/// as failed when any failed (or when some rank did not report within the rank timeout).
/// Opaque: made by `kvlink_aggregator_new`, freed by `kvlink_aggregator_free`. Safe to use from
/// several threads at once, except `kvlink_aggregator_free`.
pub struct kvlink_aggregator {
    inner: Mutex<TpAggregator>,
}

impl kvlink_aggregator {
    fn lock(&self) -> std::sync::MutexGuard<'_, TpAggregator> {
        // A panic inside a call leaves the aggregator consistent enough to keep going: every
        // update is a handful of map operations.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Stores a new aggregator for `world_size` ranks (at least 1) in `*out`; a request some ranks
/// reported fails when the others have not reported within `rank_timeout_ms` (1 ms to 7 days)
/// of the first report. The caller owns it and frees it with `kvlink_aggregator_free`.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_new(
    world_size: usize,
    rank_timeout_ms: u64,
    out: *mut *mut kvlink_aggregator,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        if rank_timeout_ms == 0 {
            return Err(invalid("rank_timeout_ms is 0"));
        }
        let timeout = millis(rank_timeout_ms, "rank_timeout_ms")?;
        let agg = TpAggregator::new(world_size, timeout)?;
        let handle = Box::into_raw(Box::new(kvlink_aggregator {
            inner: Mutex::new(agg),
        }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Takes rank `rank`'s finished set (from its `kvlink_engine_wait_finished`, or built with
/// `kvlink_finished_new`). `finished` stays owned by the caller and is only read during the
/// call. Duplicate reports are ignored.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (NULL argument, rank not below the world size).
///
/// # Safety
/// `aggregator` is NULL or a live aggregator; `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_report(
    aggregator: *mut kvlink_aggregator,
    rank: usize,
    finished: *const kvlink_finished,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live aggregator or NULL.
        let a = unsafe { ref_arg(aggregator, "aggregator") }?;
        // SAFETY: the caller promised a live kvlink_finished or NULL.
        let f = unsafe { ref_arg(finished, "finished") }?;
        a.lock().handle_report(rank, &f.finished, Instant::now())?;
        Ok(())
    })
}

/// Fails the requests whose missing ranks ran past the rank timeout, then stores the requests
/// released since the last call in a new `kvlink_finished` at `*out` (possibly empty). The
/// caller owns it and frees it with `kvlink_finished_free`.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `aggregator` is NULL or a live aggregator; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_take(
    aggregator: *mut kvlink_aggregator,
    out: *mut *mut kvlink_finished,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live aggregator or NULL.
        let a = unsafe { ref_arg(aggregator, "aggregator") }?;
        check_out(out, "out")?;
        let finished = {
            let mut agg = a.lock();
            agg.poll(Instant::now());
            agg.take_finished()
        };
        let handle = Box::into_raw(Box::new(kvlink_finished::new(finished)));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Frees an aggregator. NULL is ignored.
///
/// # Safety
/// `aggregator` is NULL or an aggregator not freed yet, which no other thread uses during or
/// after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_aggregator_free(aggregator: *mut kvlink_aggregator) {
    guard(|| {
        if !aggregator.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in
            // kvlink_aggregator_new, used by no one else.
            drop(unsafe { Box::from_raw(aggregator) });
        }
        Ok(())
    });
}
