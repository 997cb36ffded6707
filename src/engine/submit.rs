//! A read submitted on the caller's thread: polled once there, handed to the runtime only
//! when something wakes it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Polls `task` once on this thread, inside the runtime's context, and hands it to the runtime
/// only when something wakes it (its response arrived, its deadline passed, it was
/// cancelled): the waker its first poll registered spawns it then, from the thread that woke
/// it, usually one of the runtime's own. No runtime thread is woken to poll a task that can
/// only wait (a sleeping runtime woken from outside costs an event and a thread wake-up, on
/// the path of the read's response on a busy machine).
pub(super) fn submit_here(
    rt: &tokio::runtime::Runtime,
    task: impl Future<Output = ()> + Send + 'static,
) {
    let _in = rt.enter();
    let mut task: DeferredTask = Box::pin(task);
    let deferred = Arc::new(Deferred {
        task: Mutex::new(None),
        woken: AtomicBool::new(false),
        runtime: rt.handle().clone(),
    });
    let waker = std::task::Waker::from(deferred.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    if task.as_mut().poll(&mut cx).is_ready() {
        return;
    }
    *deferred.task.lock() = Some(task);
    // A wake-up between the poll and the line above found no task: it is spawned here.
    if deferred.woken.load(Ordering::SeqCst) {
        deferred.spawn();
    }
}

type DeferredTask = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// A task polled once on the caller's thread, waiting for its first wake-up to be spawned.
struct Deferred {
    /// The task, once its first poll returned; taken by the one who spawns it.
    task: Mutex<Option<DeferredTask>>,
    /// Set by every wake-up before it looks for the task (the submitter looks after storing it).
    woken: AtomicBool,
    runtime: tokio::runtime::Handle,
}

impl Deferred {
    fn spawn(&self) {
        if let Some(task) = self.task.lock().take() {
            drop(self.runtime.spawn(task));
        }
    }
}

impl std::task::Wake for Deferred {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        self.spawn();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A task that can only wait after its first poll runs to its end once woken from
    /// another thread, and one woken by a timer too.
    #[test]
    fn a_task_submitted_here_runs_once_woken() {
        let rt = runtime();
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let (done, finished) = mpsc::channel();
        let first = done.clone();
        submit_here(&rt, async move {
            first.send(rx.await.unwrap()).unwrap();
        });
        let deadline = Duration::from_secs(10);
        assert!(finished.recv_timeout(Duration::from_millis(50)).is_err());
        std::thread::spawn(move || tx.send(7).unwrap());
        assert_eq!(finished.recv_timeout(deadline).unwrap(), 7);
        submit_here(&rt, async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            done.send(8).unwrap();
        });
        assert_eq!(finished.recv_timeout(deadline).unwrap(), 8);
    }

    /// A task that wakes itself during its first poll (a yield) is spawned at once, and one
    /// that finishes in its first poll is never spawned.
    #[test]
    fn a_task_woken_during_its_first_poll_is_spawned() {
        let rt = runtime();
        let (done, finished) = mpsc::channel();
        let second = done.clone();
        submit_here(&rt, async move {
            tokio::task::yield_now().await;
            done.send(1).unwrap();
        });
        assert_eq!(finished.recv_timeout(Duration::from_secs(10)).unwrap(), 1);
        submit_here(&rt, async move { second.send(2).unwrap() });
        assert_eq!(finished.try_recv().unwrap(), 2);
    }
}
