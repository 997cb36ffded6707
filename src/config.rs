//! How an engine is set up: [`EngineConfig`] and [`TransportChoice`], with the checks
//! [`EngineConfig::validate`] runs before an engine starts. A leaf of the crate: every layer may
//! read the configuration, none is imported here but the transports' own settings.

use std::time::Duration;

use crate::auth::AuthKey;
use crate::error::{Error, Result};
use crate::transport::rdma::RdmaSettings;
use crate::transport::stream::frame::MAX_REQUEST_BYTES;

/// Which transport an engine may use for reading from peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// The same-host path when both engines share a host and this engine's memory can be
    /// shared; else RDMA when both engines have it; else TCP (logged per peer, with the
    /// reason).
    #[default]
    Auto,
    /// TCP only; RDMA is not even probed.
    Tcp,
    /// RDMA only: the engine fails to start without a usable device, and a read from a peer
    /// without RDMA fails with `Error::RdmaUnavailable`.
    Rdma,
    /// The same-host path only: a read from a peer on another host, or into memory that
    /// cannot be shared, fails with the reason. RDMA is not probed.
    Local,
    /// The network paths only: RDMA when both engines have it, else TCP (and TCP when every
    /// RDMA device fails), never the same-host path, even towards an engine of this host.
    Network,
}

impl TransportChoice {
    /// Every choice, in the order the documentation lists them.
    pub const ALL: [TransportChoice; 5] = [
        TransportChoice::Auto,
        TransportChoice::Network,
        TransportChoice::Tcp,
        TransportChoice::Rdma,
        TransportChoice::Local,
    ];

    /// The choice's name, as settings, command lines and messages spell it (`auto`,
    /// `network`, `tcp`, `rdma`, `local`); [`str::parse`] reads it back.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Network => "network",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Rdma => "rdma",
            TransportChoice::Local => "local",
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = Error;

    /// A choice by its name (exactly as [`TransportChoice::as_str`] writes it);
    /// `Error::InvalidArgument` naming every choice otherwise.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "transport must be auto, network, tcp, rdma or local, got {s:?}"
                ))
            })
    }
}

/// The longest duration any setting accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long a session stays open unused unless configured otherwise
/// ([`EngineConfig::session_idle`]).
pub(crate) const DEFAULT_SESSION_IDLE: Duration = Duration::from_secs(120);
/// Default of [`EngineConfig::spin`]: about what a small read takes over TCP on one host.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Longest [`EngineConfig::spin`].
const MAX_SPIN: Duration = Duration::from_millis(10);
/// Default of [`EngineConfig::read_pin`].
pub(crate) const DEFAULT_READ_PIN: Duration = Duration::from_millis(20);
/// Longest [`EngineConfig::read_pin`]: the longest a holder's `release` may wait for a pin.
const MAX_READ_PIN: Duration = Duration::from_secs(10);
/// Largest RDMA read from one prefill that asks for a pin ([`EngineConfig::read_pin`]): its
/// confirmation's round trip is a small part of a larger read's time.
pub const MAX_PIN_READ_BYTES: u64 = 16 << 20;

