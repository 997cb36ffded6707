//! The KV layout of the C ABI: `kvlink_tensor` (with its layout asserts) and
//! `kvlink_engine_set_layout`.

use std::ffi::{c_char, c_int};

use kvlink::{HeadSplit, KvLayout, RegionId, MAX_TENSORS};

use crate::args::{ref_arg, slice_arg, str_arg};
use crate::guard::guard;
use crate::handle::kvlink_engine;
use crate::status::invalid;

/// One tensor of the KV cache for `kvlink_engine_set_layout`: `num_blocks` blocks of
/// `block_bytes` bytes, block `b` starting at byte `offset + b * block_stride` of region
/// `region`. Zero the struct before filling it: the fields after `block_bytes` default to
/// block group 0, no KV heads and no token runs.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvlink_tensor {
    /// Region that holds the tensor (from `kvlink_engine_allocate_host` or
    /// `kvlink_engine_register_host`).
    pub region: u32,
    /// Number of blocks.
    pub num_blocks: u32,
    /// Byte offset of block 0 within the region.
    pub offset: u64,
    /// Distance in bytes from one block to the next (at least `block_bytes`).
    pub block_stride: u64,
    /// Bytes of one block of this tensor.
    pub block_bytes: u64,
    /// The block group (block-id space, from 0) the tensor belongs to: reads and holds give
    /// block ids per group (`kvlink_engine_read`, `kvlink_engine_hold_groups`).
    pub group: u32,
    /// KV heads of the model in this tensor over all TP ranks, when tensor parallelism splits
    /// them (0: every rank holds the tensor whole, as MLA's latent). Declared heads let a peer
    /// of another TP size read its own heads.
    pub heads_total: u32,
    /// KV heads this rank holds (`heads_total / tp_size`, or 1 with more ranks than heads).
    pub heads_local: u32,
    /// How many times this rank's heads repeat in a block: 1 for head-major blocks
    /// (`[heads, tokens, dim]`), the tokens per block for token-major ones.
    pub head_runs: u32,
    /// How a block holds its tokens: that many stretches of all the block's tokens side by
    /// side (1 for `[tokens, ...]` blocks, the local heads for head-major ones, twice that with
    /// K and V in one block); 0: not declared. Needed to read between engines whose blocks hold
    /// different numbers of tokens (`kvlink_engine_read_resized`).
    pub token_runs: u32,
    /// Zero.
    pub reserved: u32,
}

const _: () = assert!(std::mem::size_of::<kvlink_tensor>() == 56);
const _: () = assert!(std::mem::align_of::<kvlink_tensor>() == 8);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, region) == 0);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, num_blocks) == 4);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, offset) == 8);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, block_stride) == 16);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, block_bytes) == 24);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, group) == 32);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, heads_total) == 36);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, heads_local) == 40);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, head_runs) == 44);
const _: () = assert!(std::mem::offset_of!(kvlink_tensor, token_runs) == 48);

/// Sets the KV layout (validated against the registered regions) and publishes it to peers.
///
/// `tensors` points to `count` tensors (1 to 16384) in the order both engines agree on
/// (layer-major, K before V); they are named `t0`, `t1`, ... in logs. `dtype` is the element
/// type tag (`"bf16"`, `"fp8_e4m3"`, ...), 1 to 32 bytes; peers must agree on it and on
/// `tokens_per_block`. Both are only read during the call.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (the last error names the offending tensor).
///
/// # Safety
/// `engine` is NULL or a live engine; `dtype` is NULL or NUL-terminated; `tensors` is NULL or
/// points to `count` valid `kvlink_tensor`s.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_set_layout(
    engine: *mut kvlink_engine,
    tokens_per_block: u32,
    dtype: *const c_char,
    tensors: *const kvlink_tensor,
    count: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let dtype = unsafe { str_arg(dtype, "dtype") }?;
        if count == 0 || count > MAX_TENSORS {
            return Err(invalid(format!(
                "count is {count}; a layout has 1 to {MAX_TENSORS} tensors"
            )));
        }
        // SAFETY: the caller promised `count` valid tensors or NULL.
        let tensors = unsafe { slice_arg(tensors, count, "tensors") }?;
        let mut layout = KvLayout::numbered(
            tokens_per_block,
            dtype,
            tensors.iter().map(|t| {
                (
                    RegionId(t.region),
                    t.offset,
                    t.block_stride,
                    t.block_bytes,
                    t.num_blocks,
                )
            }),
        );
        for (out, t) in layout.tensors.iter_mut().zip(tensors) {
            out.group = t.group;
            out.heads = (t.heads_total > 0).then_some(HeadSplit {
                total: t.heads_total,
                local: t.heads_local,
                runs: t.head_runs,
            });
            out.token_runs = (t.token_runs > 0).then_some(t.token_runs);
        }
        e.engine.set_layout(layout)?;
        Ok(())
    })
}
