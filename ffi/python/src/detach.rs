//! Calls made with the GIL released that stay safe while the interpreter exits.
//!
//! CPython before 3.14 ends a thread that takes the GIL back after finalization began with
//! `pthread_exit`: a forced unwind that runs through this library's frames until the binding's
//! panic guard stops it, and a forced unwind that is stopped aborts the process ("FATAL:
//! exception not rethrown"). A daemon thread waiting in `Engine.wait_finished` when the program
//! ends meets it. `blocking` parks such a thread instead, until the process exits, which is what
//! CPython 3.14 does itself.

use pyo3::marker::Ungil;
use pyo3::Python;

/// Runs `f` with the GIL released (`Python::allow_threads`); a thread the interpreter's exit
/// ends while it takes the GIL back is parked for good rather than unwound.
pub(crate) fn blocking<T, F>(py: Python<'_>, f: F) -> T
where
    F: Ungil + FnOnce() -> T,
    T: Ungil,
{
    let guard = ParkIfForcedOut;
    let out = py.allow_threads(f);
    // Back with the GIL: the guard is not dropped, so it parks nothing.
    std::mem::forget(guard);
    out
}

/// Dropped only while unwinding out of `blocking`: by a Rust panic (let through) or by the
/// interpreter's `pthread_exit` (the thread parks until the process exits).
struct ParkIfForcedOut;

impl Drop for ParkIfForcedOut {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        loop {
            std::thread::park();
        }
    }
}
