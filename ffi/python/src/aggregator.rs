//! Finished sets (the `Finished` class and its conversions) and the `TpAggregator` class that
//! combines them across tensor-parallel ranks.

use std::time::Instant;

use kvlink_core::{Finished as RsFinished, RequestId, Side, TpAggregator as RsAggregator};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::convert::{request_id, seconds};
use crate::error::{to_py, InvalidArgument};

/// What finished since the last call: `sending`, `receiving` (request ids), `failed`
/// (tuples `(request_id, side, expired, reason)`, side `"send"` or `"recv"`), `failures`
/// (the same entries as dicts with a `cause` too: `expired`, `peer`, `connection`, `rdma`,
/// `gpu`, `cancelled` or `other`) and `reports` (one dict per request in `receiving`: `id`,
/// `peer`, `bytes`, `segments`, `blocks`, `work_requests`, `transport`, `seconds`).
#[pyclass(module = "kvlink", frozen, get_all)]
pub(crate) struct Finished {
    sending: Py<PyList>,
    receiving: Py<PyList>,
    failed: Py<PyList>,
    failures: Py<PyList>,
    reports: Py<PyList>,
}

#[pymethods]
impl Finished {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Finished(sending={}, receiving={}, failed={})",
            self.sending.bind(py).len(),
            self.receiving.bind(py).len(),
            self.failed.bind(py).len()
        )
    }

    /// True when nothing finished.
    fn is_empty(&self, py: Python<'_>) -> bool {
        self.sending.bind(py).is_empty()
            && self.receiving.bind(py).is_empty()
            && self.failed.bind(py).is_empty()
    }
}

pub(crate) fn finished_to_py(py: Python<'_>, f: &RsFinished) -> PyResult<Finished> {
    let ids = |v: &[RequestId]| PyList::new(py, v.iter().map(|i| i.as_str()));
    let failed = PyList::empty(py);
    let failures = PyList::empty(py);
    for fr in &f.failed {
        let side = match fr.side {
            Side::Send => "send",
            Side::Recv => "recv",
        };
        failed.append(PyTuple::new(
            py,
            [
                fr.id.as_str().into_pyobject(py)?.into_any(),
                side.into_pyobject(py)?.into_any(),
                pyo3::types::PyBool::new(py, fr.expired)
                    .to_owned()
                    .into_any(),
                fr.reason.as_str().into_pyobject(py)?.into_any(),
            ],
        )?)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("id", fr.id.as_str())?;
        d.set_item("side", side)?;
        d.set_item("expired", fr.expired)?;
        d.set_item("reason", fr.reason.as_str())?;
        d.set_item("cause", fr.cause.name())?;
        failures.append(d)?;
    }
    let reports = PyList::empty(py);
    for r in &f.reports {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("id", r.id.as_str())?;
        d.set_item("peer", r.peer.as_str())?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("segments", r.segments)?;
        d.set_item("blocks", r.blocks)?;
        d.set_item("work_requests", r.work_requests)?;
        d.set_item("transport", r.transport)?;
        d.set_item("seconds", r.elapsed.as_secs_f64())?;
        let t = &r.timeline;
        let timeline = pyo3::types::PyDict::new(py);
        for (k, v) in [
            ("held", t.held),
            ("connected", t.connected),
            ("first_byte", t.first_byte),
            ("last_byte", t.last_byte),
            ("confirmed", t.confirmed),
        ] {
            timeline.set_item(k, v.map(|d| d.as_secs_f64()))?;
        }
        d.set_item("timeline", timeline)?;
        reports.append(d)?;
    }
    Ok(Finished {
        sending: ids(&f.sending)?.unbind(),
        receiving: ids(&f.receiving)?.unbind(),
        failed: failed.unbind(),
        failures: failures.unbind(),
        reports: reports.unbind(),
    })
}

fn finished_from_py(obj: &Bound<'_, PyAny>) -> PyResult<RsFinished> {
    let get = |name: &str| -> PyResult<Bound<'_, PyAny>> { obj.getattr(name) };
    let mut f = RsFinished::default();
    for id in get("sending")?.try_iter()? {
        f.sending.push(request_id(&id?)?);
    }
    for id in get("receiving")?.try_iter()? {
        f.receiving.push(request_id(&id?)?);
    }
    for item in get("failed")?.try_iter()? {
        let (id, side, expired, reason): (Bound<'_, PyAny>, String, bool, String) =
            item?.extract()?;
        let side = match side.as_str() {
            "send" => Side::Send,
            "recv" => Side::Recv,
            s => {
                return Err(InvalidArgument::new_err(format!(
                    "side must be 'send' or 'recv', got {s:?}"
                )))
            }
        };
        f.failed.push(kvlink_core::FailedRequest {
            id: request_id(&id)?,
            side,
            expired,
            reason,
            cause: if expired {
                kvlink_core::FailureCause::Expired
            } else {
                kvlink_core::FailureCause::Other
            },
        });
    }
    Ok(f)
}

/// Combines the finished sets of `world_size` TP ranks for the scheduler: a request is released
/// once every rank reported it, failed if any rank failed, and failed after `rank_timeout`
/// seconds if some rank never reports.
#[pyclass(module = "kvlink")]
pub(crate) struct TpAggregator {
    inner: RsAggregator,
}

#[pymethods]
impl TpAggregator {
    #[new]
    #[pyo3(signature = (world_size, rank_timeout = 60.0))]
    fn new(world_size: usize, rank_timeout: f64) -> PyResult<Self> {
        Ok(TpAggregator {
            inner: RsAggregator::new(world_size, seconds("rank_timeout", rank_timeout)?)
                .map_err(to_py)?,
        })
    }

    /// Takes one rank's Finished (as returned by Engine.get_finished()).
    fn add(&mut self, rank: usize, finished: &Bound<'_, PyAny>) -> PyResult<()> {
        let f = finished_from_py(finished)?;
        self.inner
            .handle_report(rank, &f, Instant::now())
            .map_err(to_py)
    }

    /// Requests released since the last call (finished on every rank, or failed).
    fn take(&mut self, py: Python<'_>) -> PyResult<Finished> {
        self.inner.poll(Instant::now());
        let f = self.inner.take_finished();
        finished_to_py(py, &f)
    }

    /// Requests some but not all ranks have reported.
    #[getter]
    fn pending(&self) -> usize {
        self.inner.pending()
    }
}
