"""Causal training, saving, loading and batch scoring of hotness predictors.

The split never lets a model see the future of what it scores. A stream's first
``train_fraction`` of lookups is the training window; its first half only feeds the corpus
prior (token and row frequencies), so the training samples, from the second half, see the
prior exactly as later lookups will: as a past they are not part of. A training sample's label
must be settled inside the window, so samples end ``horizon`` lookups before the window does.
Validation is the rest of the stream.

Three label kinds: the regression predictors learn ``log1p`` of the lookups to the next
access; a classifier learns reuse within the horizon, or, with ``capacity`` set, whether
the offline optimum at that cache size keeps the row until its next use (a model for one
cache size; docs/learned.md).

Scores handed to the learned policies are predicted *positions* of the next access,
negated (higher = keep): ``-(t + expm1(predicted log1p gap))`` for a regressor, and
``-(t + horizon * (1 - p))`` for a reuse classifier (probability ``p`` of reuse within the
horizon read as an expected wait).
"""

from __future__ import annotations

import hashlib
import inspect
import math
import numbers
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from cachelab import registry
from cachelab.capacity import capacity_rows, parse_capacity
from cachelab.defaults import HORIZON, MAX_SAMPLES, TRAIN_FRACTION
from cachelab.engram.config import preset_flag
from cachelab.errors import CachelabError
from cachelab.learning.lineup import lineup, tuned_params
from cachelab.learning.streams import LearningView, layout_differences
from cachelab.learning.predictor import (METADATA, Predictor, check_features, install, load_predictor, model_folder,
                                         read_metadata, read_sealed, read_tensors, write_tensors)
from cachelab.params import check_params
from cachelab.learning.features import (FEATURE_NAMES, PRIOR_TENSORS, CorpusPrior, FeatureState, apply_prior, belady_labels, extract,
                                 prompt_lookahead, regression_labels, reuse_labels)

PRIOR = "prior.safetensors"
HEX = "0123456789abcdef"
CHUNK = 1 << 20  # entries featurised and scored together (a 104 MB feature matrix, not the stream's)


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """How a model is trained (recorded in its metadata.json)."""

    horizon: int = HORIZON
    train_fraction: float = TRAIN_FRACTION
    max_samples: int = MAX_SAMPLES
    seed: int = 0
    capacity: float | str = 0.0  # set: Belady keep labels at this cache size (cachelab.capacity; ``window_rows``)
    lookahead: bool = True  # the prompt-lookahead features (cachelab.learning.features)

    def check(self) -> None:
        for name in ("horizon", "max_samples", "seed"):  # 4096.5, or even 4096.0, failed deep in the sampling
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise CachelabError(f"TrainSpec.{name} must be an integer, got {value!r}")
        if self.capacity:
            parse_capacity(self.capacity, "capacity")
        if not 0.0 < self.train_fraction < 1.0:
            raise CachelabError(f"train_fraction must lie in (0, 1), got {self.train_fraction}")
        if self.horizon < 1:
            raise CachelabError(f"horizon must be at least 1 lookup, got {self.horizon}")
        if self.max_samples < 1:
            raise CachelabError(f"max_samples must be at least 1 training sample, got {self.max_samples}")
        if self.seed < 0:
            raise CachelabError(f"seed must be a whole number >= 0, got {self.seed}")


def rows_for(capacity: float | str, unique: int) -> int:
    """A capacity (``cachelab.capacity``: rows, a fraction or percentage of the unique rows) as rows."""
    return capacity_rows(capacity, unique_rows=unique, where="capacity")


def window_rows(capacity: float | str, keys: np.ndarray) -> int:
    """A keep model's capacity as rows of the training window whose entries are ``keys``: a share
    counts the distinct rows there, all a model fitted on them may see, not the whole stream's (those
    of the part it is validated and judged on too), as ``evaluate`` counts those of the stream it replays."""
    return rows_for(capacity, int(np.unique(keys).size))


def check_target(task: str, spec: TrainSpec) -> None:
    """Belady keep labels are yes/no: refuse them for a regression predictor."""
    if spec.capacity and task == "regression":
        raise CachelabError("Belady keep labels (a capacity) need a classifier, e.g. --predictor lightgbm-reuse; "
                            "a regression predictor learns the time to the next access")


