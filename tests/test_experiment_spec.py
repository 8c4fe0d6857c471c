"""Bad specs stop before any work, with a message naming the key (and the allowed values)."""

from __future__ import annotations

import json
import re

import pytest
from experiment_helpers import cli, write_spec

from cachelab.errors import CachelabError
from cachelab.experiment.spec import capacity_rows, load_spec
from cachelab.experiment.sweep import expand
from cachelab.paths import REPO_ROOT


def _load(tmp_path, extra="", **kw):
    return load_spec(write_spec(tmp_path, extra=extra, **kw))


def _error(tmp_path, text_from, text_to, extra=""):
    path = write_spec(tmp_path, extra=extra)
    path.write_text(path.read_text().replace(text_from, text_to, 1))
    with pytest.raises(CachelabError) as exc:
        load_spec(path)
    return str(exc.value)


def test_valid_spec_expands_to_a_hashed_grid(tmp_path):
    spec = _load(tmp_path)
    points = expand(spec)
    assert len(points) == 4 and len({p.hash for p in points}) == 4
    assert points[0].axes == {"kind": "replay", "hbm.capacity": "0.5%", "hbm.admission": "always", "seed": 0}
    assert points[0].config["hierarchy"]["tiers"][0]["capacity"] == "0.5%"
    assert expand(_load(tmp_path))[0].hash == points[0].hash  # stable across loads


@pytest.mark.parametrize("old,new,expected", [
    ('policy = "lru"', 'policy = "lur"', "hierarchy.tiers[0].policy: unknown policy 'lur'; allowed: "),
    ('capacity = "1%"', "capacity = 999999999999", "hierarchy.tiers[0].capacity: 999999999999 is 999,999,999,999 "
                                                   "rows, larger than the table"),
    ('capacity = "1%"', 'capacity = "1 PiB"', "hierarchy.tiers[0].capacity: '1 PiB' is not a capacity"),
    ('capacity = "1%"', 'capacity = "150%"',
     "hierarchy.tiers[0].capacity: '150%': a share of the distinct rows must be in"),
    ("warmup = 0.1", 'warmup = "lots"', "warmup: Input should be a valid number"),
    ("warmup = 0.1", "warmup = 1.5", "warmup: Input should be less than 1"),
    ("tokens_per_step = 512", "tokens_per_step = -4", "workload.tokens_per_step: Input should be greater than 0"),
    ("seeds = [0]", 'seeds = "zero"', "seeds: Input should be a valid list"),
    ("seeds = [0]", "seeds = [true]", "seeds[0]: Input should be a valid integer (got True)"),  # was seed 1
    ("tokens_per_step = 512", 'tokens_per_step = "512"', "workload.tokens_per_step: Input should be a valid integer"),
    ("warmup = 0.1", "warmup = false", "warmup: Input should be a valid number (got False)"),
    ('source = "stdlib"', 'source = "nope"', "workload.source: unknown workload 'nope'; allowed: "),
    ("tokens_per_step = 512", "tokens_per_step = 512\nsauce = 1", "workload.sauce: unknown key"),
    ('name = "tiny"', 'name = "a b"', "name: String should match pattern"),
    ("max_chars = 40000", "max_lines = 4", "workload.params: 'stdlib' has no parameter 'max_lines'; it takes "),
    ("max_chars = 40000", 'max_chars = "lots"', "workload.params.max_chars must be an integer or none, got 'lots'"),
    ("max_chars = 40000", "max_chars = -5", "workload.params: 'stdlib': max_chars must be a number of characters > 0"),
    ('capacity = "1%"', "capacity = true", "hierarchy.tiers[0].capacity: a capacity is rows, a share"),
    ('policy = "lru"', 'policy = "lru"\nadmission = "maybe"', "hierarchy.tiers[0]: unknown admission 'maybe'"),
    ('"always", "tinylfu"', '"always", 7', "sweep.'hierarchy.hbm.admission'[1]: hierarchy.tiers[0].admission: "
                                          "Input should be a valid string"),
    ('"hierarchy.hbm.capacity"', '"hierarchy.l3.capacity"', "no tier named 'l3' in hierarchy.tiers"),
    ('"always", "tinylfu"', '"always", "tinylfu", "always"',  # ran once, silently: fewer points than the grid
     "sweep.'hierarchy.hbm.admission'[2]: 'always' is listed already (at [0]); each point runs once"),
    ("seeds = [0]", 'seeds = [0]\nkind = "dance"', "kind: unknown experiment kind 'dance'; allowed: learned, live, replay, serve"),
    ("seeds = [0]", 'seeds = [0]\nkind = "learned"', "predictor: kind 'learned' needs a [predictor] section"),
    # a learned point refused a negative seed at run time; a seed listed twice ran once, silently
    ("seeds = [0]", "seeds = [0, -1]", "tiny.toml: seeds[1]: Input should be greater than or equal to 0 (got -1)"),
    ("seeds = [0]", "seeds = [0, 1, 0]", "tiny.toml: seeds[2]: 0 is listed already (at [0]); each point runs once"),
    # an axis over a key no point reads passed, and every point ran as if it were not there
    ('"hierarchy.hbm.admission"', '"kind"', "tiny.toml: sweep.'kind': not a key a point reads; list the kinds in kind"),
    ('"hierarchy.hbm.admission"', '"seeds"', "sweep.'seeds': not a key a point reads; list them in seeds = [...]"),
    ('"hierarchy.hbm.admission"', '"name"', "sweep.'name': not a key a point reads; it names the experiment"),
    # its dots unquoted, an axis is nested tables to TOML: the error said "sweep.hierarchy: Input should be a valid list"
    ('"hierarchy.hbm.admission"', "hierarchy.hbm.admission", 'tiny.toml: sweep: hierarchy.hbm.admission: a key with '
     'unquoted dots is nested tables to TOML, not one axis; quote it: "hierarchy.hbm.admission" = [...]'),
    # a negative page cache ran as none (every page read from the SSD), in silence
    ('[[hierarchy.tiers]]\nname = "hbm"', '[hierarchy]\nbacking = "ssd"\npage_cache = -4096\n\n[[hierarchy.tiers]]\n'
     'name = "hbm"', "tiny.toml: hierarchy.page_cache: -4096 bytes: a page cache holds 0 bytes or more"),
])
def test_bad_spec_names_the_key(tmp_path, old, new, expected):
    assert expected in _error(tmp_path, old, new)