/// How an engine is set up. `EngineConfig::default()` listens on loopback with ephemeral ports.
///
/// The struct is `#[non_exhaustive]`: settings are added without breaking callers, so outside
/// this crate a config is built from the defaults, never with a struct literal:
///
/// ```
/// use std::time::Duration;
/// let config = kvlink::EngineConfig::default().with(|c| {
///     c.listen = "0.0.0.0:7400".into();
///     c.tp_rank = 1;
///     c.tp_size = 2;
///     c.request_timeout = Duration::from_secs(30);
/// });
/// assert_eq!(config.tp_size, 2);
/// // or field by field:
/// let mut config = kvlink::EngineConfig::default();
/// config.transport = kvlink::TransportChoice::Tcp;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Handshake (control) listen address, `ip:port`; port 0 picks a free one.
    pub listen: String,
    /// Host or IP that peers should use to reach this engine, when `listen` is a wildcard
    /// address such as `0.0.0.0`.
    pub advertise_host: Option<String>,
    /// Engine id (1 to 256 bytes): what peers know this engine by, and the reader name grants
    /// use. Defaults to `<hostname>-<pid>-rank<tp_rank>-<8 random hex digits>`.
    pub engine_id: Option<String>,
    /// Tensor-parallel rank of this worker.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// TCP streams opened to each peer for data.
    pub tcp_streams: u16,
    /// Bytes per pipelined TCP read request (also the largest planned segment).
    pub batch_bytes: u64,
    /// Deadline of a TCP connect.
    pub connect_timeout: Duration,
    /// Deadline of a handshake exchange.
    pub handshake_timeout: Duration,
    /// Deadline of a whole `read_blocks` request, from the call to the last byte.
    pub request_timeout: Duration,
    /// How long a send is held for its reader before it expires (prefill side): the bound for
    /// a reader that never comes.
    pub abort_timeout: Duration,
    /// How long a send stays held once its reader is gone (prefill side): a reader engine
    /// that had control sessions to this engine and lost them all (closed, or silent for three
    /// keep-alive intervals) and does not connect again within the lease has its holds end
    /// then, rather than at `abort_timeout`.
    pub lease: Duration,
    /// Longest silence tolerated on a data stream with a request outstanding; also bounds each
    /// GPU staging copy, the wait for a staging buffer, and the wait for a copy in progress when
    /// a request is cancelled.
    pub io_timeout: Duration,
    /// Keep-alive interval of control connections (dead after three silent intervals).
    pub keepalive: Duration,
    /// How long the data server keeps a data stream open with no request on it (readers
    /// reconnect after; a stream serving a request is never idle).
    pub idle_timeout: Duration,
    /// How long a session to a peer (its control connection, and its TCP streams or RDMA
    /// queue pairs) stays open with no read or message using it. Past that it closes in order:
    /// the peer is told, so its holds for this engine keep their abort timeouts, and the next
    /// read or message to that peer opens a new session (one handshake). Bounds what an engine
    /// holds to the peers it used within this time, whatever the fleet size. Zero keeps
    /// sessions open until they break.
    pub session_idle: Duration,
    /// Worker threads of the engine's runtime.
    pub runtime_threads: usize,
    /// How long a caller waiting for reads in flight (`wait_finished`) polls before it
    /// sleeps: a read that finishes meanwhile is seen without a thread wake-up (a few
    /// microseconds each). Polled only while reads are in flight, yielding the CPU between
    /// looks; zero never polls. At most 10 ms. An RDMA read of one chain of work requests
    /// also polls its completion queue itself for up to this long before it waits for the
    /// device's poller thread, and a TCP read of one batch polls its stream's socket, receiving
    /// its response there, before it waits for the stream's reader task. A TCP data connection
    /// of the serving engine polls its socket for as long after each request for the reader's
    /// next (one connection of the process at a time) before it sleeps.
    pub spin: Duration,
    /// RDMA reads confirmed without a round trip after them. As a reader: an RDMA read of up
    /// to [`MAX_PIN_READ_BYTES`](crate::MAX_PIN_READ_BYTES) per prefill asks the prefill, as
    /// it posts, to pin the hold for this long, and counts as confirmed when the answer says
    /// held and its reads completed within this long of the ask (else it sends its `Done` and
    /// waits for the answer, as larger reads do). As a holder: the longest pin granted (a
    /// longer ask is refused); `release` of a pinned hold waits until the pin lapses or its
    /// reader's `Done` or `Abort` arrives. Zero: no pins asked or granted. At most 10 s;
    /// 20 ms by default (a small read over a NIC takes microseconds).
    pub read_pin: Duration,
    /// Transports to use.
    pub transport: TransportChoice,
    /// RDMA device, GID and queue-pair settings.
    pub rdma: RdmaSettings,
    /// Whether to look for GPU runtimes (CUDA, HIP) at start. Without them only host memory can
    /// be registered; `false` skips loading the libraries.
    pub gpu: bool,
    /// Bytes per staging buffer: GPU memory sent or received over TCP moves through pinned host
    /// buffers of this size, one chunk copied while the previous one is on the wire.
    pub staging_chunk_bytes: u64,
    /// The deployment key peers must prove (HMAC-SHA256 challenge-response on the control
    /// plane; data connections bound to the authenticated session). `None` reads
    /// `KVLINK_AUTH_KEY` or `KVLINK_AUTH_KEY_FILE` at start; without either the engine
    /// authenticates nobody and, unless `insecure`, listens on loopback only.
    pub auth_key: Option<AuthKey>,
    /// Allows listening beyond loopback without a key (logged as a warning at start). Also set
    /// by `KVLINK_INSECURE=1`.
    pub insecure: bool,
    /// Most staging buffers the engine's data server uses to send GPU memory (one pool shared
    /// by all the connections it serves); allocated on first use and kept. Each stream that
    /// reads GPU memory from a peer has two more of its own. 1 to 4,096; `staging_chunk_bytes`
    /// is 4 KiB to 256 MiB.
    pub staging_buffers: usize,
    /// Serves any byte of exported memory to any (authenticated) reader, with no hold: for
    /// benchmarks and debugging only. Off (the default), the TCP data server serves a read only
    /// inside the blocks the engine holds for the request it names (`hold_blocks`), to that
    /// request's reader.
    pub open_reads: bool,
    /// Most control connections, and separately most data connections, one IP address may have
    /// open at once (1 to 4,096; 4,096 is the total of each); more are closed at accept, so one
    /// address cannot lock out another.
    pub max_connections_per_ip: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: "127.0.0.1:0".into(),
            advertise_host: None,
            engine_id: None,
            tp_rank: 0,
            tp_size: 1,
            tcp_streams: 4,
            batch_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(480),
            lease: crate::completion::DEFAULT_LEASE,
            io_timeout: Duration::from_secs(30),
            keepalive: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            session_idle: DEFAULT_SESSION_IDLE,
            runtime_threads: 2,
            spin: DEFAULT_SPIN,
            read_pin: DEFAULT_READ_PIN,
            transport: TransportChoice::Auto,
            rdma: RdmaSettings::default(),
            gpu: true,
            staging_chunk_bytes: 2 << 20,
            staging_buffers: 32,
            auth_key: None,
            insecure: false,
            open_reads: false,
            max_connections_per_ip: 256,
        }
    }
}

