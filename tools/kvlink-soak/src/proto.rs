//! What the orchestrator (tools/soak/soak.py) and a worker say to each other: one JSON object
//! per line, commands on the worker's stdin, events on its stdout.

use serde::{Deserialize, Serialize};

/// Block ids, one list per block group.
pub type Groups = Vec<Vec<u32>>;

/// A command from the orchestrator.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Prefill: write the pattern of `seed` into `blocks`, then hold them under `id`.
    Hold {
        /// The request id.
        id: String,
        /// Blocks per group.
        blocks: Groups,
        /// The seed of the pattern written into the blocks.
        seed: u64,
        /// How long the hold waits for its reader, in milliseconds (the engine's when absent).
        abort_ms: Option<u64>,
        /// The one engine allowed to read it.
        reader: Option<String>,
    },
    /// Decode: read `remote` of `peer` into `local`, expecting the pattern of `seed`.
    Read {
        /// The request id (the same on both sides).
        id: String,
        /// The prefill's handshake address.
        peer: String,
        /// This engine's blocks per group.
        local: Groups,
        /// The prefill's blocks per group.
        remote: Groups,
        /// The seed the prefill wrote.
        seed: u64,
        /// The prefill's hold token.
        hold: u64,
    },
    /// Decode: cancel a read.
    Cancel {
        /// The request id.
        id: String,
    },
    /// Prefill: release a hold without reporting it.
    Release {
        /// The request id.
        id: String,
    },
    /// Handshake with `peer` (timed).
    Connect {
        /// The peer's handshake address.
        peer: String,
        /// How long to wait, in milliseconds.
        timeout_ms: u64,
    },
    /// Stop polling and taking commands for `ms` milliseconds, as a busy scheduler does.
    Stall {
        /// How long.
        ms: u64,
    },
    /// Close the engine and exit.
    Exit,
}

/// An event for the orchestrator.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// The engine is up.
    Ready {
        /// Its handshake address.
        addr: String,
        /// Its engine id.
        engine: String,
        /// This process.
        pid: u32,
    },
    /// A hold began.
    Held {
        /// The request id.
        id: String,
        /// Its token.
        token: u64,
    },
    /// Every reader of a hold confirmed it: the blocks are free again (and overwritten).
    Sent {
        /// The request id.
        id: String,
    },
    /// A hold ended unread or unconfirmed: failed, expired or lease over (blocks overwritten).
    HoldEnd {
        /// The request id.
        id: String,
        /// `FailureCause::name`.
        cause: String,
        /// Whether its deadline (or lease) passed.
        expired: bool,
        /// The engine's reason.
        reason: String,
    },
    /// A read finished and its bytes were checked against the seed.
    Received {
        /// The request id.
        id: String,
        /// Bytes the engine reported.
        bytes: u64,
        /// Bytes checked equal to the prefill's pattern.
        verified: u64,
        /// The transport that moved them.
        transport: String,
        /// From the read call to completion, in milliseconds.
        ms: f64,
    },
    /// A read finished, but its bytes are not what the prefill held: the invariant kvlink must
    /// never break.
    Corrupt {
        /// The request id.
        id: String,
        /// The first difference.
        error: String,
    },
    /// A read failed.
    ReadFailed {
        /// The request id.
        id: String,
        /// `FailureCause::name`.
        cause: String,
        /// Whether its deadline passed.
        expired: bool,
        /// The engine's reason.
        reason: String,
    },
    /// A command the engine refused at once.
    Refused {
        /// The command.
        op: String,
        /// Its request id, when it had one.
        id: Option<String>,
        /// The error.
        error: String,
    },
    /// A cancel was issued.
    Cancelled {
        /// The request id.
        id: String,
        /// Whether the read was still in flight.
        found: bool,
    },
    /// A handshake finished.
    Connected {
        /// The peer.
        peer: String,
        /// How long it took, in milliseconds.
        ms: f64,
        /// The error, when it failed.
        error: Option<String>,
    },
    /// The engine's counters and gauges (once a second).
    Stats(Stats),
}

/// The figures a worker reports once a second.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Handshakes accepted.
    pub handshakes_accepted: u64,
    /// Handshakes refused.
    pub handshakes_refused: u64,
    /// TCP data requests refused.
    pub data_requests_refused: u64,
    /// Notices refused.
    pub notices_refused: u64,
    /// Control connections open.
    pub control_connections: u64,
    /// Data connections open.
    pub data_connections: u64,
    /// Device pairs paused.
    pub rdma_pairs_paused: u64,
    /// Bytes read, all told.
    pub bytes_read: u64,
    /// Bytes served over TCP.
    pub bytes_served: u64,
    /// Reads in flight.
    pub receiving: u64,
    /// Holds in place.
    pub holding: u64,
    /// Sessions open to peers.
    pub sessions: u64,
    /// Sessions made to peers since the start.
    pub sessions_opened: u64,
    /// Sessions closed idle since the start.
    pub sessions_closed_idle: u64,
    /// RDMA queue pairs held.
    pub queue_pairs: u64,
}

/// One event as a line (without its newline).
pub fn line(ev: &Event) -> String {
    serde_json::to_string(ev).expect("events serialize")
}

/// A command from a line, or why it is not one.
pub fn parse(line: &str) -> Result<Command, String> {
    serde_json::from_str(line).map_err(|e| format!("bad command {line:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_and_unknown_fields_are_refused() {
        let c = parse(r#"{"op":"hold","id":"r1","blocks":[[1,2],[3]],"seed":9,"abort_ms":500}"#)
            .unwrap();
        assert_eq!(
            c,
            Command::Hold {
                id: "r1".into(),
                blocks: vec![vec![1, 2], vec![3]],
                seed: 9,
                abort_ms: Some(500),
                reader: None,
            }
        );
        let c = parse(
            r#"{"op":"read","id":"r1","peer":"p:1","local":[[0]],"remote":[[1]],"seed":9,"hold":4}"#,
        )
        .unwrap();
        assert!(matches!(c, Command::Read { hold: 4, .. }));
        assert_eq!(parse(r#"{"op":"exit"}"#).unwrap(), Command::Exit);
        assert!(parse(r#"{"op":"cancel","id":"r1","now":true}"#).is_err());
        assert!(parse(r#"{"op":"fly"}"#).is_err());
        assert!(parse("not json").is_err());
    }

    #[test]
    fn events_are_tagged_lines() {
        let ev = Event::Held {
            id: "r1".into(),
            token: 7,
        };
        assert_eq!(line(&ev), r#"{"ev":"held","id":"r1","token":7}"#);
        let s = line(&Event::Stats(Stats {
            holding: 2,
            ..Stats::default()
        }));
        assert!(
            s.starts_with(r#"{"ev":"stats","#) && s.contains(r#""holding":2"#),
            "{s}"
        );
    }
}
