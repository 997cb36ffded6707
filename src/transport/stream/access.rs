//! Who may read what: the one place where both data servers (TCP and the same-host path)
//! decide it. A data connection proves an authenticated control session first, where the
//! engine has a key ([`super::proof`]); each request is then held to its grant
//! ([`authorize`]: every range exported, inside the request's blocks, at most
//! [`MAX_REQUEST_BYTES`] in all), claimed for its reader only once every check of the server
//! passed ([`Authorized::claim`]), and stopped when its hold ends while its bytes are still
//! being moved ([`still_granted`]). The servers do the I/O; nothing here reads or writes a
//! request's bytes.

use std::sync::Arc;
use std::time::Duration;

use super::frame::MAX_REQUEST_BYTES;
use super::staging::StagingPool;
use crate::auth::SessionSecret;
use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::gpu::{DeviceRuntime, GpuApi};
use crate::grant::Grant;
use crate::holds::HoldTable;
use crate::ids::{RegionId, RequestId};
use crate::memory::{Region, RegionSpan};
use crate::tp::Reader;

/// An authenticated control session, as the data servers see it: its secret and the reader
/// (engine id and TP rank) its handshake declared.
pub(crate) type DataSession = (SessionSecret, Arc<Reader>);

/// A data request's reader: its control session's id, and the reader that session declared.
pub(crate) type SessionReader = ([u8; 16], Arc<Reader>);

/// What the engine exports, and to whom: what every access decision reads.
pub(crate) trait Exports: Send + Sync + 'static {
    /// The exported region with this id, if any.
    fn region(&self, id: RegionId) -> Option<Arc<Region>>;
    /// Whether data connections must prove an authenticated control session.
    fn auth_required(&self) -> bool;
    /// The authenticated control session with this id, while it lives, and the reader it
    /// declared.
    fn data_session(&self, id: &[u8; 16]) -> Option<DataSession>;
    /// What reads of request `id` may touch: its grant; `None` when the engine serves open
    /// reads (no hold needed). `reader` is the reading engine, when the data connection proved
    /// its session. Refused (with the reason) when the request is not held for that reader.
    fn grant(
        &self,
        id: &RequestId,
        reader: Option<&Reader>,
    ) -> std::result::Result<Option<Arc<Grant>>, Refusal>;
    /// A read of request `id` by `reader` was served: it is one of the request's readers from
    /// now on.
    fn claim(&self, id: &RequestId, reader: &Reader);
    /// A request was served (`Some(bytes)`) or refused (`None`).
    fn served(&self, bytes: Option<u64>);
    /// Confirms a read whose data request asked for it (protocol 8), once its bytes were
    /// copied out: `Ok` (how long the request had been held) when the reader's control session
    /// `session` lives, `grant` (what the bytes were served from; `None` for open reads) has not
    /// ended, and the request is held for `reader` under `hold`; the reader then counts as done
    /// with it, as its `Done` would make it. Refused with the reason otherwise.
    fn confirm(&self, read: &ConfirmRead<'_>) -> std::result::Result<Duration, Refusal>;
}

/// A read to confirm with its data ([`Exports::confirm`]).
#[derive(Debug)]
pub(crate) struct ConfirmRead<'a> {
    /// The reader's control session.
    pub(crate) session: &'a [u8; 16],
    /// The reader that session declared.
    pub(crate) reader: &'a Reader,
    /// The request read.
    pub(crate) id: &'a RequestId,
    /// The hold the reader named, if any.
    pub(crate) hold: Option<u64>,
    /// What the bytes were served from (`None`: open reads).
    pub(crate) grant: Option<&'a Grant>,
}

