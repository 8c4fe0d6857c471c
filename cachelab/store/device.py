"""The compute device the HBM row cache lives on: a name checked before anything is allocated,
and named as torch names a tensor's device (``out=`` tensors are compared with it)."""

from __future__ import annotations

import re

from cachelab.errors import CachelabError


def check_device(device: str, where: str = "device") -> None:
    """Refuse a device the HBM tier cannot live on: not cpu, cuda or cuda:N ('cuda:x' was a
    RuntimeError from torch on a GPU machine), CUDA missing, or an index past the devices.
    ``where`` names it (a CLI flag)."""
    import torch

    cuda = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device != "cpu" and not cuda:
        raise CachelabError(f"{where} {device!r}: expected cpu, cuda or cuda:N")
    if cuda and not torch.cuda.is_available():
        raise CachelabError(f"{where} {device!r}: CUDA is not available here; use cpu")
    if cuda and int(cuda[1] or 0) >= torch.cuda.device_count():
        raise CachelabError(f"{where} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                            "cuda:0 onwards")


def indexed_device(device: str):
    """``device`` (checked) as torch names a tensor's: ``cuda`` is the current CUDA device with
    its index. A tensor's ``.device`` always carries the index and ``torch.device('cuda') !=
    torch.device('cuda:0')``, so a store opened on ``cuda`` refused every ``out=`` made there
    ('must be ... on cuda, got ... on cuda:0')."""
    import torch

    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
