"""Hardware profiles, the model spec and the latency model: hand-computed cases."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cachelab.errors import CachelabError
from cachelab.serving.hardware import PROFILE_DIR, builtin_names, load_profile
from cachelab.serving.hardware.probe import (dedup_rows_per_s, gather_rows_per_s, memcpy_bw, page_faults, random_reads,
                                             write_profile)
from cachelab.serving.latency import Batch, Efficiency, EngramStep, LatencyModel
from cachelab.serving.model_spec import MODEL_DIR, load_model

MODEL = load_model()


def test_every_profile_loads_and_every_number_is_cited():
    assert set(builtin_names()) == {"H100", "H200", "B200", "B300", "GB200", "GH200"}
    for name in builtin_names():
        p = load_profile(name.lower())
        assert p.gpu.hbm_bytes > 0 and p.usd_per_gpu_hour > 0
    for path in [*PROFILE_DIR.glob("*.toml"), *MODEL_DIR.glob("*.toml")]:
        for line in path.read_text().splitlines():
            if re.match(r"^\w+ = [\d\[]", line):
                assert "#" in line, f"{path.name}: uncited number: {line}"
    assert load_profile("B200").usd_per_gpu_hour == 1.95  # ANCHORS.md §6


def test_the_memory_plan_starts_from_the_memory_cuda_reports():
    # vLLM's KV budget is gpu_memory_utilization x torch.cuda.mem_get_info()'s total: on a B200 178.35 GiB
    # (pytorch/ao#4002's device query), not the datasheet's 180 GB (seen by helper-118)
    b200 = load_profile("B200")
    assert b200.gpu.hbm_bytes == pytest.approx(178.35 * 2**30, rel=1e-3)
    plan = LatencyModel(MODEL, b200, 4, "dram-uva", max_num_batched_tokens=16384).plan
    assert plan.usable_bytes == pytest.approx(0.9 * 178.35 * 2**30 - 6e9, rel=1e-3)
    assert plan.kv_bytes == pytest.approx(plan.usable_bytes - plan.weight_bytes - plan.indexer_buffer_bytes)


def test_b200_peak_bandwidth_is_the_device_s():
    # The roofline's peak is what the device has: a 7,680-bit bus at 3,996 MHz, DDR (pytorch/ao#4002's device
    # query), 7.672 TB/s, not the datasheet's 8 TB/s (which MBU, fitted on B200 points, absorbed, and then
    # carried to every other profile 4% too slow)
    assert load_profile("B200").gpu.hbm_bw == pytest.approx(7680 / 8 * 3996e6 * 2, rel=1e-4)


def test_bad_profile_names_the_key(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text((PROFILE_DIR / "B200.toml").read_text().replace("hbm_bw = 7.672e12", "hbm_bw = -1"))
    with pytest.raises(CachelabError, match=r"\[gpu\] hbm_bw must be a positive number"):
        load_profile(bad)
    for value in ("nan", "inf"):  # TOML numbers: NaN vanished in the rooflines' max() and gave finite figures
        bad.write_text((PROFILE_DIR / "B200.toml").read_text().replace("hbm_bw = 7.672e12", f"hbm_bw = {value}"))
        with pytest.raises(CachelabError, match=rf"\[gpu\] hbm_bw must be a positive number, got {value}"):
            load_profile(bad)
        bad.write_text((PROFILE_DIR / "B200.toml").read_text().replace("usd_per_gpu_hour = 1.95", f"usd_per_gpu_hour = {value}"))
        with pytest.raises(CachelabError, match=f"usd_per_gpu_hour must be a positive number, got {value}"):
            load_profile(bad)
        spec = tmp_path / "spec.toml"
        spec.write_text((MODEL_DIR / "deepseek-v4.1-flash.toml").read_text().replace("hidden = 5120", f"hidden = {value}"))
        with pytest.raises(CachelabError, match=rf"\[backbone\] hidden must be a positive number, got {value}"):
            load_model(spec)
    with pytest.raises(CachelabError, match="unknown hardware 'nope'"):
        load_profile("nope")


@pytest.mark.parametrize("old, new, message", [
    ("[cpu]\n", "[cpu]\nthreads = 0.5\n", r"\[cpu\] threads must be a whole number >= 1, got 0.5"),  # int(0.5): 0
    ("nvlink_domain = 8 ", "nvlink_domain = 7.5 ", r"\[gpu\] nvlink_domain must be a whole number >= 1, got 7.5"),
    ('name = "B200"', "name = [1]", r"name must be a string, got \[1\]"),
])
def test_a_profile_count_that_is_not_whole_or_a_name_that_is_not_text_is_refused(tmp_path, old, new, message):
    text = (PROFILE_DIR / "B200.toml").read_text()
    bad = tmp_path / "x.toml"
    assert old in text
    bad.write_text(text.replace(old, new))
    with pytest.raises(CachelabError, match=rf"x.toml: {message}"):  # 0.5 threads was a ZeroDivisionError
        load_profile(bad)


@pytest.mark.parametrize("old, new, message", [
    ("kv_replicated_across_tp = true", 'kv_replicated_across_tp = "false"',
     r"\[attention\] kv_replicated_across_tp must be true or false, got 'false'"),  # bool('false') was True
    ("table_sharded_across_tp = true", "table_sharded_across_tp = 0",
     r"\[engram\] table_sharded_across_tp must be true or false, got 0"),
    ("compress_ratios = [0, 0, 2,", "compress_ratios = [0, -1, 2,",
     r"\[attention\] compress_ratios must be a list of whole numbers >= 0"),  # -1 was read as no compression
    ("compress_ratios = [0, 0, 2,", 'compress_ratios = ["0", 0, 2,',
     r"\[attention\] compress_ratios must be a list of whole numbers >= 0"),
    ("index_sources = [[2, 0],", "index_sources = [2, [2, 0],",
     r"\[attention\] index_sources must be a list of \[a, b\] pairs"),  # were tracebacks
    ("acceptance_length = 3.51", 'acceptance_length = "3.51"', r"\[mtp\] acceptance_length must be a positive number"),
    ("draft_passes_per_step = 1 ", "draft_passes_per_step = 0 ",
     r"\[mtp\] speculative_tokens 5 needs draft_passes_per_step >= 1"),  # was a ZeroDivisionError per step
])
def test_a_model_spec_value_of_the_wrong_kind_is_refused_naming_the_key(tmp_path, old, new, message):
    text = (MODEL_DIR / "deepseek-v4.1-flash.toml").read_text()
    assert old in text
    spec = tmp_path / "spec.toml"
    spec.write_text(text.replace(old, new, 1))
    with pytest.raises(CachelabError, match=rf"spec.toml: {message}"):
        LatencyModel(load_model(spec), load_profile("B200"), 4, "dram-uva").step_time(
            Batch([1000.0], [1006.0], [8.0], lm_rows=48, drafting=8), [])


def test_probe_measures_and_round_trips(tmp_path):
    assert memcpy_bw(8 << 20) > 1e8 and gather_rows_per_s(8 << 20, 1 << 14) > 1e4 and dedup_rows_per_s(1 << 14) > 1e4
    path = tmp_path / "f.bin"
    path.write_bytes(b"\1" * (4 << 20))
    faults = page_faults(path)
    assert 0 < faults["minor_fault_s"] < float("inf")  # a time, not a bound on it: 1.6 ms a fault was seen at load 3
    assert faults["major_fault_s"] > 0 if faults["major_faults_seen"] else faults["major_fault_s"] is None
    result = {"name": "local", "host": {"link": "pcie", "link_bw": 1e10, "link_latency_s": 2e-6, "dram_bytes": 1e10,
                                        "cpu_cores": 2},
              "cpu": {"minor_fault_s": 1e-6, "major_fault_s": 1e-4, "gather_rows_per_s": 1e6, "dedup_rows_per_s": 1e6,
                      "memcpy_bw": 1e10, "round_trip_s": 2e-5, "threads": 2},
              "ssd": {"iops_4k": 1e5, "latency_s": 1e-4}}
    prof = load_profile(write_profile(result, tmp_path / "local.toml"))
    assert prof.gpu is None and prof.cpu.gather_rows_per_s == 1e6 and prof.ssd.iops_4k == 1e5
    with pytest.raises(CachelabError, match="no \\[gpu\\]"):
        LatencyModel(MODEL, prof)


def test_the_probe_times_the_dedup_the_ssd_patch_calls(monkeypatch):
    """The model's dedup_rows_per_s is the patch's np.unique(ids, return_inverse=True) over int64 row
    ids (common.toml, benchmarks/bench_engram_host_path.py); the probe timed np.unique(ids) on int32,
    a hash-table path since NumPy 2.3, 1.4-4.8 M ids/s here against that call's 17-38 M."""
    calls, unique = [], np.unique
    monkeypatch.setattr(np, "unique", lambda ids, **kw: calls.append((ids.dtype, kw)) or unique(ids, **kw))
    assert dedup_rows_per_s(1 << 12) > 0
    assert calls and all(dtype == np.int64 and kw == {"return_inverse": True} for dtype, kw in calls)