def labels(view, lo: int, hi: int, task: str, spec: TrainSpec) -> np.ndarray:
    """The labels of entries ``[lo, hi)`` from their future inside that window only."""
    check_target(task, spec)
    keys = view.keys[lo:hi]
    if task == "regression":
        return regression_labels(keys, spec.horizon)
    if spec.capacity:
        return belady_labels(keys, np.array([0, keys.size]), window_rows(spec.capacity, keys), view.num_keys)
    return reuse_labels(keys, spec.horizon)


@dataclass(slots=True)
class Model:
    """A fitted predictor with what scoring needs beside it."""

    predictor: Predictor
    prior: CorpusPrior
    domains: list[str]
    horizon: int
    metadata: dict
    lookahead: bool = True


def features(stream, model_prior: CorpusPrior, domains: list[str], lookahead: bool = True) -> np.ndarray:
    """The feature matrix of a whole stream, from an empty history."""
    state = FeatureState(stream.num_keys)
    return extract(stream, 0, len(stream), state, model_prior, domains, lookahead)


def window_digest(view, end: int) -> str:
    """A digest of a view's first ``end`` entries (their rows' global keys and the step bounds up
    to there): a model keeps its training window's, so an evaluation can tell that the stream it
    judges starts with what the model learned from (``trained_through``)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(view.raw_keys[view.keys[:end]], dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(view.step_offsets[view.step_offsets <= end], dtype=np.int64).tobytes())
    return digest.hexdigest()


def trained_through(view, model: Model) -> int:
    """The first step of ``view`` past ``model``'s training window where the view starts with that
    window (its ``train_digest``), else 0: a model judged on the stream it was trained on from the
    warm-up alone would be scored on lookups it learned from wherever its window ends later."""
    spec = model.metadata.get("spec", {})
    end, digest = spec.get("train_end"), spec.get("train_digest")
    if digest is None or end is None or not 0 < int(end) <= len(view) or window_digest(view, int(end)) != digest:
        return 0
    return int(np.searchsorted(view.step_offsets, int(end)))


def trained_requests(view, model: Model, trained: int) -> np.ndarray:
    """Per request id of ``view``: whether it repeats a request of ``model``'s training window (the
    same tokens, ``LearningView.content``) without being that window's own (``trained``, from
    ``trained_through``, is 0: the view does not start with the window). Such a request, in another
    order (``--seed``) or a longer or other stream, is one the model learned from; where the view
    starts with the window, a later repeat is a request served again after it, as in serving."""
    seen = model.metadata.get("spec", {}).get("train_requests")
    if trained or not seen or view.content is None:
        return np.zeros(0 if view.content is None else view.content.size, dtype=bool)
    return np.isin(view.content, np.array([int(d, 16) for d in seen], dtype=np.uint64))


def train(stream, predictor: Predictor, spec: TrainSpec, progress=None, tune: bool = True) -> tuple[Model, dict]:
    """Fit ``predictor`` on the training window of ``stream``; return the model and validation metrics.

    A model of Belady's keep decisions (``spec.capacity``) also gets the parameters learned
    policies declare in ``tuned_params`` (``promote`` of the built-ins), tuned on the training
    window alone (``tune_params``): each value lands under its parameter's name in the
    metadata's spec and in the metrics, its miss ratios under ``<name>_misses``.
    """
    spec.check()
    check_target(predictor.task, spec)
    n = len(stream)
    end = window_end(stream, spec)
    prior_end = end // 2
    # the window's domains: one first met after it is one the model never saw (-1), and moves no code of theirs
    domains = [stream.domains[int(code)] for code in np.unique(stream.domain[:end])]
    prior = CorpusPrior.from_window(stream, 0, prior_end)
    x = features(stream, prior, domains, spec.lookahead)
    samples = fit_window(stream, x, 0, end, predictor, spec, progress)
    meta_spec = {**asdict(spec), "train_end": end, "train_digest": window_digest(stream, end), "prior_end": prior_end,
                 "lookups": n, "domains": domains, "train_samples": samples,
                 "train_requests": stream.contents(0, end), "train_prompts": stream.prompts(0, end)}
    if stream.layout is not None:
        meta_spec["layout"] = stream.layout
    sized = spec  # a keep model is judged against Belady at the size its labels were made at
    if spec.capacity:
        meta_spec["capacity_rows"] = window_rows(spec.capacity, stream.keys[:end])
        sized = replace(spec, capacity=meta_spec["capacity_rows"])
    model = Model(predictor, prior, domains, spec.horizon, {"spec": meta_spec}, spec.lookahead)
    metrics = validate(model, stream, x, end, sized)
    if spec.capacity and tune:
        chosen, tried = tune_params(stream, type(predictor)(**predictor.get_params()), spec, end)
        meta_spec.update(chosen)
        metrics.update({**{f"{param}_misses": misses for param, misses in tried.items()}, **chosen})
    return model, metrics


def window_end(view, spec: TrainSpec) -> int:
    """The end of the training window of ``view`` (a ``LearningView``): its first ``train_fraction``
    of entries, rounded up to a step; refused where the horizon leaves no training sample or
    too little to validate on after the window."""
    n = len(view)
    end = int(view.step_offsets[np.searchsorted(view.step_offsets, int(n * spec.train_fraction))])
    if end - spec.horizon <= end // 2:
        raise CachelabError(f"training window of {end} lookups is too short for horizon {spec.horizon} "
                            f"(needs more than {2 * spec.horizon}); lower the horizon or use a longer trace")
    _validation_part(n - end, spec.horizon)
    return end


def _validation_part(lookups: int, horizon: int) -> int:
    """How many of the ``lookups`` after the training window are validated (their labels settle
    within the stream), refused when under 100."""
    if lookups - horizon < 100:
        raise CachelabError(f"validation part of {lookups:,} lookups after the training window leaves "
                            f"{max(lookups - horizon, 0):,} whose labels settle within the stream (its last "
                            f"horizon of {horizon:,} lookups cannot be labelled), fewer than 100: lower the horizon "
                            "or the train fraction, or use a longer trace")
    return lookups - horizon


def _declared_grids() -> dict[str, dict[str, tuple]]:
    """Each declaring policy's ``tuned_params``; a parameter two policies declare is refused."""
    grids = tuned_params(lineup())
    names = list(grids)
    clash = sorted({p for i, a in enumerate(names) for b in names[i + 1:] for p in set(grids[a]) & set(grids[b])})
    if clash:
        raise CachelabError(f"several learned policies declare tuned_params {clash}; a model holds one value each")
    return grids


