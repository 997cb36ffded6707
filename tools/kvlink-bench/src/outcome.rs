//! What a run measured ([`Outcome`]), and the process's CPU time it is charged with.

use std::time::Duration;

use kvlink::TransferReport;

#[derive(Default)]
pub(crate) struct Outcome {
    pub(crate) reports: Vec<TransferReport>,
    /// Per request, from the read call to the caller seeing it finished (`wait_finished`
    /// returning it): the latency a caller observes, the engine's own report's `elapsed` plus
    /// the caller's wake-up.
    pub(crate) observed: Vec<Duration>,
    pub(crate) wall: Duration,
    pub(crate) cpu: f64,
    /// Context switches of the process's threads during the run (a thread's every sleep and
    /// wake-up, and every preemption): what a small read costs, whatever the machine's speed.
    pub(crate) switches: u64,
    pub(crate) verified: u64,
    /// GB/s of a plain copy out of the caches' memory (staged runs only).
    pub(crate) reference_gbps: Option<f64>,
    /// CPU seconds of both engines idle with their session open (`--idle-secs`).
    pub(crate) idle_cpu: Option<f64>,
    /// Bytes staged out (prefill) and in (decode) during the run.
    pub(crate) staged: (u64, u64),
    /// A hybrid preset's run: the dense preset's, run just before it in the same process with
    /// the same options, to report beside it.
    pub(crate) dense: Option<Box<(crate::args::Args, Outcome)>>,
}

/// CPU time (user + system) of this process so far, in seconds, from /proc/self/stat.
pub(crate) fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ticks / 100.0 // USER_HZ is 100 on Linux
}

/// Context switches of this process's live threads so far (voluntary and not), from
/// /proc/self/task/*/status; 0 where it cannot be read.
pub(crate) fn context_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut n = 0;
    for t in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
            continue;
        };
        n += status
            .lines()
            .filter(|l| {
                l.starts_with("voluntary_ctxt_switches")
                    || l.starts_with("nonvoluntary_ctxt_switches")
            })
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    n
}
