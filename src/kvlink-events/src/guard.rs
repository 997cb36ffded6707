//! A ZMTP frame guard between an untrusted network peer and a `zeromq` socket.
//!
//! The `zeromq` crate reserves memory for a whole frame as soon as it reads the frame's length
//! header, and buffers every frame of a multipart message, with no limit: eight bytes from any
//! peer announcing a frame of 2^40 bytes abort the process. The KV-event publisher lives inside
//! inference engines and listens on the network, so its bound sockets never face peers
//! directly: [`front`] accepts each TCP connection and relays it to the real socket, which
//! listens on a Unix socket in a private (0700) directory. (Sockets that connect out reach a
//! peer the configuration chose, and are not relayed; see docs/architecture.md.)
//!
//! Bytes from the untrusted side are parsed as ZMTP 3 (64-byte greeting, then frames) and the
//! connection is cut, with a warning naming the peer, when the greeting does not arrive in time,
//! a frame header has reserved bits set, or a frame or multipart message exceeds its limit.
//! Bytes toward the untrusted side are relayed as they are.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::future::Future;
use std::net::SocketAddr;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::error::{PeerError, ZmtpError};

const GREETING: usize = 64;
const RELAY_BUFFER: usize = 256 * 1024;

/// What the untrusted side may send.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Largest frame body, in bytes.
    pub max_frame: u64,
    /// Largest multipart message, in bytes over all its frames.
    pub max_message: u64,
    /// Most frames in one multipart message.
    pub max_frames: u32,
    /// Time allowed for the 64-byte greeting (and for dialling, on the connect side).
    pub handshake: Duration,
    /// Most relayed connections at once (beyond that, new ones are closed at once).
    pub max_connections: usize,
    /// Most messages (not commands) a peer may send over one connection: subscriptions and
    /// replay requests are few, and the `zeromq` crate keeps every subscription.
    pub max_messages: u64,
    /// A peer that takes nothing relayed toward it for this long is cut off, so that a dead or
    /// stalled peer does not pin the socket's queue for it.
    pub stall: Duration,
}

#[derive(Debug)]
enum State {
    Greeting(usize),
    Flags,
    Length {
        long: bool,
        more: bool,
        command: bool,
        got: usize,
        buf: [u8; 8],
    },
    Body {
        left: u64,
    },
}

/// Incremental check of a ZMTP 3 byte stream.
#[derive(Debug)]
pub(crate) struct Check {
    limits: Limits,
    state: State,
    frames: u32,
    message: u64,
    messages: u64,
}

impl Check {
    pub(crate) fn new(limits: Limits) -> Check {
        Check {
            limits,
            state: State::Greeting(0),
            frames: 0,
            message: 0,
            messages: 0,
        }
    }

    /// Whether the greeting has been seen whole.
    pub(crate) fn greeted(&self) -> bool {
        !matches!(self.state, State::Greeting(_))
    }

