//! Control-plane messages and the engine descriptor exchanged in the handshake.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{RegionId, RequestId};
use crate::inbox::Body;
use crate::layout::KvLayout;
use crate::memory::RegionInfo;
use crate::tp::Relation;
use crate::transport::rdma::{QpEndpoint, RdmaRegionInfo};

/// Most regions a descriptor may list.
pub const MAX_REGIONS: usize = 4096;

/// Most transports a descriptor lists: TCP, the same-host path and one per RDMA device.
pub const MAX_TRANSPORTS: usize = 2 + crate::transport::rdma::MAX_DEVICES;

/// A transport an engine offers, with where to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TransportInfo {
    /// The TCP data server.
    Tcp {
        /// Address of the data server.
        addr: String,
        /// Streams a reader should open (the server accepts more).
        streams: u16,
    },
    /// RDMA verbs (RDMA READ over reliable connections).
    Rdma {
        /// Device name, for logs.
        device: String,
        /// Port GID.
        gid: [u8; 16],
        /// Port LID (0 on RoCE).
        lid: u16,
        /// Active MTU in bytes.
        mtu: u32,
        /// Keys and addresses of the exported regions.
        regions: Vec<RdmaRegionInfo>,
    },
    /// The same-host path: a Unix socket in the abstract namespace.
    Local {
        /// The host's id (its kernel's boot id): a reader with the same id shares the host.
        host: String,
        /// The socket's abstract name.
        socket: String,
    },
}

/// What one engine tells a peer about itself: identity, KV layout, exported memory, transports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// Control protocol version of the sender.
    pub protocol_version: u16,
    /// Engine id (unique per worker process; defaults to host, pid and rank).
    pub engine_id: String,
    /// Changes every time an engine starts, so a peer can tell a restart from a reconnect.
    pub generation: u64,
    /// Tensor-parallel rank of this worker.
    pub tp_rank: u32,
    /// Tensor-parallel size of this worker's group.
    pub tp_size: u32,
    /// The KV cache.
    pub layout: KvLayout,
    /// Exported memory; every read must lie inside one of these.
    pub regions: Vec<RegionInfo>,
    /// Transports offered.
    pub transports: Vec<TransportInfo>,
}

