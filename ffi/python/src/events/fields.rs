//! Events between Python and Rust: dicts (or the engines' own event objects) shaped like vLLM's
//! and SGLang's event structs, every field by its upstream name. Fields kvlink does not model
//! cross both ways as plain Python values (see [`value_to_py`]).

use kvlink_core::events::{
    BlockHash, BlockRemoved, BlockStored, BlockTransferred, ExtraField, FieldKey, KvEvent, Value,
    MAX_EXTRA_POSITION,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use crate::error::InvalidArgument;

/// Deepest nesting of an unknown field's value accepted from Python.
const MAX_DEPTH: usize = 32;
/// The tag of a msgpack extension value in Python: `("msgpack-ext", code, data)`.
const EXT_TAG: &str = "msgpack-ext";

// ---- Python -> events ----------------------------------------------------------------------

/// Reads field `name` of an event given as a dict or an object (None when absent). The name
/// is an interned Python string: no allocation, and its hash is cached.
fn field<'py>(
    ev: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let v = if let Ok(d) = ev.downcast::<PyDict>() {
        d.get_item(name)?
    } else {
        ev.getattr(name).ok()
    };
    Ok(v.filter(|v| !v.is_none()))
}

fn opt<'py, T: FromPyObject<'py>>(
    ev: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Option<T>> {
    field(ev, name)?
        .map(|v| {
            v.extract::<T>()
                .map_err(|e| InvalidArgument::new_err(format!("event field {name:?}: {e}")))
        })
        .transpose()
}

pub(crate) fn hash_of(v: &Bound<'_, PyAny>, what: &str) -> PyResult<BlockHash> {
    if let Ok(b) = v.downcast::<PyBytes>() {
        return Ok(BlockHash::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(u) = v.extract::<u64>() {
        return Ok(BlockHash::U64(u));
    }
    if let Ok(i) = v.extract::<i64>() {
        return Ok(BlockHash::I64(i));
    }
    Err(InvalidArgument::new_err(format!(
        "{what}: a block hash is an int (-2^63 to 2^64-1) or bytes, got {}",
        v.get_type().name()?
    )))
}

fn hashes(ev: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    let Some(list) = field(ev, intern!(ev.py(), "block_hashes"))? else {
        return Err(InvalidArgument::new_err("event without block_hashes"));
    };
    if let Ok(l) = list.downcast::<PyList>() {
        return l.iter().map(|h| hash_of(&h, "block_hashes")).collect();
    }
    list.try_iter()?
        .map(|h| hash_of(&h?, "block_hashes"))
        .collect()
}

/// Token ids: a list is walked directly (the common case, and the costly one: an engine's
/// page carries 16 or more), any other iterable through the iterator protocol.
fn token_list(v: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    let bad = |e: PyErr| InvalidArgument::new_err(format!("event field {name:?}: {e}"));
    if let Ok(l) = v.downcast::<PyList>() {
        let mut out = Vec::with_capacity(l.len());
        for t in l.iter() {
            out.push(t.extract::<u32>().map_err(bad)?);
        }
        return Ok(out);
    }
    v.extract::<Vec<u32>>().map_err(bad)
}

fn token_ids(ev: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    match field(ev, intern!(ev.py(), "token_ids"))? {
        Some(v) => token_list(&v, "token_ids"),
        None => Ok(Vec::new()),
    }
}

fn lookahead(ev: &Bound<'_, PyAny>) -> PyResult<Option<Vec<Vec<u32>>>> {
    field(ev, intern!(ev.py(), "lookahead_token_ids"))?
        .map(|v| {
            v.try_iter()?
                .map(|l| token_list(&l?, "lookahead_token_ids"))
                .collect()
        })
        .transpose()
}

/// A Python value as msgpack: None, bool, int (-2^63 to 2^64-1), float, str, bytes, list and
/// tuple (arrays), dict (maps), and `("msgpack-ext", code, data)` for extension types.
pub(crate) fn value_from_py(v: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(InvalidArgument::new_err(format!(
            "an event field's value is nested deeper than {MAX_DEPTH}"
        )));
    }
    if v.is_none() {
        return Ok(Value::Nil);
    }
    if let Ok(b) = v.downcast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if v.is_instance_of::<PyInt>() {
        if let Ok(u) = v.extract::<u64>() {
            return Ok(Value::UInt(u));
        }
        return v.extract::<i64>().map(Value::Int).map_err(|_| {
            InvalidArgument::new_err("an int in an event field is outside -2^63 to 2^64-1")
        });
    }
    if let Ok(f) = v.downcast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = v.downcast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = v.downcast::<PyBytes>() {
        return Ok(Value::Bin(b.as_bytes().to_vec()));
    }
    if let Ok(b) = v.downcast::<PyByteArray>() {
        return Ok(Value::Bin(b.to_vec()));
    }
    if let Ok(t) = v.downcast::<PyTuple>() {
        if t.len() == 3
            && t.get_item(0)?
                .extract::<String>()
                .is_ok_and(|s| s == EXT_TAG)
        {
            let code: i8 = t.get_item(1)?.extract()?;
            let data: Vec<u8> = t.get_item(2)?.extract()?;
            return Ok(Value::Ext(code, data));
        }
    }
    if let Ok(d) = v.downcast::<PyDict>() {
        let mut pairs = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            pairs.push((value_from_py(&k, depth + 1)?, value_from_py(&v, depth + 1)?));
        }
        return Ok(Value::Map(pairs));
    }
    if v.downcast::<PyList>().is_ok() || v.downcast::<PyTuple>().is_ok() {
        let mut items = Vec::new();
        for x in v.try_iter()? {
            items.push(value_from_py(&x?, depth + 1)?);
        }
        return Ok(Value::Array(items));
    }
    Err(InvalidArgument::new_err(format!(
        "an event field's value of type {} has no msgpack form (None, bool, int, float, str, bytes, list, tuple, dict)",
        v.get_type().name()?
    )))
}

/// The fields of an event dict (or object) kvlink does not model: a dict's other keys
/// (`"@<index>"` for a legacy array's positional ones), an engine object's other declared
/// fields (msgspec's `__struct_fields__`, a dataclass's fields) that are not None.
fn extra_fields(ev: &Bound<'_, PyAny>, ty: &str) -> PyResult<Vec<ExtraField>> {
    let py = ev.py();
    let first = KvEvent::first_extra_position(ty);
    let mut out = Vec::new();
    // Called for the names kvlink does not model only.
    let mut add = |name: String, v: Bound<'_, PyAny>| -> PyResult<()> {
        let key = match name.strip_prefix('@') {
            Some(p) => match p.parse::<usize>() {
                Ok(p) if (first..=MAX_EXTRA_POSITION).contains(&p) => FieldKey::Position(p),
                _ => {
                    return Err(InvalidArgument::new_err(format!(
                        "event field {name:?}: a positional field is \"@<index>\" from @{first} to @{MAX_EXTRA_POSITION}"
                    )))
                }
            },
            None => FieldKey::Name(name.clone()),
        };
        let value = value_from_py(&v, 0)
            .map_err(|e| InvalidArgument::new_err(format!("event field {name:?}: {e}")))?;
        out.push(ExtraField { key, value });
        Ok(())
    };
    if let Ok(d) = ev.downcast::<PyDict>() {
        for (k, v) in d.iter() {
            let k = k
                .downcast_into::<PyString>()
                .map_err(|_| InvalidArgument::new_err("an event dict's keys must be strings"))?;
            // Borrowed: the common keys (all known) cost no allocation.
            let name = k.to_str()?;
            if !KvEvent::known_field(ty, name) {
                add(name.to_owned(), v)?;
            }
        }
        return Ok(out);
    }
    let names = match ev.getattr(intern!(py, "__struct_fields__")) {
        Ok(f) => f,
        Err(_) => match ev.getattr(intern!(py, "__dataclass_fields__")) {
            Ok(f) => f,
            Err(_) => return Ok(out),
        },
    };
    for name in names.try_iter()? {
        let name = name?.downcast_into::<PyString>()?;
        if KvEvent::known_field(ty, name.to_str()?) {
            continue;
        }
        let v = ev.getattr(&name)?;
        if !v.is_none() {
            add(name.to_str()?.to_owned(), v)?;
        }
    }
    Ok(out)
}

