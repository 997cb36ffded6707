//! The transfer calls of the engine API: reads (decode side) and holds (prefill side), with
//! their cancels, releases and rejections. Reads may draw on a prefill of another TP size and
//! carry block ids per block group.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::submit::submit_here;
use super::Engine;
use crate::config::check_duration;
use crate::control::messages::Message;
use crate::error::{Error, Result};
use crate::ids::{BlockId, RequestId};
use crate::layout::KvLayout;
use crate::plan;
use crate::session::{self, FollowJob, ReadJob, Source};
use crate::tp::{self, TpRank};

/// Where a read takes its blocks from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadFrom {
    /// One engine, at its handshake address: a prefill rank this engine pairs with
    /// ([`tp_sources`]; with the same TP size, the same rank), refused otherwise once its
    /// descriptor is known, and it must hold every KV head this engine needs (a prefill of the
    /// same or a smaller TP size does; so does any rank for a layout without heads, such as
    /// MLA's).
    Engine(String),
    /// Every rank of the prefill's TP group, by handshake address in rank order. This engine
    /// reads the ranks its own rank needs (`tp_sources`): one rank when the decode's TP size
    /// is the same or a multiple of the prefill's (its share of the heads), several when the
    /// prefill's is a multiple of the decode's (their heads side by side in each block;
    /// tensors without heads shared out among them). Each rank read must answer with that rank
    /// and that group size.
    TpGroup(Vec<String>),
}

/// One read (decode side): which blocks, from where, under which ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// This engine's id for the read: completion, reports, [`Engine::cancel`].
    pub id: RequestId,
    /// The id the prefill holds the request under (its grant, the done and abort notices);
    /// usually `id`.
    pub remote_id: RequestId,
    /// The engine or the prefill TP group to read from.
    pub from: ReadFrom,
    /// This engine's block ids, one list per block group of its layout.
    pub local: Vec<Vec<BlockId>>,
    /// The prefill's block ids, paired one to one with `local`, group by group (or covering
    /// the same tokens, when its blocks hold another number of tokens).
    pub remote: Vec<Vec<BlockId>>,
    /// Tokens per block of the prefill when they differ from this engine's (one a multiple of
    /// the other): `local` and `remote` then list the blocks of the same run of tokens, each in
    /// its own size, and each prefill block is read token range by token range (a unit of
    /// the smaller size at a time). `None`: the same size as this engine's; a prefill of
    /// another size is then refused.
    pub remote_tokens_per_block: Option<u32>,
    /// Per block group, the tokens of the first block of the side with the larger blocks (the
    /// prefill's or this engine's) before the first one read: 0, or a multiple of the smaller
    /// block size (the read starts inside a block of the larger size: this engine's cached
    /// prefix ends inside a prefill block, or a sliding window starts inside a block). Empty: 0
    /// for every group.
    pub first_tokens: Vec<u32>,
    /// The token of the prefill's hold (its `hold_*` calls return it; it travels in the
    /// transfer parameters): the read announces it and its `Done` and `Abort` name it, so only
    /// that hold confirms the read; a later hold of a reused `remote_id` never does. `None`:
    /// whichever hold of `remote_id` the prefill has when the notices arrive.
    pub hold: Option<u64>,
}

/// One hold (prefill side): a request's blocks kept for its readers. See
/// [`Engine::hold`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRequest {
    /// The request id readers name.
    pub id: RequestId,
    /// Block ids per block group of this engine's layout.
    pub blocks: Vec<Vec<BlockId>>,
    /// The only engine allowed to read and confirm; `None`: the decode ranks that read this
    /// rank, admitted as they read.
    pub reader: Option<String>,
    /// How long to wait for the readers; `None`: the engine's `abort_timeout`.
    pub abort_timeout: Option<Duration>,
    /// The hold's token (non-zero), when the caller picks it: a scheduler that holds one
    /// request on every TP rank gives them all the same one, and sends it in the transfer
    /// parameters. `None`: the engine picks one, distinct for every hold it makes.
    pub token: Option<u64>,
}

