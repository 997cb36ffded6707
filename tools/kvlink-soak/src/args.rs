//! A soak worker's command line: its engine's settings and its cache.

use std::time::Duration;

use kvlink::{AuthKey, EngineConfig, TransportChoice};

pub const USAGE: &str = "\
usage: kvlink-soak [options]   (commands on stdin, events on stdout: tools/soak/README.md)

options:
  --listen ADDR          handshake listen address                       [127.0.0.1:0]
  --engine-id ID         the engine's id                                [generated]
  --transport T          auto, network, tcp, rdma or local              [auto]
  --rdma-device LIST     RDMA devices, comma-separated                  [first active]
  --qps N                RDMA queue pairs per device pair               [2]
  --streams N            TCP streams per peer                           [2]
  --key KEY              deployment key (at least 16 bytes)             [none: loopback only]
  --blocks N             blocks in the cache                            [64]
  --layers N             layers of the model (K and V each)             [4]
  --token-bytes N        bytes per token of each tensor                 [512]
  --groups N             block groups (1 or 2; odd layers in group 1)   [2]
  --keepalive-ms N       control keep-alive interval                    [500]
  --lease-ms N           a hold's lease once its reader is gone         [3000]
  --handshake-ms N       handshake deadline                             [2000]
  --connect-ms N         connect deadline                               [2000]
  --request-ms N         read deadline                                  [10000]
  --abort-ms N           hold deadline                                  [20000]
  --io-ms N              TCP I/O deadline                               [3000]
  --idle-ms N            idle TCP data stream closed after              [5000]
  --session-idle-ms N    idle session closed after (0: never)           [120000]
  --cooldown-ms N        pause of a failed RDMA device pair             [3000]
";

/// What the command line says.
#[derive(Debug, Clone)]
pub struct Options {
    /// The engine's settings.
    pub config: EngineConfig,
    /// Blocks in the cache.
    pub blocks: u32,
    /// Layers of the model.
    pub layers: u32,
    /// Bytes per token per tensor.
    pub token_bytes: u64,
    /// Block groups.
    pub groups: u32,
}

/// The soak's defaults: short timeouts, so that every fault plays out within seconds.
fn defaults() -> Options {
    let ms = Duration::from_millis;
    let mut config = EngineConfig::default().with(|c| {
        c.transport = TransportChoice::Auto;
        c.tcp_streams = 2;
        c.keepalive = ms(500);
        c.lease = ms(3000);
        c.handshake_timeout = ms(2000);
        c.connect_timeout = ms(2000);
        c.request_timeout = ms(10_000);
        c.abort_timeout = ms(20_000);
        c.io_timeout = ms(3000);
        c.idle_timeout = ms(5000);
        c.runtime_threads = 1;
        c.gpu = false;
    });
    config.rdma.qps = 2;
    config.rdma.cooldown = ms(3000);
    Options {
        config,
        blocks: 64,
        layers: 4,
        token_bytes: 512,
        groups: 2,
    }
}

/// Parses `args` (without the program name); `Ok(None)` for `--help`.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Options>, String> {
    use lexopt::prelude::*;
    let mut o = defaults();
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        let Long(name) = arg else {
            return Err(format!("unexpected argument {:?}", arg.unexpected()));
        };
        let name = name.to_string();
        if name == "help" {
            return Ok(None);
        }
        let value: String = p
            .value()
            .map_err(|e| e.to_string())?
            .string()
            .map_err(|e| format!("--{name}: {e:?}"))?;
        set(&mut o, &name, &value)?;
    }
    o.config.validate().map_err(|e| e.to_string())?;
    if o.groups == 0 || o.groups > 2 {
        return Err(format!("--groups {}: 1 or 2", o.groups));
    }
    Ok(Some(o))
}

/// Applies one option.
fn set(o: &mut Options, name: &str, v: &str) -> Result<(), String> {
    let num = || v.parse::<u64>().map_err(|e| format!("--{name} {v}: {e}"));
    let ms = || num().map(Duration::from_millis);
    let c = &mut o.config;
    match name {
        "listen" => c.listen = v.to_string(),
        "engine-id" => c.engine_id = Some(v.to_string()),
        "transport" => c.transport = v.parse().map_err(|e| format!("--transport: {e}"))?,
        "rdma-device" => c.rdma.device = Some(v.to_string()),
        "qps" => c.rdma.qps = narrow(num()?, name)?,
        "streams" => c.tcp_streams = narrow(num()?, name)?,
        "key" => c.auth_key = Some(AuthKey::new(v.as_bytes()).map_err(|e| e.to_string())?),
        "blocks" => o.blocks = narrow(num()?, name)?,
        "layers" => o.layers = narrow(num()?, name)?,
        "token-bytes" => o.token_bytes = num()?,
        "groups" => o.groups = narrow(num()?, name)?,
        "keepalive-ms" => c.keepalive = ms()?,
        "lease-ms" => c.lease = ms()?,
        "handshake-ms" => c.handshake_timeout = ms()?,
        "connect-ms" => c.connect_timeout = ms()?,
        "request-ms" => c.request_timeout = ms()?,
        "abort-ms" => c.abort_timeout = ms()?,
        "io-ms" => c.io_timeout = ms()?,
        "idle-ms" => c.idle_timeout = ms()?,
        "session-idle-ms" => c.session_idle = ms()?,
        "cooldown-ms" => c.rdma.cooldown = ms()?,
        _ => return Err(format!("unknown option --{name}")),
    }
    Ok(())
}

/// `n` as a smaller integer, or an error naming the option.
fn narrow<T: TryFrom<u64>>(n: u64, name: &str) -> Result<T, String> {
    T::try_from(n).map_err(|_| format!("--{name} {n}: too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<Option<Options>, String> {
        parse(s.split_whitespace().map(String::from))
    }

    #[test]
    fn defaults_are_short_and_valid() {
        let o = args("").unwrap().unwrap();
        assert_eq!(o.config.lease, Duration::from_secs(3));
        assert_eq!((o.blocks, o.layers, o.groups), (64, 4, 2));
        assert!(args("--help").unwrap().is_none());
    }

    #[test]
    fn options_land_where_they_belong() {
        let o = args(
            "--transport tcp --engine-id d0 --blocks 32 --lease-ms 1500 --qps 3 \
             --session-idle-ms 0 \
             --key 0123456789abcdef0123 --rdma-device rxe0,rxe1 --groups 1",
        )
        .unwrap()
        .unwrap();
        assert_eq!(o.config.transport, TransportChoice::Tcp);
        assert_eq!(o.config.engine_id.as_deref(), Some("d0"));
        assert_eq!((o.blocks, o.groups, o.config.rdma.qps), (32, 1, 3));
        assert_eq!(o.config.lease, Duration::from_millis(1500));
        assert_eq!(o.config.session_idle, Duration::ZERO);
        assert!(o.config.auth_key.is_some());
        assert_eq!(o.config.rdma.device.as_deref(), Some("rxe0,rxe1"));
    }

    #[test]
    fn mistakes_are_refused_with_the_option_named() {
        assert!(args("--blocks many").unwrap_err().contains("--blocks"));
        assert!(args("--frobnicate 1").unwrap_err().contains("frobnicate"));
        assert!(args("--key short").is_err(), "a key under 16 bytes");
        assert!(args("--groups 3").unwrap_err().contains("--groups"));
        assert!(args("--qps 70000").unwrap_err().contains("too large"));
        assert!(args("stray").is_err());
    }
}
