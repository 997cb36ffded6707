//! kvlink moves LLM KV-cache blocks between inference engines and streams their KV-cache events.
//!
//! Each engine worker process (one per tensor-parallel rank) starts an [`Engine`], registers its
//! KV-cache memory and sets its [`KvLayout`]. A prefill worker hands its
//! [`handshake_address`](Engine::handshake_address) to the decode side with each request and
//! [`hold_blocks`](Engine::hold_blocks) until it is read; a decode worker calls
//! [`read_blocks`](Engine::read_blocks) with the blocks it needs. Both poll
//! [`get_finished`](Engine::get_finished); the scheduler combines ranks with [`TpAggregator`].
//!
//! ```no_run
//! use kvlink::{Engine, EngineConfig, ModelShape};
//! let shape = ModelShape::LLAMA3_8B;
//! let decode = Engine::start(EngineConfig::default())?;
//! let region = decode.allocate_host(shape.region_bytes(1024), false)?;
//! decode.set_layout(shape.layout(region.id(), 1024))?;
//! decode.read_blocks("10.0.0.5:7400", "req-1", &[4, 5, 6], &[90, 17, 33])?;
//! let finished = decode.wait_finished(std::time::Duration::from_secs(5));
//! # Ok::<(), kvlink::Error>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

// Layers, top to bottom: a module imports only from layers below its own (from its own layer
// only where tools/check_layers.py's SAME_LAYER_OK says). check_layers reads this list and
// checks every import against it; docs/architecture.md draws it.
//   verify > engine > session > state > control > config > transport > completion
//   > plan, layout, grant > memory > auth > error > gpu > holds > shm
//   > accept > conn_limit, log_limit, ids, tp, inbox
// The KV events are a crate of their own (src/kvlink-events).
mod accept;
mod auth;
mod completion;
mod config;
mod conn_limit;
mod control;
mod engine;
mod error;
/// KV-cache events: the `kvlink-events` crate (`src/kvlink-events`), re-exported.
#[cfg(feature = "events")]
#[doc(inline)]
pub use kvlink_events as events;
mod gpu;
mod grant;
#[allow(unsafe_code)]
mod holds;
mod ids;
mod inbox;
mod layout;
mod log_limit;
#[allow(unsafe_code)]
mod memory;
mod plan;
mod session;
#[allow(unsafe_code)]
mod shm;
mod state;
mod tp;
mod transport;
pub mod verify;

pub use auth::{AuthKey, MIN_KEY_BYTES};
pub use completion::{
    FailedRequest, FailureCause, Finished, Side, Timeline, Totals, TpAggregator, TransferReport,
};
pub use config::{EngineConfig, TransportChoice, MAX_PIN_READ_BYTES};
pub use control::messages::{Descriptor, TransportInfo};
pub use engine::{
    tp_sources, Capabilities, Engine, EngineStats, FollowRequest, HoldRequest, ReadFrom,
    ReadRequest, SessionState,
};
pub use error::{wc_status, Error, RdmaError, RdmaErrorKind, Refusal, RefusalKind, Result};
pub use gpu::{GpuApi, GpuError, GpuReport, PointerKind};
pub use ids::{BlockId, RegionId, RequestId, MAX_REQUEST_ID_LEN};
pub use inbox::{PeerMessage, MAX_MESSAGE_BYTES};
pub use layout::{
    HeadSplit, KvLayout, ModelShape, TensorLayout, TokenShape, MAX_GROUPS, MAX_TENSORS,
};
pub use memory::{DeviceMemory, ExternalMemory, MemoryKind, Region, RegionInfo};
pub use tp::{TpError, TpRank};
pub use transport::rdma::RdmaSettings;

/// Internals for kvlink's own tests, benchmarks, fuzzing and bindings: the planner, the
/// completion tracker, the wire formats of the control and data planes, the RDMA probe and
/// fault injection. Not part of the stable API.
#[doc(hidden)]
pub mod internal {
    pub use crate::completion::{
        Announcement, CompletionTracker, Follower, HoldTerms, Release, SendNotice,
    };
    pub use crate::config::{check_duration, MAX_DURATION};
    pub use crate::control::{frame, messages};
    pub use crate::grant::Grant;
    pub use crate::inbox::Body as MessageBody;

    pub use crate::plan::{
        check_blocks, check_local_blocks, plan, plan_read, plan_read_from, resizes, tensor_reads,
        whole_reads, Plan, PlanOptions, Resize, Segment, TensorRead,
    };
    pub use crate::tp::{heads, heads_per_rank, readers, reads, sources, Reader, Relation};
    pub use crate::transport::rdma::{RdmaFault, RdmaRegionInfo};
    pub use crate::transport::tcp::wire as tcp_wire;

    use crate::{Engine, EngineConfig, ExternalMemory, RdmaSettings, Region, Result};

    /// Opens the RDMA devices `settings` name (or the first usable one) and returns their
    /// names, comma-separated, or says why none can be used.
    // A String error kept: a test helper's report (device names, or why none).
    pub fn probe_rdma(settings: &RdmaSettings) -> std::result::Result<String, String> {
        crate::transport::rdma::probe(settings)
            .map(|d| {
                d.iter()
                    .map(|d| d.name().to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .map_err(|e| e.to_string())
    }

    /// Registers host memory with `engine` as emulated device memory: every transfer into or
    /// out of it takes the device paths (TCP staging, device RDMA registration) with `memcpy`
    /// as the "GPU" copy. For tests of those paths on machines without a GPU.
    pub fn register_emulated_device(
        engine: &Engine,
        mem: ExternalMemory,
    ) -> Result<std::sync::Arc<Region>> {
        engine.register_emulated_device(mem)
    }

    /// Starts an engine whose RDMA connections inject `fault` (tests of the RDMA error paths).
    pub fn start_with_rdma_fault(config: EngineConfig, fault: RdmaFault) -> Result<Engine> {
        Engine::start_with_rdma_fault(config, fault)
    }
}