@pytest.mark.parametrize("params, expected", [
    ('{ n_estimators = "many" }', "predictor.params.n_estimators must be an integer, got 'many'"),
    ("{ n_trees = 5 }", "predictor.params: 'lightgbm' has no parameter 'n_trees'"),
    ("{ learning_rate = true }", "predictor.params.learning_rate must be a number, got True"),
    # in range too: LightGBM refused these only when fitting, after the features were made
    ("{ n_estimators = 0 }", "predictor.params: lightgbm: n_estimators must be a whole number >= 1, got 0"),
    ("{ num_leaves = 1 }", "predictor.params: lightgbm: num_leaves must be a whole number >= 2, got 1"),
    ("{ learning_rate = -0.1 }", "predictor.params: lightgbm: learning_rate must be a finite number > 0, got -0.1"),
    ("{ learning_rate = inf }", "predictor.params: lightgbm: learning_rate must be a finite number > 0, got inf"),
])
def test_predictor_params_are_typed_before_any_work(tmp_path, params, expected):
    """n_estimators = "many" used to fail after two points had run."""
    extra = f'\n[predictor]\nname = "lightgbm"\nparams = {params}\n'
    assert expected in _error(tmp_path, "seeds = [0]", "seeds = [0]", extra=extra)


def test_unknown_policy_in_sweep_lists_allowed(tmp_path):
    message = _error(tmp_path, '"hierarchy.hbm.admission" = ["always", "tinylfu"]',
                     '"hierarchy.hbm.policy" = ["lru", "nope"]')
    assert "sweep.'hierarchy.hbm.policy'[1]: hierarchy.tiers[0].policy: unknown policy 'nope'; allowed: " in message
    assert "lru" in message


