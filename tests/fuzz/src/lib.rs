//! The fuzz targets' entry points (`../targets.rs`, also run over the corpora by
//! `tests/fuzz_corpus.rs`), as a library the cargo-fuzz binaries call.

#[path = "../targets.rs"]
mod targets;

pub use targets::*;