def test_the_probe_saves_the_one_fetch_thread_the_model_charges(tmp_path, monkeypatch):
    """Its rates are one thread's, and the fetch they cost runs on one host thread per GPU worker
    (common.toml); the probe saved threads = os.cpu_count(), so `--hardware local` divided every
    dedup, gather and fault cost by the machine's cores."""
    from cachelab.serving.hardware import probe as probe_module

    for name in ("memcpy_bw", "gather_rows_per_s", "dedup_rows_per_s"):
        monkeypatch.setattr(probe_module, name, lambda: 1e9)
    monkeypatch.setattr(probe_module, "page_faults", lambda path: {"minor_fault_s": 1e-6, "major_fault_s": 1e-4,
                                                                   "major_faults_seen": 9})
    monkeypatch.setattr(probe_module, "random_reads", lambda path: {"iops_4k": 1e5, "latency_s": 1e-4, "method": "x"})
    monkeypatch.setattr(probe_module.os, "cpu_count", lambda: 16)
    result = probe_module.probe(tmp_path, file_bytes=16 << 20)
    assert result["cpu"]["threads"] == 1 and result["host"]["cpu_cores"] == 16
    assert load_profile(write_profile(result, tmp_path / "local.toml")).cpu.threads == 1


def test_a_probe_that_sees_no_major_fault_keeps_the_common_cost(tmp_path):
    """On tmpfs the file cannot leave memory: no major fault happens, and the probe saved the time of
    4,096 minor faults as the cost of one major fault (3.4 ms here, against 53 us measured on disk)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    path = shm / f"cachelab-faults-{os.getpid()}.bin"
    try:
        path.write_bytes(os.urandom(8 << 20))
        faults = page_faults(path)
    finally:
        path.unlink(missing_ok=True)
    if faults["major_faults_seen"]:
        pytest.skip("/dev/shm here is not kept in memory")
    assert faults["major_fault_s"] is None
    result = {"name": "local", "host": {"link": "pcie", "link_bw": 1e10, "link_latency_s": 2e-6, "dram_bytes": 1e10,
                                        "cpu_cores": 2},
              "cpu": {"minor_fault_s": faults["minor_fault_s"], "major_fault_s": None, "gather_rows_per_s": 1e6,
                      "dedup_rows_per_s": 1e6, "memcpy_bw": 1e10, "round_trip_s": 2e-5, "threads": 2},
              "ssd": {"iops_4k": 1e5, "latency_s": 1e-4}}
    prof = load_profile(write_profile(result, tmp_path / "local.toml"))
    common = tomllib.loads((PROFILE_DIR / "common.toml").read_text())["cpu"]["major_fault_s"]
    assert prof.cpu.major_fault_s == common


@pytest.mark.parametrize("folder", ["tmp", "/dev/shm"])
def test_probe_reads_the_way_the_direct_backing_does(tmp_path, folder):
    """O_DIRECT through the store's reader where the file system allows it (the probe once timed
    buffered Python preads with readahead, 10x below fio), else buffered with readahead off
    (older kernels' tmpfs refuses O_DIRECT)."""
    base = tmp_path if folder == "tmp" else Path(folder)
    if not base.is_dir():
        pytest.skip(f"no {folder}")
    path = base / f"cachelab-probe-{os.getpid()}.bin"
    try:
        path.write_bytes(os.urandom(8 << 20))
        reads = random_reads(path, n=2_000, depth=8)
    finally:
        path.unlink(missing_ok=True)
    direct = "O_DIRECT refused" not in reads["method"]
    assert direct == _direct_ok(base), reads["method"]
    assert reads["iops_4k"] > 0 and reads["latency_s"] > 0 and "8 in flight" in reads["method"]


def _direct_ok(folder) -> bool:
    probe = folder / f"direct-check-{os.getpid()}"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def test_model_spec_facts():
    assert MODEL.engram_layers == (1, 14) and MODEL.row_bytes == 264
    assert MODEL.table_bytes / 2**30 == pytest.approx(188.8, abs=0.1)  # about 189 GiB (ANCHORS.md §1)
    # the released config: 40 layers x 384 experts of 18.8 MB (MXFP4), top-6, about 16 B active
    assert MODEL.expert_params * MODEL.expert_bytes_per_param / 1e6 == pytest.approx(18.8, abs=0.05)
    assert MODEL.active_params / 1e9 == pytest.approx(16.1, abs=0.2)
    assert MODEL.touched_expert_bytes(1) == pytest.approx(MODEL.moe_layers * 6 * MODEL.expert_params
                                                          * MODEL.expert_bytes_per_param)
    assert MODEL.touched_expert_bytes(100_000) == pytest.approx(40 * 384 * 35389440 * 0.53125, rel=1e-6)
    # 763 B parameters in the checkpoint (transformers' config docstring), 196.6 B of them Engram
    assert MODEL.acceptance_length == 3.51  # the InferenceX recipe's synthetic acceptance


def test_v41s_kv_formats_are_vllms_defaults_on_sm100():
    # No V4.1 InferenceX script passes --kv-cache-dtype: FlashMLA's fp8_ds_mla record (448 e4m3 + 64 bf16 RoPE
    # + 8 B of scales) for the window and the compressed caches, and the FP8 indexer K cache (128 + 4 B)
    assert MODEL.latent_bytes_per_position == MODEL.window_bytes_per_position == 448 + 64 * 2 + 8
    assert MODEL.index_key_bytes == 128 + 4
    # a token's KV: each KV source (layers 2, 8, 14, 20) stores 1 / ratio latents and index keys for all 40 layers
    sources = (2, 8, 14, 20)
    per_token = sum(1 / MODEL.compress_ratios[layer] for layer in sources)
    assert per_token == 2.5
    assert MODEL.kv_bytes_per_token == per_token * (MODEL.latent_bytes_per_position + MODEL.index_key_bytes)
    # one sequence's verify step (6 queries) at 150k: every layer's 128-position window, 6 x top-512 gathers in
    # the 38 compressed layers, and the indexer keys of the 8 index sources (the last 4 within the 16,384 pool)
    window = 40 * 128 * 584
    gathers = 38 * 6 * 512 * 584
    keys = (3 * 75_000 + 150_000 + 4 * 16_384) * 132
    assert float(MODEL.kv_read_bytes(6, 150_000)) == pytest.approx(window + gathers + keys)


def test_a_rank_holds_the_published_weight_fit_and_the_indexer_buffer_of_its_token_budget():
    gib = 2**30
    # InferenceX PR 3337: 256 GiB / TP + 17.2 GiB per rank (TP8 49.2, TP4 81.2, TP2 145.2 GiB)
    for tp, published in ((8, 49.2), (4, 81.2), (2, 145.2)):
        assert MODEL.rank_weight_bytes(tp) / gib == pytest.approx(published, abs=0.05)
    r1 = load_model("deepseek-r1")  # no published fit: an even split of its weights, no indexer buffer
    assert r1.rank_weight_bytes(8) == pytest.approx(r1.weight_bytes / 8) and r1.indexer_buffer_bytes(16384) == 0
    assert MODEL.indexer_buffer_bytes(16384) == 32 * gib  # "32 GiB at the upstream 16384 batched tokens"
    b200 = load_profile("B200")
    small, big = (LatencyModel(MODEL, b200, tp=4, placement="dram-uva", max_num_batched_tokens=n).plan
                  for n in (8192, 16384))
    assert small.weight_bytes == MODEL.rank_weight_bytes(4) and big.indexer_buffer_bytes == 32 * gib
    assert small.kv_bytes - big.kv_bytes == pytest.approx(16 * gib)


def test_model_spec_takes_the_engram_tables_from_the_layout(tmp_path):
    from cachelab.engram import get_preset

    v41 = get_preset("deepseek-v4.1-flash")
    assert MODEL.layout is v41 and MODEL.rows_per_token_layer == v41.columns == 24
    assert MODEL.table_rows == tuple(v41.table_rows.tolist()) == (384_006_168, 384_016_682)
    demo = load_model(layout="engram-27b-demo")
    assert demo.engram_layers == (1, 15) and demo.row_bytes == 128 and demo.rows_per_token_layer == 16
    assert demo.table_bytes == float(get_preset("engram-27b-demo").table_rows.sum()) * 128
    text = (MODEL_DIR / "deepseek-v4.1-flash.toml").read_text()
    agreeing = tmp_path / "old.toml"  # a spec that restates the tables still loads while they agree
    agreeing.write_text(text.replace("wkv_params =", "row_bytes = 264\ntable_rows = [384006168, 384016682]\nwkv_params ="))
    assert load_model(agreeing).table_rows == MODEL.table_rows
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(text.replace("wkv_params =", "row_bytes = 256\nwkv_params ="))
    with pytest.raises(CachelabError, match=r"wrong.toml: \[engram\] row_bytes = 256 disagrees with layout"):
        load_model(wrong)
    bare = tmp_path / "bare.toml"
    bare.write_text(text.replace('layout = "deepseek-v4.1-flash"', ""))
    with pytest.raises(CachelabError, match=r"bare.toml: \[engram\] needs layout"):
        load_model(bare)


def test_table_in_hbm_takes_kv_and_b300_tp2_does_not_fit():
    b300 = load_profile("B300")
    dram = LatencyModel(MODEL, b300, tp=4, placement="dram-uva").plan
    hbm = LatencyModel(MODEL, b300, tp=4, placement="hbm").plan
    assert dram.kv_bytes - hbm.kv_bytes == pytest.approx(MODEL.table_bytes / 4)
    assert LatencyModel(MODEL, b300, tp=2, placement="dram-uva").plan.kv_tokens > 0
    # weights 155.9 GB (256 GiB / 2 + 17.2 GiB), table 101.4 GB, indexer buffer 17.2 GB at 8192 tokens
    with pytest.raises(CachelabError, match=r"does not fit B300 at TP2 with placement hbm.*\(-19\.81 GiB\)"):
        LatencyModel(MODEL, b300, tp=2, placement="hbm")
    with pytest.raises(CachelabError, match="does not fit H100 at TP1"):
        LatencyModel(MODEL, load_profile("H100"), tp=1, placement="hbm")
    with pytest.raises(CachelabError, match="--tp 16"):
        LatencyModel(MODEL, b300, tp=16)


def test_uva_fetch_is_lines_over_the_link():
    # the table is split across the TP ranks by head: each TP4 rank reads a quarter of the rows
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-uva")
    parts = lat.fetch_parts(EngramStep(lookups=2400, unique=2000, cache_hits=500))
    h, e = lat.hw.host, lat.eff
    assert parts["uva_read_s"] == pytest.approx(h.link_latency_s + 1500 / 4 * 384 / (h.link_bw * e.uva_efficiency))
    assert parts["hbm_gather_s"] == pytest.approx(500 / 4 * 384 / (lat.hw.gpu.hbm_bw * e.mbu))
    tp8 = LatencyModel(MODEL, load_profile("B200"), tp=8, placement="dram-uva")
    assert tp8.fetch_parts(EngramStep(lookups=2400, unique=2000))["uva_read_s"] == pytest.approx(
        h.link_latency_s + 2000 / 8 * 384 / (h.link_bw * e.uva_efficiency))


def test_ssd_mmap_parts_add_up_and_faults_dominate_cold_reads():
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap")
    parts = lat.fetch_parts(EngramStep(lookups=10_000, unique=8_000, page_cache_rows=4_000, page_reads=4_000))
    crit = max(parts["device_reads_s"], parts["page_faults_s"])
    assert parts["total_s"] == pytest.approx(parts["round_trip_s"] + parts["cpu_dedup_s"] + crit
                                             + parts["cpu_gather_s"] + parts["h2d_copy_s"])
    assert parts["page_faults_s"] == pytest.approx(4000 / 4 * lat.hw.cpu.major_fault_s / lat.hw.cpu.threads)  # per rank
    warm = lat.fetch_parts(EngramStep(lookups=10_000, unique=8_000, page_cache_rows=8_000))
    assert 0 < warm["total_s"] < parts["total_s"]
    uva = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-uva")
    assert warm["total_s"] > uva.fetch_parts(EngramStep(lookups=10_000, unique=8_000))["total_s"]  # the CPU round trip


def test_the_mapped_gathers_row_cost_is_charged_per_row_a_rank_reads_on_ssd_mmap_alone():
    # the what-if term of the joint SSD fit (Efficiency.mmap_row_s): rows a rank reads through the mapping
    work = EngramStep(lookups=10_000, unique=8_000, cache_hits=2_000)
    plain = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap").fetch_parts(work)
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap", efficiency=Efficiency(mmap_row_s=1e-6))
    parts = lat.fetch_parts(work)
    assert plain["mmap_rows_s"] == 0.0  # not charged by default
    assert parts["mmap_rows_s"] == pytest.approx(6000 / 4 * 1e-6 / lat.hw.cpu.threads)  # the row-cache misses, a rank's
    assert parts["total_s"] == pytest.approx(plain["total_s"] + parts["mmap_rows_s"])
    copy = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-copy", efficiency=Efficiency(mmap_row_s=1e-6))
    assert "mmap_rows_s" not in copy.fetch_parts(work)
    # a prefill chunk's rows outlast layer 1's one-layer window; a verify step's few rows hide behind it
    chunk, one = Batch([0.0], [16384.0]), Batch([1000.0], [1006.0], lm_rows=6, drafting=1)
    rows = lambda tokens: [EngramStep(tokens * 24, tokens * 24)] * 2
    base = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap")
    assert lat.step_time(chunk, rows(16384)).stall_s > base.step_time(chunk, rows(16384)).stall_s
    assert lat.step_time(one, rows(6)).step_s == base.step_time(one, rows(6)).step_s


def test_a_fraction_of_a_page_expected_pays_that_fraction_of_the_read_latency():
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap")
    ssd = lat.hw.ssd
    # one rank's share: a quarter of the step's pages
    parts = lambda pages: lat.fetch_parts(EngramStep(lookups=400, unique=400, page_reads=4 * pages))["device_reads_s"]
    assert parts(0.0) == 0.0
    assert parts(0.02) == pytest.approx(0.02 * ssd.latency_s + 0.02 / ssd.iops_4k)  # an expectation (steady state)
    assert parts(1.0) == pytest.approx(ssd.latency_s + 1 / ssd.iops_4k)  # one read: its whole latency
    assert parts(500.0) == pytest.approx(ssd.latency_s + 500 / ssd.iops_4k)


def test_prefetch_window_hides_small_fetches_and_stall_is_the_rest():
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-copy",
                       efficiency=Efficiency(host_addressing=True))
    small = lat.step_time(Batch(np.full(8, 1000.0), np.full(8, 1001.0)), [EngramStep(8 * 24, 8 * 24)] * 2)
    assert small.stall_s == 0.0 and small.step_s == small.gpu.total_s
    big_work = EngramStep(8192 * 24, 8192 * 24)
    big = lat.step_time(Batch(np.full(64, 1000.0), np.full(64, 1001.0)), [big_work] * 2)
    layer_s = (big.gpu.total_s - big.gpu.overhead_s) / MODEL.layers
    f = big.to_dict()["engram1_fetch_s"]
    stall1 = max(0.0, f - layer_s)
    stall14 = max(0.0, 2 * f - (14 * layer_s + stall1))
    assert big.stall_s == pytest.approx(stall1 + stall14) and big.stall_s > 0
    assert [x.window_s for x in big.fetches] == [layer_s, 14 * layer_s]


