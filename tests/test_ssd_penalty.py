"""The SSD arm's penalty read without the think time, and the decode step at B200's read-off
(cachelab.serving.studies.ssd_penalty; issue 15)."""

import polars as pl
import pytest

from cachelab.serving.agentic import agentic_workload
from cachelab.serving.latency import Efficiency
from cachelab.serving.studies.semianalysis import SSD_PR_STEADY, TARGET, X, run_points
from cachelab.serving.studies.ssd_penalty import (OUTPUT_SHARE, penalty_by_concurrency, penalty_ms_per_token,
                                                  published_penalty_ms_per_token, read_off_decomposition)


@pytest.mark.parametrize("think_s", [2.0, 5.0, 30.0])
def test_the_penalty_is_the_latency_difference_whatever_the_think_time(think_s):
    """A closed loop of C clients, each cycling through think time, then latency L and `out` output
    tokens: O = C x out / (think + L). The penalty is (L_ssd - L_uva) / out at every think time, where the
    throughput ratio the study fits moves with it."""
    c, out, l_uva, l_ssd = 16, 1_077.4, 9.0, 12.0
    o_uva, o_ssd = (c * out / (think_s + lat) for lat in (l_uva, l_ssd))
    assert penalty_ms_per_token(c, o_uva, o_ssd) == pytest.approx((l_ssd - l_uva) / out * 1e3)


def test_the_published_penalty_is_the_pr_bodys_two_columns_over_the_cards_output_share():
    """16 clients: 112,212 and 101,218 total tok/s (UVA, disk); the card's 106,474,498 output tokens of
    21,741,855,874 make 0.49% of them output: 3.16 ms per output token."""
    assert OUTPUT_SHARE == pytest.approx(106_474_498 / (21_635_381_376 + 106_474_498))
    assert published_penalty_ms_per_token(16) == pytest.approx(
        16 * (1 / 101_218 - 1 / 112_212) / OUTPUT_SHARE * 1e3)
    assert published_penalty_ms_per_token(16) == pytest.approx(3.16, abs=0.01)


@pytest.fixture(scope="module")
def b200_points():
    wl = agentic_workload()
    eff = Efficiency()
    configs = [("B200", 4, "dram-uva"), ("B200", 4, "ssd-mmap"), ("B200", 8, "dram-uva")]
    return eff, wl, pl.DataFrame(run_points(wl, eff, configs, SSD_PR_STEADY), infer_schema_length=None)


def test_the_models_penalty_reads_its_own_tp4_pairs(b200_points):
    """Each concurrency of the PR body's steady sweep gets the model's penalty from its B200 TP4 pair and
    the published one; the model's falls as the decode steps grow over the SSD floor."""
    _, _, df = b200_points
    got = penalty_by_concurrency(df)
    assert set(got["by_concurrency"]) == {str(c) for c in SSD_PR_STEADY}
    tp4 = df.filter(pl.col("tp") == 4)
    for c, v in got["by_concurrency"].items():
        o = {r["placement"]: r["output_tokens_per_s_per_gpu"] * 4
             for r in tp4.filter(pl.col("concurrency") == int(c)).iter_rows(named=True)}
        assert v["model"] == pytest.approx(penalty_ms_per_token(int(c), o["dram-uva"], o["ssd-mmap"]))
        assert v["published"] == pytest.approx(published_penalty_ms_per_token(int(c)))
    model = [got["by_concurrency"][str(c)]["model"] for c in SSD_PR_STEADY]
    assert model[0] > 1.0  # one sequence's step sits on the floor
    assert all(b <= a + 1e-9 for a, b in zip(model[2:], model[3:]))  # longer decode steps hide more of it
    held = [got["by_concurrency"][c]["published"] for c in ("16", "32", "64")]
    assert got["held_out_mean"]["published"] == pytest.approx(sum(held) / 3)


def test_the_read_off_decomposition_interpolates_the_step_where_the_front_crosses(b200_points):
    eff, wl, df = b200_points
    got = read_off_decomposition(df, eff, wl)
    assert got["acceptance_length"] == pytest.approx(3.51)
    for name, at in got["by_config"].items():
        rows = df.filter((pl.col("placement") == name.split()[0]) & (pl.col("tp") == int(name[-1]))).sort("concurrency")
        crossed = rows.filter(pl.col(X) < TARGET)
        if crossed.height == 0 or crossed["concurrency"].min() == rows["concurrency"].min():
            assert at is None
            continue
        hi = int(crossed["concurrency"].min())
        lo = int(rows.filter(pl.col("concurrency") < hi)["concurrency"].max())
        assert lo <= at["concurrency"] <= hi
        assert at["exposed_ms"] == pytest.approx(at["decode_step_ms"] - at["gpu_ms"])
        assert at["exposed_ms_per_token"] == pytest.approx(at["exposed_ms"] / 3.51)
        assert at["tokens_per_verify_step"] == pytest.approx(6 * at["decode_batch"])
        if name.startswith("dram"):
            assert at["exposed_ms"] == 0.0 and at["host_floor_ms"] == 0.0
        else:
            assert at["decode_step_ms"] >= at["host_floor_ms"] - 1e-9 and at["host_floor_ms"] > 0


def test_a_config_whose_sweep_never_crosses_the_target_has_no_read_off(b200_points):
    eff, wl, df = b200_points
    assert read_off_decomposition(df.filter(pl.col(X) > TARGET), eff, wl)["by_config"]["dram-uva TP4"] is None


def test_an_additive_host_offset_keeps_the_penalty_where_the_floor_hides_it(b200_points):
    """The what-if's reading (the PR body's 2.6 ms a token added to every SSD step) against the floor's, on
    the same UVA arm: the floor's penalty falls as decode steps grow, the additive one stays near 2.6 ms."""
    from dataclasses import replace

    from cachelab.serving.studies.ssd_penalty import penalty_under

    eff, wl, df = b200_points
    floor = penalty_by_concurrency(df)["by_concurrency"]
    additive = penalty_under(wl, replace(eff, piecewise_step_offset_s=2.6e-3 * 3.51), eff)["by_concurrency"]
    assert set(additive) == set(floor)
    assert all(additive[c]["model"] >= floor[c]["model"] - 1e-9 for c in floor)
    assert 2.0 < additive["64"]["model"] < 3.5 and floor["64"]["model"] < 0.5
    assert additive["64"]["published"] == floor["64"]["published"]


def test_the_8k1k_pairs_penalty_is_negative_the_ssd_arm_was_faster():
    """14,168 against 13,632 tok/s at 16 clients, an output share of about 1/9 (lengths uniform in [0.8 L, L]
    for both 8k in and 1k out): -0.40 ms per output token, where the agentic sweep's held-out points give +2-3."""
    from cachelab.serving.studies.ssd_penalty import pair_penalty_ms_per_token

    assert pair_penalty_ms_per_token() == pytest.approx(16 * (9 / 14_168 - 9 / 13_632) * 1e3, rel=2e-3)
    assert pair_penalty_ms_per_token() == pytest.approx(-0.40, abs=0.01)
