"""The latency model: how long a serving step takes on given hardware, and why.

A step's GPU time is a sum of per-operator rooflines, each the larger of its FLOPs at the
tensor-core rate of its precision and its bytes at HBM bandwidth, scaled by efficiency factors
(GEMM FLOPs of decode rows at ``mfu``, of prefill chunks at ``prefill_mfu``; with expert
parallelism a layer waits for the rank that holds the most touched experts):

    dense       attention projections, shared experts, routers, Engram wkv (FP8); split over
                the TP ranks except the layers a spec marks replicated, which every rank runs whole
    experts     grouped routed-expert GEMMs: FP4/FP8 FLOPs padded to a minimum tile per touched
                expert (small per-expert batches waste the MMA), against the bytes of the
                experts the step's tokens route to
    attention   QK^T and PV over the positions each query attends to (the whole context for
                dense MLA; window + top-k compressed positions for V4.1's sparse attention),
                against the KV bytes read (latent cache, or window + gathers + indexer keys; a
                V4.1 prefill chunk first copies its compressed and window regions into BF16)
    indexer     V4.1's sparse indexer scoring the compressed keys (FP8)
    lm_head     logits for every verified or final position
    draft       MTP / DSpark draft passes for decoding sequences
    residual    the residual path's activation traffic (V4.1: four hyper-connection streams and their
                mixing weights; R1: one stream's fused add-and-norm), at HBM bandwidth x ``mbu``
    comm        two all-reduces per layer over NVLink, and with a table split across the TP ranks
                the all-gather of each Engram layer's looked-up rows (BF16), whatever the placement
    overhead    a fixed cost per step, CPU costs per scheduled sequence and per prompt token
                hashed for the prefix cache

With a decoder SWA bounded replay (V4.1, ``Efficiency.decoder_replay``) a prefill chunk runs the
layers past the last KV source on its last ``sliding_window`` rows only: their dense and expert
GEMMs, attention, indexer and all-reduces are charged for those rows, the earlier layers' for every
row; the KV written is the same.

A step that runs as piecewise CUDA graphs (a CPU fetch path whose row ids come from the GPU:
host work inside the forward is illegal during capture) is launched layer by layer from
Python, so it also cannot be shorter than the host's launch of it (``host_floor_s``): the GPU
waits for the host when a step's GPU work is short and the host's launches hide behind it
when it is long.

The Engram fetch runs beside it, decomposed into its parts per placement:

    hbm         table resident in HBM (sharded over TP ranks): a gather kernel
    dram-uva    table in pinned host DRAM; the GPU gathers rows over UVA (PCIe or C2C)
    dram-copy   row ids to the CPU, dedup, CPU gather into a pinned buffer, H2D copy
    ssd-mmap    as dram-copy, but rows come through mmap and the page cache: major faults
                and SSD reads for pages not cached, and a fitted host cost per row read
                through the mapping (``Efficiency.mmap_row_s``)
    ssd-direct  pages read from the SSD straight into GPU memory (GPUDirect Storage style)

Rows found in an HBM row cache (a tier above any of these) cost an HBM gather instead.
The fetch of Engram layer L may overlap the compute of the layers before it (the prefetch
window); whatever is not hidden is a stall. The HBM the table or the row cache takes is
taken from the KV cache, which bounds the batch (``memory_plan``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from cachelab.errors import CachelabError
from cachelab.serving.hardware import HardwareProfile
from cachelab.serving.model_spec import ModelSpec

PLACEMENTS = ("hbm", "dram-uva", "dram-copy", "ssd-mmap", "ssd-direct")
CPU_PATHS = ("dram-copy", "ssd-mmap", "ssd-direct")
PAGE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of peak a real serving stack reaches, and fixed costs. Defaults are
    ASSUMPTIONS of the order published for vLLM/SGLang on Hopper and Blackwell (MFU 40-60% for
    large GEMMs, 70-85% of HBM bandwidth for weight streaming); ``cachelab study inferencex``
    fits the ones named in ``calibration.FITTED`` on published measurements."""

    # GEMMs of decode / verify rows (a few rows per expert): fitted, but only with cpu_per_sequence_s,
    # which also grows with the batch: the fit subsets pin their sum per sequence, not either alone
    mfu: float = 0.5
    mbu: float = 0.75
    # GEMMs of prefill chunks (thousands of rows): a different regime from decode's, and one the
    # decode-heavy fit subset barely sees; derived from DeepSeek's published production prefill
    # throughput with this model's own FLOP count (``calibration.published_prefill_mfu``)
    prefill_mfu: float = 0.176
    attention_mfu: float = 0.4  # sparse / MLA attention kernels reach less than dense GEMMs
    comm: float = 0.7  # of NVLink bandwidth an all-reduce reaches
    allreduce_latency_s: float = 8e-6
    step_overhead_s: float = 0.4e-3  # scheduler, sampling, launches (CUDA graphs)
    layer_overhead_s: float = 30e-6  # per layer per step: kernel tails and small kernels no roofline sees
    request_overhead_s: float = 20e-3  # per request: HTTP, tokenisation, admission; adds to TTFT
    cpu_per_sequence_s: float = 10e-6  # host work per scheduled sequence per step (batch building, detokenising)
    cpu_per_prefix_token_s: float = 20e-9  # hashing a prompt token's block for the prefix cache
    # Host work per token the step computes (0 on a GPU, where it is in the kernels): on a CPU
    # engine the per-token glue between the timed operators (embedding, norms, residual adds,
    # activation copies), fitted by `cachelab calibrate` on the untimed remainder of the step.
    cpu_per_token_s: float = 0.0
    expert_tile_rows: int = 16  # a touched expert's GEMM computes at least this many rows (swap-AB tiles)
    # Host time to launch one layer of a piecewise step (its graph pieces and the eager attention
    # between them); a piecewise step takes at least step_overhead_s + this x the layers it runs.
    # Fitted, on one named subset: the SSD recipe's agentic sweep (SSD over pinned-DRAM UVA throughput,
    # B200 TP4, https://github.com/SemiAnalysisAI/InferenceX/blob/main/analysis/ssd_offload/VLLM-PR-BODY.md)
    # at 1-8 clients, where the PR body says its host cost dominates (``studies.semianalysis.
    # fitted_piecewise_layer_s``, refitted after every efficiency fit); its 16-64 clients and the 8k/1k
    # pair are held out. This default is the fit with the efficiencies fitted on ``calibration.
    # EFFICIENCY_SUBSETS`` (R1 1k/1k run 1 and the B200 TP4 point).
    piecewise_layer_s: float = 464e-6
    # A host cost every piecewise step pays on top of its GPU work (0: none). The PR body's offset
    # "does not scale with batch size"; read that way (additive at every step, not a floor) it is
    # 2.6 ms x the acceptance length: a what-if of the study, contradicted by the held-out 8k/1k
    # pair, where the SSD arm's TPOT is the UVA arm's (docs/serving.md).
    piecewise_step_offset_s: float = 0.0
    # A host cost a piecewise step pays per token of context its sequences hold, serialized with the step
    # (0: none). No source names one: the PR body's SSD cost is 2.1-3.2 ms a token on the agentic trace (~190k
    # tokens of context a sequence) and none on the 8k/1k pair, which the model's context-free host terms cannot
    # both give; a what-if of the study spans its plausible range (``studies.ssd_context``), in this form
    # (it grows with the batch too) and the next (it does not).
    piecewise_context_token_s: float = 0.0
    # The same cost per token of the step's mean context, whatever its batch (the PR body's offset "does not
    # scale with batch size"): the what-if's other form (0: none).
    piecewise_step_context_s: float = 0.0
    # Host time per distinct row the ssd-mmap gather reads through the mapping beyond the gather rate
    # timed here (``[cpu] gather_rows_per_s``, on a 3 GiB mapping whose every page was touched first):
    # faults that map a page on its first touch (1.6 us a row timed here with them kept in,
    # ``benchmarks/bench_engram_host_path.py --cold``), page walks of a rank's 47 GiB private mapping.
    # Binds where a step reads many rows: a prefill chunk (98k a rank a layer for a 16k-token chunk at
    # TP4), behind the one layer of window before Engram layer 1. 0: not charged. The study's what-if
    # fits it jointly with ``piecewise_layer_s`` on the PR body's throughput and P90 TTFT
    # (``studies.ssd_floor.fit_ssd_host``); as a cost every step pays, the held-out points reject it.
    mmap_row_s: float = 0.0
    uva_efficiency: float = 0.6  # of link bandwidth for scattered 128 B UVA reads
    copy_efficiency: float = 0.9  # of link bandwidth for a bulk H2D copy
    line_bytes: int = 128  # a GPU gather moves whole 128 B lines: a 264 B row costs 3
    memory_utilization: float = 0.9  # vLLM's gpu_memory_utilization default
    host_addressing: bool = False  # CPU paths: row ids computed on the host ahead of the step (True)
    # or, as in the SSD path SemiAnalysis measured, by the GPU's hash kernel and copied to the host
    # at the start of the forward, each Engram layer gathered by its own worker (False): then the
    # step runs as piecewise CUDA graphs (a host read is illegal during capture, InferenceX
    # dsv41flashssd script) and has the host floor
    graph_break_s: float = 50e-6  # the forward thread waited for a fetch: the GPU drained and waits for the relaunch
    # Piecewise CPU paths: each Engram layer's host gather runs on its own worker from the start of
    # the step, behind the layers before it (True: the InferenceX SSD patch's overlapped build), or
    # inline on the forward thread when the step reaches the Engram layer (False: the patch's first
    # build, "measured against an otherwise identical inline build run back to back",
    # https://github.com/SemiAnalysisAI/InferenceX/blob/main/analysis/ssd_offload/VLLM-PR-BODY.md).
    # Inline, nothing hides the fetch: the forward thread, which launches the rest of the piecewise
    # step, waits for all of it (the ids' device-to-host copy, dedup, gather, copy back).
    host_gather_overlap: bool = True
    # Decoder SWA bounded replay: a prefill runs the layers from the spec's ``decoder_replay_start`` on
    # each request's last ``sliding_window`` rows only, the layers before it on every row (vLLM's V4.1
    # port: "layers 0-20 still run on every token", layers 21-39 "on each request's last 128 tokens
    # only, cold prefills included", https://github.com/vllm-project/vllm/pull/56752 and its
    # re-submission /pull/58132; DecoderReplayLayers in vllm/models/deepseek_v41/decoder_replay_layers.py).
    # Off (every layer on every row) by default, because no published V4.1 measurement ran a build that
    # had it: #56752 was opened on 2026-09-14 stacked on the unmerged encoder side (#56227) and closed
    # unmerged, #58132 was opened on 2026-09-22, and vLLM's V4.1 tracking issue (#57448) still lists the
    # decoder side open that day; the 8k/1k pair ran a vLLM tree of 2026-09-13 (the InferenceX SSD
    # patch, benchmarks/patches/vllm-dsv41flash-engram-ssd.patch, is cut against its
    # models/deepseek_v4_1/ files), the agentic sweeps the 2026-09-15 nightly
    # (vllm-project/recipes#981: vllm/vllm-openai:nightly-cd10ed6f9...), and the article is of
    # 2026-09-18. True: a vLLM build carrying #58132 (gated there on ``--swa-bounded-replay`` and model
    # runner V2, which DSpark forces) or SGLang with ``--enable-decoder-swa-bounded-replay``. A no-op
    # for a spec without ``decoder_replay_start``.
    decoder_replay: bool = False
    activation_reserve_bytes: float = 6e9  # activations, CUDA graphs, NCCL buffers per GPU


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's sequences: each row computes the queries at contexts ``(lo, hi]``; ``weight``
    is how many sequences the row stands for (1 in a replay, fractional in the steady-state
    model). ``lm_rows``: positions that need logits; ``drafting``: sequences that draft;
    ``prefix_tokens``: prompt tokens hashed for the prefix cache this step."""

    lo: np.ndarray
    hi: np.ndarray
    weight: np.ndarray = field(default=None)
    lm_rows: float | None = None
    drafting: float = 0.0
    prefix_tokens: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "lo", np.asarray(self.lo, np.float64))
        object.__setattr__(self, "hi", np.asarray(self.hi, np.float64))
        w = np.ones_like(self.lo) if self.weight is None else np.asarray(self.weight, np.float64)
        object.__setattr__(self, "weight", w)

    @property
    def tokens(self) -> float:
        return float((self.weight * (self.hi - self.lo)).sum())

    @property
    def sequences(self) -> float:
        return float(self.weight.sum())


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per GPU: where HBM goes. KV tokens are per replica (the latent cache is per rank)."""

    usable_bytes: float
    weight_bytes: float
    table_bytes: float
    row_cache_bytes: float
    kv_bytes: float
    kv_tokens: int
    indexer_buffer_bytes: float = 0.0  # the sparse indexer's logits buffer at the step's token budget


