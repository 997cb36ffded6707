//! What an engine reports of the GPU runtimes it found.

/// Which GPU runtimes this process found, or why each is missing. Reported by
/// `Engine::capabilities` and logged when an engine starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuReport {
    /// `Ok(description)` (driver version, devices) or `Err(why it is unavailable)`.
    // A String error kept: a report for people (found, or why not), public; Python reads it.
    pub cuda: Result<String, String>,
    /// `Ok(description)` (runtime version, devices) or `Err(why it is unavailable)`.
    // A String error kept: as `cuda`.
    pub hip: Result<String, String>,
}
