"""ServeGen: requests sampled from per-client rate / CV / length distributions."""

from __future__ import annotations

import glob
import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cachelab.errors import CachelabError
from cachelab.trace.ingest import Ingest
from cachelab.trace.schema import validate
from traces import servegen as servegen_module
from traces.servegen import ServeGenWorkload, read_pmfs, read_windows

TRACE = "0,0.5,1.0,Gamma,1.0,2.0\n600,0,0,,0,0\n1200,2.0,2.0,Weibull,0.6,0.3\n"
DATASET = {"0": {"input_tokens": "{10: 0.25, 20: 0.75}", "output_tokens": "{5: 1.0}", "reason_ratio": "{0.0: 1.0}"},
           "1200": {"input_tokens": "{}", "output_tokens": "{}", "reason_ratio": "{}"}}


def client(tmp_path, trace: str = TRACE, dataset: str | None = None):
    folder = tmp_path / "language" / "m-test"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chunk-3-trace.csv").write_text(trace)
    (folder / "chunk-3-dataset.json").write_text(dataset if dataset is not None else json.dumps(DATASET, indent=1))
    return folder


def test_rates_lengths_idle_windows_and_seed(tmp_path):
    folder = client(tmp_path)
    df = ServeGenWorkload(str(folder), duration_s=1800, seed=1).arrivals()
    t = df["arrival_s"].to_numpy()
    assert 0.5 * 600 * 0.85 < (t < 600).sum() < 0.5 * 600 * 1.15  # rate 0.5/s in the first window
    assert not ((t >= 600) & (t < 1200)).any()  # an idle window
    assert 2.0 * 600 * 0.8 < (t >= 1200).sum() < 2.0 * 600 * 1.2  # bursty (CV 2) at 2/s
    assert set(df["prompt_len"]) <= {10, 20} and set(df["output_len"]) == {5}  # the 1200 PMFs are empty: 0's apply
    assert df["domain"][0] == "language"
    assert ServeGenWorkload(str(folder), duration_s=1800, seed=1).arrivals().equals(df)
    assert not ServeGenWorkload(str(folder), duration_s=1800, seed=2).arrivals()["arrival_s"].equals(df["arrival_s"])
    later = ServeGenWorkload(str(folder), duration_s=600, start_s=1200, seed=1).arrivals()["arrival_s"]
    assert later.min() >= 0 and later.max() < 600


@pytest.mark.parametrize("line, message", [
    ("600,0,0", "3 fields, expected 6"),
    ("600,fast,1.0,Gamma,1,1", "field 'rate'"),
    ("600,0.5,1.0,Pareto,1,1", "field 'pattern'"),
    ("600,0.5,-1,Gamma,1,1", "field 'cv'"),
    ("600,1e300,1,Gamma,1,1", "field 'rate'"),
])
def test_corrupted_trace_rows_are_named_or_counted(tmp_path, line, message):
    folder = client(tmp_path, trace=TRACE.replace("600,0,0,,0,0", line))
    with pytest.raises(CachelabError, match=f"chunk-3-trace.csv:2: {message}"):
        ServeGenWorkload(str(folder)).arrivals()
    source = ServeGenWorkload(str(folder), skip_bad=True, duration_s=1800)
    source.arrivals()
    assert source.skipped == 1


@pytest.mark.parametrize("dataset, message", [
    ('{"0": {"input_tokens": "{10: oops}", "output_tokens": "{5: 1.0}"}}', ":1: window 0, field 'input_tokens'"),
    ('{\n"0": {\n"input_tokens": "{10: 0.5}",\n"output_tokens": "{5: 1.0}"}}', ":3: window 0, field 'input_tokens': not a PMF"),
    ('{"0": {"input_tokens": ', ":1: not valid JSON"),
    ("", "empty file"),
])
def test_corrupted_dataset_is_named(tmp_path, dataset, message):
    folder = client(tmp_path, dataset=dataset)
    with pytest.raises(CachelabError, match=message):
        ServeGenWorkload(str(folder)).arrivals()


