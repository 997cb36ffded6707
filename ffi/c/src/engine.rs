//! The engine handle (`kvlink_engine`) and its functions (the KV layout's are in `layout.rs`).

use std::ffi::{c_char, c_int, c_void};

use kvlink::{DeviceMemory, Engine, EngineConfig, ExternalMemory, RegionId};

use crate::args::{check_out, millis, opt_str_arg, ref_arg, str_arg, write_out};
use crate::config::{engine_config, kvlink_config, read_config};
use crate::finished::kvlink_finished;
use crate::guard::guard;
use crate::handle::kvlink_engine;
use crate::status::{invalid, FfiResult};
use crate::tp::{kvlink_engine_hold_groups, kvlink_engine_read};

/// Starts an engine: binds its handshake service and data server and starts its threads.
/// Register memory and set a layout before peers read from it.
///
/// On success stores a new engine in `*out`; the caller owns it and frees it with
/// `kvlink_engine_free`. On failure `*out` is left unchanged. `config` is only read during the
/// call; NULL means the defaults of `kvlink_config_default`.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID` (bad settings), `KVLINK_E_IO` (cannot bind the
/// listen address) or `KVLINK_E_RDMA` (`KVLINK_TRANSPORT_RDMA` without a usable device).
///
/// # Safety
/// `config` is NULL or points to a `kvlink_config` of the caller's header, its `size` set and
/// its strings NULL or NUL-terminated; `out` is NULL or points to writable memory for a pointer.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_start(
    config: *const kvlink_config,
    out: *mut *mut kvlink_engine,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        let config = if config.is_null() {
            EngineConfig::default()
        } else {
            // SAFETY: the caller promised a kvlink_config of its header with its size set.
            engine_config(&unsafe { read_config(config) }?)?
        };
        let engine = Engine::start(config)?;
        let handle = Box::into_raw(Box::new(kvlink_engine { engine }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Stops an engine and frees it with all the memory it allocated (pointers returned by
/// `kvlink_engine_allocate_host` dangle afterwards). Transfers in flight are abandoned. NULL is
/// ignored.
///
/// # Safety
/// `engine` is NULL or a pointer returned by `kvlink_engine_start` that has not been freed, and
/// no other thread uses it during or after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_free(engine: *mut kvlink_engine) {
    guard(|| {
        if !engine.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in
            // kvlink_engine_start, used by no one else.
            drop(unsafe { Box::from_raw(engine) });
        }
        Ok(())
    });
}

/// Copies the engine's handshake address (`"ip:port"`, what peers pass to
/// `kvlink_engine_read_blocks`) into `buf` as a NUL-terminated string.
///
/// `buf` is owned by the caller and must hold `len` bytes; `KVLINK_ADDRESS_MAX` bytes are
/// always enough. Returns `KVLINK_OK`, or `KVLINK_E_INVALID` when an argument is NULL or the
/// buffer is too small (then `buf` holds an empty string if `len > 0`).
///
/// # Safety
/// `engine` is NULL or a live engine; `buf` is NULL or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_handshake_address(
    engine: *const kvlink_engine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        let addr = e.engine.handshake_address().to_string();
        // SAFETY: the caller promised `len` writable bytes at `buf` (or NULL).
        unsafe { copy_str_out(buf, len, &addr, "the handshake address") }
    })
}