/// A progressive read (decode side; see [`Engine::follow`]): this engine's blocks for the
/// whole request, read part by part as the prefill at `peer` holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowRequest {
    /// The prefill's handshake address.
    pub peer: String,
    /// The id this engine tracks and reports the read under.
    pub id: RequestId,
    /// The id the prefill holds the request under.
    pub remote_id: RequestId,
    /// This engine's blocks per block group, for the whole request after the first `skip`
    /// of the prefill's, in the order the prefill's blocks pair with them (its hold's order).
    pub local: Vec<Vec<BlockId>>,
    /// Per block group, how many of the prefill's first blocks this engine does not read
    /// (it has their tokens already: a prefix it cached); empty: none. The hold's parts still
    /// count them, and its confirmation covers the blocks read.
    pub skip: Vec<u32>,
    /// Tokens per block of the prefill; `None`: the same as this engine's.
    pub remote_tokens_per_block: Option<u32>,
    /// The prefill's hold token, when known (the read is then of that hold only).
    pub hold: Option<u64>,
    /// How long to wait for the first part (the prefill may not hold the request yet);
    /// `None`: the request timeout.
    pub first_part_timeout: Option<Duration>,
    /// How long to wait for each later part; `None`: the request timeout.
    pub part_timeout: Option<Duration>,
}

impl FollowRequest {
    /// A progressive read of request `id` (the same id on both sides) from the prefill at
    /// `peer` into `local` blocks (one block group), with the engine's timeouts.
    pub fn blocks(peer: impl Into<String>, id: impl Into<RequestId>, local: &[BlockId]) -> Self {
        let id = id.into();
        FollowRequest {
            peer: peer.into(),
            remote_id: id.clone(),
            id,
            local: vec![local.to_vec()],
            skip: Vec::new(),
            remote_tokens_per_block: None,
            hold: None,
            first_part_timeout: None,
            part_timeout: None,
        }
    }
}

impl HoldRequest {
    /// A hold of `blocks` (one block group) under `id`, for the readers that read this rank,
    /// with the engine's abort timeout and a token it picks.
    pub fn blocks(id: impl Into<RequestId>, blocks: &[BlockId]) -> HoldRequest {
        HoldRequest {
            id: id.into(),
            blocks: vec![blocks.to_vec()],
            reader: None,
            abort_timeout: None,
            token: None,
        }
    }
}

impl ReadRequest {
    /// A read of `remote` blocks of the engine at `peer` into `local` blocks, one block group,
    /// under one id on both sides.
    pub fn blocks(
        peer: impl Into<String>,
        id: impl Into<RequestId>,
        local: &[BlockId],
        remote: &[BlockId],
    ) -> ReadRequest {
        let id = id.into();
        ReadRequest {
            remote_id: id.clone(),
            id,
            from: ReadFrom::Engine(peer.into()),
            local: vec![local.to_vec()],
            remote: vec![remote.to_vec()],
            remote_tokens_per_block: None,
            first_tokens: Vec::new(),
            hold: None,
        }
    }
}

/// The prefill ranks that rank `decode` of a decode's TP group reads from a prefill of
/// `prefill_size` ranks (what [`ReadFrom::TpGroup`] reads), or why the sizes cannot pair (one
/// must be a multiple of the other).
pub fn tp_sources(decode: TpRank, prefill_size: u32) -> Result<std::ops::Range<u32>> {
    Ok(tp::sources(decode, prefill_size)?)
}

impl Engine {
    /// Starts reading `remote_blocks` of the engine at `peer` (its handshake address) into
    /// `local_blocks`, pairwise, for every tensor of the layout. Returns at once; the outcome
    /// arrives through [`get_finished`](Engine::get_finished). The layout must have one block
    /// group; [`read`](Engine::read) takes several, and a prefill of another TP size.
    ///
    /// Errors returned here are immediate refusals (bad ids, no layout); everything after the
    /// call (handshake, transfer, deadline) ends as a finished or failed entry.
    pub fn read_blocks(
        &self,
        peer: &str,
        id: impl Into<RequestId>,
        local_blocks: &[BlockId],
        remote_blocks: &[BlockId],
    ) -> Result<()> {
        self.read(ReadRequest::blocks(peer, id, local_blocks, remote_blocks))
    }

