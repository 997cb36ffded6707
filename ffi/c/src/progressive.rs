//! Progressive transfers: holds that grow part by part (prefill side) and reads that follow
//! them (decode side).

use std::ffi::{c_char, c_int};

use kvlink::FollowRequest;

use crate::args::{millis, opt_str_arg, ref_arg, str_arg};
use crate::guard::guard;
use crate::handle::kvlink_engine;
use crate::tp::{groups_arg, hold_as};

/// Prefill side: holds request `request_id` whose blocks are not all final yet, as
/// `kvlink_engine_hold_groups` does (same arguments and returns), except that the lists may be
/// empty, the hold grows with `kvlink_engine_extend_hold` as blocks become final, and it
/// confirms no read before `kvlink_engine_seal_hold`. Readers that follow the request
/// (`kvlink_engine_follow`) read each part as it is held.
///
/// # Safety
/// As `kvlink_engine_hold_groups`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvlink_engine_hold_growing(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    blocks: *const *const u32,
    counts: *const usize,
    groups: usize,
    reader: *const c_char,
    abort_timeout_ms: u64,
    token: *mut u64,
) -> c_int {
    // SAFETY: the caller's promises are the ones `hold_as` asks.
    unsafe {
        hold_as(
            engine,
            request_id,
            blocks,
            counts,
            groups,
            reader,
            abort_timeout_ms,
            token,
            true,
        )
    }
}

/// Prefill side: adds blocks (final from now on; list `g` holds `counts[g]` ids at
/// `blocks[g]`, in order after the blocks of group `g` held so far) to the growing hold of
/// `request_id`, and tells its followers. `tensor_start` and `tensor_end` (both 0: every
/// tensor) name the layout's tensors `[start, end)` that are final when only some are (a step
/// whose layers become final a group at a time): new blocks from tensor 0, then no block
/// (`groups` lists of 0 ids) with the next tensors of the same blocks until the last. Returns
/// `KVLINK_OK` or `KVLINK_E_INVALID` (not held, sealed, a block held already or outside the KV
/// cache, groups not the layout's, tensors out of order).
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` is NULL or NUL-terminated; `blocks` and
/// `counts` are NULL or point to `groups` readable elements, each `blocks[g]` NULL or pointing
/// to `counts[g]` readable `uint32_t`s.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_extend_hold(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    blocks: *const *const u32,
    counts: *const usize,
    groups: usize,
    tensor_start: u32,
    tensor_end: u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        // SAFETY: the caller promised `groups` lists of `counts[g]` ids, or NULL.
        let blocks = unsafe { groups_arg(blocks, counts, groups, "blocks") }?;
        match (tensor_start, tensor_end) {
            (0, 0) => e.engine.extend_hold(id, &blocks)?,
            (s, t) => e.engine.extend_hold_tensors(id, &blocks, s..t)?,
        }
        Ok(())
    })
}

/// Prefill side: seals the growing hold of `request_id`: it is complete, its readers may
/// confirm their reads, and its followers are told. Returns `KVLINK_OK` or `KVLINK_E_INVALID`
/// (not held, sealed already, no block held).
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_seal_hold(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        e.engine.seal_hold(id)?;
        Ok(())
    })
}

/// Decode side: starts a progressive read of the request the engine at `peer` holds (or will
/// hold) under `remote_request_id` (NULL: `request_id`) into this engine's blocks (list `g`
/// holds `counts[g]` ids at `local[g]`: all the request's blocks here, paired in order with
/// the prefill's as it holds them). Each part is read as soon as the prefill holds it; the
/// read ends as `request_id` in `kvlink_engine_wait_finished`: received once the prefill
/// sealed its hold, every part is here and it confirmed them, failed when the hold ends first,
/// a part does not come within `first_part_timeout_ms` (the first) or `part_timeout_ms` (each
/// later one; 0 for either: the engine's request timeout), or at the request timeout. `hold`
/// is the hold's token when known (0: any). Returns at once: `KVLINK_OK`, `KVLINK_E_INVALID`
/// (bad id, block ids, timeouts; no layout) or `KVLINK_E_SHUTDOWN`.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer`, `request_id` and `remote_request_id` are NULL or
/// NUL-terminated; `local` and `counts` are NULL or point to `groups` readable elements, each
/// `local[g]` NULL or pointing to `counts[g]` readable `uint32_t`s.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvlink_engine_follow(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    request_id: *const c_char,
    remote_request_id: *const c_char,
    local: *const *const u32,
    counts: *const usize,
    groups: usize,
    hold: u64,
    first_part_timeout_ms: u64,
    part_timeout_ms: u64,
) -> c_int {
    // SAFETY: the caller's promises are this function's, and a NULL `skip` is allowed.
    unsafe {
        kvlink_engine_follow_skip(
            engine,
            peer,
            request_id,
            remote_request_id,
            local,
            counts,
            groups,
            std::ptr::null(),
            hold,
            first_part_timeout_ms,
            part_timeout_ms,
        )
    }
}

/// [`kvlink_engine_follow`] for a decode that has the start of the prompt already (a prefix
/// it cached): `skip` (NULL: none) holds, per block group, how many of the prefill's first
/// blocks this engine does not read; `local[g]` lists this engine's blocks for the rest. The
/// hold's parts still count the skipped blocks, and the prefill's confirmation covers the
/// blocks read. Returns as `kvlink_engine_follow` does.
///
/// # Safety
/// As `kvlink_engine_follow`, and `skip` is NULL or points to `groups` readable `uint32_t`s.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvlink_engine_follow_skip(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    request_id: *const c_char,
    remote_request_id: *const c_char,
    local: *const *const u32,
    counts: *const usize,
    groups: usize,
    skip: *const u32,
    hold: u64,
    first_part_timeout_ms: u64,
    part_timeout_ms: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised NUL-terminated strings or NULL.
        let peer = unsafe { str_arg(peer, "peer") }?;
        // SAFETY: as above.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        // SAFETY: as above.
        let remote_id = unsafe { opt_str_arg(remote_request_id, "remote_request_id") }?;
        // SAFETY: the caller promised `groups` lists of `counts[g]` ids, or NULL.
        let local = unsafe { groups_arg(local, counts, groups, "local") }?;
        let skip = match skip.is_null() {
            true => Vec::new(),
            // SAFETY: the caller promised `groups` readable counts at a non-NULL `skip`.
            false => unsafe { std::slice::from_raw_parts(skip, groups) }.to_vec(),
        };
        let ms = |v: u64, what| match v {
            0 => Ok(None),
            v => millis(v, what).map(Some),
        };
        e.engine.follow(FollowRequest {
            peer: peer.to_string(),
            id: id.into(),
            remote_id: remote_id.unwrap_or(id).into(),
            local,
            skip,
            remote_tokens_per_block: None,
            hold: (hold != 0).then_some(hold),
            first_part_timeout: ms(first_part_timeout_ms, "first_part_timeout_ms")?,
            part_timeout: ms(part_timeout_ms, "part_timeout_ms")?,
        })?;
        Ok(())
    })
}
