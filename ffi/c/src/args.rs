//! Argument checks: NULL and alignment checks of pointers, C strings, arrays, out-parameters
//! and timeouts.

use std::ffi::{c_char, CStr};
use std::time::Duration;

use kvlink::internal::MAX_DURATION;

use crate::status::{invalid, FfiResult, KVLINK_TIMEOUT_MAX_MS};

/// A borrowed string argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged for `'a`.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> FfiResult<&'a str> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: `p` is not NULL and the caller promised a NUL-terminated string living for 'a.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|e| invalid(format!("{what} is not valid UTF-8: {e}")))
}

/// An optional borrowed string argument: NULL gives `None`.
///
/// # Safety
/// As for [`str_arg`].
pub(crate) unsafe fn opt_str_arg<'a>(p: *const c_char, what: &str) -> FfiResult<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: forwarded from the caller.
        unsafe { str_arg(p, what) }.map(Some)
    }
}

/// A shared reference to an argument.
///
/// # Safety
/// `p` is NULL or points to a valid `T` that nothing mutates for `'a`.
pub(crate) unsafe fn ref_arg<'a, T>(p: *const T, what: &str) -> FfiResult<&'a T> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: not NULL, aligned, and the caller promised a valid T for 'a.
    Ok(unsafe { &*p })
}

/// An exclusive reference to an argument.
///
/// # Safety
/// `p` is NULL or points to a valid `T` that nothing else accesses for `'a`.
pub(crate) unsafe fn mut_arg<'a, T>(p: *mut T, what: &str) -> FfiResult<&'a mut T> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: not NULL, aligned, and the caller promised exclusive access to a valid T for 'a.
    Ok(unsafe { &mut *p })
}

/// A borrowed array argument of `count` elements; NULL is accepted when `count` is 0.
///
/// # Safety
/// When `count > 0`, `p` is NULL or points to `count` valid `T`s that nothing mutates for `'a`.
pub(crate) unsafe fn slice_arg<'a, T>(p: *const T, count: usize, what: &str) -> FfiResult<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL but its count is {count}")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    if count > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(invalid(format!("{what}: count {count} is too large")));
    }
    // SAFETY: not NULL, aligned, the total size fits in isize, and the caller promised `count`
    // valid elements for 'a.
    Ok(unsafe { std::slice::from_raw_parts(p, count) })
}

/// The leading `u64` of a versioned struct: its size in bytes as the caller's header declares
/// it. Checked against `full` (this release's size): a multiple of 8 from 8 to `full`, as
/// fields are appended 8 bytes at a time, so that the size tells which fields a caller has.
///
/// # Safety
/// `p` is NULL or points to at least 8 readable bytes, aligned for `T`.
pub(crate) unsafe fn struct_size<T>(p: *const T, what: &str) -> FfiResult<usize> {
    let full = std::mem::size_of::<T>();
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: not NULL, aligned for T (so for u64: T starts with its u64 size), and the caller
    // promised at least the size field.
    let size = unsafe { p.cast::<u64>().read() };
    if size < 8 || size % 8 != 0 || size > full as u64 {
        return Err(invalid(format!(
            "{what}->size is {size}: set it to sizeof of the struct (at most {full} bytes in \
             this kvlink; a multiple of 8)"
        )));
    }
    Ok(size as usize)
}

/// Copies the first `size` bytes of `from` over the same bytes of `into`: a caller's struct of
/// an older (shorter) layout into a full one, or back.
///
/// # Safety
/// `size` is at most `size_of::<T>()` and ends at a field boundary of `T`; `from` points to
/// `size` readable bytes and `into` to `size` writable ones, not overlapping.
pub(crate) unsafe fn copy_prefix<T>(from: *const T, into: *mut T, size: usize) {
    debug_assert!(size <= std::mem::size_of::<T>());
    // SAFETY: the caller promised both ranges and a field boundary at `size`, so the bytes
    // copied are whole fields of T (plain data, every bit pattern of them valid).
    unsafe { std::ptr::copy_nonoverlapping(from.cast::<u8>(), into.cast::<u8>(), size) };
}

/// Checks an out-parameter before any work is done, so that no result is lost to a bad one.
pub(crate) fn check_out<T>(p: *mut T, what: &str) -> FfiResult {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    Ok(())
}

/// Stores a result through an out-parameter checked by [`check_out`].
///
/// # Safety
/// `p` passed [`check_out`] and points to writable memory for a `T`.
pub(crate) unsafe fn write_out<T>(p: *mut T, value: T) {
    // SAFETY: checked non-NULL and aligned; the caller promised it is writable. `write` does not
    // read or drop the (possibly uninitialised) old value.
    unsafe { p.write(value) }
}

/// A timeout in milliseconds; 0 is allowed (waits return at once), longer than the core's limit
/// of 7 days (`MAX_DURATION`, `KVLINK_TIMEOUT_MAX_MS`) is refused.
pub(crate) fn millis(ms: u64, what: &str) -> FfiResult<Duration> {
    let d = Duration::from_millis(ms);
    if d > MAX_DURATION {
        return Err(invalid(format!(
            "{what} of {ms} ms is longer than the limit of {KVLINK_TIMEOUT_MAX_MS} ms (7 days)"
        )));
    }
    Ok(d)
}
