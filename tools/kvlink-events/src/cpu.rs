//! CPU time of this process, for the benchmark summaries (the only unsafe code of the tool).

/// CPU time of the whole process so far (every thread), user and system, in seconds.
pub fn seconds() -> f64 {
    // SAFETY: getrusage only writes into the zeroed struct it is given, which outlives the
    // call; RUSAGE_SELF is always a valid target.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}
