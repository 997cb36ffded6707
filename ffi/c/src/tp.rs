//! Reads and holds with block ids per block group, reads from a prefill's TP group, and the
//! TP pairing rule (`kvlink_tp_sources`).

use std::ffi::{c_char, c_int};

use kvlink::{BlockId, HoldRequest, ReadFrom, ReadRequest, RequestId, TpRank, MAX_GROUPS};

use crate::args::{millis, opt_str_arg, ref_arg, slice_arg, str_arg, write_out};
use crate::guard::guard;
use crate::handle::kvlink_engine;
use crate::status::{invalid, FfiResult};

/// `groups` block lists, list `g` holding `counts[g]` ids at `lists[g]`.
///
/// # Safety
/// `lists` and `counts` are NULL or point to `groups` readable elements; each `lists[g]` is
/// NULL or points to `counts[g]` readable `uint32_t`s.
pub(crate) unsafe fn groups_arg(
    lists: *const *const u32,
    counts: *const usize,
    groups: usize,
    what: &str,
) -> FfiResult<Vec<Vec<BlockId>>> {
    if groups == 0 || groups > MAX_GROUPS {
        return Err(invalid(format!(
            "{what}: {groups} block groups (1 to {MAX_GROUPS})"
        )));
    }
    // SAFETY: the caller promised `groups` readable pointers or NULL.
    let lists = unsafe { slice_arg(lists, groups, what) }?;
    // SAFETY: the caller promised `groups` readable counts or NULL.
    let counts = unsafe { slice_arg(counts, groups, "counts") }?;
    lists
        .iter()
        .zip(counts)
        .enumerate()
        .map(|(g, (&p, &n))| {
            let name = if groups == 1 {
                what.to_string()
            } else {
                format!("{what}[{g}]")
            };
            // SAFETY: the caller promised `counts[g]` readable ids at `lists[g]`, or NULL.
            unsafe { slice_arg(p, n, &name) }.map(<[u32]>::to_vec)
        })
        .collect()
}

