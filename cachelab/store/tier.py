"""One cache tier holding real rows: a policy decides, the tier moves the bytes by slot.

The policy's ``step`` says which of a step's distinct rows hit, which were admitted into
which slot, and which left. The tier keeps its own map from row key to slot (4 bytes per
table row), reads hits out of their slots before anything of this step is written (a row
hit early in a step may be evicted later in the same step), and writes each admitted row
that is still resident at the end of the step into its slot. A row can be admitted and
evicted within one step when the step holds more distinct rows than the tier; its bytes are
then never written, since no later step can hit it.
"""

from __future__ import annotations

import numpy as np

from cachelab import registry
from cachelab.engine.cascade import sized
from cachelab.errors import CachelabError
from cachelab.policy import Policy, StepResult
from cachelab.policy.clock import on_clock
from cachelab.store.kernels import copy_rows
from cachelab.workload.compaction import compact
from cachelab.workload.lookups import global_key


class CacheTier:
    """A policy of ``capacity`` rows over slots of ``row_bytes`` in ``memory``: a NumPy view of the
    tier's host buffer, or the torch tensor of a tier in device memory (with CUDA, the HBM row
    cache). ``rows``, the slots, is the capacity, or fewer where the policy holds every row at
    that capacity and runs as the infinite cache (its slots fill in order, one per row)."""

    def __init__(self, name: str, policy: Policy, capacity: int, num_keys: int, memory):
        caps = policy.capabilities
        if caps.needs_future:
            raise CachelabError(f"policy {policy.name!r} ({name} tier) needs the future; a live store serves one "
                                "step at a time and cannot give it")
        self.name, self.capacity, self.memory, self.rows = name, int(capacity), memory, int(memory.shape[0])
        self.policy = sized(policy, self.capacity, num_keys)  # holding every row: the simulator's infinite cache
        self.slot_of = np.full(num_keys, -1, np.int32 if num_keys < 2**31 else np.int64)
        self.accesses = 0  # the policy's clock: keys it was handed since its reset

    @property
    def host_bytes(self) -> int:
        """Host memory the tier holds: its slot map, and its slots unless they are a GPU's (with
        CUDA the HBM row cache's slot map is still host memory: it was left out of the count)."""
        return self.slot_of.nbytes + (self.memory.nbytes if isinstance(self.memory, np.ndarray) else 0)

    @property
    def needs_scores(self) -> bool:
        return self.policy.capabilities.needs_scores

    @property
    def needs_counts(self) -> bool:
        return self.policy.capabilities.needs_counts

    @property
    def needs_raw_keys(self) -> bool:
        return self.policy.capabilities.needs_raw_keys

    def check_scores(self, scores) -> None:
        """Refuse a step without the scores this tier's policy needs, before any tier steps."""
        if self.needs_scores and scores is None:
            raise CachelabError(f"policy {self.policy.name!r} ({self.name} tier) needs predictor scores: "
                                "pass scores= to lookup/prefetch")

    def lookup(self, keys: np.ndarray, scores: np.ndarray | None, counts: np.ndarray | None = None,
               made_at: np.ndarray | None = None, raw_keys: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, StepResult]:
        """The policy's step on ``keys`` (distinct; ``counts``: each one's lookups in the step, for a
        policy that declares ``needs_counts``; ``made_at``: the scorer's position of each score,
        re-based onto the policy's clock; ``raw_keys``: each key's row as the engine names it, for
        a policy that declares ``needs_raw_keys``); returns (hit mask, hit slots, result)."""
        more = {"counts": counts} if self.needs_counts and counts is not None else {}
        if self.needs_raw_keys and raw_keys is not None:
            more["raw_keys"] = raw_keys
        if self.needs_scores and scores is not None and made_at is not None:
            scores = on_clock(scores, made_at, self.accesses)
        self.accesses += keys.size
        res = self.policy.step(keys, None, scores if self.needs_scores else None, **more)
        slots = self.slot_of[keys[res.hits]]
        if slots.size and slots.min() < 0:
            bad = keys[res.hits][np.flatnonzero(slots < 0)[0]]
            raise CachelabError(f"policy {self.policy.name!r} ({self.name} tier) reported a hit on key {int(bad)} "
                                "(rows numbered by first use), which it never admitted")
        return res.hits, slots.astype(np.int64), res

    def gather(self, slots: np.ndarray, dst: np.ndarray, out, indices=None) -> None:
        """``out[dst[i]] = slot slots[i]``'s row (``indices``: a tier in device memory's
        ``IndexStaging``, which takes the index arrays there)."""
        _move_rows(self.memory, slots, out, dst, indices)

    def commit(self, res: StepResult, src: np.ndarray, src_index: np.ndarray, indices=None) -> int:
        """Apply the step's admissions and evictions; admitted key ``res.admitted[i]``'s bytes
        are ``src[src_index[i]]`` (``indices`` as ``gather``'s). Returns the rows written."""
        adm, slots, ev = res.admitted, res.slots, res.evicted
        if adm.size:
            was = self.slot_of[adm] >= 0
            evs = np.sort(ev)
            evicted_n = np.searchsorted(evs, adm, "right") - np.searchsorted(evs, adm, "left")
            stays = was.astype(np.int64) + 1 - evicted_n == 1
        if ev.size:
            self.slot_of[ev] = -1
        if not adm.size:
            return 0
        adm, slots, idx = adm[stays], slots[stays], src_index[stays]
        self.slot_of[adm] = slots
        _move_rows(src, idx, self.memory, slots.astype(np.int64), indices)
        return int(slots.size)

    def clear(self) -> None:
        """Empty the tier: its policy reset, every slot forgotten. After a step failed between
        the policy's ``step`` and the ``commit`` (a backing read error, an interrupt), the policy
        holds rows whose bytes never reached their slots; nothing short of this undoes it."""
        self.policy.reset(self.capacity, self.slot_of.size)
        self.slot_of.fill(-1)
        self.accesses = 0


