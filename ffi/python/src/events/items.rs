//! Subscriber items as Python dicts.

use kvlink_core::events::{EventBatch, KvEvent, Resync, SubItem};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::event_to_py;

fn events_to_py<'py>(py: Python<'py>, events: &[KvEvent]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for e in events {
        out.append(event_to_py(py, e)?)?;
    }
    Ok(out)
}

/// A batch's `ts`, `dp_rank` and `events`, into `d`.
fn batch_fields(py: Python<'_>, d: &Bound<'_, PyDict>, b: &EventBatch) -> PyResult<()> {
    d.set_item("ts", b.ts)?;
    d.set_item("dp_rank", b.dp_rank)?;
    d.set_item("events", events_to_py(py, &b.events)?)
}

/// One item as the dict `EventSubscriber` yields (kinds `batch`, `malformed`, `resync`,
/// `gap_filled`, `snapshot`).
pub(super) fn item_to_py<'py>(py: Python<'py>, item: &SubItem) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match item {
        SubItem::Batch {
            seq,
            batch,
            skipped,
            topic,
            ..
        } => {
            d.set_item("kind", "batch")?;
            d.set_item("seq", *seq)?;
            d.set_item("topic", String::from_utf8_lossy(topic))?;
            batch_fields(py, &d, batch)?;
            d.set_item(
                "skipped",
                skipped.iter().map(ToString::to_string).collect::<Vec<_>>(),
            )?;
        }
        SubItem::Malformed { seq, reason } => {
            d.set_item("kind", "malformed")?;
            d.set_item("seq", *seq)?;
            d.set_item("reason", reason.to_string())?;
        }
        SubItem::Resync(Resync::PublisherRestart { last, now }) => {
            d.set_item("kind", "resync")?;
            d.set_item("reason", "publisher_restart")?;
            d.set_item("last", *last)?;
            d.set_item("now", *now)?;
        }
        SubItem::GapFilled { from, through } => {
            d.set_item("kind", "gap_filled")?;
            d.set_item("from", *from)?;
            d.set_item("through", *through)?;
        }
        SubItem::Snapshot {
            seq,
            batches,
            skipped,
            topic,
        } => {
            d.set_item("kind", "snapshot")?;
            d.set_item("seq", *seq)?;
            d.set_item("topic", String::from_utf8_lossy(topic))?;
            let out = PyList::empty(py);
            for b in batches {
                let bd = PyDict::new(py);
                batch_fields(py, &bd, b)?;
                out.append(bd)?;
            }
            d.set_item("batches", out)?;
            d.set_item(
                "skipped",
                skipped.iter().map(ToString::to_string).collect::<Vec<_>>(),
            )?;
        }
        SubItem::Resync(Resync::HistoryLost { from, resumed }) => {
            d.set_item("kind", "resync")?;
            d.set_item("reason", "history_lost")?;
            d.set_item("from", *from)?;
            d.set_item("resumed", *resumed)?;
        }
    }
    Ok(d)
}
