"""Damaged or crafted model files are refused with an error naming the file, never a crash,
a hang or a traceback: the manifest (size + SHA-256) is checked before any parser reads a
byte, LightGBM's text model is read by cachelab's own parser, and flattened trees are
checked (children in range and after their node, features in range, shapes agree) before
the unchecked compiled loop walks them. A Hypothesis fuzz truncates, flips bits and crafts
files (re-sealing the manifest, so the parsers themselves see the damage)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.features import FEATURE_NAMES, CorpusPrior
from cachelab.learning.predictor import MANIFEST, seal
from cachelab.learning.training import PRIOR, Model, load, save

PREDICTORS = {"lightgbm": {"n_estimators": 6, "num_leaves": 7, "min_child_samples": 5},
              "hgb": {"max_iter": 6, "max_leaf_nodes": 7}, "logistic": {},
              "mlp": {"hidden": 8, "epochs": 1, "batch_size": 256}}
WIDTH = len(FEATURE_NAMES)


def _x(n=400, seed=0):
    return np.random.default_rng(seed).normal(size=(n, WIDTH)).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """One small saved model per built-in predictor family, and its predictions on ``_x()``."""
    x = _x(1500, seed=1)
    gap = np.log1p(np.exp(1.0 + x[:, 0] - x[:, 1])).astype(np.float32)
    reuse = (gap < np.median(gap)).astype(np.float32)
    prior = CorpusPrior(np.arange(50, dtype=np.int64), np.array([3, 9, 40], np.int64), np.array([2, 5, 7], np.int64))
    out = {}
    for name, params in PREDICTORS.items():
        cls = registry.get(registry.PREDICTORS, name)
        fitted = cls(**params).fit(x, gap if cls.task == "regression" else reuse, list(FEATURE_NAMES))
        directory = tmp_path_factory.mktemp(name)
        save(Model(fitted, prior, ["code"], 64, {"spec": {"horizon": 64, "domains": ["code"]}}), directory)
        out[name] = directory, fitted.predict(_x())
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _outcome(directory: Path) -> str:
    """Load and score; anything but success or a CachelabError fails the test."""
    try:
        model = load(directory)
        scores = model.predictor.predict(_x(50))
    except CachelabError as exc:
        assert str(exc), "an error must say what is wrong"
        return "refused"
    assert np.asarray(scores).shape == (50,)
    return "loaded"


def test_saved_models_carry_a_manifest_and_load_back(models):
    for name, (directory, expected) in models.items():
        manifest = json.loads((directory / MANIFEST).read_text())["files"]
        assert {"metadata.json", PRIOR} <= set(manifest), name
        assert all(len(e["sha256"]) == 64 and e["size"] == (directory / f).stat().st_size for f, e in manifest.items())
        np.testing.assert_allclose(load(directory).predictor.predict(_x()), expected, rtol=1e-6, atol=1e-9)


def test_a_saved_models_files_all_have_the_umasks_mode(models):
    """prior.safetensors was 0600 (safetensors' save_file) where the model's other files were
    0644: another user could load no model it was given read access to."""
    import os

    umask = os.umask(0o22)
    os.umask(umask)
    for name, (directory, _) in models.items():
        modes = {f.name: oct(f.stat().st_mode & 0o777) for f in directory.iterdir()}
        assert set(modes.values()) == {oct(0o666 & ~umask)}, (name, modes)


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_truncated_lightgbm_model_is_refused_by_the_manifest_and_by_the_parser(models, tmp_path, fraction):
    d = _copy(models["lightgbm"][0], tmp_path / "m")
    text = (d / "model.txt").read_bytes()
    (d / "model.txt").write_bytes(text[:int(len(text) * fraction)])
    with pytest.raises(CachelabError, match=r"model.txt is [\d,]+ bytes, manifest.json says"):
        load(d)
    seal(d)  # a crafted file with a matching manifest reaches the parser: trees cut short are refused
    if b"end of trees" in text[:int(len(text) * fraction)]:  # only the trailing sections were cut
        np.testing.assert_allclose(load(d).predictor.predict(_x()), models["lightgbm"][1], rtol=1e-9)
    else:
        with pytest.raises(CachelabError, match="model.txt"):
            load(d)


def test_bit_flip_is_refused_naming_the_file(models, tmp_path):
    d = _copy(models["hgb"][0], tmp_path / "m")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x10
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CachelabError, match="model.safetensors does not match its SHA-256"):
        load(d)


def test_a_model_without_manifest_is_refused(models, tmp_path):
    d = _copy(models["logistic"][0], tmp_path / "m")
    (d / MANIFEST).unlink()
    with pytest.raises(CachelabError, match="has no manifest.json"):
        load(d)


def _craft_forest(d: Path, **changes) -> None:
    t = load_file(str(d / "model.safetensors"))
    for name, change in changes.items():
        t[name] = change(t[name].copy())
    save_file(t, str(d / "model.safetensors"))
    seal(d)


def _set(i, value):
    def change(a):
        a[i] = value
        return a
    return change


@pytest.mark.parametrize("changes, message", [
    ({"left": _set(0, 10**6)}, "node 0 has children"),              # out of range: was a segfault
    ({"left": lambda a: a[:-3]}, "arrays of one length"),           # a short tensor: was a segfault
    ({"left": _set(0, 0)}, "node 0 has children 0"),                # points to itself: was an endless loop
    ({"right": _set(0, -5)}, "node 0 has children"),
    ({"feature": _set(0, 99)}, "outside the model's"),
    ({"roots": _set(0, -1)}, "root lies outside"),
    ({"left": lambda a: a.astype(np.float32)}, "32-bit integers"),
    ({"base": lambda a: np.zeros((2, 2))}, "'base'"),
])
def test_crafted_hgb_forests_are_refused(models, tmp_path, changes, message):
    d = _copy(models["hgb"][0], tmp_path / "m")
    _craft_forest(d, **changes)
    with pytest.raises(CachelabError, match=message) as exc:
        load(d)
    assert "model.safetensors" in str(exc.value)


def _craft_metadata(d: Path, change) -> None:
    path = d / "metadata.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    seal(d)


@pytest.mark.parametrize("change, message", [
    (lambda m: [m], "expected a JSON object, got list"),
    (lambda m: {**m, "spec": {**m["spec"], "horizon": "64"}}, "spec.horizon must be a whole number"),
    (lambda m: {**m, "feature_names": "abc"}, "'feature_names' must be a list"),
    (lambda m: {**m, "params": {**m["params"], "max_iter": "many"}}, r"params.max_iter must be an integer"),
    (lambda m: {**m, "params": {"nope": 1}}, "has no parameter 'nope'"),
    # which model named it was said nowhere: the file, and that the model needs it
    (lambda m: {**m, "predictor": "no-such-predictor"}, r"metadata.json: predictor: unknown predictor 'no-such-predictor'; "
     r"installed: .* \(the model was trained with it and loads only through it\)"),
    # the training requests' digests (evaluate leaves their repeats uncounted) and the params' ranges
    (lambda m: {**m, "spec": {**m["spec"], "train_requests": "abc"}}, "spec.train_requests must be a list of 16-digit"),
    (lambda m: {**m, "spec": {**m["spec"], "train_requests": ["x" * 16]}}, "spec.train_requests must be a list"),
    # and its prompts' (online scoring counts the served prompts among them)
    (lambda m: {**m, "spec": {**m["spec"], "train_prompts": ["0" * 15]}}, "spec.train_prompts must be a list of 16"),
    (lambda m: {**m, "params": {**m["params"], "max_iter": 0}}, r"metadata.json: params: hgb: max_iter must be a whole number >= 1, got 0"),
    # a keep model's size in rows, which every verb running it now names and judges it at
    (lambda m: {**m, "spec": {**m["spec"], "capacity": 0.01, "capacity_rows": "many"}},
     r"metadata.json: spec.capacity_rows must be a whole number of rows >= 1, got 'many'"),
])
def test_crafted_metadata_is_refused_naming_the_key(models, tmp_path, change, message):
    d = _copy(models["hgb"][0], tmp_path / "m")
    _craft_metadata(d, change)
    with pytest.raises(CachelabError, match=message):
        load(d)


def test_truncated_prior_is_refused(models, tmp_path):
    d = _copy(models["hgb"][0], tmp_path / "m")
    (d / PRIOR).write_bytes((d / PRIOR).read_bytes()[:40])
    seal(d)
    with pytest.raises(CachelabError, match="prior.safetensors: not a readable safetensors file"):
        load(d)


def test_lightgbm_text_parser_matches_the_booster():
    """The Python reader of model.txt scores exactly as LightGBM's own predict."""
    import lightgbm as lgb

    from predictors.trees import from_lightgbm_text

    x = _x(3000, seed=2)[:, :5]
    y = np.log1p(np.exp(2.0 + 1.5 * x[:, 0] - x[:, 1]))
    booster = lgb.train({"objective": "regression", "verbosity": -1, "num_threads": 1, "num_leaves": 15},
                        lgb.Dataset(x, y), num_boost_round=15)
    forest, gain, width = from_lightgbm_text(booster.model_to_string())
    assert width == 5
    np.testing.assert_allclose(forest.raw_predict(x), booster.predict(x), rtol=1e-9, atol=1e-9)
    by_feature = np.bincount(forest.feature[forest.left >= 0], gain[forest.left >= 0], 5)
    np.testing.assert_allclose(by_feature, booster.feature_importance("gain"), rtol=1e-6)


def test_wrong_plugin_is_never_blamed(models):
    """An exception inside hgb's loader names hgb, not the other class of its module."""
    from cachelab.registry import blame

    cls = registry.get(registry.PREDICTORS, "hgb")
    with pytest.raises(TypeError) as exc:
        cls.load_model(models["hgb"][0], {"params": {"nope": 1}, "feature_names": list(FEATURE_NAMES)})
    assert blame(exc.value).name == "hgb"


def test_a_loader_that_returns_no_predictor_is_refused_naming_it(models, monkeypatch):
    """A plug-in's load_model that hands back something else (its library's raw model, None)."""
    cls = registry.get(registry.PREDICTORS, "logistic")
    monkeypatch.setattr(cls, "load_model", classmethod(lambda c, directory, metadata: {"coef": [1.0]}))
    with pytest.raises(CachelabError, match="predictor 'logistic''s load_model returned dict, not a Logistic"):
        load(models["logistic"][0])


# --- the fuzz -------------------------------------------------------------------------------

FILES = {"lightgbm": "model.txt", "hgb": "model.safetensors", "logistic": "model.safetensors",
         "mlp": "model.safetensors"}


@st.composite
def damage(draw):
    """(predictor, file, new bytes, re-seal?): a truncation, a bit flip or a crafted edit."""
    name = draw(st.sampled_from(sorted(PREDICTORS)))
    file = draw(st.sampled_from([FILES[name], "metadata.json", PRIOR]))
    how = draw(st.sampled_from(["truncate", "flip", "splice", "numbers"]))
    return name, file, how, draw(st.integers(0, 2**32 - 1)), draw(st.booleans())


def _damaged(data: bytes, how: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if how == "truncate":
        return data[:int(rng.integers(0, len(data)))]
    if how == "flip":
        out = bytearray(data)
        for pos in rng.integers(0, len(data), size=int(rng.integers(1, 8))):
            out[pos] ^= 1 << int(rng.integers(0, 8))
        return bytes(out)
    if how == "splice":  # a run of random bytes over the middle of the file
        at, n = int(rng.integers(0, len(data))), int(rng.integers(1, 64))
        return data[:at] + rng.integers(0, 256, n, dtype=np.uint8).tobytes() + data[at + n:]
    text = data.decode("latin-1")  # crafted numbers: a child index, a count, a feature, a size
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    if not digits:
        return data
    at = digits[int(rng.integers(0, len(digits)))]
    value = str(rng.choice([-1, -2, 0, 1, 7, 2**31, 10**30, int(rng.integers(-100, 100))]))
    return (text[:at] + value + text[at + 1:]).encode("latin-1")


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                     HealthCheck.function_scoped_fixture])
@given(damage())
def test_fuzzed_model_files_never_crash_hang_or_traceback(models, case):
    name, file, how, seed, reseal = case
    with tempfile.TemporaryDirectory() as tmp:
        d = _copy(models[name][0], Path(tmp) / "m")
        path = d / file
        damaged = _damaged(path.read_bytes(), how, seed)
        path.write_bytes(damaged)
        if reseal:
            seal(d)
        outcome = _outcome(d)
        if not reseal and damaged != (models[name][0] / file).read_bytes():
            assert outcome == "refused", "the manifest must catch every change"


