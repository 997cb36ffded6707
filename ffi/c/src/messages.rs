//! Application messages between engines (`kvlink_engine_send_message`,
//! `kvlink_engine_take_messages`) and the message sets (`kvlink_messages`) the latter returns.

use std::ffi::{c_char, c_int, CString};

use kvlink::PeerMessage;

use crate::args::{check_out, ref_arg, slice_arg, str_arg, write_out};
use crate::guard::{guard, guard_value, to_cstring};
use crate::handle::kvlink_engine;
use crate::status::invalid;

/// Messages taken from an engine's inbox, oldest first. Opaque: made by
/// `kvlink_engine_take_messages`, freed with `kvlink_messages_free`; what its accessors return
/// is owned by it and stays valid until then.
pub struct kvlink_messages {
    messages: Vec<PeerMessage>,
    senders: Vec<CString>,
}

/// Sends `len` bytes at `body` (at most `KVLINK_MESSAGE_MAX`) to the engine whose handshake
/// address is `peer`, over the authenticated control connection, for its application
/// (`kvlink_engine_take_messages`). The bytes are copied before the call returns. Returns at
/// once: messages to one peer arrive in call order once its session is up; one that cannot be
/// delivered (peer unreachable) is logged and counted, so the application's own protocol must
/// time out. `KVLINK_E_INVALID` for a body over the limit or a NULL argument (`body` may be NULL
/// when `len` is 0), `KVLINK_E_SHUTDOWN` after close.
///
/// # Safety
/// `engine` is NULL or a live engine; `peer` is NULL or NUL-terminated; `body` is NULL or points
/// to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_send_message(
    engine: *const kvlink_engine,
    peer: *const c_char,
    body: *const u8,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        // SAFETY: the caller promised a NUL-terminated string or NULL.
        let peer = unsafe { str_arg(peer, "peer") }?;
        if len > kvlink::MAX_MESSAGE_BYTES {
            return Err(invalid(format!(
                "message of {len} bytes is over the {} byte limit",
                kvlink::MAX_MESSAGE_BYTES
            )));
        }
        let body = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller promised `len` readable bytes at `body`.
            unsafe { slice_arg(body, len, "body") }?.to_vec()
        };
        e.engine.send_message(peer, body)?;
        Ok(())
    })
}

/// Takes the messages peers sent this engine since the last call (oldest first) into a new
/// `kvlink_messages` stored in `*out` (possibly empty), which the caller frees with
/// `kvlink_messages_free`. The inbox keeps at most 4,096 messages or 16 MiB and refuses what does
/// not fit, so call it every scheduler step. Never blocks.
///
/// # Safety
/// `engine` is NULL or a live engine; `out` is NULL or points to writable memory for a pointer.
#[no_mangle]
pub unsafe extern "C" fn kvlink_engine_take_messages(
    engine: *const kvlink_engine,
    out: *mut *mut kvlink_messages,
) -> c_int {
    guard(|| {
        check_out(out, "out")?;
        // SAFETY: the caller promised a live engine or NULL.
        let e = unsafe { ref_arg(engine, "engine") }?;
        let messages = e.engine.take_messages();
        let senders = messages.iter().map(|m| to_cstring(&m.from)).collect();
        let handle = Box::into_raw(Box::new(kvlink_messages { messages, senders }));
        // SAFETY: checked above; the caller promised writable memory.
        unsafe { write_out(out, handle) };
        Ok(())
    })
}

/// Number of messages in `messages`; 0, with the last error set, when it is NULL.
///
/// # Safety
/// `messages` is NULL or a live `kvlink_messages`.
#[no_mangle]
pub unsafe extern "C" fn kvlink_messages_count(messages: *const kvlink_messages) -> usize {
    guard_value(
        |_| 0,
        || {
            // SAFETY: the caller promised a live kvlink_messages or NULL.
            Ok(unsafe { ref_arg(messages, "messages") }?.messages.len())
        },
    )
}

/// Message `index` of `messages`: stores the sender's engine id (as it proved it in its
/// handshake; a NUL-terminated string) in `*from`, the body's address in `*body` and its length
/// in `*len`, all owned by `messages` (valid until `kvlink_messages_free`). Any of the three
/// output pointers may be NULL. `KVLINK_E_INVALID` when `messages` is NULL or `index` out of
/// range.
///
/// # Safety
/// `messages` is NULL or a live `kvlink_messages`; each output pointer is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvlink_messages_get(
    messages: *const kvlink_messages,
    index: usize,
    from: *mut *const c_char,
    body: *mut *const u8,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller promised a live kvlink_messages or NULL.
        let m = unsafe { ref_arg(messages, "messages") }?;
        let (Some(msg), Some(sender)) = (m.messages.get(index), m.senders.get(index)) else {
            return Err(invalid(format!(
                "index {index} is out of range: there are {} messages",
                m.messages.len()
            )));
        };
        if !from.is_null() {
            // SAFETY: not NULL; the caller promised writable memory.
            unsafe { write_out(from, sender.as_ptr()) };
        }
        if !body.is_null() {
            // SAFETY: as above.
            unsafe { write_out(body, msg.body.as_ptr()) };
        }
        if !len.is_null() {
            // SAFETY: as above.
            unsafe { write_out(len, msg.body.len()) };
        }
        Ok(())
    })
}

/// Frees a `kvlink_messages` and what its accessors returned. NULL is ignored.
///
/// # Safety
/// `messages` is NULL or a `kvlink_messages` not freed yet, which no other thread uses during or
/// after this call.
#[no_mangle]
pub unsafe extern "C" fn kvlink_messages_free(messages: *mut kvlink_messages) {
    guard(|| {
        if !messages.is_null() {
            // SAFETY: the caller passes ownership of a pointer made by Box::into_raw in
            // kvlink_engine_take_messages, used by no one else.
            drop(unsafe { Box::from_raw(messages) });
        }
        Ok(())
    });
}
