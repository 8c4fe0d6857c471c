"""Where cachelab finds third-party data, keeps its own derived caches and may write outputs.

Nothing is downloaded: the data root is configured (``CACHELAB_DATA``) or found beside the
checkout (``../shared/data``), and derived artefacts (the compressed-vocabulary map) live in
``CACHELAB_CACHE_DIR`` or ``~/.cache/cachelab``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from cachelab.errors import CachelabError
from cachelab.owners import owner, owner_is_dead

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """The directory for derived, rebuildable artefacts (created on first use)."""
    root = Path(os.environ.get("CACHELAB_CACHE_DIR", Path.home() / ".cache" / "cachelab"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def data_root(required: bool = True) -> Path | None:
    """The root of the real third-party data (traces, prompts, tokenizers).

    ``CACHELAB_DATA`` wins; otherwise ``../shared/data`` next to the repository.
    """
    env = os.environ.get("CACHELAB_DATA")
    candidates = [Path(env)] if env else [REPO_ROOT.parent / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    if required:
        where = env if env else str(candidates[0])
        raise CachelabError(
            f"data root not found at {where!r}: set CACHELAB_DATA to the folder holding "
            "traces/, prompts/ and tokenizers/"
        )
    return None


def resolve_data_path(path: str, where: str = "spec", key: str = "path") -> Path:
    """A data file or folder a spec or flag names: absolute as given; relative, under the data
    root, else in the working directory. The error names ``where``, ``key`` and the path."""
    given = Path(path)
    if given.is_absolute():
        if not given.exists():
            raise CachelabError(f"{where}: {key}: data file not found: {given}")
        return given
    root = data_root(required=False)
    if root is not None and (root / given).exists():
        return root / given
    if given.exists():
        return given
    if root is None:
        raise CachelabError(f"{where}: {key}: {path!r} needs the data root: "
                            "set CACHELAB_DATA to the folder holding traces/ and prompts/")
    raise CachelabError(f"{where}: {key}: data file not found: {root / given}")


def named_in(file: str | os.PathLike, value: str) -> str:
    """The path ``value`` as the file ``file`` names it: a relative one from the file's folder
    (``~`` expanded), wherever the command runs; read from the working directory, the same file
    named another file, or none, depending on where it was run."""
    return os.path.abspath(Path(file).parent / os.path.expanduser(value))


def output_file(path: Path, flag: str) -> Path:
    """An output file a flag names, checked before the work that fills it: its folder must
    exist and be writable and the path must not be a folder, so a long run does not fail at
    its end with nothing written."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise CachelabError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise CachelabError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise CachelabError(f"{flag} {path}: the folder {folder} is not writable")
    return path


def scratch_beside(path: Path) -> Path:
    """A hidden name beside ``path`` no other writer uses (its owner and a random token): two
    processes writing one output at once each write their own scratch file, the last rename
    wins whole, where a shared scratch name let one truncate or rename the other's half. The
    scratch files beside ``path`` whose writer is proven gone (``owners.owner_is_dead``: a
    writer killed mid-write) are removed first, as the shared name was overwritten by the next
    write; another host's (a shared file system) are left alone."""
    head, tail = f".{path.name}.", ".partial"
    for stale in path.parent.glob(f"{glob.escape(head)}*{tail}"):
        tag = stale.name[len(head):-len(tail)].rpartition(".")[0]
        if owner_is_dead(tag):
            stale.unlink(missing_ok=True)
    return path.with_name(f"{head}{owner()}.{secrets.token_hex(4)}{tail}")


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A scratch file beside ``path`` to write; it becomes ``path`` only when the block ends
    without an error, so a kill or an error mid-write never leaves a cut file under the name
    (a reader could take a cut file for a shorter whole one) and an older file stays whole."""
    path = Path(path)
    tmp = scratch_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        name_the_file(exc, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def name_the_file(exc: OSError, path: str | os.PathLike) -> None:
    """A write to an open file that fails (a full disk, a file size limit) names no file: name
    ``path``, the output asked for, not its scratch file, so the command line's error says which."""
    if exc.filename is None:
        exc.filename = str(path)


@contextlib.contextmanager
def held(lock: Path, what: str, why: str) -> Iterator[None]:
    """The folder of the lock file ``lock`` for ``what`` alone until the block ends; a second
    holder is refused at once, told who holds it and ``why`` two at once would be wrong (the
    lock is the kernel's: a killed holder frees it)."""
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise CachelabError(f"{holder} is using {lock.parent} now; wait for it to end ({why})") from None
        try:  # unbuffered: a write the disk refuses (full, a file size limit) raised here, named, not at close
            os.ftruncate(f.fileno(), 0)
            os.write(f.fileno(), f"`{what}` (pid {os.getpid()})".encode())
        except OSError as exc:
            raise CachelabError(f"{lock}: {exc.strerror or exc} (writing who holds {lock.parent})") from None
        yield


@contextlib.contextmanager
def one_builder(lock: Path) -> Iterator[None]:
    """The lock file ``lock`` held until the block ends, waiting while another process holds it:
    processes that would build the same cached artefact at once (the points of one sweep, two
    sweeps) build it once, each later one finding it made (the kernel frees a killed holder's)."""
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def output_folder(path: Path, flag: str) -> Path:
    """An output folder a flag names, checked before the work that fills it: a path that
    cannot be one is named at once, not after the run. The check makes the folders (the one
    true test on any file system) and removes those it made: the writer makes them again, so
    a run that fails leaves no empty folder behind."""
    path = Path(path)
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError as exc:
        raise CachelabError(f"{flag} {path}: cannot be made a folder ({exc.strerror or exc})") from None
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
    if not writable:
        raise CachelabError(f"{flag} {path}: the folder is not writable")
    return path