def test_a_save_that_fails_leaves_the_model_it_replaces_whole(models, tmp_path, monkeypatch):
    """A save wrote the prior, then the predictor's files, over the old model in place: one that
    failed midway (a full disk, a plug-in's save_model raising) left the new prior beside the old
    files, the old manifest refusing them all: the good model was lost, and a new folder kept a
    prior and no model. It now writes into a scratch folder and moves the files in whole."""
    directory, want = models["lightgbm"]
    kept = _copy(directory, tmp_path / "kept")
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    other = load(models["hgb"][0])  # another model to save over it
    cls = type(other.predictor)

    def fails(self, where):
        (Path(where) / "half-written").write_bytes(b"\0" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cls, "save_model", fails)
    for target in (kept, tmp_path / "new"):
        with pytest.raises(CachelabError, match=f"{target.name}: the model could not be written \\(No space left"):
            save(other, target)
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    np.testing.assert_array_equal(load(kept).predictor.predict(_x()), want)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # no scratch folder left behind
    monkeypatch.undo()
    save(other, kept)  # replaced whole: the old model's files gone, the new one's sealed
    assert "model.txt" not in {p.name for p in kept.iterdir()}
    np.testing.assert_array_equal(load(kept).predictor.predict(_x()), models["hgb"][1])


