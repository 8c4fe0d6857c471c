"""The predictor contract: learned hotness from what is known before a row is fetched.

A predictor maps a feature matrix (float32, one row per lookup, named columns) to scores
(higher = more worth keeping: e.g. minus the predicted log steps to next access, or the
probability of reuse within a window). Training is causal: the runner never fits on the
future of the window it scores. Models are saved without pickle (a LightGBM text model,
safetensors or ONNX) beside ``metadata.json`` recording the feature names and the training
spec; ``load`` refuses a model whose features do not match.

``manifest.json`` seals a model directory: each file's size and SHA-256, written last by
``save`` and checked by ``read_metadata`` before any parser (a native one above all) reads a
byte, so a truncated, bit-flipped or swapped file is refused by name instead of crashing the
process inside a library's loader.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import inspect
import json
import math
import numbers
import os
import shutil
import stat
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np

from cachelab.errors import CachelabError

METADATA = "metadata.json"
MANIFEST = "manifest.json"
TASKS = ("regression", "classification")  # a predictor's ``task``


class Predictor(ABC):
    """Base class of every hotness predictor.

    Constructor: hyper-parameters only. Learned state ends in ``_`` (``feature_names_``).
    ``name`` is the registry name (the registry checks it): a saved model records it.
    ``task`` is ``"regression"`` (labels: log1p steps to next access, censored) or
    ``"classification"`` (labels: 0/1 reuse within a window).
    """

    name: ClassVar[str] = ""
    task: ClassVar[str] = "regression"

    def get_params(self) -> dict:
        sig = inspect.signature(type(self).__init__)
        return {name: getattr(self, name) for name, p in sig.parameters.items()
                if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    @abstractmethod
    def fit(self, features: np.ndarray, labels: np.ndarray, feature_names: list[str]) -> "Predictor":
        """Learn from ``features`` [n, f] and ``labels`` [n]; return self."""

    @abstractmethod
    def predict(self, features: np.ndarray) -> np.ndarray:
        """Scores [n], higher = keep."""

    @abstractmethod
    def save_model(self, directory: Path) -> None:
        """Write the learned state (no pickle) into ``directory``."""

    @classmethod
    @abstractmethod
    def load_model(cls, directory: Path, metadata: dict) -> "Predictor":
        """Rebuild from what ``save_model`` wrote."""

    def save(self, directory: Path, spec: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.save_model(directory)
        meta = {"predictor": self.name, "task": self.task, "params": self.get_params(),
                "feature_names": list(self.feature_names_), "spec": spec or {}}
        (directory / METADATA).write_text(json.dumps(meta, indent=2, default=str))
        seal(directory)
        return directory


def in_range(predictor: str, name: str, value, low: float, above: bool = False, whole: bool = False) -> None:
    """Refuse a hyper-parameter below ``low`` (at or below it with ``above``), or not a finite
    number (with ``whole``, not an integer: a count of trees, leaves, units or epochs), naming it: a
    predictor checks them as it is made, before a stream is built, where the library refused them
    only when fitting, once the features were made (minutes in; in a sweep, a point failed after
    the others had run)."""
    kinds = numbers.Integral if whole else numbers.Real
    number = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < low or (above and value == low):
        raise CachelabError(f"{predictor}: {name} must be {'a whole number' if whole else 'a finite number'} "
                            f"{'>' if above else '>='} {low:g}, got {value!r}")


def model_folder(directory: Path, flag: str) -> Path:
    """A folder a model may be saved into, checked before the training that fills it: new, empty,
    or a model (which the save replaces whole). Anything else is refused by name: a save sealed
    every file it found into the model, and a table build's ``manifest.json`` was overwritten."""
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.iterdir()) or _is_model(directory):
        return directory
    names = sorted(p.name for p in directory.iterdir())
    found = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    raise CachelabError(f"{flag} {directory}: holds files that are not a cachelab model ({found}); give a new or "
                        "empty folder, or a model's folder to replace the model")


def _is_model(directory: Path) -> bool:
    """Whether ``directory`` holds a model: its metadata, sealed or not (a model saved before
    manifests is retrained in place)."""
    return (directory / METADATA).is_file()