/// Checks an engine id as peers do: 1 to 256 bytes. `what` names it in the error.
pub(crate) fn check_engine_id(what: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > 256 {
        return Err(Error::invalid(format!(
            "{what} must be 1 to 256 bytes, got {}",
            id.len()
        )));
    }
    Ok(())
}

impl EngineConfig {
    /// This config with `set` applied to it: the way to change some settings of the defaults
    /// in one expression (see the type's docs).
    #[must_use]
    pub fn with(mut self, set: impl FnOnce(&mut Self)) -> Self {
        set(&mut self);
        self
    }

    /// Checks every setting against its documented range; the error names the first one out of
    /// range. [`Engine::start`](crate::Engine::start) runs it first.
    pub fn validate(&self) -> Result<()> {
        if let Some(id) = &self.engine_id {
            // Peers refuse a descriptor whose id is empty or longer (every handshake would fail).
            check_engine_id("engine_id", id)?;
        }
        if !(1..=4096).contains(&self.max_connections_per_ip) {
            return Err(Error::invalid("max_connections_per_ip must be 1 to 4096"));
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return Err(Error::invalid(format!(
                "tp_rank {} must be below tp_size {}",
                self.tp_rank, self.tp_size
            )));
        }
        let durations = [
            ("connect_timeout", self.connect_timeout),
            ("handshake_timeout", self.handshake_timeout),
            ("request_timeout", self.request_timeout),
            ("abort_timeout", self.abort_timeout),
            ("lease", self.lease),
            ("io_timeout", self.io_timeout),
            ("keepalive", self.keepalive),
            ("idle_timeout", self.idle_timeout),
        ];
        for (name, d) in durations {
            check_duration(name, d)?;
        }
        if self.session_idle > MAX_DURATION {
            return Err(Error::invalid(format!(
                "session_idle must be at most 7 days (zero: never closed), got {:?}",
                self.session_idle
            )));
        }
        let r = &self.rdma;
        if r.qps == 0 || r.qps > 64 {
            return Err(Error::invalid("rdma.qps must be 1 to 64"));
        }
        if !(4096..=1 << 30).contains(&r.max_wr_bytes) || r.max_mr_bytes < 4096 {
            return Err(Error::invalid(
                "rdma.max_wr_bytes must be 4 KiB to 1 GiB and rdma.max_mr_bytes at least 4 KiB",
            ));
        }
        if r.gid_index.is_some_and(|g| g > 255) {
            return Err(Error::invalid("rdma.gid_index must be below 256"));
        }
        if self.tcp_streams == 0 || self.tcp_streams > 64 {
            return Err(Error::invalid("tcp_streams must be 1 to 64"));
        }
        if self.spin > MAX_SPIN {
            return Err(Error::invalid(format!(
                "spin must be at most {MAX_SPIN:?}, got {:?}",
                self.spin
            )));
        }
        if self.read_pin > MAX_READ_PIN {
            return Err(Error::invalid(format!(
                "read_pin must be at most {MAX_READ_PIN:?}, got {:?}",
                self.read_pin
            )));
        }
        if !(4096..=256 << 20).contains(&self.staging_chunk_bytes)
            || self.staging_buffers == 0
            || self.staging_buffers > 4096
        {
            return Err(Error::invalid(
                "staging_chunk_bytes must be 4 KiB to 256 MiB and staging_buffers 1 to 4096",
            ));
        }
        if self.batch_bytes == 0 || self.batch_bytes > MAX_REQUEST_BYTES {
            return Err(Error::invalid(format!(
                "batch_bytes must be 1 to {}",
                MAX_REQUEST_BYTES
            )));
        }
        Ok(())
    }
}