def test_roofline_regimes():
    # every layer on every row (no decoder replay), whichever the default
    lat = LatencyModel(MODEL, load_profile("B200"), tp=8, placement="hbm", efficiency=Efficiency(decoder_replay=False))
    decode = lat.gpu_time(Batch([1000.0], [1001.0]))
    g, e = lat.hw.gpu, lat.eff
    # one token touches 6 experts per layer: the expert time is their bytes at HBM bandwidth
    assert decode.experts_s == pytest.approx(float(MODEL.touched_expert_bytes(1)) / 8 / (g.hbm_bw * e.mbu))
    prefill = lat.gpu_time(Batch([0.0], [16_384.0]))
    # every expert touched (every layer on every row: no decoder replay): FLOPs at prefill's GEMM efficiency and
    # the FP8 rate, where MXFP4 weights meet the MXFP8 activations vLLM feeds them (W4A8), not at the FP4 rate
    rows = 16_384 * 6
    assert MODEL.expert_precision == "fp8" and MODEL.expert_bytes_per_param == 0.53125
    assert prefill.experts_s == pytest.approx(2 * 40 * MODEL.expert_params * rows / 8 / (g.fp8_flops * e.prefill_mfu))
    # sparse attention: past the window and top-k a query attends 128 + 512 (ratio 1) or 128 + 512 (ratio 2) positions
    far = MODEL.attended_positions(np.array([100_000.0]), np.array([100_001.0]))
    assert float(far[0]) == 40 * 128 + 38 * 512
    r1 = load_model("deepseek-r1")
    assert float(r1.attended_positions(np.array([0.0]), np.array([3.0]))[0]) == 61 * (1 + 2 + 3)
    # MLA decodes absorbed (576-wide QK, 512-wide V) but prefills unabsorbed (192 and 128 per head)
    assert r1.attn_flops_per_position == 2 * 128 * (576 + 512)
    assert r1.prefill_attn_flops_per_position == 2 * 128 * (192 + 128)
    assert MODEL.prefill_attn_flops_per_position == MODEL.attn_flops_per_position


