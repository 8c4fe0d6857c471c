"""A trace spec (TOML or flags) and the build it describes: import, or synthesize.

``TraceSpec`` says how a request trace is made; an experiment's ``WorkloadSpec``
(``cachelab.experiment.spec``) may hold one as ``[workload.trace]`` and cuts its requests into
Engram lookups.

```toml
seed = 0
[arrivals]                 # a registered arrival source: mooncake, azure, burstgpt, servegen, gamma
source = "mooncake"
path = "traces/mooncake_fast25/conversation_trace.jsonl"   # absolute, or under the data root
skip_bad = false           # skip (and count) unusable rows instead of failing
use_lengths = true         # false: arrivals only time session starts; lengths come from the corpus
max_requests = 1000        # keep the first N arrivals (optional)
options = {}               # the source's own options (e.g. gamma: rate, burstiness, num_requests)
[corpus]                   # a registered corpus; leave out to import the arrivals as they are
source = "arena-hard"
tokenizer = "deepseek-v4"  # or a tokenizer.json (a relative path is read from this file's folder)
options = { version = "v2.0" }
[synthesis]
output_tokens = 256        # output length where neither the trace nor the corpus gives one
turn_gap_s = 30.0          # seconds between the turns of a session
# prefix_overlap = 0.5     # instead of sessions (so no turn_gap_s): a shared-prefix workload
# prefixes = 4             #   (cachelab.trace.overlap): this share of each prompt is one of
# prompt_tokens = 1024     #   `prefixes` shared prefixes, the rest its own; prompt_tokens where
                           #   the arrivals carry no lengths (e.g. gamma)
chunk_tokens = 4000000     # tokens materialized per written chunk (bounds memory)
```

Sources are found by name through the ``cachelab.workloads`` entry points, like any plug-in.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Any

import polars as pl
from pydantic import Field

from cachelab import registry
from cachelab.engram.vocab import DEEPSEEK_V4
from cachelab.errors import CachelabError
from cachelab.params import check_params
from cachelab.paths import named_in, resolve_data_path
from cachelab.trace.overlap import plan_overlap
from cachelab.trace.synthesis import BuildReport, TokenStream, make_plan, synthesize
from cachelab.trace.schema import write_trace
from cachelab.validation import Strict, read_toml, validate


class ArrivalSpec(Strict):
    source: str
    path: str | None = None
    skip_bad: bool = False
    use_lengths: bool = True
    max_requests: int | None = Field(None, gt=0)
    options: dict[str, Any] = {}


class CorpusSpec(Strict):
    source: str
    tokenizer: str = DEEPSEEK_V4   # or a tokenizer.json: in a spec file, a relative path is read from its folder
    options: dict[str, Any] = {}


class SynthesisSpec(Strict):
    output_tokens: int = Field(256, ge=0)
    turn_gap_s: float = Field(30.0, ge=0)
    chunk_tokens: int = Field(4_000_000, gt=0)
    prefix_overlap: float | None = Field(None, ge=0, lt=1)
    prefixes: int = Field(4, ge=1)
    prompt_tokens: int | None = Field(None, ge=1)


class TraceSpec(Strict):
    """Arrivals (imported, or generated), optionally a corpus for their text, and synthesis rules."""

    seed: int = 0
    arrivals: ArrivalSpec
    corpus: CorpusSpec | None = None
    synthesis: SynthesisSpec = SynthesisSpec()


def parse_spec(data: dict, where: str) -> TraceSpec:
    """A validated spec; errors name ``where`` and the offending key."""
    return validate(TraceSpec, data, where)


def load_spec(path: str | os.PathLike) -> TraceSpec:
    """The spec file ``path``; a relative ``corpus.tokenizer`` is read from the file's folder, as a
    layout file's ``tokenizer`` is (it was read from the working directory: the same spec built
    with another tokenizer, or failed, depending on where the command ran)."""
    data = read_toml(path, "trace spec")
    corpus = data.get("corpus")
    if isinstance(corpus, dict) and isinstance(corpus.get("tokenizer"), str) and corpus["tokenizer"] != DEEPSEEK_V4:
        corpus["tokenizer"] = named_in(path, corpus["tokenizer"])
    return parse_spec(data, str(path))


def instantiate(name: str, kwargs: dict[str, Any], optional: dict[str, Any], path_flag: str, where: str):
    """The registered workload ``name`` built with ``kwargs`` (all must be accepted, each of its
    parameter's type, named as ``where.KEY``) plus the ``optional`` ones its constructor takes;
    ``path_flag`` says where a user gives its path."""
    cls = registry.get(registry.WORKLOADS, name)
    params = inspect.signature(cls).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise CachelabError(f"workload {name!r} takes no option(s) {unknown}; it takes {sorted(params)}")
    check_params(cls, kwargs, where)  # num_requests = 2.5 was a plug-in's TypeError, true one request
    extra = {k: v for k, v in optional.items() if k in params and k not in kwargs}
    missing = [k for k, p in params.items() if p.default is p.empty and k not in kwargs and k not in extra
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise CachelabError(f"workload {name!r} needs " + ", ".join(f"{k} ({path_flag})" if k == "path" else k
                                                                   for k in missing))
    try:
        return cls(**kwargs, **extra)
    except TypeError as exc:
        raise CachelabError(f"workload {name!r}: {exc}") from None


def make_arrivals(spec: TraceSpec):
    a = spec.arrivals
    kwargs = dict(a.options)
    if a.path is not None:
        kwargs["path"] = str(resolve_data_path(a.path, "trace spec", "arrivals.path"))
    source = instantiate(a.source, kwargs, {"skip_bad": a.skip_bad, "seed": spec.seed},
                         "the arrivals file or folder: --arrivals-path, or arrivals.path in a spec", "arrivals.options")
    if not hasattr(source, "arrivals"):
        raise CachelabError(f"workload {a.source!r} is a corpus, not an arrival source (it has no arrivals())")
    return source


def make_corpus(spec: TraceSpec):
    kwargs = dict(spec.corpus.options)
    if isinstance(kwargs.get("path"), str):  # under the data root, as arrivals.path (and as its hash reads it)
        kwargs["path"] = str(resolve_data_path(kwargs["path"], "trace spec", "corpus.options.path"))
    corpus = instantiate(spec.corpus.source, kwargs, {},
                         "--corpus-option path=..., or corpus.options.path in a spec", "corpus.options")
    if not hasattr(corpus, "documents"):
        raise CachelabError(f"workload {spec.corpus.source!r} is an arrival source, not a corpus (it has no documents())")
    return corpus


def build(spec: TraceSpec, out: str | os.PathLike, progress=None) -> BuildReport:
    """Import the arrivals (no corpus) or synthesize a workload; write it to ``out``.

    Args:
        progress: optional object with ``stage(name, total)`` and ``advance(n)``.
    """
    started = time.perf_counter()
    source = make_arrivals(spec)
    _refuse_unused(spec, source)
    if progress:
        progress.stage(f"read {spec.arrivals.source}", None)
    arrivals = source.arrivals()
    if spec.arrivals.max_requests:
        arrivals = arrivals.head(spec.arrivals.max_requests)
    skipped = _skipped(source)
    if spec.corpus is None:
        if not source.has_lengths:
            raise CachelabError(f"arrivals {spec.arrivals.source!r} carry no lengths: give a [corpus] to synthesize")
        write_trace(arrivals, out)
        return BuildReport(requests=arrivals.height, sessions=arrivals["session_id"].n_unique(),
                           tokens_in=int(arrivals["prompt_len"].cast(pl.Int64).sum()),
                           tokens_out=int(arrivals["output_len"].cast(pl.Int64).sum()), chunks=1, **skipped,
                           seconds=round(time.perf_counter() - started, 3))
    corpus = make_corpus(spec)
    if progress:
        progress.stage(f"tokenize {spec.corpus.source}", None)
    stream = TokenStream.from_corpus(corpus, spec.corpus.tokenizer, progress.advance if progress else None)
    syn = spec.synthesis
    if syn.prefix_overlap is not None:
        plan = plan_overlap(stream, arrivals, overlap=syn.prefix_overlap, prefixes=syn.prefixes, seed=spec.seed,
                            has_lengths=source.has_lengths and spec.arrivals.use_lengths,
                            prompt_tokens=syn.prompt_tokens, output_tokens=syn.output_tokens)
    else:
        plan = make_plan(stream, arrivals, has_lengths=source.has_lengths, use_lengths=spec.arrivals.use_lengths,
                         seed=spec.seed, output_tokens=syn.output_tokens, turn_gap_s=syn.turn_gap_s)
    if progress:
        progress.stage("synthesize", plan.size)
    report = synthesize(stream, plan, out, source=f"{spec.arrivals.source}+{spec.corpus.source}",
                        chunk_tokens=spec.synthesis.chunk_tokens,
                        progress=(lambda n, _tokens: progress.advance(n)) if progress else None)
    for key, value in skipped.items():
        setattr(report, key, value)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


FLAGS = {"synthesis.prefix_overlap": "--prefix-overlap", "synthesis.prefixes": "--prefixes",
         "synthesis.prompt_tokens": "--prompt-tokens", "synthesis.output_tokens": "--output-tokens",
         "arrivals.use_lengths = false": "--no-lengths", "seed": "--seed"}


def draws_with_seed(spec: TraceSpec) -> bool:
    """Whether ``seed`` changes what the build writes: synthesis samples its corpus with it, and an
    arrival source may draw with it (gamma); an import of a file as it is does not."""
    source = registry.get(registry.WORKLOADS, spec.arrivals.source)
    return spec.corpus is not None or "seed" in inspect.signature(source).parameters


def _refuse_unused(spec: TraceSpec, source) -> None:
    """A setting this build would not read is an error naming it (and its flag), not silently
    ignored (an import given --prefixes 3 or --seed 4 wrote the very same trace)."""
    syn = spec.synthesis
    if spec.arrivals.skip_bad and "skip_bad" not in inspect.signature(type(source)).parameters:
        raise CachelabError(f"arrivals.skip_bad (--skip-bad): {spec.arrivals.source!r} reads no input rows to skip; "
                            "leave it out")
    if spec.corpus is None:
        unused = [f"synthesis.{k}" for k in sorted(syn.model_fields_set)]
        unused += ["arrivals.use_lengths = false"] if not spec.arrivals.use_lengths else []
        unused += ["seed"] if "seed" in spec.model_fields_set and not draws_with_seed(spec) else []
        why = (f"apply to synthesis, and this build imports {spec.arrivals.source!r} as it is (no corpus); give "
               "a corpus (--corpus) or leave them out")
    elif syn.prefix_overlap is None:
        unused = [f"synthesis.{k}" for k in ("prefixes", "prompt_tokens") if k in syn.model_fields_set]
        why = "apply to a shared-prefix workload only; give synthesis.prefix_overlap (--prefix-overlap) or leave them out"
    else:
        unused = ["synthesis.turn_gap_s"] if "turn_gap_s" in syn.model_fields_set else []
        why = "a shared-prefix workload (prefix_overlap) has no sessions, so no gap between turns; leave it out"
    if unused:
        named = ", ".join(f"{k} ({FLAGS[k]})" if k in FLAGS else k for k in unused)
        raise CachelabError(f"{named}: {why}")


def _skipped(source) -> dict[str, Any]:
    """The rows ``source`` skipped under skip_bad, as ``BuildReport`` fields: a one-file importer
    names them by line number, ServeGen (many files) by ``FILE:LINE``."""
    name = os.path.basename(str(getattr(source, "path", "")))
    lines = [at if isinstance(at, str) else f"{name}:{at}" for at in getattr(source, "skipped_lines", [])]
    return {"skipped_rows": int(getattr(source, "skipped", 0)), "skipped_lines": lines,
            "skipped_first": getattr(source, "first_skipped", None)}
