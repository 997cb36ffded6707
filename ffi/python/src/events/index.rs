//! `EventIndex`: a router's index of which engine holds which KV blocks (`kvlink_events::Index`),
//! fed the items of `EventSubscriber`s or an `EventMerger` (or event lists), and the prefix
//! overlap it answers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvlink_core::events::{
    EventBatch, HolderKey, HolderState, Index, IndexConfig, Overlap, Resync, Salt,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::fields::{event_from_py, hash_of};
use crate::error::InvalidArgument;

/// EventIndex(*, max_blocks=16777216, max_holders=65536)
///
/// Which engine holds which KV blocks, per holder (engine, DP rank, medium, KV-cache group), from
/// their event streams; `overlap_tokens` and `overlap_hashes` answer how many of a prompt's
/// leading blocks each holder has. A holder's state is `exact`, `recovering` (events were
/// lost: blocks known from before are withheld from answers) or `stale` (marked down: nothing
/// counts); a publisher restart drops the engine's blocks. Stores past the limits are dropped
/// and counted.
#[pyclass(module = "kvlink", frozen)]
pub(crate) struct EventIndex {
    inner: Mutex<Index>,
    /// Per holder, a dict of its key's fields that answers copy (its names are not made into
    /// Python strings again per answer); the holder's `Arc` is kept with it, so that its
    /// address, the map's key, is never another holder's while cached.
    names: Mutex<Names>,
}

/// Cached answer dicts by holder address (see `EventIndex::names`).
type Names = HashMap<usize, (Arc<HolderKey>, Py<PyDict>)>;

/// Holders whose answer dicts are cached at most (the cache starts over past it).
const NAMES_CACHED: usize = 1 << 17;

impl EventIndex {
    /// An answer: per match, a copy of its holder's cached dict with its state, blocks and
    /// tokens.
    fn overlap_to_py<'py>(&self, py: Python<'py>, o: &Overlap) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let mut names = self.names.lock().expect("names lock");
        if names.len() > NAMES_CACHED {
            names.clear();
        }
        for m in &o.matches {
            let ptr = Arc::as_ptr(&m.holder) as usize;
            let d = match names.get(&ptr) {
                Some((_, d)) => d.bind(py).copy()?,
                None => {
                    let d = key_to_py(py, &m.holder)?;
                    names.insert(ptr, (m.holder.clone(), d.clone().unbind()));
                    d.copy()?
                }
            };
            d.set_item(intern!(py, "state"), state_to_py(py, m.state))?;
            d.set_item(intern!(py, "blocks"), m.blocks)?;
            d.set_item(intern!(py, "tokens"), m.tokens)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Loads a snapshot item: the engine's blocks become the snapshot's, exact again (a loss
    /// too when it skipped events).
    fn load_snapshot(&self, engine: &str, item: &Bound<'_, PyDict>) -> PyResult<()> {
        let parts = item
            .get_item("batches")?
            .ok_or_else(|| InvalidArgument::new_err("a snapshot without \"batches\""))?;
        let mut batches = Vec::new();
        for part in parts.try_iter()? {
            let part = part?;
            let events = part.get_item("events")?;
            let dp_rank: Option<i64> = part.get_item("dp_rank")?.extract()?;
            batches.push(batch_of(&events, dp_rank)?);
        }
        let skipped = item.get_item("skipped")?;
        let lost = skipped.is_some_and(|s| s.len().unwrap_or(0) > 0);
        self.with(|ix| {
            ix.load_snapshot(engine, &batches);
            if lost {
                ix.lose(engine);
            }
        });
        Ok(())
    }

    fn with<T>(&self, f: impl FnOnce(&mut Index) -> T) -> T {
        f(&mut self.inner.lock().expect("index lock"))
    }
}

#[pymethods]
impl EventIndex {
    #[new]
    #[pyo3(signature = (*, max_blocks = 1 << 24, max_holders = 1 << 16))]
    fn new(max_blocks: usize, max_holders: usize) -> Self {
        let config = IndexConfig {
            max_blocks,
            max_holders,
        };
        EventIndex {
            inner: Mutex::new(Index::new(config)),
            names: Mutex::default(),
        }
    }

    /// Applies one item of engine `engine`'s subscriber (a dict as `EventSubscriber` yields):
    /// a batch (a loss too when it skipped events), a malformed batch (a loss), a resync (a
    /// publisher restart drops the engine's blocks; lost history withholds them), a snapshot
    /// (the engine's blocks replaced by it, exact).
    fn apply(&self, engine: &str, item: &Bound<'_, PyDict>) -> PyResult<()> {
        let kind: String = item
            .get_item("kind")?
            .ok_or_else(|| InvalidArgument::new_err("an item without \"kind\""))?
            .extract()?;
        match kind.as_str() {
            "batch" => {
                let events = item
                    .get_item("events")?
                    .ok_or_else(|| InvalidArgument::new_err("a batch without \"events\""))?;
                let dp_rank: Option<i64> = match item.get_item("dp_rank")? {
                    Some(v) => v.extract()?,
                    None => None,
                };
                self.apply_events(engine, &events, dp_rank)?;
                let skipped = item.get_item("skipped")?;
                if skipped.is_some_and(|s| s.len().unwrap_or(0) > 0) {
                    self.with(|ix| ix.lose(engine));
                }
            }
            "malformed" => self.with(|ix| ix.lose(engine)),
            "resync" => {
                let reason: String = item
                    .get_item("reason")?
                    .map(|r| r.extract())
                    .transpose()?
                    .unwrap_or_default();
                let why = match reason.as_str() {
                    "publisher_restart" => Resync::PublisherRestart { last: 0, now: 0 },
                    _ => Resync::HistoryLost {
                        from: 0,
                        resumed: 0,
                    },
                };
                self.with(|ix| ix.resync(engine, &why));
            }
            "gap_filled" => {}
            "snapshot" => self.load_snapshot(engine, item)?,
            other => {
                return Err(InvalidArgument::new_err(format!(
                    "an item of unknown kind {other:?}"
                )))
            }
        }
        Ok(())
    }

    /// Applies a list of events (dicts, or vLLM's and SGLang's event objects) of engine
    /// `engine`, DP rank `dp_rank`, as one batch.
    #[pyo3(signature = (engine, events, dp_rank = None))]
    fn apply_events(
        &self,
        engine: &str,
        events: &Bound<'_, PyAny>,
        dp_rank: Option<i64>,
    ) -> PyResult<()> {
        let batch = batch_of(events, dp_rank)?;
        self.with(|ix| ix.apply_batch(engine, &batch));
        Ok(())
    }

    /// The holders of the leading full blocks of `tokens` (blocks of `block_size` tokens,
    /// hashed from the LoRA adapter and cache salt given), most blocks first: a list of dicts
    /// `{"engine", "dp_rank", "medium", "group", "blocks", "tokens", "state"}`.
    #[pyo3(signature = (tokens, block_size, *, lora_id = None, lora_name = None,
        cache_salt = None))]
    fn overlap_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        lora_name: Option<String>,
        cache_salt: Option<String>,
    ) -> PyResult<Bound<'py, PyList>> {
        let salt = Salt {
            lora_id,
            lora_name,
            cache_salt,
        };
        // Microseconds of work: the GIL is kept (releasing and taking it back would cost
        // about as much); no path holds the index's lock while it waits for the GIL.
        let o = self.with(|ix| ix.overlap_tokens(&tokens, block_size, &salt));
        self.overlap_to_py(py, &o)
    }

    /// The holders of the leading blocks named by the engines' own block hashes (ints, as the
    /// events carry them), most blocks first; dicts as `overlap_tokens` gives.
    fn overlap_hashes<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = hashes
            .try_iter()?
            .map(|h| hash_of(&h?, "hashes").map(|h| h.as_u64()))
            .collect::<PyResult<Vec<u64>>>()?;
        let o = self.with(|ix| ix.overlap_hashes(&keys));
        self.overlap_to_py(py, &o)
    }

    /// Marks engine `engine`'s stream down (`True`: nothing of it counts) or up again
    /// (`False`: what it held is withheld, as after a loss).
    fn set_stale(&self, engine: &str, stale: bool) {
        self.with(|ix| ix.set_stale(engine, stale));
    }

    /// Forgets engine `engine`.
    fn remove_engine(&self, engine: &str) {
        self.with(|ix| ix.remove_engine(engine));
    }

    /// Every holder: dicts `{"engine", "dp_rank", "medium", "group", "state", "blocks",
    /// "withheld"}`.
    fn holders<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let all = self.with(|ix| ix.holders());
        let out = PyList::empty(py);
        for (key, state, blocks, withheld) in all {
            let d = holder_to_py(py, &key, state)?;
            d.set_item("blocks", blocks)?;
            d.set_item("withheld", withheld)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Counters: `blocks`, `holders`, `stored`, `removed`, `unknown_removed`, `unknown_parent`,
    /// `dropped`, `losses`, `restarts`, `snapshots`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(|ix| ix.stats());
        let d = PyDict::new(py);
        d.set_item("blocks", s.blocks)?;
        d.set_item("holders", s.holders)?;
        d.set_item("stored", s.stored)?;
        d.set_item("removed", s.removed)?;
        d.set_item("unknown_removed", s.unknown_removed)?;
        d.set_item("unknown_parent", s.unknown_parent)?;
        d.set_item("dropped", s.dropped)?;
        d.set_item("losses", s.losses)?;
        d.set_item("restarts", s.restarts)?;
        d.set_item("snapshots", s.snapshots)?;
        Ok(d)
    }
}

