"""Unit tests for pytest_ctresources.gpu.detect: fake GPUs, CUDA_VISIBLE_DEVICES, NVML, torch.

No GPU needed: NVML and torch are replaced by small stand-in modules in ``sys.modules``.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ctresources.gpu.detect import (
    GpuFacts,
    GpuInfo,
    detect_gpus,
    used_memory_reader,
)
from pytest_ctresources.gpu.fake import FAKE_GPUS_ENV, parse_fake_gpus, parse_fake_used
from pytest_ctresources.gpu.visible_devices import parse_visible_devices
from pytest_ctresources.units import GIB

# --------------------------------------------------------------------------- CT_FAKE_GPUS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("NVIDIA GeForce RTX 4090=23.6", [("NVIDIA GeForce RTX 4090", 23.6)]),
        (
            "NVIDIA GeForce RTX 4090=23.6;NVIDIA H200=139.8",
            [("NVIDIA GeForce RTX 4090", 23.6), ("NVIDIA H200", 139.8)],
        ),
        ("24", [("Fake GPU", 24.0)]),
        (" 24 ; Big = 80 ;", [("Fake GPU", 24.0), ("Big", 80.0)]),
        ("a=b=1", [("a=b", 1.0)]),
        ("", []),
        (" ; ", []),
    ],
)
def test_parse_fake_gpus_good(text: str, expected: list[tuple[str, float]]) -> None:
    assert parse_fake_gpus(text) == expected


@pytest.mark.parametrize(
    ("text", "bad_entry"),
    [
        ("NVIDIA H200=lots", "'NVIDIA H200=lots'"),
        ("24;24GiB", "'24GiB'"),
        ("A=24;=12", "'=12'"),
        ("A=0", "'A=0'"),
        ("A=-3", "'A=-3'"),
        ("A=nan", "'A=nan'"),
        ("A=inf", "'A=inf'"),
        ("A=", "'A='"),
    ],
)
def test_parse_fake_gpus_bad_names_entry_and_format(text: str, bad_entry: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_fake_gpus(text)
    message = str(info.value)
    assert message.startswith("CT_FAKE_GPUS: ")
    assert bad_entry in message
    assert "NAME=GIB" in message


def test_bad_fake_gpus_raise_from_detect() -> None:
    with pytest.raises(ValueError, match=r"CT_FAKE_GPUS: .*'x'"):
        detect_gpus({FAKE_GPUS_ENV: "24;x"})


def fake_env(visible: str | None = None, fakes: str = "A=10;B=20;C=30") -> dict[str, str]:
    env = {FAKE_GPUS_ENV: fakes}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def names(facts: GpuFacts) -> list[str]:
    return [gpu.name for gpu in facts.gpus]


def test_fake_gpus_all_visible_when_unset() -> None:
    facts = detect_gpus(fake_env())
    assert facts.source == "fake"
    assert facts.detail == "CT_FAKE_GPUS"
    assert facts.cuda_visible_devices is None
    assert names(facts) == ["A", "B", "C"]
    assert [g.index for g in facts.gpus] == [0, 1, 2]
    assert [g.physical_index for g in facts.gpus] == [0, 1, 2]
    assert [g.uuid for g in facts.gpus] == ["GPU-fake-0", "GPU-fake-1", "GPU-fake-2"]
    assert facts.gpus[1].total_bytes == 20 * GIB
    assert facts.caveats == ()


def test_fake_gpus_ignore_real_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode() -> None:
        raise AssertionError("NVML must not be consulted when CT_FAKE_GPUS is set")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=explode))
    assert detect_gpus(fake_env()).source == "fake"


def test_empty_fake_gpus_means_no_gpu() -> None:
    facts = detect_gpus({FAKE_GPUS_ENV: ""})
    assert facts.source == "fake"
    assert facts.gpus == ()
    assert facts.gpu() is None


@pytest.mark.parametrize(
    ("visible", "expected_names", "expected_physical"),
    [
        ("1", ["B"], [1]),
        ("2,0", ["C", "A"], [2, 0]),
        ("1,0", ["B", "A"], [1, 0]),
        (" 1 , 2 ", ["B", "C"], [1, 2]),
        ("0,7,1", ["A"], [0]),  # out of range: cut there
        ("0,foo,1", ["A"], [0]),  # not an index: cut there
        ("1,-1,0", ["B"], [1]),  # -1: cut there
        ("-1", [], []),
        ("", [], []),
        ("1gpu", ["B"], [1]),  # CUDA reads indices like strtoul
        ("1\u00b2", ["B"], [1]),  # ... whose digits are ASCII: not '²' (an INTERNALERROR once)
        ("\u0661", [], []),  # nor ARABIC-INDIC DIGIT ONE, once read as GPU 1
        ("0," + "9" * 5000, ["A"], [0]),  # beyond a C long: strtol clamps, out of range
        ("GPU-fake-2,GPU-fake-0", ["C", "A"], [2, 0]),
        ("GPU-fake-2,0", ["C"], [2]),  # the first entry fixes the kind of the list
        ("0,GPU-fake-2", ["A"], [0]),
        ("GPU-fake-1", ["B"], [1]),
        ("GPU-fake-", [], []),  # ambiguous prefix: cut
        ("0,GPU-nope,1", ["A"], [0]),  # unknown UUID: cut
        ("MIG-abc", [], []),  # fakes have no MIG devices
    ],
)
def test_visible_devices_on_fakes(
    visible: str, expected_names: list[str], expected_physical: list[int]
) -> None:
    facts = detect_gpus(fake_env(visible))
    assert names(facts) == expected_names
    assert [g.physical_index for g in facts.gpus] == expected_physical
    assert [g.index for g in facts.gpus] == list(range(len(expected_names)))
    assert facts.cuda_visible_devices == visible


def test_cut_reason_is_in_detail() -> None:
    facts = detect_gpus(fake_env("0,7,1"))
    assert "'7'" in facts.detail
    assert "CT_FAKE_GPUS" in facts.detail
    assert "'foo'" in detect_gpus(fake_env("0,foo")).detail
    assert "empty" in detect_gpus(fake_env("")).detail


@pytest.mark.parametrize("visible", ["0,0", "1,0,1", "01,1", "GPU-fake-1,GPU-fake-1"])
def test_duplicate_visible_devices_mean_no_gpu(visible: str) -> None:
    facts = detect_gpus(fake_env(visible))
    assert facts.gpus == ()
    assert "twice" in facts.detail


def test_exact_fake_uuid_beats_longer_prefix_match() -> None:
    fakes = ";".join(str(i + 1) for i in range(11))  # GPU-fake-1 is a prefix of GPU-fake-10
    facts = detect_gpus(fake_env("GPU-fake-1", fakes))
    assert [g.physical_index for g in facts.gpus] == [1]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("  ", []),
        ("0,1", ["0", "1"]),
        (" 01 ,+2", ["1", "2"]),
        ("3,-1,4", ["3"]),
        ("2,x,4", ["2"]),
        ("0,,1", ["0"]),
        ("GPU-ab, GPU-cd", ["GPU-ab", "GPU-cd"]),
        ("GPU-ab,MIG-cd,GPU-ef", ["GPU-ab"]),
        ("MIG-ab,MIG-cd,3", ["MIG-ab", "MIG-cd"]),
        ("0,GPU-ab", ["0"]),
        ("0gpu,1 2", ["0", "1"]),
        ("1," + "9" * 5000, ["1", str(2**63 - 1)]),
        ("1," + "9" * 20, ["1", str(2**63 - 1)]),  # past a C long by a digit: clamped too
        ("-" + "9" * 30, []),
    ],
)
def test_parse_visible_devices(value: str | None, expected: list[str] | None) -> None:
    assert parse_visible_devices(value) == expected


# --------------------------------------------------------------------------- NVML stand-in


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError (its str() is the human message)."""