def test_missing_data_file_names_the_path(tmp_path, monkeypatch, data_dir):
    message = _error(tmp_path, "tokens_per_step = 512", 'tokens_per_step = 512\npath = "prompts/nope.jsonl"')
    assert "workload.path: data file not found: " in message and "prompts/nope.jsonl" in message
    monkeypatch.setenv("CACHELAB_DATA", str(tmp_path / "absent"))
    message = _error(tmp_path, "tokens_per_step = 512", 'tokens_per_step = 512\npath = "prompts/nope.jsonl"')
    assert "workload.path: 'prompts/nope.jsonl' needs the data root" in message


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write_spec(tmp_path)
    spec = load_spec(path, ["workload.params.max_chars=1000", "hierarchy.dram.policy=lru"])
    assert spec.workload.params["max_chars"] == 1000
    with pytest.raises(CachelabError, match=r"warmup: Input should be less than 1 \(got 2\)"):
        load_spec(path, ["warmup=2"])
    with pytest.raises(CachelabError, match="expected KEY=VALUE"):
        load_spec(path, ["warmup"])
    with pytest.raises(CachelabError, match="kind: name at least one experiment kind; allowed: "):
        load_spec(path, ["kind=[]"])  # no points: the run would succeed having run nothing
    # a key the file does not have was named as the file's alone (seen by helper-111)
    with pytest.raises(CachelabError, match=r"tiny.toml: workload.tokens_per_stp: unknown key \(the spec with "
                       r"--set warmup=0.2 --set workload.tokens_per_stp=512\)$"):
        load_spec(path, ["warmup=0.2", "workload.tokens_per_stp=512"])


def test_a_tier_addressed_by_its_place_is_told_to_use_its_name(tmp_path):
    """``hierarchy.tiers.1.capacity`` (as TOML lists the tiers) said only "no tier named 'tiers'"."""
    path = write_spec(tmp_path)
    with pytest.raises(CachelabError, match=re.escape(
            "--set 'hierarchy.tiers.1.capacity=5': a tier is addressed by its name, hierarchy.<tier>.capacity (here "
            "hierarchy.dram.capacity), not by its place in hierarchy.tiers; tiers: ['hbm', 'dram']")):
        load_spec(path, ["hierarchy.tiers.1.capacity=5"])
    path.write_text(path.read_text().replace('"hierarchy.hbm.admission"', '"hierarchy.tiers.0.params.x"'))
    with pytest.raises(CachelabError, match=re.escape(
            "tiny.toml: sweep.'hierarchy.tiers.0.params.x': a tier is addressed by its name, "
            "hierarchy.<tier>.params.x (here hierarchy.hbm.params.x)")):
        load_spec(path)


def test_an_override_inside_a_swept_table_reaches_every_point(tmp_path):
    """An axis over a table (``predictor.params``) replaced the whole table on every point, so
    ``--set predictor.params.num_threads=1`` inside it was silently lost."""
    def spec(axis: str):
        path = write_spec(tmp_path, extra=f'"predictor.params" = {axis}\n[predictor]\nname = "lightgbm"\n')
        path.write_text(path.read_text().replace("seeds = [0]", 'seeds = [0]\nkind = "learned"'))
        return path

    path = spec("[{ n_estimators = 10 }, { n_estimators = 20, num_leaves = 7 }]")
    points = expand(load_spec(path, ["predictor.params.num_threads=1"]))
    assert [p.config["predictor"]["params"] for p in points] == [
        {"n_estimators": 10, "num_threads": 1}, {"n_estimators": 20, "num_leaves": 7, "num_threads": 1}]
    points = expand(load_spec(path, ["predictor.params.n_estimators=5"]))  # the axis's values stay apart
    assert [p.config["predictor"]["params"] for p in points] == [{"n_estimators": 5},
                                                                 {"n_estimators": 5, "num_leaves": 7}]
    points = expand(load_spec(spec("[{ n_estimators = 10 }, { n_estimators = 20 }]"), ["predictor.params.n_estimators=5"]))
    assert [p.config["predictor"]["params"] for p in points] == [{"n_estimators": 5}]  # made equal: runs once
    path = write_spec(tmp_path, extra='"workload.domains" = [["code"], ["docstring"]]\n')
    with pytest.raises(CachelabError, match=r"--set 'workload.domains.x=1': sweep.'workload.domains'\[0\]: "
                       r"\['code'\] is not a table"):
        load_spec(path, ["workload.domains.x=1"])