def tier_memory(name: str, rows: int, row_bytes: int, device):
    """A tier's ``rows`` slots: the HBM row cache on a GPU in its memory (a torch tensor), any
    other tier a CPU tensor's host memory, as NumPy (on the CPU a stand-in for HBM). Never pinned:
    no copy reads the DRAM cache over the host link (the CPU gathers its hits into the store's
    pinned staging), and torch's pinned allocator rounds each block up to a power of two, so a
    pinned DRAM cache locked up to twice its capacity, past the store's check of host memory."""
    import torch

    cuda = name == "hbm" and device.type == "cuda"
    mem = torch.empty((rows, row_bytes), dtype=torch.uint8, device=device if cuda else "cpu")
    return mem if cuda else mem.numpy()


def device_free(device) -> int:
    """Bytes a new tensor can take on CUDA ``device``: the driver's free memory and what torch's
    caching allocator holds unused (a closed store's slots, kept for reuse). The driver's figure
    alone refused a second store of a tier over half the GPU, the first's slots cached (``store
    bench`` opens one for its warm-up, then the one it times)."""
    import torch

    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def scorer_positions(row_ids, first: np.ndarray, scored: int) -> tuple[np.ndarray, int]:
    """The scorer's position of each of a step's distinct keys' score (made at its ``first``
    lookup), and the scorer's clock after the step (``scored`` before it). Scores are positions
    on the clock of the full-layout rows, each step's distinct ones in order, as ``lookup_scores``
    and ``OnlineScorer`` number them; the fold merges rows that collide, so the store counts them
    here, from the row ids ``[..., layers, columns]`` it is handed."""
    rows = np.asarray(row_ids, dtype=np.int64)
    inverse, uniq = compact(global_key(np.arange(rows.shape[-2])[:, None], rows).reshape(-1))
    return scored + inverse[first], scored + uniq.size


def _move_rows(src, src_index: np.ndarray, dst, dst_index: np.ndarray, indices) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]``. Host rows (NumPy) move in a compiled loop; a
    tier in device memory (a torch tensor: the HBM row cache on a GPU) moves them there with
    index ops, its rows never crossing to the host, the indices through ``indices`` (pinned)."""
    if not src_index.size:
        return
    if isinstance(src, np.ndarray) and isinstance(dst, np.ndarray):
        copy_rows(src, src_index, dst, dst_index, work=src_index.size * src.shape[1])
        return
    dst.index_copy_(0, indices(dst_index), src.index_select(0, indices(src_index)))


def policy_bytes_per_row(policy: Policy | str, capacity: int = 1024, num_keys: int = 1 << 20) -> float:
    """Bytes of policy state per table row: what a live store (no compaction) pays per row,
    measured from the arrays a reset sizes by ``num_keys``, plus the tier's 4-byte slot map
    (the store's 4-byte first-use numbering is paid once, not per tier)."""
    policy = registry.make_policy(policy) if isinstance(policy, str) else policy

    def arrays(obj, seen):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            return obj.nbytes
        if isinstance(obj, (tuple, list)):
            return sum(arrays(x, seen) for x in obj)
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            return sum(arrays(x, seen) for x in vars(obj).values())
        return 0

    sizes = []
    for n in (num_keys, 2 * num_keys):
        policy.reset(capacity, n)
        sizes.append(arrays(policy, set()))
    return (sizes[1] - sizes[0]) / num_keys + 4
