# SPDX-License-Identifier: Apache-2.0
"""kvmem for PyTorch: KV Means and Universal Attention caches as custom ops.

Importing the package loads the op library (``torch.ops.kvmem``); the functions below are typed
wrappers around those ops. A state lives on one device: the CPU (kvmem's host backend) or, when the
library was built with kvmem's CUDA backend, a CUDA device (``device="cuda"`` on the create and size
functions, or placement over CUDA tensors). Every tensor passed with a state must be on the state's
device; a state on one device with tensors on another raises ``ValueError``. CUDA ops run on the
current stream of the state's device (docs/integration.md, "PyTorch ops on CUDA": what waits for the
device, and CUDA graph capture).

A state stores its keys and values in one dtype, chosen when it is made (``dtype=``, float32 by
default): KV Means in float32 or bfloat16, Universal Attention in float32, bfloat16 or float16, on the
CPU and on CUDA alike; another dtype raises ``ValueError``. A step takes q, k, v and the gates in the
state's dtype and returns ``out`` in it (``lse`` is float32); sums, softmax, decay and ``lse`` are
float32 whatever the storage. KV Means weights are float32.

Layouts (docs/integration.md): inputs of a step are packed token-major, the rows of a ragged batch
given by ``slot`` (int32 ``[rows]``, -1 = padding row) and ``query_start`` (int32 ``[rows + 1]``):

========  =====================  ==========================================================
tensor    shape                  meaning
========  =====================  ==========================================================
q         [tokens, Hq, D]        post-RoPE queries (the state's dtype)
k         [tokens, Hk, D]        post-RoPE keys (UA: unit-norm before RoPE)
v         [tokens, Hk, Dv]       values (UA: Dv = D)
gate      [tokens, Hk]           KVM merge gate, > 0
z_k, z_q  [tokens, Hk]           UA key-gate and query-side gate logits
out       [tokens, Hq, Dv]       per-head attention output (the state's dtype)
lse       [tokens, Hq]           natural log-sum-exp of each softmax row (float32)
========  =====================  ==========================================================

A state (``kvm_create`` / ``ua_create``) holds ``max_slots`` sequence slots of one layer. Every op
validates its arguments before it changes anything; a refused call raises ``ValueError``
(invalid argument), ``IndexError`` (index out of range) or ``RuntimeError`` with kvmem's message and
leaves the state unchanged. On CUDA, input values (NaN, Inf, ``gate <= 0``) are not checked, and a
step captured in a CUDA graph reports its refusals through ``step_status``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "Fixed", "Power", "Saturating", "KvmWeights", "State",
    "kvm_create", "kvm_state_bytes", "ua_create", "kvm_layout", "kvm_place", "ua_layout", "ua_place",
    "kvm_step", "ua_step", "step_status", "state_device", "state_dtype",
    "reset_slots", "copy_slots", "export_slot", "import_slot", "truncate", "library_path",
]


def library_path() -> str:
    """Path of the op library: $KVMEM_TORCH_LIBRARY, else libkvmem_torch.so beside this file."""
    env = os.environ.get("KVMEM_TORCH_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkvmem_torch.so")


torch.ops.load_library(library_path())
_ops = torch.ops.kvmem

#: A layer's state: ``torch.classes.kvmem.State``. Methods: ``mechanism()`` ("kvm" or "ua"),
#: ``device()`` ("cpu" or "cuda:<index>"), ``dtype()`` ("Float", "BFloat16" or "Half"), ``max_slots()``, ``tokens(slot)`` (tokens the slot's sequence
#: has seen), ``allocated_bytes()``, ``export_bytes(slot)`` (size of that slot's record now). On CUDA,
#: ``tokens`` and ``export_bytes`` read the device and wait for the current stream.
State = torch.ScriptObject

Device = Union[torch.device, str, None]


def _device(device: Device) -> Optional[torch.device]:
    return None if device is None else torch.device(device)


def state_device(state: State) -> torch.device:
    """The device a state lives on (where its tensors must be)."""
    return torch.device(state.device())


_DTYPES = {"Float": torch.float32, "BFloat16": torch.bfloat16, "Half": torch.float16}


def state_dtype(state: State) -> torch.dtype:
    """The dtype a state stores its keys and values in: its steps take q, k, v and the gates in it and
    return ``out`` in it."""
    return _DTYPES[state.dtype()]


# ---- KV Means budgets (docs/slots.md, spec KVM.md 3.1) ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fixed:
    """A fixed number of memory slots per sequence and KV head ("KVM-256")."""
    count: int = 256
    maximum: int = 2_560_000

    def _spec(self) -> Tuple[str, List[float]]:
        return "fixed", [float(self.count), float(self.maximum)]


@dataclasses.dataclass(frozen=True)
class Power:
    """``max(factor * N**exponent, minimum)`` memory slots after N tokens ("16·√N")."""
    factor: float = 16.0
    exponent: float = 0.5
    minimum: int = 256
    round_down: int = 1
    maximum: int = 2_560_000

    def _spec(self) -> Tuple[str, List[float]]:
        return "power", [self.factor, self.exponent, float(self.minimum), float(self.round_down),
                         float(self.maximum)]


@dataclasses.dataclass(frozen=True)
class Saturating:
    """``max(saturation * N / (saturation + N), minimum)`` memory slots after N tokens."""
    saturation: float = 1024.0
    minimum: int = 1
    maximum: int = 2_560_000
    round_down: int = 1

    def _spec(self) -> Tuple[str, List[float]]:
        return "saturating", [self.saturation, float(self.minimum), float(self.maximum),
                              float(self.round_down)]


Budget = Union[Fixed, Power, Saturating]


class KvmWeights(NamedTuple):
    """KV Means' learned parameters (float32, on the state's device): ``ln_weight``, ``ln_bias`` [D]
    (the LN_s affine), ``tau_state``, ``tau_bswa`` [Hq] (temperatures of memory-slot and window
    logits)."""
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor
    tau_state: torch.Tensor
    tau_bswa: torch.Tensor

    @staticmethod
    def identity(head_dim: int, q_heads: int, device: Device = None) -> "KvmWeights":
        """LN_s weight 1, bias 0 and unit temperatures."""
        return KvmWeights(torch.ones(head_dim, device=device), torch.zeros(head_dim, device=device),
                          torch.ones(q_heads, device=device), torch.ones(q_heads, device=device))

    def to(self, device: Device) -> "KvmWeights":
        """The same weights on ``device``."""
        return KvmWeights(*(t.to(device) for t in self))


# ---- create --------------------------------------------------------------------------------------

def kvm_create(max_slots: int, q_heads: int, kv_heads: int, head_dim: int, value_dim: int, n_ctx: int, *,
               chunk: int = 256, window_chunks: int = 2, sink: int = 1, rope_dims: int = 64,
               budget: Budget = Fixed(), scale: float = 0.0, device: Device = None,
               dtype: Optional[torch.dtype] = None) -> State:
    """A KV Means state of ``max_slots`` sequence slots, each holding up to ``n_ctx`` tokens.

    ``chunk`` (C) and ``window_chunks`` (nb): the window keeps the last nb·C exact keys; ``sink``: memory
    slots never merged into; ``rope_dims``: leading key channels zeroed before LN_s; ``budget``: how
    many memory slots exist after N tokens; ``scale``: the logit scale (0 = 1/sqrt(head_dim));
    ``device``: the CPU (None) or a CUDA device ("cuda" is the current one); ``dtype``: the storage of
    the window and the memory slots' readout copies, ``torch.float32`` (None) or ``torch.bfloat16``
    (the memory slots' sums stay float32); its steps take and return tensors of that dtype. The state
    owns its memory (``state.allocated_bytes()``)."""
    kind, args = budget._spec()
    return _ops.kvm_create(max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx, chunk, window_chunks, sink,
                           rope_dims, kind, args, scale, _device(device), dtype)


def kvm_state_bytes(max_slots: int, q_heads: int, kv_heads: int, head_dim: int, value_dim: int, n_ctx: int, *,
                    chunk: int = 256, window_chunks: int = 2, sink: int = 1, rope_dims: int = 64,
                    budget: Budget = Fixed(), scale: float = 0.0, device: Device = None,
                    dtype: Optional[torch.dtype] = None) -> int:
    """Bytes ``kvm_create`` with the same arguments allocates on ``device`` (0 if they are invalid):
    size memory for the worst case before the first token."""
    kind, args = budget._spec()
    return _ops.kvm_state_bytes(max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx, chunk, window_chunks,
                                sink, rope_dims, kind, args, scale, _device(device), dtype)


def ua_create(max_slots: int, q_heads: int, kv_heads: int, head_dim: int, capacity: int, *,
              device: Device = None, dtype: Optional[torch.dtype] = None) -> State:
    """A Universal Attention cache of ``max_slots`` sequence slots, each keeping up to ``capacity``
    entries per KV head (a row that could exceed it is refused: kept + new tokens <= capacity), on the
    CPU (``device=None``) or a CUDA device, storing keys and values in ``dtype``: ``torch.float32``
    (None), ``torch.bfloat16`` or ``torch.float16`` (λ and the gate logits stay float32)."""
    return _ops.ua_create(max_slots, q_heads, kv_heads, head_dim, capacity, _device(device), dtype)


# ---- placed over tensors the caller allocates (docs/memory.md) -------------------------------------

def kvm_layout(max_slots: int, q_heads: int, kv_heads: int, head_dim: int, value_dim: int, n_ctx: int, *,
               chunk: int = 256, window_chunks: int = 2, sink: int = 1, rope_dims: int = 64,
               budget: Budget = Fixed(), scale: float = 0.0, device: Device = None,
               dtype: Optional[torch.dtype] = None) -> Tuple[int, int]:
    """``(state_bytes, workspace_bytes)`` of a KV Means state placed by ``kvm_place``: the sizes of the two
    uint8 tensors an engine allocates before the first request ((0, 0) for an invalid configuration).
    The state tensor holds every slot's sequence; one workspace may serve several layers' states that
    never step at the same time. The layout depends on the backend and the storage: pass the ``device``
    the tensors will be on and the state's ``dtype``."""
    kind, args = budget._spec()
    return tuple(_ops.kvm_layout(max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx, chunk, window_chunks,
                                 sink, rope_dims, kind, args, scale, _device(device), dtype))


def kvm_place(memory: torch.Tensor, workspace: torch.Tensor, max_slots: int, q_heads: int, kv_heads: int,
              head_dim: int, value_dim: int, n_ctx: int, *, chunk: int = 256, window_chunks: int = 2,
              sink: int = 1, rope_dims: int = 64, budget: Budget = Fixed(), scale: float = 0.0,
              dtype: Optional[torch.dtype] = None) -> State:
    """A KV Means state like ``kvm_create``'s, living in ``memory`` and using ``workspace`` as scratch:
    contiguous uint8 tensors on one device (the state's: CPU or CUDA) of at least
    ``kvm_layout(..., device=memory.device, dtype=dtype)`` bytes, aligned (64 bytes on the CPU, 256 on CUDA; a fresh
    ``torch.empty`` is). Every slot starts empty; the state keeps both tensors alive. Too small,
    misaligned, of the wrong dtype or on different devices raises ``ValueError`` with kvmem's message.
    On CUDA, placing waits once for the current stream."""
    kind, args = budget._spec()
    return _ops.kvm_place(memory, workspace, max_slots, q_heads, kv_heads, head_dim, value_dim, n_ctx, chunk,
                          window_chunks, sink, rope_dims, kind, args, scale, dtype)


def ua_layout(max_slots: int, q_heads: int, kv_heads: int, head_dim: int, capacity: int, *,
              device: Device = None, dtype: Optional[torch.dtype] = None) -> Tuple[int, int]:
    """``(cache_bytes, workspace_bytes)`` of a Universal Attention cache of storage ``dtype`` placed by
    ``ua_place`` on ``device``."""
    return tuple(_ops.ua_layout(max_slots, q_heads, kv_heads, head_dim, capacity, _device(device), dtype))


def ua_place(memory: torch.Tensor, workspace: torch.Tensor, max_slots: int, q_heads: int, kv_heads: int,
             head_dim: int, capacity: int, *, dtype: Optional[torch.dtype] = None) -> State:
    """A Universal Attention cache like ``ua_create``'s over caller tensors (as ``kvm_place``)."""
    return _ops.ua_place(memory, workspace, max_slots, q_heads, kv_heads, head_dim, capacity, dtype)


# ---- steps ---------------------------------------------------------------------------------------

def kvm_step(state: State, weights: KvmWeights, slot: torch.Tensor, query_start: torch.Tensor,
             q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, *,
             exact: bool = False, wait: bool = True,
             max_query_len: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One KV Means step over a ragged batch of sequence slots; returns ``(out, lse)``.

    Row r runs the tokens ``query_start[r]:query_start[r+1]`` of the sequence in ``slot[r]`` and
    advances that slot; a padding row (-1) is skipped and its outputs are zero. A row computes what a
    prefill of its tokens on that sequence alone computes. ``exact=True`` takes the scalar paths that
    make this bitwise (the default allows faster tile products, equal within float32 rounding).
    ``q``, ``k``, ``v`` and ``gate`` are of the state's dtype (``state_dtype(state)``), and so is
    ``out``; ``lse`` is float32. On the CPU a bfloat16 state reads its inputs as float32 (exactly) and
    rounds ``out`` to bfloat16 once.

    On CUDA every tensor is on the state's device and ``exact`` has no effect (the update rounds like
    the host's exact path; outputs equal it within float32 rounding). The device checks the rows; the
    op then reads the verdict back, which waits for the current stream, and raises like the CPU op.
    With ``wait=False``, and inside a CUDA graph capture, it does not wait: a refused step changes
    nothing and is raised by ``step_status`` or the next step that waits (a decode loop that keeps
    the device busy calls ``step_status`` once per so many steps). On the CPU a step is checked
    before it runs and raises at once, whatever ``wait`` says.

    ``max_query_len`` bounds the tokens of every row that names a slot (vLLM's attention metadata
    ``max_query_len``; 0, the default, means unknown). The rows live on the device, so the CUDA step
    sizes its launches from this host-side bound: a prefill of a few long rows then runs in the chunk
    phases its rows need instead of as many as the packed token count allows. A row that names a slot
    and holds more tokens refuses the step (ValueError; nothing changes) on every backend. A padding
    row is not bound by it. A graph captured with a bound keeps it for its replays."""
    return _ops.kvm_step(state, list(weights), slot, query_start, q, k, v, gate, exact, wait, max_query_len)


def ua_step(state: State, slot: torch.Tensor, query_start: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, z_k: torch.Tensor, z_q: torch.Tensor, z_o: Optional[torch.Tensor] = None, *,
            p: float = 0.0, prefill_chunk: int = 128,
            evict_before_attention: bool = True, wait: bool = True,
            max_query_len: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One Universal Attention step over a ragged batch of sequence slots; returns ``(out, lse)``.

    A one-token row is a decode step, a longer row a chunked prefill (chunks of ``prefill_chunk``
    counted from the row's first token) that continues the slot. ``p`` is the pruning threshold: keys
    whose accumulated decay falls below ln p are evicted for good (0 = dense UA). ``z_o``
    [tokens, Hq, D] is an optional output gate. Token i of row r sits at position
    ``state.tokens(slot[r]) + i``, which the caller uses for RoPE. ``q``, ``k``, ``v``, ``z_k``, ``z_q``
    and ``z_o`` are of the cache's dtype, and so is ``out``; ``lse`` is float32. The gate logits are read
    as float32 on every backend.

    On CUDA every tensor is on the state's device, ``prefill_chunk`` is at most 128, and the op checks
    the rows and each slot's room on the host before it enqueues the step (reading the slots' lengths
    waits for the current stream). With ``wait=False`` it checks shapes and options only, and inside a
    CUDA graph capture nothing on the host: the device refuses bad rows (changing nothing), and a row
    without room is skipped (outputs zero) and its slot flagged; ``step_status`` reports both. On the
    CPU a step is checked before it runs and raises at once, whatever ``wait`` says.

    ``max_query_len`` bounds the tokens of every row that names a slot, as in ``kvm_step`` (0: unknown):
    the CUDA step runs as many prefill rounds as that bound needs (none for a bound of 1) instead of as
    many as the packed token count allows. A row that names a slot and holds more tokens refuses the
    step (ValueError; nothing changes) on every backend; a padding row is not bound by it."""
    return _ops.ua_step(state, slot, query_start, q, k, v, z_k, z_q, z_o, p, prefill_chunk,
                        evict_before_attention, wait, max_query_len)


def step_status(state: State) -> None:
    """Raises what the device refused since the last check, as the step would have raised: a CUDA
    step captured in a graph does not wait for its rows' check, so a refused replay (which changes
    nothing) is reported here, and, for Universal Attention, the slots that had no room for a
    captured row (skipped, flagged until ``reset_slots``, ``copy_slots`` or ``import_slot``). Waits
    for the current stream; call it outside a capture, after replays. A CPU state refuses a step
    when it is made, so this returns at once for it."""
    _ops.step_status(state)


# ---- slot operations (the same names and argument order for both mechanisms) -----------------------

def _slots(x: Union[torch.Tensor, Sequence[int]], state: State) -> torch.Tensor:
    """A slot list as an int32 tensor: a list becomes one on the state's device."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(list(x), dtype=torch.int32, device=state_device(state))


def reset_slots(state: State, slots: Union[torch.Tensor, Sequence[int]]) -> None:
    """Forgets the sequences in ``slots`` (int32 tensor on the state's device, or a list of ints);
    they restart at 0 tokens. On CUDA the device checks the list; the op then reads its verdict back (a
    wait for the current stream) and raises like the CPU op. Inside a CUDA graph capture it does not
    wait: call ``step_status`` after replays."""
    _ops.reset_slots(state, _slots(slots, state))


def copy_slots(state: State, src: Union[torch.Tensor, Sequence[int]],
               dst: Union[torch.Tensor, Sequence[int]]) -> None:
    """Fork: slot ``dst[i]`` becomes a copy of ``src[i]`` and continues bit for bit like it (beam
    search, n > 1 sampling, a shared prefix). Destinations are distinct and none is another pair's
    source. On CUDA the device checks the lists; the op then reads its verdict back (a wait for the
    current stream) and raises like the CPU op. Inside a CUDA graph capture it does not wait: call
    ``step_status`` after replays."""
    _ops.copy_slots(state, _slots(src, state), _slots(dst, state))


def export_slot(state: State, slot: int) -> torch.Tensor:
    """The sequence in ``slot`` as a versioned byte record (uint8 CPU tensor, magic ``KVMEMSLT``,
    whatever the state's device) that ``import_slot`` of any backend reads back."""
    return _ops.export_slot(state, slot)


def import_slot(state: State, weights: Optional[KvmWeights], slot: int, record: torch.Tensor) -> None:
    """Replaces ``slot`` with an exported record (a uint8 tensor on the CPU or on the state's device;
    records are the same on every backend). KV Means needs its ``weights`` (the readout copies are
    rebuilt with them); pass ``None`` for a Universal Attention cache. A record whose version,
    mechanism, parameters or shapes differ from this state's is refused, naming the field."""
    _ops.import_slot(state, [] if weights is None else list(weights), slot, record)


def truncate(state: State, slot: int, n: int) -> None:
    """Drops the last ``n`` tokens of ``slot`` when that is exact, and refuses otherwise with the
    reason (KVM: tokens a state update absorbed; UA: anything but 0 or all tokens)."""
    _ops.truncate(state, slot, n)