def test_a_save_over_the_file_size_limit_is_an_error_naming_the_folder(models, tmp_path):
    """A save whose prior hit the file size limit (or a full disk) ended `cachelab train` with the
    safetensors writer's traceback (docs/robustness.md: no traceback); it is an error naming the
    folder and the kernel's reason, the model the folder held kept whole."""
    import resource

    directory, want = models["lightgbm"]
    kept = _copy(directory, tmp_path / "kept")
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    other = load(models["hgb"][0])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # Python ignores SIGXFSZ: a write gets EFBIG
    try:
        with pytest.raises(CachelabError, match=r"kept: the model could not be written \(.*File too large"):
            save(other, kept)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    np.testing.assert_array_equal(load(kept).predictor.predict(_x()), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_a_model_is_never_saved_over_other_files(models, tmp_path):
    """`cachelab train --out` a table build's folder overwrote its manifest.json (the tables lost)
    and sealed every file it found, the tables included, into the model; refused now, before the
    training, naming the folder."""
    from typer.testing import CliRunner

    from cachelab.cli import app
    from cachelab.store import build_tables

    tables = tmp_path / "tables"
    build_tables("deepseek-v4.1-flash", 1e-5, tables, progress=False)
    before = {p.name: p.read_bytes() for p in tables.iterdir()}
    res = CliRunner().invoke(app, ["train", "--trace", str(tmp_path / "not-yet.npz"), "--out", str(tables)])
    assert res.exit_code == 2 and (f"--out {tables}: holds files that are not a cachelab model (.build.lock, "
                                   "layer1.tbl, layer14.tbl, manifest.json)") in res.output, res.output
    with pytest.raises(CachelabError, match="holds files that are not a cachelab model"):
        save(load(models["logistic"][0]), tables)
    assert {p.name: p.read_bytes() for p in tables.iterdir()} == before
    unsealed = _copy(models["logistic"][0], tmp_path / "unsealed")  # saved before manifests, or killed mid-swap by an older cachelab
    (unsealed / MANIFEST).unlink()
    save(load(models["logistic"][0]), unsealed)  # its own folder: replaced, not refused
    np.testing.assert_array_equal(load(unsealed).predictor.predict(_x()), models["logistic"][1])


BROKEN = {  # a predictor plug-in whose own dependency is not installed
    "brokenpred/__init__.py": "import a_dependency_not_installed\n",
    "cachelab_brokenpred-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-brokenpred\nVersion: 0.1\n",
    "cachelab_brokenpred-0.1.dist-info/entry_points.txt": "[cachelab.predictors]\nbroken = brokenpred:Broken\n",
}


def test_a_model_whose_predictor_plug_in_fails_to_load_names_the_model_and_the_plug_in(models, tmp_path, monkeypatch):
    """The plug-in's import error was named, but not the model that named it (a folder given to
    evaluate, simulate --model or serve --model)."""
    from experiment_helpers import install_site

    install_site(tmp_path, BROKEN, monkeypatch)
    registry.discover.cache_clear()
    try:
        d = _copy(models["hgb"][0], tmp_path / "m")
        _craft_metadata(d, lambda m: {**m, "predictor": "broken"})
        with pytest.raises(CachelabError) as exc:
            load(d)
    finally:
        registry.discover.cache_clear()
    message = str(exc.value)
    assert message.startswith(f"{d / 'metadata.json'}: predictor: plug-in 'broken'"), message
    assert "cachelab-brokenpred 0.1" in message and "No module named 'a_dependency_not_installed'" in message


@pytest.mark.parametrize("exchange", [True, False])
def test_a_save_cut_at_any_step_leaves_the_old_model_or_the_new_one(models, tmp_path, monkeypatch, exchange):
    """``install`` deleted the old manifest, then moved the new files in one by one: Ctrl-C or a
    kill between the steps left a folder with no model at all. Cut before and after each rename,
    unlink or exchange in turn (the folders exchanged in one call, or renamed aside where a file
    system cannot exchange), the folder holds the old model whole or the new one, nothing beside it."""
    import os

    from cachelab.learning import predictor as module

    real = {"replace": os.replace, "rename": os.rename, "unlink": Path.unlink,
            "exchange": getattr(module, "_exchange", lambda a, b: False)}
    if not exchange:
        real["exchange"] = lambda a, b: False
    other = load(models["hgb"][0])
    kept = tmp_path / "kept"
    for cut in range(1, 80):
        shutil.rmtree(kept, ignore_errors=True)
        _copy(models["lightgbm"][0], kept)
        steps = [0]

        def counted(name):
            def call(*args, **kwargs):
                for when in ("before", "after"):
                    steps[0] += 1
                    if steps[0] == cut:
                        raise KeyboardInterrupt
                    if when == "before":
                        result = real[name](*args, **kwargs)
                return result
            return call

        with monkeypatch.context() as patch:
            for name in ("replace", "rename"):
                patch.setattr(os, name, counted(name))
            patch.setattr(Path, "unlink", counted("unlink"))
            patch.setattr(module, "_exchange", counted("exchange"), raising=False)
            try:
                save(other, kept)
                finished = True
            except KeyboardInterrupt:
                finished = False
        predicted = load(kept).predictor.predict(_x())
        if finished or not np.array_equal(predicted, models["lightgbm"][1]):
            np.testing.assert_array_equal(predicted, models["hgb"][1])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"], cut
        if finished:
            break
    assert finished and cut > 2
    umask = os.umask(0o22)
    os.umask(umask)
    fresh = save(other, tmp_path / "fresh")  # a new folder has the umask's mode, not the scratch folder's 0700
    assert oct(fresh.stat().st_mode & 0o777) == oct(0o777 & ~umask)
    assert kept.stat().st_mode == models["lightgbm"][0].stat().st_mode  # a replaced one keeps its own
    (tmp_path / "link").symlink_to(fresh)
    save(load(models["lightgbm"][0]), tmp_path / "link")  # a link to a model folder stays a link
    assert (tmp_path / "link").is_symlink()
    np.testing.assert_array_equal(load(fresh).predictor.predict(_x()), models["lightgbm"][1])


# --- a model read while another is installed over it ------------------------------------------


def _another_lightgbm(models, tmp_path) -> tuple[Model, Path]:
    """A second lightgbm model (other trees, prior and horizon) sealed in a scratch folder beside
    ``models``' first, as ``save`` leaves one before ``install`` puts it in place."""
    first = load(models["lightgbm"][0])
    x = _x(1500, seed=7)
    fitted = type(first.predictor)(**PREDICTORS["lightgbm"]).fit(x, np.abs(x[:, 2]), list(FEATURE_NAMES))
    prior = CorpusPrior(np.arange(50, dtype=np.int64)[::-1].copy(), np.array([1, 4], np.int64),
                        np.array([8, 9], np.int64))
    other = Model(fitted, prior, ["chat"], 128, {"spec": {"horizon": 128, "domains": ["chat"]}})
    scratch = tmp_path / ".m.next"
    scratch.mkdir()
    from cachelab.learning.predictor import write_tensors

    write_tensors(scratch / PRIOR, prior.tensors())
    fitted.save(scratch, {**other.metadata["spec"], "prior": PRIOR})
    return other, scratch


def test_a_model_read_while_another_is_installed_is_one_of_them_whole(models, tmp_path, monkeypatch):
    """``load`` read the metadata, then the predictor read its weights and the prior by path: a
    ``predictor install`` (or a train's save) between the two reads gave the metadata of one model
    (its horizon, its promote, its size) with the trees and prior of the other, and nothing noticed.
    The swap is made as the predictor starts to read its weights."""
    from cachelab.learning.predictor import install

    d = _copy(models["lightgbm"][0], tmp_path / "m")
    before = load(d)
    other, scratch = _another_lightgbm(models, tmp_path)
    cls = type(before.predictor)
    real = cls.load_model.__func__

    def swapped_first(c, directory, metadata):
        if scratch.exists():
            install(scratch, d)
        return real(c, directory, metadata)

    monkeypatch.setattr(cls, "load_model", classmethod(swapped_first))
    read = load(d)
    assert read.horizon == 64 and read.domains == ["code"]  # the first model's metadata ...
    np.testing.assert_array_equal(read.predictor.predict(_x()), models["lightgbm"][1])  # ... with its trees
    for name, tensor in before.prior.tensors().items():  # ... and its prior
        np.testing.assert_array_equal(read.prior.tensors()[name], tensor)
    assert not scratch.exists() and load(d).horizon == 128  # the swap happened: the next read is the other model
    np.testing.assert_array_equal(load(d).predictor.predict(_x()), other.predictor.predict(_x()))


def test_a_model_removed_while_its_files_are_read_is_read_again_as_the_new_one(models, tmp_path, monkeypatch):
    """The folder read is the one opened: where ``install`` exchanged it and removed the old model
    while its files were being read, the reader starts again from the path, on the new model."""
    from cachelab.learning import predictor as module

    d = _copy(models["lightgbm"][0], tmp_path / "m")
    other, scratch = _another_lightgbm(models, tmp_path)
    real, opened = module._open_in, []

    def install_midway(fd, directory, name):
        opened.append(name)
        if len(opened) == 3:  # metadata and manifest opened: the old model goes before its files are read
            module.install(scratch, d)
        return real(fd, directory, name)

    monkeypatch.setattr(module, "_open_in", install_midway)
    read = load(d)
    assert read.horizon == 128 and read.domains == ["chat"]
    np.testing.assert_array_equal(read.predictor.predict(_x()), other.predictor.predict(_x()))
    assert opened.count(MANIFEST) == 2  # read twice: the first model's, removed midway, then the second's
