//! The page splitter: a stored run of tokens becomes fixed-size block entries (one
//! `BlockStored` per page of `block_size` tokens), each page's parent being the previous page,
//! with `token_offset` set and a partial tail page allowed, so consumers that understand only
//! fixed-size blocks (Dynamo's indexer) can use the stream.
//!
//! Page digests are chained: `digest = SHA-256(previous digest (32 bytes) || tokens as u32
//! little-endian)`, the first page of a root having no previous digest (SGLang's scheme). The
//! hash published per page is derived from the digest by the chosen [`PageHash`].

use sha2::{Digest, Sha256};

use super::wire::{BlockHash, BlockStored};

/// How a page digest becomes the published block hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageHash {
    /// SGLang: the first 8 bytes of the digest, big-endian, as a signed integer.
    SglangI64,
    /// vLLM-style integer: the low 64 bits of the digest (its last 8 bytes, big-endian),
    /// unsigned.
    VllmU64,
}

impl PageHash {
    /// The published hash of a digest.
    pub fn of(self, digest: &[u8; 32]) -> BlockHash {
        match self {
            PageHash::SglangI64 => {
                BlockHash::I64(i64::from_be_bytes(digest[..8].try_into().expect("8 bytes")))
            }
            PageHash::VllmU64 => BlockHash::U64(u64::from_be_bytes(
                digest[24..].try_into().expect("8 bytes"),
            )),
        }
    }
}

/// The chained digest of one page.
pub fn page_digest(previous: Option<&[u8; 32]>, tokens: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    if let Some(p) = previous {
        h.update(p);
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Splits runs of stored tokens into fixed-size pages.
#[derive(Debug, Clone)]
pub struct PageSplitter {
    block_size: u32,
    hash: PageHash,
}

/// The pages of one run, and the digest to chain the next run from.
#[derive(Debug, Clone, PartialEq)]
pub struct Pages {
    /// One `BlockStored` per page, in order.
    pub events: Vec<BlockStored>,
    /// Digest of the last page (the parent of whatever follows).
    pub last_digest: Option<[u8; 32]>,
}

impl PageSplitter {
    /// A splitter for pages of `block_size` tokens (at least 1).
    pub fn new(block_size: u32, hash: PageHash) -> PageSplitter {
        PageSplitter {
            block_size: block_size.max(1),
            hash,
        }
    }

    /// Splits `tokens`, which start at sequence position `token_offset` and follow the page
    /// whose digest is `parent` (None for a root), into pages; `medium` is copied into each.
    pub fn split(
        &self,
        parent: Option<&[u8; 32]>,
        tokens: &[u32],
        token_offset: u64,
        medium: Option<&str>,
    ) -> Pages {
        let mut events = Vec::with_capacity(tokens.len().div_ceil(self.block_size as usize));
        let mut prev = parent.copied();
        for (i, page) in tokens.chunks(self.block_size as usize).enumerate() {
            let digest = page_digest(prev.as_ref(), page);
            events.push(BlockStored {
                block_hashes: vec![self.hash.of(&digest)],
                parent_block_hash: prev.as_ref().map(|p| self.hash.of(p)),
                token_ids: page.to_vec(),
                block_size: page.len() as u32,
                medium: medium.map(str::to_string),
                token_offset: Some(token_offset + (i as u64) * u64::from(self.block_size)),
                ..BlockStored::default()
            });
            prev = Some(digest);
        }
        Pages {
            events,
            last_digest: prev,
        }
    }
}
