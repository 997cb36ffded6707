//! Typed identifiers used across the crate.
//!
//! One [`RequestId`] type runs from the bindings to the TP aggregator: the same value the
//! scheduler hands to `read_blocks` comes back from `get_finished` and from the aggregator.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Longest request id accepted, in bytes (locally and on the wire).
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// The id of one transfer request, chosen by the engine's scheduler (vLLM uses strings such as
/// `"cmpl-3f2a-0"`; integer ids are passed as their decimal text by the bindings).
///
/// Cheap to clone (shared string). Compared and hashed by content.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// Makes a request id from text.
    pub fn new(id: impl AsRef<str>) -> Self {
        RequestId(Arc::from(id.as_ref()))
    }

    /// The id's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Checks the id is usable: non-empty and at most [`MAX_REQUEST_ID_LEN`] bytes.
    // A String error kept: public; callers wrap the reason into their own error.
    pub fn validate(&self) -> Result<(), String> {
        if self.0.is_empty() {
            return Err("request id is empty".into());
        }
        if self.0.len() > MAX_REQUEST_ID_LEN {
            return Err(format!(
                "request id is {} bytes, the limit is {MAX_REQUEST_ID_LEN}",
                self.0.len()
            ));
        }
        Ok(())
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        RequestId::new(s)
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        RequestId(Arc::from(s))
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({:?})", &*self.0)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The id of a registered memory region within one engine. Ids are assigned by the engine at
/// registration and travel in the handshake descriptor; a peer names memory only by these ids.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RegionId(pub u32);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region#{}", self.0)
    }
}

/// Index of a KV-cache block within a worker's cache (the engine's block-table entry).
pub type BlockId = u32;
