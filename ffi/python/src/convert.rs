//! Conversions of Python arguments: durations in seconds, request ids, block-id sequences and
//! the memory of array-like objects (array interfaces and torch tensors).

use std::time::Duration;

use kvlink_core::internal::{check_duration, MAX_DURATION};
use kvlink_core::{AuthKey, HeadSplit, HoldRequest, RegionId, RequestId, TensorLayout};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::{to_py, InvalidArgument};

/// A positive number of seconds, at most the core's limit of 7 days (`MAX_DURATION`).
pub(crate) fn seconds(name: &str, v: f64) -> PyResult<Duration> {
    let limit = MAX_DURATION.as_secs_f64();
    if !(v.is_finite() && v > 0.0 && v <= limit) {
        return Err(InvalidArgument::new_err(format!(
            "{name} must be a positive number of seconds, at most 7 days, got {v}"
        )));
    }
    let d = Duration::from_secs_f64(v);
    check_duration(name, d).map_err(to_py)?;
    Ok(d)
}

/// Request ids are `str` end to end: an int id is refused rather than converted, so the ids the
/// scheduler gets back always equal the ones it passed in.
pub(crate) fn request_id(obj: &Bound<'_, PyAny>) -> PyResult<RequestId> {
    let s: String = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "request ids are str (got {}); pass str(request_id)",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let id = RequestId::from(s);
    id.validate().map_err(InvalidArgument::new_err)?;
    Ok(id)
}

/// `obj` as a list when it is an array (numpy arrays and tensors convert to a list in one C
/// call, far faster than extracting element by element), else `obj` itself.
fn listed<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if !obj.is_instance_of::<PyList>() && obj.hasattr("tolist")? {
        obj.call_method0("tolist")
    } else {
        Ok(obj.clone())
    }
}

pub(crate) fn block_ids(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    listed(obj)?.extract::<Vec<u32>>().map_err(|_| {
        InvalidArgument::new_err(format!(
            "{name} must be a sequence of non-negative block ids below 2**32"
        ))
    })
}

/// Block ids per block group: a flat sequence of ids (one group), or a sequence of such
/// sequences (one per group of the layout).
pub(crate) fn block_groups(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
    let obj = listed(obj)?;
    if let Ok(flat) = obj.extract::<Vec<u32>>() {
        return Ok(vec![flat]);
    }
    let groups: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| {
        InvalidArgument::new_err(format!(
            "{name} must be a sequence of block ids, or one such sequence per block group"
        ))
    })?;
    groups
        .iter()
        .enumerate()
        .map(|(g, ids)| block_ids(&format!("{name}[{g}]"), ids))
        .collect()
}

/// Where an array-like object's bytes are: `(pointer, nbytes, on_gpu)`. Host arrays expose
/// `__array_interface__` (numpy) or are CPU torch tensors; GPU arrays expose
/// `__cuda_array_interface__` (CuPy, Numba; HIP builds use the same name) or are torch tensors
/// on a `cuda` device (ROCm builds of torch use the same name).
/// Refuses arrays whose elements are not plain bytes: object dtypes hold pointers to Python
/// objects (a peer would read addresses; written into, the process crashes). Accepted kinds:
/// bool, signed and unsigned integers, floats, complex, and void (raw bytes) without object
/// fields.
fn plain_bytes(ai: &Bound<'_, PyDict>, attr: &str) -> PyResult<()> {
    let typestr: String = match ai.get_item("typestr")? {
        Some(t) => t.extract()?,
        None => return Err(InvalidArgument::new_err(format!("{attr} has no 'typestr'"))),
    };
    let kind = typestr.chars().nth(1).unwrap_or('?');
    if !"biufcV".contains(kind) {
        return Err(InvalidArgument::new_err(format!(
            "arrays of dtype {typestr:?} cannot be registered: only plain numeric or raw-byte \
             (void) dtypes hold KV cache bytes (object arrays hold pointers)"
        )));
    }
    if kind == 'V' {
        if let Some(descr) = ai.get_item("descr")? {
            if holds_objects(&descr)? {
                return Err(InvalidArgument::new_err(format!(
                    "a structured dtype with object fields cannot be registered ({})",
                    descr.repr()?
                )));
            }
        }
    }
    Ok(())
}

/// Whether an array-interface `descr` (`[(name, typestr or nested descr[, shape]), ...]`) has
/// an object field at any depth.
fn holds_objects(descr: &Bound<'_, PyAny>) -> PyResult<bool> {
    for field in descr.try_iter()? {
        let ty = field?.get_item(1)?;
        let objects = match ty.extract::<String>() {
            Ok(t) => t.chars().nth(1) == Some('O'),
            Err(_) => holds_objects(&ty)?,
        };
        if objects {
            return Ok(true);
        }
    }
    Ok(false)
}