/// Where a data request's reader comes from: the session its connection proved (engines with a
/// key), or the session the request names (engines without one). `None`: neither, and the
/// request is served as before protocol 8, for no reader in particular.
pub(crate) fn reader_of(
    exports: &dyn Exports,
    proven: Option<&SessionReader>,
    named: Option<&[u8; 16]>,
) -> std::result::Result<Option<SessionReader>, Refusal> {
    match (proven, named) {
        (Some(p), None) => Ok(Some(p.clone())),
        (Some(_), Some(_)) => Err(Refusal::new(
            RefusalKind::Malformed,
            "a data request on a connection that proved its session names another",
        )),
        (None, Some(id)) if !exports.auth_required() => match exports.data_session(id) {
            Some((_, reader)) => Ok(Some((*id, reader))),
            None => Err(Refusal::new(
                RefusalKind::NotHeld,
                "the data request names a control session that is not open (closed, or never \
                 opened with this engine)",
            )),
        },
        (None, Some(_)) => Err(Refusal::new(
            RefusalKind::Unauthenticated,
            "a data request names a session on a connection that proved none",
        )),
        (None, None) => Ok(None),
    }
}

/// Confirms `read` once its bytes were sent, or says why not; `None` when the request did not
/// ask. A request that asked without a reader (no session proved or named) is not confirmed.
pub(crate) fn confirmation(
    exports: &dyn Exports,
    reader: Option<&SessionReader>,
    id: &RequestId,
    hold: Option<u64>,
    grant: Option<&Grant>,
) -> std::result::Result<Duration, Refusal> {
    let Some((session, reader)) = reader else {
        return Err(Refusal::new(
            RefusalKind::Unauthenticated,
            "the data request named no control session to confirm for",
        ));
    };
    let read = ConfirmRead {
        session,
        reader,
        id,
        hold,
        grant,
    };
    exports.confirm(&read)
}

/// What the data servers need beyond the access decisions: where they move device memory
/// through.
pub(crate) trait DataServer: Exports {
    /// The staging buffers for device memory.
    fn staging(&self) -> &Arc<StagingPool>;
    /// The loaded runtime of `api` and the GPU to open a same-host reader's device memory on.
    fn device_runtime(&self, api: GpuApi) -> Option<(Arc<dyn DeviceRuntime>, i32)>;
    /// The table of live holds same-host readers copy against (`crate::holds`), if any.
    fn hold_table(&self) -> Option<Arc<HoldTable>>;
}

/// One range a reader asks for, in this engine's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Source {
    /// The exported region.
    pub(crate) region: RegionId,
    /// Where in it the range starts.
    pub(crate) offset: u64,
    /// Its length in bytes.
    pub(crate) len: u64,
}

/// A request that passed the access checks: its grant (`None` for open reads), its ranges as
/// exported spans, and their total length.
#[derive(Debug)]
pub(crate) struct Authorized {
    /// The request's grant, checked again while its bytes move ([`still_granted`]).
    pub(crate) grant: Option<Arc<Grant>>,
    /// Every range asked for, in order.
    pub(crate) spans: Vec<RegionSpan>,
    /// Their total length.
    pub(crate) total: u64,
}

impl Authorized {
    /// Makes `reader` one of request `id`'s readers. Call it only once every check of the
    /// request passed (the same-host server checks the destinations after [`authorize`]).
    pub(crate) fn claim(&self, exports: &dyn Exports, id: &RequestId, reader: Option<&Reader>) {
        if let (Some(_), Some(r)) = (&self.grant, reader) {
            exports.claim(id, r);
        }
    }
}

/// Decides whether `reader` (the engine its data connection proved, if any) may read
/// `sources` for request `id`: the request is held for it (unless the engine serves open
/// reads), every range is exported and inside the request's grant, and the whole is at most
/// [`MAX_REQUEST_BYTES`]. A refusal names only what the reader asked for.
pub(crate) fn authorize(
    exports: &dyn Exports,
    id: &RequestId,
    reader: Option<&Reader>,
    sources: impl Iterator<Item = Source>,
) -> std::result::Result<Authorized, Refusal> {
    let grant = exports.grant(id, reader)?;
    let (spans, total) = resolve(exports, grant.as_deref(), sources)?;
    Ok(Authorized {
        grant,
        spans,
        total,
    })
}

