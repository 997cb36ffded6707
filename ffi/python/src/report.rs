//! What an engine reports to Python as dictionaries: its capabilities and its counters.

use kvlink_core::{Capabilities, EngineStats};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `{name: (available, detail)}` for `rdma`, `tcp`, `cuda` and `hip`.
pub(crate) fn capabilities_dict(py: Python<'_>, c: &Capabilities) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    let item = |r: &Result<String, String>| match r {
        Ok(s) => (true, s.clone()),
        Err(s) => (false, s.clone()),
    };
    d.set_item("rdma", item(&c.rdma))?;
    d.set_item("tcp", (true, c.tcp.clone()))?;
    d.set_item("cuda", item(&c.gpu.cuda))?;
    d.set_item("hip", item(&c.gpu.hip))?;
    Ok(d.unbind())
}

/// Every counter and gauge of `Engine.stats()`, by its field's name.
pub(crate) fn stats_dict(py: Python<'_>, s: &EngineStats) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("handshakes_accepted", s.handshakes_accepted)?;
    d.set_item("handshakes_refused", s.handshakes_refused)?;
    d.set_item("data_requests_served", s.data_requests_served)?;
    d.set_item("data_requests_refused", s.data_requests_refused)?;
    d.set_item("bytes_served", s.bytes_served)?;
    d.set_item("bytes_staged_out", s.bytes_staged_out)?;
    d.set_item("bytes_staged_in", s.bytes_staged_in)?;
    d.set_item("notices_refused", s.notices_refused)?;
    d.set_item("reads_pinned", s.reads_pinned)?;
    d.set_item("messages_received", s.messages_received)?;
    d.set_item("messages_refused", s.messages_refused)?;
    d.set_item("messages_sent", s.messages_sent)?;
    d.set_item("messages_unsent", s.messages_unsent)?;
    d.set_item("rdma_pairs_paused", s.rdma_pairs_paused)?;
    d.set_item("control_connections", s.control_connections)?;
    d.set_item("data_connections", s.data_connections)?;
    d.set_item("sessions", s.sessions)?;
    d.set_item("sessions_opened", s.sessions_opened)?;
    d.set_item("sessions_closed_idle", s.sessions_closed_idle)?;
    d.set_item("queue_pairs", s.queue_pairs)?;
    let t = &s.totals;
    d.set_item("reads_done", t.reads_done)?;
    d.set_item("reads_failed", t.reads_failed)?;
    d.set_item("reads_expired", t.reads_expired)?;
    d.set_item("reads_cancelled", t.reads_cancelled)?;
    d.set_item("bytes_read", t.bytes_read)?;
    d.set_item("sends_done", t.sends_done)?;
    d.set_item("sends_failed", t.sends_failed)?;
    d.set_item("sends_expired", t.sends_expired)?;
    d.set_item("sends_lease_expired", t.sends_lease_expired)?;
    Ok(d.unbind())
}