/// An event from a dict with `"type"`, or from an engine's event object (its class name).
pub(crate) fn event_from_py(ev: &Bound<'_, PyAny>) -> PyResult<KvEvent> {
    let py = ev.py();
    let kind: String = match field(ev, intern!(py, "type"))? {
        Some(t) if ev.is_instance_of::<PyDict>() => t.extract()?,
        _ if ev.is_instance_of::<PyDict>() => {
            return Err(InvalidArgument::new_err(
                "an event dict needs a \"type\" key",
            ))
        }
        _ => ev.get_type().name()?.extract()?,
    };
    let extra = || extra_fields(ev, &kind);
    Ok(match kind.as_str() {
        "BlockStored" => KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(ev)?,
            parent_block_hash: field(ev, intern!(py, "parent_block_hash"))?
                .map(|h| hash_of(&h, "parent_block_hash"))
                .transpose()?,
            token_ids: token_ids(ev)?,
            block_size: opt(ev, intern!(py, "block_size"))?.unwrap_or(0),
            lora_id: opt(ev, intern!(py, "lora_id"))?,
            medium: opt(ev, intern!(py, "medium"))?,
            lora_name: opt(ev, intern!(py, "lora_name"))?,
            group_idx: opt(ev, intern!(py, "group_idx"))?,
            kv_cache_spec_kind: opt(ev, intern!(py, "kv_cache_spec_kind"))?,
            kv_cache_spec_sliding_window: opt(ev, intern!(py, "kv_cache_spec_sliding_window"))?,
            token_offset: opt(ev, intern!(py, "token_offset"))?,
            extra_keys: field(ev, intern!(py, "extra_keys"))?
                .map(|v| value_from_py(&v, 0))
                .transpose()
                .map_err(|e| InvalidArgument::new_err(format!("event field \"extra_keys\": {e}")))?,
            locality: opt(ev, intern!(py, "locality"))?,
            ownership: opt(ev, intern!(py, "ownership"))?,
            session_id: opt(ev, intern!(py, "session_id"))?,
            lookahead_token_ids: lookahead(ev)?,
            cache_salt: opt(ev, intern!(py, "cache_salt"))?,
            extra: extra()?,
        }),
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(ev)?,
            medium: opt(ev, intern!(py, "medium"))?,
            group_idx: opt(ev, intern!(py, "group_idx"))?,
            locality: opt(ev, intern!(py, "locality"))?,
            ownership: opt(ev, intern!(py, "ownership"))?,
            extra: extra()?,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared {
            medium: opt(ev, intern!(py, "medium"))?,
            extra: extra()?,
        },
        "BlockTransferred" => KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: hashes(ev)?,
            from_medium: opt(ev, intern!(py, "from_medium"))?,
            to_medium: opt(ev, intern!(py, "to_medium"))?,
            group_idx: opt(ev, intern!(py, "group_idx"))?,
            extra: extra()?,
        }),
        other => {
            return Err(InvalidArgument::new_err(format!(
                "unknown KV event type {other:?} (BlockStored, BlockRemoved, AllBlocksCleared, BlockTransferred)"
            )))
        }
    })
}