fn key_to_py<'py>(py: Python<'py>, key: &HolderKey) -> PyResult<Bound<'py, PyDict>> {
    // Interned keys: an answer lists every holder of a prompt's first block.
    let d = PyDict::new(py);
    d.set_item(intern!(py, "engine"), &key.engine)?;
    d.set_item(intern!(py, "dp_rank"), key.dp_rank)?;
    d.set_item(intern!(py, "medium"), &key.medium)?;
    d.set_item(intern!(py, "group"), key.group)?;
    Ok(d)
}

fn state_to_py(py: Python<'_>, state: HolderState) -> &Bound<'_, pyo3::types::PyString> {
    match state {
        HolderState::Exact => intern!(py, "exact"),
        HolderState::Recovering => intern!(py, "recovering"),
        HolderState::Stale => intern!(py, "stale"),
    }
}

fn holder_to_py<'py>(
    py: Python<'py>,
    key: &HolderKey,
    state: HolderState,
) -> PyResult<Bound<'py, PyDict>> {
    let d = key_to_py(py, key)?;
    d.set_item(intern!(py, "state"), state_to_py(py, state))?;
    Ok(d)
}

/// A batch of `events` (dicts, or the engines' event objects) of DP rank `dp_rank`.
fn batch_of(events: &Bound<'_, PyAny>, dp_rank: Option<i64>) -> PyResult<EventBatch> {
    let mut out = Vec::new();
    for (i, ev) in events.try_iter()?.enumerate() {
        out.push(event_from_py(&ev?).map_err(|e| {
            InvalidArgument::new_err(format!("event {i}: {}", e.value(events.py())))
        })?);
    }
    Ok(EventBatch {
        ts: 0.0,
        events: out,
        dp_rank,
    })
}