class FakeNvml:
    """A minimal pynvml: GPU 0 and 1 plain, GPU 2 in MIG mode with MIG devices in slots 0, 2."""

    NVMLError = FakeNVMLError

    def __init__(self) -> None:
        self.gpus: list[dict[str, Any]] = [
            {"name": b"NVIDIA H200", "total": 150 * GIB, "uuid": b"GPU-aaaa1111-0000"},
            {"name": "NVIDIA H200", "total": 150 * GIB, "uuid": "GPU-aaaa2222-0000"},
            {
                "name": "NVIDIA A100-SXM4-40GB",
                "total": 40 * GIB,
                "uuid": "GPU-bbbb3333-0000",
                "mig": {
                    0: {
                        "name": b"NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                        "total": 20 * GIB,
                        "uuid": b"MIG-cccc0000-1111",
                    },
                    2: {
                        "name": "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                        "total": 5 * GIB,
                        "uuid": "MIG-cccc0000-2222",
                    },
                },
            },
        ]
        self.init_error: Exception | None = None
        self.initialised = False
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.initialised = False

    def nvmlSystemGetNVMLVersion(self) -> bytes:
        return b"12.580.65"

    def nvmlDeviceGetCount(self) -> int:
        assert self.initialised
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> object:
        return handle["name"]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> object:
        return handle["uuid"]

    nvmlMemory_v2 = 0x2000028
    reserved = 512 * 2**20  # what the driver keeps for itself; CUDA does not count it

    def nvmlDeviceGetMemoryInfo(
        self, handle: dict[str, Any], version: int | None = None
    ) -> SimpleNamespace:
        # Like real NVML: the v1 "total" includes the reserved part (as used memory);
        # v2 reports it separately. handle["total"] is what CUDA would report.
        total = handle["total"] + self.reserved
        if version is None:
            return SimpleNamespace(total=total, free=handle["total"], used=self.reserved)
        assert version == self.nvmlMemory_v2
        return SimpleNamespace(total=total, reserved=self.reserved, free=handle["total"], used=0)

    def nvmlDeviceGetMigMode(self, handle: dict[str, Any]) -> list[int]:
        if "mig" not in handle:
            raise FakeNVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: dict[str, Any]) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: dict[str, Any], slot: int) -> object:
        try:
            return handle["mig"][slot]
        except KeyError:
            raise FakeNVMLError("Not Found") from None


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def nvml_env(visible: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(extra)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def test_nvml_all_gpus_when_unset(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env(CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    assert facts.source == "nvml"
    assert facts.detail == "NVML 12.580.65"
    assert nvml.shutdowns == 1
    # GPU 2 is in MIG mode: CUDA runs on its first MIG device, not on the whole GPU.
    assert names(facts) == [
        "NVIDIA H200",
        "NVIDIA H200",
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
    ]
    assert [g.total_bytes for g in facts.gpus] == [150 * GIB, 150 * GIB, 20 * GIB]
    assert [g.uuid for g in facts.gpus] == [
        "GPU-aaaa1111-0000",
        "GPU-aaaa2222-0000",
        "MIG-cccc0000-1111",
    ]
    assert [g.physical_index for g in facts.gpus] == [0, 1, 2]
    assert any("MIG mode" in caveat for caveat in facts.caveats)


def test_nvml_index_selection(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("1", CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    assert len(facts.gpus) == 1
    gpu = facts.gpus[0]
    assert (gpu.index, gpu.physical_index, gpu.uuid) == (0, 1, "GPU-aaaa2222-0000")
    assert facts.summary_lines() == [
        "GPU 0: NVIDIA H200, 150.0 GiB (nvml, CUDA_VISIBLE_DEVICES=1 -> physical 1)"
    ]


def test_nvml_reorder_and_cut(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("1,0,5,2"))
    assert [g.physical_index for g in facts.gpus] == [1, 0]
    assert "'5'" in facts.detail


def test_nvml_gpu_uuid_prefix_selection(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("GPU-aaaa2,GPU-aaaa1111-0000"))
    assert [g.physical_index for g in facts.gpus] == [1, 0]


def test_nvml_ambiguous_uuid_prefix_cuts(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("GPU-bbbb,GPU-aaaa,GPU-aaaa1"))
    assert [g.physical_index for g in facts.gpus] == [2]  # GPU-aaaa matches two GPUs


def test_nvml_mig_uuid_selection(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("MIG-cccc0000-2222"))
    assert len(facts.gpus) == 1
    gpu = facts.gpus[0]
    assert gpu.name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    assert gpu.total_bytes == 5 * GIB
    assert gpu.uuid == "MIG-cccc0000-2222"
    assert gpu.physical_index == 2
    assert gpu.index == 0
    assert facts.summary_lines() == [
        "GPU 0: NVIDIA A100-SXM4-40GB MIG 1g.5gb, 5.0 GiB "
        "(nvml, CUDA_VISIBLE_DEVICES=MIG-cccc0000-2222 -> MIG device on physical 2)"
    ]


def test_nvml_only_one_mig_device_per_process(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("MIG-cccc0000-1111,MIG-cccc0000-2222"))
    assert [g.uuid for g in facts.gpus] == ["MIG-cccc0000-1111"]
    assert any("one MIG device" in caveat for caveat in facts.caveats)


def test_nvml_mig_mode_gpu_without_mig_devices_is_left_out(nvml: FakeNvml) -> None:
    nvml.gpus[2]["mig"] = {}
    facts = detect_gpus(nvml_env("2,0"))
    assert [g.physical_index for g in facts.gpus] == [0]
    assert any("no MIG devices" in caveat for caveat in facts.caveats)


def test_nvml_mig_failures_do_not_break_detection(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> object:
        raise FakeNVMLError("Function Not Found")

    monkeypatch.setattr(nvml, "nvmlDeviceGetMaxMigDeviceCount", broken)
    facts = detect_gpus(nvml_env("MIG-cccc0000-1111"))
    assert facts.gpus == ()  # the MIG UUID is now unknown
    assert "'MIG-cccc0000-1111' matches no single GPU" in facts.detail

    monkeypatch.setattr(nvml, "nvmlDeviceGetMigMode", broken)
    facts = detect_gpus(nvml_env("2"))
    assert [(g.name, g.total_bytes) for g in facts.gpus] == [("NVIDIA A100-SXM4-40GB", 40 * GIB)]


def test_nvml_unreadable_gpu_is_left_out(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    real = nvml.nvmlDeviceGetHandleByIndex

    def handle(index: int) -> dict[str, Any]:
        if index == 0:
            raise FakeNVMLError("Insufficient Permissions")
        return real(index)

    monkeypatch.setattr(nvml, "nvmlDeviceGetHandleByIndex", handle)
    facts = detect_gpus(nvml_env("0"))
    # CUDA numbers only the GPUs it can open, so ordinal 0 is NVML's GPU 1.
    assert [g.physical_index for g in facts.gpus] == [1]
    assert "Insufficient Permissions" in facts.detail


def test_nvml_duplicate_means_no_gpu(nvml: FakeNvml) -> None:
    # Same GPU by full UUID and by prefix: CUDA 13 then sees no device (checked on an H200).
    facts = detect_gpus(nvml_env("GPU-aaaa1111-0000,GPU-aaaa1"))
    assert facts.gpus == ()
    assert facts.summary_lines()[0].startswith("no CUDA GPU detected (NVML 12.580.65; ")


def test_nvml_memory_without_v2_query(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    # Old pynvml has no nvmlMemory_v2; then the v1 total (reserved part included) is used.
    monkeypatch.delattr(FakeNvml, "nvmlMemory_v2")
    facts = detect_gpus(nvml_env("0"))
    assert [g.total_bytes for g in facts.gpus] == [150 * GIB + nvml.reserved]


def test_nvml_memory_v2_query_failing(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    real = nvml.nvmlDeviceGetMemoryInfo

    def v1_only(handle: dict[str, Any], version: int | None = None) -> SimpleNamespace:
        if version is not None:
            raise FakeNVMLError("Function Not Found")  # old driver
        return real(handle)

    monkeypatch.setattr(nvml, "nvmlDeviceGetMemoryInfo", v1_only)
    facts = detect_gpus(nvml_env("0"))
    assert [g.total_bytes for g in facts.gpus] == [150 * GIB + nvml.reserved]


def test_nvml_mixed_gpus_order_caveat(nvml: FakeNvml) -> None:
    facts = detect_gpus(nvml_env("0"))
    assert any("CUDA_DEVICE_ORDER" in c for c in facts.caveats)
    assert facts.summary_lines()[-1].startswith("note: CUDA_DEVICE_ORDER is not PCI_BUS_ID")
    pci = detect_gpus(nvml_env("0", CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    assert not any("CUDA_DEVICE_ORDER" in c for c in pci.caveats)
    # UUIDs name GPUs whatever the order.
    by_uuid = detect_gpus(nvml_env("GPU-aaaa2"))
    assert not any("CUDA_DEVICE_ORDER" in c for c in by_uuid.caveats)


def test_nvml_identical_gpus_no_order_caveat(nvml: FakeNvml) -> None:
    del nvml.gpus[2]
    assert detect_gpus(nvml_env()).caveats == ()


def test_nvml_shutdown_even_when_query_fails(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> int:
        raise FakeNVMLError("Unknown Error")

    monkeypatch.setattr(nvml, "nvmlDeviceGetCount", broken)
    monkeypatch.setitem(sys.modules, "torch", None)
    facts = detect_gpus(nvml_env())
    assert nvml.shutdowns == 1
    assert facts.source == "none"
    assert "NVML query failed (Unknown Error)" in facts.detail


# --------------------------------------------------------------------------- torch fallback


def test_nvml_init_error_falls_back_to_real_torch(nvml: FakeNvml) -> None:
    nvml.init_error = FakeNVMLError("NVML Shared Library Not Found")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the fallback would find real GPUs")
    facts = detect_gpus(nvml_env())
    assert facts.source == "none"
    assert facts.gpus == ()
    assert facts.detail.startswith("NVML unavailable (NVML Shared Library Not Found); torch ")
    assert "CUDA not available" in facts.detail
    assert nvml.shutdowns == 0  # never initialised, so never shut down
    [line] = facts.summary_lines()
    assert line.startswith("no CUDA GPU detected (NVML unavailable (NVML Shared Library")


def test_pynvml_missing_and_torch_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    facts = detect_gpus({"CUDA_VISIBLE_DEVICES": "0"})
    assert facts.source == "none"
    assert facts.cuda_visible_devices == "0"
    assert "pynvml not importable" in facts.detail
    assert "torch not importable" in facts.detail


def fake_torch(devices: list[SimpleNamespace]) -> SimpleNamespace:
    cuda = SimpleNamespace(
        is_available=lambda: bool(devices),
        device_count=lambda: len(devices),
        get_device_properties=lambda i: devices[i],
    )
    return SimpleNamespace(__version__="9.9.9", version=SimpleNamespace(cuda="12.8"), cuda=cuda)


def test_torch_fallback_reports_devices(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml.init_error = FakeNVMLError("Driver Not Loaded")
    devices = [
        SimpleNamespace(name="NVIDIA L4", total_memory=22 * GIB, uuid="1234-abcd"),
        SimpleNamespace(name="NVIDIA A100-SXM4-40GB MIG 1g.5gb", total_memory=5 * GIB),
    ]
    monkeypatch.setitem(sys.modules, "torch", fake_torch(devices))
    facts = detect_gpus(nvml_env("3"))
    assert facts.source == "torch"
    assert "may initialise CUDA" in facts.detail
    assert "Driver Not Loaded" in facts.detail
    assert facts.gpus == (
        GpuInfo(0, "NVIDIA L4", 22 * GIB, "GPU-1234-abcd", None),
        GpuInfo(1, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 5 * GIB, None, None),
    )
    assert facts.summary_lines()[0] == "GPU 0: NVIDIA L4, 22.0 GiB (torch, CUDA_VISIBLE_DEVICES=3)"


def test_torch_without_cuda(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml.init_error = FakeNVMLError("Driver Not Loaded")
    monkeypatch.setitem(sys.modules, "torch", fake_torch([]))
    facts = detect_gpus(nvml_env())
    assert facts.source == "none"
    assert facts.detail == (
        "NVML unavailable (Driver Not Loaded); "
        "torch 9.9.9: CUDA not available (no usable CUDA device or driver)"
    )


def test_real_machine_detection_does_not_crash() -> None:
    facts = detect_gpus({})
    assert facts.source in ("nvml", "torch", "none")
    assert facts.summary_lines()


# --------------------------------------------------------------------------- value objects


def test_gpu_info_helpers() -> None:
    gpu = GpuInfo(0, "NVIDIA H200", 150_118_154_240, "GPU-x", 1)
    assert gpu.describe() == "GPU 0 (NVIDIA H200)"
    assert gpu.total_gib == pytest.approx(139.8084, abs=1e-4)
    assert not gpu.is_mig
    assert GpuInfo(0, "m", GIB, "MIG-y", 0).is_mig


def test_facts_gpu_lookup() -> None:
    facts = detect_gpus(fake_env("2,1"))
    first = facts.gpu()
    assert first is not None and first.name == "C"
    second = facts.gpu(1)
    assert second is not None and second.name == "B"
    assert facts.gpu(2) is None
    assert facts.gpu(-1) is None


def test_summary_lines_fake() -> None:
    facts = detect_gpus(fake_env(fakes="NVIDIA H200=139.8;24"))
    assert facts.summary_lines() == [
        "GPU 0: NVIDIA H200, 139.8 GiB (fake, physical 0)",
        "GPU 1: Fake GPU, 24.0 GiB (fake, physical 1)",
    ]
    empty = detect_gpus(fake_env("", fakes="24"))
    assert empty.summary_lines() == [
        "no CUDA GPU detected (CT_FAKE_GPUS; CUDA_VISIBLE_DEVICES is empty, which hides every GPU)"
    ]


def test_to_dict_round_trips_through_json(nvml: FakeNvml) -> None:
    for facts in (
        detect_gpus(nvml_env()),
        detect_gpus(nvml_env("MIG-cccc0000-2222")),
        detect_gpus(fake_env("1,0")),
        detect_gpus(fake_env("")),
    ):
        data = json.loads(json.dumps(facts.to_dict()))
        assert data == facts.to_dict()
        assert len(data["gpus"]) == len(facts.gpus)


def test_to_dict_content() -> None:
    data = detect_gpus(fake_env("1", fakes="A=1.5;B=2")).to_dict()
    assert data == {
        "source": "fake",
        "detail": "CT_FAKE_GPUS",
        "cuda_visible_devices": "1",
        "caveats": [],
        "gpus": [
            {
                "index": 0,
                "name": "B",
                "total_bytes": 2 * GIB,
                "total_gib": 2.0,
                "uuid": "GPU-fake-1",
                "physical_index": 1,
            }
        ],
    }


def test_module_import_does_not_import_torch() -> None:
    # Load gpus.py on its own, so that what the package's other modules import does not count.
    import subprocess

    import pytest_ctresources.gpu.detect as gpus

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ct_gpus', {gpus.__file__!r})\n"
        "module = sys.modules['ct_gpus'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'pynvml' not in sys.modules, 'pynvml imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- memory in use


def test_used_memory_of_a_gpu_from_nvml(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = detect_gpus(nvml_env()).gpus[1]
    by_uuid = {str(entry["uuid"]): entry for entry in nvml.gpus}
    monkeypatch.setattr(nvml, "nvmlDeviceGetHandleByUUID", by_uuid.__getitem__, raising=False)
    real = nvml.nvmlDeviceGetMemoryInfo

    def six_gib_in_use(handle: dict[str, Any], version: int | None = None) -> SimpleNamespace:
        info = real(handle, version)
        return SimpleNamespace(**{**vars(info), "free": handle["total"] - 6 * GIB})

    monkeypatch.setattr(nvml, "nvmlDeviceGetMemoryInfo", six_gib_in_use)
    shutdowns = nvml.shutdowns
    reader = used_memory_reader(gpu, {})
    assert reader is not None
    assert [reader(), reader()] == [6 * GIB, 6 * GIB]  # NVML stays initialised in between
    assert nvml.shutdowns == shutdowns
    reader.close()
    assert nvml.shutdowns == shutdowns + 1
    # A GPU NVML cannot find by its UUID (or that has none) has no reader.
    assert used_memory_reader(GpuInfo(0, "x", GIB, None, None), {}) is None


def test_used_memory_of_fake_gpus() -> None:
    env = {FAKE_GPUS_ENV: "A=10;B=24", "CT_FAKE_GPUS_USED": ";6.5"}
    readers = [used_memory_reader(gpu, env) for gpu in detect_gpus(env).gpus]
    assert [reader() if reader else None for reader in readers] == [0, round(6.5 * GIB)]
    assert parse_fake_used("") == [0.0]
    with pytest.raises(
        ValueError, match=r"CT_FAKE_GPUS_USED: entry 1 '12' exceeds fake GPU 0's 10 GiB"
    ):
        parse_fake_used("12", [10, 24])
    with pytest.raises(ValueError, match=r"entry 2 '-1' is not a number of GiB >= 0"):
        parse_fake_used("1;-1")