@dataclass(frozen=True, slots=True)
class EngramStep:
    """One Engram layer's rows in one step (counts at full scale, not sampled)."""

    lookups: float = 0.0  # row lookups (tokens x rows per token)
    unique: float = 0.0  # distinct rows
    cache_hits: float = 0.0  # distinct rows served by the HBM row cache
    page_cache_rows: float = 0.0  # distinct rows served from the OS page cache
    page_reads: float = 0.0  # 4 KiB pages read from the SSD


OPERATORS = ("dense_s", "experts_s", "attention_s", "indexer_s", "lm_head_s", "draft_s", "residual_s")


@dataclass(frozen=True, slots=True)
class GpuTime:
    """Seconds of GPU work in one step, by operator; ``total_s`` is their sum plus comm and
    overhead."""

    dense_s: float
    experts_s: float
    attention_s: float
    indexer_s: float
    lm_head_s: float
    draft_s: float
    residual_s: float
    comm_s: float
    overhead_s: float
    total_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LayerFetch:
    """One Engram layer's fetch in a step: its prefetch window, its parts (``fetch_parts``)
    and their critical path."""

    layer: int
    window_s: float
    fetch_s: float
    parts: dict[str, float]  # seconds per part; which parts depends on the placement


@dataclass(frozen=True, slots=True)
class StepTime:
    """A step's time: GPU work plus the stall the Engram fetches did not hide, or the host's
    launch of a piecewise step (``host_floor_s``; 0 when the step is captured whole), whichever
    is longer."""

    gpu: GpuTime
    fetches: tuple[LayerFetch, ...]
    stall_s: float
    step_s: float
    host_floor_s: float = 0.0

    def to_dict(self) -> dict:
        """Flat: the GPU parts, then per layer L ``engramL_window_s``, ``engramL_fetch_s`` and
        ``engramL_<part>``, then ``stall_s``, ``host_floor_s`` and ``step_s``."""
        out = self.gpu.to_dict()
        for f in self.fetches:
            out[f"engram{f.layer}_window_s"] = f.window_s
            out[f"engram{f.layer}_fetch_s"] = f.fetch_s
            out.update({f"engram{f.layer}_{key}": value for key, value in f.parts.items()})
        out["stall_s"] = self.stall_s
        out["host_floor_s"] = self.host_floor_s
        out["step_s"] = self.step_s
        return out


