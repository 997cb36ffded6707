//! The reader's side of a same-host copy it makes itself: the prefill's hold table and host
//! regions, mapped read-only once per session (`SHARE`), its own receipt page there, and the
//! copy of one request's bytes checked against the table (`crate::holds`): kept only when the
//! hold's word did not move from before the first byte to after the last, and the receipt was
//! signed before the word moved (or the prefill counted it). No round trip to the prefill; it
//! hears of the read by its `Done`, sent without waiting for an answer, or by the receipt when
//! that `Done` is lost.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::holds::{Found, HoldTable, ReceiptPage};
use crate::ids::{RegionId, RequestId};
use crate::memory::PeerMemory;
use crate::shm::SharedMap;
use crate::transport::{ConfirmAsk, ReadDone, ReadOp, RequestCtl};

/// Bytes a reader copies on its own thread; larger copies run on a blocking thread.
const INLINE_COPY_BYTES: u64 = 256 << 10;

/// What this session mapped of the prefill's memory: `None` where the prefill refused to share
/// (device memory, memory registered from a caller's pointer, no table), so its reads go to the
/// prefill's copy without asking again.
#[derive(Default)]
pub(super) struct Views {
    table: Option<Option<Signed>>,
    regions: HashMap<RegionId, Option<Arc<PeerMemory>>>,
}

/// The prefill's hold table and this reader's receipt page in it.
pub(super) type Signed = (Arc<HoldTable>, Arc<ReceiptPage>);

/// The prefill's hold table, this reader's receipt page, and the source region of each op,
/// mapped.
pub(super) type Mapped = (Signed, Vec<Arc<PeerMemory>>);

/// How long a reader whose hold ended between its receipt and its last look waits for the
/// prefill's verdict (written right after the end, under the same lock).
const VERDICT_WAIT: Duration = Duration::from_millis(50);

/// What to map, from a `SHARE` answer: the read-only descriptor and the file's length, or
/// `None` when the prefill refused.
pub(super) type Shared = Option<(OwnedFd, u64)>;

impl Views {
    /// Whether the table is still to be asked for.
    pub(super) fn table_unknown(&self) -> bool {
        self.table.is_none()
    }

    /// Maps the table and the receipt page the prefill shared (or records that it did not
    /// share both: no copy here without a receipt).
    pub(super) fn set_table(&mut self, table: Shared, receipts: Shared) {
        let table = table.and_then(|(fd, len)| {
            let map = SharedMap::open_peer_readonly(fd, len).ok()?;
            HoldTable::reader(map).map(Arc::new)
        });
        let receipts = receipts.and_then(|(fd, len)| {
            let map = SharedMap::open_peer(fd, len).ok()?;
            ReceiptPage::reader(map).map(Arc::new)
        });
        self.table = Some(table.zip(receipts));
    }

    /// The regions of `ops` still to be asked for.
    pub(super) fn unknown_regions(&self, ops: &[ReadOp]) -> Vec<RegionId> {
        let mut out: Vec<RegionId> = ops
            .iter()
            .map(|o| o.remote_region)
            .filter(|r| !self.regions.contains_key(r))
            .collect();
        out.sort_unstable_by_key(|r| r.0);
        out.dedup();
        out
    }

    /// Maps a region the prefill shared (or records that it did not).
    pub(super) fn set_region(&mut self, id: RegionId, shared: Shared) {
        let mem = shared.and_then(|(fd, len)| PeerMemory::open_host_readonly(fd, len).ok());
        self.regions.insert(id, mem.map(Arc::new));
    }

    /// The table and every source region of `ops`, when all are mapped.
    pub(super) fn of(&self, ops: &[ReadOp]) -> Option<Mapped> {
        let signed = self.table.clone().flatten()?;
        let sources = ops
            .iter()
            .map(|o| self.regions.get(&o.remote_region).cloned().flatten())
            .collect::<Option<Vec<_>>>()?;
        Some((signed, sources))
    }
}

/// Copies `ops` from the prefill's `mapped` memory when its table holds request `id` live
/// (under the token `ask` names, if any) granting exactly the blocks the read names: the read,
/// confirmed by the table and the receipt, or `None` when it must go to the prefill's copy
/// (not in the table, or other blocks: the prefill then serves it, checking each range
/// against its grant, or says why not).
pub(super) async fn copy_here(
    ((table, receipts), sources): Mapped,
    id: &RequestId,
    ask: ConfirmAsk,
    ops: &[ReadOp],
    ctl: &Arc<RequestCtl>,
) -> Result<Option<ReadDone>> {
    let Some(found) = table.find(id, ask.hold, ask.blocks) else {
        return Ok(None);
    };
    let bytes: u64 = ops.iter().map(|o| o.local.len()).sum();
    let pieces: Vec<(Arc<PeerMemory>, ReadOp)> =
        sources.into_iter().zip(ops.iter().cloned()).collect();
    if bytes <= INLINE_COPY_BYTES {
        copy(&pieces, ctl)?;
    } else {
        let ctl = ctl.clone();
        tokio::task::spawn_blocking(move || copy(&pieces, &ctl))
            .await
            .map_err(|e| Error::Protocol(format!("the copy task: {e}")))??;
    }
    let (confirmed, tell_received) = verdict(&table, &receipts, found).await;
    Ok(Some(ReadDone {
        work_requests: 0,
        confirmed: Some(confirmed),
        tell_received,
    }))
}

/// Copies every piece into its local span, under the request's write guard (a cancel waits
/// for it, and none starts after one).
fn copy(pieces: &[(Arc<PeerMemory>, ReadOp)], ctl: &RequestCtl) -> Result<()> {
    ctl.guarded(
        || {
            pieces
                .iter()
                .try_for_each(|(src, op)| src.read_into(op.remote_offset, &op.local))
        },
        || Err(Error::Cancelled("copying on the same host".into())),
    )
}

/// Whether the copy stands, and whether the prefill is still to hear of it by a `Done`: the
/// hold's word did not move while it ran, and the receipt was signed before the word moved,
/// or the prefill counted the receipt when it ended the hold.
async fn verdict(
    table: &HoldTable,
    receipts: &ReceiptPage,
    found: Found,
) -> (std::result::Result<Duration, Refusal>, bool) {
    if !table.unchanged(found) {
        return (Err(moved()), false);
    }
    receipts.sign(found);
    if table.unchanged(found) {
        // How long the hold had been held is the prefill's to know; the table does not say.
        return (Ok(Duration::ZERO), true);
    }
    // The hold ended between the two looks: the prefill saw the receipt or not, and says.
    let deadline = tokio::time::Instant::now() + VERDICT_WAIT;
    loop {
        match table.outcome(found) {
            Some(true) => return (Ok(Duration::ZERO), false),
            Some(false) => return (Err(moved()), false),
            None if tokio::time::Instant::now() >= deadline => {
                return (
                    Err(Refusal::new(
                        RefusalKind::NotHeld,
                        format!(
                            "the hold ended as its copy was signed for, and the prefill did not \
                             say within {VERDICT_WAIT:?} whether it counted the receipt"
                        ),
                    )),
                    false,
                )
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

fn moved() -> Refusal {
    Refusal::new(
        RefusalKind::NotHeld,
        "the hold ended or was made again while its blocks were being copied (its word in the \
         prefill's hold table moved)",
    )
}
