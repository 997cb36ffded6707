//! The engine handle, `kvlink_engine`, on its own: every module of functions taking an engine
//! (`engine.rs`, `layout.rs`, `tp.rs`, `messages.rs`) names it from here.

use kvlink::Engine;

/// A kvlink engine (one per worker process and tensor-parallel rank). Opaque: create it with
/// `kvlink_engine_start`, destroy it with `kvlink_engine_free`.
///
/// Every function taking an engine may be called from several threads at once, except
/// `kvlink_engine_free`, which must be the last call on it.
pub struct kvlink_engine {
    pub(crate) engine: Engine,
}
