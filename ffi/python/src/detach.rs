//! Calls made with the GIL released that stay safe while the interpreter exits.
//!
//! CPython before 3.14 ends a thread that takes the GIL back after finalization began with
//! `pthread_exit`: a forced unwind through this library's frames. In a wheel linked with its own
//! unwinder (maturin's `--zig`) that unwind crashes the process; elsewhere the binding's panic
//! guard stops it and the process aborts ("FATAL: exception not rethrown"). A daemon thread
//! waiting in `Engine.wait_finished` when the program ends met it every time.
//!
//! So no thread of this library takes the GIL back once the interpreter is exiting: `exiting`,
//! registered with `atexit` (whose callbacks run before finalization begins), raises a flag,
//! after which a call that returns from its wait parks its thread until the process exits (as
//! CPython 3.14 does itself); and it lets every thread already on its way back to the GIL
//! through first (it waits for them, the GIL released, for at most `DRAIN`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// Raised by `exiting`: the interpreter is exiting.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Threads between the end of their wait and the GIL taken back.
static RETURNING: AtomicUsize = AtomicUsize::new(0);
/// The thread that runs the `atexit` callbacks and then finalizes: never ended by CPython, so
/// it takes the GIL back as always (it may close an engine in a later callback).
static FINALIZING_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// How long `exiting` waits for the threads on their way back to the GIL.
const DRAIN: Duration = Duration::from_secs(2);

/// Runs `f` with the GIL released (`Python::allow_threads`). Once the interpreter is exiting,
/// a thread other than the one finalizing parks for good instead of taking the GIL back.
pub(crate) fn blocking<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let out = py.allow_threads(move || {
        let out = f();
        // Counted before the flag is read: `exiting` either sees this thread on its way back
        // (and waits for it) or has raised the flag first (and this thread parks).
        RETURNING.fetch_add(1, SeqCst);
        if EXITING.load(SeqCst) && FINALIZING_THREAD.get() != Some(&std::thread::current().id()) {
            RETURNING.fetch_sub(1, SeqCst);
            park_for_good();
        }
        out
    });
    RETURNING.fetch_sub(1, SeqCst);
    out
}

fn park_for_good() -> ! {
    loop {
        std::thread::park();
    }
}

/// Registered with `atexit` when the module loads: raises the exit flag, then waits (GIL
/// released, at most `DRAIN`) until no thread is on its way back to the GIL.
#[pyfunction]
pub(crate) fn exiting(py: Python<'_>) {
    let _ = FINALIZING_THREAD.set(std::thread::current().id());
    EXITING.store(true, SeqCst);
    // The main thread: finalization has not begun, so taking the GIL back is safe here.
    py.allow_threads(|| {
        let end = Instant::now() + DRAIN;
        while RETURNING.load(SeqCst) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}