/// Copies `s` and a NUL into `buf` (`len` bytes), or refuses (writing an empty string when
/// there is room for one) when it does not fit.
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes that do not overlap `s`.
unsafe fn copy_str_out(buf: *mut c_char, len: usize, s: &str, what: &str) -> FfiResult {
    if buf.is_null() {
        return Err(invalid("buf is NULL"));
    }
    let needed = s.len() + 1;
    if len < needed {
        if len > 0 {
            // SAFETY: buf points to at least one writable byte.
            unsafe { buf.write(0) };
        }
        return Err(invalid(format!(
            "buffer of {len} bytes is too small for {what} ({needed} bytes with its NUL)"
        )));
    }
    // SAFETY: buf has room for `needed` bytes (checked above) and does not overlap `s` (the
    // caller's promise).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

/// Writes a report of the transports and memory kinds this engine found into `buf` (`len`
/// bytes, NUL-terminated), one line per item: `transport rdma: yes: <device>` or
/// `memory cuda:    no: <why>`. Returns `KVLINK_OK` or `KVLINK_E_INVALID` (NULL argument,
/// buffer too small: 4096 bytes suffice in practice, and the last error says how many are
/// needed).
///
/// # Safety
/// `engine` is NULL or a live engine; `buf` is NULL or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_capabilities(
    engine: *const kvlink_engine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        let report = e.engine.capabilities().to_string();
        // SAFETY: the caller promised `len` writable bytes at `buf` (or NULL); `report` is ours.
        unsafe { copy_str_out(buf, len, &report, "the capabilities report") }
    })
}

/// Allocates `len` bytes of zeroed host memory and registers it as a new region (with
/// `huge_pages`, on 2 MiB huge pages when the system has them reserved, else regular pages).
///
/// Stores the region id in `*region_id` and the memory's address in `*ptr`. The memory is owned
/// by the engine: the caller may read and write it until `kvlink_engine_deregister` of its
/// region or `kvlink_engine_free`, whichever comes first (both release it), and must not free
/// it. Returns `KVLINK_OK`, `KVLINK_E_INVALID` (NULL argument, `len` of 0) or
/// `KVLINK_E_MEMORY`.
///
/// # Safety
/// `engine` is NULL or a live engine; `region_id` and `ptr` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_allocate_host(
    engine: *mut kvlink_engine,
    len: u64,
    huge_pages: bool,
    region_id: *mut u32,
    ptr: *mut *mut u8,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(region_id, "region_id")?;
        check_out(ptr, "ptr")?;
        let region = e.engine.allocate_host(len, huge_pages)?;
        // SAFETY: both checked above; the caller promised writable memory.
        unsafe {
            write_out(region_id, region.id().0);
            write_out(ptr, region.as_ptr());
        }
        Ok(())
    })
}

/// Registers `len` bytes of caller-owned host memory at `ptr` (an inference engine's KV cache)
/// as a new region, and stores its id in `*region_id`.
///
/// The memory stays owned by the caller, but kvlink and its peers read and write it
/// concurrently until `kvlink_engine_deregister` returns `KVLINK_OK` for the region or the
/// engine is freed; only then may it be freed. Returns `KVLINK_OK`, `KVLINK_E_INVALID` (NULL
/// argument, `len` of 0, or a loaded GPU runtime says `ptr` is GPU or managed memory: use
/// `kvlink_engine_register_device`), `KVLINK_E_GPU` (a GPU runtime failed to classify `ptr`)
/// or `KVLINK_E_MEMORY` (the RDMA device could not register it).
///
/// # Safety
/// `engine` is NULL or a live engine; `region_id` is NULL or writable; `ptr` is NULL or points
/// to `len` bytes valid for reads and writes for as long as described above.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_register_host(
    engine: *mut kvlink_engine,
    ptr: *mut c_void,
    len: u64,
    region_id: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(region_id, "region_id")?;
        // SAFETY: the caller promised `len` bytes at `ptr`, valid for reads and writes until
        // the region is deregistered or the engine freed: ExternalMemory::new's contract.
        // NULL and empty ranges are refused by new itself.
        let mem = unsafe { ExternalMemory::new(ptr.cast::<u8>(), len) }?;
        let region = e.engine.register_host(mem)?;
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(region_id, region.id().0) };
        Ok(())
    })
}