def tune_params(view, predictor: Predictor, spec: TrainSpec, end: int) -> tuple[dict[str, float], dict[str, dict]]:
    """The declared ``tuned_params``, chosen without looking past the training window ``[0, end)``.

    ``predictor`` is fitted on the window's first half (as ``train`` would with half the
    fraction) and scores the second half; the declaring policy replays the window at each
    value of a parameter's grid (its other parameters from that model; the first half, where the
    model's scores are in-sample, without them: ``out_of_sample``), and the fewest misses
    per lookup in the second half win, as an evaluation counts them (a fetch stands for its
    step's lookups of the row). Returns the values and the miss ratio at each value, by parameter
    (no miss ratios, and the policy's defaults, if the half window is too short for the
    horizon). The cache, and the half model's labels, are of the model's size (``window_rows``). A
    subclass of the declaring policy gets the value by name (``policy_params``).
    """
    grids = _declared_grids()
    classes = {name: registry.get(registry.POLICIES, name) for name in grids}
    capacity = window_rows(spec.capacity, view.keys[:end])  # the half model is one for this size too
    try:
        model, _ = train(view, predictor, replace(spec, train_fraction=spec.train_fraction / 2, capacity=capacity),
                         tune=False)
    except CachelabError:
        return ({param: float(inspect.signature(classes[name]).parameters[param].default)
                 for name, params in grids.items() for param in params},
                {param: {} for params in grids.values() for param in params})
    start = int(model.metadata["spec"]["train_end"])
    # the half model's own window gets no scores: they are in-sample there, and would build the cache
    # the judged half meets (evaluate's "In-sample warm-up")
    scores = out_of_sample(model, keep_scores(model, view)[:end], np.arange(end) < start)
    lookups = np.bincount(view.inverse, minlength=len(view))[:end]  # each fetch's lookups in its step
    judged = lookups[start:]
    chosen, tried = {}, {}
    for name, params in grids.items():
        cls = classes[name]
        for param, grid in params.items():
            misses = {}
            for value in grid:
                policy = cls(**{**policy_params(cls, model), param: value})
                hits = view.replay(policy, capacity, scores, lookups, end)
                misses[str(value)] = float(1.0 - judged[hits[start:]].sum() / judged.sum())
            chosen[param], tried[param] = float(min(misses, key=misses.get)), misses
    return chosen, tried


