"""Tree ensembles as flat arrays, evaluated by one compiled loop.

LightGBM's and scikit-learn's HistGradientBoosting models both reduce to binary trees whose
internal nodes test ``x[feature] <= threshold``. Flattened into arrays (``feature``,
``threshold``, ``left``, ``right``, ``value``; a leaf has ``left == -1``), a model is saved
without pickle (safetensors) and scored in batches by a Numba loop several times faster than
the libraries' own per-call overhead allows on small batches. Features never hold NaN here
(``cachelab.learning.features`` encodes "never" as a large value), so missing-value routing is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np


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

    def tensors(self) -> dict[str, np.ndarray]:
        return {"feature": self.feature, "threshold": self.threshold, "left": self.left,
                "right": self.right, "value": self.value, "roots": self.roots,
                "base": np.array([self.base])}

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray]) -> "FlatForest":
        return cls(t["feature"].astype(np.int32), t["threshold"].astype(np.float64),
                   t["left"].astype(np.int32), t["right"].astype(np.int32),
                   t["value"].astype(np.float64), t["roots"].astype(np.int32), float(t["base"][0]))

    def raw_predict(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(x.shape[0], dtype=np.float64)
        _forest_predict(np.ascontiguousarray(x, dtype=np.float32), self.feature, self.threshold,
                        self.left, self.right, self.value, self.roots, self.base, out)
        return out


@nb.njit(cache=True, nogil=True, parallel=True, boundscheck=False)
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


def from_lightgbm(booster) -> FlatForest:
    """Flatten a LightGBM booster (numerical ``<=`` splits only, which is all we train)."""
    feature, threshold, left, right, value, roots = [], [], [], [], [], []

    def walk(node) -> int:
        idx = len(feature)
        feature.append(0)
        threshold.append(0.0)
        left.append(-1)
        right.append(-1)
        value.append(0.0)
        if "leaf_value" in node:
            value[idx] = node["leaf_value"]
            return idx
        if node.get("decision_type", "<=") != "<=":
            raise ValueError(f"unsupported LightGBM split {node['decision_type']!r}")
        feature[idx] = node["split_feature"]
        threshold[idx] = node["threshold"]
        left[idx] = walk(node["left_child"])
        right[idx] = walk(node["right_child"])
        return idx

    for tree in booster.dump_model()["tree_info"]:
        roots.append(walk(tree["tree_structure"]))
    return FlatForest(np.array(feature, np.int32), np.array(threshold, np.float64),
                      np.array(left, np.int32), np.array(right, np.int32),
                      np.array(value, np.float64), np.array(roots, np.int32))


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
