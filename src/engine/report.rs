//! What an engine reports about itself: [`Capabilities`] (transports and memory kinds found at
//! start, with the reason for each one missing) and [`EngineStats`] (counters).

use crate::completion::Totals;
use crate::gpu::GpuReport;

/// Counters of what an engine has served, refused and staged, for tests, logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Handshakes answered with our descriptor.
    pub handshakes_accepted: u64,
    /// Handshakes refused (bad frame, wrong version, incompatible peer, no layout, silence).
    pub handshakes_refused: u64,
    /// TCP data requests served.
    pub data_requests_served: u64,
    /// TCP data requests refused (request not held or held for another reader, range outside
    /// its blocks or outside exported memory, unknown region, failed session proof).
    pub data_requests_refused: u64,
    /// Bytes served over TCP.
    pub bytes_served: u64,
    /// GPU bytes copied into staging buffers to be sent over TCP.
    pub bytes_staged_out: u64,
    /// Bytes received over TCP and copied from staging buffers into GPU memory.
    pub bytes_staged_in: u64,
    /// Readers' done/abort notices and pins refused (request not held, or held for another
    /// reader).
    pub notices_refused: u64,
    /// RDMA reads whose hold this engine pinned as they were posted (confirmed without a
    /// round trip after them; `EngineConfig::read_pin`).
    pub reads_pinned: u64,
    /// Peers' application messages queued in the inbox.
    pub messages_received: u64,
    /// Peers' application messages refused (over the size limit, or the inbox full).
    pub messages_refused: u64,
    /// Application messages handed to a peer's control connection.
    pub messages_sent: u64,
    /// Application messages that could not be sent (peer unreachable, its queue full).
    pub messages_unsent: u64,
    /// Times an RDMA device pair towards a peer was paused after its path failed (reads then
    /// go to the other devices, or to TCP).
    pub rdma_pairs_paused: u64,
    /// Control connections open now (a gauge, not a count).
    pub control_connections: u64,
    /// TCP data connections open now (a gauge).
    pub data_connections: u64,
    /// Sessions this engine has open to peers now (a gauge): each a control connection, plus
    /// TCP streams or RDMA queue pairs, or a same-host socket.
    pub sessions: u64,
    /// Sessions this engine made to peers since it started (one handshake each).
    pub sessions_opened: u64,
    /// Sessions closed because no read or message used them for `session_idle`.
    pub sessions_closed_idle: u64,
    /// RDMA queue pairs this engine holds now (a gauge): its sessions' and those it made for
    /// its readers, on every device.
    pub queue_pairs: u64,
    /// Requests finished on each side since the engine started, by outcome.
    pub totals: Totals,
}

/// What an engine found at start: its transports and the memory kinds it can register, each
/// with the reason when missing. `Display` prints one line per item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The RDMA device in use, or why RDMA is not used.
    // A String error kept: a report for people (what is used, or why not), public since 0.1.
    pub rdma: std::result::Result<String, String>,
    /// The TCP data server (always available).
    pub tcp: String,
    /// The same-host path (its socket), or why there is none.
    // A String error kept: a report for people, as `rdma`.
    pub local: std::result::Result<String, String>,
    /// The GPU runtimes found (device memory), or why each is missing.
    pub gpu: GpuReport,
}

impl Capabilities {
    /// One line: transports and memory kinds, with reasons for what is missing.
    pub fn summary(&self) -> String {
        let mut transports = Vec::new();
        if let Ok(dev) = &self.rdma {
            transports.push(format!("rdma ({dev})"));
        }
        transports.push("tcp".to_string());
        let mut memory = vec!["host".to_string()];
        let mut missing = Vec::new();
        match &self.local {
            Ok(_) => transports.push("local (same host)".to_string()),
            Err(why) => missing.push(format!("local: {why}")),
        }
        if let Err(why) = &self.rdma {
            missing.push(format!("rdma: {why}"));
        }
        for (name, r) in [("cuda", &self.gpu.cuda), ("hip", &self.gpu.hip)] {
            match r {
                Ok(desc) => memory.push(format!("{name} ({desc})")),
                Err(why) => missing.push(format!("{name}: {why}")),
            }
        }
        let mut line = format!(
            "transports: {}; memory: {}",
            transports.join(", "),
            memory.join(", ")
        );
        if !missing.is_empty() {
            line.push_str(&format!("; unavailable: {}", missing.join("; ")));
        }
        line
    }
}

impl std::fmt::Display for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A String error kept: prints the two reports above.
        let line = |r: &std::result::Result<String, String>| match r {
            Ok(s) => format!("yes: {s}"),
            Err(why) => format!("no: {why}"),
        };
        writeln!(f, "transport rdma: {}", line(&self.rdma))?;
        writeln!(f, "transport tcp:  yes: {}", self.tcp)?;
        writeln!(f, "memory host:    yes")?;
        writeln!(f, "memory cuda:    {}", line(&self.gpu.cuda))?;
        write!(f, "memory hip:     {}", line(&self.gpu.hip))
    }
}