/// Registers `len` bytes of caller-owned GPU memory at device address `ptr` (a KV cache
/// allocated with CUDA or HIP) as a new region, and stores its id in `*region_id`. The loaded
/// GPU runtime says which device it is on; RDMA registers it with dma-buf or a peer-memory
/// driver, TCP stages it through pinned host buffers.
///
/// The same lifetime rules as `kvlink_engine_register_host` apply. Returns `KVLINK_OK`,
/// `KVLINK_E_INVALID` (NULL argument, `len` of 0, `ptr` not device memory), `KVLINK_E_GPU` (no
/// GPU runtime loaded, the last error saying why each is missing, or a runtime call failed) or
/// `KVLINK_E_MEMORY` (the RDMA device could not register it: the last error names the dma-buf
/// and peer-memory attempts; a `KVLINK_TRANSPORT_TCP` engine does not register with RDMA).
///
/// # Safety
/// `engine` is NULL or a live engine; `region_id` is NULL or writable; `[ptr, ptr + len)` is a
/// live device allocation of this process's CUDA or HIP runtime that stays allocated as
/// described above.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_register_device(
    engine: *mut kvlink_engine,
    ptr: u64,
    len: u64,
    region_id: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(region_id, "region_id")?;
        // SAFETY: the caller promised a live device allocation: DeviceMemory::new's contract.
        let mem = unsafe { DeviceMemory::new(ptr, len) }?;
        let region = e.engine.register_device(mem)?;
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(region_id, region.id().0) };
        Ok(())
    })
}

/// Stops exporting a region and waits until no transfer uses it any more (at most the request
/// timeout plus 10 s). When this returns `KVLINK_OK`, memory registered with
/// `kvlink_engine_register_host` or `kvlink_engine_register_device` may be freed; memory from
/// `kvlink_engine_allocate_host` is freed by the engine.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID` (unknown region, or a region the layout uses) or
/// `KVLINK_E_MEMORY` (still in use after the wait: do not free the memory).
///
/// # Safety
/// `engine` is NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_deregister(
    engine: *mut kvlink_engine,
    region_id: u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        e.engine.deregister(RegionId(region_id))?;
        Ok(())
    })
}

/// Connects to the engine at `peer` (its handshake address), or reuses the cached connection,
/// waiting up to `timeout_ms`; optional, as `kvlink_engine_read_blocks` connects on first use.
/// Stores the number of blocks of the peer's cache in `*peer_blocks` unless it is NULL.
///
/// Returns `KVLINK_OK`, `KVLINK_E_INVALID`, `KVLINK_E_TIMEOUT`, `KVLINK_E_INCOMPATIBLE` (the
/// layouts differ; the last error lists every difference), `KVLINK_E_CONNECTION` or
/// `KVLINK_E_IO`.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer` is NULL or NUL-terminated; `peer_blocks` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_connect(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    timeout_ms: u64,
    peer_blocks: *mut u32,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let peer = unsafe { str_arg(peer, "peer") }?;
        if !peer_blocks.is_null() {
            check_out(peer_blocks, "peer_blocks")?;
        }
        let timeout = millis(timeout_ms, "timeout_ms")?;
        let descriptor = e.engine.connect(peer, timeout)?;
        if !peer_blocks.is_null() {
            // SAFETY: checked above; the caller promised writable memory.
            unsafe { write_out(peer_blocks, descriptor.layout.num_blocks()) };
        }
        Ok(())
    })
}