def test_capacity_forms():
    assert capacity_rows(1000, 50, 264) == 1000
    assert capacity_rows("2%", 5000, 264) == 100
    assert capacity_rows("1 MiB", 10, 264) == 2**20 // 264
    assert capacity_rows("3 rows", 10, 264) == 3
    assert capacity_rows("0.001%", 10, 264) == 1  # a share of a non-empty workload is at least one row
    with pytest.raises(CachelabError, match="less than one row"):
        capacity_rows("100 B", 10, 264)


def test_bad_spec_stops_the_cli_before_any_work(tmp_path):
    path = write_spec(tmp_path)
    path.write_text(path.read_text().replace('policy = "lru"', 'policy = "lur"', 1))
    res = cli("run", str(path), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith("error: ") and "hierarchy.tiers[0].policy: unknown policy 'lur'" in res.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "experiments").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_spec_validates(path, data_dir):
    spec = load_spec(path)
    assert expand(spec), f"{path.name} has no points"


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "experiments").glob("*.toml")), ids=lambda p: p.name)
def test_no_shipped_held_out_workload_replays_a_request_of_the_training_workload(path, data_dir):
    """learned_holdout.toml trained on Arena-Hard's coding and creative-writing prompts and held out
    `arena-hard-non-english`, 66 of whose 131 prompts are creative-writing ones of that very workload:
    half its "held-out" domain was the training workload's (those in the training window replayed
    but not counted, the rest counted as unseen text) (seen by helper-142)."""
    from cachelab.experiment.spec import WorkloadSpec
    from cachelab.experiment.workload import corpus_texts

    spec = load_spec(path)
    held = spec.predictor.holdout if spec.predictor is not None else None
    held = [] if held is None else held if isinstance(held, list) else [held]
    if not held or spec.workload.trace is not None:
        return
    trained = {text for _, text in corpus_texts(spec.workload)}
    for i, workload in enumerate(held):
        workload = workload if isinstance(workload, WorkloadSpec) else WorkloadSpec(**workload)
        shared = [text for _, text in corpus_texts(workload) if text in trained]
        assert not shared, f"{path.name}: predictor.holdout[{i}] ({workload.source}) shares {len(shared)} requests"


def test_a_kind_ignores_the_axes_it_does_not_read(tmp_path):
    extra = '\n[predictor]\nname = "lightgbm"\n'
    path = write_spec(tmp_path, extra=extra)
    path.write_text(path.read_text().replace("seeds = [0]", 'seeds = [0]\nkind = ["replay", "learned"]'))
    points = expand(load_spec(path))
    kinds = [p.config["kind"] for p in points]
    assert kinds.count("replay") == 4 and kinds.count("learned") == 1  # the tier axes do not touch it
    learned = points[-1]
    assert "hierarchy" not in learned.config and learned.axes == {"kind": "learned", "seed": 0}
    path.write_text(path.read_text().replace('name = "lightgbm"', 'name = "lightgbm"\nparams = { trees = 3 }'))
    with pytest.raises(CachelabError, match=r"predictor.params: 'lightgbm' has no parameter 'trees'; it takes \["):
        load_spec(path)


def test_held_out_domains_are_a_list_and_a_bad_one_is_named_by_index(tmp_path):
    held = ('\n[predictor]\nname = "lightgbm-reuse"\nbelady_labels = true\n'
            '[[predictor.holdout]]\nsource = "stdlib"\n[[predictor.holdout]]\nsource = "stdlib"\n'
            'params = { max_chars = 1000 }\n')
    spec = _load(tmp_path, extra=held)
    assert [h.params for h in spec.predictor.holdout] == [{}, {"max_chars": 1000}]
    path = write_spec(tmp_path, extra=held.replace("max_chars = 1000", "max_lines = 4"))
    with pytest.raises(CachelabError, match=r"predictor.holdout\[1\].params: 'stdlib' has no parameter 'max_lines'"):
        load_spec(path)



