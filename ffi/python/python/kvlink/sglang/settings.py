"""What kvlink's SGLang backend reads at start, before it makes an engine: SGLang's resolved
parallel layout and the DP group a rank registers under, the KV page layout and heads of the
model, the configurations it refuses, the address it listens on, its environment settings.
Read-only helpers; nothing here holds state.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import replace
from typing import Any

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode

from .. import core

logger = logging.getLogger(__name__)


def env_seconds(name: str, default: float) -> float:
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except Exception:  # noqa: BLE001 - older SGLang, or the variable unset
        return float(os.environ.get(name, default))


def env_flag(name: str) -> bool:
    try:
        from sglang.srt.environ import envs

        return bool(getattr(envs, name).get())
    except Exception:  # noqa: BLE001 - older SGLang, or the variable unset
        return os.environ.get(name, "").lower() in ("1", "true", "yes")


#: kvlink's settings (``kvlink.core``'s schema) in the environment, SGLang's place for them:
#: ``KVLINK_<FIELD>``, and ``KVLINK_HOST`` (a host; each engine takes an ephemeral port). The
#: key's variables are left to ``kvlink.Engine``, which reads them itself.
NAMES: dict[str, str | None] = {field: "KVLINK_" + field.upper() for field in core.FIELDS}
NAMES.update(listen="KVLINK_HOST", auth_key=None, auth_key_file=None)


def link() -> core.Settings:
    """kvlink's settings from the environment; ``ValueError`` names the variable at fault."""
    s = core.Settings.read(os.environ, NAMES, "the environment")
    return replace(s, port=0)


def node_address() -> str:
    """This node's address as SGLang finds it (loopback when it cannot)."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto

        return str(get_local_ip_auto())
    except Exception:  # noqa: BLE001
        return "127.0.0.1"


def gpu_pci(gpu_id: int | None) -> str | None:
    """The PCI address of CUDA device ``gpu_id`` (``0000:3b:00.0``), when there is one."""
    if gpu_id is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(int(gpu_id))
        # Read by name: torch's stubs leave the PCI ids out (CUDA builds have them).
        domain, bus, device = (int(getattr(p, f"pci_{k}_id")) for k in ("domain", "bus", "device"))
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    except Exception:  # noqa: BLE001 - no CUDA, or a torch without PCI ids
        return None


def layout_tag(desc: str) -> str:
    """``desc`` as a kvlink layout tag (at most 32 bytes): itself when short enough, else a
    digest of it (DeepSeek-V4 names its main and compressed KV layouts, well over 32 bytes)."""
    if len(desc.encode()) <= 32:
        return desc
    return "sgl-" + hashlib.blake2b(desc.encode(), digest_size=14).hexdigest()


PARALLEL_FIELDS = ("attn_tp_rank", "attn_tp_size", "attn_dp_rank", "attn_dp_size", "attn_cp_size", "pp_size", "dp_size")


def parallel() -> dict[str, Any]:
    """This rank's place as SGLang resolved it (``get_parallel()``: attention TP, DP and CP, PP,
    system DP), never guessed from raw arguments: ``--dwdp-size`` and context parallelism change
    them after parsing. A value SGLang has not published is an error at start."""
    from sglang.srt.runtime_context import get_parallel

    p, out = get_parallel(), dict[str, Any]()
    for name in PARALLEL_FIELDS:
        try:
            v = getattr(p, name)
        except Exception as e:  # noqa: BLE001 - SGLang raises several kinds for "not published"
            raise ValueError(f"kvlink: SGLang's parallel context has no {name}: {e}") from None
        if type(v) is not int or v < 0:
            raise ValueError(f"kvlink: SGLang's parallel context has {name}={v!r}")
        out[name] = v
    for name, default in (("load_balance_method", "follow_bootstrap_room"), ("enable_kv_cache_sharding", False)):
        try:
            out[name] = getattr(p, name)
        except Exception:  # noqa: BLE001 - an SGLang without the option
            out[name] = default
    return out


def dp_group(par: dict[str, Any], args: KVArgs) -> tuple:
    """``(rank, count)`` of the prefill group a room is routed to, as SGLang's bootstrap keys
    it: the attention-DP rank, or with system DP (``--dp-size`` without DP attention) the
    replica's rank."""
    if par["dp_size"] > 1:
        return int(getattr(args, "system_dp_rank", 0) or 0), par["dp_size"]
    return par["attn_dp_rank"], par["attn_dp_size"]


def mha_layout() -> str:
    """How SGLang's MHA pool lays out a page, chosen as its ``MHATokenToKVPool`` chooses:
    ``hnd`` (head-major, SGLANG_USE_HND_KVCACHE), AITER's ``vectorized_5d`` (head-major) or
    ``nhd`` (token-major, the default)."""
    from sglang.srt.environ import envs

    if envs.SGLANG_USE_HND_KVCACHE.get():
        return "hnd"
    try:
        from sglang.srt.mem_cache import memory_pool

        if getattr(memory_pool, "_use_aiter", False):
            return envs.SGLANG_AITER_KV_CACHE_LAYOUT.get().lower()
    except Exception:  # noqa: BLE001 - no AITER setting in this SGLang
        pass
    return "nhd"