/// Cancels the read `request_id` (decode side): nothing more is written into its blocks once
/// in-flight data is drained (at most the engine's `io_timeout_ms`), it ends as a failed entry
/// whose reason says it was cancelled, and the prefill is told so it frees its blocks at once.
/// Returns at once. `*in_flight` (when `in_flight` is not NULL) is set to 1 when such a read was
/// in flight, 0 when not (it already finished, or never started).
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (NULL engine or id, misaligned `in_flight`).
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` is NULL or NUL-terminated; `in_flight` is
/// NULL or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_cancel(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    in_flight: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        if !in_flight.is_null() {
            check_out(in_flight, "in_flight")?;
        }
        let was = e.engine.cancel(id);
        if !in_flight.is_null() {
            // SAFETY: checked above; the caller promised writable memory.
            unsafe { write_out(in_flight, c_int::from(was)) };
        }
        Ok(())
    })
}

/// Starts reading blocks `remote[i]` of the engine at `peer` (its handshake address) into
/// blocks `local[i]` of this engine, for every tensor of the layout, as request `request_id`
/// (1 to 256 bytes). Returns at once: the outcome arrives through
/// `kvlink_engine_wait_finished`, as `request_id` in the receiving or the failed entries.
///
/// `local` and `remote` hold `count` block ids each and are only read during the call; a local
/// block id may appear once per request. Returns `KVLINK_OK` or an immediate refusal:
/// `KVLINK_E_INVALID` (bad id, block id out of range, no layout, request id already in flight)
/// or `KVLINK_E_SHUTDOWN`. Everything later (handshake, transfer, deadline) ends as a failed
/// entry instead.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer` and `request_id` are NULL or NUL-terminated;
/// `local` and `remote` are NULL or point to `count` readable `uint32_t`s.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_read_blocks(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    request_id: *const c_char,
    local: *const u32,
    remote: *const u32,
    count: usize,
) -> c_int {
    // SAFETY: the same contract as `kvlink_engine_read_blocks_as`, with the prefill's id being
    // this engine's own.
    unsafe {
        kvlink_engine_read_blocks_as(engine, peer, request_id, request_id, local, remote, count)
    }
}

/// `kvlink_engine_read_blocks` of a request the prefill holds under another id:
/// `remote_request_id` is the prefill's id (its grant, the done and abort notices; NULL: the
/// same as `request_id`), `request_id` this engine's own (finished entries, reports,
/// `kvlink_engine_cancel`). Lets a decode keep its scheduler's ids while the prefill keeps its
/// own. Same returns as `kvlink_engine_read_blocks`.
///
/// # Safety
/// As `kvlink_engine_read_blocks`; `remote_request_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_read_blocks_as(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    request_id: *const c_char,
    remote_request_id: *const c_char,
    local: *const u32,
    remote: *const u32,
    count: usize,
) -> c_int {
    let (peers, local, remote, counts) = ([peer], [local], [remote], [count]);
    // SAFETY: one engine and one block group: each array above holds one element, and the
    // caller's promises about `peer`, `local`, `remote` and `count` are the ones
    // `kvlink_engine_read` asks of its elements.
    unsafe {
        kvlink_engine_read(
            engine,
            request_id,
            remote_request_id,
            peers.as_ptr(),
            1,
            0,
            local.as_ptr(),
            remote.as_ptr(),
            counts.as_ptr(),
            1,
            0,
        )
    }
}

/// Prefill side: drops the hold of request `request_id` (aborted or preempted before its reader
/// was told): its grant ends at once and nothing is reported for it. Stores 1 at `*was_held`
/// (when not NULL) if it was held, 0 otherwise. Returns `KVLINK_OK` or `KVLINK_E_INVALID`, once
/// the blocks may be reused: a hold an RDMA reader pinned as it posted its reads is waited for
/// until that reader says it is done or the pin lapses (20 ms by default, once per hold).
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` is NULL or NUL-terminated; `was_held` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_release(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    was_held: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let id = unsafe { str_arg(request_id, "request_id") }?;
        let was = e.engine.release(id);
        if !was_held.is_null() {
            // SAFETY: checked above; the caller promised writable memory.
            unsafe { write_out(was_held, c_int::from(was)) };
        }
        Ok(())
    })
}

/// Decode side: tells the prefill at `peer` that this engine will not read its request
/// `remote_request_id`, so it frees the blocks now rather than at its abort timeout (for a
/// request rejected or aborted before its read started; a read in flight is cancelled with
/// `kvlink_engine_cancel` instead). `reason` (NULL for none) is passed along. Returns at once
/// (`KVLINK_OK`); the notice leaves once the session to `peer` is up. `hold` is the token of
/// the hold rejected (from the transfer parameters; 0: whichever hold of that id the prefill
/// has). `KVLINK_E_INVALID` for a bad id, `KVLINK_E_SHUTDOWN` after close.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer`, `remote_request_id` and `reason` are NULL or
/// NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_reject(
    engine: *mut kvlink_engine,
    peer: *const c_char,
    remote_request_id: *const c_char,
    hold: u64,
    reason: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised NUL-terminated strings or NULL.
        let peer = unsafe { str_arg(peer, "peer") }?;
        // SAFETY: as above.
        let id = unsafe { str_arg(remote_request_id, "remote_request_id") }?;
        // SAFETY: as above.
        let reason = unsafe { opt_str_arg(reason, "reason") }?;
        e.engine.reject(
            peer,
            id,
            (hold != 0).then_some(hold),
            reason.unwrap_or("no reason given"),
        )?;
        Ok(())
    })
}

