//! Finished sets (`kvlink_finished`): what `kvlink_engine_wait_finished` and
//! `kvlink_aggregator_take` return, their accessors and builders.

use std::ffi::{c_char, c_int, CString};

use kvlink::{FailedRequest, FailureCause, Finished, RequestId, Side};

use crate::args::{check_out, mut_arg, opt_str_arg, ref_arg, str_arg, write_out};
use crate::guard::{guard, guard_value, to_cstring};
use crate::status::{
    invalid, FfiResult, KVLINK_FAILED, KVLINK_RECEIVING, KVLINK_SENDING, KVLINK_SIDE_RECV,
    KVLINK_SIDE_SEND,
};

/// A set of finished requests: sending, receiving and failed entries (see `KVLINK_SENDING`,
/// `KVLINK_RECEIVING`, `KVLINK_FAILED`). Opaque: made by `kvlink_engine_wait_finished`,
/// `kvlink_aggregator_take` or `kvlink_finished_new`, freed with `kvlink_finished_free`.
///
/// Strings returned by its accessors are owned by it and stay valid until it is freed. It may
/// be read from several threads at once, but not while `kvlink_finished_add*` changes it.
pub struct kvlink_finished {
    pub(crate) finished: Finished,
    sending: Vec<CString>,
    receiving: Vec<CString>,
    failed: Vec<CString>,
    reasons: Vec<CString>,
    /// The peer of each report, in the order of `finished.reports`.
    peers: Vec<CString>,
}

impl kvlink_finished {
    pub(crate) fn new(finished: Finished) -> Self {
        let ids = |v: &[RequestId]| v.iter().map(|id| to_cstring(id.as_str())).collect();
        kvlink_finished {
            sending: ids(&finished.sending),
            receiving: ids(&finished.receiving),
            failed: finished
                .failed
                .iter()
                .map(|f| to_cstring(f.id.as_str()))
                .collect(),
            reasons: finished
                .failed
                .iter()
                .map(|f| to_cstring(&f.reason))
                .collect(),
            peers: finished
                .reports
                .iter()
                .map(|r| to_cstring(&r.peer))
                .collect(),
            finished,
        }
    }

    fn ids(&self, kind: c_int) -> FfiResult<&[CString]> {
        match kind {
            KVLINK_SENDING => Ok(&self.sending),
            KVLINK_RECEIVING => Ok(&self.receiving),
            KVLINK_FAILED => Ok(&self.failed),
            other => Err(invalid(format!(
                "kind is {other}; use KVLINK_SENDING (0), KVLINK_RECEIVING (1) or KVLINK_FAILED (2)"
            ))),
        }
    }

    /// Receiving entry `index`'s position in `finished.reports`.
    fn report_at(&self, index: usize) -> FfiResult<usize> {
        let id = self.finished.receiving.get(index).ok_or_else(|| {
            invalid(format!(
                "index {index} is out of range: there are {} receiving entries",
                self.finished.receiving.len()
            ))
        })?;
        self.finished
            .reports
            .iter()
            .position(|r| &r.id == id)
            .ok_or_else(|| invalid(format!("receiving entry {index} ({id}) carries no report")))
    }

    fn failed(&self, index: usize) -> FfiResult<&FailedRequest> {
        self.finished.failed.get(index).ok_or_else(|| {
            invalid(format!(
                "index {index} is out of range: there are {} failed entries",
                self.finished.failed.len()
            ))
        })
    }
}

/// What one finished read moved (see `kvlink_finished_report`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvlink_report {
    /// Bytes moved.
    pub bytes: u64,
    /// Segments after coalescing.
    pub segments: u64,
    /// Block pairs requested.
    pub blocks: u64,
    /// RDMA work requests, or TCP read requests, the read took.
    pub work_requests: u64,
    /// Nanoseconds from `kvlink_engine_read_blocks` to the last byte in place.
    pub elapsed_ns: u64,
    /// `"tcp"`, `"rdma"` or `"local"`: a static string, never NULL.
    pub transport: *const c_char,
    /// The read's timeline, in nanoseconds from the read call; `UINT64_MAX` for a step not
    /// seen. How long the prefill had held the request when this engine's done notice arrived.
    pub held_ns: u64,
    /// Sessions to every source were up.
    pub connected_ns: u64,
    /// The first bytes landed.
    pub first_byte_ns: u64,
    /// Every source's bytes were in place.
    pub last_byte_ns: u64,
    /// Every prefill confirmed it held the request for the whole read.
    pub confirmed_ns: u64,
}

