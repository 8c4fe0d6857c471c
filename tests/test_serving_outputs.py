"""The serving verbs' output files are written whole or not at all: a write that fails (a full
disk, a kill) leaves the file that stood there as it was, never a cut one under its name."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from cachelab.serving.hardware import load_profile
from cachelab.serving.hardware.probe import write_profile as write_probe
from cachelab.serving.latency import Efficiency
from cachelab.serving.live_calibration import Calibration
from cachelab.serving.live_profile import write_profile as write_calibration
from cachelab.serving.pareto import plot_fronts


class DiskFull(OSError):
    pass


def _failing_after_some_bytes(monkeypatch, cls, method: str):
    """``cls.method`` writes part of its output, then fails as a full disk would."""
    def cut(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(str(data)[:5])
        raise DiskFull("no space left on device")

    monkeypatch.setattr(cls, method, cut)


def test_profiles_fail_whole(tmp_path, monkeypatch):
    probed = {"name": "local", "host": {"link_bw": 1e10}, "cpu": {}, "ssd": {}}
    calibration = Calibration(Efficiency(), 0.0, ["c2"], [], {}, 2)
    for path, write in ((tmp_path / "local.toml", lambda p: write_probe(probed, p)),
                        (tmp_path / "fitted.toml", lambda p: write_calibration(calibration, load_profile("H200"), 1, p))):
        write(path)
        before = path.read_text()
        with monkeypatch.context() as m:
            _failing_after_some_bytes(m, Path, "write_text")
            with pytest.raises(DiskFull):
                write(path)
        assert path.read_text() == before, path  # it held the file's first 5 bytes
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_plot_fails_whole(tmp_path, monkeypatch):
    import matplotlib.figure

    points = pl.DataFrame({"config": ["a", "a", "b"], "interactivity": [10.0, 20.0, 15.0],
                           "tokens_per_s_per_gpu": [900.0, 500.0, 700.0]})
    plot = tmp_path / "front.png"
    plot_fronts(points, "config", plot, "fronts")
    before = plot.read_bytes()
    assert before.startswith(b"\x89PNG")  # the format from the name asked for
    plot_fronts(points, "config", tmp_path / "front.svg", "fronts")
    assert b"<svg" in (tmp_path / "front.svg").read_bytes()[:400]

    def cut(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PN")
        raise DiskFull("no space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut)
    with pytest.raises(DiskFull):
        plot_fronts(points, "config", plot, "fronts")
    assert plot.read_bytes() == before


def test_the_semianalysis_points_csv_fails_whole(tmp_path, monkeypatch):
    """`cachelab study semianalysis` writes its points as CSV once the sweep is done: a write that failed
    left a cut CSV, which reads as a study of fewer points (the streamed JSONL is unaffected)."""
    from cachelab.serving.studies import semianalysis

    monkeypatch.setattr(semianalysis, "run_points", lambda workload, eff, on_point: [{"id": 1}, {"id": 2}])
    before = "id\n1\n2\n3\n"
    (tmp_path / "semianalysis_points.csv").write_text(before)

    def cut(self, path, **kwargs):
        Path(path).write_text("id\n1\n")
        raise DiskFull("no space left on device")

    monkeypatch.setattr(pl.DataFrame, "write_csv", cut)
    with pytest.raises(DiskFull):
        semianalysis.run(tmp_path, Efficiency())
    assert (tmp_path / "semianalysis_points.csv").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
