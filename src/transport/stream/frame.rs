//! The parts of the data-stream framing that TCP and the same-host path share: the session
//! proof's sizes, the request id's bounds and decoding, the most one request may ask for, and
//! what a request carries beside its entries (protocol 8: [`Extras`]).
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

/// Request flag: confirm the read once its bytes are copied out (it is the read's last
/// request).
pub const FLAG_CONFIRM: u16 = 1;
/// Request flag: the hold token follows the request id.
pub const FLAG_HOLD: u16 = 2;
/// Request flag: the reader's control session id follows (engines without a key).
pub const FLAG_SESSION: u16 = 4;
/// Every flag this build knows.
pub const FLAGS: u16 = FLAG_CONFIRM | FLAG_HOLD | FLAG_SESSION;

/// What a request carries beside its entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extras {
    /// Confirm the read with its data ([`FLAG_CONFIRM`]).
    pub confirm: bool,
    /// The hold the reader reads ([`FLAG_HOLD`]).
    pub hold: Option<u64>,
    /// The reader's control session ([`FLAG_SESSION`]).
    pub session: Option<[u8; 16]>,
}

impl Extras {
    /// What a read's requests carry: the session (engines without a key), and, when the read
    /// is `batches` requests of which only one asks, its confirmation with the hold token
    /// (a read of one request is confirmed with its data).
    pub(crate) fn of_read(
        confirm: Option<crate::transport::ConfirmAsk>,
        batches: usize,
        session: Option<[u8; 16]>,
    ) -> Extras {
        let confirm = confirm.filter(|_| batches == 1);
        Extras {
            confirm: confirm.is_some(),
            hold: confirm.and_then(|c| c.hold),
            session,
        }
    }

    /// The flags announcing these extras.
    pub fn flags(&self) -> u16 {
        let mut f = 0;
        if self.confirm {
            f |= FLAG_CONFIRM;
        }
        if self.hold.is_some() {
            f |= FLAG_HOLD;
        }
        if self.session.is_some() {
            f |= FLAG_SESSION;
        }
        f
    }

    /// Bytes that follow the request id for `flags`.
    pub fn len_of(flags: u16) -> usize {
        let mut n = 0;
        if flags & FLAG_HOLD != 0 {
            n += 8;
        }
        if flags & FLAG_SESSION != 0 {
            n += 16;
        }
        n
    }

    /// Appends the hold token and session id, as the flags announce them.
    pub fn encode(&self, out: &mut Vec<u8>) {
        if let Some(h) = self.hold {
            out.extend_from_slice(&h.to_le_bytes());
        }
        if let Some(s) = &self.session {
            out.extend_from_slice(s);
        }
    }

    /// Parses what [`encode`](Self::encode) wrote for `flags` (`b` is [`len_of`](Self::len_of)
    /// bytes long).
    pub fn decode(flags: u16, b: &[u8]) -> Extras {
        let mut at = 0;
        let hold = (flags & FLAG_HOLD != 0).then(|| {
            at += 8;
            u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
        });
        let session =
            (flags & FLAG_SESSION != 0).then(|| b[at..at + 16].try_into().expect("16 bytes"));
        Extras {
            confirm: flags & FLAG_CONFIRM != 0,
            hold,
            session,
        }
    }
}

/// Parses a request id as it arrived (1 to [`MAX_ID`] bytes of UTF-8).
pub fn decode_request_id(b: &[u8]) -> Result<crate::ids::RequestId> {
    let s =
        std::str::from_utf8(b).map_err(|_| Error::Protocol("request id is not UTF-8".into()))?;
    let id = crate::ids::RequestId::from(s);
    id.validate().map_err(Error::Protocol)?;
    Ok(id)
}
