//! The C ABI of kvlink.
//!
//! Every type C sees is either an opaque handle (`kvlink_engine`, `kvlink_messages`, `kvlink_finished`,
//! `kvlink_aggregator`, `kvlink_event_publisher`, `kvlink_event_batch`, always behind a pointer) or a `#[repr(C)]` struct whose layout is
//! asserted below. Every function that can fail returns a status (`KVLINK_OK` or a negative
//! `KVLINK_E_*` code) and leaves a message for [`kvlink_last_error`]; every body runs under
//! [`std::panic::catch_unwind`], so a panic becomes `KVLINK_E_INTERNAL` instead of unwinding into
//! C. Pointers are checked for NULL and alignment, strings for UTF-8, lengths for bounds.
//!
//! The header `include/kvlink.h` is generated from this file by cbindgen (see `cbindgen.toml`)
//! and checked in; `tests/header.rs` fails when it is stale. Doc comments on public items are
//! copied into the header, so they are written for C readers.

#![allow(unsafe_code, non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

// The modules are declared in the order of the C API: cbindgen emits functions in the order it
// reads them, so this is also their order in the header. (Blank lines keep rustfmt from sorting
// them.)

mod status;

mod guard;

mod args;

mod config;

mod handle;

mod engine;

mod layout;

mod tp;

mod progressive;

mod messages;

mod finished;

mod aggregator;

mod events;

#[cfg(test)]
mod tests;

// The handles are documented as usable from several threads at once.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<kvlink_engine>();
    shareable::<kvlink_finished>();
    shareable::<kvlink_aggregator>();
    shareable::<kvlink_event_publisher>();
    shareable::<kvlink_messages>();
};

pub use crate::aggregator::{
    kvlink_aggregator, kvlink_aggregator_free, kvlink_aggregator_new, kvlink_aggregator_report,
    kvlink_aggregator_take,
};
pub use crate::config::{kvlink_config, kvlink_config_default, KVLINK_CONFIG_SIZE};
pub use crate::engine::{
    kvlink_engine_allocate_host, kvlink_engine_capabilities, kvlink_engine_connect,
    kvlink_engine_deregister, kvlink_engine_free, kvlink_engine_handshake_address,
    kvlink_engine_hold_blocks, kvlink_engine_read_blocks, kvlink_engine_register_device,
    kvlink_engine_register_host, kvlink_engine_start, kvlink_engine_wait_finished,
};
pub use crate::events::{
    kvlink_event_batch, kvlink_event_batch_all_cleared, kvlink_event_batch_block_removed,
    kvlink_event_batch_block_stored, kvlink_event_batch_free, kvlink_event_batch_new,
    kvlink_event_publisher, kvlink_event_publisher_endpoint, kvlink_event_publisher_free,
    kvlink_event_publisher_publish, kvlink_event_publisher_start, kvlink_event_publisher_stats,
    kvlink_event_stats, KVLINK_EVENTS_CURRENT, KVLINK_EVENTS_LEGACY,
};
pub use crate::finished::{
    kvlink_finished, kvlink_finished_add, kvlink_finished_add_failed, kvlink_finished_count,
    kvlink_finished_expired, kvlink_finished_free, kvlink_finished_id, kvlink_finished_new,
    kvlink_finished_reason, kvlink_finished_report_peer, kvlink_finished_side,
};
pub use crate::guard::{kvlink_last_error, kvlink_version};
pub use crate::handle::kvlink_engine;
pub use crate::layout::{kvlink_engine_set_layout, kvlink_tensor};
pub use crate::messages::{
    kvlink_engine_send_message, kvlink_engine_take_messages, kvlink_messages,
    kvlink_messages_count, kvlink_messages_free, kvlink_messages_get,
};
pub use crate::status::{
    KVLINK_ADDRESS_MAX, KVLINK_E_CONNECTION, KVLINK_E_GPU, KVLINK_E_INCOMPATIBLE,
    KVLINK_E_INTERNAL, KVLINK_E_INVALID, KVLINK_E_IO, KVLINK_E_MEMORY, KVLINK_E_RDMA,
    KVLINK_E_SHUTDOWN, KVLINK_E_TIMEOUT, KVLINK_FAILED, KVLINK_MESSAGE_MAX, KVLINK_OK,
    KVLINK_RECEIVING, KVLINK_SENDING, KVLINK_SIDE_RECV, KVLINK_SIDE_SEND, KVLINK_TIMEOUT_MAX_MS,
    KVLINK_TRANSPORT_AUTO, KVLINK_TRANSPORT_RDMA, KVLINK_TRANSPORT_TCP,
};
pub use crate::tp::{kvlink_engine_hold_groups, kvlink_engine_read, kvlink_tp_sources};