def test_a_held_out_workload_of_another_layout_is_refused_before_any_work(tmp_path):
    """A held-out workload on another Engram preset (or none, where the training workload names one)
    passed the checks and failed its point after the training, reading its rows as the model's
    layout; a bad held-out preset was named as workload.preset."""
    held = ('\n[predictor]\nname = "lightgbm-reuse"\n[[predictor.holdout]]\nsource = "stdlib"\n'
            'preset = "engram-27b-demo"\n')
    with pytest.raises(CachelabError, match=r"tiny.toml: predictor.holdout\[0\].preset: 'engram-27b-demo' is not "
                       r"workload.preset 'deepseek-v4.1-flash': .* give predictor.holdout\[0\] preset = "):
        _load(tmp_path, extra=held)
    with pytest.raises(CachelabError, match=r"tiny.toml: predictor.holdout\[0\].preset: unknown preset 'nope'"):
        _load(tmp_path, extra=held.replace("engram-27b-demo", "nope"))

def test_list_valued_axes_become_table_cells():
    from types import SimpleNamespace

    from cachelab.experiment.report import ExperimentData, summary_table
    from cachelab.experiment.runner import results_table

    def run(i, domains):
        tags = {"cachelab.point_hash": str(i), "cachelab.axis.kind": '"replay"',
                "cachelab.axis.workload.domains": json.dumps(domains)}
        return SimpleNamespace(info=SimpleNamespace(run_id=str(i), run_name=f"p{i}"),
                               data=SimpleNamespace(tags=tags, params={}, metrics={"hbm.miss_ratio": 0.5}))

    table = results_table([run(0, ["coding"]), run(1, ["math", "coding"])])
    assert table["axis.workload.domains"].to_list() == ["coding", "math,coding"]
    data = ExperimentData("x", "", '{"hierarchy": {"tiers": [{"name": "hbm"}]}}', table)
    assert summary_table(data)["axis.workload.domains"].to_list() == ["coding", "math,coding"]


def test_a_field_added_with_its_default_keeps_the_point_hashes(tmp_path, monkeypatch):
    """Points already run stay recognised when a later cachelab adds a spec field whose
    default keeps the old behaviour: defaults are left out of the hash."""
    from pydantic.fields import FieldInfo

    from cachelab.experiment import spec as spec_module

    before = [p.hash for p in expand(_load(tmp_path))]
    monkeypatch.setitem(spec_module.HierarchySpec.model_fields, "future_knob", FieldInfo(annotation=int, default=7))
    for model in (spec_module.HierarchySpec, spec_module.ExperimentSpec):
        model.model_rebuild(force=True)
    try:
        points = expand(_load(tmp_path))
        assert points[0].config["hierarchy"]["future_knob"] == 7  # the field is really there
        assert [p.hash for p in points] == before
        path = write_spec(tmp_path)
        path.write_text(path.read_text().replace("[[hierarchy.tiers]]", "[hierarchy]\nfuture_knob = 8\n\n[[hierarchy.tiers]]", 1))
        changed = [p.hash for p in expand(load_spec(path))]
    finally:
        monkeypatch.undo()
        for model in (spec_module.HierarchySpec, spec_module.ExperimentSpec):
            model.model_rebuild(force=True)
    assert not set(changed) & set(before)  # a value set apart from the default is a new point


def test_set_pins_a_swept_key_and_names_an_axis_with_its_dots(tmp_path):
    path = write_spec(tmp_path)  # sweeps hierarchy.hbm.capacity (0.5%, 2%) x hierarchy.hbm.admission
    pinned = expand(load_spec(path, ["hierarchy.hbm.capacity=2%"]))
    assert sorted(p.config["hierarchy"]["tiers"][0]["capacity"] for p in pinned) == ["2%", "2%"]
    assert {p.hash for p in pinned} <= {p.hash for p in expand(load_spec(path))}  # the same points, found again
    axis = expand(load_spec(path, ['sweep.hierarchy.hbm.admission=["tinylfu"]']))
    assert [p.config["hierarchy"]["tiers"][0]["admission"] for p in axis] == ["tinylfu", "tinylfu"]
    with pytest.raises(CachelabError, match=r"sweep.hierarchy.hbm.admission: Input should be a valid list"):
        load_spec(path, ["sweep.hierarchy.hbm.admission=tinylfu"])


