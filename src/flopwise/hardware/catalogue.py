"""The one hardware catalogue: dense peak FLOP/s per dtype, memory, links. Pure Python.

Bandwidths are per device and per direction. Sources are given per entry; "V" = read in the
vendor datasheet or the paper that used the number, "V2" = secondary copy, "U" = unverified. The
`cpu` entry has no fixed peak: the trainer measures a matmul ceiling on the machine it runs on.
Extend with a TOML file whose tables have the same field names (`load_catalogue`).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from flopwise.errors import ConfigError
from flopwise.hardware.calibration import Calibration, calibration_toml, parse_calibration, positive_number
from flopwise.hardware.restart_costs import Recovery, parse_recovery, recovery_toml

GB = 1e9
GiB = 2**30
TB = 1e12

# Achievable dense-GEMM share of peak. A100: calibrated on the one published per-layer timing on
# that chip, Korthikanti et al. 2022 Table 4 (a 22B layer, tp 8, micro-batch 4: forward 7.7 ms),
# which the planner's layer model reproduces at 0.75; a microbenchmark, not one of the end-to-end
# runs the planner is validated against. H100 SXM and H200: measured (`hopper_calibration`). Other chips: U, assumed
# the same until measured (`flopwise hardware calibrate` on one; put the figure in a catalogue TOML).
_A100_GEMM = 0.75


def hopper_calibration(hbm_bw: float, source: str) -> Calibration:
    """Hopper tables measured on this project's H200 (2026-12-04, torch 2.11, cuBLAS, cuDNN SDPA):
    benchmarks/published/hopper_tables.py derives every row from the kernel profile of a compiled 1.1B Llama
    step (benchmarks/gpu/results/gpu_llama1b_z3_b8.json) beside the planner's time for the same work,
    and tests check the rows against that profile. One measured shape per table, not curves: the
    GEMM share is all 339 products of that step (A100's assumed 0.75 gave the same within 1%); cuDNN
    attention's backward ran at 0.64 of the peak, not 0.75. An H100 SXM has the same GH100 compute
    and libraries, so the same compute shares (published large-GEMM ceilings agree: H100 SXM 792
    TFLOP/s = 80% of peak, ml-engineering's MAMF table; torchao's roofline 0.78); its memory-bound
    rates scale with its HBM bandwidth. The memory-bound rate (3.96 TB/s on the H200) is every
    memory-bound byte the planner books in that step (element-wise work, FSDP2's copies, the clip)
    over those kernels' time; the optimizer row is the fused AdamW's time plus the clip's bytes at
    that rate, as `hardware calibrate` times the two together. `flopwise hardware calibrate --device
    cuda` measures full tables on the user's own GPU."""
    scale = hbm_bw / _H200_HBM
    return Calibration(
        dtype="bf16",
        gemm=((16384, 8192, 2048, _HOPPER_GEMM),),
        attention=((2048, 64, 0.736, 0.643),),
        elementwise=((1, 67108864, 3.96e12 * scale),),
        optimizer=((1104218112, 0.01221 / scale),),
        source=source,
    )


_HOPPER_GEMM = 0.743
_H200_HBM = 4800 * GB


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense (no 2:4 sparsity) FLOP/s by dtype: bf16, fp16, fp32, fp8
    memory_bytes: float
    memory_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s per device per direction (NVLink, ICI)
    inter_node_bw: float  # bytes/s per device per direction (InfiniBand/RoCE/DCN)
    devices_per_node: int
    source: str
    notes: str = ""
    matmul_efficiency: float = _A100_GEMM  # achievable share of peak for large dense GEMMs (chip + BLAS)
    extra: dict = field(default_factory=dict)
    calibration: Calibration | None = None  # measured tables (`flopwise hardware calibrate`), else the above
    recovery: Recovery | None = None  # measured checkpoint write and restart (calibrate), else plan's constants

    def peak(self, dtype: str) -> float | None:
        return self.peak_flops.get(dtype)

    @property
    def peak_16bit(self) -> float | None:
        """The dense peak that planning and MFU are stated against: bf16, else fp16 (V100); an entry
        `hardware calibrate` measured in fp32 (a CPU without bf16 instructions, whose runs train in
        fp32) has only that peak, and its tables are shares of it."""
        fp32 = self.peak("fp32") if self.calibration and self.calibration.dtype == "fp32" else None
        return self.peak("bf16") or self.peak("fp16") or fp32


CATALOGUE: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware(
            "v100-32gb",
            {"fp16": 125e12, "fp32": 15.7e12},
            32 * GiB,
            900 * GB,
            150 * GB,
            12.5 * GB,
            8,
            "V2/U: NVIDIA V100 datasheet (125 TFLOP/s tensor); NVLink2 300 GB/s bidirectional; 100 Gb/s IB",
            notes="no bf16 tensor cores: bf16 runs are not supported at speed",
        ),
        Hardware(
            "a100-40gb",
            {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
            40 * GiB,
            1555 * GB,
            300 * GB,
            25 * GB,
            8,
            "V: 312 TFLOP/s in Narayanan et al. 2021 §5 and PaLM App. B; V2: NVIDIA A100 datasheet; "
            "8x 200 Gb/s HDR per node (Selene)",
            matmul_efficiency=_A100_GEMM,
        ),
        Hardware(
            "a100-80gb",
            {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
            80 * GiB,
            2039 * GB,
            300 * GB,
            25 * GB,
            8,
            "V: Narayanan et al. 2021 (312 TFLOP/s, 8x HDR 200 Gb/s per DGX A100); V2: NVIDIA datasheet",
            matmul_efficiency=_A100_GEMM,
        ),
        Hardware(
            "h100-sxm",
            {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12},
            80 * GiB,
            3350 * GB,
            450 * GB,
            50 * GB,
            8,
            "V2: NVIDIA H100 datasheet (989 dense bf16); NVLink4 900 GB/s bidirectional; "
            "V: Llama 3 paper, 400 Gb/s per GPU RoCE/IB",
            matmul_efficiency=_HOPPER_GEMM,
            calibration=hopper_calibration(
                3350 * GB, "D: the H200's measured compute shares; memory-bound rates x 3.35/4.8 TB/s"
            ),
        ),
        Hardware(
            "h100-pcie",
            {"bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51.2e12},
            80 * GiB,
            2000 * GB,
            300 * GB,
            50 * GB,
            8,
            "V2: NVIDIA H100 datasheet, PCIe column (1,513 TFLOP/s bf16 with sparsity = 756.5 dense; "
            "2.0 TB/s HBM2e; NVLink bridge 600 GB/s bidirectional)",
        ),
        Hardware(
            "h100-nvl",
            {"bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12, "tf32": 417.5e12, "fp32": 60e12},
            94 * GB,
            3900 * GB,
            300 * GB,
            50 * GB,
            8,
            "V2: NVIDIA H100 NVL datasheet (1,671 TFLOP/s bf16 with sparsity = 835.5 dense; 94 GB HBM3, 3.9 TB/s)",
        ),
        Hardware(
            "h200",
            {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12},
            141 * GB,
            4800 * GB,
            450 * GB,
            50 * GB,
            8,
            "V2: NVIDIA H200 datasheet / MLCommons system description (141 GB HBM3e, 4.8 TB/s)",
            matmul_efficiency=_HOPPER_GEMM,
            calibration=hopper_calibration(_H200_HBM, "measured: this project's H200 profile"),
        ),
        Hardware(
            "h200-nvl",
            {"bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12, "tf32": 417.5e12, "fp32": 60e12},
            141 * GB,
            4800 * GB,
            450 * GB,
            50 * GB,
            8,
            "V2: NVIDIA H200 NVL datasheet (1,671 TFLOP/s bf16 with sparsity = 835.5 dense; 141 GB, 4.8 TB/s)",
        ),
        Hardware(
            "l4",
            {"bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12, "tf32": 60e12, "fp32": 30.3e12},
            24 * GB,
            300 * GB,
            32 * GB,
            25 * GB,
            8,
            "V2: NVIDIA L4 datasheet (242 TFLOP/s bf16 with sparsity = 121 dense; 24 GB GDDR6, 300 GB/s; "
            "PCIe Gen4 x16, no NVLink)",
        ),
        Hardware(
            "l40s",
            {"bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12, "tf32": 183e12, "fp32": 91.6e12},
            48 * GB,
            864 * GB,
            32 * GB,
            25 * GB,
            8,
            "V2: NVIDIA L40S datasheet (362.05 TFLOP/s bf16 dense, 733 with sparsity; 48 GB GDDR6, 864 GB/s; "
            "PCIe Gen4 x16, no NVLink)",
        ),
        Hardware(
            "b200",
            {"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "fp32": 80e12},
            180 * GB,
            8000 * GB,
            900 * GB,
            50 * GB,
            8,
            "U: NVIDIA HGX B200 spec sheet (dense = half the sparse figures); NVLink5 1.8 TB/s bidirectional",
        ),
        Hardware(
            "tpu-v3",
            {"bf16": 123e12},
            32 * GiB,
            900 * GB,
            82 * GB,
            82 * GB,
            1024,
            "V2: 123 TFLOP/s bf16 per chip (LaMDA); U: memory and ICI",
            notes="ICI is the only fabric in a pod: devices_per_node is the pod (1024 chips)",
        ),
        Hardware(
            "tpu-v4",
            {"bf16": 275e12, "int8": 275e12},
            32 * GiB,
            1200 * GB,
            135 * GB,
            135 * GB,
            3072,
            "V: 275 TFLOP/s bf16 in PaLM App. B; V2: Google Cloud's TPU v4 page (275 TFLOP/s bf16 or int8, "
            "32 GiB HBM2 at 1200 GB/s; the same chip as Jouppi et al., ISCA 2023); U: ICI 270 GB/s a chip in "
            "Pope et al. 2022 §2, booked as 135 GB/s each way",
            notes="devices_per_node is PaLM's 3072-chip pod; pods are joined by DCN (inter_node_bw, U); "
            "collectives are priced as rings, not the 3D torus's multi-dimensional ones",
        ),
        Hardware(
            "tpu-v5p",
            {"bf16": 459e12, "fp8": 918e12},
            95 * GB,
            2765 * GB,
            300 * GB,
            300 * GB,
            8960,
            "U: Google Cloud TPU v5p spec (459 TFLOP/s bf16, 95 GB HBM2e, 4800 Gb/s ICI)",
        ),
        Hardware(
            "cpu",
            {},
            0.0,
            0.0,
            0.0,
            0.0,
            1,
            "measured: flopwise times a square matmul in the training dtype on the machine it runs on",
        ),
    ]
}


# What torch.cuda.get_device_name says -> catalogue entry. Names as the driver reports them, e.g.
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA L4", "NVIDIA L40S", "NVIDIA B200". Whole words, so "L4"
# never matches "L40S"; the A100's two memory sizes share a name stem and are told apart by memory.
_GPU_RULES: list[tuple[str, str | None, str]] = [  # (chip word, variant word or None, catalogue entry)
    ("h100", "nvl", "h100-nvl"),
    ("h100", "pcie", "h100-pcie"),
    ("h100", None, "h100-sxm"),
    ("h200", "nvl", "h200-nvl"),
    ("h200", None, "h200"),
    ("b200", None, "b200"),
    ("l40s", None, "l40s"),
    ("l4", None, "l4"),
]


def identify_gpu(device_name: str, memory_bytes: float) -> str | None:
    """The catalogue entry of a GPU from its driver name and memory; None for a chip the catalogue
    does not know (the trainer then measures a ceiling instead of guessing a peak)."""
    words = device_name.lower().replace("-", " ").replace("_", " ").split()
    if "a100" in words:
        return "a100-80gb" if memory_bytes > 60 * GiB else "a100-40gb"
    for chip, variant, entry in _GPU_RULES:
        if chip in words and (variant is None or variant in words):
            return entry
    return None


def cpu_multiplies_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU has bf16 matrix instructions (AMX-BF16 or AVX512-BF16 among
    /proc/cpuinfo's flags; `cpuinfo`: that file's text). Without them PyTorch's CPU bf16 matmuls take
    a path tens of times slower than fp32 (2026-12-07, an AMD EPYC with AVX2 only: 512x512 products 1.35
    GFLOP/s in bf16 against 73 in fp32 on one thread; the demo trained at 60 tokens/s under bf16
    autocast against 2,850 in fp32 on two). No such file (macOS, Windows): False, as fp32 is never
    that slow."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    return "amx_bf16" in flags or "avx512_bf16" in flags


def auto_dtype(hw: Hardware) -> Literal["bf16", "fp32"]:
    """train.dtype=auto: bf16 where `hw` has a bf16 peak: a catalogue GPU, or an entry `hardware
    calibrate` measured (its tables are bf16 only, so its plans and `plan measure` stay in the
    dtype they were measured in); on the built-in `cpu` entry, with no peak at all, bf16 where this
    machine's CPU has bf16 instructions (cpu_multiplies_bf16); else (a V100: fp16 and fp32) fp32."""
    native = hw.peak("bf16") is not None or (not hw.peak_flops and cpu_multiplies_bf16())
    return "bf16" if native else "fp32"


def get_hardware(name: str, catalogue: dict[str, Hardware] | None = None, option: str = "cluster.hardware") -> Hardware:
    """A catalogue entry; an unknown name is one line naming `option` (the key or flag that gave it)."""
    cat = catalogue or CATALOGUE
    if name not in cat:
        raise ConfigError(f"{option}: unknown hardware {name!r} (known: {', '.join(cat)})")
    return cat[name]


def cluster_catalogue(cluster) -> dict[str, Hardware]:
    """The built-in catalogue, with cluster.hardware_file's entries when given."""
    return load_catalogue(cluster.hardware_file) if cluster.hardware_file else CATALOGUE


def cluster_hardware(cluster) -> Hardware:
    """The accelerator a config's `cluster` section names, with cluster.gpus_per_node applied: what
    the planner plans for (the trainer's MFU identifies the device it runs on instead)."""
    hw = get_hardware(cluster.hardware, cluster_catalogue(cluster))
    return replace(hw, devices_per_node=cluster.gpus_per_node) if cluster.gpus_per_node else hw


_NUMBERS = ("memory_bytes", "memory_bw", "intra_node_bw", "inter_node_bw")


def load_catalogue(path: str | Path) -> dict[str, Hardware]:
    """The built-in catalogue plus the entries of a TOML file (one table per device; an entry
    named like a built-in one replaces it). Every field is checked, so a bad or partial file fails
    in one line naming the field instead of planning with a hole in it."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"hardware file {path}: cannot read ({e})") from None
    if not data:
        raise ConfigError(
            f"hardware file {path}: holds no hardware entry; measure one with `flopwise hardware "
            "calibrate --out FILE` (a new file) and give cluster.hardware=NAME (the name it prints), "
            "or drop cluster.hardware_file"
        )
    cat = dict(CATALOGUE)
    for name, fields in data.items():
        where = f"hardware file {path}: [{name}]"
        if not isinstance(fields, dict):
            raise ConfigError(f"{where}: a table of fields is needed")
        fields = dict(fields)
        peaks = fields.get("peak_flops")
        if not isinstance(peaks, dict) or not all(positive_number(v) for v in peaks.values()):
            raise ConfigError(f"{where}.peak_flops: a table of dtype = FLOP/s (positive numbers) is needed")
        for key in _NUMBERS:
            if key in fields and not (positive_number(fields[key]) or (name == "cpu" and fields[key] == 0)):
                raise ConfigError(f"{where}.{key}: a positive number is needed, got {fields[key]!r}")
        eff = fields.get("matmul_efficiency", _A100_GEMM)
        if not (positive_number(eff) and eff <= 1):
            raise ConfigError(f"{where}.matmul_efficiency: a share of the peak in (0, 1] is needed, got {eff!r}")
        dpn = fields.get("devices_per_node", 1)
        if not isinstance(dpn, int) or isinstance(dpn, bool) or dpn < 1:
            raise ConfigError(f"{where}.devices_per_node: a whole number >= 1 is needed, got {dpn!r}")
        if "calibration" in fields:
            fields["calibration"] = parse_calibration(f"{where}.calibration", fields["calibration"])
        if "recovery" in fields:
            fields["recovery"] = parse_recovery(f"{where}.recovery", fields["recovery"])
        try:
            cat[name] = Hardware(name=name, **fields)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None
    return cat


def hardware_toml(hw: Hardware) -> dict:
    """A hardware entry as a TOML table `load_catalogue` reads back."""
    out = {
        "peak_flops": dict(hw.peak_flops),
        "memory_bytes": hw.memory_bytes,
        "memory_bw": hw.memory_bw,
        "intra_node_bw": hw.intra_node_bw,
        "inter_node_bw": hw.inter_node_bw,
        "devices_per_node": hw.devices_per_node,
        "source": hw.source,
        "matmul_efficiency": hw.matmul_efficiency,
    }
    if hw.notes:
        out["notes"] = hw.notes
    if hw.calibration:
        out["calibration"] = calibration_toml(hw.calibration)
    if hw.recovery:
        out["recovery"] = recovery_toml(hw.recovery)
    return out


def busy_note(what: str) -> str | None:
    """A one-line warning when other processes keep this machine's cores busy (1-minute load average
    at least its core count) before `what` times anything: what it measures then is the share of the
    machine it got, slower than the machine."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return None
    cores = os.cpu_count() or 1
    if load < cores:
        return None
    return (
        f"this machine is busy (1-minute load average {load:.1f} on {cores} cores): {what} will read slower "
        "than the machine is; rerun it when the machine is quiet"
    )
