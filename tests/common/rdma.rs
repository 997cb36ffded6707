//! The RDMA tests' device check and engine settings.

use kvlink::internal::probe_rdma as probe;
use kvlink::{EngineConfig, RdmaSettings, TransportChoice};

use super::quick_config;

/// True when an RDMA device is usable; otherwise says why the test is skipped (or fails inside
/// the VM, where the device must exist).
pub fn rdma_available() -> bool {
    let settings = RdmaSettings {
        device: std::env::var("KVLINK_RDMA_DEVICE").ok(),
        ..RdmaSettings::default()
    };
    match probe(&settings) {
        Ok(_) => true,
        Err(why) => {
            if std::env::var_os("KVLINK_SOFTROCE").is_some() {
                panic!("inside the SoftRoCE VM but RDMA is unavailable: {why}");
            }
            super::skip("no RDMA device", &why);
            false
        }
    }
}

pub fn rdma_config() -> EngineConfig {
    let mut c = quick_config();
    c.transport = TransportChoice::Rdma;
    c.rdma.device = std::env::var("KVLINK_RDMA_DEVICE").ok();
    c.rdma.qps = 2;
    // A handshake creates queue pairs, which the VM's two emulated CPUs do slowly when its host
    // is busy (500 ms, the TCP fault tests' deadline, was once exceeded).
    c.handshake_timeout = std::time::Duration::from_secs(5);
    c.keepalive = VM_KEEPALIVE;
    c
}

/// Keep-alive of the RDMA tests' control connections (dead after three silent intervals). The
/// host tests' 1 s made a control connection look dead in a VM whose host ran other work (its
/// boot took twice as long): three seconds without a keep-alive from its two emulated CPUs. The
/// engine's default: no RDMA test waits on a dead peer being noticed.
pub const VM_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(5);