SERVE_SPEC = """
name = "hw"
kind = "serve"
[workload.trace]
seed = 0
arrivals = {{ source = "gamma", options = {{ rate = 4.0, num_requests = 4 }} }}
corpus = {{ source = "stdlib", options = {{ max_chars = 20000 }} }}
synthesis = {{ output_tokens = 4 }}
[serving]
hardware = "{hardware}"
placement = "dram-uva"
"""


def test_a_file_a_point_reads_is_in_its_hash(tmp_path):
    """A point hashed only the path of a hardware profile (or a calibration, a learned row
    cache's model): rewritten in place, its finished points were reused with stale results."""
    from cachelab.experiment.live import live_inputs
    from cachelab.experiment.points import serve_inputs
    from cachelab.serving.hardware import PROFILE_DIR

    profile = tmp_path / "mine.toml"
    profile.write_text((PROFILE_DIR / "B200.toml").read_text())
    spec = tmp_path / "hw.toml"
    spec.write_text(SERVE_SPEC.format(hardware=profile.as_posix()))
    [first] = expand(load_spec(spec))
    assert [p.hash for p in expand(load_spec(spec))] == [first.hash]  # unchanged file, same point
    profile.write_text(profile.read_text().replace("usd_per_gpu_hour = 1.95", "usd_per_gpu_hour = 2.5"))
    [edited] = expand(load_spec(spec))
    assert edited.hash != first.hash and edited.config == first.config
    spec.write_text(SERVE_SPEC.format(hardware="B200"))  # a built-in profile: hashed as it always was
    [builtin] = expand(load_spec(spec))
    assert serve_inputs(builtin.config) == []
    model = tmp_path / "model"
    model.mkdir()
    live = {"preset": "tiny", "placement": "dram", "row_cache_policy": "learned-lfu-adaptive",
            "row_cache_model": str(model), "calibration": str(profile)}
    assert live_inputs({"live": live}) == [profile, model]
    assert live_inputs({"live": {**live, "row_cache_policy": "lru"}}) == [profile]  # a heuristic ignores the model


def test_a_workload_data_file_is_in_the_hash_and_the_build_key(tmp_path, data_dir):
    """A trace a workload reads, captured again into the same path: its points and its built workload were
    keyed by the path alone, so `cachelab run` reused both with the old trace's results."""
    from cachelab.experiment.workload import workload_key

    lines = (data_dir / "traces/mooncake_fast25/conversation_trace.jsonl").read_text().splitlines()
    trace = tmp_path / "captured.jsonl"
    trace.write_text("\n".join(lines[:20]) + "\n")
    spec = tmp_path / "replay.toml"
    spec.write_text(SERVE_SPEC.format(hardware="B200").replace(
        'arrivals = { source = "gamma", options = { rate = 4.0, num_requests = 4 } }',
        f'arrivals = {{ source = "mooncake", path = "{trace.as_posix()}" }}'))
    [first] = expand(load_spec(spec))
    key = workload_key(first.config["workload"])
    assert [p.hash for p in expand(load_spec(spec))] == [first.hash]  # unchanged file, same point
    trace.write_text("\n".join(lines[20:40]) + "\n")
    [again] = expand(load_spec(spec))
    assert again.hash != first.hash and again.config == first.config
    assert workload_key(again.config["workload"]) != key


