//! The parts of the data-stream framing that TCP and the same-host path share: the session
//! proof's sizes, the request id's bounds and decoding, and the most one request may ask for.
//! Each transport's own framing (`tcp::wire`, `local::wire`) is built around them.

use crate::error::{Error, Result};

/// Bytes of a data connection's session proof: the session id (16) and the proof (32), sent
/// after the server's 32-byte nonce on engines with a deployment key.
pub const AUTH_REPLY: usize = 48;
/// Bytes of the data server's session challenge (a nonce).
pub const AUTH_NONCE: usize = 32;
/// Longest request id, in bytes.
pub const MAX_ID: usize = 256;
/// Most bytes one request may ask for.
pub const MAX_REQUEST_BYTES: u64 = 256 << 20;

/// Parses a request id as it arrived (1 to [`MAX_ID`] bytes of UTF-8).
pub fn decode_request_id(b: &[u8]) -> Result<crate::ids::RequestId> {
    let s =
        std::str::from_utf8(b).map_err(|_| Error::Protocol("request id is not UTF-8".into()))?;
    let id = crate::ids::RequestId::from(s);
    id.validate().map_err(Error::Protocol)?;
    Ok(id)
}