@pytest.mark.data
def test_real_deepseek_r1_rates_are_reproduced(data_dir):
    folder = data_dir / "traces/servegen/data/reason/deepseek-r1"
    df = ServeGenWorkload(str(folder), duration_s=7200, start_s=36000, seed=0).arrivals()
    expected = 0.0
    for path in glob.glob(str(folder / "chunk-*-trace.csv")):
        w = read_windows(Ingest(path))
        expected += w.filter((w["start_s"] >= 36000) & (w["start_s"] < 43200))["rate"].sum() * 600
    assert df.height == pytest.approx(expected, rel=0.05)
    assert df["domain"].unique().to_list() == ["reason"]
    assert np.all(df["prompt_len"].to_numpy() > 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), skip=st.booleans())
def test_arbitrary_trace_bytes_give_requests_or_a_clean_error(tmp_path, data, skip):
    folder = client(tmp_path)
    (folder / "chunk-3-trace.csv").write_bytes(data)
    try:
        df = ServeGenWorkload(str(folder), skip_bad=skip).arrivals()
    except CachelabError:
        return
    validate(df, "fuzz")


def test_a_windows_requests_do_not_depend_on_the_span_taken(tmp_path):
    """One generator ran through the windows taken in turn, so a window's requests depended on
    which windows came before it: hours 1200-1800 of a trace from 0 and of one from 1200 differed.
    Each window now draws whole from its own generator (seed, client, window), then is cut to
    the span: the same requests, and a span that ends inside a window keeps a prefix of them."""
    folder = client(tmp_path)
    whole = ServeGenWorkload(str(folder), duration_s=1800, seed=1).arrivals()
    late = ServeGenWorkload(str(folder), duration_s=600, start_s=1200, seed=1).arrivals()
    tail = whole.filter(whole["arrival_s"] >= 1200)
    assert late.height > 100
    np.testing.assert_allclose(late["arrival_s"].to_numpy() + 1200, tail["arrival_s"].to_numpy())
    assert late["prompt_len"].to_list() == tail["prompt_len"].to_list()
    cut = ServeGenWorkload(str(folder), duration_s=1500, seed=1).arrivals()
    assert cut.equals(whole.filter(whole["arrival_s"] < 1500))


def test_a_length_pmf_of_fractional_token_counts_is_refused(tmp_path):
    """A PMF key of 12.5 tokens was cut to 12 without a word."""
    dataset = json.dumps({"0": {"input_tokens": "{10: 0.5, 12.5: 0.5}", "output_tokens": "{5: 1.0}"}})
    with pytest.raises(CachelabError, match="window 0, field 'input_tokens': keys must be whole token counts"):
        ServeGenWorkload(str(client(tmp_path, dataset=dataset))).arrivals()


def test_a_truncated_real_dataset_file_is_named_as_truncated(data_dir, tmp_path):
    """A cut dataset file was 'FILE:9: not valid JSON (Unterminated string starting at)', the line of
    whatever the cut left open: it now says the file ends before its JSON does."""
    source = data_dir / "traces/servegen/data/reason/deepseek-r1/chunk-35-dataset.json"
    raw = source.read_bytes()
    path = tmp_path / "chunk-35-dataset.json"
    for cut in (10, len(raw) // 2, len(raw) - 3):
        path.write_bytes(raw[:cut])
        with pytest.raises(CachelabError, match=rf"{path.name}:\d+: not valid JSON \(.*\): the file ends before its "
                                                r"JSON does \(truncated\?\)"):
            read_pmfs(Ingest(path))
    path.write_bytes(raw.replace(b'"', b"'", 1))  # damaged, not cut: no such guess
    with pytest.raises(CachelabError, match=rf"{path.name}:2: not valid JSON \(Expecting property name[^:]*$"):
        read_pmfs(Ingest(path))


def test_a_dataset_file_past_the_bound_is_refused_unread(tmp_path):
    """The whole file was read and parsed, about 30 times its size in Python memory (33 MiB for the
    published 1.1 MB file): a multi-GB file given as a dataset exhausted memory before any error."""
    path = tmp_path / "chunk-1-dataset.json"
    with open(path, "wb") as fh:
        fh.truncate(servegen_module.MAX_DATASET_BYTES + 1)  # sparse: no disk, and no memory unless read
    tracemalloc.start()
    try:
        with pytest.raises(CachelabError, match=rf"{path.name}: 67,108,865 bytes, more than the 67,108,864 a "
                                                "ServeGen dataset file may have"):
            read_pmfs(Ingest(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak / 2**20:.0f} MiB"
