"""`cachelab store build --from-safetensors`: real Engram tensors (written here with the
safetensors package, as a checkpoint holds them) become the table files, `verify` and the
store's lookups compare against those tensors, and a wrong checkpoint is an error naming the
tensor and the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.engram.config import EngramConfig
from cachelab.errors import CachelabError
from cachelab.store import TieredStore, build_tables, verify_tables
from cachelab.store.bench import check_rows
from cachelab.store.format import PAGE
from cachelab.store.source import quantize_rows

TINY = EngramConfig(name="tiny", layers=(1, 3), max_ngram=3, heads=2, base_sizes=(40, 60), compressed_vocab=1000)


def fp8_tensors(rng) -> dict[str, np.ndarray]:
    """FP8 E4M3 tables with UE8M0 scales (U8), DeepSeek-V4.1's naming with the ``model.`` prefix."""
    out = {}
    for li, lid in enumerate(TINY.layers):
        rows = int(TINY.table_rows[li])
        vals = rng.integers(0, 256, (rows, 256), dtype=np.uint8)
        vals[(vals & 0x7F) == 0x7F] = 0x42  # no NaN bytes in a real table
        out[f"model.layers.{lid}.engram.embed.weight"] = vals
        out[f"model.layers.{lid}.engram.embed.weight_scale_inv"] = rng.integers(115, 135, (rows, 8), dtype=np.uint8)
    return out


def save_fp8(tensors: dict[str, np.ndarray], path) -> None:
    """As a checkpoint stores them: tables as F8_E4M3, scales as U8 exponent bytes."""
    save_torch({k: torch.from_numpy(v).view(torch.float8_e4m3fn) if k.endswith(".weight") else torch.from_numpy(v)
                for k, v in tensors.items()}, path)


def test_fp8_checkpoint_builds_the_same_bytes_and_verifies_against_it(tmp_path):
    tensors = fp8_tensors(np.random.default_rng(0))
    ckpt = tmp_path / "model.safetensors"
    save_fp8(tensors, ckpt)
    d = tmp_path / "tables"
    manifest = build_tables(TINY, 1.0, d, progress=False, from_safetensors=ckpt)
    assert manifest["source"]["kind"] == "safetensors"
    assert manifest["source"]["layers"][0]["tensor"] == "model.layers.1.engram.embed.weight"
    for li, lid in enumerate(TINY.layers):
        data = np.frombuffer((d / f"layer{lid}.tbl").read_bytes()[PAGE:], np.uint8).reshape(-1, PAGE)
        rows = data[:, : 15 * 264].reshape(-1, 264)[: TINY.table_rows[li]]
        np.testing.assert_array_equal(rows[:, :256], tensors[f"model.layers.{lid}.engram.embed.weight"])
        np.testing.assert_array_equal(rows[:, 256:], tensors[f"model.layers.{lid}.engram.embed.weight_scale_inv"])
    assert verify_tables(d) == {"rows_checked": int(TINY.table_rows.sum()), "mismatches": 0}
    # a flipped byte is found against the checkpoint (the SplitMix64 recompute would differ everywhere)
    path = d / "layer3.tbl"
    data = bytearray(path.read_bytes())
    data[PAGE + 264 * 2 + 7] ^= 0x01
    path.write_bytes(bytes(data))
    assert verify_tables(d)["mismatches"] == 1


def test_bf16_checkpoint_is_quantised_and_lookups_check_against_it(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {}
    for li, lid in enumerate(TINY.layers):
        x = torch.from_numpy(rng.standard_normal((int(TINY.table_rows[li]), 256)).astype(np.float32) * 0.02)
        tensors[f"layers.{lid}.engram.embed.weight"] = x.to(torch.bfloat16)
    ckpt = tmp_path / "bf16.safetensors"
    save_torch(tensors, ckpt)
    d = tmp_path / "tables"
    build_tables(TINY, 1.0, d, progress=False, from_safetensors=ckpt)
    assert verify_tables(d)["mismatches"] == 0
    w = tensors["layers.1.engram.embed.weight"].float()
    fp8, scale = quantize_rows(tensors["layers.1.engram.embed.weight"].view(torch.uint16).numpy(), "BF16")
    back = torch.from_numpy(fp8).view(torch.float8_e4m3fn).float() * torch.exp2(
        torch.from_numpy(scale).float() - 127).repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= w.abs().reshape(-1, 8, 32).amax(2).repeat_interleave(32, 1) / 8).all()  # E4M3 step
    assert (w.reshape(-1, 8, 32).abs().amax(2) / torch.exp2(torch.from_numpy(scale).float() - 127) <= 448).all()
    with TieredStore.open(d, backing="mmap", hbm_policy="lru", hbm_capacity=50) as store:
        rows = TINY.offsets[None] + rng.integers(0, TINY.primes[None], (20, 2, 4))
        got = store.lookup(rows)
        assert check_rows(store, rows, got) == 0
        # the checked reference is the checkpoint's: row 0 of layer 1 equals its quantised tensor row
        ref = store.source.rows(0, np.array([0]))
        np.testing.assert_array_equal(ref[0, :256], fp8[0])


