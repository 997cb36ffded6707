"""kvlink's SGLang transfer backend: ``KvlinkKVManager``, ``KvlinkKVSender`` (prefill),
``KvlinkKVReceiver`` (decode), on SGLang's base classes.

kvlink pulls: the decode reads, the prefill holds. So the flow turns SGLang's around while
keeping every poll state where SGLang's schedulers expect it:

1. The decode receiver's ``send_metadata`` keeps the decode's page indices local and tells the
   prefill rank (a ``want`` message over kvlink's authenticated engine messages) how many pages
   it expects, its prefix, and whether it wants the aux row and state indices. Until that
   arrives the prefill sender polls ``Bootstrapping``; then ``WaitingForInput``.
2. Each ``KVSender.send`` (one per prefill chunk) holds the chunk's prefill pages for that decode
   engine only (``hold_blocks`` with the reader) and announces them (a ``chunk`` message). The
   decode reads each chunk into its own pages as it arrives, under its own request id. The last
   chunk also holds and announces the aux row and the state indices, each in its own index space:
   one kvlink engine per space (KV pages, aux rows, each state type), so every read stays
   block-granular and granted.
3. The sender polls ``Success`` once the decode confirmed every hold; the receiver once every
   read is in place. Any failure (a read, a hold expiring, an abort on either side, a timeout)
   fails both sides with the reason, and the other side is told (an ``abort`` message).

Every wait has a deadline: SGLang's bootstrap and waiting timeouts
(``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``), and
kvlink's request and abort timeouts for reads and holds.
"""

from __future__ import annotations

from kvlink.sglang.manager import KvlinkKVManager, KvlinkTransferError
from kvlink.sglang.receiver import KvlinkKVReceiver
from kvlink.sglang.sender import KvlinkKVSender

__all__ = ["KvlinkKVManager", "KvlinkKVReceiver", "KvlinkKVSender", "KvlinkTransferError"]