def test_decode_rows_and_prefill_chunks_run_at_their_own_gemm_efficiency():
    from dataclasses import replace

    slow_prefill = replace(Efficiency(), mfu=0.5, prefill_mfu=0.05)
    lat = LatencyModel(MODEL, load_profile("B200"), tp=8, placement="hbm", efficiency=slow_prefill)
    base = LatencyModel(MODEL, load_profile("B200"), tp=8, placement="hbm")
    chunk = Batch([0.0], [8192.0])
    assert lat.gpu_time(chunk).dense_s == pytest.approx(base.gpu_time(chunk).dense_s * base.eff.prefill_mfu / 0.05)
    decode = Batch(np.full(256, 4000.0), np.full(256, 4006.0))  # verify rows only: prefill_mfu plays no part
    assert lat.gpu_time(decode).dense_s == pytest.approx(base.gpu_time(decode).dense_s * base.eff.mfu / 0.5)
    mixed = Batch(np.array([4000.0, 0.0]), np.array([4006.0, 8192.0]), np.array([256.0, 1.0]))
    split = lat.gpu_time(mixed).dense_s  # each side's FLOPs at its own efficiency
    assert split == pytest.approx(lat.gpu_time(decode).dense_s + lat.gpu_time(chunk).dense_s, rel=1e-9)


