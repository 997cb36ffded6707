//! The thread's last error message, panic containment (`guard`, `guard_value`) and the
//! version string.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::status::{FfiResult, KVLINK_E_INTERNAL, KVLINK_OK};

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

const EMPTY: &CStr = c"";

/// Text as a C string, with any NUL byte replaced (ids and messages never contain one in
/// practice, but a C string cannot).
pub(crate) fn to_cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\u{fffd}")).unwrap_or_default()
}

fn set_last_error(msg: &str) {
    let msg = to_cstring(msg);
    // A thread being torn down has no last error to keep.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(msg));
}

fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = None);
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic payload");
    format!("internal error: kvlink panicked: {what}")
}

/// Runs an API body: clears the last error, contains panics and turns the outcome into a
/// status code.
pub(crate) fn guard(body: impl FnOnce() -> FfiResult) -> c_int {
    guard_value(|code| code, || body().map(|()| KVLINK_OK))
}

/// [`guard`] for functions that return a value: after an error or a panic (whose message goes to
/// the last error either way), returns `on_failure` of the status code.
pub(crate) fn guard_value<T>(
    on_failure: impl FnOnce(c_int) -> T,
    body: impl FnOnce() -> FfiResult<T>,
) -> T {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            on_failure(e.code)
        }
        Err(payload) => {
            set_last_error(&panic_message(payload.as_ref()));
            on_failure(KVLINK_E_INTERNAL)
        }
    }
}

/// The message of the last failed call on this thread, or an empty string when the last call
/// succeeded.
///
/// Never NULL. The string is owned by kvlink and stays valid until the next kvlink call on the
/// same thread; copy it to keep it. Every call other than this one and `kvlink_version` clears
/// or replaces it.
#[no_mangle]
pub extern "C" fn kvlink_last_error() -> *const c_char {
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|e| e.borrow().as_ref().map_or(EMPTY.as_ptr(), |m| m.as_ptr()))
            .unwrap_or(EMPTY.as_ptr())
    })
    .unwrap_or(EMPTY.as_ptr())
}

const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The version of this library, e.g. `"0.2.0"`. Never NULL; a static string owned by kvlink.
#[no_mangle]
pub extern "C" fn kvlink_version() -> *const c_char {
    VERSION.as_ptr().cast()
}
