"""Hardware profiles: the public specs of datacenter GPUs, and the measured local machine.

Each built-in profile is one TOML file in ``profiles/`` with a citation beside every number;
``profiles/common.toml`` holds the host-side software costs they share (page faults, CPU
gather and dedup rates), which ``cachelab hw probe`` measures on the local machine. A profile
is selected by name (``B200``), by path (``my.toml``), or as ``local`` (the last probe).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from cachelab.errors import CachelabError
from cachelab.paths import cache_dir

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class GPU:
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    fp8_flops: float  # dense FLOP/s
    fp4_flops: float  # dense FLOP/s (Hopper: the FP8 rate, FP4 weights dequantised)
    bf16_flops: float
    nvlink_bw: float  # bytes/s per direction
    nvlink_domain: int  # GPUs one tensor-parallel group can span


@dataclass(frozen=True, slots=True)
class Host:
    link: str  # "pcie" or "c2c": how the GPU reaches host memory
    link_bw: float  # bytes/s per direction
    link_latency_s: float
    dram_bytes: float  # host memory per GPU
    cpu_cores: int  # per GPU


@dataclass(frozen=True, slots=True)
class CPU:
    minor_fault_s: float
    major_fault_s: float
    gather_rows_per_s: float  # per thread
    dedup_rows_per_s: float  # per thread
    memcpy_bw: float  # bytes/s per thread
    round_trip_s: float  # GPU -> CPU -> GPU hand-off
    threads: int


@dataclass(frozen=True, slots=True)
class SSD:
    iops_4k: float  # random 4 KiB reads/s per GPU
    latency_s: float


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    usd_per_gpu_hour: float | None
    gpu: GPU | None
    host: Host | None
    cpu: CPU
    ssd: SSD | None
    source: str


SECTIONS = {"gpu": GPU, "host": Host, "cpu": CPU, "ssd": SSD}


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CachelabError(f"cannot read hardware profile {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CachelabError(f"hardware profile {path} is not valid TOML: {exc}") from None


def _section(cls, data: dict, path: Path, name: str):
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise CachelabError(f"{path}: unknown key(s) {unknown} in [{name}]; allowed: {names}")
    missing = [n for n in names if n not in data]
    if missing:
        raise CachelabError(f"{path}: [{name}] is missing {missing}")
    values = {}
    for f in fields(cls):
        v = data[f.name]
        if f.type == "str":
            if not isinstance(v, str):
                raise CachelabError(f"{path}: [{name}] {f.name} must be a string, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:  # TOML spells nan, inf
            raise CachelabError(f"{path}: [{name}] {f.name} must be a positive number, got {v!r}")
        elif f.type == "int" and v != int(v):  # int(0.5) threads would be none
            raise CachelabError(f"{path}: [{name}] {f.name} must be a whole number >= 1, got {v!r}")
        values[f.name] = int(v) if f.type == "int" else v
    if name == "host" and values["link"] not in ("pcie", "c2c"):
        raise CachelabError(f"{path}: [host] link must be 'pcie' or 'c2c', got {values['link']!r}")
    return cls(**values)


def local_profile_path() -> Path:
    return cache_dir() / "hardware" / "local.toml"


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml") if p.stem != "common")


def load_profile(name: str | Path) -> HardwareProfile:
    """A profile by built-in name (case-insensitive), ``local``, or a TOML file path."""
    text = str(name)
    builtins = {n.lower(): PROFILE_DIR / f"{n}.toml" for n in builtin_names()}
    if text.lower() in builtins:
        path = builtins[text.lower()]
    elif text.lower() == "local":
        path = local_profile_path()
        if not path.is_file():
            raise CachelabError(f"no local profile at {path}: run `cachelab hw probe` first (it measures this "
                                "host only, no GPU: a serving replay, serve-sim or pareto, needs a GPU profile, "
                                f"one of {builtin_names()} or a TOML file with [gpu] and [host])")
    else:
        path = Path(text)
        if not path.is_file():
            raise CachelabError(f"unknown hardware {text!r}: not a file, and not one of {builtin_names() + ['local']}")
    data = _read(path)
    common = _read(PROFILE_DIR / "common.toml")
    # [efficiency], [calibration]: what `cachelab calibrate` fitted beside the profile (live_calibration)
    unknown = sorted(set(data) - {"name", "usd_per_gpu_hour", "efficiency", "calibration", *SECTIONS})
    if unknown:
        raise CachelabError(f"{path}: unknown top-level key(s) {unknown}")
    merged = {"cpu": {**common["cpu"], **data.get("cpu", {})}}
    parts = {key: _section(cls, data[key] if key != "cpu" else merged["cpu"], path, key)
             if key in data or key == "cpu" else None for key, cls in SECTIONS.items()}
    if not isinstance(data.get("name", ""), str):
        raise CachelabError(f"{path}: name must be a string, got {data['name']!r}")
    price = data.get("usd_per_gpu_hour")
    if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float)) or not 0 < price < math.inf):
        raise CachelabError(f"{path}: usd_per_gpu_hour must be a positive number, got {price!r}")
    return HardwareProfile(name=str(data.get("name", path.stem)), usd_per_gpu_hour=price,
                           source=str(path), **parts)