pub(crate) fn array_buffer(obj: &Bound<'_, PyAny>) -> PyResult<(usize, u64, bool)> {
    for (attr, on_gpu) in [
        ("__cuda_array_interface__", true),
        ("__array_interface__", false),
    ] {
        let Ok(ai) = obj.getattr(attr) else { continue };
        let ai = ai.downcast_into::<PyDict>()?;
        let (ptr, readonly): (usize, bool) = ai
            .get_item("data")?
            .ok_or_else(|| InvalidArgument::new_err(format!("{attr} has no 'data'")))?
            .extract()?;
        if readonly {
            return Err(InvalidArgument::new_err(
                "the array is read-only; kvlink writes into KV caches",
            ));
        }
        plain_bytes(&ai, attr)?;
        if let Some(strides) = ai.get_item("strides")? {
            if !strides.is_none() {
                return Err(InvalidArgument::new_err(
                    "the array is not C-contiguous; pass a contiguous array",
                ));
            }
        }
        let nbytes: u64 = match obj.getattr("nbytes") {
            Ok(n) => n.extract()?,
            Err(_) => interface_nbytes(&ai, attr)?,
        };
        return Ok((ptr, nbytes, on_gpu));
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("nbytes")? {
        // torch.Tensor: contiguous, on the CPU or a GPU.
        let mut on_gpu = false;
        if let Ok(dev) = obj.getattr("device") {
            let kind: String = dev.getattr("type")?.extract()?;
            on_gpu = match kind.as_str() {
                "cpu" => false,
                "cuda" => true,
                other => {
                    return Err(InvalidArgument::new_err(format!(
                        "the tensor is on {other}; kvlink registers CPU and cuda (CUDA or ROCm) tensors"
                    )))
                }
            };
        }
        if obj.hasattr("is_contiguous")? && !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(InvalidArgument::new_err(
                "the tensor is not contiguous; call .contiguous()",
            ));
        }
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let nbytes: u64 = obj.getattr("nbytes")?.extract()?;
        return Ok((ptr, nbytes, on_gpu));
    }
    Err(InvalidArgument::new_err(
        "expected an array exposing __array_interface__ (numpy), __cuda_array_interface__ \
         (CuPy) or data_ptr()/nbytes (torch)",
    ))
}

/// Bytes of a contiguous array from its interface's `shape` and `typestr` (`"<f2"`: 2 bytes).
fn interface_nbytes(ai: &Bound<'_, PyDict>, attr: &str) -> PyResult<u64> {
    let shape: Vec<u64> = ai
        .get_item("shape")?
        .ok_or_else(|| InvalidArgument::new_err(format!("{attr} has no 'shape'")))?
        .extract()?;
    let typestr: String = ai
        .get_item("typestr")?
        .ok_or_else(|| InvalidArgument::new_err(format!("{attr} has no 'typestr'")))?
        .extract()?;
    let item: u64 = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            InvalidArgument::new_err(format!("{attr} typestr {typestr:?} unreadable"))
        })?;
    shape
        .iter()
        .try_fold(item, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| InvalidArgument::new_err(format!("{attr} describes more than 2^64 bytes")))
}

/// Tensor `i` of `set_layout`: `(region, offset, block_stride, block_bytes, num_blocks[, group[,
/// heads[, token_runs]]])`, `heads` being `None` or `(total, local, runs)`, `token_runs` `None` or
/// how many stretches of all the block's tokens a block holds side by side.
pub(crate) fn tensor_layout(i: usize, t: &Bound<'_, PyAny>) -> PyResult<TensorLayout> {
    let bad = || {
        InvalidArgument::new_err(format!(
            "tensor {i} must be (region, offset, block_stride, block_bytes, num_blocks[, group[, \
             (total_heads, local_heads, runs) or None[, token_runs or None]]]) with \
             non-negative integers"
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = t.extract().map_err(|_| bad())?;
    if !(5..=8).contains(&items.len()) {
        return Err(bad());
    }
    let int = |k: usize| items[k].extract::<u64>().map_err(|_| bad());
    let small = |k: usize| items[k].extract::<u32>().map_err(|_| bad());
    let group = if items.len() > 5 { small(5)? } else { 0 };
    let heads = match items.get(6) {
        Some(h) if !h.is_none() => {
            let (total, local, runs): (u32, u32, u32) = h.extract().map_err(|_| bad())?;
            Some(HeadSplit { total, local, runs })
        }
        _ => None,
    };
    Ok(TensorLayout {
        name: format!("t{i}"),
        region: RegionId(small(0)?),
        offset: int(1)?,
        block_stride: int(2)?,
        block_bytes: int(3)?,
        num_blocks: small(4)?,
        group,
        heads,
        token_runs: match items.get(7) {
            Some(r) if !r.is_none() => Some(small(7)?),
            _ => None,
        },
    })
}

/// The deployment key of `Engine(auth_key=...)`: str or bytes, at least 16 bytes.
pub(crate) fn auth_key(k: &Bound<'_, PyAny>) -> PyResult<AuthKey> {
    let bytes: Vec<u8> = match k.extract::<String>() {
        Ok(s) => s.into_bytes(),
        Err(_) => k
            .extract::<Vec<u8>>()
            .map_err(|_| InvalidArgument::new_err("auth_key must be str or bytes"))?,
    };
    AuthKey::new(bytes).map_err(to_py)
}

/// The hold `hold_blocks` and `hold_growing` make of their arguments.
pub(crate) fn hold_request(
    id: &Bound<'_, PyAny>,
    blocks: &Bound<'_, PyAny>,
    reader: Option<&str>,
    abort_timeout: Option<f64>,
    token: Option<u64>,
) -> PyResult<HoldRequest> {
    Ok(HoldRequest {
        id: request_id(id)?,
        blocks: block_groups("blocks", blocks)?,
        reader: reader.map(str::to_string),
        abort_timeout: abort_timeout
            .map(|t| seconds("abort_timeout", t))
            .transpose()?,
        token,
    })
}
