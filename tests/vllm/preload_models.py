"""Imported once by the engines' forkserver (``harness.PRELOAD``): the model classes of every
configuration in ``models/`` (vLLM imports a model's module when it first resolves it) and the
modules their construction imports, so that each engine builds its model for its KV cache
specs (``model_specs.model_specs``) without paying those imports again. Imports only."""

from __future__ import annotations

import contextlib
import importlib
import json
import os

from vllm.model_executor.models import ModelRegistry

HERE = os.path.dirname(os.path.abspath(__file__))
# What building a model imports on first use, beyond its own module.
LATER = [
    "vllm.compilation.backends",
    "vllm.v1.executor.abstract",
    "vllm.v1.worker.worker_base",
    "vllm.distributed.ec_transfer.ec_transfer_state",
]

for folder in sorted(os.listdir(os.path.join(HERE, "models"))):
    path = os.path.join(HERE, "models", folder, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            for arch in json.load(f).get("architectures", []):
                ModelRegistry._try_load_model_cls(arch)
for name in LATER:
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
