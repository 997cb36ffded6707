//! Python bindings of kvlink: the worker lifecycle of a disaggregated KV connector.
//!
//! Thin by design: every call forwards to `kvlink::Engine` or `kvlink::TpAggregator`. Blocking
//! calls release the GIL; no Rust thread ever calls into Python; Rust errors become exceptions
//! of the `KvlinkError` family whose messages say what to do.

mod aggregator;
mod buffers;
mod convert;
mod detach;
mod engine;
mod error;
mod events;
mod report;

use pyo3::prelude::*;

use crate::aggregator::{Finished, TpAggregator};
use crate::engine::Engine;
use crate::error::{
    IncompatiblePeer, InvalidArgument, KvlinkError, KvlinkTimeout, PeerError, RdmaUnavailable,
};
use crate::events::{EventIndex, EventMerger, EventPublisher, EventSubscriber, PageSplitter};

/// kvlink's native core (`kvlink._kvlink`), re-exported by the `kvlink` package: moves LLM
/// KV-cache blocks between inference engines.
#[pymodule]
fn _kvlink(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<TpAggregator>()?;
    m.add_class::<Finished>()?;
    m.add_class::<EventPublisher>()?;
    m.add_class::<EventSubscriber>()?;
    m.add_class::<EventMerger>()?;
    m.add_class::<PageSplitter>()?;
    m.add_class::<EventIndex>()?;
    m.add("KvlinkError", py.get_type::<KvlinkError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("KvlinkTimeout", py.get_type::<KvlinkTimeout>())?;
    m.add("IncompatiblePeer", py.get_type::<IncompatiblePeer>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("RdmaUnavailable", py.get_type::<RdmaUnavailable>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The names `Engine(transport=...)` accepts, for connectors that check a setting early.
    let transports: Vec<&str> = kvlink_core::TransportChoice::ALL
        .iter()
        .map(|t| t.as_str())
        .collect();
    m.add("TRANSPORTS", pyo3::types::PyTuple::new(py, transports)?)?;
    m.add_function(wrap_pyfunction!(tp_sources, m)?)?;
    // Before the interpreter finalizes, threads waiting in kvlink stop coming back (detach.rs).
    let exiting = wrap_pyfunction!(detach::exiting, m)?;
    py.import("atexit")?.call_method1("register", (exiting,))?;
    Ok(())
}

/// tp_sources(decode_rank, decode_size, prefill_size) -> list[int]
///
/// The prefill ranks that rank `decode_rank` of a decode's TP group of `decode_size` reads from
/// a prefill of `prefill_size` ranks (what `read_blocks` with the prefill's address list reads):
/// one rank when the decode is the same size or larger, `prefill_size / decode_size` when it is
/// smaller. Raises `InvalidArgument` when neither size is a multiple of the other.
#[pyfunction]
fn tp_sources(decode_rank: u32, decode_size: u32, prefill_size: u32) -> PyResult<Vec<u32>> {
    kvlink_core::tp_sources(
        kvlink_core::TpRank::new(decode_rank, decode_size),
        prefill_size,
    )
    .map(|r| r.collect())
    .map_err(crate::error::to_py)
}
