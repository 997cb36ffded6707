"""Which RDMA NICs a rank's kvlink engines open, from the settings SGLang users already write:

1. ``KVLINK_RDMA_DEVICE``, else
2. SGLang's ``--disaggregation-ib-device``,

either of them in one of SGLang's three forms: device names for every rank
(``"mlx5_0,mlx5_1"``), a JSON map from GPU id to names (``{"0": "mlx5_0", "1": "mlx5_1"}``),
or the path of a ``.json`` file holding such a map. A map without this rank's GPU is an error
at start, as in SGLang's own backends.

3. With neither, the NIC nearest the rank's GPU: the one whose PCIe path from the root complex
   shares the most bridges with the GPU's (behind the same switch first), then one on the
   GPU's NUMA node; ties go to the first name. Without a GPU (or where sysfs does not say),
   nothing is chosen here and the engine opens the first usable device.

Pure functions over a sysfs root (``/sys`` unless a test passes a tree of its own), no verbs.
"""

from __future__ import annotations

import json
import os


def parse(spec: str | None) -> str | dict[int, str] | None:
    """``spec`` as names for every GPU (a string) or a map from GPU id to names; None when
    empty. Raises ``ValueError`` saying what is wrong with a map or its file."""
    if spec is None or not spec.strip():
        return None
    s = spec.strip()
    if not s.startswith("{") and not s.endswith(".json"):
        return s
    if s.endswith(".json"):
        try:
            with open(s, encoding="utf-8") as f:
                mapping = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"the RDMA device map {s} cannot be read: {e}") from None
    else:
        try:
            mapping = json.loads(s)
        except ValueError as e:
            raise ValueError(f"the RDMA device map {s!r} is not JSON: {e}") from None
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError("an RDMA device map must be a JSON object from GPU id to device names")
    out: dict[int, str] = {}
    for k, v in mapping.items():
        if not str(k).isdigit() or not isinstance(v, str) or not v.strip():
            raise ValueError(f"RDMA device map entry {k!r}: {v!r}: GPU ids map to device names")
        out[int(k)] = v.strip()
    return out


def for_gpu(spec: str | None, gpu_id: int | None) -> str | None:
    """The device names ``spec`` gives the rank on GPU ``gpu_id`` (None: ``spec`` is empty)."""
    parsed = parse(spec)
    if parsed is None or isinstance(parsed, str):
        return parsed
    if gpu_id is None or gpu_id not in parsed:
        raise ValueError(f"the RDMA device map names GPUs {sorted(parsed)}, not this rank's GPU {gpu_id}")
    return parsed[gpu_id]


def choose(
    env: str | None, flag: str | None, gpu_id: int | None, gpu_pci: str | None, sysfs: str = "/sys"
) -> str | None:
    """The devices for this rank (see the module docstring for the order); ``gpu_pci`` is the
    GPU's PCI address (``0000:3b:00.0``), when known."""
    for spec in (env, flag):
        names = for_gpu(spec, gpu_id)
        if names:
            return names
    return nearest(gpu_pci, sysfs) if gpu_pci else None


def nearest(gpu_pci: str, sysfs: str = "/sys") -> str | None:
    """The RDMA device nearest the PCI function ``gpu_pci``, or None when sysfs lists none or
    does not know the GPU."""
    gpu = _pci_path(os.path.join(sysfs, "bus", "pci", "devices", gpu_pci))
    if gpu is None:
        return None
    gpu_node = _numa(os.path.join(sysfs, "bus", "pci", "devices", gpu_pci))
    best, best_key = None, None
    for name in _devices(sysfs):
        dev = os.path.join(sysfs, "class", "infiniband", name, "device")
        path = _pci_path(dev)
        if path is None:
            continue  # a virtual device (rxe, siw): no PCI function
        shared = _shared(gpu, path)
        same_node = gpu_node is not None and _numa(dev) == gpu_node
        key = (shared, same_node)
        if best_key is None or key > best_key:
            best, best_key = name, key
    return best


def _devices(sysfs: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(sysfs, "class", "infiniband")))
    except OSError:
        return []


def _pci_path(link: str) -> list[str] | None:
    """The PCI bridges from the root complex down to a device (its resolved sysfs path, from
    its ``pci`` domain directory on), or None when it is not a PCI device."""
    if not os.path.exists(link):
        return None
    real = os.path.realpath(link)
    parts = real.split(os.sep)
    for i, p in enumerate(parts):
        if p.startswith("pci") and ":" in p:
            return parts[i:]
    return None


def _shared(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _numa(device_dir: str) -> int | None:
    try:
        with open(os.path.join(device_dir, "numa_node"), encoding="ascii") as f:
            n = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return n if n >= 0 else None
