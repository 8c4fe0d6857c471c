"""``cachelab train`` and ``cachelab evaluate``: hotness predictors trained causally, judged against Belady."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from cachelab import defaults, registry, strict_json
from cachelab.capacity import parse_capacities, parse_capacity
from cachelab.cli.interrupted import file_identity, interruptible, interrupted
from cachelab.cli.stdout import stdout_console
from cachelab.engram import get_preset
from cachelab.errors import CachelabError
from cachelab.learning.training import (TrainSpec, check_target, keep_capacity, keep_rows, keep_size_note, load,
                                        rolling_scores, save, train as train_model)
from cachelab.learning.evaluation import evaluate_capacities, judged_policy
from cachelab.learning.lineup import lineup
from cachelab.learning.predictor import METADATA, model_folder
from cachelab.params import check_params, parse_pairs, parse_value, seeded_params
from cachelab.paths import output_folder
from cachelab.progress import spinner
from cachelab.learning.streams import STEP_VIEWS, LearningView, load_trace, unchecked_layout
from cachelab.trace.kinds import detect

TRACE_HELP = ("Prompt corpora (cachelab.workloads), comma-separated and interleaved: arena-hard, gsm8k, humaneval, "
              "gutenberg, mt-bench, ...; or a lookup stream with token metadata (.npz, `cachelab trace lookups`), "
              "or a request trace with token ids (.parquet, e.g. a capture of live serving). The kind is detected and "
              "printed.")
PRESET_HELP = ("Engram layout of the stream: a preset (deepseek-v4.1-flash, engram-27b-demo) or a layout .toml/.json "
               "(`cachelab engram info`). A model scores only rows of the layout it was trained on.")
STEPS_HELP = (f"How corpora become serving steps, one of {list(STEP_VIEWS)}: each prompt alone, chunk by chunk "
              "(prompts), or batched by the serving scheduler (serving: continuous batching, chunked prefill, "
              "prefix-cache hits skipped). A saved .npz keeps its own steps.")


def _view(trace: str, requests: int, seed: int, preset: str, steps: str, console: Console,
          verb: str, notes: list[str] | None = None) -> LearningView:
    """The trace's learning view; a note on it goes to ``notes`` where given, else to ``console``."""
    found = detect(trace)
    console.print(f"{trace}: {found}")
    with spinner("building the Engram lookup stream"):
        stream = load_trace(found, requests, seed, preset, steps, verb=verb)
    if note := unchecked_layout(stream):
        if notes is None:
            console.print(f"{trace}: {note}")
        else:
            notes.append(f"{trace}: {note}")
    return LearningView.of(stream, preset)