/// Resolves every range to an exported span inside `grant` (when there is one), or says which
/// one is refused and why.
fn resolve(
    exports: &dyn Exports,
    grant: Option<&Grant>,
    sources: impl Iterator<Item = Source>,
) -> std::result::Result<(Vec<RegionSpan>, u64), Refusal> {
    let mut spans = Vec::new();
    let mut total = 0u64;
    let mut checker = grant.map(Grant::checker);
    for (i, s) in sources.enumerate() {
        // The size cap first: it bounds the grant walk below too.
        total = total.saturating_add(s.len);
        if total > MAX_REQUEST_BYTES {
            return Err(Refusal::new(
                RefusalKind::Limit,
                format!("request asks for more than {MAX_REQUEST_BYTES} bytes"),
            ));
        }
        let not_exported = |why: String| Refusal::new(RefusalKind::NotExported, why);
        let region = exports
            .region(s.region)
            .ok_or_else(|| not_exported(format!("entry {i}: {} is not exported", s.region)))?;
        let span = RegionSpan::new(region, s.offset, s.len)
            .map_err(|err| not_exported(format!("entry {i}: {err}")))?;
        if let Some(c) = &mut checker {
            c.check(s.region, s.offset, s.len)
                .map_err(|why| Refusal::new(why.kind(), format!("entry {i}: {why}")))?;
        }
        spans.push(span);
    }
    Ok((spans, total))
}