/// Holds the `count` blocks at `blocks` of request `request_id` (1 to 256 bytes) for its
/// readers (prefill side) and grants them to them: over TCP they may read those blocks, and
/// only those, under this request id; `kvlink_engine_hold_groups` with one block group.
/// `reader` is NULL (the decode ranks that pair with this rank become the readers as they read
/// or confirm: one, or several when the decode's TP size is a multiple of this one's) or the
/// reader's engine id (only that engine may read and confirm). The request finishes sending
/// when every reader confirmed, and fails when one aborts or after `abort_timeout_ms` (0 for
/// the engine's `abort_timeout_ms`; at most 7 days). `token` is NULL (the engine picks the
/// hold's token), or points to a token: 0 to have the engine pick one and write it there, or
/// the caller's own (non-zero; a scheduler gives every TP rank's hold of a request the same
/// one). The token travels with the request's transfer parameters to the reader, whose reads
/// name it (`kvlink_engine_read`): a reused request id then never confirms an earlier read.
///
/// Returns `KVLINK_OK` or `KVLINK_E_INVALID` (bad id, no block or a block outside the KV
/// cache, id already held, bad reader or timeout).
///
/// # Safety
/// `engine` is NULL or a live engine; `request_id` and `reader` are NULL or NUL-terminated;
/// `blocks` is NULL or points to `count` readable `uint32_t`s; `token` is NULL or points to a
/// readable and writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_hold_blocks(
    engine: *mut kvlink_engine,
    request_id: *const c_char,
    blocks: *const u32,
    count: usize,
    reader: *const c_char,
    abort_timeout_ms: u64,
    token: *mut u64,
) -> c_int {
    let (blocks, counts) = ([blocks], [count]);
    // SAFETY: one block group: each array above holds one element, and the caller's promises
    // about `blocks` and `count` are the ones `kvlink_engine_hold_groups` asks of its elements.
    unsafe {
        kvlink_engine_hold_groups(
            engine,
            request_id,
            blocks.as_ptr(),
            counts.as_ptr(),
            1,
            reader,
            abort_timeout_ms,
            token,
        )
    }
}

/// Waits up to `timeout_ms` (0 to poll, at most 7 days) until some request finishes, then
/// stores everything that finished since the last call (each request exactly once) in a new
/// `kvlink_finished` at `*out`, possibly empty when the wait timed out. The caller owns it and
/// frees it with `kvlink_finished_free`.
///
/// Returns `KVLINK_OK`, or `KVLINK_E_INVALID` (NULL argument, timeout too long).
///
/// # Safety
/// `engine` is NULL or a live engine; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_wait_finished(
    engine: *mut kvlink_engine,
    timeout_ms: u64,
    out: *mut *mut kvlink_finished,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        check_out(out, "out")?;
        let timeout = millis(timeout_ms, "timeout_ms")?;
        let finished = e.engine.wait_finished(timeout);
        let handle = Box::into_raw(Box::new(kvlink_finished::new(finished)));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}
