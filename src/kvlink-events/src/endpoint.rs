//! ZeroMQ endpoint conventions of vLLM's KV-event publisher, so that a configuration written
//! for vLLM means the same to kvlink:
//! - bind when the endpoint contains `*` or `::` or is `ipc://`, connect otherwise;
//! - data-parallel rank `r` adds `r` to a tcp port, and appends `_dp{r}` to an ipc path.
//!
//! `inproc://` has no meaning across the Rust/Python boundary here (the `zeromq` crate has no
//! inproc transport) and is refused with a clear error.

use std::net::{SocketAddr, ToSocketAddrs};

use super::error::EventsError;

/// Whether a socket binds (listens) or connects to its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attach {
    /// Listen at the endpoint.
    Bind,
    /// Dial the endpoint (which someone else binds).
    Connect,
}

/// An endpoint after vLLM's rules were applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedEndpoint {
    /// The endpoint to use, with the data-parallel offset applied (`*` kept as given).
    pub endpoint: String,
    /// Bind or connect.
    pub attach: Attach,
}

/// Applies vLLM's endpoint rules for data-parallel rank `dp_rank`.
pub fn resolve(endpoint: &str, dp_rank: u32) -> Result<ResolvedEndpoint, EventsError> {
    let bad = |why: &str| EventsError::Endpoint(format!("{endpoint:?}: {why}"));
    let attach =
        if endpoint.contains('*') || endpoint.contains("::") || endpoint.starts_with("ipc://") {
            Attach::Bind
        } else {
            Attach::Connect
        };
    let endpoint = if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| bad("a tcp endpoint needs host:port"))?;
        let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
        if host.is_empty() {
            return Err(bad("the host is empty (use * to listen on every address)"));
        }
        let port = if dp_rank == 0 {
            port
        } else {
            u16::try_from(u32::from(port) + dp_rank)
                .ok()
                .filter(|_| port != 0)
                .ok_or_else(|| {
                    bad(&format!(
                        "data-parallel rank {dp_rank} needs a fixed port whose offset stays below 65536"
                    ))
                })?
        };
        format!("tcp://{host}:{port}")
    } else if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(bad("the ipc path is empty"));
        }
        if dp_rank == 0 {
            endpoint.to_string()
        } else {
            format!("{endpoint}_dp{dp_rank}")
        }
    } else if endpoint.starts_with("inproc://") {
        return Err(bad(
            "inproc endpoints are not supported (no inproc transport in this process); use ipc:// or tcp://",
        ));
    } else {
        return Err(bad("expected tcp://host:port or ipc://path"));
    };
    Ok(ResolvedEndpoint { endpoint, attach })
}

/// The socket address a bound tcp endpoint listens on: `*` means every IPv4 address, `[::]`
/// or `::` every IPv6 address; names are resolved.
pub(crate) fn tcp_listen_addr(endpoint: &str) -> Result<SocketAddr, EventsError> {
    let bad = |why: String| EventsError::Endpoint(format!("{endpoint:?}: {why}"));
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| bad("not a tcp endpoint".into()))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("needs host:port".into()))?;
    let port: u16 = port
        .parse()
        .map_err(|_| bad("the port is not a number".into()))?;
    let host = match host {
        "*" | "0.0.0.0" => "0.0.0.0",
        "[::]" | "::" | "[*]" => "::",
        h => h.trim_start_matches('[').trim_end_matches(']'),
    };
    (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(format!("cannot resolve: {e}")))?
        .next()
        .ok_or_else(|| bad("resolves to no address".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_rules() {
        let r = resolve("tcp://*:5557", 0).unwrap();
        assert_eq!(
            (r.endpoint.as_str(), r.attach),
            ("tcp://*:5557", Attach::Bind)
        );
        let r = resolve("tcp://*:5557", 3).unwrap();
        assert_eq!(r.endpoint, "tcp://*:5560");
        let r = resolve("tcp://router.local:6000", 1).unwrap();
        assert_eq!(
            (r.endpoint.as_str(), r.attach),
            ("tcp://router.local:6001", Attach::Connect)
        );
        assert_eq!(resolve("tcp://[::]:7", 0).unwrap().attach, Attach::Bind);
        let r = resolve("ipc:///tmp/kv", 2).unwrap();
        assert_eq!(
            (r.endpoint.as_str(), r.attach),
            ("ipc:///tmp/kv_dp2", Attach::Bind)
        );
        for bad in [
            "inproc://x",
            "udp://x:1",
            "tcp://x",
            "tcp://:5",
            "tcp://h:99999",
            "ipc://",
        ] {
            assert!(resolve(bad, 0).is_err(), "{bad}");
        }
        assert!(resolve("tcp://*:65535", 1).is_err(), "port overflow");
        assert!(
            resolve("tcp://*:0", 1).is_err(),
            "ephemeral port with a rank offset"
        );
        assert_eq!(
            tcp_listen_addr("tcp://*:5557").unwrap(),
            "0.0.0.0:5557".parse().unwrap()
        );
        assert_eq!(
            tcp_listen_addr("tcp://[::]:1").unwrap(),
            "[::]:1".parse().unwrap()
        );
    }
}
