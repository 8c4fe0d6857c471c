"""A small torch MLP regressor of log1p(lookups to next access); weights in safetensors."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.learning import Predictor
from cachelab.learning.predictor import in_range, read_tensors, write_tensors

TENSORS = "model.safetensors"


@contextmanager
def _torch_threads(n: int):
    """Torch's intra-op threads set to ``n`` for a block: how a matrix product is split between
    threads changes its sums' order, so a fit on 1 thread and on 4 differ (by up to 2e-3 in a
    prediction); a fixed count makes the model the same in a one-thread Ray worker and a pool
    worker with every core."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class MLP(Predictor):
    """Two hidden layers on standardised features; ``predict`` is minus the predicted log1p time.
    Fitted and run on ``num_threads`` torch threads, whatever the process's setting, so a seed
    gives one model."""

    name = "mlp"
    task = "regression"

    def __init__(self, hidden: int = 64, epochs: int = 3, batch_size: int = 4096, lr: float = 3e-3,
                 seed: int = 0, num_threads: int = 1):
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise CachelabError(f"mlp: num_threads must be a whole number >= 1, got {num_threads!r}")
        for key, value, low in (("hidden", hidden, 0), ("epochs", epochs, 0), ("batch_size", batch_size, 1)):
            in_range(self.name, key, value, low, whole=True)  # what torch refuses when fitting, no more
        in_range(self.name, "lr", lr, 0)
        self.hidden = hidden
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.seed = seed
        self.num_threads = num_threads

    def _net(self, n_in: int):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(n_in, self.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(self.hidden, self.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(self.hidden, 1))

    def fit(self, features, labels, feature_names):
        with _torch_threads(self.num_threads):
            return self._fit(features, labels, feature_names)

    def _fit(self, features, labels, feature_names):
        import torch

        torch.manual_seed(self.seed)
        x = np.asarray(features, dtype=np.float32)
        self.mean_ = x.mean(axis=0)
        std = x.std(axis=0)
        self.scale_ = np.where(std > 0, std, 1.0).astype(np.float32)
        xt = torch.from_numpy((x - self.mean_) / self.scale_)
        yt = torch.from_numpy(np.asarray(labels, dtype=np.float32))
        self.net_ = self._net(x.shape[1])
        with torch.no_grad():  # start at the labels' mean: a few hundred steps do not climb to log1p(horizon) from 0
            self.net_[-1].bias.fill_(float(yt.mean()))
        opt = torch.optim.Adam(self.net_.parameters(), lr=self.lr)
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epochs):
            for idx in torch.randperm(xt.shape[0], generator=gen).split(self.batch_size):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(self.net_(xt[idx]).squeeze(1), yt[idx])
                loss.backward()
                opt.step()
        self.feature_names_ = list(feature_names)
        return self

    def predict(self, features) -> np.ndarray:
        import torch

        x = (np.asarray(features, dtype=np.float32) - self.mean_) / self.scale_
        with torch.no_grad(), _torch_threads(self.num_threads):
            return -self.net_(torch.from_numpy(x)).squeeze(1).double().numpy()

    def importances(self) -> dict[str, float]:
        """Mean absolute first-layer weight per (standardised) input."""
        w = self.net_[0].weight.detach().abs().mean(dim=0).numpy()
        return {n: float(v) for n, v in zip(self.feature_names_, w / (w.sum() or 1.0))}

    def save_model(self, directory: Path) -> None:
        tensors = {k: v.detach().cpu().numpy() for k, v in self.net_.state_dict().items()}
        write_tensors(Path(directory) / TENSORS, {**tensors, "mean": self.mean_, "scale": self.scale_})

    @classmethod
    def load_model(cls, directory: Path, metadata: dict) -> "MLP":
        import torch

        path = Path(directory) / TENSORS
        t = read_tensors(path, {"mean": 1, "scale": 1})
        width = len(metadata["feature_names"])
        if t["mean"].size != width or t["scale"].size != width:
            raise CachelabError(f"{path}: mean and scale must hold one value per feature ({width})")
        if not all(np.isfinite(v).all() for v in t.values()) or (t["scale"] == 0).any():
            raise CachelabError(f"{path}: a weight is not finite or a scale is zero")
        self = cls(**metadata.get("params", {}))
        self.mean_, self.scale_ = t.pop("mean").astype(np.float32), t.pop("scale").astype(np.float32)
        self.net_ = self._net(width)
        try:
            self.net_.load_state_dict({k: torch.from_numpy(v) for k, v in t.items()})
        except RuntimeError as exc:
            raise CachelabError(f"{path}: the weights do not fit a {width}-{self.hidden}-{self.hidden}-1 "
                                f"network ({str(exc).splitlines()[0]})") from None
        self.feature_names_ = list(metadata["feature_names"])
        return self