/// Starts a read with block ids per block group (`groups` lists: `local[g]` and `remote[g]`
/// hold `counts[g]` ids each, paired one to one), from one engine or from a prefill's TP
/// group. With `tp_group` 0, `peers` holds one handshake address and that engine is read: it
/// must be a prefill rank this engine pairs with (`kvlink_tp_sources`) and hold every KV head
/// this engine needs. With `tp_group` 1,
/// `peers` holds the prefill's `num_peers` handshake addresses in rank order and this engine
/// reads the ranks `kvlink_tp_sources` names: its share of one rank's heads, or the heads of
/// several ranks side by side (the TP sizes must be multiples of one another). The read is
/// reported once, when every rank read delivered its part or one failed.
///
/// `remote_request_id` is the prefill's id for the request (NULL: `request_id`). `hold` is the
/// token of the prefill's hold (from its `kvlink_engine_hold_*`, sent with the request's
/// transfer parameters; 0: none): only that hold confirms the read, never a later hold of a
/// reused id. Everything is only read during the call. Returns `KVLINK_OK` or an immediate refusal: `KVLINK_E_INVALID`
/// (bad ids or block lists, TP sizes that cannot pair, no layout, request id already in
/// flight) or `KVLINK_E_SHUTDOWN`; everything later ends as a failed entry.
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` and `remote_request_id` are NULL or
/// NUL-terminated; `peers` is NULL or points to `num_peers` NULL or NUL-terminated strings;
/// `local`, `remote` and `counts` are NULL or point to `groups` readable elements, and each
/// `local[g]` and `remote[g]` is NULL or points to `counts[g]` readable `uint32_t`s.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvlink_engine_read(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    remote_request_id: *const c_char,
    peers: *const *const c_char,
    num_peers: usize,
    tp_group: c_int,
    local: *const *const u32,
    remote: *const *const u32,
    counts: *const usize,
    groups: usize,
    hold: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller's promises on `request_id`, `remote_request_id` and `peers`.
        let req = unsafe { read_args(request_id, remote_request_id, peers, num_peers, tp_group) }?;
        let req = ReadRequest {
            hold: (hold != 0).then_some(hold),
            ..req
        };
        // SAFETY: the caller promised `groups` lists of `counts[g]` ids, or NULL.
        let local = unsafe { groups_arg(local, counts, groups, "local") }?;
        // SAFETY: as above.
        let remote = unsafe { groups_arg(remote, counts, groups, "remote") }?;
        e.engine.read(ReadRequest {
            local,
            remote,
            ..req
        })?;
        Ok(())
    })
}

/// `kvlink_engine_read` from a prefill whose blocks hold another number of tokens than this
/// engine's (one a multiple of the other): `local[g]` holds `local_counts[g]` ids of this
/// engine's blocks and `remote[g]` `remote_counts[g]` ids of the prefill's blocks of
/// `remote_tokens_per_block` tokens, both lists covering the same run of tokens, from token
/// `first_tokens[g]` of group `g`'s first block of the larger size (the prefill's or this
/// engine's; 0, or a multiple of the smaller size: the read starts inside that block, as when
/// this engine's cached prefix ends inside a prefill block or a sliding window starts inside
/// a block; NULL: 0 for every group). Both layouts must declare `token_runs`. `hold` as for
/// `kvlink_engine_read`. Returns as `kvlink_engine_read`.
///
/// # Safety
/// As `kvlink_engine_read`, with `local_counts` and `remote_counts` for `counts`;
/// `first_tokens` is NULL or points to `groups` readable `uint32_t`s.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvlink_engine_read_resized(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    remote_request_id: *const c_char,
    peers: *const *const c_char,
    num_peers: usize,
    tp_group: c_int,
    local: *const *const u32,
    local_counts: *const usize,
    remote: *const *const u32,
    remote_counts: *const usize,
    groups: usize,
    remote_tokens_per_block: u32,
    first_tokens: *const u32,
    hold: u64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller's promises on `request_id`, `remote_request_id` and `peers`.
        let req = unsafe { read_args(request_id, remote_request_id, peers, num_peers, tp_group) }?;
        // SAFETY: the caller promised `groups` lists of `local_counts[g]` ids, or NULL.
        let local = unsafe { groups_arg(local, local_counts, groups, "local") }?;
        // SAFETY: the caller promised `groups` lists of `remote_counts[g]` ids, or NULL.
        let remote = unsafe { groups_arg(remote, remote_counts, groups, "remote") }?;
        e.engine.read(ReadRequest {
            local,
            remote,
            remote_tokens_per_block: Some(remote_tokens_per_block),
            hold: (hold != 0).then_some(hold),
            first_tokens: if first_tokens.is_null() {
                Vec::new()
            } else {
                // SAFETY: the caller promised `groups` readable ids at `first_tokens`.
                unsafe { slice_arg(first_tokens, groups, "first_tokens") }?.to_vec()
            },
            ..req
        })?;
        Ok(())
    })
}

/// A read's ids and source, without block lists (same block size, reading from token 0).
///
/// # Safety
/// `request_id` and `remote_request_id` are NULL or NUL-terminated; `peers` is NULL or points
/// to `num_peers` NULL or NUL-terminated strings.
unsafe fn read_args(
    request_id: *const c_char,
    remote_request_id: *const c_char,
    peers: *const *const c_char,
    num_peers: usize,
    tp_group: c_int,
) -> FfiResult<ReadRequest> {
    // SAFETY: the caller promised NUL-terminated strings or NULL.
    let id = unsafe { str_arg(request_id, "request_id") }?;
    // SAFETY: as above.
    let remote_id = unsafe { opt_str_arg(remote_request_id, "remote_request_id") }?;
    // SAFETY: the caller promised `num_peers` readable pointers or NULL.
    let peer_ptrs = unsafe { slice_arg(peers, num_peers, "peers") }?;
    let peers = peer_ptrs
        .iter()
        .enumerate()
        // SAFETY: the caller promised each is NULL or NUL-terminated.
        .map(|(i, &p)| unsafe { str_arg(p, &format!("peers[{i}]")) }.map(str::to_string))
        .collect::<FfiResult<Vec<String>>>()?;
    let from = match (tp_group, peers.len()) {
        (0, 1) => ReadFrom::Engine(peers.into_iter().next().expect("one peer")),
        (0, n) => {
            return Err(invalid(format!(
                "{n} peers without tp_group; give one engine, or set tp_group to 1 for the \
                 prefill's TP group"
            )))
        }
        (1, _) => ReadFrom::TpGroup(peers),
        (other, _) => return Err(invalid(format!("tp_group is {other}, not 0 or 1"))),
    };
    let id = RequestId::from(id);
    let remote_id = remote_id.map_or_else(|| id.clone(), RequestId::from);
    Ok(ReadRequest {
        id,
        remote_id,
        from,
        local: Vec::new(),
        remote: Vec::new(),
        remote_tokens_per_block: None,
        first_tokens: Vec::new(),
        hold: None,
    })
}

/// `kvlink_engine_hold_blocks` with block ids per block group: list `g` holds `counts[g]` ids
/// at `blocks[g]`, for the layout's `groups` block groups. The readers are the decode ranks
/// that read this rank (several when the decode's TP size is a multiple of this one's); the
/// send finishes once every one confirmed. `reader` (NULL: any), `abort_timeout_ms` (0: the
/// engine's) and `token` as for `kvlink_engine_hold_blocks`. Returns `KVLINK_OK` or
/// `KVLINK_E_INVALID`.
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` and `reader` are NULL or NUL-terminated;
/// `blocks` and `counts` are NULL or point to `groups` readable elements, each `blocks[g]`
/// NULL or pointing to `counts[g]` readable `uint32_t`s; `token` is NULL or points to a
/// readable and writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_hold_groups(
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
            false,
        )
    }
}