/// Stops a response whose grant ended (its hold finished, failed or expired) while it was
/// being sent: the blocks may be reused from then on.
pub(crate) fn still_granted(live: Option<&Grant>) -> Result<()> {
    match live {
        Some(g) if g.is_ended() => Err(Error::Protocol(
            "the request's hold ended while its blocks were being sent".into(),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::layout::{KvLayout, TensorLayout};
    use crate::tp::TpRank;

    /// One exported region of 8 blocks of 100 bytes (stride 128); request "held" grants
    /// blocks 2 and 3 to reader "dec", "open" is served without a hold.
    struct Fake {
        region: Arc<Region>,
        grant: Arc<Grant>,
        claimed: Mutex<Vec<String>>,
    }

    fn fake() -> Fake {
        let layout = KvLayout {
            tokens_per_block: 16,
            dtype: "bf16".into(),
            tensors: vec![TensorLayout {
                name: "t".into(),
                region: RegionId(1),
                offset: 0,
                block_stride: 128,
                block_bytes: 100,
                num_blocks: 8,
                group: 0,
                heads: None,
                token_runs: None,
            }],
        };
        Fake {
            region: Arc::new(Region::allocate(RegionId(1), 1024, false).unwrap()),
            grant: Arc::new(Grant::new(Arc::new(layout), &[[2u32, 3]]).unwrap()),
            claimed: Mutex::new(Vec::new()),
        }
    }

    fn dec() -> Reader {
        Reader {
            engine: "dec".into(),
            tp: TpRank::SOLO,
        }
    }

    impl Exports for Fake {
        fn region(&self, id: RegionId) -> Option<Arc<Region>> {
            (id == RegionId(1)).then(|| self.region.clone())
        }
        fn auth_required(&self) -> bool {
            false
        }
        fn data_session(&self, _: &[u8; 16]) -> Option<DataSession> {
            None
        }
        fn grant(
            &self,
            id: &RequestId,
            reader: Option<&Reader>,
        ) -> std::result::Result<Option<Arc<Grant>>, Refusal> {
            match id.as_str() {
                "open" => Ok(None),
                "held" if reader.is_none_or(|r| r.engine == "dec") => Ok(Some(self.grant.clone())),
                _ => Err(Refusal::new(
                    RefusalKind::NotHeld,
                    format!("{id} is not held for this reader"),
                )),
            }
        }
        fn claim(&self, id: &RequestId, reader: &Reader) {
            let who = format!("{id} by {}", reader.engine);
            self.claimed.lock().unwrap().push(who);
        }
        fn served(&self, _: Option<u64>) {}
        fn confirm(&self, read: &ConfirmRead<'_>) -> std::result::Result<Duration, Refusal> {
            match read.grant {
                Some(g) if g.is_ended() => Err(Refusal::new(RefusalKind::NotHeld, "ended")),
                _ => Ok(Duration::from_micros(7)),
            }
        }
    }

    fn src(offset: u64, len: u64) -> Source {
        Source {
            region: RegionId(1),
            offset,
            len,
        }
    }

    /// Why `authorize` refuses, and what it says.
    fn refusal(
        f: &Fake,
        id: &str,
        reader: Option<&Reader>,
        sources: &[Source],
    ) -> (RefusalKind, String) {
        let id = RequestId::from(id);
        match authorize(f, &id, reader, sources.iter().copied()) {
            Ok(a) => panic!("authorized {:?}", a.spans.len()),
            Err(e) => (e.kind(), e.to_string()),
        }
    }

    #[test]
    fn granted_ranges_pass_whole_and_in_order() {
        let f = fake();
        let id = RequestId::from("held");
        let a = authorize(
            &f,
            &id,
            Some(&dec()),
            [src(256, 100), src(384, 50)].into_iter(),
        )
        .unwrap();
        assert_eq!((a.spans.len(), a.total), (2, 150));
        assert_eq!(a.spans[1].len(), 50);
        assert!(a.grant.is_some());
        assert!(
            f.claimed.lock().unwrap().is_empty(),
            "authorizing claims nothing"
        );
        a.claim(&f, &id, Some(&dec()));
        assert_eq!(*f.claimed.lock().unwrap(), ["held by dec"]);
    }

    #[test]
    fn each_refusal_names_what_was_asked() {
        let f = fake();
        let r = Some(dec());
        let held = |s: &[Source]| refusal(&f, "held", r.as_ref(), s);
        // Each names the entry it refuses (the kind says why).
        let (kind, text) = held(&[src(0, 100)]);
        assert_eq!(kind, RefusalKind::OutOfGrant, "{text}");
        assert!(text.starts_with("entry 0:"), "{text}");
        let (kind, text) = held(&[src(256, 100), src(256, 101)]);
        assert_eq!(kind, RefusalKind::NotExported, "padding: {text}");
        assert!(text.starts_with("entry 1:"), "{text}");
        let other = Source {
            region: RegionId(9),
            ..src(0, 1)
        };
        assert_eq!(held(&[other]).0, RefusalKind::NotExported);
        let (kind, text) = held(&[src(1000, 100)]);
        assert_eq!(
            kind,
            RefusalKind::NotExported,
            "past the region's end: {text}"
        );
        let over = [src(256, 100), src(0, MAX_REQUEST_BYTES)];
        assert_eq!(held(&over).0, RefusalKind::Limit);
        let stranger = Reader {
            engine: "other".into(),
            tp: TpRank::SOLO,
        };
        let refused = |id, r: Option<&Reader>| refusal(&f, id, r, &[src(256, 1)]).0;
        assert_eq!(refused("held", Some(&stranger)), RefusalKind::NotHeld);
        assert_eq!(refused("unknown", None), RefusalKind::NotHeld);
    }

    #[test]
    fn open_reads_check_the_exports_but_no_blocks_and_claim_nothing() {
        let f = fake();
        let id = RequestId::from("open");
        let a = authorize(&f, &id, Some(&dec()), [src(0, 1024)].into_iter()).unwrap();
        assert!(a.grant.is_none());
        a.claim(&f, &id, Some(&dec()));
        assert!(f.claimed.lock().unwrap().is_empty());
        assert_eq!(
            refusal(&f, "open", None, &[src(0, 1025)]).0,
            RefusalKind::NotExported
        );
    }

    #[test]
    fn a_grant_that_ended_stops_the_bytes() {
        let f = fake();
        assert!(still_granted(Some(&f.grant)).is_ok());
        assert!(still_granted(None).is_ok());
        f.grant.end();
        let e = still_granted(Some(&f.grant)).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
    }
}