// ---- events -> Python ----------------------------------------------------------------------

fn hash_to_py(py: Python<'_>, h: &BlockHash) -> PyResult<PyObject> {
    Ok(match h {
        BlockHash::U64(v) => v.into_pyobject(py)?.into_any().unbind(),
        BlockHash::I64(v) => v.into_pyobject(py)?.into_any().unbind(),
        BlockHash::Bytes(b) => PyBytes::new(py, b).into_any().unbind(),
    })
}

fn hashes_to_py<'py>(py: Python<'py>, hs: &[BlockHash]) -> PyResult<Bound<'py, PyList>> {
    let l = PyList::empty(py);
    for h in hs {
        l.append(hash_to_py(py, h)?)?;
    }
    Ok(l)
}

/// A msgpack value as Python: the inverse of [`value_from_py`] (arrays as lists, except inside
/// dict keys, where they become tuples, and maps there become tuples of pairs).
pub(crate) fn value_to_py(py: Python<'_>, v: &Value) -> PyResult<PyObject> {
    value_to_py_as(py, v, false)
}

fn value_to_py_as(py: Python<'_>, v: &Value, key: bool) -> PyResult<PyObject> {
    Ok(match v {
        Value::Nil => py.None(),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any().unbind(),
        Value::UInt(u) => u.into_pyobject(py)?.into_any().unbind(),
        Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Value::Float(f) => f.into_pyobject(py)?.into_any().unbind(),
        Value::Str(s) => PyString::new(py, s).into_any().unbind(),
        Value::Bin(b) => PyBytes::new(py, b).into_any().unbind(),
        Value::Ext(code, data) => PyTuple::new(
            py,
            [
                PyString::new(py, EXT_TAG).into_any(),
                code.into_pyobject(py)?.into_any(),
                PyBytes::new(py, data).into_any(),
            ],
        )?
        .into_any()
        .unbind(),
        Value::Array(items) => {
            let items = items
                .iter()
                .map(|x| value_to_py_as(py, x, key))
                .collect::<PyResult<Vec<_>>>()?;
            if key {
                PyTuple::new(py, items)?.into_any().unbind()
            } else {
                PyList::new(py, items)?.into_any().unbind()
            }
        }
        // A map as a dict key (not hashable): a tuple of (key, value) pairs.
        Value::Map(pairs) if key => {
            let items = pairs
                .iter()
                .map(|(k, v)| {
                    PyTuple::new(
                        py,
                        [value_to_py_as(py, k, true)?, value_to_py_as(py, v, true)?],
                    )
                })
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any().unbind()
        }
        Value::Map(pairs) => {
            let d = PyDict::new(py);
            for (k, v) in pairs {
                d.set_item(value_to_py_as(py, k, true)?, value_to_py_as(py, v, false)?)?;
            }
            d.into_any().unbind()
        }
    })
}