def install(scratch: Path, directory: Path) -> None:
    """Put the sealed model folder ``scratch`` (beside ``directory``) at ``directory`` (new, empty or
    a model's, as ``model_folder`` allows) in one rename: a kill at any moment leaves the old model
    whole or the new one (the old manifest went first, then the files moved one by one: a kill
    between left a folder with no model). Over a model the two folders are exchanged
    (``renameat2``), the old one then removed from ``scratch``; where the file system cannot
    exchange, the old folder is renamed aside first, whole."""
    model_folder(directory, "model folder")
    directory = Path(directory).resolve()  # a link to the folder stays a link: its target is replaced
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        mode = None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(scratch, stat.S_IMODE(mode) if mode is not None else 0o777 & ~umask)  # mkdtemp made it 0700
    try:
        if mode is None or not any(directory.iterdir()):
            os.replace(scratch, directory)  # a rename onto an empty folder replaces it
        elif not _exchange(scratch, directory):
            aside = Path(f"{scratch}.old")
            try:
                os.rename(directory, aside)
                os.rename(scratch, directory)
            finally:
                if not directory.exists():  # Ctrl-C or a failure between the renames: the old model back
                    os.rename(aside, directory)
                shutil.rmtree(aside, ignore_errors=True)
    except OSError as exc:
        raise CachelabError(f"{directory}: the model could not be moved in ({exc.strerror or exc}); the folder "
                            "holds what it held") from None
    _fsync(directory.parent)
    shutil.rmtree(scratch, ignore_errors=True)  # the old model, out of the way


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the C library
    or the file system has no such call."""
    call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if call is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def seal(directory: Path) -> None:
    """Write ``manifest.json``: the size and SHA-256 of every file in ``directory``."""
    directory = Path(directory)
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=2))


class _Replaced(Exception):
    """The model folder a reader opened was moved out and removed under it (``install``)."""


def read_sealed(directory: Path, required: tuple[str, ...] = (METADATA,)) -> dict[str, bytes]:
    """Every file ``manifest.json`` lists, read once and checked (size first, then SHA-256), by name.

    All are read through one open handle of the folder, so they are one model's while ``install``
    puts another in its place: opened by path one by one, the metadata of one model went with the
    weights of the next. Where the model opened was removed under the reader, the folder is read
    again (the new model). Nothing else of the directory is read, and a parser handed these bytes
    reads what was checked. ``required`` names files the manifest must list.
    """
    directory = Path(directory)
    for _ in range(3):
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            raise CachelabError(f"no model at {directory}: {METADATA} is missing") from None
        try:
            return _read_sealed(fd, directory, required)
        except _Replaced:
            continue
        finally:
            os.close(fd)
    raise CachelabError(f"model at {directory}: replaced by another one three times while it was read; read it again")


def _read_sealed(fd: int, directory: Path, required: tuple[str, ...]) -> dict[str, bytes]:
    """``read_sealed`` of the folder open as ``fd``."""
    path = directory / MANIFEST
    if (meta := _open_in(fd, directory, METADATA)) is None:
        raise CachelabError(f"no model at {directory}: {METADATA} is missing")
    os.close(meta)
    if (file := _open_in(fd, directory, MANIFEST)) is None:
        raise CachelabError(f"model at {directory} has no {MANIFEST} (each file's size and SHA-256, written by "
                            "cachelab since models were sealed): save or train it again")
    with open(file, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CachelabError(f"{path}: not valid JSON ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and type(e.get("size")) is int and isinstance(e.get("sha256"), str) for e in files.values()):
        raise CachelabError(f"{path}: expected {{\"files\": {{name: {{\"size\": int, \"sha256\": hex}}}}}}")
    for name in required:
        if name not in files:
            raise CachelabError(f"{path} does not list {name}")
    out = {MANIFEST: raw}
    for name, entry in files.items():
        if Path(name).name != name or name in (".", "..", MANIFEST):
            raise CachelabError(f"{path}: {name!r} is not a file name of the model directory")
        if (file := _open_in(fd, directory, name)) is None:
            raise CachelabError(f"model at {directory}: {name} is missing (listed in {MANIFEST})")
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry["size"]:
                raise CachelabError(f"model at {directory}: {name} is {size:,} bytes, {MANIFEST} says "
                                    f"{entry['size']:,}: the file was truncated or changed after saving")
            out[name] = f.read()
        if hashlib.sha256(out[name]).hexdigest() != entry["sha256"].lower():
            raise CachelabError(f"model at {directory}: {name} does not match its SHA-256 in {MANIFEST}: "
                                "the file is damaged or was changed after saving")
    return out


def _open_in(fd: int, directory: Path, name: str) -> int | None:
    """File ``name`` of the folder open as ``fd``, opened for reading; None where the folder holds no
    such file. Raises ``_Replaced`` where it is gone because the folder was moved away from ``directory``."""
    try:
        file = os.open(name, os.O_RDONLY, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        if _moved(fd, directory):
            raise _Replaced from None
        return None
    if not stat.S_ISREG(os.fstat(file).st_mode):
        os.close(file)
        return None
    return file


def _moved(fd: int, directory: Path) -> bool:
    """Whether ``directory`` names another folder than the one open as ``fd`` (or none)."""
    try:
        now = os.stat(directory)
    except OSError:
        return True
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def load_predictor(cls, files: dict[str, bytes], directory: Path, metadata: dict) -> "Predictor":
    """``cls.load_model`` of the model ``read_sealed`` read from ``directory`` as ``files``: it reads
    its files by path, so it is handed a private copy of them (``directory`` may hold another model
    by now); its errors name ``directory``, and a loader's own failure or a wrong type is refused."""
    name = metadata.get("predictor")
    with tempfile.TemporaryDirectory(prefix="cachelab-model-") as copy:
        for file, data in files.items():
            Path(copy, file).write_bytes(data)
        try:
            predictor = cls.load_model(Path(copy), metadata)
        except CachelabError as exc:
            raise CachelabError(str(exc).replace(copy, str(directory))) from None
        except Exception as exc:  # a plug-in's loader: name it and the file, not a traceback
            raise CachelabError(f"model at {directory}: predictor {name!r} could not load it: "
                                f"{type(exc).__name__}: {str(exc).replace(copy, str(directory))}") from None
    if not isinstance(predictor, cls):
        raise CachelabError(f"model at {directory}: predictor {name!r}'s load_model returned "
                            f"{type(predictor).__name__}, not a {cls.__name__}")
    return predictor