    /// Checks the next bytes of the stream.
    // Long: one state machine over a byte stream that splits anywhere (greeting, flags, length,
    //   body); each state's step reads and sets the counters the others check.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) -> Result<(), ZmtpError> {
        while !bytes.is_empty() {
            match &mut self.state {
                State::Greeting(seen) => {
                    if *seen == 0 && bytes[0] != 0xFF {
                        return Err(ZmtpError::NotAGreeting);
                    }
                    let take = (GREETING - *seen).min(bytes.len());
                    *seen += take;
                    bytes = &bytes[take..];
                    if *seen == GREETING {
                        self.state = State::Flags;
                    }
                }
                State::Flags => {
                    let f = bytes[0];
                    bytes = &bytes[1..];
                    if f & !0x07 != 0 {
                        return Err(ZmtpError::ReservedFlags(f));
                    }
                    self.state = State::Length {
                        long: f & 0x02 != 0,
                        more: f & 0x01 != 0,
                        command: f & 0x04 != 0,
                        got: 0,
                        buf: [0; 8],
                    };
                }
                State::Length {
                    long,
                    more,
                    command,
                    got,
                    buf,
                } => {
                    let need = if *long { 8 } else { 1 };
                    let take = (need - *got).min(bytes.len());
                    buf[*got..*got + take].copy_from_slice(&bytes[..take]);
                    *got += take;
                    bytes = &bytes[take..];
                    if *got < need {
                        continue;
                    }
                    let len = if *long {
                        u64::from_be_bytes(*buf)
                    } else {
                        u64::from(buf[0])
                    };
                    if len > self.limits.max_frame {
                        return Err(ZmtpError::FrameOverLimit {
                            len,
                            max: self.limits.max_frame,
                        });
                    }
                    if !*command {
                        self.frames += 1;
                        self.message += len;
                        if self.frames > self.limits.max_frames {
                            return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
                        }
                        if self.message > self.limits.max_message {
                            return Err(ZmtpError::MessageOverLimit(self.limits.max_message));
                        }
                        if !*more {
                            self.frames = 0;
                            self.message = 0;
                            self.messages += 1;
                            if self.messages > self.limits.max_messages {
                                return Err(ZmtpError::TooManyMessages(self.limits.max_messages));
                            }
                        }
                    }
                    self.state = if len == 0 {
                        State::Flags
                    } else {
                        State::Body { left: len }
                    };
                }
                State::Body { left } => {
                    let take = (*left).min(bytes.len() as u64);
                    *left -= take;
                    bytes = &bytes[take as usize..];
                    if *left == 0 {
                        self.state = State::Flags;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A private directory for the relays' Unix sockets, removed on drop.
#[derive(Debug)]
pub(crate) struct PrivateDir(PathBuf);

impl PrivateDir {
    /// Creates a fresh directory with an unpredictable name (never reusing an existing path).
    pub(crate) fn new() -> io::Result<PrivateDir> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mut last = None;
        for _ in 0..16 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let salt = std::collections::hash_map::RandomState::new();
            let mut h = std::hash::BuildHasher::build_hasher(&salt);
            std::hash::Hasher::write_u64(&mut h, nanos ^ NEXT.fetch_add(1, Ordering::Relaxed));
            let dir = std::env::temp_dir().join(format!(
                "kvlink-zmq-{}-{:016x}",
                std::process::id(),
                std::hash::Hasher::finish(&h)
            ));
            match std::fs::DirBuilder::new().mode_private().create(&dir) {
                Ok(()) => return Ok(PrivateDir(dir)),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no private directory")))
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

trait PrivateBuilder {
    fn mode_private(&mut self) -> &mut Self;
}

impl PrivateBuilder for std::fs::DirBuilder {
    fn mode_private(&mut self) -> &mut Self {
        use std::os::unix::fs::DirBuilderExt;
        self.mode(0o700)
    }
}

/// The `ipc://` endpoint of a Unix socket path.
pub(crate) fn ipc_endpoint(path: &Path) -> String {
    format!("ipc://{}", path.display())
}

/// Relays one connection: `untrusted` bytes are checked on their way to `trusted`; the other
/// direction is copied as is. Returns when either side closes or the check fails.
async fn relay<U, T>(untrusted: U, trusted: T, limits: Limits, peer: &str)
where
    U: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ur, mut uw) = tokio::io::split(untrusted);
    let (mut tr, mut tw) = tokio::io::split(trusted);
    let inbound = async {
        let mut check = Check::new(limits);
        let mut buf = vec![0u8; RELAY_BUFFER];
        let greeting_deadline = tokio::time::Instant::now() + limits.handshake;
        loop {
            let n = if check.greeted() {
                ur.read(&mut buf).await
            } else {
                match tokio::time::timeout_at(greeting_deadline, ur.read(&mut buf)).await {
                    Ok(r) => r,
                    Err(_) => return Err(PeerError::Handshake(limits.handshake)),
                }
            }?;
            if n == 0 {
                return Ok(());
            }
            check.feed(&buf[..n])?;
            tw.write_all(&buf[..n]).await?;
        }
    };
    let outbound = async {
        let mut buf = vec![0u8; RELAY_BUFFER];
        loop {
            let n = tr.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), io::Error>(());
            }
            tokio::time::timeout(limits.stall, uw.write_all(&buf[..n]))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "peer stalled"))??;
        }
    };
    tokio::select! {
        r = inbound => if let Err(why) = r {
            tracing::warn!(peer, "ZeroMQ connection closed: {why}");
        },
        r = outbound => if let Err(e) = r {
            if e.kind() == io::ErrorKind::TimedOut {
                tracing::warn!(peer, "ZeroMQ peer took nothing for {:?}; connection closed", limits.stall);
            }
        },
    }
}

/// Accepts TCP connections on `listener` for ever, at most `max_connections` served at once
/// (beyond that, new ones are closed at once), each served by the task `serve` makes for it.
/// Shared by the relay below and the publisher's own PUB side.
pub(crate) async fn accept_limited<F, Fut>(
    listener: TcpListener,
    max_connections: usize,
    mut serve: F,
) where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max_connections));
    loop {
        let (tcp, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("accept on the KV-event endpoint failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(peer = %addr, "too many ZeroMQ connections; closing this one");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let task = serve(tcp, addr);
        tokio::spawn(async move {
            let _slot = slot;
            task.await
        });
    }
}

/// Accepts TCP connections on `listener` and relays each, checked, to the Unix socket at
/// `backend` (where the real `zeromq` socket listens). The task ends when aborted.
pub(crate) fn front(listener: TcpListener, backend: PathBuf, limits: Limits) -> JoinHandle<()> {
    tokio::spawn(accept_limited(
        listener,
        limits.max_connections,
        move |tcp, addr| {
            let backend = backend.clone();
            async move {
                match UnixStream::connect(&backend).await {
                    Ok(unix) => relay(tcp, unix, limits, &addr.to_string()).await,
                    // The socket is gone while the publisher shuts down.
                    Err(e) => tracing::debug!("relay to the local ZeroMQ socket failed: {e}"),
                }
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_frame: 100,
            max_message: 150,
            max_frames: 3,
            handshake: Duration::from_secs(1),
            max_connections: 4,
            max_messages: 2,
            stall: Duration::from_secs(1),
        }
    }

    fn greeting() -> Vec<u8> {
        let mut g = vec![0u8; 64];
        g[0] = 0xFF;
        g[9] = 0x7F;
        g
    }

    #[test]
    fn frames_within_limits_pass_byte_by_byte() {
        let mut s = greeting();
        s.extend([0x04, 5, b'R', b'E', b'A', b'D', b'Y']); // short command
        s.extend([0x01, 2, b'h', b'i']); // frame with MORE
        s.push(0x02); // long final frame of 100 bytes
        s.extend(100u64.to_be_bytes());
        s.extend([7u8; 100]);
        s.extend([0x00, 0]); // empty frame
        let mut c = Check::new(limits());
        for b in &s {
            c.feed(std::slice::from_ref(b)).unwrap();
        }
        assert!(c.greeted());
    }

    #[test]
    fn hostile_headers_are_refused() {
        let mut huge = greeting();
        huge.push(0x02);
        huge.extend((1u64 << 40).to_be_bytes());
        assert!(matches!(
            Check::new(limits()).feed(&huge),
            Err(ZmtpError::FrameOverLimit { len, .. }) if len == 1 << 40
        ));

        let mut reserved = greeting();
        reserved.push(0x80);
        assert_eq!(
            Check::new(limits()).feed(&reserved),
            Err(ZmtpError::ReservedFlags(0x80))
        );

        let mut many = greeting();
        for _ in 0..4 {
            many.extend([0x01, 0]);
        }
        assert!(matches!(
            Check::new(limits()).feed(&many),
            Err(ZmtpError::TooManyFrames(_))
        ));

        let mut big_message = greeting();
        big_message.extend([0x01, 90]);
        big_message.extend([0u8; 90]);
        big_message.extend([0x00, 90]);
        assert!(matches!(
            Check::new(limits()).feed(&big_message),
            Err(ZmtpError::MessageOverLimit(_))
        ));

        assert_eq!(
            Check::new(limits()).feed(b"GET / HTTP/1.1"),
            Err(ZmtpError::NotAGreeting)
        );

        let mut chatty = greeting();
        for _ in 0..3 {
            chatty.extend([0x00, 1, 1]);
        }
        assert!(matches!(
            Check::new(limits()).feed(&chatty),
            Err(ZmtpError::TooManyMessages(_))
        ));
    }
}
