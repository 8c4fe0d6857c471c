"""Tree ensembles as flat arrays, evaluated by one compiled loop.

LightGBM's and scikit-learn's HistGradientBoosting models both reduce to binary trees whose
internal nodes test ``x[feature] <= threshold``. Flattened into arrays (``feature``,
``threshold``, ``left``, ``right``, ``value``; a leaf has ``left == -1``), a model is saved
without pickle (safetensors) and scored in batches by a Numba loop several times faster than
the libraries' own per-call overhead allows on small batches. Features never hold NaN here
(``cachelab.learning.features`` encodes "never" as a large value), so missing-value routing is not needed.

A forest of up to ``COMPILED_NODES`` nodes is also compiled to code, treelite-style: each node
an ``if x[i, f] <= t`` of its own with the threshold and leaf values as constants (``compiled``).
Every node then has its own branch, which the CPU predicts from that node's history, where the
loop's one shared branch mispredicts about once per node: 7 times faster on the 30 x 15 keep
model (docs/learned.md), and bit-identical (the same comparisons, the trees summed in the same
order). The generated module is written once per forest into the cache directory, named by
the SHA-256 of its source, and Numba caches its machine code beside it.

The loop runs without bounds checks, so a forest is checked once when it is built
(``FlatForest.check``): every child index lies after its parent and inside the arrays (so no
walk can cycle or leave them), every split's feature is a column the model was trained on,
and the arrays agree in shape. LightGBM's text model is read by ``from_lightgbm_text``, a
strict parser of its own, so no native loader ever reads a model file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import numba as nb
import numpy as np

from cachelab.compiled import serial_and_parallel
from cachelab.errors import CachelabError

INT32 = np.iinfo(np.int32)
COMPILED_NODES = 4096  # larger forests take the loop: compiling their code would take minutes
COMPILE_ROWS = 1 << 20  # a batch this large pays for compiling a new forest's code (seconds, once)
PARALLEL_WALKS = 1 << 20  # rows x trees under which the loop runs on one thread (a live decode step's rows)


@dataclass(slots=True)
class FlatForest:
    """Trees concatenated: ``roots[t]`` is the first node of tree ``t``; child indices are global."""

    feature: np.ndarray    # int32
    threshold: np.ndarray  # float64
    left: np.ndarray       # int32, -1 at a leaf
    right: np.ndarray      # int32
    value: np.ndarray      # float64 (leaf output)
    roots: np.ndarray      # int32
    base: float = 0.0      # added to the sum of the trees
    width: int = field(init=False, default=0)  # the columns a feature matrix needs
    _code: object = field(init=False, default=None, repr=False)  # ``compiled()``, once
    _path: object = field(init=False, default=None, repr=False)  # ``_module_path()``, once

    def __post_init__(self):
        internal = self.left >= 0
        if internal.shape == self.feature.shape and internal.any():  # else ``check`` refuses the shapes
            self.width = int(self.feature[internal].max()) + 1

    def tensors(self) -> dict[str, np.ndarray]:
        return {"feature": self.feature, "threshold": self.threshold, "left": self.left,
                "right": self.right, "value": self.value, "roots": self.roots,
                "base": np.array([self.base])}

    def check(self, num_features: int, where: str) -> "FlatForest":
        """Refuse, naming ``where``, a forest the unchecked loop could not walk safely; return it."""
        n = self.feature.size
        if any(a.ndim != 1 or a.size != n for a in (self.threshold, self.left, self.right, self.value)):
            raise CachelabError(f"{where}: feature, threshold, left, right and value must be arrays of one length")
        if n == 0 or self.roots.ndim != 1 or self.roots.size == 0:
            raise CachelabError(f"{where}: the forest has no nodes or no trees")
        if ((self.roots < 0) | (self.roots >= n)).any():
            raise CachelabError(f"{where}: a tree root lies outside the {n} nodes")
        node = np.arange(n)
        internal = self.left >= 0
        bad = (self.left < -1) | (internal & ((self.left <= node) | (self.left >= n) | (self.right <= node)
                                              | (self.right >= n)))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CachelabError(f"{where}: node {i} has children {self.left[i]} and {self.right[i]}; a child must "
                                f"lie after its node and inside the {n} nodes (else a walk could cycle)")
        if ((self.feature < 0) | (self.feature >= num_features))[internal].any():
            raise CachelabError(f"{where}: a split tests a feature outside the model's {num_features} features")
        if np.isnan(self.threshold[internal]).any() or not np.isfinite(self.value[~internal]).all() \
                or not np.isfinite(self.base):
            raise CachelabError(f"{where}: a threshold is NaN or a leaf value or the base is not finite")
        return self

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray], num_features: int, where: str) -> "FlatForest":
        """A forest from ``tensors()``'s arrays, checked (``check``) before the loop may walk it."""
        ints = {}
        for name in ("feature", "left", "right", "roots"):
            a = t[name]
            if a.dtype.kind not in "iu" or (a.size and (a.min() < INT32.min or a.max() > INT32.max)):
                raise CachelabError(f"{where}: tensor {name!r} must hold 32-bit integers")
            ints[name] = a.astype(np.int32)
        if t["base"].shape != (1,):
            raise CachelabError(f"{where}: tensor 'base' must hold one number")
        return cls(ints["feature"], t["threshold"].astype(np.float64), ints["left"], ints["right"],
                   t["value"].astype(np.float64), ints["roots"], float(t["base"][0])).check(num_features, where)

    def raw_predict(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] < self.width:
            raise CachelabError(f"the forest needs a feature matrix of {self.width} columns, got shape {x.shape}")
        out = np.empty(x.shape[0], dtype=np.float64)
        if self.feature.size <= COMPILED_NODES and (x.shape[0] >= COMPILE_ROWS or self._code is not None
                                                    or self._module_path().exists()):
            self.compiled()(x, out)
        else:
            _forest_predict(x, self.feature, self.threshold, self.left, self.right, self.value, self.roots,
                            self.base, out, work=x.shape[0] * self.roots.size)
        return out

    def source(self) -> str:
        """The forest as a Python module for Numba: one nested ``if`` per tree (module doc)."""
        lines = ["import numba as nb", "import numpy as np", "", "",
                 "@nb.njit(cache=True, nogil=True, boundscheck=False)", "def predict(x, out):",
                 "    for i in range(x.shape[0]):", f"        acc = {_number(self.base)}"]

        def node(k: int, depth: int) -> None:
            pad = "    " * depth
            if self.left[k] < 0:
                lines.append(f"{pad}acc += {_number(self.value[k])}")
                return
            lines.append(f"{pad}if x[i, {int(self.feature[k])}] <= {_number(self.threshold[k])}:")
            node(int(self.left[k]), depth + 1)
            lines.append(f"{pad}else:")
            node(int(self.right[k]), depth + 1)

        for root in self.roots:
            node(int(root), 2)
        lines.append("        out[i] = acc")
        return "\n".join(lines) + "\n"

    def _module_path(self):
        """Where ``source()`` lives in the cache directory, named by its SHA-256."""
        if self._path is None:
            from cachelab.paths import cache_dir

            digest = hashlib.sha256(self.source().encode()).hexdigest()[:24]
            self._path = cache_dir() / "forests" / f"forest_{digest}.py"
        return self._path

    def compiled(self):
        """The compiled ``predict(x, out)`` of ``source()``, from the cache directory (written there
        once, atomically, by whichever process needs it first). A file there that is not this
        forest's source (edited or damaged) is written again before it is run."""
        if self._code is None:
            path = self._module_path()
            if not path.exists() or path.read_text(errors="replace") != self.source():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(self.source())
                os.replace(tmp, path)
            name = f"cachelab_{path.stem}"
            module = sys.modules.get(name)
            if module is None:  # registered, so that Numba's cached machine code finds its module again
                spec = importlib.util.spec_from_file_location(name, path)
                module = sys.modules[name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            self._code = module.predict
        return self._code


def _number(v) -> str:
    """A float64 as exact Python source (``repr`` round-trips; infinities through NumPy)."""
    v = float(v)
    return repr(v) if np.isfinite(v) else ("np.inf" if v > 0 else "-np.inf")


@serial_and_parallel(PARALLEL_WALKS)
def _forest_predict(x, feature, threshold, left, right, value, roots, base, out):
    for i in nb.prange(x.shape[0]):
        acc = base
        for t in range(roots.size):
            node = roots[t]
            while left[node] >= 0:
                if np.float64(x[i, feature[node]]) <= threshold[node]:
                    node = left[node]
                else:
                    node = right[node]
            acc += value[node]
        out[i] = acc


def _numbers(fields: dict, key: str, count: int, kind, where: str) -> list:
    text = fields.get(key, "")
    try:
        values = [kind(v) for v in text.split()]
    except ValueError:
        raise CachelabError(f"{where}: {key}= holds a value that is not a number") from None
    if len(values) != count:
        raise CachelabError(f"{where}: {key}= has {len(values)} values, expected {count}")
    return values


def _lightgbm_tree(fields: dict, offset: int, where: str):
    """One tree's node arrays (internal nodes first, then leaves) and split gains, global from ``offset``."""
    try:
        leaves = int(fields.get("num_leaves", ""))
        categorical = int(fields.get("num_cat", "0"))
    except ValueError:
        raise CachelabError(f"{where}: num_leaves= or num_cat= is not an integer") from None
    if not 1 <= leaves <= INT32.max // 4 or categorical != 0:
        raise CachelabError(f"{where}: num_leaves={leaves} num_cat={categorical}; expected a numerical tree")
    inner = leaves - 1
    value = _numbers(fields, "leaf_value", leaves, float, where)
    if inner == 0:
        return [0], [0.0], [-1], [-1], value, [0.0]
    feature = _numbers(fields, "split_feature", inner, int, where)
    threshold = _numbers(fields, "threshold", inner, float, where)
    decision = _numbers(fields, "decision_type", inner, int, where)
    gain = _numbers(fields, "split_gain", inner, float, where)
    if any(d & 1 or (d >> 2) & 3 == 1 for d in decision):  # categorical, or zero taken as missing
        raise CachelabError(f"{where}: a split is categorical or treats zero as missing; only numerical <= splits "
                            "are supported")

    def child(c: int) -> int:
        if not -leaves <= c < inner:
            raise CachelabError(f"{where}: child index {c} outside the tree's {inner} nodes and {leaves} leaves")
        return offset + (c if c >= 0 else inner + ~c)

    left = [child(c) for c in _numbers(fields, "left_child", inner, int, where)]
    right = [child(c) for c in _numbers(fields, "right_child", inner, int, where)]
    return (feature + [0] * leaves, threshold + [0.0] * leaves, left + [-1] * leaves, right + [-1] * leaves,
            [0.0] * inner + value, gain + [0.0] * leaves)


def from_lightgbm_text(text: str, where: str = "LightGBM model") -> tuple[FlatForest, np.ndarray, int]:
    """Read LightGBM's text model (``Booster.model_to_string``) in Python: the checked forest,
    each node's split gain (0 at a leaf) and the feature count. Refuses, naming ``where`` and the
    tree, what LightGBM would not have written for a numerical model."""
    head, _, rest = text.partition("\nTree=")
    header = dict(line.split("=", 1) for line in head.splitlines() if "=" in line)
    try:
        num_features = int(header.get("max_feature_idx", "")) + 1
    except ValueError:
        raise CachelabError(f"{where}: no max_feature_idx= line; not a LightGBM text model") from None
    if "average_output" in head.split() or header.get("num_tree_per_iteration", "1") != "1":
        raise CachelabError(f"{where}: averaged or multi-class models are not supported")
    if not rest or "\nend of trees" not in rest:
        raise CachelabError(f"{where}: no trees, or no 'end of trees' line (a truncated file)")
    trees = ("Tree=" + rest).split("\nend of trees")[0].split("\nTree=")
    cols = [[] for _ in range(6)]
    roots = []
    for t, block in enumerate(trees):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        roots.append(len(cols[0]))
        for col, part in zip(cols, _lightgbm_tree(fields, len(cols[0]), f"{where}, tree {t}")):
            col.extend(part)
    forest = FlatForest(np.array(cols[0], np.int32), np.array(cols[1], np.float64), np.array(cols[2], np.int32),
                        np.array(cols[3], np.int32), np.array(cols[4], np.float64), np.array(roots, np.int32))
    return forest.check(num_features, where), np.array(cols[5], np.float64), num_features


def from_hist_gradient_boosting(model) -> FlatForest:
    """Flatten a fitted scikit-learn HistGradientBoosting{Regressor,Classifier} (binary)."""
    parts, roots, offset = [], [], 0
    for (predictor,) in model._predictors:
        nodes = predictor.nodes
        n = nodes.size
        leaf = nodes["is_leaf"].astype(bool)
        left = np.where(leaf, -1, nodes["left"].astype(np.int64) + offset)
        right = np.where(leaf, -1, nodes["right"].astype(np.int64) + offset)
        parts.append((nodes["feature_idx"], nodes["num_threshold"], left, right, nodes["value"]))
        roots.append(offset)
        offset += n
    cols = [np.concatenate([p[i] for p in parts]) for i in range(5)]
    base = float(np.ravel(model._baseline_prediction)[0])
    return FlatForest(cols[0].astype(np.int32), cols[1].astype(np.float64), cols[2].astype(np.int32),
                      cols[3].astype(np.int32), cols[4].astype(np.float64), np.array(roots, np.int32), base)