def test_expert_parallel_ranks_wait_for_the_most_loaded_one():
    r1 = load_model("deepseek-r1")
    tp8, ep8 = (LatencyModel(r1, load_profile("B200"), tp=8, placement="hbm", ep=ep) for ep in (1, 8))
    small, full = Batch(np.full(16, 1000.0), np.full(16, 1001.0)), Batch(np.full(512, 1000.0), np.full(512, 1001.0))
    # 16 tokens x 8 picks touch ~40% of the 32 experts a rank holds; the busiest rank has ~30% more
    assert 1.2 < ep8.gpu_time(small).experts_s / tp8.gpu_time(small).experts_s < 1.45
    assert ep8.gpu_time(full).experts_s == pytest.approx(tp8.gpu_time(full).experts_s, rel=0.01)  # every expert touched
    with pytest.raises(CachelabError, match="expert parallelism 2"):
        LatencyModel(r1, load_profile("B200"), tp=8, placement="hbm", ep=2)


def test_v41_kv_read_is_bounded_while_r1_grows_with_context():
    r1 = load_model("deepseek-r1")
    short, long = (MODEL.kv_read_bytes(1, c) for c in (20_000, 140_000))
    assert long < 3 * short  # window + top-k gathers + the (capped) indexer scan
    assert r1.kv_read_bytes(1, 140_000) == pytest.approx(7 * r1.kv_read_bytes(1, 20_000))


def test_v41s_indexer_runs_whole_on_every_tp_rank():
    from dataclasses import replace

    b = Batch([140_000.0], [148_000.0])  # an 8k prefill chunk after a 140k prefix
    hw = load_profile("B300")
    eff = Efficiency(mfu=0.1, prefill_mfu=0.1)
    assert MODEL.index_replicated_across_tp and not load_model("deepseek-r1").index_replicated_across_tp
    split = replace(MODEL, index_replicated_across_tp=False)
    for tp in (2, 4):
        whole = LatencyModel(MODEL, hw, tp, "dram-uva", efficiency=eff).gpu_time(b).indexer_s
        shard = LatencyModel(split, hw, tp, "dram-uva", efficiency=eff).gpu_time(b).indexer_s
        assert whole == pytest.approx(tp * shard)  # every rank scores every index head
    # per GPU, a TP4 replica spends twice a TP2 replica's indexer time on the same chunk
    per_gpu = {tp: tp * LatencyModel(MODEL, hw, tp, "dram-uva", efficiency=eff).gpu_time(b).indexer_s for tp in (2, 4)}
    assert per_gpu[4] == pytest.approx(2 * per_gpu[2])


def test_index_sources_of_one_ratio_cap_and_query_range_are_summed_once(monkeypatch):
    # V4.1's eight index sources are three kinds (ratio, cap, and whether a bounded replay trims their
    # queries); each step the latency model times summed all eight anew, a third of a steady-state solve's
    # time. Each kind is summed once; the totals are the per-source sums in the same order, exactly.
    from cachelab.serving import model_spec

    sum_min, calls = model_spec.sum_min, []
    lo, hi, late = np.array([140_000.0, 3_000.0]), np.array([148_000.0, 3_004.0]), np.array([147_872.0, 3_000.0])
    replayed = MODEL._replayed_index_sources
    assert len(MODEL.index_sources) == 8 and len(replayed) == 4
    for late_lo in (None, late):
        want = 0.0
        for i, (ratio, cap) in enumerate(MODEL.index_sources):
            want = want + sum_min(late_lo if late_lo is not None and i in replayed else lo, hi, ratio * cap) / ratio
        monkeypatch.setattr(model_spec, "sum_min", lambda *a: calls.append(a) or sum_min(*a))
        got = MODEL.indexer_positions(lo, hi, late_lo)
        monkeypatch.setattr(model_spec, "sum_min", sum_min)
        assert np.array_equal(got, want) and len(calls) == 3
        calls.clear()
    # the indexer keys a step reads: each source's, in source order
    keys = sum(np.minimum(hi / r, cap if cap else np.inf) for r, cap in MODEL.index_sources) * MODEL.index_key_bytes
    no_keys = replace(MODEL, index_sources=(), index_source_layers=())
    assert np.array_equal(MODEL.kv_read_bytes(hi - lo, hi), no_keys.kv_read_bytes(hi - lo, hi) + keys)


def test_v41s_replicated_dense_layers_run_whole_on_every_tp_rank(tmp_path):
    from dataclasses import replace

    # vLLM's V4.1 attention keeps fused wq_a + wkv whole on every rank (the router and the indexer too)
    # and splits the rest: 0.516 B of the 6.63 B dense parameters run whole
    assert MODEL.dense_replicated_params == 5.16e8 and load_model("deepseek-r1").dense_replicated_params == 0
    split = replace(MODEL, dense_replicated_params=0.0)
    dense, wkv = MODEL.dense_params, MODEL.engram_params  # the Engram wkv is whole on every rank too (its own test)
    for tp in (1, 2, 4, 8):
        assert MODEL.rank_dense_params(tp) == pytest.approx((dense - 5.16e8) / tp + 5.16e8 + wkv)
        assert split.rank_dense_params(tp) == pytest.approx(dense / tp + wkv)
    # (every layer on every row: the decoder replay's early layers hold the Engram wkv, a share that does not scale)
    hw, eff = load_profile("B200"), Efficiency(mfu=0.1, prefill_mfu=0.1, decoder_replay=False)
    decode, chunk = Batch(np.full(8, 4000.0), np.full(8, 4001.0)), Batch([0.0], [8192.0])
    for b in (decode, chunk):  # weight-bound and FLOP-bound alike: the dense term scales with the rank's share
        got = LatencyModel(MODEL, hw, 4, "dram-uva", efficiency=eff).gpu_time(b).dense_s
        even = LatencyModel(split, hw, 4, "dram-uva", efficiency=eff).gpu_time(b).dense_s
        assert got == pytest.approx(even * MODEL.rank_dense_params(4) / split.rank_dense_params(4))
    # without a published weight fit a rank also holds the replicated layers whole
    bare = replace(MODEL, rank_weights_sharded_bytes=0.0, rank_weights_replicated_bytes=0.0)
    assert bare.rank_weight_bytes(4) == pytest.approx(bare.weight_bytes / 4 + (5.16e8 + wkv) * 0.75)
    bad = tmp_path / "bad.toml"
    bad.write_text((MODEL_DIR / "deepseek-v4.1-flash.toml").read_text().replace(
        "dense_replicated_params = 5.16e8", "dense_replicated_params = 7e9"))
    with pytest.raises(CachelabError, match=r"bad.toml: \[backbone\] dense_replicated_params 7000000000.0 exceeds"):
        load_model(bad)