def tune_promote(view, predictor: Predictor, spec: TrainSpec, end: int) -> tuple[float, dict]:
    """``tune_params`` for ``promote`` alone: the threshold and the miss ratio at each value."""
    chosen, tried = tune_params(view, predictor, spec, end)
    return chosen["promote"], tried["promote"]


def fit_window(view, x: np.ndarray, lo: int, hi: int, predictor: Predictor, spec: TrainSpec,
               progress=None) -> int:
    """Fit on entries ``[lo, hi)`` only: the first half feeds the prior already in ``x``, the
    second half gives samples whose labels settle before ``hi``. Returns the sample count."""
    mid = (lo + hi) // 2
    y = labels(view, lo, hi, predictor.task, spec)
    idx = np.arange(mid, hi - spec.horizon)
    if idx.size > spec.max_samples:
        idx = np.sort(np.random.default_rng(spec.seed).choice(idx, spec.max_samples, replace=False))
    if progress:
        progress(f"fitting {predictor.name} on {idx.size:,} lookups")
    predictor.fit(x[idx], y[idx - lo], list(FEATURE_NAMES))
    return int(idx.size)


def rolling_scores(view, make_predictor, spec: TrainSpec, every: int, window: int) -> np.ndarray:
    """Keep-scores with periodic retraining as the trace streams.

    Block ``[s, s + every)`` is scored by a model fitted on ``[s - window, s)`` alone (its prior
    from that window's first half), so no model sees the future of what it scores. Entries
    before the first full window get a neutral score (every row due one horizon after its
    access, which makes the learned policy recency-ordered).
    """
    if window <= 2 * spec.horizon:
        raise CachelabError(f"retraining window of {window} lookups must exceed twice the horizon {spec.horizon}")
    if every < 1:
        raise CachelabError(f"retrain interval must be at least 1 lookup, got {every}")
    n = len(view)
    if window >= n:  # no block would be scored by a model: every score neutral, judged as if retrained
        raise CachelabError(f"retraining window of {window:,} lookups leaves nothing of this {n:,}-lookup stream "
                            "to score with a retrained model (each block is scored by a model of the window before "
                            "it); give a shorter retraining window (evaluate: --retrain-window)")
    empty = CorpusPrior(np.zeros(view.vocab, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    x = features(view, empty, list(view.domains), spec.lookahead)
    scores = neutral_scores(n, spec.horizon)
    for start in range(window, n, every):
        stop = min(start + every, n)
        lo = start - window
        prior = CorpusPrior.from_window(view, lo, (lo + start) // 2)
        apply_prior(view, lo, start, prior, x[lo:start])
        predictor = make_predictor()
        fit_window(view, x, lo, start, predictor, spec)
        apply_prior(view, start, stop, prior, x[start:stop])
        model = Model(predictor, prior, list(view.domains), spec.horizon, {}, spec.lookahead)
        scores[start:stop] = keep_scores(model, view, x[start:stop], offset=start)
    return scores


def validate(model: Model, stream, x: np.ndarray, start: int, spec: TrainSpec | None = None) -> dict:
    """Metrics on lookups after ``start`` whose labels are settled within the stream.

    ``auc`` is against reuse within the horizon; with Belady keep labels, ``auc_belady``
    is against Belady's decisions on the whole stream at ``spec``'s capacity (what the classifier
    imitates: ``train`` gives the rows its labels were made at). An AUC
    whose labels are all one class is undefined: NaN (null in JSON), the key kept for scripts."""
    from sklearn.metrics import roc_auc_score

    keys = stream.keys[start:]
    stop = _validation_part(keys.size, model.horizon)
    xv = x[start:start + stop]
    pred = predictions(model, xv, start)
    reuse = reuse_labels(keys, model.horizon)[:stop]
    out = {"validation_lookups": int(stop), "reuse_rate": float(reuse.mean())}
    out["auc"] = float(roc_auc_score(reuse, pred)) if len(np.unique(reuse)) == 2 else math.nan
    if spec is not None and spec.capacity:
        kept = labels(stream, 0, len(stream), model.predictor.task, spec)[start:start + stop]
        out["belady_keep_rate"] = float(kept.mean())
        out["auc_belady"] = float(roc_auc_score(kept, pred)) if len(np.unique(kept)) == 2 else math.nan
    if model.predictor.task == "regression":
        y = regression_labels(keys, model.horizon)[:stop]
        out["rmse"] = float(np.sqrt(np.mean((-pred - y) ** 2)))
        out["rmse_constant"] = float(np.std(y))
    importances = getattr(model.predictor, "importances", None)
    if importances is not None:
        out["importances"] = dict(sorted(importances().items(), key=lambda kv: -kv[1]))
    return out


def save(model: Model, directory: Path, extra: dict | None = None) -> Path:
    """Write the prior, then the predictor (whose ``save`` seals the manifest), into a scratch
    folder beside ``directory``, and put it in place by one rename (``predictor.install``): a save that
    fails leaves nothing of itself and the model ``directory`` held as it was (it was written
    file by file over the old one). ``directory`` must be new, empty or a model's."""
    import shutil
    import tempfile

    from safetensors import SafetensorError

    directory = Path(directory)
    model_folder(directory, "model folder")
    directory.parent.mkdir(parents=True, exist_ok=True)
    spec = {**model.metadata["spec"], **(extra or {}), "prior": PRIOR}
    scratch = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial",
                                    dir=directory.resolve().parent))  # where install renames it
    try:
        try:
            write_tensors(scratch / PRIOR, model.prior.tensors())
            model.predictor.save(scratch, spec)
        except (OSError, SafetensorError) as exc:  # a full disk, a file size limit: a traceback before
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CachelabError(f"{directory}: the model could not be written ({reason}); nothing of it was "
                                "saved, and the folder holds what it held") from None
        install(scratch, directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def _scoring_spec(spec: dict, where: Path) -> tuple[int, list[str], bool]:
    """The horizon, domains and lookahead flag a model's metadata spec holds, type-checked."""
    default = TrainSpec()
    horizon = spec.get("horizon", default.horizon)
    domains = spec.get("domains", [])
    lookahead = spec.get("lookahead", default.lookahead)
    if type(horizon) is not int or horizon < 1:
        raise CachelabError(f"{where}: spec.horizon must be a whole number of lookups >= 1, got {horizon!r:.80}")
    if not isinstance(domains, list) or not all(isinstance(d, str) for d in domains):
        raise CachelabError(f"{where}: spec.domains must be a list of domain names, got {domains!r:.80}")
    if not isinstance(lookahead, bool):
        raise CachelabError(f"{where}: spec.lookahead must be true or false, got {lookahead!r:.80}")
    for key in ("train_requests", "train_prompts"):
        seen = spec.get(key, [])
        if not isinstance(seen, list) or not all(isinstance(d, str) and len(d) == 16 and set(d) <= set(HEX)
                                                 for d in seen):
            raise CachelabError(f"{where}: spec.{key} must be a list of 16-digit hex request digests, "
                                f"got {seen!r:.80}")
    if spec.get("capacity"):  # a keep model's size, read by every verb that runs it (``keep_size_note``)
        parse_capacity(spec["capacity"], f"{where}: spec.capacity")
        rows = spec.get("capacity_rows", 1)
        if type(rows) is not int or rows < 1:
            raise CachelabError(f"{where}: spec.capacity_rows must be a whole number of rows >= 1, got {rows!r:.80}")
    if not isinstance(spec.get("layout", {}), dict):
        raise CachelabError(f"{where}: spec.layout must be an object (an Engram layout's signature), "
                            f"got {spec['layout']!r:.80}")
    return horizon, domains, lookahead


def check_layout(model: Model, layout: dict | None, rows: str = "") -> None:
    """Refuse to score rows of another Engram layout than the model's training trace (``layout``:
    ``streams.layout_signature`` of the rows to score), naming what differs: its features (layer,
    n-gram order, head) and its prior's row counts would mean other rows. A model saved before
    layouts were recorded, or a hand-built view, is not checked. ``rows`` names where the rows
    live (a store's tables), for the error."""
    trained = model.metadata.get("spec", {}).get("layout")
    if trained is None or layout is None:
        return
    shown = layout_differences(trained, layout)
    if shown and rows:
        raise CachelabError(f"the model was trained on Engram layout {trained.get('name')!r}, but {rows} are of "
                            f"layout {layout['name']!r} (model / tables: {shown}): its scores would rank rows these "
                            "tables do not hold; give tables of the model's layout, or a model trained on theirs")
    if shown:
        raise CachelabError(f"the model was trained on Engram layout {trained.get('name')!r}, these rows are of layout "
                            f"{layout['name']!r} (model / rows: {shown}): score rows of the model's layout "
                            f"(evaluate: {preset_flag(trained.get('name'))}), or train a model on theirs")


def load(directory: Path) -> Model:
    """A saved model, refused with the reason when its manifest, metadata, features or files do
    not match; no file is parsed before its size and SHA-256 match the manifest, and every file is
    read once, all of one model (``read_sealed``)."""
    directory = Path(directory)
    files = read_sealed(directory, required=(METADATA, PRIOR))  # one model's files, whatever is installed meanwhile
    meta = read_metadata(directory, files)
    check_features(meta, list(FEATURE_NAMES), directory)
    name = meta.get("predictor")
    where = directory / METADATA
    try:  # the name is the model's: an uninstalled or broken one said neither the file nor the model
        cls = registry.get(registry.PREDICTORS, name)
    except CachelabError as exc:
        raise CachelabError(f"{where}: predictor: {exc} (the model was trained with it and "
                            "loads only through it)") from None
    check_params(cls, meta.get("params", {}), f"{where}: params")
    try:  # and their ranges (the predictor's constructor), named with the file
        cls(**meta.get("params", {}))
    except (CachelabError, TypeError, ValueError) as exc:
        raise CachelabError(f"{where}: params: {exc}") from None
    horizon, domains, lookahead = _scoring_spec(meta.get("spec", {}), where)
    predictor = load_predictor(cls, {f: data for f, data in files.items() if f != PRIOR}, directory, meta)  # its own
    prior = CorpusPrior.from_tensors(read_tensors(directory / PRIOR, dict.fromkeys(PRIOR_TENSORS, 1), files[PRIOR]),
                                     directory / PRIOR)
    return Model(predictor, prior, domains, horizon, meta, lookahead)


def keep_scores(model: Model, stream, x: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
    """Per-entry scores for the learned policies: minus the predicted next-access position.

    ``x`` holds the features of entries ``offset, offset + 1, ...``; by default the whole
    stream is featurised and scored ``CHUNK`` entries at a time (the feature state carried
    over), so memory holds one chunk's feature matrix, not the stream's.
    """
    check_layout(model, stream.layout)
    if x is None:
        state = FeatureState(stream.num_keys)
        ahead = prompt_lookahead(stream) if model.lookahead else False
        raw = np.empty(len(stream), dtype=np.float64)
        for lo in range(0, len(stream), CHUNK):
            hi = min(lo + CHUNK, len(stream))
            raw[lo:hi] = predictions(model, extract(stream, lo, hi, state, model.prior, model.domains, ahead), lo)
    else:
        raw = np.concatenate([predictions(model, x[i:i + CHUNK], offset + i) for i in range(0, x.shape[0], CHUNK)])
    return as_scores(model, raw, offset)


def neutral_scores(n: int, horizon: int) -> np.ndarray:
    """The scores of ``n`` entries that carry no prediction: each row due one ``horizon`` after its
    access (a keep classifier's chance 0), which leaves a learned policy to its base's own order."""
    return -(np.arange(n, dtype=np.float64) + horizon)


def out_of_sample(model: Model, scores: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """``scores`` with the ``seen`` entries' (those ``model`` learned from) made neutral
    (``neutral_scores``): the model is deployed where its training data ends, as after training on
    served traffic, and the cache it finds was built without it (docs/learned.md, "In-sample warm-up")."""
    return np.where(seen, neutral_scores(seen.size, model.horizon), scores)


def predictions(model: Model, x: np.ndarray, offset: int = 0) -> np.ndarray:
    """The model's predictions for features ``x`` (entries ``offset, offset + 1, ...``), one number
    per row, or an error naming the predictor: a NaN cannot rank rows, and a result of another
    shape would broadcast where scores are made (an ``[n, 1]`` array into an ``[n, n]`` matrix)."""
    raw = model.predictor.predict(x)
    name = getattr(model.predictor, "name", "") or type(model.predictor).__name__
    if np.shape(raw) != (x.shape[0],):
        raise CachelabError(f"predictor {name!r} returned predictions of shape {np.shape(raw)} for {x.shape[0]:,} "
                            f"rows of features; predict must return one number per row, shape ({x.shape[0]},)")
    raw = np.asarray(raw, dtype=np.float64)
    nan = np.isnan(raw)
    if nan.any():
        raise CachelabError(f"predictor {name!r} predicted NaN for {int(nan.sum()):,} of {raw.size:,} entries "
                            f"(the first is entry {offset + int(nan.argmax()):,}); its scores cannot rank rows")
    return raw


def as_scores(model: Model, raw: np.ndarray, offset: int) -> np.ndarray:
    """The predictions of entries ``offset, offset + 1, ...`` as scores: minus the predicted
    next-access position."""
    t = offset + np.arange(raw.size, dtype=np.float64)
    if model.predictor.task == "regression":
        wait = np.expm1(np.clip(-raw, 0.0, None))
    else:
        wait = model.horizon * (1.0 - np.clip(raw, 0.0, 1.0))
    return -(t + wait)


def lookup_scores(model: Path | Model, stream, layout=None) -> tuple[np.ndarray, Model, int]:
    """Scores per lookup of an engine ``LookupStream`` from ``model`` (or the model saved in that
    directory), the model, and the stream's distinct rows (counted on the way: a keep model's
    share of them is its size, ``keep_rows``). The stream is read as the rows of ``layout`` (an
    ``EngramConfig``: the tables a store serves them from), so the model is checked against it; by
    default as the layout the model was trained on."""
    model = model if isinstance(model, Model) else load(model)
    view = LearningView.of(stream, trained_layout(model) if layout is None else layout)
    return view.per_lookup(keep_scores(model, view)), model, view.num_keys


def keep_capacity(model: Model) -> float | str:
    """The cache size a keep model (``train --capacity``) was trained for (``load`` checked it), 0
    for any other model."""
    return model.metadata.get("spec", {}).get("capacity") or 0.0


def keep_rows(model: Model, unique: int | None) -> int | None:
    """A keep model's size in rows: those its labels were made at (``spec.capacity_rows``; a share counted
    its training window's distinct rows, ``window_rows``), whatever the workload it runs on; for a model
    that records none, its share of a workload of ``unique`` distinct rows (None: unknown, a live server's).
    None for another model."""
    capacity = keep_capacity(model)
    if not capacity:
        return None
    rows = model.metadata["spec"].get("capacity_rows")
    return rows_for(capacity, unique) if rows is None and unique is not None else rows


def keep_size_note(model: Model, runs: dict[str, int], unique: int | None) -> str | None:
    """The note every verb running a model gives where a keep model (Belady's keep decisions at one
    cache size) runs at another size: ``runs`` maps each size run, named as the reader wrote it, to its
    rows; ``unique`` as ``keep_rows``. None where each is its own size or it is no keep model. A note,
    never a refusal: a user may mean to run it at another size."""
    rows = keep_rows(model, unique)
    other = [name for name, n in runs.items() if rows is not None and n != rows]
    if not other:
        return None
    recorded = model.metadata["spec"].get("capacity_rows") is not None
    return (f"the model is a keep model for capacity {keep_capacity(model)} ({rows:,} rows "
            f"{'on its training stream' if recorded else 'here'}): at {', '.join(other)} its keep "
            "chances are for another cache size")


def trained_layout(model: Model) -> str:
    """The Engram layout (a preset or layout file) a model was trained on: `train`'s preset, or
    an experiment's workload preset; the default layout for a model that records neither."""
    spec = model.metadata.get("spec", {})
    workload = spec.get("workload")
    return spec.get("preset") or (workload.get("preset") if isinstance(workload, dict) else None) \
        or "deepseek-v4.1-flash"


def policy_params(policy_cls, model: Model) -> dict:
    """What a learned policy takes from its model: the horizon (which turns a classifier's score
    back into a chance) and a tuned promote threshold, each only if the policy has the parameter."""
    takes = inspect.signature(policy_cls).parameters
    params = {"horizon": model.horizon, "promote": model.metadata.get("spec", {}).get("promote")}
    return {k: v for k, v in params.items() if k in takes and v is not None}

