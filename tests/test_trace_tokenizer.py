"""A trace records the tokenizer that made its ids, and a layout of another tokenizer is refused
where it would address them: the same ids are other text under another tokenizer."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.trace.schema import TOKENIZER_KEY, recorded_tokenizer, write_trace
from cachelab.trace.stats import summarize
from test_trace_schema import table


def tiny_tokenizer(folder) -> str:
    """A word-level tokenizer.json of 14 ids: another tokenizer than DeepSeek-V4's."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<bos>", "<p2>", "a", "b", "c", "d", "e", "f", "g", "h", "the", "cat", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = folder / "tiny" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


def tiny_layout(folder, tokenizer: str):
    path = folder / "tiny_layout.toml"
    path.write_text(f'tokenizer = {json.dumps(tokenizer)}\nlayers = [1, 14]\nmax_ngram = 3\nheads = 2\n'
                    "base_sizes = [1000, 1000]\ncompressed_vocab = 14\n")
    return str(path)


def test_a_trace_records_its_tokenizer(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    write_trace(table(), tmp_path / "t.parquet", tokenizer=tok)
    record = recorded_tokenizer(tmp_path / "t.parquet")
    assert record["tokenizer"] == tok and len(record["sha256"]) == 64
    assert summarize(tmp_path / "t.parquet", preset=tiny_layout(tmp_path, tok))["tokenizer"] == record
    write_trace(table(), tmp_path / "old.parquet")  # none known (a capture, or written before the record)
    assert recorded_tokenizer(tmp_path / "old.parquet") is None


def test_synthesis_records_the_corpus_tokenizer(tmp_path):
    from cachelab.trace.build import build, parse_spec

    spec = parse_spec({"arrivals": {"source": "gamma", "options": {"rate": 2.0, "num_requests": 3}},
                       "corpus": {"source": "stdlib", "options": {"max_chars": 200_000}}}, "test")
    build(spec, tmp_path / "t.parquet")
    assert recorded_tokenizer(tmp_path / "t.parquet")["tokenizer"] == "deepseek-v4"


@pytest.mark.parametrize("verb", [
    ["trace", "info", "{trace}", "--engram-tokens", "100"],
    ["trace", "convert", "{trace}", "{out}/rows.bin"],
    ["trace", "lookups", "{trace}", "-o", "{out}/s.npz"],
    ["simulate", "--trace", "{trace}", "--policy", "lru", "--capacity", "100"],
    ["serve-sim", "--trace", "{trace}", "--hardware", "B200", "--placement", "hbm"],
])
def test_ids_of_another_tokenizer_are_refused(tmp_path, verb):
    """The default layout (DeepSeek-V4's tokenizer) on ids a tiny tokenizer made: every verb that
    addresses a trace's ids read them as V4 ids before."""
    trace = tmp_path / "t.parquet"
    write_trace(table(), trace, tokenizer=tiny_tokenizer(tmp_path))
    args = [a.format(trace=trace, out=tmp_path) for a in verb]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert "its token ids are of tokenizer" in result.output and "tiny" in result.output
    assert "deepseek-v4" in result.output


def test_a_layout_of_another_tokenizer_is_refused(tmp_path):
    from cachelab.learning.streams import load_trace

    trace = tmp_path / "t.parquet"
    write_trace(table(), trace, tokenizer="deepseek-v4")
    layout = tiny_layout(tmp_path, tiny_tokenizer(tmp_path))
    with pytest.raises(CachelabError, match="layout 'tiny_layout' addresses ids of"):
        load_trace(str(trace), 0, 0, layout)
    with pytest.raises(CachelabError, match="its token ids are of tokenizer 'deepseek-v4'"):
        summarize(trace, preset=layout)
    assert load_trace(str(trace), 0, 0, "deepseek-v4.1-flash").keys.size  # the same tokenizer: addressed


def test_a_malformed_record_is_named(tmp_path):
    trace = tmp_path / "t.parquet"
    write_trace(table(), trace)
    data = pq.read_table(trace)
    pq.write_table(data.replace_schema_metadata({**data.schema.metadata, TOKENIZER_KEY: b"[1]"}), trace)
    with pytest.raises(CachelabError, match="t.parquet: Parquet metadata cachelab.trace.tokenizer"):
        recorded_tokenizer(trace)


@pytest.mark.data
def test_an_experiment_trace_of_another_tokenizer_is_refused(tmp_path, data_dir):
    """[workload.trace] with corpus.tokenizer of another tokenizer than workload.preset's layout:
    the trace's ids were addressed as the layout's."""
    from cachelab.experiment.spec import WorkloadSpec
    from cachelab.experiment.workload import _from_trace

    trace = {"arrivals": {"source": "gamma", "options": {"rate": 2.0, "num_requests": 2}},
             "corpus": {"source": "mt-bench", "tokenizer": tiny_tokenizer(tmp_path)}}
    with pytest.raises(CachelabError, match="layout 'deepseek-v4.1-flash' addresses ids of 'deepseek-v4'"):
        _from_trace(WorkloadSpec(trace=trace), tmp_path / "w.trace.parquet")
    trace["corpus"].pop("tokenizer")
    sequences, _, _ = _from_trace(WorkloadSpec(trace=trace), tmp_path / "w.trace.parquet")
    assert len(sequences) >= 2


def test_a_spec_file_reads_its_tokenizer_from_its_own_folder(tmp_path, monkeypatch):
    """A relative corpus.tokenizer was read from the working directory (a layout file's from its
    folder): the same spec built with another tokenizer, or failed, depending on where it ran; and
    --corpus over a spec dropped the spec's tokenizer, building with DeepSeek-V4's unsaid."""
    folder = tmp_path / "specs"
    folder.mkdir()
    tok = tiny_tokenizer(folder)
    spec = folder / "w.toml"
    spec.write_text('[arrivals]\nsource = "gamma"\noptions = { rate = 2.0, num_requests = 2 }\n'
                    '[corpus]\nsource = "stdlib"\ntokenizer = "tiny/tokenizer.json"\n'
                    'options = { max_chars = 200000 }\n')
    monkeypatch.chdir(tmp_path)  # not the spec's folder: tiny/tokenizer.json is not here
    for extra in ([], ["--corpus", "stdlib", "--corpus-option", "max_chars=200000"]):  # 200k chars, not all
        out = tmp_path / f"t{len(extra)}.parquet"
        result = CliRunner().invoke(app, ["trace", "build", str(spec), *extra, "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert recorded_tokenizer(out)["tokenizer"] == tok