def test_the_engram_rows_are_all_gathered_in_every_placement_and_the_wkv_runs_whole_on_every_rank(tmp_path):
    """vLLM splits each table by head over the TP ranks; a rank looks its heads' rows up wherever they
    live, dequantized to BF16, and the ranks all-gather them for a wkv every rank holds whole
    (ParallelEngramEmbedding.forward; `self.wkv = ReplicatedLinear` in the module the SSD patch is cut
    against). The exchange was charged to the HBM placement only, at the FP8 row's 264 B, and the wkv
    was split over the ranks."""
    from dataclasses import replace

    hw, e = load_profile("B300"), Efficiency()
    assert MODEL.wkv_replicated_across_tp and MODEL.gathered_row_bytes == 2 * 256
    tokens = 8 * 6
    verify = Batch(np.full(8, 4000.0), np.full(8, 4006.0), lm_rows=48, drafting=8)
    comm = {p: LatencyModel(MODEL, hw, 4, p).gpu_time(verify).comm_s for p in ("hbm", "dram-uva", "ssd-mmap")}
    assert comm["dram-uva"] == pytest.approx(comm["hbm"]) and comm["ssd-mmap"] == pytest.approx(comm["hbm"])
    alone = replace(MODEL, table_sharded_across_tp=False)  # the same step without the exchange (a host table)
    exchange = 2 * (e.allreduce_latency_s + tokens * 24 * 512 * 3 / 4 / (hw.gpu.nvlink_bw * e.comm))
    assert comm["dram-uva"] == pytest.approx(LatencyModel(alone, hw, 4, "dram-uva").gpu_time(verify).comm_s + exchange)
    # the wkv: whole on every rank, in FLOPs (a chunk) and in bytes (a decode step)
    split = replace(MODEL, wkv_replicated_across_tp=False)
    assert MODEL.rank_dense_params(4) - split.rank_dense_params(4) == pytest.approx(0.75 * MODEL.engram_params)
    chunk = Batch([0.0], [8192.0])
    for b in (verify, chunk):
        got = LatencyModel(MODEL, hw, 4, "dram-uva").gpu_time(b).dense_s
        even = LatencyModel(split, hw, 4, "dram-uva").gpu_time(b).dense_s
        assert got == pytest.approx(even * MODEL.rank_dense_params(4) / split.rank_dense_params(4))
    bad = tmp_path / "bad.toml"
    bad.write_text((MODEL_DIR / "deepseek-v4.1-flash.toml").read_text().replace(
        "wkv_replicated_across_tp = true", 'wkv_replicated_across_tp = "yes"'))
    with pytest.raises(CachelabError, match=r"\[engram\] wkv_replicated_across_tp must be true or false"):
        load_model(bad)