def train(
    trace: str = typer.Option(..., help=TRACE_HELP),
    predictor: str = typer.Option("lightgbm", help="A registered predictor (cachelab.predictors)."),
    out: Path = typer.Option(..., help="Directory for the model, metadata.json and the corpus prior."),
    requests: int = typer.Option(200, help="Requests per corpus (from the start of each), or of a .parquet trace."),
    preset: str = typer.Option(defaults.PRESET, help=PRESET_HELP),
    steps: str = typer.Option("prompts", help=STEPS_HELP),
    horizon: int = typer.Option(defaults.HORIZON, help="Label horizon in lookups (censoring / reuse window)."),
    train_fraction: float = typer.Option(defaults.TRAIN_FRACTION,
                                         help="Share of the trace used for training; the rest validates."),
    max_samples: int = typer.Option(defaults.MAX_SAMPLES, help="Training samples drawn from the training window."),
    seed: int = typer.Option(0, help="Seed for request order and sampling, and added to the predictor's own seed "
                             "(--param seed, where it takes one: the MLP's weights, HGB's binning sample)."),
    capacity: str = typer.Option("0", help="Label with Belady's keep decisions at this cache size (rows, a "
                                 "fraction or percentage of the training window's unique rows, or bytes) instead "
                                 "of reuse within the horizon: a model for that size, what learned-lfu-adaptive "
                                 "(judged by `evaluate`) and learned-s3fifo are built for. Needs a classifier "
                                 "(--predictor lightgbm-reuse). 0: off."),
    lookahead: bool = typer.Option(True, help="Use the prompt-lookahead features (a prefill lookup sees how far "
                                   "ahead in its own, already arrived prompt its row is used again)."),
    param: list[str] = typer.Option([], "--param", help="A predictor hyper-parameter as key=value (repeatable), "
                                    "e.g. --param n_estimators=200."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Train a hotness predictor on the first part of a trace; print validation AUC/RMSE and importances."""
    console = Console(stderr=True, quiet=as_json)
    cls = registry.get(registry.PREDICTORS, predictor)
    spec = TrainSpec(horizon=horizon, train_fraction=train_fraction, max_samples=max_samples, seed=seed,
                     capacity=_learning_capacity(capacity, preset, "--capacity"), lookahead=lookahead)
    spec.check()
    check_target(cls.task, spec)
    params = parse_pairs(param)
    check_params(cls, params, "--param")
    try:  # before the stream is built: a bad value costs no minutes
        fresh = cls(**seeded_params(cls, params, seed))  # as an experiment point's seed offsets it
    except TypeError as exc:
        raise CachelabError(f"predictor {predictor!r}: {exc}") from None
    model_folder(output_folder(out, "--out"), "--out")  # before the training it would hold
    # the model goes in by one rename: Ctrl-C leaves the folder's model before or the new one, whole
    with interrupted("train", out, thing="model", partial="model was", identity=_model_identity):
        stream = _view(trace, requests, seed, preset, steps, console, "train")
        with spinner(f"training {predictor}"):
            model, metrics = train_model(stream, fresh, spec)
        save(model, out, {"trace": trace, "requests": requests, "preset": preset, "steps": steps})
    # lookups as `evaluate` counts them (every row read); fetches: each step's distinct rows, which
    # training samples and validation (validation_lookups) count
    result = {"predictor": predictor, "trace": trace, "lookups": int(stream.inverse.size), "fetches": len(stream),
              "out": str(out), **metrics}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    out_console = stdout_console()
    out_console.print(f"[bold]{predictor}[/] on {result['lookups']:,} lookups ({len(stream):,} fetches: each "
                      f"step's distinct rows), validated on {metrics['validation_lookups']:,} held-out fetches; "
                      f"saved to {out}")
    # an AUC is undefined (NaN; null in --json) where its labels are all one class
    one_class = {"auc": ("reuse_rate", "reused within the horizon"), "auc_belady": ("belady_keep_rate", "kept by Belady")}
    for key in ("auc", "auc_belady", "belady_keep_rate", "rmse", "rmse_constant", "reuse_rate"):
        if key in metrics and metrics[key] != metrics[key]:
            rate, what = one_class[key]
            out_console.print(f"  {key}: undefined (the validation fetches are all one class: "
                              f"{metrics[rate]:.0%} {what})")
        elif key in metrics:
            out_console.print(f"  {key}: {metrics[key]:.4f}  ({METRIC_MEANING[key]})")
    table = Table("feature", "importance")
    for name, value in list(metrics.get("importances", {}).items())[:12]:
        table.add_row(name, f"{value:.3f}")
    out_console.print(table)


def _model_identity(folder: Path) -> tuple[int, int] | None:
    """What tells one saved model from the next (None: no model in ``folder``)."""
    return file_identity(folder / METADATA)


METRIC_MEANING = {  # printed bare, rmse_constant and reuse_rate said nothing to a newcomer
    "auc": "the scores' ranking of the fetches reused within the horizon above the rest; 0.5 is chance",
    "auc_belady": "the same against the fetches Belady keeps at --capacity",
    "belady_keep_rate": "share of the validation fetches Belady keeps",
    "rmse": "of the predicted log1p(lookups to the next use), censored at the horizon",
    "rmse_constant": "the same for a constant prediction: the rmse to beat",
    "reuse_rate": "share of the validation fetches reused within the horizon",
}


def _learning_capacity(text: str, preset: str, where: str) -> float | str:
    """A capacity flag (``cachelab.capacity``) as the learning API takes it: "0" is off; a number
    stays a number (a fraction below 1, else rows); bytes become rows of the preset's row size."""
    if parse_value(text) == 0:  # the default: reuse labels, no Belady capacity
        return 0.0
    cap = parse_capacity(text, where)
    if cap.kind == "bytes":
        return float(cap.rows(row_bytes=get_preset(preset).row_bytes, where=where))
    return cap.written if cap.kind == "percent" else cap.amount


DEFAULT_CAPACITIES = "0.001,0.01,0.05"


def _capacities(text: str, preset: str) -> list[float | str]:
    return [_learning_capacity(c.written, preset, "--capacities") for c in parse_capacities(text)]


@interruptible("evaluate")
def evaluate(
    trace: str = typer.Option(..., help=TRACE_HELP),
    model: Path = typer.Option(..., help="A directory written by `cachelab train`."),
    capacities: str = typer.Option(None,
                                   help="Cache sizes, comma-separated: fractions of the unique rows (< 1), rows "
                                        "(>= 1), percentages ('5%') or bytes ('64MiB'). Default: a keep model's "
                                        "own size (`train --capacity`: it is trained for that one size), else "
                                        f"{DEFAULT_CAPACITIES}."),
    requests: int = typer.Option(200, help="Requests per corpus, or of a .parquet trace."),
    preset: str = typer.Option(defaults.PRESET, help=PRESET_HELP),
    steps: str = typer.Option("prompts", help=STEPS_HELP),
    warmup: float = typer.Option(0.5, help="Share of the steps replayed before misses are counted."),
    retrain_every: int = typer.Option(0, help="Retrain the model's predictor every N lookups as the trace "
                                      "streams, each time on the window before (0: score with the saved model)."),
    retrain_window: int = typer.Option(0, help="Lookups each retraining sees (default: the model's training window)."),
    seed: int = typer.Option(0, help="Seed for request order."),
    policy: str = typer.Option(None, help="The learned policy judged by 'gap closed' (default: the registered "
                               "learned policy that declares judged_by_default); all of them are replayed."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Miss ratios of every registered learned policy, heuristic and oracle, the best heuristic, and the
    share of its gap to the best oracle that the judged policy closes."""
    console = Console(stderr=True, quiet=as_json)
    caps = None if capacities is None else _capacities(capacities, preset)
    if not 0.0 <= warmup < 1.0:
        raise CachelabError(f"--warmup must lie in [0, 1), got {warmup}")
    fitted = load(model)
    trained_for = keep_capacity(fitted)
    # a keep model is judged at the rows its labels were made at (its share of its training window's rows)
    caps = caps or ([keep_rows(fitted, None) or trained_for] if trained_for
                    else _capacities(DEFAULT_CAPACITIES, preset))
    # before the stream is built (minutes on long traces): each was refused once it had been
    if retrain_every < 0:
        raise CachelabError(f"--retrain-every must be a number of lookups >= 1 (0: no retraining), got {retrain_every}")
    if retrain_window < 0 or (retrain_every and retrain_window and retrain_window <= 2 * fitted.horizon):
        raise CachelabError(f"--retrain-window must exceed twice the model's horizon ({2 * fitted.horizon:,} lookups; "
                            f"0: the model's training window), got {retrain_window:,}")
    judged_policy(lineup(), policy)  # a misspelt --policy was refused after the stream and any retraining
    notes: list[str] = []  # every note beside the table, in --json too (``notes``)
    stream = _view(trace, requests, seed, preset, steps, console, "evaluate", notes)
    scores = None
    if retrain_every:
        spec = fitted.metadata.get("spec", {})
        cls, params = type(fitted.predictor), fitted.predictor.get_params()
        window = retrain_window or int(spec.get("train_end", len(stream) // 2))
        with spinner(f"retraining every {retrain_every:,} lookups on windows of {window:,}"):
            scores = rolling_scores(stream, lambda: cls(**params),
                                    TrainSpec(horizon=fitted.horizon, seed=int(spec.get("seed", 0)),
                                              max_samples=int(spec.get("max_samples", defaults.MAX_SAMPLES)),
                                              # a keep model's rows: its share of each window was another size
                                              capacity=keep_rows(fitted, None) or trained_for,
                                              lookahead=fitted.lookahead),
                                    retrain_every, window)
    evaluation = evaluate_capacities(stream, fitted, caps, warmup, progress=True, scores=scores, policy=policy)
    own_rows = keep_rows(fitted, stream.num_keys)
    result = {"trace": trace, "model": str(model), "model_capacity": trained_for or None,
              "model_capacity_rows": own_rows, **evaluation.to_dict(),
              # the capacities a keep model runs at though trained for another size (keep_size_note)
              "other_size_capacities": [row.capacity for row in evaluation.capacities
                                        if own_rows is not None and row.rows != own_rows]}
    found_notes = (
        (evaluation.training_requests, f"{evaluation.training_requests:,} requests after the warm-up repeat the "
         "model's training requests (the same tokens; this stream does not start with its training window): "
         "replayed, not counted"),
        (evaluation.in_sample_lookups, f"{evaluation.in_sample_lookups:,} lookups the model learned from (its "
         "training window, or requests repeating it) were replayed without its scores (a keep chance of 0): the "
         "model starts where its training data ends, on the cache built without it"),
        (result["missing"], f"registered but not loaded, so not compared: {', '.join(result['missing'])}"),
        (True, keep_size_note(fitted, {str(row.capacity): row.rows for row in evaluation.capacities},
                              stream.num_keys)))
    notes += [text for found, text in found_notes if found and text]
    result["notes"] = notes
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    out = stdout_console()
    out.print(f"[bold]miss ratios[/] on {result['lookups']:,} lookups ({result['unique_rows']:,} unique rows), "
              f"counted after {warmup:.0%} warm-up" + (f" and the model's training window ({evaluation.training_window_steps:,} "
              f"steps at the stream's start)" if evaluation.training_window_steps
              and evaluation.counted_from_step == evaluation.training_window_steps else ""))
    for note in notes:
        out.print(note)
    rows = result["capacities"]
    table = Table("policy", *(f"{row['capacity']:g}\n{row['rows']:,} rows" if isinstance(row["capacity"], float)
                              else f"{row['capacity']}\n{row['rows']:,} rows" for row in rows),
                  caption=f"gap closed: (best heuristic - {evaluation.learned_policy}) / (best heuristic - best oracle)")
    # each policy by its registry name, what --policy takes (--json keys it by label: LRU beside arc)
    name_of = lineup().name_of
    for label in rows[0]["miss_ratio"]:  # one row per policy: a few capacities fit a terminal, many policies do not
        name = name_of(label)
        table.add_row(f"[bold]{name}[/]" if name == evaluation.learned_policy else name,
                      *(f"{row['miss_ratio'][label]:.4f}" for row in rows))
    table.add_row("floor (no policy misses less)", *(f"{row['miss_floor']:.4f}" for row in rows))
    table.add_row("best heuristic", *(name_of(row["best_heuristic"]) if row["best_heuristic"] else "n/a"
                                      for row in rows))
    table.add_row("gap closed", *("n/a" if row["gap_closed"] is None else f"{row['gap_closed']:.1%}" for row in rows))
    out.print(table)