def test_each_seed_samples_its_own_trace(tmp_path, data_dir):  # the Mooncake import reads the data root
    """`seeds = [0, 1, 2]` on a synthesized trace: each seed's points read a trace synthesized with the
    trace's seed offset by it (they all read one trace: a serve point gave the same numbers per seed);
    seed 0 is the trace as written, its point's hash unchanged."""
    from cachelab.experiment.workload import workload_key

    spec = tmp_path / "seeds.toml"
    spec.write_text(SERVE_SPEC.format(hardware="B200").replace("seed = 0\n", "seed = 5\n"))
    [alone] = expand(load_spec(spec))
    spec.write_text(SERVE_SPEC.format(hardware="B200").replace("seed = 0\n", "seed = 5\n")
                    .replace('kind = "serve"', 'kind = "serve"\nseeds = [0, 1, 2]'))
    points = expand(load_spec(spec))
    assert [p.config["workload"]["trace"]["seed"] for p in points] == [5, 6, 7]
    assert points[0].hash == alone.hash and len({workload_key(p.config["workload"]) for p in points}) == 3
    # a trace imported as it is (no corpus) has no token ids for any point to address: refused when read
    spec.write_text(spec.read_text().replace('corpus = { source = "stdlib", options = { max_chars = 20000 } }\n', "")
                    .replace("synthesis = { output_tokens = 4 }\n", "")
                    .replace('{ source = "gamma", options = { rate = 4.0, num_requests = 4 } }',
                             '{ source = "mooncake", path = "traces/mooncake_fast25/conversation_trace.jsonl" }'))
    with pytest.raises(CachelabError, match="workload.trace has no corpus"):
        load_spec(spec)


def test_a_standard_library_workload_is_another_under_another_python(tmp_path, monkeypatch):
    """The stdlib corpus reads the running Python's standard library, which no hash held: after a
    Python upgrade its workload was found in the cache and its finished points skipped, results of
    another corpus. Its fingerprint (the Python's version) joins the point hash and the cache key."""
    import platform

    from cachelab.experiment.workload import workload_key

    def hashes():
        points = expand(_load(tmp_path))
        return [p.hash for p in points], workload_key(points[0].config["workload"])

    before, key = hashes()
    assert hashes() == (before, key)  # stable for one Python
    monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
    after, other = hashes()
    assert other != key and not set(after) & set(before)
    trace = {"arrivals": {"source": "gamma", "options": {"num_requests": 4}}, "corpus": {"source": "stdlib"}}
    from cachelab.experiment.spec import workload_sources

    assert workload_sources({"source": "arena-hard", "trace": trace}) == ["stdlib of CPython 3.99.0"]
    assert workload_sources({"source": "gsm8k"}) == []  # a corpus of data files: their contents are hashed
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    first = workload_sources({"source": "stdlib", "params": {"root": str(root)}})
    (root / "pkg" / "b.py").write_text("y = 2\n")
    from traces.stdlib import _tree_digest

    _tree_digest.cache_clear()
    assert workload_sources({"source": "stdlib", "params": {"root": str(root)}}) != first


def test_a_trace_workload_needs_a_corpus_of_the_layouts_tokenizer(tmp_path):
    """Refused when the spec is read, before any build: a [workload.trace] without a corpus (an import:
    lengths, no token ids) failed at the run with 'prompt_lengths must give, per sequence, a length
    between 0 and its token count'; one whose corpus.tokenizer is not the layout's was addressed as
    the layout's ids."""
    from test_trace_tokenizer import tiny_tokenizer

    corpus = 'corpus = { source = "stdlib", options = { max_chars = 20000 } }'
    text = SERVE_SPEC.format(hardware="B200")
    spec = tmp_path / "t.toml"
    spec.write_text(text.replace(corpus, ""))
    with pytest.raises(CachelabError, match=r"t.toml: workload.trace has no corpus: an import of 'gamma' gives its "
                                            "requests lengths but no token ids"):
        load_spec(spec)
    tok = tiny_tokenizer(tmp_path)
    spec.write_text(text.replace(corpus, corpus[:-2] + f", tokenizer = {json.dumps(tok)} }}"))
    with pytest.raises(CachelabError, match=r"t.toml: workload.trace.corpus.tokenizer: the trace's ids would be of "
                                            r"tokenizer '.*tiny.*' \(tokenizer.json SHA-256 \w+\.\.\.\), but "
                                            r"layout 'deepseek-v4.1-flash' addresses"):
        load_spec(spec)
    spec.write_text(text.replace(corpus, corpus[:-2] + ', tokenizer = "missing.json" }'))
    with pytest.raises(CachelabError, match="workload.trace.corpus.tokenizer: tokenizer file not found: "
                                            + re.escape(str(tmp_path / "missing.json"))):
        load_spec(spec)
    spec.write_text(text)
    assert load_spec(spec)


