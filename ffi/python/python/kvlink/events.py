"""KV-cache events for Python engines and routers, byte-compatible with vLLM, SGLang and ATOM.

An engine publishes each scheduler step's events; a router subscribes (batches come out in
sequence order, each once, gaps filled by replay, with explicit resync signals when it must
drop what it derived); a merger joins several engines' streams. Events are read with the GIL
held and encoded with it released; socket writes and replay answers run on kvlink's threads.

Events are dicts shaped like vLLM's event structs (``{"type": "BlockStored", "block_hashes":
[...], "parent_block_hash": ..., "token_ids": [...], "block_size": 16, "medium": "GPU", ...}``);
``Publisher.publish`` also takes vLLM's and SGLang's own event objects::

    from kvlink.events import Publisher, Subscriber

    pub = Publisher("tcp://*:5557", replay_endpoint="tcp://*:5558")
    pub.publish([{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                  "token_ids": list(range(16)), "block_size": 16, "medium": "GPU"}])

    sub = Subscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    for item in sub:
        if item["kind"] == "batch":
            index(item["events"])
        elif item["kind"] == "resync":   # publisher restarted, or history lost
            drop_state()

``Index`` is what a KV-aware router builds from the streams: which engine holds which blocks
(per DP rank, medium and KV-cache group), and how many of a prompt's leading blocks each has,
never counting a block it cannot vouch for (after lost history the engine's older blocks are
withheld; a publisher restart drops them)::

    from kvlink.events import Index

    index = Index()
    for item in sub:
        index.apply("engine-0", item)
    best = index.overlap_tokens(prompt_tokens, block_size=16)[:1]

``PageSplitter`` turns a stored run of tokens into fixed-size pages with chained hashes and
``token_offset`` (SGLang's scheme, or vLLM-style 64-bit hashes) for consumers that index
fixed-size blocks only.
"""

from ._kvlink import EventIndex as Index
from ._kvlink import EventMerger as Merger
from ._kvlink import EventPublisher as Publisher
from ._kvlink import EventSubscriber as Subscriber
from ._kvlink import PageSplitter

__all__ = ["Index", "Merger", "PageSplitter", "Publisher", "Subscriber"]
