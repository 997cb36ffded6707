"""The stand-in model the ATOM tests run in place of a real one: what a forward writes into
ATOM's KV cache for a token at a position, and the token it samples from the KV it reads.

Every KV element is ``(token + f(position, layer, K|V, global head, dim)) % 251`` (exact in
bf16) or, in an fp8 cache, ``(nibble + f(...)) % 16`` with the token's high nibble in even dims
and its low one in odd dims (exact in fp8 e4m3); scales are ``token * 1000 + g(...)`` (exact
in fp32). A forward reads back the whole
context from the cache (every layer, K, V, scales or latents), recovers each position's token
from it and checks every element; the sampled token is a function of all of them. So a decode
generates the same tokens as a single engine only when every byte it computes from is the
prefill's, for its own heads."""

from __future__ import annotations

from typing import List

MOD = 251
#: Prompt tokens must stay below ``MOD`` (a token is recovered from one KV element).
VOCAB = 240
#: What a forward samples when the KV it reads is not what the prefill wrote.
POISON = 1


def next_token(tokens: List[int]) -> int:
    """The token sampled after ``tokens`` (the whole context, prompt and generated)."""
    acc = len(tokens)
    for i, t in enumerate(tokens):
        acc = (acc * 31 + t * (i + 1)) % 1_000_003
    return acc % VOCAB + 3


def expected(prompt: List[int], max_tokens: int) -> List[int]:
    """The tokens a single engine generates for ``prompt`` (greedy)."""
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(ctx)
        out.append(t)
        ctx.append(t)
    return out


def modulus(dtype: str) -> int:
    """The element modulus for a KV cache of ATOM's ``kv_cache_dtype``."""
    return 16 if dtype == "fp8" else MOD


def encode(torch, tok, offsets, mod: int):
    """KV elements for tokens ``tok`` [n] at ``offsets`` [n, ..., dim]."""
    t = tok.view(-1, *([1] * (offsets.dim() - 1)))
    if mod == MOD:
        return (t + offsets) % MOD
    d = torch.arange(offsets.shape[-1], dtype=torch.int64)
    return (torch.where(d % 2 == 0, t >> 4, t & 15) + offsets) % mod


def decode(v0, v1, off0, off1, mod: int):
    """Tokens from the elements of dims 0 and 1 and their offsets (all [n])."""
    if mod == MOD:
        return (v0 - off0) % MOD
    return ((v0 - off0) % mod) * 16 + (v1 - off1) % mod


def kv_offsets(torch, pos, layer: int, kv: int, heads, dim: int):
    """``f`` for positions ``pos`` [n], heads ``heads`` (global indices) [H]: [n, H, dim]."""
    d = torch.arange(dim, dtype=torch.int64)
    return pos[:, None, None] * 7 + layer * 13 + kv * 5 + heads[None, :, None] * 3 + d[None, None, :]


def scale_values(torch, tok, pos, layer: int, kv: int, heads):
    """Scales for tokens ``tok`` at ``pos`` [n]: [n, H] float32."""
    v = tok[:, None] * 1000 + pos[:, None] * 3 + layer * 7 + kv + heads[None, :] * 11
    return v.to(torch.float32)


def latent_offsets(torch, pos, layer: int, dim: int):
    """``f`` for an MLA latent row: [n, dim]."""
    d = torch.arange(dim, dtype=torch.int64)
    return pos[:, None] * 7 + layer * 13 + d[None, :]