/// An event as a dict with every field of its type (None when unset), then the fields kvlink
/// does not model (`"@<index>"` for a legacy array's positional ones).
pub(crate) fn event_to_py<'py>(py: Python<'py>, e: &KvEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("type", e.type_name())?;
    match e {
        KvEvent::BlockStored(s) => {
            d.set_item("block_hashes", hashes_to_py(py, &s.block_hashes)?)?;
            d.set_item(
                "parent_block_hash",
                s.parent_block_hash
                    .as_ref()
                    .map(|h| hash_to_py(py, h))
                    .transpose()?,
            )?;
            d.set_item("token_ids", &s.token_ids)?;
            d.set_item("block_size", s.block_size)?;
            d.set_item("lora_id", s.lora_id)?;
            d.set_item("medium", &s.medium)?;
            d.set_item("lora_name", &s.lora_name)?;
            d.set_item(
                "extra_keys",
                s.extra_keys
                    .as_ref()
                    .map(|v| value_to_py(py, v))
                    .transpose()?,
            )?;
            d.set_item("group_idx", s.group_idx)?;
            d.set_item("kv_cache_spec_kind", &s.kv_cache_spec_kind)?;
            d.set_item(
                "kv_cache_spec_sliding_window",
                s.kv_cache_spec_sliding_window,
            )?;
            d.set_item("token_offset", s.token_offset)?;
            d.set_item("locality", &s.locality)?;
            d.set_item("ownership", &s.ownership)?;
            d.set_item("session_id", &s.session_id)?;
            d.set_item("lookahead_token_ids", &s.lookahead_token_ids)?;
            d.set_item("cache_salt", &s.cache_salt)?;
        }
        KvEvent::BlockRemoved(r) => {
            d.set_item("block_hashes", hashes_to_py(py, &r.block_hashes)?)?;
            d.set_item("medium", &r.medium)?;
            d.set_item("group_idx", r.group_idx)?;
            d.set_item("locality", &r.locality)?;
            d.set_item("ownership", &r.ownership)?;
        }
        KvEvent::AllBlocksCleared { medium, .. } => {
            d.set_item("medium", medium)?;
        }
        KvEvent::BlockTransferred(t) => {
            d.set_item("block_hashes", hashes_to_py(py, &t.block_hashes)?)?;
            d.set_item("from_medium", &t.from_medium)?;
            d.set_item("to_medium", &t.to_medium)?;
            d.set_item("group_idx", t.group_idx)?;
        }
    }
    for f in e.extra() {
        let k = match &f.key {
            FieldKey::Name(n) => n.clone(),
            FieldKey::Position(p) => format!("@{p}"),
        };
        d.set_item(k, value_to_py(py, &f.value)?)?;
    }
    Ok(d)
}