impl Descriptor {
    /// Checks a descriptor received from a peer before any use.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Protocol(format!("invalid peer descriptor: {m}")));
        if self.engine_id.is_empty() || self.engine_id.len() > 256 {
            return bad("engine_id must be 1 to 256 bytes".into());
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return bad(format!(
                "tp_rank {} of tp_size {}",
                self.tp_rank, self.tp_size
            ));
        }
        if self.regions.len() > MAX_REGIONS {
            return bad(format!(
                "{} regions (limit {MAX_REGIONS})",
                self.regions.len()
            ));
        }
        // Region lengths by id: every check below is linear in the descriptor's size.
        let mut lens = HashMap::with_capacity(self.regions.len());
        if let Some(r) = self
            .regions
            .iter()
            .find(|r| lens.insert(r.id, r.len).is_some())
        {
            return bad(format!("{} listed twice", r.id));
        }
        if self.transports.is_empty() || self.transports.len() > MAX_TRANSPORTS {
            return bad(format!(
                "{} transports (1 to {MAX_TRANSPORTS} allowed)",
                self.transports.len()
            ));
        }
        for t in &self.transports {
            self.check_transport(t, &lens)?;
        }
        self.layout
            .validate(&self.regions)
            .and_then(|()| self.layout.validate_tp(self.tp_size))
            .map_err(|e| Error::Protocol(format!("invalid peer descriptor: {e}")))
    }

    /// One offered transport of [`validate`](Self::validate): a TCP address and stream count,
    /// a same-host id and socket name, or RDMA keys covering exported regions (`lens`: each
    /// region's length) exactly once.
    fn check_transport(&self, t: &TransportInfo, lens: &HashMap<RegionId, u64>) -> Result<()> {
        let bad = |m: String| Err(Error::Protocol(format!("invalid peer descriptor: {m}")));
        match t {
            TransportInfo::Tcp { addr, streams } => {
                if addr.parse::<SocketAddr>().is_err() {
                    return bad(format!("tcp address {addr:?} is not ip:port"));
                }
                if *streams == 0 || *streams > 64 {
                    return bad(format!("tcp streams {streams} (1 to 64 allowed)"));
                }
            }
            TransportInfo::Local { host, socket } => {
                if host.is_empty() || host.len() > 64 || socket.is_empty() || socket.len() > 100 {
                    return bad("same-host id or socket name of the wrong length".into());
                }
            }
            TransportInfo::Rdma {
                device, regions, ..
            } => {
                if device.len() > 64 {
                    return bad("rdma device name longer than 64 bytes".into());
                }
                if regions.len() > self.regions.len() {
                    return bad(format!(
                        "rdma keys for {} regions, {} exported",
                        regions.len(),
                        self.regions.len()
                    ));
                }
                let mut keyed = HashSet::with_capacity(regions.len());
                for r in regions {
                    let Some(&len) = lens.get(&r.id) else {
                        return bad(format!("rdma keys for unknown {}", r.id));
                    };
                    if !keyed.insert(r.id) {
                        return bad(format!("rdma keys for {} listed twice", r.id));
                    }
                    let chunks = if r.chunk_bytes == 0 {
                        u64::MAX
                    } else {
                        len.div_ceil(r.chunk_bytes)
                    };
                    if chunks != r.rkeys.len() as u64 || r.addr.checked_add(len).is_none() {
                        return bad(format!(
                            "rdma registration of {} does not cover its {} bytes",
                            r.id, len
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Every difference that stops `theirs` from exchanging blocks with `self`: layouts that
    /// differ in what a block is, or TP sizes that cannot pair (one must be a multiple of the
    /// other; see `crate::tp`).
    pub fn differences(&self, theirs: &Descriptor) -> Vec<String> {
        let mut d = self.layout.differences(&theirs.layout);
        if let Err(why) = Relation::describe(self.tp_size, theirs.tp_size) {
            d.push(format!(
                "tp_size {} vs {}: {why}",
                self.tp_size, theirs.tp_size
            ));
        }
        d
    }

    /// How this engine's TP group pairs with `theirs`', in words (for logs).
    pub fn tp_relation(&self, theirs: &Descriptor) -> String {
        Relation::describe(self.tp_size, theirs.tp_size).unwrap_or_else(|why| why.to_string())
    }

    /// The TCP data server, if offered.
    pub fn tcp(&self) -> Option<(SocketAddr, u16)> {
        self.transports.iter().find_map(|t| match t {
            TransportInfo::Tcp { addr, streams } => addr.parse().ok().map(|a| (a, *streams)),
            _ => None,
        })
    }

    /// The same-host path (host id, socket name), if offered.
    pub fn local(&self) -> Option<(&str, &str)> {
        self.transports.iter().find_map(|t| match t {
            TransportInfo::Local { host, socket } => Some((host.as_str(), socket.as_str())),
            _ => None,
        })
    }

    /// The RDMA devices offered, in order, with their registration keys.
    pub fn rdma(&self) -> Vec<(&str, &[RdmaRegionInfo])> {
        self.transports
            .iter()
            .filter_map(|t| match t {
                TransportInfo::Rdma {
                    device, regions, ..
                } => Some((device.as_str(), regions.as_slice())),
                _ => None,
            })
            .collect()
    }
}

/// A control-plane message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Message {
    /// Reader to server, first message: who I am. Answered by `Descriptor` or `Error`.
    Hello {
        /// The reader's own descriptor (checked for compatibility by the server).
        descriptor: Box<Descriptor>,
        /// On engines without a key: a random id for this session, which the reader's TCP and
        /// same-host data requests name, so the server knows their reader (with a key, the
        /// data connections prove the session instead). `None` from keyed readers.
        #[serde(default)]
        session: Option<[u8; 16]>,
    },
    /// Reader to server, first message on engines with a deployment key: a fresh nonce.
    /// Answered by `AuthChallenge`, or `Error` (the server has no key).
    AuthHello {
        /// 32 random bytes.
        client_nonce: [u8; 32],
    },
    /// Server to reader: the server's nonce and its proof of the key over both nonces.
    AuthChallenge {
        /// 32 random bytes.
        server_nonce: [u8; 32],
        /// HMAC-SHA256 under the key of the server label and both nonces.
        server_proof: [u8; 32],
    },
    /// Reader to server, after a valid `AuthChallenge`: my proof of the key. Not answered; the
    /// reader's `Hello` follows, and is read only once the proof checks (so every frame before
    /// authentication is small).
    AuthProof {
        /// HMAC-SHA256 under the key of the client label and both nonces.
        client_proof: [u8; 32],
    },
    /// Server to reader: who I am.
    Descriptor(Box<Descriptor>),
    /// Reader to server, as a read of the request starts: I am reading it. Not answered; the
    /// server admits the reader to the request's hold (as a TCP read does), so the hold ends on
    /// the reader's lease if the reader goes away. Over RDMA nothing else tells the server who
    /// reads.
    Reading {
        /// The request.
        request_id: RequestId,
        /// The hold read (its token, from the transfer parameters), when the reader knows it.
        #[serde(default)]
        hold: Option<u64>,
    },
    /// Reader to server, as an RDMA read of the request is posted (instead of `Reading`): I am
    /// reading it; is it held for me now? Answered by `Confirm`. When held, the server also
    /// admits the reader (as `Reading` does) and pins the hold for `pin_us` from now: nothing
    /// ends it before then (not the engine's own release, nor a timeout or lease) but this
    /// reader's `Done`, `Received` or `Abort`. A read that completes within `pin_us` of sending
    /// its `Pin` was then held the whole time and counts as confirmed; its `Received` follows.
    /// Refused (and nothing pinned) when a `Done` would be, when the hold waits for
    /// several readers, when this reader pinned it before, or when `pin_us` is longer than the
    /// server pins.
    Pin {
        /// The request.
        request_id: RequestId,
        /// The hold read (its token, from the transfer parameters), when the reader knows it.
        #[serde(default)]
        hold: Option<u64>,
        /// How long the reader asks the hold to be pinned, in microseconds.
        pin_us: u64,
    },
    /// Reader to server: the request's blocks are all read; the server may free them.
    /// Answered by `Confirm`.
    Done {
        /// The request.
        request_id: RequestId,
        /// The hold read, when the reader knows it: only that hold is confirmed.
        #[serde(default)]
        hold: Option<u64>,
    },
    /// Reader to server: the request's blocks are all read, and the read is confirmed already
    /// (by a `Pin`, by the data response, or by the hold table of a same-host copy): as `Done`,
    /// the server may free them, but nothing is answered.
    Received {
        /// The request.
        request_id: RequestId,
        /// The hold read, when the reader knows it: only that hold is confirmed.
        #[serde(default)]
        hold: Option<u64>,
    },
    /// Server to reader, the answer to `Done` (and to `Pin`): whether the request was still
    /// held for this reader when the `Done` arrived (its blocks were then held for the whole
    /// read). Only then does the reader report the request received.
    Confirm {
        /// The request.
        request_id: RequestId,
        /// `None`: held, and the send is done; else why not (not held: expired, released, or
        /// held for other readers).
        refused: Option<String>,
        /// How long the request had been held when the `Done` arrived, in microseconds (0
        /// when refused): the reader's timeline shows it.
        #[serde(default)]
        held_us: u64,
    },
    /// Reader to server: the reader gave up on the request; the server may free its blocks.
    Abort {
        /// The request.
        request_id: RequestId,
        /// Why, for the server's logs and its failed list.
        reason: String,
        /// The hold given up, when the reader knows it: only that hold ends.
        #[serde(default)]
        hold: Option<u64>,
    },
    /// Reader to server, after the handshake: connect these queue pairs to yours. Answered by
    /// `RdmaAccept` or `Error`. The generation tells answers to old exchanges apart.
    RdmaConnect {
        /// The reader's session generation.
        generation: u64,
        /// Which of the server's RDMA devices (its `Rdma` transports, in descriptor order).
        device: u32,
        /// The reader's queue pairs.
        qps: Vec<QpEndpoint>,
    },
    /// Server to reader: my queue pairs, connected to yours and ready.
    RdmaAccept {
        /// The generation of the `RdmaConnect` answered.
        generation: u64,
        /// The server's queue pairs, one per reader queue pair.
        qps: Vec<QpEndpoint>,
    },
    /// Reader to server, after the handshake: bytes for the server engine's application
    /// (`Engine::send_message`), queued in its inbox (`Engine::take_messages`). Not answered;
    /// over [`MAX_MESSAGE_BYTES`](crate::inbox::MAX_MESSAGE_BYTES) it is dropped alone.
    AppMessage {
        /// The application's bytes.
        body: Body,
    },
    /// Reader to server: this session closes in order (it was idle past the reader's
    /// `session_idle`); nothing follows on the connection. Not answered. The reader is not
    /// gone: holds it is known to keep their abort timeouts rather than start its lease, and
    /// its next read opens a new session.
    Bye,
    /// Keep-alive probe.
    Ping {
        /// Echoed in the answer.
        nonce: u64,
    },
    /// Keep-alive answer.
    Pong {
        /// The probe's nonce.
        nonce: u64,
    },
    /// Reader to server: tell me of request `request_id`'s hold as its blocks are held (a
    /// progressive read); a request not held yet is waited for up to `wait_ms` (at most the
    /// server's own bound). Not answered at once: `Part`s follow as the prefill holds blocks,
    /// the last one sealed, or `Ended`.
    Follow {
        /// The request.
        request_id: RequestId,
        /// The hold followed, when the reader knows its token.
        #[serde(default)]
        hold: Option<u64>,
        /// How long to wait for a hold of the request, in milliseconds.
        wait_ms: u64,
    },
    /// Server to reader: blocks of a followed request's hold that are final. Per block group,
    /// `first` is the position of the part's first block among the hold's, `blocks` its ids in
    /// the prefill's order; `sealed`: the hold is complete, no part follows.
    Part {
        /// The request.
        request_id: RequestId,
        /// The hold's token: the reader's `Done` names it.
        token: u64,
        /// Per block group, where the part starts among the hold's blocks.
        first: Vec<u32>,
        /// Per block group, the part's block ids (none: the part adds tensors to the blocks
        /// of the part before).
        blocks: Vec<Vec<u32>>,
        /// The tensors the part makes final, `[start, end)`; `None`: all of them.
        #[serde(default)]
        tensors: Option<(u32, u32)>,
        /// The last part.
        sealed: bool,
    },
    /// Server to reader: a followed request's hold ended before the reader confirmed it
    /// (released, expired, aborted), or the follow was refused or not held in time.
    Ended {
        /// The request.
        request_id: RequestId,
        /// Why.
        reason: String,
    },
    /// The sender refuses the previous message; the connection closes after it.
    Error {
        /// What is wrong and what to do.
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RegionId;
    use crate::layout::ModelShape;

    fn descriptor(keys: Vec<RdmaRegionInfo>) -> Descriptor {
        let shape = ModelShape::LLAMA3_8B;
        let len = shape.region_bytes(4);
        Descriptor {
            protocol_version: crate::control::frame::PROTOCOL_VERSION,
            engine_id: "e".into(),
            generation: 1,
            tp_rank: 0,
            tp_size: 1,
            layout: shape.layout(RegionId(1), 4),
            regions: vec![
                RegionInfo {
                    id: RegionId(1),
                    len,
                },
                RegionInfo {
                    id: RegionId(2),
                    len: 4096,
                },
            ],
            transports: vec![
                TransportInfo::Tcp {
                    addr: "127.0.0.1:9".into(),
                    streams: 4,
                },
                TransportInfo::Rdma {
                    device: "rxe0".into(),
                    gid: [0; 16],
                    lid: 0,
                    mtu: 1024,
                    regions: keys,
                },
            ],
        }
    }

    fn keys(id: u32, len: u64) -> RdmaRegionInfo {
        RdmaRegionInfo {
            id: RegionId(id),
            addr: 1 << 30,
            chunk_bytes: len,
            rkeys: vec![7],
        }
    }

    #[test]
    fn rdma_keys_are_checked_once_per_region() {
        let len = ModelShape::LLAMA3_8B.region_bytes(4);
        descriptor(vec![keys(1, len), keys(2, 4096)])
            .validate()
            .unwrap();
        for (ks, want) in [
            (vec![keys(1, len), keys(1, len)], "listed twice"),
            (vec![keys(3, len)], "unknown"),
            (
                vec![keys(1, len), keys(2, 4096), keys(2, 4096)],
                "3 regions, 2 exported",
            ),
            (vec![keys(1, len / 2)], "does not cover"),
        ] {
            let e = descriptor(ks).validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e} should say {want:?}");
        }
    }
}
