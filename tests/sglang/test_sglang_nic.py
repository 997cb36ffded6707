"""Which NIC each SGLang rank's kvlink engines open (``kvlink.sglang.nic``): SGLang's three
forms of ``--disaggregation-ib-device``, ``KVLINK_RDMA_DEVICE`` before it, and with neither the
NIC nearest the rank's GPU, read from a fake sysfs tree laid out as a two-socket server's."""

from __future__ import annotations

import json
import os

import pytest

from kvlink.sglang import nic

# Socket 0: a PCIe switch with GPU 0 and mlx5_0 behind it; GPU 2 under another root port.
# Socket 1: GPU 1 and mlx5_1 under the same root complex (no shared switch). GPU 3 sits on a
# root complex of its own on socket 1, with no NIC on it. rxe0: a SoftRoCE device, no PCI.
TREE = {
    "gpu0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0),
    "mlx5_0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0),
    "gpu2": ("pci0000:00/0000:00:03.0/0000:05:00.0", 0),
    "gpu1": ("pci0000:80/0000:80:02.0/0000:82:00.0", 1),
    "mlx5_1": ("pci0000:80/0000:80:01.0/0000:81:00.0", 1),
    "gpu3": ("pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1),
}


@pytest.fixture
def sysfs(tmp_path):
    root = tmp_path / "sys"
    (root / "bus" / "pci" / "devices").mkdir(parents=True)
    (root / "class" / "infiniband").mkdir(parents=True)
    for name, (path, node) in TREE.items():
        d = root / "devices" / path
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
        os.symlink(d, root / "bus" / "pci" / "devices" / path.rsplit("/", 1)[1])
        if name.startswith("mlx5"):
            (root / "class" / "infiniband" / name).mkdir()
            os.symlink(d, root / "class" / "infiniband" / name / "device")
    (root / "class" / "infiniband" / "rxe0").mkdir()
    return str(root)


def pci(name: str) -> str:
    return TREE[name][0].rsplit("/", 1)[1]


def test_the_nic_behind_the_gpus_switch_wins(sysfs):
    assert nic.nearest(pci("gpu0"), sysfs) == "mlx5_0"


def test_then_the_nic_under_the_same_root_complex(sysfs):
    assert nic.nearest(pci("gpu1"), sysfs) == "mlx5_1"
    assert nic.nearest(pci("gpu2"), sysfs) == "mlx5_0"


def test_then_the_nic_on_the_gpus_numa_node(sysfs):
    # GPU 3 shares no bridge with either NIC; mlx5_1 is on its socket.
    assert nic.nearest(pci("gpu3"), sysfs) == "mlx5_1"


def test_no_pci_nic_or_an_unknown_gpu_chooses_nothing(sysfs, tmp_path):
    assert nic.nearest("0000:ff:00.0", sysfs) is None
    bare = tmp_path / "bare"
    (bare / "class" / "infiniband" / "rxe0").mkdir(parents=True)
    (bare / "bus" / "pci" / "devices").mkdir(parents=True)
    assert nic.nearest(pci("gpu0"), str(bare)) is None


def test_sglangs_three_forms(tmp_path):
    assert nic.for_gpu("mlx5_0, mlx5_1", 3) == "mlx5_0, mlx5_1"
    assert nic.for_gpu('{"0": "mlx5_0", "1": "mlx5_1,mlx5_2"}', 1) == "mlx5_1,mlx5_2"
    f = tmp_path / "nics.json"
    f.write_text(json.dumps({"0": "mlx5_3", "7": "mlx5_4"}))
    assert nic.for_gpu(str(f), 7) == "mlx5_4"
    assert nic.for_gpu("  ", 0) is None and nic.for_gpu(None, 0) is None


@pytest.mark.parametrize("spec,why", [
    ('{"0": "mlx5_0"}', "not this rank's GPU 1"),
    ('{"0": mlx5_0}', "not JSON"),
    ('{"gpu0": "mlx5_0"}', "GPU ids map to device names"),
    ('{"0": ""}', "GPU ids map to device names"),
    ("/nonexistent/nics.json", "cannot be read"),
    ("[]", None),  # not a map, not a path: a device name, which the engine refuses as unknown
])
def test_a_bad_map_is_an_error_at_start(spec, why):
    if why is None:
        assert nic.for_gpu(spec, 1) == "[]"
        return
    with pytest.raises(ValueError, match=why):
        nic.for_gpu(spec, 1)


def test_kvlinks_variable_comes_before_sglangs_flag_and_both_before_the_nearest(sysfs):
    assert nic.choose("mlx5_9", '{"0": "mlx5_1"}', 0, pci("gpu0"), sysfs) == "mlx5_9"
    assert nic.choose(None, '{"0": "mlx5_1"}', 0, pci("gpu0"), sysfs) == "mlx5_1"
    assert nic.choose("", "", 0, pci("gpu0"), sysfs) == "mlx5_0"
    assert nic.choose(None, None, 0, None, sysfs) is None


def test_a_map_without_this_ranks_gpu_stops_the_backend_at_start():
    """Through the manager SGLang builds: the map is read from KVArgs.ib_device and gpu_id."""
    from harness import Pair

    with pytest.raises(ValueError, match="not this rank's GPU 0"):
        Pair(4, ib_device='{"5": "mlx5_0"}')
