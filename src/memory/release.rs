//! Waiting for shared objects to go: a [`Release`] counts the objects armed with it that are
//! still alive, and each object's [`OnDrop`] counts itself out when it drops. Deregistering a
//! region waits on it, woken by the last transfer that let go, instead of polling reference
//! counts.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// How many armed objects are still alive, and the condition a waiter sleeps on.
#[derive(Default)]
pub(crate) struct Release {
    left: Mutex<usize>,
    gone: Condvar,
}

impl Release {
    pub(crate) fn new() -> Arc<Release> {
        Arc::new(Release::default())
    }

    fn done(&self) {
        let mut left = self.left.lock();
        *left -= 1;
        if *left == 0 {
            self.gone.notify_all();
        }
    }

    /// Waits until every armed object dropped, or `deadline`; returns how many are left.
    pub(crate) fn wait_until(&self, deadline: Instant) -> usize {
        let mut left = self.left.lock();
        while *left > 0 && !self.gone.wait_until(&mut left, deadline).timed_out() {}
        *left
    }
}

/// Kept by an object that a [`Release`] may wait for: counted out when the object drops.
#[derive(Default)]
pub(crate) struct OnDrop(Mutex<Option<Arc<Release>>>);

impl OnDrop {
    /// Counts the object in `release` until it drops (an object is armed at most once; a
    /// second arm moves it to the new release).
    pub(crate) fn arm(&self, release: &Arc<Release>) {
        *release.left.lock() += 1;
        if let Some(old) = self.0.lock().replace(release.clone()) {
            old.done();
        }
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(r) = self.0.get_mut().take() {
            r.done();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_wait_ends_when_the_last_armed_object_drops() {
        let release = Release::new();
        let (a, b) = (Arc::new(OnDrop::default()), OnDrop::default());
        a.arm(&release);
        b.arm(&release);
        let user = a.clone();
        drop(a);
        drop(b);
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(release.wait_until(soon), 1, "a user still holds one");
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(user);
        });
        // Woken by the drop, long before the deadline (which would also find none left).
        let start = Instant::now();
        assert_eq!(release.wait_until(start + Duration::from_secs(60)), 0);
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the wait ended at its deadline: the last drop did not wake it"
        );
        t.join().unwrap();
    }

    #[test]
    fn nothing_armed_waits_for_nothing() {
        assert_eq!(Release::new().wait_until(Instant::now()), 0);
    }
}