class LatencyModel:
    """Step time for ``model`` on ``hardware`` at tensor-parallel degree ``tp``.

    Args:
        placement: one of PLACEMENTS.
        row_cache_bytes: HBM per GPU for a row cache in front of the placement.
        table_bytes: the Engram table's bytes where they are not the model layout's (a live
            store's scaled tables); what placement ``hbm`` holds in HBM.
        max_num_batched_tokens: the scheduler's token budget per step, for the HBM a model
            reserves per batched token (V4.1's indexer logits buffer).
    """

    def __init__(self, model: ModelSpec, hardware: HardwareProfile, tp: int = 1, placement: str = "dram-uva",
                 row_cache_bytes: float = 0.0, efficiency: Efficiency = Efficiency(), ep: int = 1,
                 table_bytes: float | None = None, max_num_batched_tokens: int = 8192):
        if placement not in PLACEMENTS:
            raise CachelabError(f"unknown placement {placement!r}; use one of {list(PLACEMENTS)}")
        if hardware.gpu is None or hardware.host is None:
            raise CachelabError(f"hardware profile {hardware.name!r} has no [gpu] or [host] section; "
                                "a serving model needs a GPU profile (H100, H200, B200, B300, GB200, GH200)")
        if tp < 1 or tp > hardware.gpu.nvlink_domain:
            raise CachelabError(f"--tp {tp} is outside 1..{hardware.gpu.nvlink_domain}, "
                                f"the NVLink domain of {hardware.name}")
        model.check_tp(tp)
        if placement.startswith("ssd") and hardware.ssd is None:
            raise CachelabError(f"placement {placement!r} needs an [ssd] section in {hardware.source}")
        if ep not in (1, tp):
            raise CachelabError(f"expert parallelism {ep} must be 1 (experts sharded over TP) or the TP degree {tp}")
        self.model, self.hw, self.tp, self.placement, self.ep = model, hardware, int(tp), placement, int(ep)
        self.row_cache_bytes = float(row_cache_bytes)
        self.table_bytes = model.table_bytes if table_bytes is None else float(table_bytes)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.eff = efficiency
        self.plan = self.memory_plan()

    # -- memory ------------------------------------------------------------------------------
    def memory_plan(self) -> MemoryPlan:
        m, g, e = self.model, self.hw.gpu, self.eff
        usable = g.hbm_bytes * e.memory_utilization - e.activation_reserve_bytes
        weights = m.rank_weight_bytes(self.tp)
        table = self.table_bytes / self.table_shards if self.placement == "hbm" else 0.0
        buffer = m.indexer_buffer_bytes(self.max_num_batched_tokens)
        kv = usable - weights - table - buffer - self.row_cache_bytes
        per_token = m.kv_bytes_per_token if m.kv_replicated_across_tp else m.kv_bytes_per_token / self.tp
        if kv <= 0:
            GIB = 2**30  # binary, as serve-sim's flags and its other lines: "2 GiB" of row cache read "2.1 GB" here
            raise CachelabError(
                f"{m.name} does not fit {self.hw.name} at TP{self.tp} with placement {self.placement}: per GPU "
                f"{usable / GIB:.2f} GiB usable, weights {weights / GIB:.2f} GiB, table {table / GIB:.2f} GiB, "
                f"indexer buffer {buffer / GIB:.2f} GiB ({self.max_num_batched_tokens} batched tokens), "
                f"row cache {self.row_cache_bytes / GIB:.2f} GiB leave no KV cache ({kv / GIB:+.2f} GiB)")
        return MemoryPlan(usable, weights, table, self.row_cache_bytes, kv, int(kv // per_token), buffer)

    # -- compute -----------------------------------------------------------------------------
    def _roofline(self, compute_s: float, nbytes: float) -> float:
        return max(compute_s, nbytes / (self.hw.gpu.hbm_bw * self.eff.mbu))

    def _gemm_s(self, flops: float, peak: float, decode_share: float) -> float:
        """Seconds of ``flops`` at ``peak``: the decode rows' share at ``mfu``, the prefill
        chunks' at ``prefill_mfu`` (one GEMM efficiency cannot describe both: decode GEMMs
        have a few rows per expert, prefill chunks thousands)."""
        d = min(max(decode_share, 0.0), 1.0)
        return flops * (d / (peak * self.eff.mfu) + (1.0 - d) / (peak * self.eff.prefill_mfu))

    def gpu_time(self, batch: Batch) -> GpuTime:
        """Seconds of GPU work in a step, per operator (see the module docstring)."""
        m, g, e, tp = self.model, self.hw.gpu, self.eff, self.tp
        tokens = batch.tokens
        if tokens <= 0:
            return GpuTime(*([0.0] * 10))
        w, lo, hi = batch.weight, batch.lo, batch.hi
        fp8 = g.fp8_flops * e.mfu
        prefill = (hi - lo) > 1 + m.speculative_tokens  # a prefill chunk, not a decode / verify row
        chunk = float((w * (hi - lo))[prefill].sum())  # prefill-chunk tokens: GEMMs at prefill_mfu
        decode_share = 1.0 - chunk / tokens
        dense_rank = m.rank_dense_params(tp)  # replicated layers whole on every rank, the rest split
        # with a bounded replay the replayed layers compute each row's last window only (late_lo)
        late_lo = m.replay_lo(lo, hi) if e.decoder_replay and m.decoder_replay_start else None
        if late_lo is not None and not np.any(late_lo > lo):
            late_lo = None  # no row longer than the window: nothing is trimmed
        if late_lo is None:
            dense_flops = self._gemm_s(2 * dense_rank * tokens, g.fp8_flops, decode_share)
            groups = [(m.moe_layers, tokens, chunk)]  # (MoE layers, tokens, prefill-chunk tokens) per group
        else:
            late_rows = w * (hi - late_lo)
            late_tokens, late_chunk = float(late_rows.sum()), float(late_rows[prefill].sum())
            late = m.replayed_layers / m.layers  # the Engram wkv sits in the early layers, with every row
            per_layer = dense_rank - m.rank_engram_params(tp)
            dense_flops = (self._gemm_s(2 * (dense_rank - late * per_layer) * tokens, g.fp8_flops, decode_share)
                           + self._gemm_s(2 * late * per_layer * late_tokens, g.fp8_flops, 1.0 - late_chunk / late_tokens))
            groups = [(m.moe_layers - m.replayed_moe_layers, tokens, chunk),
                      (m.replayed_moe_layers, late_tokens, late_chunk)]
        dense = self._roofline(dense_flops, dense_rank * m.dense_bytes_per_param)
        # routed experts: touched experts, each padded to a tile of rows (the padding is decode's)
        expert_peak = g.fp4_flops if m.expert_precision == "fp4" else g.fp8_flops
        expert_compute, expert_bytes = 0.0, 0.0
        for layers, n, prefill_n in groups:
            touched = m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** n)
            rows = max(n * m.experts_per_token, touched * e.expert_tile_rows) if n else 0.0
            expert_compute += self._gemm_s(2 * layers * m.expert_params * rows / tp, expert_peak,
                                           1.0 - prefill_n * m.experts_per_token / rows if rows else 1.0)
            expert_bytes += float(m.touched_expert_bytes(n, layers)) / tp * self.expert_imbalance(n)
        experts = self._roofline(expert_compute, expert_bytes)
        positions = w * m.attended_positions(lo, hi, late_lo)
        attn_flops = float(np.where(prefill, m.prefill_attn_flops_per_position, m.attn_flops_per_position)
                           @ positions) if positions.ndim else m.attn_flops_per_position * float(positions)
        late = None if late_lo is None else hi - late_lo
        kv_rows, gather = m.kv_read_bytes(hi - lo, hi, late), 0.0
        if m.prefill_gather_bytes_per_position and np.any(prefill):  # prefill reads a workspace it fills first
            kv_rows = np.where(prefill, m.kv_read_bytes(hi - lo, hi, late, gathered=True), kv_rows)
            gather = float((w * m.prefill_gather_bytes(hi - lo, hi))[prefill].sum())  # its own kernel: not overlapped
        kv = float((w * kv_rows).sum())
        if not m.kv_replicated_across_tp:
            kv, gather = kv / tp, gather / tp
        attention = (self._roofline(attn_flops / (tp * g.bf16_flops * e.attention_mfu), kv)
                     + gather / (g.hbm_bw * e.mbu))
        indexer = 0.0
        if m.index_sources:
            scored = w * m.indexer_positions(lo, hi, late_lo)
            total = float(scored.sum())
            shards = 1 if m.index_replicated_across_tp else tp  # a replicated indexer runs whole on every rank
            indexer = self._gemm_s(2.0 * m.index_heads * m.index_head_dim * total / shards, g.fp8_flops,
                                   1.0 - float(scored[prefill].sum()) / total if total else 1.0)
        lm_rows = batch.sequences if batch.lm_rows is None else batch.lm_rows
        lm_head = self._roofline(2 * m.lm_head_params * lm_rows / (tp * fp8), m.lm_head_params * m.dense_bytes_per_param / tp)
        draft = 0.0
        drafted = batch.drafting * m.speculative_tokens if m.speculative_tokens and batch.drafting > 0 else 0.0
        passes = m.draft_passes_per_step if drafted else 0
        if drafted:
            per_pass = drafted / passes  # tokens one draft pass computes
            draft = passes * self._roofline(
                2 * m.draft_active_params * per_pass / (tp * fp8), float(m.draft_read_bytes(per_pass)) / tp)
        # the residual streams, whole on every rank, in every layer a row runs through (the draft layers'
        # for each drafted token), and the Engram lookups written into them (every row: the early layers)
        rows = tokens * m.layers if late_lo is None else (
            tokens * m.decoder_replay_start + late_tokens * m.replayed_layers)
        residual = ((rows + drafted * m.draft_layers) * m.residual_bytes_per_token_layer
                    + (m.layers + passes * m.draft_layers) * m.residual_weight_bytes_per_layer
                    + tokens * len(m.engram_layers) * m.injection_bytes_per_token_layer) / (g.hbm_bw * e.mbu)
        comm = 0.0
        if tp > 1:
            for layers, n in ((m.layers, tokens),) if late_lo is None else (
                    (m.decoder_replay_start, tokens), (m.replayed_layers, late_tokens)):
                volume = 2.0 * (tp - 1) / tp * n * m.hidden * 2  # ring all-reduce of BF16 activations
                comm += 2 * layers * (e.allreduce_latency_s + volume / (g.nvlink_bw * e.comm))
            if m.table_sharded_across_tp and m.engram_layers:  # all-gather of the gathered rows, every placement
                gathered = tokens * m.rows_per_token_layer * m.gathered_row_bytes * (tp - 1) / tp
                comm += len(m.engram_layers) * (e.allreduce_latency_s + gathered / (g.nvlink_bw * e.comm))
        overhead = (e.step_overhead_s + e.layer_overhead_s * m.layers_launched(batch.drafting > 0)
                    + e.cpu_per_sequence_s * batch.sequences + e.cpu_per_prefix_token_s * batch.prefix_tokens
                    + e.cpu_per_token_s * tokens)
        parts = (dense, experts, attention, indexer, lm_head, draft, residual)
        return GpuTime(*parts, comm, overhead, sum(parts) + comm + overhead)

    def expert_imbalance(self, tokens: float) -> float:
        """With expert parallelism each rank holds E / EP whole experts, and a layer waits for the
        rank whose tokens touched the most of its own: the expected maximum over EP ranks of a
        binomial count (normal approximation; expected maxima of EP standard normals: 0.56, 1.03,
        1.42, 1.77 for 2, 4, 8, 16), over the mean. Experts sharded over TP ranks balance exactly."""
        if self.ep == 1 or tokens <= 0:
            return 1.0
        m = self.model
        per_rank = m.experts / self.ep
        p = 1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens
        mean = per_rank * p
        z = {2: 0.5642, 4: 1.0294, 8: 1.4236, 16: 1.7660}.get(self.ep, float(np.sqrt(2 * np.log(self.ep))))
        return min(per_rank, mean + z * np.sqrt(per_rank * p * (1 - p))) / mean if mean > 0 else 1.0

    @property
    def piecewise(self) -> bool:
        """Whether steps run as piecewise CUDA graphs: a CPU fetch path whose row ids come from
        the GPU does host work inside the forward, which full-graph capture forbids."""
        return self.placement in CPU_PATHS and not self.eff.host_addressing and bool(self.model.engram_layers)

    def host_floor_s(self, batch: Batch) -> float:
        """The shortest a piecewise step can be: the host launches every layer it runs (the
        backbone's, and the draft's when the step drafts) plus the fixed per-step work; 0 for a
        step captured whole."""
        if not self.piecewise or batch.tokens <= 0:
            return 0.0
        return self.eff.step_overhead_s + self.eff.piecewise_layer_s * self.model.layers_launched(batch.drafting > 0)

    # -- the Engram fetch --------------------------------------------------------------------
    def fetch_parts(self, work: EngramStep) -> dict:
        """Seconds per part of one Engram layer's fetch; ``total_s`` is their critical path."""
        e, g, h, cpu = self.eff, self.hw.gpu, self.hw.host, self.hw.cpu
        work = self.rank_share(work)
        lines = -(-self.model.row_bytes // e.line_bytes) * e.line_bytes
        parts = {"hbm_gather_s": work.cache_hits * lines / (g.hbm_bw * e.mbu)}
        rows = work.unique - work.cache_hits  # rows the placement must deliver
        if work.unique <= 0:
            return {**parts, "total_s": 0.0}
        if self.placement == "hbm":
            parts["hbm_gather_s"] += rows * lines / (g.hbm_bw * e.mbu)
            parts["total_s"] = parts["hbm_gather_s"]
            return parts
        if self.placement == "dram-uva":
            parts["uva_read_s"] = (h.link_latency_s + rows * lines / (h.link_bw * e.uva_efficiency)) if rows > 0 else 0.0
            parts["total_s"] = parts["hbm_gather_s"] + parts["uva_read_s"]
            return parts
        # The CPU paths: ids to the host, dedup, (faults), gather into pinned memory, copy back.
        threads = cpu.threads
        missing = work.lookups * rows / work.unique  # lookups sent to the host (row-cache misses)
        parts["round_trip_s"] = cpu.round_trip_s
        parts["cpu_dedup_s"] = missing / (cpu.dedup_rows_per_s * threads)
        if self.placement == "ssd-direct":
            pages = work.page_reads
            parts["device_reads_s"] = self._device_reads_s(pages)
            parts["dma_s"] = pages * PAGE_BYTES / (h.link_bw * e.copy_efficiency)
            parts["total_s"] = (parts["hbm_gather_s"] + parts["round_trip_s"] + parts["cpu_dedup_s"]
                                + max(parts["device_reads_s"], parts["dma_s"]))
            return parts
        critical = 0.0
        if self.placement == "ssd-mmap":
            pages = work.page_reads
            parts["device_reads_s"] = self._device_reads_s(pages)
            parts["page_faults_s"] = pages * cpu.major_fault_s / threads
            critical = max(parts["device_reads_s"], parts["page_faults_s"])
            parts["mmap_rows_s"] = rows * e.mmap_row_s / threads
            critical += parts["mmap_rows_s"]
        parts["cpu_gather_s"] = rows / (cpu.gather_rows_per_s * threads)
        parts["h2d_copy_s"] = rows * self.model.row_bytes / (h.link_bw * e.copy_efficiency)
        parts["total_s"] = (parts["hbm_gather_s"] + parts["round_trip_s"] + parts["cpu_dedup_s"] + critical
                            + parts["cpu_gather_s"] + parts["h2d_copy_s"])
        return parts

    def _device_reads_s(self, pages: float) -> float:
        """Seconds of SSD reads for ``pages`` 4 KiB pages: one read's latency, then the rest at the
        device's IOPS. A fractional count is an expectation (the steady-state model's): a step
        expected to miss p < 1 pages waits for a read with probability about p, so it is charged
        p x the latency rather than all of it."""
        if pages <= 0:
            return 0.0
        ssd = self.hw.ssd
        return ssd.latency_s * min(1.0, pages) + pages / ssd.iops_4k

    @property
    def table_shards(self) -> int:
        """The ranks an Engram table is split across: the TP degree where the model shards it
        by hash head, else 1 (every rank holds and reads every row)."""
        return self.tp if self.model.table_sharded_across_tp else 1

    def rank_share(self, work: EngramStep) -> EngramStep:
        """One TP rank's part of a layer's rows. vLLM splits each Engram table across the TP
        ranks by hash head (8 heads x 3 n-gram orders = 24 rows per token; a rank holds and
        gathers its heads' rows: vllm-project/vllm#56757, and the InferenceX SSD recipe's 23.60 GiB
        per rank per layer at TP4), so every placement's per-GPU work is 1/TP of the replica's
        and the ranks fetch in parallel, each on its own link and host thread."""
        if self.table_shards == 1:
            return work
        s = 1.0 / self.table_shards
        return EngramStep(work.lookups * s, work.unique * s, work.cache_hits * s, work.page_cache_rows * s,
                          work.page_reads * s)

    def step_time(self, batch: Batch, engram: list[EngramStep]) -> StepTime:
        """The step: GPU time, each Engram layer's fetch and window, the stall not hidden, and
        (piecewise steps) the host floor.

        GPU paths fetch one layer after another on a side stream, starting with the step; layer
        L's rows are needed when the L layers before it have run. CPU paths fetch each Engram
        layer on its own host worker, all starting with the step: the InferenceX SSD patch
        (``prepare_embeddings``) copies the step's row ids to the host before the decoder layers
        and hands each layer's gather to that layer's one-thread pool, and the layer's ``embed``
        waits for it; a wait drains the GPU, which then waits ``graph_break_s`` for the relaunch.
        ``host_addressing`` (ids computed on the host ahead of the step) fetches on one thread.
        Without ``host_gather_overlap`` (the patch's inline build) a CPU path's fetch starts when
        the forward thread reaches the Engram layer and nothing hides it: the GPU waits for all of
        it, and so does the host's launch of a host-bound step.
        """
        gpu = self.gpu_time(batch)
        layer_s = (gpu.total_s - gpu.overhead_s) / self.model.layers
        stall = 0.0
        fetch_done = 0.0
        fetches = []
        inline = self.piecewise and not self.eff.host_gather_overlap
        blocked = 0.0  # host time the forward thread spends gathering inline
        for layer, work in zip(self.model.engram_layers, engram):
            parts = self.fetch_parts(work)
            needed = layer * layer_s + stall  # main stream reaches layer L (after earlier stalls)
            if inline:
                fetch_done = needed + parts["total_s"]  # on the forward thread, once it reaches layer L
                blocked += parts["total_s"]
            elif self.piecewise:
                fetch_done = parts["total_s"]  # its own worker, from the start of the step
            else:
                fetch_done += parts["total_s"]
            wait = max(0.0, fetch_done - needed)
            if self.piecewise and wait > 0:
                wait += self.eff.graph_break_s
            stall += wait
            fetches.append(LayerFetch(layer, 0.0 if inline else layer * layer_s, parts["total_s"],
                                      {k: v for k, v in parts.items() if k != "total_s"}))
        floor = self.host_floor_s(batch)
        offset = self.eff.piecewise_step_offset_s if floor > 0 else 0.0
        # an inline gather blocks the thread that launches the step: a host-bound step waits for it too
        host = floor + blocked if floor > 0 else 0.0
        context = 0.0
        if floor > 0:
            held = float((batch.weight * batch.hi).sum())
            context = self.eff.piecewise_context_token_s * held + self.eff.piecewise_step_context_s * held / batch.sequences
        return StepTime(gpu, tuple(fetches), stall, max(gpu.total_s + stall + offset, host) + context, floor)


def describe(lat: LatencyModel) -> dict:
    """The memory plan and configuration, for reports and --json."""
    return {"hardware": lat.hw.name, "tp": lat.tp, "placement": lat.placement, "model": lat.model.name,
            "memory_plan_per_gpu": {k: float(v) for k, v in asdict(lat.plan).items()},
            "efficiency": asdict(lat.eff)}

