"""Fills vLLM's model-info cache (``$VLLM_CACHE_ROOT/modelinfos``) for the architectures of
every configuration in ``models/``, ahead of the suites.

vLLM inspects a model class in a fresh interpreter the first time it resolves an architecture
(``_run_in_subprocess`` in its model registry, "to avoid initializing CUDA": torch, vLLM and the
model's module imported, about 15 s each on two cores) and keeps the answer in that cache,
keyed by the module's hash. On a fresh machine the first suite to touch each model would pay
those one after another. Here vLLM's own inspection (``_try_inspect_model_cls``: its hash, its
``_ModelInfo.from_model_cls``, its cache file) runs in this one process instead (there is no
CUDA to keep out of it), so torch and vLLM are imported once for every architecture. It
changes nothing but the cache: the suites read it as vLLM always does.

    python warm_registry.py"""

from __future__ import annotations

import json
import os
import sys
import time

from vllm.model_executor.models import ModelRegistry, registry

HERE = os.path.dirname(os.path.abspath(__file__))


def architectures() -> list[str]:
    """Every architecture the model zoo's configurations name, once each."""
    found: list[str] = []
    for folder in sorted(os.listdir(os.path.join(HERE, "models"))):
        path = os.path.join(HERE, "models", folder, "config.json")
        if os.path.exists(path):
            with open(path) as f:
                found += [a for a in json.load(f).get("architectures", []) if a not in found]
    return found


def main() -> int:
    started = time.monotonic()
    archs = architectures()
    # The inspection in this process: what vLLM's subprocess would run, run here.
    registry._run_in_subprocess = lambda fn: fn()
    infos = [ModelRegistry._try_inspect_model_cls(a) for a in archs]
    missing = [a for a, info in zip(archs, infos) if info is None]
    print(f"warm_registry: {len(archs) - len(missing)} of {len(archs)} architectures in vLLM's cache "
          f"({os.environ.get('VLLM_CACHE_ROOT', '~/.cache/vllm')}) in {time.monotonic() - started:.0f} s"
          + (f"; not inspected: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
