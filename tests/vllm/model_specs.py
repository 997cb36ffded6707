"""The KV cache specs of a model configuration shipped with the tests, as vLLM's own layers
make them (``model_specs``), and what a deployment of each model sets. Used by the engine
process (``engine_process.py``) and the state rules' tests."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from typing import Any, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# Per model folder, the options a deployment of it sets (``--limit-mm-per-prompt '{"image": 0}'``
# for a multimodal model served for text: its processor needs the tokenizer that a folder
# without weights lacks, and its vision tower owns no KV cache).
MODEL_OPTIONS: Dict[str, Dict[str, Any]] = {"deepseek-v4.1": {"limit_mm_per_prompt": {"image": 0}}}


def model_dir(model: str) -> str:
    """The folder of a model configuration shipped with the tests (``models/README.md``)."""
    return os.path.join(HERE, "models", model)


def model_specs(config, tp: int) -> tuple[Dict[str, Any], Dict[str, str]]:
    """Each layer's KV cache spec as vLLM's own layers make it, the way the GPU model runner
    collects them (``get_layers_from_vllm_config`` of ``AttentionLayerBase``, each layer's
    ``get_kv_cache_spec``): the model class vLLM resolves for the config, built on the meta
    device (on the CPU, uninitialized, for a model whose construction reads a value), with no
    weights. Returns the specs of the layers that own a cache, and the layers that reuse another
    layer's (``kv_sharing_target_layer_name``) with their targets.

    What is stubbed: the TP group. The ranks of an engine live in this one process, so the model
    is built in a gloo world of one process whose TP group says it has ``tp`` ranks and that
    this is rank 0 while the layers read their shard sizes; no collective runs. For a model
    vLLM implements for GPUs only, also what its construction asks of the GPU (``_gpu_platform``)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.models import ModelRegistry

    model_config = config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    with set_current_vllm_config(config):
        if not ps.model_parallel_is_initialized():
            # A file rendezvous: a TCP one needs a port chosen before its store binds it,
            # which another process can take in between.
            store = tempfile.mkdtemp(prefix="kvlink-gloo-")
            atexit.register(shutil.rmtree, store, True)
            ps.init_distributed_environment(1, 0, f"file://{store}/store", 0, "gloo")
            ps.initialize_model_parallel(1)
        group = ps.get_tp_group()
        saved = group.world_size, group.rank_in_group
        group.world_size, group.rank_in_group = tp, 0
        try:
            with _gpu_platform(model_config.architectures):
                return _built_specs(cls, config)
        finally:
            group.world_size, group.rank_in_group = saved


def _built_specs(cls: Any, config: Any) -> tuple[Dict[str, Any], Dict[str, str]]:
    """``model_specs`` once the TP group is set: builds the model and collects its specs."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    try:
        with torch.device("meta"):
            cls(vllm_config=config, prefix="")
    except RuntimeError as e:
        if "meta" not in str(e):
            raise
        config.compilation_config.static_forward_context.clear()
        with torch.device("cpu"):
            cls(vllm_config=config, prefix="")
    # The layers read the TP size again when they make their specs.
    specs: Dict[str, Any] = {}
    shared: Dict[str, str] = {}
    for name, layer in get_layers_from_vllm_config(config, AttentionLayerBase).items():
        target = getattr(layer, "kv_sharing_target_layer_name", None)
        if target is not None:
            shared[name] = target
            continue
        spec = layer.get_kv_cache_spec(config)
        if spec is not None:
            specs[name] = spec
    return specs, shared


# Models whose vLLM implementation exists for GPUs only: built as on an H200 (``_gpu_platform``).
GPU_ONLY = {"DeepseekV41ForCausalLM"}


class _Inert:
    """A CUDA stream or event made while a model is built, never used: no forward runs here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def _gpu_platform(architectures: List[str]):
    """While a model of ``GPU_ONLY`` is built: the CUDA streams and events its layers make for
    their forward are inert objects, and the platform reports compute capability 9.0 (an
    H100 or H200, whose kernels' block sizes its layers then choose). Nothing else changes;
    other models are built as they are."""
    if not GPU_ONLY.intersection(architectures):
        yield
        return
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    saved = torch.cuda.Stream, torch.cuda.Event, current_platform.get_device_capability
    torch.cuda.Stream, torch.cuda.Event = _Inert, _Inert  # type: ignore[misc, assignment]
    current_platform.get_device_capability = lambda device_id=0: DeviceCapability(9, 0)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.Event, current_platform.get_device_capability = saved  # type: ignore[misc]


def declared_layouts(config) -> List[str]:
    """The KV cache layouts the model's attention backends support, as a worker reports them
    to the engine core (``get_supported_kv_cache_layouts`` over ``get_current_attn_backends``),
    leaving out vLLM's CPU attention backend: on the CPU platform it stands in for the GPU's
    attention backend of a plain layer, which declares no layout (all six then). DeepSeek-V4's
    indexer declares the block-outermost layouts only, which its packed pages need."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout

    backends = [b for b in get_current_attn_backends(config) if b.get_name() != "CPU_ATTN"]
    declared = [b for b in backends if b.supported_kv_cache_layouts() is not None]
    if not declared:
        return [l.name for l in KVCacheLayout]
    return [l.name for l in get_supported_kv_cache_layouts(declared)]