def test_a_spec_reads_its_files_from_its_own_folder(tmp_path, monkeypatch):
    """A relative workload.preset (a layout file), [workload.trace]'s corpus.tokenizer and
    serving.hardware were read from the working directory: `cachelab run experiments/x.toml` from
    another folder failed, or read another file of the same name. They are read from the spec's
    folder, in sweep values and held-out workloads too, as a layout file reads its tokenizer; a
    path given with --set is the command line's, so the working directory's."""
    from cachelab.serving.hardware import PROFILE_DIR
    from test_trace_tokenizer import tiny_layout, tiny_tokenizer

    folder = tmp_path / "specs"
    folder.mkdir()
    tiny_tokenizer(folder)
    tiny_layout(folder, "tiny/tokenizer.json")  # its tokenizer from its own folder
    (folder / "mine.toml").write_text((PROFILE_DIR / "B200.toml").read_text())
    trace = 'corpus = { source = "stdlib", tokenizer = "TOK", options = { max_chars = 20000 } }'
    text = SERVE_SPEC.format(hardware="mine.toml").replace(
        'corpus = { source = "stdlib", options = { max_chars = 20000 } }', trace)
    text = text.replace("[workload.trace]", '[workload]\npreset = "tiny_layout.toml"\n[workload.trace]')
    spec = folder / "x.toml"
    spec.write_text(text.replace("TOK", "tiny/tokenizer.json")
                    + '[sweep]\n"workload.trace.corpus.tokenizer" = ["tiny/tokenizer.json"]\n')
    monkeypatch.chdir(tmp_path)  # not the spec's folder: none of its files is here
    loaded = load_spec(spec)
    assert loaded.workload.preset == str(folder / "tiny_layout.toml")
    assert loaded.workload.trace["corpus"]["tokenizer"] == str(folder / "tiny" / "tokenizer.json")
    assert loaded.sweep["workload.trace.corpus.tokenizer"] == [str(folder / "tiny" / "tokenizer.json")]
    assert loaded.serving.hardware == str(folder / "mine.toml")
    [point] = expand(loaded)
    assert point.config["workload"]["trace"]["corpus"]["tokenizer"] == str(folder / "tiny" / "tokenizer.json")
    assert load_spec(spec, ['serving.hardware="specs/mine.toml"']).serving.hardware == "specs/mine.toml"

    spec.write_text(text.replace("TOK", "other/tokenizer.json"))  # missing: named by its key, in the spec's folder
    with pytest.raises(CachelabError, match=r"x.toml: workload.trace.corpus.tokenizer: tokenizer file not found: "
                                            + re.escape(str(folder / "other" / "tokenizer.json"))):
        load_spec(spec)


def test_a_layout_file_and_its_tokenizer_are_in_the_hash_and_the_build_key(tmp_path):
    """A layout file (workload.preset) or a tokenizer edited in place hashed as before: its points were
    skipped as finished and its workload came from the cache, rows of the old layout (seen by
    helper-130)."""
    from cachelab.experiment.workload import workload_key
    from test_trace_tokenizer import tiny_layout, tiny_tokenizer

    tok = tiny_tokenizer(tmp_path)
    layout = tiny_layout(tmp_path, "tiny/tokenizer.json")
    spec = tmp_path / "x.toml"
    spec.write_text('name = "x"\n[workload]\npreset = "tiny_layout.toml"\n'
                    '[[hierarchy.tiers]]\nname = "hbm"\ncapacity = 10\n')

    def keys():
        loaded = load_spec(spec)
        [point] = expand(loaded)
        return point.hash, workload_key(loaded.workload), point.inputs["files"]

    first = keys()
    assert set(first[2]) == {layout, tok}
    with open(layout, "a") as f:
        f.write("# edited\n")
    second = keys()
    with open(tok, "a") as f:
        f.write("\n")
    third = keys()
    assert len({first[:2], second[:2], third[:2]}) == 3  # each edit: other points, another build
    assert first[2][layout] != second[2][layout] == third[2][layout] and second[2][tok] != third[2][tok]
