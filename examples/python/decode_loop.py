# SPDX-License-Identifier: Apache-2.0
"""A continuous-batching decode loop over kvmem's PyTorch ops.

A small Llama-shaped decoder (pre-norm RMSNorm, grouped-query attention with rotary positions on the
leading rope_dims channels, SwiGLU MLP, tied embedding; random weights) serves requests that arrive
at different steps with prompts and output lengths of their own. Every step packs one ragged batch:
a prefill chunk of each request still reading its prompt, one token of each generating request, and
padding rows up to a multiple of 4 (what an engine that captures graphs per batch size does). Each
layer's attention is one kvmem step over sequence slots (``kvmem.kvm_step`` or ``kvmem.ua_step``);
``dense`` is a plain PyTorch KV cache for comparison (on CUDA a preallocated cache attended with
``torch.nn.functional.scaled_dot_product_attention``, so cuDNN or FlashAttention kernels run).

    PYTHONPATH=build/release/python python3 examples/python/decode_loop.py --mechanism kvm
    PYTHONPATH=build/release/python python3 examples/python/decode_loop.py --bench --device cuda --dtype bfloat16

``--device`` and ``--dtype`` place the model and kvmem's states (bfloat16 states store bfloat16 keys and
values). ``--bench`` measures KV Means with 256 memory slots, KV Means with 16·√N slots and Universal
Attention with p = 0.05 against the dense cache: for each (concurrent sequences, prompt tokens) of
``--sweep`` every sequence is admitted at once, prefilled in chunks of ``--prefill-chunk`` tokens (at most
``--step-tokens`` tokens a step), then decoded for ``--decode-steps`` steps; it prints prefill and decode
tokens/s, the cache bytes allocated (from kvmem's layout and size ops) and the live sequences per step.
``--compare-engine PATH`` runs the C++ engine (examples/engine, kvmem-engine) and this loop on the CPU
with the same model, workload and threads, and prints the per-step times of both: the cost of the
Python path (the model in PyTorch, the ops' argument checks and dispatch) over the C++ loop.

The Decoder takes an optional range of KV heads and a process group, so head_parallel.py runs the
same model with the heads sharded over ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

import kvmem


@dataclasses.dataclass
class Config:
    vocab: int = 256
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    rope_dims: int = 16
    mlp: int = 256
    rope_theta: float = 10000.0
    seed: int = 0
    # attention
    mechanism: str = "kvm"  # kvm | ua | dense
    max_slots: int = 4
    n_ctx: int = 256
    kvm_chunk: int = 16
    kvm_window_chunks: int = 2
    kvm_budget: Union[kvmem.Fixed, kvmem.Power] = dataclasses.field(default_factory=lambda: kvmem.Fixed(64))
    ua_p: float = 0.05
    ua_prefill_chunk: int = 16
    ua_capacity: int = 0  # kept rows per (slot, KV head); 0 = n_ctx
    dense_backend: str = "flash"  # SDPA kernel of the dense cache on CUDA (SdpaCache.BACKENDS)
    wait: bool = True  # kvmem steps wait for their verdict (False: the loop calls step_status itself)
    # scheduling
    prefill_chunk: int = 24
    row_bucket: int = 4
    # placement: the model's weights and activations and kvmem's states
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def d_model(self) -> int:
        return self.q_heads * self.head_dim


def make_weights(cfg: Config) -> Dict[str, torch.Tensor]:
    """Random weights ~ N(0, 1/fan_in) (unit-scale activations); norms near 1; drawn on cfg.device (the
    same numbers on the CPU for a given seed) and stored in cfg.dtype."""
    dev = torch.device(cfg.device)
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    dm, D = cfg.d_model, cfg.head_dim

    def mat(o, i):
        return (torch.randn(o, i, generator=g, device=dev) / math.sqrt(i)).to(cfg.dtype)

    def norm(n):
        return (0.8 + 0.4 * torch.rand(n, generator=g, device=dev)).to(cfg.dtype)

    w = {"embed": torch.randn(cfg.vocab, dm, generator=g, device=dev).to(cfg.dtype), "final_norm": norm(dm)}
    for l in range(cfg.layers):
        w.update({f"{l}.attn_norm": norm(dm), f"{l}.wq": mat(cfg.q_heads * D, dm),
                  f"{l}.wk": mat(cfg.kv_heads * D, dm), f"{l}.wv": mat(cfg.kv_heads * D, dm),
                  f"{l}.wgk": mat(cfg.kv_heads, dm), f"{l}.wgq": mat(cfg.kv_heads, dm),
                  f"{l}.wo": mat(dm, cfg.q_heads * D), f"{l}.mlp_norm": norm(dm),
                  f"{l}.w_gate": mat(cfg.mlp, dm), f"{l}.w_up": mat(cfg.mlp, dm), f"{l}.w_down": mat(dm, cfg.mlp)})
    return w


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, rope_dims: int, theta: float) -> torch.Tensor:
    """Rotates channel pairs (i, i + rope_dims/2) of each head: x [tokens, heads, D], pos [tokens]."""
    half = rope_dims // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64, device=pos.device) * 2 / rope_dims)
    ang = pos.double()[:, None] * inv[None, :]
    c, s = torch.cos(ang).to(x.dtype)[:, None, :], torch.sin(ang).to(x.dtype)[:, None, :]
    a, b = x[..., :half], x[..., half:rope_dims]
    return torch.cat([a * c - b * s, a * s + b * c, x[..., rope_dims:]], dim=-1)


class DenseCache:
    """The baseline on the CPU: every key and value of every slot; causal softmax(q·k/√D) in plain
    PyTorch, in float32 whatever the model's dtype (outputs rounded to it once)."""

    def __init__(self, max_slots: int):
        self.k: List[Optional[torch.Tensor]] = [None] * max_slots
        self.v: List[Optional[torch.Tensor]] = [None] * max_slots

    def reset(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.k[s] = self.v[s] = None

    def step(self, slot: torch.Tensor, query_start: torch.Tensor, q, k, v) -> torch.Tensor:
        out = torch.zeros_like(q)
        rep = q.shape[1] // k.shape[1]
        for r in range(slot.numel()):
            s, a, b = int(slot[r]), int(query_start[r]), int(query_start[r + 1])
            if s < 0 or a == b:
                continue
            self.k[s] = k[a:b] if self.k[s] is None else torch.cat([self.k[s], k[a:b]])
            self.v[s] = v[a:b] if self.v[s] is None else torch.cat([self.v[s], v[a:b]])
            K, V = self.k[s].repeat_interleave(rep, 1).float(), self.v[s].repeat_interleave(rep, 1).float()
            n, t = b - a, K.shape[0]
            logits = torch.einsum("thd,shd->hts", q[a:b].float(), K) / math.sqrt(q.shape[-1])
            mask = torch.arange(t)[None, :] <= (torch.arange(n) + t - n)[:, None]
            out[a:b] = torch.einsum("hts,shd->thd", logits.masked_fill(~mask, float("-inf")).softmax(-1), V)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


def _sdpa_kernel(backend: str):
    """A context-manager factory that restricts scaled_dot_product_attention to one backend (PyTorch 2.3
    and later), or leaves PyTorch's choice for "auto"."""
    if backend == "auto":
        return contextlib.nullcontext
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise ValueError(f"dense backend {backend}: choosing SDPA's kernel needs PyTorch 2.3 or later "
                         f"(this is {torch.__version__}); use auto") from e
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    return lambda: sdpa_kernel(chosen)


class SdpaCache:
    """The baseline on CUDA: a preallocated KV cache [max_slots, Hk, n_ctx, D] per layer, attended with
    torch.nn.functional.scaled_dot_product_attention. Rows of consecutive slots at one length with as
    many tokens each are attended in one call over a view of the cache: a decode step of slots 0..n-1 is
    one call.

    `backend` picks SDPA's kernel for decode steps and for causal prefills: "flash" (FlashAttention, the
    default; it takes any key length without preparing anything per shape), "cudnn", "efficient", or
    "auto" (PyTorch's own choice). PyTorch's cuDNN attention prepares an execution plan per distinct
    shape, and a decode step has a new key length every step, so "auto" (which may pick cuDNN) pays a
    plan build per layer and step: a cost a serving engine with a paged FlashAttention decode does not
    pay. A chunk after cached tokens needs an explicit mask and takes PyTorch's choice."""

    BACKENDS = ("flash", "cudnn", "efficient", "auto")

    def __init__(self, max_slots: int, kv_heads: int, n_ctx: int, head_dim: int, device, dtype,
                 backend: str = "flash"):
        if backend not in self.BACKENDS:
            raise ValueError(f"dense backend: expected one of {', '.join(self.BACKENDS)}, got {backend}")
        shape = (max_slots, kv_heads, n_ctx, head_dim)
        # zeros, not empty: decode_at weighs the rows after pos[0] by exactly 0, which a NaN left in
        # uninitialised memory would turn into NaN
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = [0] * max_slots
        self.kernel = _sdpa_kernel(backend)
        self.masked_kernel = _sdpa_kernel("auto" if backend == "auto" else "efficient")

    def reset(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.length[s] = 0

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def _attend(self, q, K, V, past: int):
        """q [r, Hq, n, D] of tokens after `past` cached ones, over K, V [r, Hk, past + n, D]."""
        F = torch.nn.functional
        r, hq, n, d = q.shape
        hk = K.shape[1]
        if n == 1:  # decode: the rep query heads of a KV head are rep queries over its keys, no mask
            with self.kernel():
                return F.scaled_dot_product_attention(q.reshape(r, hk, hq // hk, d), K, V).reshape(r, hq, 1, d)
        K, V = K.repeat_interleave(hq // hk, 1), V.repeat_interleave(hq // hk, 1)
        if past == 0:
            with self.kernel():
                return F.scaled_dot_product_attention(q, K, V, is_causal=True)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)

    def decode_at(self, pos: torch.Tensor, q, k, v) -> torch.Tensor:
        """One decode token of each slot 0..n-1, all at position pos[0], with no host-side state: the
        rows are written at pos[0] and every slot attends over the whole n_ctx with the positions after
        pos[0] masked (the memory-efficient kernel, which takes a mask), so a CUDA graph can capture it.
        It reads n_ctx keys where `step` reads pos[0] + 1: the benchmark sizes n_ctx to the prompt plus
        the decode steps, so the excess is at most the decode steps."""
        F = torch.nn.functional
        n, hq, d = q.shape
        hk = k.shape[1]
        at = pos[:1]
        self.k[:n].index_copy_(2, at, k.view(n, hk, 1, d))
        self.v[:n].index_copy_(2, at, v.view(n, hk, 1, d))
        keys = torch.arange(self.k.shape[2], device=q.device)
        mask = torch.zeros(self.k.shape[2], device=q.device, dtype=q.dtype).masked_fill(keys > at, float("-inf"))
        with self.masked_kernel():
            o = F.scaled_dot_product_attention(q.view(n, hk, hq // hk, d), self.k[:n], self.v[:n], attn_mask=mask)
        return o.reshape(n, hq, d)

    def step(self, rows: Sequence[Tuple[int, int, int]], q, k, v) -> torch.Tensor:
        out = torch.zeros_like(q)
        live = [(s, a, b) for s, a, b in rows if s >= 0 and b > a]
        groups: List[List[Tuple[int, int, int]]] = []
        for s, a, b in live:
            g = groups[-1] if groups else None
            if g and s == g[-1][0] + 1 and a == g[-1][2] and b - a == g[0][2] - g[0][1] and \
                    self.length[s] == self.length[g[0][0]]:
                g.append((s, a, b))
            else:
                groups.append([(s, a, b)])
        for g in groups:
            s0, a0, r, n = g[0][0], g[0][1], len(g), g[0][2] - g[0][1]
            L = self.length[s0]
            qg = q[a0:a0 + r * n].view(r, n, *q.shape[1:]).transpose(1, 2)
            self.k[s0:s0 + r, :, L:L + n] = k[a0:a0 + r * n].view(r, n, *k.shape[1:]).transpose(1, 2)
            self.v[s0:s0 + r, :, L:L + n] = v[a0:a0 + r * n].view(r, n, *v.shape[1:]).transpose(1, 2)
            o = self._attend(qg, self.k[s0:s0 + r, :, :L + n], self.v[s0:s0 + r, :, :L + n], L)
            out[a0:a0 + r * n] = o.transpose(1, 2).reshape(r * n, *q.shape[1:])
            for s, _, _ in g:
                self.length[s] = L + n
        return out


class Decoder:
    """The model over packed tokens, with kvmem state per layer for KV heads [kv0, kv1) and their query
    heads. With a process group, each rank owns a disjoint head range and the attention output
    projection's partial sums are all-reduced: the one exchange head parallelism needs per layer."""

    def __init__(self, cfg: Config, weights: Dict[str, torch.Tensor], kv_range: Tuple[int, int] = None,
                 group=None):
        self.cfg, self.w, self.group = cfg, weights, group
        kv0, kv1 = kv_range or (0, cfg.kv_heads)
        rep, D = cfg.q_heads // cfg.kv_heads, cfg.head_dim
        self.hk, self.hq = kv1 - kv0, (kv1 - kv0) * rep
        self.qrows = slice(kv0 * rep * D, kv1 * rep * D)  # this shard's rows of wq, columns of wo
        self.krows = slice(kv0 * D, kv1 * D)
        self.grows = slice(kv0, kv1)
        self.kvm_weights = kvmem.KvmWeights.identity(D, self.hq, device=cfg.device)
        self.states = [self._state() for _ in range(cfg.layers)]
        self.attention_seconds = 0.0  # host time inside the attention calls (all of it on the CPU)

    def _kvm_args(self):
        c = self.cfg
        return (c.max_slots, self.hq, self.hk, c.head_dim, c.head_dim, c.n_ctx), dict(
            chunk=c.kvm_chunk, window_chunks=c.kvm_window_chunks, rope_dims=c.rope_dims, budget=c.kvm_budget,
            device=c.device, dtype=c.dtype)

    def _ua_args(self):
        c = self.cfg
        return (c.max_slots, self.hq, self.hk, c.head_dim, c.ua_capacity or c.n_ctx), dict(device=c.device,
                                                                                            dtype=c.dtype)

    def _state(self):
        c = self.cfg
        if c.mechanism == "kvm":
            args, kw = self._kvm_args()
            return kvmem.kvm_create(*args, **kw)
        if c.mechanism == "ua":
            args, kw = self._ua_args()
            return kvmem.ua_create(*args, **kw)
        if c.mechanism == "dense":
            if torch.device(c.device).type == "cuda":
                return SdpaCache(c.max_slots, self.hk, c.n_ctx, c.head_dim, c.device, c.dtype, c.dense_backend)
            return DenseCache(c.max_slots)
        raise ValueError(f"mechanism: expected kvm, ua or dense, got {c.mechanism}")

    def is_dense(self) -> bool:
        return self.cfg.mechanism == "dense"

    def reset(self, slots: Sequence[int]) -> None:
        for s in self.states:
            if self.is_dense():
                s.reset(slots)
            else:
                kvmem.reset_slots(s, list(slots))

    def cache_bytes(self) -> int:
        """Bytes of every layer's attention state: kvmem's allocation, or the dense cache's tensors."""
        if self.is_dense():
            return sum(s.nbytes() for s in self.states)
        return sum(s.allocated_bytes() for s in self.states)

    def layout_bytes(self) -> int:
        """Bytes of every layer's kvmem state as the size ops give them before anything is allocated
        (kvm_state_bytes, ua_layout): what an engine sizes its memory with. The dense cache: its tensors."""
        if self.is_dense():
            return self.cache_bytes()
        if self.cfg.mechanism == "kvm":
            args, kw = self._kvm_args()
            return self.cfg.layers * kvmem.kvm_state_bytes(*args, **kw)
        args, kw = self._ua_args()
        return self.cfg.layers * sum(kvmem.ua_layout(*args, **kw))

    def attention(self, l: int, h: torch.Tensor, pos, slot, query_start, rows=None,
                  max_query_len: int = 0) -> torch.Tensor:
        c, w, N, D = self.cfg, self.w, h.shape[0], self.cfg.head_dim
        q = (h @ w[f"{l}.wq"][self.qrows].T).view(N, self.hq, D)
        k = (h @ w[f"{l}.wk"][self.krows].T).view(N, self.hk, D)
        v = (h @ w[f"{l}.wv"][self.krows].T).view(N, self.hk, D)
        zk, zq = h @ w[f"{l}.wgk"][self.grows].T, h @ w[f"{l}.wgq"][self.grows].T
        if c.mechanism == "ua":
            k = k / (k.norm(dim=-1, keepdim=True) + 1e-6)  # UA's keys are unit-norm before RoPE
        q, k = rope(q, pos, c.rope_dims, c.rope_theta), rope(k, pos, c.rope_dims, c.rope_theta)
        q, k, v, zk, zq = (t.contiguous() for t in (q, k, v, zk, zq))
        state = self.states[l]
        t0 = time.perf_counter()
        if c.mechanism == "kvm":
            o, _ = kvmem.kvm_step(state, self.kvm_weights, slot, query_start, q, k, v, torch.sigmoid(zk),
                                  wait=c.wait, max_query_len=max_query_len)
        elif c.mechanism == "ua":
            o, _ = kvmem.ua_step(state, slot, query_start, q, k, v, zk, zq, p=c.ua_p,
                                 prefill_chunk=c.ua_prefill_chunk, wait=c.wait, max_query_len=max_query_len)
        elif isinstance(state, SdpaCache):
            o = state.step(rows, q, k, v) if rows is not None else state.decode_at(pos, q, k, v)
        else:
            o = state.step(slot, query_start, q, k, v)
        self.attention_seconds += time.perf_counter() - t0
        y = o.reshape(N, self.hq * D) @ w[f"{l}.wo"][:, self.qrows].T
        if self.group is not None:
            torch.distributed.all_reduce(y, group=self.group)
        return y

    def step_status(self) -> None:
        """Raises what the device refused in steps that did not wait (kvmem.step_status per layer)."""
        if not self.is_dense():
            for s in self.states:
                kvmem.step_status(s)

    def forward(self, tokens, pos, slot, query_start, last, rows=None, max_query_len: int = 0) -> torch.Tensor:
        """Logits [len(last), vocab] of the tokens at indices `last` of the packed batch. `rows`: the
        batch's (slot, first token, end token) on the host, for the dense cache on CUDA; without them
        the dense cache takes the batch as one decode token of each slot 0..n-1 at position pos[0]
        (SdpaCache.decode_at, which a CUDA graph can capture). `max_query_len`: the longest row's
        tokens, known on the host as in vLLM's attention metadata (0: unknown); a CUDA step sizes its
        launches from it instead of from the packed token count."""
        w = self.w
        x = w["embed"][tokens]
        for l in range(self.cfg.layers):
            x = x + self.attention(l, rms_norm(x, w[f"{l}.attn_norm"]), pos, slot, query_start, rows, max_query_len)
            h = rms_norm(x, w[f"{l}.mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ w[f"{l}.w_gate"].T) * (h @ w[f"{l}.w_up"].T)) @ w[f"{l}.w_down"].T
        return rms_norm(x[last], w["final_norm"]) @ w["embed"].T


@dataclasses.dataclass
class Request:
    arrival: int
    prompt: List[int]
    max_new: int


def workload(n: int, vocab: int, prompt: Tuple[int, int], generate: Tuple[int, int], gap: int = 1,
             seed: int = 1) -> List[Request]:
    g = torch.Generator().manual_seed(seed)

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    return [Request(i * gap, torch.randint(0, vocab, (between(*prompt),), generator=g).tolist(), between(*generate))
            for i in range(n)]


def serve(model: Decoder, requests: List[Request], verbose: bool = False, on_step=None):
    """Continuous batching over the model's slots. Returns, per request, the generated tokens and the
    logits [max_new, vocab] they were sampled from, and the total tokens and seconds. on_step, when
    given, gets each step's {"step", "live", "rows", "prefill", "decode", "seconds"}."""
    cfg = model.cfg
    slots: List[Optional[dict]] = [None] * cfg.max_slots
    results = [{"tokens": [], "logits": []} for _ in requests]
    nxt, done, step, tokens_total, seconds = 0, 0, 0, 0, 0.0
    while done < len(requests):
        t0 = time.perf_counter()
        admitted = []
        for s in range(cfg.max_slots):
            if slots[s] is None and nxt < len(requests) and requests[nxt].arrival <= step:
                slots[s] = {"request": nxt, "fed": 0}
                admitted.append(s)
                nxt += 1
        if admitted:
            model.reset(admitted)
        tok, pos, slot, qs, samples = [], [], [], [0], []
        prefill_tokens = 0
        for s, live in enumerate(slots):
            if live is None:
                continue
            rq, res = requests[live["request"]], results[live["request"]]
            if live["fed"] < len(rq.prompt):
                n = min(cfg.prefill_chunk, len(rq.prompt) - live["fed"])
                tok += rq.prompt[live["fed"]:live["fed"] + n]
                prefill_tokens += n
            else:
                n = 1
                tok.append(res["tokens"][-1])
            pos += range(live["fed"], live["fed"] + n)
            slot.append(s)
            qs.append(qs[-1] + n)
            samples.append(live["fed"] + n >= len(rq.prompt))
            live["fed"] += n
        live_rows = len(slot)
        while len(slot) % cfg.row_bucket or not slot:  # padding rows: no tokens, skipped
            slot.append(-1)
            qs.append(qs[-1])
            samples.append(False)
        last = [qs[r + 1] - 1 for r in range(len(slot)) if samples[r]]
        logits, chosen = None, []
        if tok:
            dev = cfg.device
            logits = model.forward(torch.tensor(tok, device=dev), torch.tensor(pos, device=dev),
                                   torch.tensor(slot, dtype=torch.int32, device=dev),
                                   torch.tensor(qs, dtype=torch.int32, device=dev),
                                   torch.tensor(last, dtype=torch.long, device=dev),
                                   rows=[(slot[r], qs[r], qs[r + 1]) for r in range(len(slot))],
                                   max_query_len=max(qs[r + 1] - qs[r] for r in range(live_rows)))
            logits = logits.float().cpu()
            chosen = logits.argmax(-1).tolist()
        i = 0
        for r in range(len(slot)):
            if not samples[r]:
                continue
            s = slot[r]
            res = results[slots[s]["request"]]
            res["logits"].append(logits[i])
            res["tokens"].append(int(chosen[i]))
            i += 1
            if len(res["tokens"]) >= requests[slots[s]["request"]].max_new:
                model.reset([s])
                slots[s] = None
                done += 1
        dt = time.perf_counter() - t0
        tokens_total += len(tok)
        seconds += dt
        if on_step is not None:
            on_step(dict(step=step, live=live_rows, rows=len(slot), prefill=prefill_tokens,
                         decode=len(tok) - prefill_tokens, seconds=dt))
        if verbose:
            print(f"step {step:4d}  live {live_rows:3d}  rows {len(slot):3d}  tokens {len(tok):4d}  "
                  f"cache {model.cache_bytes() / 2**20:7.2f} MiB  {1e3 * dt:7.2f} ms")
        step += 1
    for res in results:
        res["logits"] = torch.stack(res["logits"])
    return results, tokens_total, seconds


# ---- benchmark ----------------------------------------------------------------------------------------

#: The mechanisms of the benchmark: (name, Config fields).
BENCH_MECHANISMS = {
    "dense": dict(mechanism="dense"),
    "kvm-256": dict(mechanism="kvm", kvm_budget=kvmem.Fixed(256)),
    "kvm-16sqrtN": dict(mechanism="kvm", kvm_budget=kvmem.Power(16.0, 0.5, 256)),
    "ua-0.05": dict(mechanism="ua", ua_p=0.05),
}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _bench_steps(model: Decoder, n_seq: int, prompt: int, decode_steps: int, chunk: int, step_tokens: int,
                 seed: int, graphs: bool = False):
    """All n_seq sequences admitted into slots 0..n_seq-1 at once, prefilled in chunks (at most
    step_tokens tokens a step, whole chunks of as many sequences as fit), then decoded in lockstep:
    decode_steps eager steps, or with `graphs` one eager step (untimed) and decode_steps replays of a
    CUDA graph of the whole decode step (model, attention, next token), as an engine that captures its
    decode per batch size runs it. Returns (prefill seconds, decode seconds, rows per prefill step,
    logits of the last decode step)."""
    cfg, dev = model.cfg, model.cfg.device
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab, (n_seq, prompt), generator=g)
    model.reset(range(n_seq))
    fed = [0] * n_seq
    rows_per_step: List[int] = []
    _sync(dev)
    t0 = time.perf_counter()
    last_tok = torch.zeros(n_seq, dtype=torch.long, device=dev)
    while fed[-1] < prompt:
        tok, pos, slot, qs, rows = [], [], [], [0], []
        for s in range(n_seq):
            n = min(chunk, prompt - fed[s])
            if n == 0 or (slot and qs[-1] + n > step_tokens):
                continue
            tok.append(prompts[s, fed[s]:fed[s] + n])
            pos.append(torch.arange(fed[s], fed[s] + n))
            rows.append((s, qs[-1], qs[-1] + n))
            slot.append(s)
            qs.append(qs[-1] + n)
            fed[s] += n
        rows_per_step.append(len(slot))
        while len(slot) % cfg.row_bucket and len(slot) < n_seq:  # a CUDA KV Means step takes <= max_slots rows
            rows.append((-1, qs[-1], qs[-1]))
            slot.append(-1)
            qs.append(qs[-1])
        ends = [b - 1 for s, _, b in rows if s >= 0 and fed[s] == prompt]
        logits = model.forward(torch.cat(tok).to(dev), torch.cat(pos).to(dev),
                               torch.tensor(slot, dtype=torch.int32, device=dev),
                               torch.tensor(qs, dtype=torch.int32, device=dev),
                               torch.tensor(ends, dtype=torch.long, device=dev), rows=rows,
                               max_query_len=max(b - a for _, a, b in rows))
        done = [s for s, _, b in rows if s >= 0 and fed[s] == prompt]
        if done:
            last_tok[done] = logits.argmax(-1)
    _sync(dev)
    t1 = time.perf_counter()
    model.step_status()
    slot = torch.arange(n_seq, dtype=torch.int32, device=dev)
    qs = torch.arange(n_seq + 1, dtype=torch.int32, device=dev)
    rows = [(s, s, s + 1) for s in range(n_seq)]
    every = torch.arange(n_seq, dtype=torch.long, device=dev)
    logits = None
    if graphs:
        pos = torch.full((n_seq,), prompt, dtype=torch.long, device=dev)
        logits = model.forward(last_tok, pos, slot, qs, every, rows=rows, max_query_len=1)  # warms every kernel up
        tok, pos = logits.argmax(-1), pos + 1
        model.step_status()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = model.forward(tok, pos, slot, qs, every, max_query_len=1)
            tok.copy_(logits.argmax(-1))
            pos.add_(1)
        _sync(dev)
        t2 = time.perf_counter()
        for _ in range(decode_steps):
            graph.replay()
    else:
        t2 = t1
        for i in range(decode_steps):
            pos = torch.full((n_seq,), prompt + i, dtype=torch.long, device=dev)
            logits = model.forward(last_tok, pos, slot, qs, every, rows=rows, max_query_len=1)
            last_tok = logits.argmax(-1)
    _sync(dev)
    t3 = time.perf_counter()
    model.step_status()
    return t1 - t0, t3 - t2, rows_per_step, None if logits is None else logits.float().cpu()


def bench(base: Config, sweep: Sequence[Tuple[int, int]], mechanisms: Sequence[str], decode_steps: int,
          chunk: int, step_tokens: int, dense_max_gib: float, ua_room: int = 2048, warmup: bool = True,
          graphs: bool = False, print_fn=print):
    """The benchmark of record (see the module docstring). A Universal Attention slot keeps at most
    chunk + ua_room rows per KV head (what survives pruning plus the prompt chunk in flight; 0: n_ctx).
    Returns {(n_seq, prompt, mechanism): result}."""
    weights = make_weights(dataclasses.replace(base, mechanism="dense"))
    results = {}
    print_fn(f"model: {base.layers} layers, d_model {base.d_model}, {base.q_heads} query / {base.kv_heads} KV heads "
             f"of {base.head_dim}, MLP {base.mlp}, vocab {base.vocab}; {base.device}, {str(base.dtype)[6:]}; "
             f"prefill chunks of {chunk} tokens, at most {step_tokens} tokens a step; {decode_steps} decode steps"
             f"{' replayed from a CUDA graph' if graphs else ' (eager)'}; "
             f"dense: SDPA {'efficient, masked to n_ctx' if graphs else base.dense_backend}")
    print_fn(f"{'seqs':>5} {'prompt':>7} {'mechanism':<12} {'prefill tok/s':>14} {'decode tok/s':>13} "
             f"{'ms/step':>8} {'x dense':>8} {'cache MiB':>10} {'live/step (prefill, decode)':>28}")
    for n_seq, prompt in sweep:
        dense_rate = None
        for name in mechanisms:
            cfg = dataclasses.replace(base, **BENCH_MECHANISMS[name], max_slots=n_seq,
                                      n_ctx=prompt + decode_steps + 1, prefill_chunk=chunk, wait=False)
            if cfg.mechanism == "ua" and ua_room > 0:
                cfg.ua_capacity = min(cfg.n_ctx, chunk + ua_room)
            if cfg.mechanism == "dense":
                need = 2 * cfg.layers * n_seq * cfg.kv_heads * cfg.n_ctx * cfg.head_dim * \
                    torch.tensor([], dtype=cfg.dtype).element_size()
                if need > dense_max_gib * 2**30:
                    print_fn(f"{n_seq:>5} {prompt:>7} {name:<12} skipped: its KV cache needs {need / 2**30:.1f} GiB "
                             f"(> --dense-max-gib {dense_max_gib:g})")
                    continue
            model = Decoder(cfg, weights)
            # the dense cache prefills each prompt in one row on CUDA: FlashAttention's causal kernel, its
            # best case (a chunk after cached tokens needs an explicit mask, which fused kernels may not
            # take with grouped queries); kvmem's states take the chunks an engine's token budget gives
            own_chunk = prompt if name == "dense" and torch.device(base.device).type == "cuda" else chunk
            if warmup:  # kernels, allocator, library heuristics: a short run at this batch shape
                _bench_steps(model, n_seq, min(prompt, own_chunk), 2, own_chunk, step_tokens, seed=99, graphs=graphs)
            pre, dec, rows, logits = _bench_steps(model, n_seq, prompt, decode_steps, own_chunk, step_tokens, seed=1,
                                                  graphs=graphs)
            prefill_rate, decode_rate = n_seq * prompt / pre, n_seq * decode_steps / max(dec, 1e-12)
            if name == "dense":
                dense_rate = decode_rate
            ratio = f"{decode_rate / dense_rate:8.2f}" if dense_rate else f"{'-':>8}"
            live = f"{sum(rows) / len(rows):.1f}, {n_seq}"
            print_fn(f"{n_seq:>5} {prompt:>7} {name:<12} {prefill_rate:14.0f} {decode_rate:13.0f} "
                     f"{1e3 * dec / max(decode_steps, 1):8.2f} {ratio} {model.layout_bytes() / 2**20:10.1f} "
                     f"{live:>28}")
            results[(n_seq, prompt, name)] = dict(prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
                                                  cache_bytes=model.layout_bytes(), allocated=model.cache_bytes(),
                                                  rows_per_prefill_step=rows, logits=logits)
            del model
            if torch.device(base.device).type == "cuda":
                torch.cuda.empty_cache()
    return results


# ---- the Python path against the C++ engine --------------------------------------------------------------

ENGINE_MECHANISMS = {"kvm": ("kvm", dict(mechanism="kvm", kvm_budget=kvmem.Fixed(256))),
                     "kvm-sqrt": ("kvm-sqrt", dict(mechanism="kvm", kvm_budget=kvmem.Power(16.0, 0.5, 256))),
                     "ua": ("ua", dict(mechanism="ua", ua_p=0.05, ua_prefill_chunk=128)),
                     "dense": ("dense", dict(mechanism="dense"))}


def compare_engine(engine: str, base: Config, mechanism: str, requests: int, prompt: int, generate: int,
                   threads: int, print_fn=print):
    """Per-step times of the C++ engine and of this loop on the CPU, same model shape, same workload
    (every request arrives at step 0 with `prompt` tokens and generates `generate`), same threads.
    Returns {"cpp": (prefill ms/step, decode ms/step), "python": (...)}."""
    name, fields = ENGINE_MECHANISMS[mechanism]
    flags = ["--mechanism", name, "--layers", base.layers, "--heads", base.q_heads, "--kv-heads", base.kv_heads,
             "--head-dim", base.head_dim, "--mlp", base.mlp, "--vocab", base.vocab, "--chunk", base.kvm_chunk,
             "--window-chunks", base.kvm_window_chunks, "--prefill-chunk", base.prefill_chunk, "--slots",
             base.max_slots, "--requests", requests, "--prompt", f"{prompt}:{prompt}", "--generate",
             f"{generate}:{generate}", "--arrival-gap", 0, "--threads", threads]
    run = subprocess.run([engine] + [str(f) for f in flags], capture_output=True, text=True, check=True)
    cpp = {"prefill": [], "decode": []}
    for line in run.stdout.splitlines():  # step live rows prefill decode alloc in-use ms
        f = line.split()
        if len(f) == 10 and f[0].isdigit():
            cpp["prefill" if int(f[3]) > 0 else "decode"].append(float(f[9]))
    torch.set_num_threads(threads)
    cfg = dataclasses.replace(base, **fields, n_ctx=prompt + generate, rope_dims=base.head_dim // 2, device="cpu",
                              dtype=torch.float32)
    model = Decoder(cfg, make_weights(cfg))
    py = {"prefill": [], "decode": []}
    attn = {"prefill": [], "decode": []}
    steps = []

    def record(st):
        steps.append(dict(st, attention=model.attention_seconds))
        model.attention_seconds = 0.0

    serve(model, workload(requests, cfg.vocab, (prompt, prompt), (generate, generate), gap=0), on_step=record)
    for st in steps:
        kind = "prefill" if st["prefill"] > 0 else "decode"
        py[kind].append(1e3 * st["seconds"])
        attn[kind].append(1e3 * st["attention"])

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    out = {"cpp": (mean(cpp["prefill"]), mean(cpp["decode"])), "python": (mean(py["prefill"]), mean(py["decode"])),
           "python_attention": (mean(attn["prefill"]), mean(attn["decode"]))}
    print_fn(f"{mechanism}: {requests} requests of {prompt} prompt + {generate} generated tokens, {base.max_slots} "
             f"slots, {threads} threads; ms per step (prefill steps, decode steps)")
    for who, label in (("cpp", "C++ engine"), ("python", "Python ops"),
                       ("python_attention", "  of which the attention calls")):
        print_fn(f"  {label:<30} prefill {out[who][0]:9.3f}   decode {out[who][1]:9.3f}")
    print_fn(f"  Python / C++: prefill {out['python'][0] / out['cpp'][0]:.2f}x, "
             f"decode {out['python'][1] / out['cpp'][1]:.2f}x")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mechanism", default="kvm", choices=["kvm", "ua", "dense", "kvm-sqrt"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", default="8:120", help="min:max prompt tokens")
    ap.add_argument("--generate", default="4:32", help="min:max generated tokens")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    model = ap.add_argument_group("model shape (--bench and --compare-engine)")
    model.add_argument("--layers", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--kv-heads", type=int)
    model.add_argument("--head-dim", type=int)
    model.add_argument("--mlp", type=int)
    model.add_argument("--vocab", type=int)
    model.add_argument("--chunk", type=int, help="KV Means chunk C (the window is 2 C)")
    b = ap.add_argument_group("benchmark")
    b.add_argument("--bench", action="store_true", help="measure kvm-256, kvm-16sqrtN and ua-0.05 against dense")
    b.add_argument("--sweep", default="32x4096,32x32768,256x4096,256x16384",
                   help="comma-separated SEQSxPROMPT: concurrent sequences and prompt tokens")
    b.add_argument("--mechanisms", default="dense,kvm-256,kvm-16sqrtN,ua-0.05")
    b.add_argument("--decode-steps", type=int, default=32)
    b.add_argument("--prefill-chunk", type=int, default=2048)
    b.add_argument("--step-tokens", type=int, default=16384, help="most tokens of one prefill step")
    b.add_argument("--ua-room", type=int, default=2048,
                   help="UA capacity beyond the prefill chunk: kept rows a slot may hold (0: n_ctx)")
    b.add_argument("--dense-max-gib", type=float, default=80.0, help="skip dense where its KV cache needs more")
    b.add_argument("--no-warmup", action="store_true")
    b.add_argument("--dense-backend", default="flash", choices=SdpaCache.BACKENDS,
                   help="SDPA kernel of the dense cache's decode and causal prefill on CUDA")
    b.add_argument("--graphs", action="store_true",
                   help="decode from a CUDA graph of the whole step (CUDA), instead of eager steps")
    e = ap.add_argument_group("the Python path against the C++ engine (CPU)")
    e.add_argument("--compare-engine", metavar="PATH", help="kvmem-engine executable (examples/engine)")
    e.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    shape = {k: v for k, v in dict(layers=a.layers, q_heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                                   mlp=a.mlp, vocab=a.vocab, kvm_chunk=a.chunk).items() if v is not None}
    if a.graphs and torch.device(a.device).type != "cuda":
        ap.error("--graphs: CUDA graphs need --device cuda")
    if a.bench:
        # default: a Llama-style GQA attention (32 query heads over 8 KV heads of 128) in 2 layers with a
        # narrower MLP, so that the sweep's prefill of millions of tokens fits minutes on one GPU
        defaults = dict(layers=2, q_heads=32, kv_heads=8, head_dim=128, mlp=8192, vocab=32000, kvm_chunk=256,
                        ua_prefill_chunk=128)
        defaults.update(shape)
        base = Config(**defaults, rope_dims=defaults["head_dim"] // 2, device=a.device, dtype=dtype,
                      dense_backend=a.dense_backend)
        sweep = [tuple(int(x) for x in item.split("x")) for item in a.sweep.split(",")]
        bench(base, sweep, a.mechanisms.split(","), a.decode_steps, a.prefill_chunk, a.step_tokens, a.dense_max_gib,
              ua_room=a.ua_room, warmup=not a.no_warmup, graphs=a.graphs, print_fn=lambda *x: print(*x, flush=True))
        return
    p, g = tuple(map(int, a.prompt.split(":"))), tuple(map(int, a.generate.split(":")))
    if a.compare_engine:
        base = Config(**dict(dict(layers=4, q_heads=8, kv_heads=2, head_dim=64, mlp=1024, vocab=512, kvm_chunk=64,
                                  prefill_chunk=64), **shape), max_slots=a.slots)
        compare_engine(a.compare_engine, base, a.mechanism, a.requests, p[1], g[1], a.threads)
        return
    mech = ENGINE_MECHANISMS[a.mechanism][1] if a.mechanism == "kvm-sqrt" else dict(mechanism=a.mechanism)
    cfg = Config(**dict(mech, **shape), max_slots=a.slots, n_ctx=p[1] + g[1], device=a.device, dtype=dtype)
    model = Decoder(cfg, make_weights(cfg))
    _, tokens, seconds = serve(model, workload(a.requests, cfg.vocab, p, g), verbose=not a.quiet)
    print(f"{a.mechanism}: {tokens} tokens in {seconds:.3f} s = {tokens / seconds:.0f} tokens/s; "
          f"kvmem state {model.cache_bytes() / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