/// Stores in `*out` what receiving entry `index` of `finished` moved (bytes, segments, blocks,
/// work requests, duration, transport) and when (its timeline).
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when `finished` or `out` is NULL, `index` is out of
/// range, or the entry carries no report (sets built by `kvlink_aggregator_take` or
/// `kvlink_finished_add` carry none).
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`; `out` is NULL or points to a writable
/// `kvlink_report`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_report(
    finished: *const kvlink_finished,
    index: usize,
    out: *mut kvlink_report,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live kvlink_finished or NULL.
        let f = unsafe { ref_arg(finished, "finished") }?;
        check_out(out, "out")?;
        let r = &f.finished.reports[f.report_at(index)?];
        let transport: &'static std::ffi::CStr = match r.transport {
            "rdma" => c"rdma",
            "tcp" => c"tcp",
            "local" => c"local",
            _ => c"other",
        };
        let ns = |d: Option<std::time::Duration>| {
            d.map_or(u64::MAX, |d| {
                u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
            })
        };
        let t = &r.timeline;
        let report = kvlink_report {
            held_ns: ns(t.held),
            connected_ns: ns(t.connected),
            first_byte_ns: ns(t.first_byte),
            last_byte_ns: ns(t.last_byte),
            confirmed_ns: ns(t.confirmed),
            bytes: r.bytes,
            segments: r.segments as u64,
            blocks: r.blocks as u64,
            work_requests: r.work_requests,
            elapsed_ns: u64::try_from(r.elapsed.as_nanos()).unwrap_or(u64::MAX),
            transport: transport.as_ptr(),
        };
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, report) };
        Ok(())
    })
}

/// The handshake address of the engine receiving entry `index` of `finished` was read from,
/// owned by `finished` (valid until it is freed); NULL when `finished` is NULL, `index` is out
/// of range or the entry carries no report (see `kvlink_last_error`).
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_report_peer(
    finished: *const kvlink_finished,
    index: usize,
) -> *const c_char {
    guard_value(
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(f.peers[f.report_at(index)?].as_ptr())
        },
    )
}

/// Number of entries of `kind` (`KVLINK_SENDING`, `KVLINK_RECEIVING` or `KVLINK_FAILED`) in
/// `finished`. Returns 0, with the last error set, when `finished` is NULL or `kind` unknown.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_count(
    finished: *const kvlink_finished,
    kind: c_int,
) -> usize {
    guard_value(
        |_| 0,
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(f.ids(kind)?.len())
        },
    )
}

/// The request id of entry `index` of `kind` in `finished`, as a NUL-terminated string owned by
/// `finished` (valid until `kvlink_finished_free`). Returns NULL, with the last error set, when
/// an argument is NULL, unknown or out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_id(
    finished: *const kvlink_finished,
    kind: c_int,
    index: usize,
) -> *const c_char {
    guard_value(
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            let ids = f.ids(kind)?;
            ids.get(index).map(|s| s.as_ptr()).ok_or_else(|| {
                invalid(format!(
                    "index {index} is out of range: there are {} entries of kind {kind}",
                    ids.len()
                ))
            })
        },
    )
}

/// Why failed entry `index` of `finished` failed, in words a user can act on, as a
/// NUL-terminated string owned by `finished` (valid until `kvlink_finished_free`). Returns NULL,
/// with the last error set, when `finished` is NULL or `index` out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_reason(
    finished: *const kvlink_finished,
    index: usize,
) -> *const c_char {
    guard_value(
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            f.failed(index)?;
            Ok(f.reasons[index].as_ptr())
        },
    )
}

/// Why failed entry `index` of `finished` failed, as a static NUL-terminated name valid for the
/// life of the program: `"expired"`, `"peer"` (the peer aborted or refused it), `"connection"`,
/// `"rdma"`, `"gpu"`, `"cancelled"`, `"unconfirmed"` (every byte arrived, but the prefill did
/// not confirm it held the blocks until then: recompute) or `"other"`; NULL when `finished` is
/// NULL or `index` out
/// of range (see `kvlink_last_error`).
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_cause(
    finished: *const kvlink_finished,
    index: usize,
) -> *const c_char {
    guard_value(
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(cause_name(&f.failed(index)?.cause).as_ptr())
        },
    )
}

/// The NUL-terminated static name of a cause (`FailureCause::name` plus the terminator).
pub(crate) fn cause_name(cause: &FailureCause) -> &'static std::ffi::CStr {
    match cause {
        FailureCause::Expired => c"expired",
        FailureCause::Peer => c"peer",
        FailureCause::Connection => c"connection",
        FailureCause::Rdma(_) => c"rdma",
        FailureCause::Gpu { .. } => c"gpu",
        FailureCause::Cancelled => c"cancelled",
        FailureCause::Unconfirmed => c"unconfirmed",
        // `FailureCause` is non-exhaustive: a cause added later reads "other" here until named.
        _ => c"other",
    }
}

/// 1 when failed entry `index` of `finished` ended because its deadline passed (for a send: the
/// reader never confirmed within the abort timeout), 0 when it failed otherwise, or a negative
/// status (`KVLINK_E_INVALID`) when `finished` is NULL or `index` out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_expired(
    finished: *const kvlink_finished,
    index: usize,
) -> c_int {
    guard_value(
        |code| code,
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(c_int::from(f.failed(index)?.expired))
        },
    )
}

/// The side of failed entry `index` of `finished`: `KVLINK_SIDE_SEND` or `KVLINK_SIDE_RECV`, or
/// a negative status (`KVLINK_E_INVALID`) when `finished` is NULL or `index` out of range.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_side(
    finished: *const kvlink_finished,
    index: usize,
) -> c_int {
    guard_value(
        |code| code,
        || {
            // SAFETY: the caller promised a live kvlink_finished or NULL.
            let f = unsafe { ref_arg(finished, "finished") }?;
            Ok(match f.failed(index)?.side {
                Side::Send => KVLINK_SIDE_SEND,
                Side::Recv => KVLINK_SIDE_RECV,
            })
        },
    )
}

/// Stores a new, empty `kvlink_finished` in `*out`, for building a rank's report received from
/// another process before passing it to `kvlink_aggregator_report`. The caller owns it and
/// frees it with `kvlink_finished_free`.
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when `out` is NULL.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_new(out: *mut *mut kvlink_finished) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        let handle = Box::into_raw(Box::new(kvlink_finished::new(Finished::default())));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Appends `request_id` (copied) to the sending (`KVLINK_SENDING`) or receiving
/// (`KVLINK_RECEIVING`) entries of `finished`; failed entries are added with
/// `kvlink_finished_add_failed`.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished` that no other thread uses during the call;
/// `request_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_add(
    finished: *mut kvlink_finished,
    kind: c_int,
    request_id: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised exclusive use of a live kvlink_finished or NULL.
        let f = unsafe { mut_arg(finished, "finished") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        let c = to_cstring(id);
        match kind {
            KVLINK_SENDING => {
                f.finished.sending.push(RequestId::new(id));
                f.sending.push(c);
            }
            KVLINK_RECEIVING => {
                f.finished.receiving.push(RequestId::new(id));
                f.receiving.push(c);
            }
            other => {
                return Err(invalid(format!(
                    "kind is {other}; use KVLINK_SENDING (0) or KVLINK_RECEIVING (1), \
                     and kvlink_finished_add_failed for failed entries"
                )))
            }
        }
        Ok(())
    })
}