/// `kvlink_engine_hold_groups` (`growing` false) or `kvlink_engine_hold_growing` (true).
///
/// # Safety
/// As `kvlink_engine_hold_groups`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn hold_as(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    blocks: *const *const u32,
    counts: *const usize,
    groups: usize,
    reader: *const c_char,
    abort_timeout_ms: u64,
    token: *mut u64,
    growing: bool,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        // SAFETY: the caller promised `groups` lists of `counts[g]` ids, or NULL.
        let blocks = unsafe { groups_arg(blocks, counts, groups, "blocks") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let reader = unsafe { opt_str_arg(reader, "reader") }?;
        let timeout = match abort_timeout_ms {
            0 => None,
            ms => Some(millis(ms, "abort_timeout_ms")?),
        };
        // SAFETY: the caller promised a readable token or NULL.
        let given = match unsafe { token.as_ref() } {
            Some(&t) if t != 0 => Some(t),
            _ => None,
        };
        let req = HoldRequest {
            id: id.into(),
            blocks,
            reader: reader.map(str::to_string),
            abort_timeout: timeout,
            token: given,
        };
        let t = if growing {
            e.engine.hold_growing(req)?
        } else {
            e.engine.hold(req)?
        };
        if !token.is_null() {
            // SAFETY: checked non-NULL; the caller promised it writable.
            unsafe { write_out(token, t) };
        }
        Ok(())
    })
}

/// The prefill ranks that rank `decode_rank` of a decode's TP group of `decode_size` reads
/// from a prefill of `prefill_size` ranks: `*count` ranks from `*first` on (one when the decode
/// is the same size or larger, `prefill_size / decode_size` when it is smaller). Returns
/// `KVLINK_OK`, or `KVLINK_E_INVALID` when neither size is a multiple of the other.
///
/// # Safety
/// `first` and `count` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_tp_sources(
    decode_rank: u32,
    decode_size: u32,
    prefill_size: u32,
    first: *mut u32,
    count: *mut u32,
) -> c_int {
    guard(|| {
        crate::args::check_out(first, "first")?;
        crate::args::check_out(count, "count")?;
        let r = kvlink::tp_sources(TpRank::new(decode_rank, decode_size), prefill_size)?;
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(first, r.start) };
        // SAFETY: as above.
        unsafe { write_out(count, r.end - r.start) };
        Ok(())
    })
}
