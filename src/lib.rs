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

mod completion;
pub mod control;
mod engine;
mod error;
pub mod events;
pub mod gpu;
mod ids;
mod layout;
#[allow(unsafe_code)]
mod memory;
mod plan;
mod session;
pub mod transport;
pub mod verify;

pub use completion::{
    CompletionTracker, FailedRequest, Finished, SendNotice, Side, TpAggregator, TransferReport,
};
pub use control::messages::{Descriptor, TransportInfo};
pub use engine::{Capabilities, Engine, EngineConfig, EngineStats, TransportChoice};
pub use error::{Error, Result};
pub use gpu::{GpuApi, GpuReport, PointerKind};
pub use ids::{BlockId, RegionId, RequestId, MAX_REQUEST_ID_LEN};
pub use layout::{KvLayout, ModelShape, TensorLayout, MAX_TENSORS};
pub use memory::{DeviceMemory, ExternalMemory, MemoryKind, Region, RegionInfo};
pub use plan::{check_blocks, check_local_blocks, plan, Plan, PlanOptions, Segment};