/// Appends a failed entry for `request_id` on `side` (`KVLINK_SIDE_SEND` or
/// `KVLINK_SIDE_RECV`) to `finished`, with `expired` as in `kvlink_finished_expired` and
/// `reason` as its explanation (NULL for none). The strings are copied.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID`.
///
/// # Safety
/// `finished` is NULL or a live `kvlink_finished` that no other thread uses during the call;
/// `request_id` and `reason` are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_add_failed(
    finished: *mut kvlink_finished,
    side: c_int,
    request_id: *const c_char,
    expired: bool,
    reason: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised exclusive use of a live kvlink_finished or NULL.
        let f = unsafe { mut_arg(finished, "finished") }?;
        // SAFETY: the caller promised NUL-terminated strings or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        // SAFETY: as above.
        let reason = unsafe { opt_str_arg(reason, "reason") }?.unwrap_or("");
        let side = match side {
            KVLINK_SIDE_SEND => Side::Send,
            KVLINK_SIDE_RECV => Side::Recv,
            other => {
                return Err(invalid(format!(
                    "side is {other}; use KVLINK_SIDE_SEND (0) or KVLINK_SIDE_RECV (1)"
                )))
            }
        };
        f.failed.push(to_cstring(id));
        f.reasons.push(to_cstring(reason));
        f.finished.failed.push(FailedRequest {
            id: RequestId::new(id),
            side,
            expired,
            reason: reason.to_string(),
            cause: if expired {
                FailureCause::Expired
            } else {
                FailureCause::Other
            },
        });
        Ok(())
    })
}

/// Frees a `kvlink_finished` and the strings its accessors returned. NULL is ignored.
///
/// # Safety
/// `finished` is NULL or a `kvlink_finished` not freed yet, which no other thread uses during or
/// after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_finished_free(finished: *mut kvlink_finished) {
    guard(|| {
        if !finished.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in this
            // library, used by no one else.
            drop(unsafe { Box::from_raw(finished) });
        }
        Ok(())
    });
}