/// Refuses a zero duration or one over [`MAX_DURATION`] (7 days), naming the setting. The
/// bindings check their duration arguments with it too.
pub fn check_duration(name: &str, d: Duration) -> Result<()> {
    if d.is_zero() || d > MAX_DURATION {
        return Err(Error::invalid(format!(
            "{name} must be between 0 and 7 days, got {d:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_names_read_back() {
        for c in TransportChoice::ALL {
            assert_eq!(c.to_string().parse::<TransportChoice>().unwrap(), c);
        }
        for bad in ["", "TCP", "rdma ", "ipc"] {
            let e = bad.parse::<TransportChoice>().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
        }
    }

    #[test]
    fn default_is_valid() {
        EngineConfig::default().validate().unwrap();
        let never = EngineConfig {
            session_idle: Duration::ZERO,
            ..EngineConfig::default()
        };
        never.validate().expect("zero: sessions never closed idle");
    }

    #[test]
    fn each_range_is_checked_and_named() {
        type Change = fn(&mut EngineConfig);
        let bad: Vec<(Change, &str)> = vec![
            (|c| c.tp_rank = 1, "tp_rank 1 must be below tp_size 1"),
            (|c| c.tp_size = 0, "tp_size 0"),
            (|c| c.request_timeout = Duration::ZERO, "request_timeout"),
            (|c| c.keepalive = MAX_DURATION * 2, "keepalive"),
            (|c| c.session_idle = MAX_DURATION * 2, "session_idle"),
            (|c| c.rdma.qps = 65, "rdma.qps"),
            (|c| c.rdma.max_wr_bytes = 100, "rdma.max_wr_bytes"),
            (|c| c.rdma.gid_index = Some(256), "rdma.gid_index"),
            (|c| c.tcp_streams = 0, "tcp_streams"),
            (|c| c.spin = Duration::from_secs(1), "spin"),
            (|c| c.read_pin = Duration::from_secs(11), "read_pin"),
            (|c| c.staging_buffers = 0, "staging_buffers"),
            (|c| c.batch_bytes = 0, "batch_bytes"),
            (|c| c.engine_id = Some(String::new()), "engine_id"),
            (|c| c.engine_id = Some("e".repeat(257)), "engine_id"),
        ];
        for (change, name) in bad {
            let mut c = EngineConfig::default();
            change(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{e:?} should name {name:?}");
        }
    }
}