def _typed(meta: dict, key: str, kind, what: str, where: Path) -> None:
    if key in meta and not kind(meta[key]):
        raise CachelabError(f"{where}: {key!r} must be {what}, got {meta[key]!r:.80}")


def read_metadata(directory: Path, files: dict[str, bytes] | None = None) -> dict:
    """The model's metadata, from ``files`` (``read_sealed``'s; by default the folder read now); its
    keys' types are checked, naming the key."""
    files = read_sealed(directory) if files is None else files
    path = Path(directory) / METADATA
    try:
        meta = json.loads(files[METADATA])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CachelabError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CachelabError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    _typed(meta, "predictor", lambda v: isinstance(v, str), "a predictor name", path)
    _typed(meta, "feature_names", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
           "a list of feature names", path)
    _typed(meta, "params", lambda v: isinstance(v, dict), "an object of hyper-parameters", path)
    _typed(meta, "spec", lambda v: isinstance(v, dict), "an object", path)
    return meta


def write_tensors(path: Path, tensors: dict) -> None:
    """NumPy arrays, or torch tensors (the live model's weights, bfloat16 ones too), as a safetensors
    file with the mode of the model's other files (the umask's): safetensors' ``save_file`` writes
    0600, and another user could not load a model shared with it."""
    if all(isinstance(v, np.ndarray) for v in tensors.values()):
        from safetensors.numpy import save

        data = save({k: np.ascontiguousarray(v) for k, v in tensors.items()})
    else:
        from safetensors.torch import save

        data = save({k: v.contiguous() for k, v in tensors.items()})
    Path(path).write_bytes(data)


def read_tensors(path: Path, expected: dict[str, int | None], data: bytes | None = None) -> dict:
    """NumPy arrays from a safetensors file (or its bytes ``data``, read already), each named in
    ``expected`` with its dimensions (None: any); a malformed file or a missing or misshapen tensor
    is refused, naming it."""
    from safetensors.numpy import load, load_file

    try:
        tensors = load_file(str(path)) if data is None else load(data)
    except Exception as exc:  # safetensors' own error type, and OSError
        raise CachelabError(f"{path}: not a readable safetensors file ({exc})") from None
    for name, ndim in expected.items():
        if name not in tensors:
            raise CachelabError(f"{path}: tensor {name!r} is missing")
        if ndim is not None and tensors[name].ndim != ndim:
            raise CachelabError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, expected {ndim} dimension(s)")
    return tensors


def check_features(metadata: dict, feature_names: list[str], where: Path) -> None:
    """Refuse a model trained on other features, naming the difference."""
    trained = metadata.get("feature_names", [])
    if list(trained) != list(feature_names):
        missing = sorted(set(trained) - set(feature_names))
        extra = sorted(set(feature_names) - set(trained))
        raise CachelabError(
            f"model at {where} was trained on features {trained}; these features differ "
            f"(missing {missing}, unexpected {extra}, or another order)"
        )