def test_v41s_decoder_replay_runs_the_layers_past_the_last_kv_source_on_each_prefills_last_window(tmp_path):
    # kv_source_layer_ids [2, 8, 14, 20]: layers 21-39 own only sliding-window KV, so a prefill runs them on each
    # request's last 128 rows (vLLM's V4.1 port from #58132, which no published V4.1 run had: off by default);
    # layers 0-20 run on every row
    assert MODEL.decoder_replay_start == 21 and MODEL.replayed_layers == 19 and MODEL.replayed_moe_layers == 19
    assert not Efficiency().decoder_replay and load_model("deepseek-r1").decoder_replay_start == 0
    hw = load_profile("B200")
    on = LatencyModel(MODEL, hw, 4, "dram-uva", efficiency=Efficiency(decoder_replay=True))
    off = LatencyModel(MODEL, hw, 4, "dram-uva")
    long = Batch([0.0], [16_384.0])
    a, b = on.gpu_time(long), off.gpu_time(long)
    # the dense GEMMs (FLOP-bound here): 19/40 of the per-layer weights meet 128 rows instead of 16,384; the
    # Engram wkv (layers 1 and 14) meets every row
    dense = MODEL.rank_dense_params(4)
    per_layer = dense - MODEL.engram_params  # the wkv, whole on every rank
    assert a.dense_s == pytest.approx(b.dense_s * (dense * 16_384 - 19 / 40 * per_layer * (16_384 - 128)) / (dense * 16_384))
    # the whole step falls to the 21 early layers' share, plus the replayed layers' 128 rows (their experts
    # padded to 16-row tiles) and the Engram wkv (whole on every rank, in layers 1 and 14), every operator
    # but the LM head with it
    assert 21 / 40 < a.total_s / b.total_s < 21 / 40 + 0.035
    for part in ("dense_s", "experts_s", "attention_s", "indexer_s", "comm_s"):
        assert getattr(a, part) < 0.9 * getattr(b, part), part
    assert a.lm_head_s == b.lm_head_s
    # per request: two requests' chunks keep 128 rows each, as two separate steps would
    pair = Batch([0.0, 0.0], [8192.0, 8192.0])
    assert on.gpu_time(pair).attention_s == pytest.approx(2 * on.gpu_time(Batch([0.0], [8192.0])).attention_s)
    # nothing is trimmed in a prompt no longer than the window, in a decode step, or in R1
    for short in (Batch([0.0], [128.0]), Batch([0.0], [100.0]), Batch(np.full(8, 4000.0), np.full(8, 4006.0))):
        assert on.gpu_time(short) == off.gpu_time(short)
    r1 = load_model("deepseek-r1")
    assert (LatencyModel(r1, hw, 8, "hbm", efficiency=Efficiency(decoder_replay=True)).gpu_time(long)
            == LatencyModel(r1, hw, 8, "hbm").gpu_time(long))
    # the KV a prefill writes does not change: the memory plan is the same
    assert on.plan == off.plan
    # a replay must start after every Engram layer and know its index sources' layers
    text = (MODEL_DIR / "deepseek-v4.1-flash.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("decoder_replay_start = 21", "decoder_replay_start = 10"))
    with pytest.raises(CachelabError, match=r"bad.toml: \[attention\] decoder_replay_start 10 comes before Engram layer"):
        load_model(bad)
    bad.write_text(text.replace("index_source_layers = [2, 8, 14, 20, 24, 28, 32, 36]", "index_source_layers = [2, 8]"))
    with pytest.raises(CachelabError, match=r"index_source_layers has 2 entries, index_sources 8"):
        load_model(bad)
    bad.write_text(text.replace("decoder_replay_start = 21", "decoder_replay_start = 40"))
    with pytest.raises(CachelabError, match=r"decoder_replay_start must be a layer index in 0..39"):
        load_model(bad)


def test_mtp_verify_costs_draft_and_more_tokens():
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-uva")
    plain = lat.gpu_time(Batch(np.full(16, 8000.0), np.full(16, 8001.0)))
    verify = lat.gpu_time(Batch(np.full(16, 8000.0), np.full(16, 8006.0), lm_rows=96, drafting=16))
    assert verify.draft_s > 0 and plain.draft_s == 0
    assert verify.total_s > plain.total_s and verify.total_s < 6 * plain.total_s


def test_a_draft_pass_reads_only_the_draft_experts_its_tokens_route_to(tmp_path):
    """DSpark's draft layers are MoE (128 experts, top-3): like a backbone layer, a pass loads the
    experts its tokens route to, not all 7.71 GB (read whole, one sequence's draft cost 6x its bytes)."""
    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-uva")
    e, g, m = lat.eff, lat.hw.gpu, MODEL
    expert = m.expert_params * m.expert_bytes_per_param
    touched = 128 * (1 - (1 - 3 / 128) ** 5)  # the 5 tokens one sequence drafts, per draft layer: 14.3
    read = m.draft_params - 3 * 128 * expert + 3 * touched * expert
    assert read == pytest.approx(1.298e9, rel=1e-3)
    one = lat.gpu_time(Batch([1000.0], [1006.0], lm_rows=6, drafting=1))
    assert one.draft_s == pytest.approx(read / 4 / (g.hbm_bw * e.mbu))  # weight-bound, split over 4 ranks
    # more drafting sequences touch more of them, up to all: then the whole draft is read, as before
    many = lat.gpu_time(Batch(np.full(400, 1000.0), np.full(400, 1006.0), lm_rows=2400, drafting=400))
    assert many.draft_s >= m.draft_params / 4 / (g.hbm_bw * e.mbu) * 0.999
    # a spec that declares no draft experts reads its draft whole; a bad count names the key
    text = (MODEL_DIR / "deepseek-v4.1-flash.toml").read_text()
    plain = tmp_path / "plain.toml"
    plain.write_text(text.replace("draft_experts = 128 ", "draft_experts = 0 ").replace(
        "draft_experts_per_token = 3 ", "draft_experts_per_token = 0 "))
    whole = LatencyModel(load_model(plain), load_profile("B200"), tp=4, placement="dram-uva")
    assert whole.gpu_time(Batch([1000.0], [1006.0], lm_rows=6, drafting=1)).draft_s == pytest.approx(
        m.draft_params / 4 / (g.hbm_bw * e.mbu))
    for old, new, message in (("draft_experts_per_token = 3 ", "draft_experts_per_token = 200 ",
                               r"draft_experts_per_token 200 must be in 1..draft_experts \(128\)"),
                              ("draft_experts = 128 ", "draft_experts = 1.5 ", r"\[mtp\] draft_experts must be a whole"),
                              ("draft_params = 7.71e9 ", "draft_params = 1e9 ", r"more than draft_params")):
        plain.write_text(text.replace(old, new))
        with pytest.raises(CachelabError, match=message):
            load_model(plain)


def test_ssd_workers_fetch_from_the_step_start_and_the_host_floors_short_steps():
    from dataclasses import replace

    lat = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap")
    e = lat.eff
    # a prefill chunk's rows: each Engram layer's worker starts with the step, in parallel with the other
    work = [EngramStep(8192 * 24, 8192 * 24)] * 2
    chunk = Batch([0.0], [8192.0])
    step = lat.step_time(chunk, work)
    layer_s = (step.gpu.total_s - step.gpu.overhead_s) / MODEL.layers
    f1, f14 = (x.fetch_s for x in step.fetches)
    stall1 = max(0.0, f1 - layer_s) + (e.graph_break_s if f1 > layer_s else 0.0)
    stall14 = max(0.0, f14 - (14 * layer_s + stall1))  # its own worker: not queued behind layer 1's fetch
    assert stall1 > 0 and step.stall_s == pytest.approx(stall1 + stall14)
    assert step.host_floor_s == pytest.approx(e.step_overhead_s + 40 * e.piecewise_layer_s)
    assert step.step_s == pytest.approx(max(step.gpu.total_s + step.stall_s, step.host_floor_s))
    # a short verify step of one sequence: the host's launch of the backbone and draft layers binds
    one = Batch([1000.0], [1006.0], lm_rows=6, drafting=1)
    short = lat.step_time(one, [EngramStep(6 * 24, 6 * 24)] * 2)
    assert short.host_floor_s == pytest.approx(e.step_overhead_s + (40 + 3) * e.piecewise_layer_s)
    assert short.step_s == short.host_floor_s > short.gpu.total_s + short.stall_s
    # UVA steps are captured whole: no floor, the same GPU work
    uva = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-uva").step_time(one, [EngramStep(144, 144)] * 2)
    assert uva.host_floor_s == 0.0 and uva.step_s < short.step_s
    assert uva.gpu.total_s == pytest.approx(short.gpu.total_s)
    # the additive reading of the host offset (a what-if) adds to every piecewise step and to no UVA step
    add = replace(e, piecewise_step_offset_s=9e-3)
    long_ssd = LatencyModel(MODEL, load_profile("B200"), tp=4, placement="ssd-mmap", efficiency=add).step_time(chunk, work)
    assert long_ssd.step_s == pytest.approx(step.gpu.total_s + step.stall_s + 9e-3)
    assert LatencyModel(MODEL, load_profile("B200"), tp=4, placement="dram-uva", efficiency=add).step_time(
        one, [EngramStep(144, 144)] * 2).step_s == pytest.approx(uva.step_s)
    assert "host_floor_s" in short.to_dict()


def test_an_inline_gather_is_exposed_in_full_on_the_gpu_and_on_the_hosts_launch():
    from dataclasses import replace

    b200 = load_profile("B200")
    inline = LatencyModel(MODEL, b200, tp=4, placement="ssd-mmap", efficiency=replace(Efficiency(), host_gather_overlap=False))
    worker = LatencyModel(MODEL, b200, tp=4, placement="ssd-mmap")
    e = inline.eff
    work = [EngramStep(8192 * 24, 8192 * 24)] * 2
    chunk = Batch([0.0], [8192.0])
    a, b = inline.step_time(chunk, work), worker.step_time(chunk, work)
    f1, f14 = (x.fetch_s for x in a.fetches)
    assert [x.fetch_s for x in b.fetches] == pytest.approx([f1, f14])  # the same host work, differently placed
    assert [x.window_s for x in a.fetches] == [0.0, 0.0]  # nothing runs beside it
    assert a.stall_s == pytest.approx(f1 + f14 + 2 * e.graph_break_s)
    assert a.stall_s > b.stall_s  # the worker hid layer 14's behind the layers before it
    assert a.step_s == pytest.approx(a.gpu.total_s + a.stall_s)
    # a host-bound verify step of one sequence: the forward thread gathers before it launches the rest
    one = Batch([1000.0], [1006.0], lm_rows=6, drafting=1)
    small = [EngramStep(6 * 24, 6 * 24)] * 2
    short, hidden = inline.step_time(one, small), worker.step_time(one, small)
    assert hidden.step_s == pytest.approx(hidden.host_floor_s)
    assert short.step_s == pytest.approx(short.host_floor_s + sum(x.fetch_s for x in short.fetches))
    # GPU paths and steps captured whole do not have the option
    uva = replace(Efficiency(), host_gather_overlap=False)
    assert LatencyModel(MODEL, b200, tp=4, placement="dram-uva", efficiency=uva).step_time(one, small).step_s == \
        pytest.approx(LatencyModel(MODEL, b200, tp=4, placement="dram-uva").step_time(one, small).step_s)


def test_the_engram_host_path_bench_times_the_patchs_dedup_and_two_gathers(tmp_path):
    import importlib.util

    pytest.importorskip("torch")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engram_host_path.py"
    spec = importlib.util.spec_from_file_location("bench_engram_host_path", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.measure(tmp_path, table_gib=1 / 256, rounds=1, counts=(96, 576, 2304))
    assert r["rows"] == (4 << 20) // 256 and (tmp_path / "engram_v0_r0.scale.bin").stat().st_size == r["rows"] * 8
    assert set(r["by_rows"]) == {"96", "576", "2304"}
    for v in r["by_rows"].values():
        assert 0 < v["dedup_s"] < v["total_s"] and 0 < v["gather_s"] < v["total_s"]
    assert r["gather_rows_per_s"] > 0 and r["fit"]["total_s"]["fixed_s"] >= 0


def test_the_residual_streams_are_charged_per_token_and_layer_on_every_rank():
    # V4.1 keeps four BF16 streams of 5120 ([CFG] hc_mult 4); each sub-layer's mhc_post and delayed mhc_pre
    # move 18 hidden vectors a token, two sub-layers a layer, plus the FP32 [24, 20480] mixing weights once a
    # step; R1's fused add-and-norm moves 4 of 7168 per sub-layer
    assert MODEL.residual_bytes_per_token_layer == 2 * 18 * 5120 * 2
    assert MODEL.residual_weight_bytes_per_layer == 2 * 24 * 4 * 5120 * 4
    r1 = load_model("deepseek-r1")
    assert r1.residual_bytes_per_token_layer == 2 * 4 * 7168 * 2 and r1.residual_weight_bytes_per_layer == 0
    hw = load_profile("B200")
    eff = Efficiency()
    bw = hw.gpu.hbm_bw * eff.mbu
    chunk = Batch([0.0], [16_384.0])
    for tp in (4, 8):  # the streams are whole on every rank: the same at every TP degree
        t = LatencyModel(MODEL, hw, tp, "dram-uva").gpu_time(chunk)
        assert t.residual_s == pytest.approx((16_384 * 40 * 368_640 + 40 * 3_932_160 + 16_384 * 2 * 133_120) / bw)
        assert t.total_s == pytest.approx(t.dense_s + t.experts_s + t.attention_s + t.indexer_s + t.lm_head_s
                                          + t.draft_s + t.residual_s + t.comm_s + t.overhead_s)
    # a 16k-token chunk's streams cost about a fifth of its other work at the default MBU
    assert 0.15 < t.residual_s / (t.total_s - t.residual_s) < 0.35
    decode = Batch(np.full(10, 150_000.0), np.full(10, 150_006.0), drafting=10)
    assert LatencyModel(MODEL, hw, 4, "dram-uva").gpu_time(decode).residual_s == pytest.approx(
        (60 * 40 * 368_640 + 50 * 3 * 368_640 + 43 * 3_932_160 + 60 * 2 * 133_120) / bw)
    assert LatencyModel(r1, hw, 8, "hbm").gpu_time(chunk).residual_s == pytest.approx(16_384 * 61 * 114_688 / bw)


def test_the_draft_layers_and_the_engram_injection_move_the_residual_streams_too():
    # vLLM's DSpark draft layers are DeepseekV4DecoderLayers on the same four streams (dspark.py: "Expand to
    # hc_mult copies for hyper-connections"): each of the 5 tokens a sequence drafts runs the 3 draft layers'
    # mhc kernels, and a draft pass reads their mixing weights; Engram's fused injection kernel reads the four
    # streams and wkv's key per stream and shared value and writes four streams at each of its 2 layers
    assert MODEL.injection_bytes_per_token_layer == 13 * 5120 * 2 and MODEL.engram_layers == (1, 14)
    assert load_model("deepseek-r1").injection_bytes_per_token_layer == 0
    lm = LatencyModel(MODEL, load_profile("B200"), 4, "dram-uva")
    bw = lm.hw.gpu.hbm_bw * lm.eff.mbu
    verify = Batch(np.full(10, 150_000.0), np.full(10, 150_006.0))
    drafting = Batch(np.full(10, 150_000.0), np.full(10, 150_006.0), drafting=10)
    backbone = (60 * 40 * 368_640 + 40 * 3_932_160 + 60 * 2 * 133_120) / bw
    assert lm.gpu_time(verify).residual_s == pytest.approx(backbone)
    assert lm.gpu_time(drafting).residual_s - lm.gpu_time(verify).residual_s == pytest.approx(
        (50 * 3 * 368_640 + 3 * 3_932_160) / bw)


def test_a_v41_prefill_gathers_its_kv_into_bf16_before_its_attention_runs():
    # vLLM's V4.1 prefill (FlashMLA on SM100): per request, every layer's window region (the chunk and 127
    # positions before it) and every compressing layer's whole compressed region are dequantized from the
    # 584 B FP8 record into a [positions, 512] BF16 workspace, which the sparse kernel then reads
    assert MODEL.prefill_gather_bytes_per_position == 512 * 2
    gathered = 40 * 13_127 * (584 + 1024) + 18 * 75_000 * (584 + 1024) + 20 * 150_000 * (584 + 1024)
    assert MODEL.prefill_gather_bytes(13_000, 150_000) == pytest.approx(gathered)
    # the attention kernel reads the workspace: the window region and the top-k positions at 1,024 B
    keys = 3 * 75_000 * 132 + 150_000 * 132 + 4 * 16_384 * 132
    assert MODEL.kv_read_bytes(13_000, 150_000, gathered=True) == pytest.approx(
        40 * 13_127 * 1024 + (18 * 75_000 + 20 * 150_000) * 1024 + keys)
    hw = load_profile("B200")
    lat = LatencyModel(MODEL, hw, 4, "dram-uva")
    bw = hw.gpu.hbm_bw * lat.eff.mbu
    no_gather = LatencyModel(replace(MODEL, prefill_gather_bytes_per_position=0.0), hw, 4, "dram-uva")
    chunk = Batch([137_000.0], [150_000.0])
    # the gather is its own kernel, added to the attention (FLOP-bound at this chunk), not hidden under it
    assert lat.gpu_time(chunk).attention_s == pytest.approx(no_gather.gpu_time(chunk).attention_s + gathered / bw)
    # decode and verify rows read the FP8 caches in place; R1 has no workspace
    decode = Batch(np.full(10, 150_000.0), np.full(10, 150_006.0), drafting=10)
    assert lat.gpu_time(decode) == no_gather.gpu_time(decode)
    assert not load_model("deepseek-r1").prefill_gather_bytes_per_position