def test_bad_checkpoints_name_the_tensor_and_file(tmp_path):
    rng = np.random.default_rng(2)
    good = fp8_tensors(rng)
    missing = {k: v for k, v in good.items() if ".3." not in k}
    save_fp8(missing, tmp_path / "missing.safetensors")
    with pytest.raises(CachelabError, match=r"missing\.safetensors: no tensor 'layers\.3\.engram\.embed\.weight'"):
        build_tables(TINY, 1.0, tmp_path / "a", progress=False, from_safetensors=tmp_path / "missing.safetensors")
    wrong = dict(good)
    wrong["model.layers.3.engram.embed.weight"] = good["model.layers.3.engram.embed.weight"][:-1]
    save_fp8(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(CachelabError, match=r"wrong\.safetensors: tensor 'model\.layers\.3\.engram\.embed\.weight' "
                                            r"has shape \[243, 256\], the layout needs \[244, 256\]"):
        build_tables(TINY, 1.0, tmp_path / "b", progress=False, from_safetensors=tmp_path / "wrong.safetensors")
    assert not (tmp_path / "b" / "manifest.json").exists()
    save_file(good, tmp_path / "u8.safetensors")  # tables as plain bytes: not a table dtype
    with pytest.raises(CachelabError, match=r"u8\.safetensors: tensor 'model\.layers\.1\.engram\.embed\.weight' "
                                            r"has dtype U8"):
        build_tables(TINY, 1.0, tmp_path / "b", progress=False, from_safetensors=tmp_path / "u8.safetensors")
    no_scale = {k: v for k, v in good.items() if "layers.1." not in k or k.endswith(".weight")}
    save_fp8(no_scale, tmp_path / "noscale.safetensors")
    with pytest.raises(CachelabError, match=r"noscale\.safetensors: FP8 tensor 'model\.layers\.1\.engram\.embed"
                                            r"\.weight' has no UE8M0 scale tensor"):
        build_tables(TINY, 1.0, tmp_path / "b", progress=False, from_safetensors=tmp_path / "noscale.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    runner = CliRunner()
    res = runner.invoke(app, ["store", "build", "--layout", "deepseek-v4.1-flash", "--scale", "1e-6", "--dir",
                              str(tmp_path / "c"), "--from-safetensors", str(tmp_path / "junk.safetensors")])
    assert res.exit_code == 2 and "junk.safetensors: not a safetensors file" in res.output


def test_f32_scales_are_read_as_ue8m0_bytes_across_the_whole_range(tmp_path):
    """F32 scales: 2^-127 (float32's one subnormal power of two in UE8M0's range) is byte 0 and
    2^127 byte 254; 0.0 and +inf passed as bytes 0 and 255 (2^-127 and UE8M0's NaN) and 2^-127
    was refused; now those, NaN, negatives and non-powers are refused, naming the value."""
    good = fp8_tensors(np.random.default_rng(3))
    key = "model.layers.1.engram.embed.weight_scale_inv"

    def saved(name, first):
        tensors = {k: torch.from_numpy(v).view(torch.float8_e4m3fn) if k.endswith(".weight") else
                   torch.exp2(torch.from_numpy(v).float() - 127) for k, v in good.items()}
        tensors[key][0, :2] = torch.tensor(first, dtype=torch.float32)
        save_torch(tensors, tmp_path / f"{name}.safetensors")
        return tmp_path / f"{name}.safetensors"

    d = tmp_path / "ends"
    build_tables(TINY, 1.0, d, progress=False, from_safetensors=saved("ends", [2.0**-127, 2.0**127]))
    assert (d / "layer1.tbl").read_bytes()[PAGE + 256: PAGE + 258] == bytes([0, 254])
    assert verify_tables(d)["mismatches"] == 0
    for name, value in (("zero", 0.0), ("inf", float("inf")), ("nan", float("nan")), ("negative", -2.0),
                        ("three-eighths", 0.375)):
        with pytest.raises(CachelabError, match=fr"{name}\.safetensors: scale tensor '{key}' holds {value!r} \(row 0, "
                                                r"block 1\): a UE8M0 scale is a power of two from 2\^-127 to 2\^127"):
            build_tables(TINY, 1.0, tmp_path / name, progress=False, from_safetensors=saved(name, [1.0, value]))
        assert not (tmp_path / name / "manifest.json").exists()


def test_a_non_finite_value_in_a_bf16_checkpoint_is_named_with_its_file_tensor_and_row(tmp_path):
    """A BF16 table holding a NaN or an infinity was refused with 'the table holds NaN or infinite
    values', naming neither the checkpoint, the tensor nor where; now all three."""
    rng = np.random.default_rng(4)
    tensors = {f"layers.{lid}.engram.embed.weight": torch.from_numpy(
        rng.standard_normal((int(TINY.table_rows[li]), 256)).astype(np.float32)).to(torch.bfloat16)
        for li, lid in enumerate(TINY.layers)}
    tensors["layers.3.engram.embed.weight"][5, 7] = float("inf")
    save_torch(tensors, tmp_path / "bf16.safetensors")
    with pytest.raises(CachelabError, match=r"bf16\.safetensors: tensor 'layers\.3\.engram\.embed\.weight' holds inf "
                                            r"at row 5, column 7: the FP8 row format cannot carry NaN"):
        build_tables(TINY, 1.0, tmp_path / "t", progress=False, from_safetensors=tmp_path / "bf16.safetensors")
    assert not (tmp_path / "t" / "manifest.json").exists()