def kv_heads(args: KVArgs, server_args: Any, attn_tp_size: int, is_mla: bool) -> tuple | None:
    """``(total, local)`` KV heads when TP splits the KV pages by head (not MLA), from the
    model's configuration as SGLang's pools size themselves (both sides the same way: a pair
    declares heads on both engines or on neither); ``None`` when it cannot be told, and then
    prefill and decode must have the same attention TP size."""
    if is_mla:
        return None
    try:
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_server_args(server_args)
        total, local = int(mc.get_total_num_kv_heads()), int(mc.get_num_kv_heads(attn_tp_size))
    except Exception as e:  # noqa: BLE001 - no model configuration to read
        logger.info("kvlink: KV heads unknown (%s): prefill and decode need the same attention TP size", e)
        return None
    given = (getattr(args, "total_kv_head_num", None), getattr(args, "kv_head_num", None))
    if all(isinstance(x, int) for x in given) and given != (total, local):
        raise ValueError(
            f"kvlink: SGLang's pool holds {given[1]} of {given[0]} KV heads, the model "
            f"configuration says {local} of {total}"
        )
    if total <= 0 or local <= 0:
        return None
    return total, local


def mamba2_conv(server_args: Any) -> tuple[list[int], int] | None:
    """A Mamba-2 conv state's sub-blocks where SGLang describes none of its own: ``([x, B, C]
    full channels, this rank's conv channels)``, from SGLang's cache parameters of the model
    at this rank's attention TP size (``Mamba2StateShape``), as its ``MambaMixer2`` shards the
    conv (x by heads, B and C by groups, each on its own) when the model's groups divide the
    TP size. None otherwise: no Mamba-2 state, a conv SGLang describes itself (a gated delta
    net's), groups replicated over ranks (fewer groups than ranks), or no configuration to read;
    then a decode of another TP size is refused, as without this."""
    try:
        from sglang.srt.configs.hybrid_arch import mambaish_config
        from sglang.srt.configs.mamba_utils import Mamba2StateShape
        from sglang.srt.configs.model_config import ModelConfig

        found = mambaish_config(ModelConfig.from_server_args(server_args))
        shape = None if found is None else found.mamba2_cache_params.shape
    except Exception as e:  # noqa: BLE001 - no model configuration to read
        logger.info("kvlink: no Mamba-2 conv split (%s)", e)
        return None
    if not isinstance(shape, Mamba2StateShape) or shape.conv_shard_groups or len(shape.conv) != 1:
        return None
    groups = getattr(found, "mamba_n_groups", None) or getattr(found, "n_groups", None)
    local = int(shape.conv[0][0])
    x, bc = int(shape.intermediate_size), int(shape.conv_dim) - int(shape.intermediate_size)
    tp = int(shape.conv_dim) // local if local else 0
    if not isinstance(groups, int) or groups <= 0 or tp <= 0 or groups % tp or bc <= 0 or bc % 2:
        return None
    if x != int(shape.num_heads) * int(shape.head_dim) or bc // 2 != groups * int(shape.ssm_state_size):
        return None
    return [x, bc // 2, bc // 2], local


def refuse_unsupported(sa: Any, par: dict[str, Any], mode: DisaggregationMode) -> None:
    """Configurations this backend does not implement fail at start, saying which (from the
    parallel sizes SGLang resolved, ``par``)."""
    why = []
    for attr, what in (("pp_size", "pipeline parallelism"), ("attn_cp_size", "attention context parallelism")):
        if par[attr] > 1:
            why.append(f"{what} ({attr}={par[attr]})")
    if par["enable_kv_cache_sharding"] is True:
        why.append("KV cache sharding across attention TP")
    dp = par["dp_size"] if par["dp_size"] > 1 else par["attn_dp_size"]
    if (
        mode == DisaggregationMode.PREFILL
        and dp > 1
        and par["load_balance_method"] not in ("follow_bootstrap_room", "auto")
    ):
        why.append(
            f"the {par['load_balance_method']} load balance method with {dp} DP ranks (a decode finds "
            "the prefill DP rank of a room as room % DP size: follow_bootstrap_room)"
        )
    if getattr(sa, "disaggregation_decode_allocation_policy", "early") not in ("early", None):
        why.append("the prefill_complete decode allocation policy")
    if getattr(sa, "enable_memory_saver", False) is True:
        why.append("the memory saver (KV memory released and remapped)")
    for env in ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "SGLANG_DISAGG_STAGING_BUFFER"):
        if os.environ.get(env, "").lower() in ("1", "true", "yes"):
            why.append(env)
    if why:
        raise ValueError("the kvlink transfer backend does not support " + ", ".join(why))