    /// [`read_blocks`](Engine::read_blocks) of a request the prefill holds under another id:
    /// `remote_id` is the prefill's id (its grant, the done/abort notices), `id` this engine's
    /// own (completion, reports, [`cancel`](Engine::cancel)). Lets a decode keep its
    /// scheduler's ids while the prefill keeps its own.
    pub fn read_blocks_as(
        &self,
        peer: &str,
        id: impl Into<RequestId>,
        remote_id: impl Into<RequestId>,
        local_blocks: &[BlockId],
        remote_blocks: &[BlockId],
    ) -> Result<()> {
        let mut r = ReadRequest::blocks(peer, id, local_blocks, remote_blocks);
        r.remote_id = remote_id.into();
        self.read(r)
    }

    /// Starts a read ([`ReadRequest`]): block ids per block group, from one engine or from the
    /// prefill's TP group. Returns at once; the outcome arrives through
    /// [`get_finished`](Engine::get_finished), once every prefill rank read delivered its part
    /// (or one failed: the others stop, and each is told). Immediate refusals: bad ids or
    /// block lists, no layout, TP sizes that cannot pair, a session already up whose layout
    /// does not fit.
    pub fn read(&self, req: ReadRequest) -> Result<()> {
        let ReadRequest {
            id,
            remote_id,
            from,
            local,
            remote,
            remote_tokens_per_block,
            first_tokens,
            hold,
        } = req;
        let layout = self.read_layout(&id, &remote_id)?;
        let remote_tokens = remote_tokens_per_block.unwrap_or(layout.tokens_per_block);
        plan::check_local_blocks(&layout, &local, &remote, remote_tokens, &first_tokens)?;
        let ours = TpRank::new(self.shared.config().tp_rank, self.shared.config().tp_size);
        let sources = match from {
            ReadFrom::Engine(peer) => vec![Source { peer, rank: None }],
            ReadFrom::TpGroup(peers) => {
                let size = u32::try_from(peers.len())
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "a prefill TP group of {} addresses (1 or more, one per rank)",
                            peers.len()
                        ))
                    })?;
                let range = tp_sources(ours, size)?;
                range
                    .clone()
                    .map(|r| Source {
                        peer: peers[r as usize].clone(),
                        rank: Some((TpRank::new(r, size), range.clone())),
                    })
                    .collect()
            }
        };
        for s in &sources {
            if let Some(conn) = self.sessions.ready_conn(&s.peer) {
                session::check_block_size(&conn.descriptor.layout, remote_tokens)?;
                plan::check_blocks(
                    &layout,
                    &conn.descriptor.layout,
                    &local,
                    &remote,
                    &first_tokens,
                )?;
            }
        }
        let now = Instant::now();
        let rt = self.runtime.read();
        let rt = rt.as_ref().ok_or(Error::Shutdown)?;
        self.shared
            .completions()
            .update(|t| t.start_recv(id.clone(), now))?;
        let job = ReadJob {
            sources,
            id,
            remote_id,
            local,
            remote,
            remote_tokens,
            first_tokens,
            hold,
            confirm_with_data: true,
            tensors: None,
            started: now,
            deadline: tokio::time::Instant::from_std(now + self.shared.config().request_timeout),
        };
        self.launch(rt, job, &layout);
        Ok(())
    }

    /// Starts a progressive read ([`FollowRequest`]): the read follows the prefill's hold of
    /// `remote_id` (held with [`hold_growing`](Engine::hold_growing), or a plain hold), which
    /// the prefill need not hold yet, and reads each part as the prefill holds it, into this
    /// engine's blocks in order. It is reported received (in
    /// [`get_finished`](Engine::get_finished)) only once the prefill sealed the hold, every
    /// part is here and the prefill confirmed that it held them throughout; failed when the
    /// hold ends first, when the first part or a later one does not come within its timeout,
    /// or at the request timeout. One prefill engine (TP groups read with
    /// [`read`](Engine::read)); [`cancel`](Engine::cancel) stops it.
    pub fn follow(&self, req: FollowRequest) -> Result<()> {
        let layout = self.read_layout(&req.id, &req.remote_id)?;
        let remote_tokens = req
            .remote_tokens_per_block
            .unwrap_or(layout.tokens_per_block);
        if remote_tokens != layout.tokens_per_block {
            return Err(Error::invalid(
                "a progressive read pairs blocks one to one: the prefill's tokens per block must \
                 be this engine's",
            ));
        }
        // The prefill's blocks are not known yet: the local ones are checked against
        // themselves.
        plan::check_local_blocks(&layout, &req.local, &req.local, remote_tokens, &[])?;
        let skip = follow_skip(&req.skip, req.local.len())?;
        let timeout = self.shared.config().request_timeout;
        let (first_wait, between) = (
            req.first_part_timeout.unwrap_or(timeout),
            req.part_timeout.unwrap_or(timeout),
        );
        check_duration("first_part_timeout", first_wait)?;
        check_duration("part_timeout", between)?;
        let now = Instant::now();
        let rt = self.runtime.read();
        let rt = rt.as_ref().ok_or(Error::Shutdown)?;
        self.shared
            .completions()
            .update(|t| t.start_recv(req.id.clone(), now))?;
        let read = ReadJob {
            sources: vec![Source {
                peer: req.peer,
                rank: None,
            }],
            id: req.id,
            remote_id: req.remote_id,
            local: req.local,
            remote: Vec::new(),
            remote_tokens,
            first_tokens: Vec::new(),
            hold: req.hold,
            confirm_with_data: false,
            tensors: None,
            started: now,
            deadline: tokio::time::Instant::from_std(now + timeout),
        };
        let job = FollowJob {
            read,
            skip,
            first_wait,
            between,
        };
        rt.spawn(session::run_follow(self.sessions.clone(), job));
        Ok(())
    }

    /// The layout a read of `id` (the prefill's `remote_id`) reads into, once both ids are
    /// valid.
    fn read_layout(&self, id: &RequestId, remote_id: &RequestId) -> Result<Arc<KvLayout>> {
        id.validate().map_err(Error::InvalidArgument)?;
        remote_id
            .validate()
            .map_err(|e| Error::invalid(format!("remote request id: {e}")))?;
        self.shared
            .layout()
            .ok_or_else(|| Error::invalid("set a KV layout before reading blocks"))
    }

    /// Starts `job`'s transfer task. A small read on a session that is up is submitted on the
    /// caller's thread: its first poll plans it and writes its data request before this
    /// returns (no wake-up of a runtime thread between the call and the request on the wire);
    /// the rest runs on the runtime. Larger reads go to the runtime at once (posting them may
    /// take a while).
    fn launch(&self, rt: &tokio::runtime::Runtime, job: ReadJob, layout: &KvLayout) {
        let inline = job.sources.len() == 1
            && read_bytes(layout, &job.local) <= self.shared.config().batch_bytes
            && self.sessions.ready_conn(&job.sources[0].peer).is_some();
        let task = session::run_read(self.sessions.clone(), job);
        if inline {
            submit_here(rt, task);
        } else {
            rt.spawn(task);
        }
    }

    /// Holds request `id`'s `blocks` for its readers (prefill side) and grants them to them:
    /// they may read those blocks, and only those, under this request id (TCP; see
    /// docs/security.md for RDMA). The layout must have one block group
    /// ([`hold_groups`](Engine::hold_groups) takes several). The readers are the decode ranks
    /// that read this rank: one when the decode's TP size is the same or smaller, the decode's
    /// ratio when it is larger (each reads its share of the heads). The request finishes
    /// sending when every reader confirmed, fails when one aborts, and expires after the abort
    /// timeout. Engines become readers as they read or confirm;
    /// [`hold_blocks_for`](Engine::hold_blocks_for) names the one reader instead.
    /// Returns the hold's token (see [`HoldRequest::token`]).
    pub fn hold_blocks(&self, id: impl Into<RequestId>, blocks: &[BlockId]) -> Result<u64> {
        self.hold_groups(id, &[blocks])
    }

    /// [`hold_blocks`](Engine::hold_blocks) with block ids per block group.
    pub fn hold_groups<B: AsRef<[BlockId]>>(
        &self,
        id: impl Into<RequestId>,
        blocks: &[B],
    ) -> Result<u64> {
        self.hold_groups_for(id, blocks, None, None)
    }

    /// [`hold_blocks`](Engine::hold_blocks) with the reader's engine id (`reader`: only that
    /// engine may read and confirm) and a specific abort timeout (`None`: the engine's).
    pub fn hold_blocks_for(
        &self,
        id: impl Into<RequestId>,
        blocks: &[BlockId],
        reader: Option<&str>,
        abort_timeout: Option<Duration>,
    ) -> Result<u64> {
        self.hold_groups_for(id, &[blocks], reader, abort_timeout)
    }

    /// [`hold_blocks_for`](Engine::hold_blocks_for) with block ids per block group.
    pub fn hold_groups_for<B: AsRef<[BlockId]>>(
        &self,
        id: impl Into<RequestId>,
        blocks: &[B],
        reader: Option<&str>,
        abort_timeout: Option<Duration>,
    ) -> Result<u64> {
        self.hold(HoldRequest {
            id: id.into(),
            blocks: blocks.iter().map(|b| b.as_ref().to_vec()).collect(),
            reader: reader.map(str::to_string),
            abort_timeout,
            token: None,
        })
    }

    /// Holds a request's blocks for its readers ([`HoldRequest`]; the `hold_*` calls are
    /// shorthands for it) and returns the hold's token: the caller's, or one the engine picked.
    /// Readers that name the token ([`ReadRequest::hold`]) are matched to this hold only.
    pub fn hold(&self, req: HoldRequest) -> Result<u64> {
        let timeout = req
            .abort_timeout
            .unwrap_or(self.shared.config().abort_timeout);
        check_duration("abort_timeout", timeout)?;
        self.shared
            .hold(req.id, &req.blocks, req.reader, timeout, req.token)
    }

    /// Holds a request whose blocks are not all final yet (prefill side): as
    /// [`hold`](Engine::hold), but `req.blocks` may be empty, the hold grows by
    /// [`extend_hold`](Engine::extend_hold) as blocks become final, and confirms no read
    /// before [`seal_hold`](Engine::seal_hold). Readers that follow the request
    /// ([`follow`](Engine::follow)) read each part as it is held. The abort timeout runs from
    /// now. Returns the hold's token.
    pub fn hold_growing(&self, req: HoldRequest) -> Result<u64> {
        let timeout = req
            .abort_timeout
            .unwrap_or(self.shared.config().abort_timeout);
        check_duration("abort_timeout", timeout)?;
        self.shared
            .hold_as(req.id, &req.blocks, req.reader, timeout, req.token, false)
    }

    /// Adds `blocks` (per block group, in order after the blocks held so far; final from now
    /// on) to request `id`'s growing hold, and tells its followers. Refused for a request not
    /// held, a sealed hold, and blocks it holds already.
    pub fn extend_hold<B: AsRef<[BlockId]>>(
        &self,
        id: impl Into<RequestId>,
        blocks: &[B],
    ) -> Result<()> {
        self.extend(id.into(), blocks, None)
    }

    /// [`extend_hold`](Engine::extend_hold) by tensors (the layout's, in its order) rather
    /// than whole blocks, for a step whose layers become final one group at a time: `blocks`
    /// with their tensors `tensors` (from 0), then, with no block, the same blocks' next
    /// tensors (from where the last ended) until the last one; new blocks and the seal only
    /// after that. Followers read each part's tensors as they are told.
    pub fn extend_hold_tensors<B: AsRef<[BlockId]>>(
        &self,
        id: impl Into<RequestId>,
        blocks: &[B],
        tensors: std::ops::Range<u32>,
    ) -> Result<()> {
        self.extend(id.into(), blocks, Some(tensors))
    }

    fn extend<B: AsRef<[BlockId]>>(
        &self,
        id: RequestId,
        blocks: &[B],
        tensors: Option<std::ops::Range<u32>>,
    ) -> Result<()> {
        let blocks: Vec<Vec<BlockId>> = blocks.iter().map(|b| b.as_ref().to_vec()).collect();
        self.shared
            .completions()
            .update(|t| t.extend_hold(&id, &blocks, tensors))
    }

    /// Seals request `id`'s growing hold: it is complete, its readers may confirm their reads,
    /// and its followers are told.
    pub fn seal_hold(&self, id: impl Into<RequestId>) -> Result<()> {
        let id = id.into();
        self.shared.completions().update(|t| t.seal_hold(&id))
    }

    /// Cancels read `id` (decode side): nothing more is posted or written into its blocks,
    /// what is in flight is waited for (at most `io_timeout`), the read is reported failed with
    /// [`FailureCause::Cancelled`](crate::FailureCause::Cancelled), and the prefill is told
    /// (an `Abort`; every prefill rank it reads), so it frees its blocks at once. Returns
    /// `false` when no read with that id is in flight (it finished, or never started); returns
    /// at once, the report follows in [`get_finished`](Engine::get_finished).
    pub fn cancel(&self, id: impl Into<RequestId>) -> bool {
        self.shared.cancel_read(&id.into())
    }

    /// Prefill side: drops the hold of request `id` (aborted or preempted before any reader
    /// was told about it): its grant ends at once (a read in progress stops at its next write)
    /// and nothing is reported for it in [`get_finished`](Engine::get_finished). Returns
    /// whether it was held, once its blocks may be reused: when an RDMA reader pinned the hold
    /// as it posted its reads (`docs/protocol.md`, pins), that is when the reader's `Done` or
    /// `Abort` arrives, or its pin lapses, whichever is first: at most the engine's
    /// [`read_pin`](crate::EngineConfig::read_pin) after the pin, once per hold.
    pub fn release(&self, id: impl Into<RequestId>) -> bool {
        let id = id.into();
        self.shared.completions().release(&id)
    }

    /// Decode side: tells the prefill at `peer` that this engine will not read request
    /// `remote_id` (the prefill's id), so it frees the request's blocks now instead of at its
    /// abort timeout; for a request rejected or aborted before its read started. Returns at
    /// once; the notice goes out once the session to `peer` is up (within the connect and
    /// handshake timeouts), and is lost, with a log line, if it cannot be (refused at once when
    /// 1,024 messages already wait for that session). A read of that
    /// request in flight is [`cancel`](Engine::cancel)led instead. `hold` names the hold
    /// rejected (its token, from the transfer parameters), so a later hold of the same id is
    /// not touched; `None` ends whichever hold of `remote_id` the prefill has.
    pub fn reject(
        &self,
        peer: &str,
        remote_id: impl Into<RequestId>,
        hold: Option<u64>,
        reason: &str,
    ) -> Result<()> {
        let remote_id = remote_id.into();
        remote_id.validate().map_err(Error::InvalidArgument)?;
        let rt = self.runtime.read();
        let rt = rt.as_ref().ok_or(Error::Shutdown)?;
        let abort = Message::Abort {
            request_id: remote_id,
            reason: format!("rejected by the reader: {reason}"),
            hold,
        };
        self.sessions.post(rt.handle(), peer, abort)
    }
}

/// The bytes a read of `local` blocks (per block group) moves into this engine's layout, at
/// most: every tensor of a block's group, whole.
fn read_bytes(layout: &KvLayout, local: &[Vec<BlockId>]) -> u64 {
    layout
        .tensors
        .iter()
        .map(|t| {
            let blocks = local.get(t.group as usize).map_or(0, Vec::len);
            t.block_bytes.saturating_mul(blocks as u64)
        })
        .fold(0u64, u64::saturating_add)
}

/// A progressive read's blocks skipped per group (`skip`, one count per group of `groups`, or
/// none).
fn follow_skip(skip: &[u32], groups: usize) -> Result<Vec<usize>> {
    match skip.len() {
        0 => Ok(vec![0; groups]),
        n if n == groups => Ok(skip.iter().map(|&s| s as usize).collect()),
        n => Err(Error::invalid(format!(
            "skip names {n} block groups; the read has {groups}"
        ))),
    }
}
