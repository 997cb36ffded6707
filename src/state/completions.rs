//! The completion tracker with its notification built in: every change that finishes a request
//! (or may bring a hold's end nearer) wakes the callers waiting for something to finish, so no
//! caller can change it and forget to.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::completion::{CompletionTracker, Finished, Release};
use crate::ids::RequestId;

/// The engine's completion tracker and the condition its waiters sleep on.
pub(crate) struct Completions {
    tracker: Mutex<CompletionTracker>,
    changed: Condvar,
    /// Moves each time an update finished a request: what a spinning waiter watches, without
    /// the lock.
    finished: AtomicU64,
    /// How long a waiter polls before it sleeps while reads are in flight (zero: never).
    spin: Duration,
}

impl Completions {
    pub(crate) fn new(tracker: CompletionTracker, spin: Duration) -> Completions {
        Completions {
            tracker: Mutex::new(tracker),
            changed: Condvar::new(),
            finished: AtomicU64::new(0),
            spin,
        }
    }

    /// Runs `f` on the tracker, then wakes the waiters when what `f` did finished a request or
    /// may have brought a hold's end nearer (they sleep until the next one); other changes
    /// wake no one.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut CompletionTracker) -> R) -> R {
        let mut t = self.tracker.lock();
        let before = (t.finished_count(), t.deadline_epoch());
        let r = f(&mut t);
        let after = (t.finished_count(), t.deadline_epoch());
        drop(t);
        if after.0 > before.0 {
            self.finished.fetch_add(1, Ordering::Release);
        }
        if after != before {
            self.changed.notify_all();
        }
        r
    }

    /// Reads the tracker (changing nothing, so waking no one).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&CompletionTracker) -> R) -> R {
        f(&self.tracker.lock())
    }

    /// Everything that finished by now, each request once (holds past their deadline end
    /// first).
    pub(crate) fn take_finished(&self) -> Finished {
        let mut t = self.tracker.lock();
        t.poll(Instant::now());
        t.take_finished()
    }

    /// [`take_finished`](Completions::take_finished), waiting up to `timeout` for something
    /// to finish: asleep until a change or the next hold's deadline. While reads are in flight,
    /// the first wait polls for up to the engine's `spin` before it sleeps (a read that
    /// finishes meanwhile is seen without a wake-up); with nothing in flight it never polls.
    pub(crate) fn wait_finished(&self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let mut t = self.tracker.lock();
        let mut spun = self.spin.is_zero();
        loop {
            let now = Instant::now();
            t.poll(now);
            if t.has_finished() || now >= deadline {
                return t.take_finished();
            }
            if !spun && t.receiving() > 0 {
                spun = true;
                self.spin_until((now + self.spin).min(deadline), &mut t);
                continue;
            }
            let wake = t.next_deadline().map_or(deadline, |d| d.min(deadline));
            self.changed.wait_until(&mut t, wake);
        }
    }

    /// The holder's release of request `id`'s hold; returns whether it was held. A hold that
    /// a reader's pin keeps (`completion::tracker::pin`) is waited for: this returns once the
    /// pin lapsed or its reader's `Done` or `Abort` ended it, at most the pin's length (the
    /// engine's `read_pin`), after which the blocks may be reused.
    pub(crate) fn release(&self, id: &RequestId) -> bool {
        let mut t = self.tracker.lock();
        let mut held = false;
        loop {
            match t.release(id, Instant::now()) {
                Release::NotHeld => return held,
                Release::Released => return true,
                Release::Pinned(until) => {
                    held = true;
                    self.changed.wait_until(&mut t, until);
                }
            }
        }
    }

    /// Polls, without the lock, until a request finishes or `until`; yields the CPU between
    /// looks, so the threads moving the read's bytes keep running on a busy machine.
    fn spin_until(&self, until: Instant, t: &mut MutexGuard<'_, CompletionTracker>) {
        let seen = self.finished.load(Ordering::Acquire);
        MutexGuard::unlocked(t, || {
            while self.finished.load(Ordering::Acquire) == seen && Instant::now() < until {
                std::thread::yield_now();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::completion::SendNotice;
    use crate::tp::{Reader, TpRank};

    fn pinned(pin: Duration) -> (Arc<Completions>, Reader) {
        let c = Arc::new(Completions::new(CompletionTracker::new(), Duration::ZERO));
        let l = crate::layout::ModelShape::LLAMA3_8B.layout(crate::ids::RegionId(1), 4);
        let g = Arc::new(crate::grant::Grant::new(Arc::new(l), &[[0, 1]]).unwrap());
        let d = Reader {
            engine: "d".into(),
            tp: TpRank::SOLO,
        };
        let now = Instant::now();
        c.update(|t| {
            t.hold_send("r".into(), g, None, now, Duration::from_secs(60), 1)
                .unwrap();
            t.pin(&"r".into(), &d, None, now, pin).unwrap();
        });
        (c, d)
    }

    #[test]
    fn a_release_returns_when_the_pinning_readers_done_arrives() {
        let (c, d) = pinned(Duration::from_secs(60));
        let released = std::thread::spawn({
            let c = c.clone();
            move || c.release(&"r".into())
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!released.is_finished(), "the pin holds the release");
        let done = c.update(|t| t.handle_notice(&"r".into(), &d, SendNotice::Done, None));
        assert!(done.is_err(), "a Done on a released hold is refused");
        assert!(released.join().unwrap(), "it was held");
        assert!(c.take_finished().is_empty(), "a release reports nothing");
    }

    #[test]
    fn a_release_returns_when_the_pin_lapses() {
        let pin = Duration::from_millis(100);
        let (c, _) = pinned(pin);
        let t0 = Instant::now();
        assert!(c.release(&"r".into()));
        assert!(
            t0.elapsed() >= pin - Duration::from_millis(10),
            "{:?}",
            t0.elapsed()
        );
        assert!(!c.release(&"r".into()), "gone");
    }
}
