# SPDX-License-Identifier: Apache-2.0
"""A continuous-batching decode loop over kvmem's PyTorch ops.

A small Llama-shaped decoder (pre-norm RMSNorm, grouped-query attention with rotary positions on the
leading rope_dims channels, SwiGLU MLP, tied embedding; random weights) serves requests that arrive
at different steps with prompts and output lengths of their own. Every step packs one ragged batch:
a prefill chunk of each request still reading its prompt, one token of each generating request, and
padding rows up to a multiple of 4 (what an engine that captures graphs per batch size does). Each
layer's attention is one kvmem step over sequence slots (``kvmem.kvm_step`` or ``kvmem.ua_step``);
``dense`` is a plain PyTorch KV cache for comparison.

    PYTHONPATH=build/release/python python3 examples/python/decode_loop.py --mechanism kvm

The Decoder takes an optional range of KV heads and a process group, so head_parallel.py runs the
same model with the heads sharded over ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

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
    kvm_budget: kvmem.Fixed = dataclasses.field(default_factory=lambda: kvmem.Fixed(64))
    ua_p: float = 0.05
    ua_prefill_chunk: int = 16
    # scheduling
    prefill_chunk: int = 24
    row_bucket: int = 4

    @property
    def d_model(self) -> int:
        return self.q_heads * self.head_dim


def make_weights(cfg: Config) -> Dict[str, torch.Tensor]:
    """Random weights ~ N(0, 1/fan_in) (unit-scale activations); norms near 1."""
    g = torch.Generator().manual_seed(cfg.seed)
    dm, D = cfg.d_model, cfg.head_dim

    def mat(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    def norm(n):
        return 0.8 + 0.4 * torch.rand(n, generator=g)

    w = {"embed": torch.randn(cfg.vocab, dm, generator=g), "final_norm": norm(dm)}
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
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dims)
    ang = pos.double()[:, None] * inv[None, :]
    c, s = torch.cos(ang).float()[:, None, :], torch.sin(ang).float()[:, None, :]
    a, b = x[..., :half], x[..., half:rope_dims]
    return torch.cat([a * c - b * s, a * s + b * c, x[..., rope_dims:]], dim=-1)


class DenseCache:
    """The baseline: every key and value of every slot; causal softmax(q·k/√D) in plain PyTorch."""

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
            K, V = self.k[s].repeat_interleave(rep, 1), self.v[s].repeat_interleave(rep, 1)
            n, t = b - a, K.shape[0]
            logits = torch.einsum("thd,shd->hts", q[a:b], K) / math.sqrt(q.shape[-1])
            mask = torch.arange(t)[None, :] <= (torch.arange(n) + t - n)[:, None]
            out[a:b] = torch.einsum("hts,shd->thd", logits.masked_fill(~mask, float("-inf")).softmax(-1), V)
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
        self.kvm_weights = kvmem.KvmWeights.identity(D, self.hq)
        self.states = [self._state() for _ in range(cfg.layers)]

    def _state(self):
        c = self.cfg
        if c.mechanism == "kvm":
            return kvmem.kvm_create(c.max_slots, self.hq, self.hk, c.head_dim, c.head_dim, c.n_ctx,
                                    chunk=c.kvm_chunk, window_chunks=c.kvm_window_chunks, rope_dims=c.rope_dims,
                                    budget=c.kvm_budget)
        if c.mechanism == "ua":
            return kvmem.ua_create(c.max_slots, self.hq, self.hk, c.head_dim, c.n_ctx)
        if c.mechanism == "dense":
            return DenseCache(c.max_slots)
        raise ValueError(f"mechanism: expected kvm, ua or dense, got {c.mechanism}")

    def reset(self, slots: Sequence[int]) -> None:
        for s in self.states:
            if isinstance(s, DenseCache):
                s.reset(slots)
            else:
                kvmem.reset_slots(s, list(slots))

    def cache_bytes(self) -> int:
        return sum(s.allocated_bytes() for s in self.states if not isinstance(s, DenseCache))

    def attention(self, l: int, h: torch.Tensor, pos, slot, query_start) -> torch.Tensor:
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
        if c.mechanism == "kvm":
            o, _ = kvmem.kvm_step(state, self.kvm_weights, slot, query_start, q, k, v, torch.sigmoid(zk))
        elif c.mechanism == "ua":
            o, _ = kvmem.ua_step(state, slot, query_start, q, k, v, zk, zq, p=c.ua_p,
                                 prefill_chunk=c.ua_prefill_chunk)
        else:
            o = state.step(slot, query_start, q, k, v)
        y = o.reshape(N, self.hq * D) @ w[f"{l}.wo"][:, self.qrows].T
        if self.group is not None:
            torch.distributed.all_reduce(y, group=self.group)
        return y

    def forward(self, tokens, pos, slot, query_start, last) -> torch.Tensor:
        """Logits [len(last), vocab] of the tokens at indices `last` of the packed batch."""
        w = self.w
        x = w["embed"][tokens]
        for l in range(self.cfg.layers):
            x = x + self.attention(l, rms_norm(x, w[f"{l}.attn_norm"]), pos, slot, query_start)
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


def serve(model: Decoder, requests: List[Request], verbose: bool = False):
    """Continuous batching over the model's slots. Returns, per request, the generated tokens and the
    logits [max_new, vocab] they were sampled from, and the total tokens and seconds."""
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
        for s, live in enumerate(slots):
            if live is None:
                continue
            rq, res = requests[live["request"]], results[live["request"]]
            if live["fed"] < len(rq.prompt):
                n = min(cfg.prefill_chunk, len(rq.prompt) - live["fed"])
                tok += rq.prompt[live["fed"]:live["fed"] + n]
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
        logits = None
        if tok:
            logits = model.forward(torch.tensor(tok), torch.tensor(pos), torch.tensor(slot, dtype=torch.int32),
                                   torch.tensor(qs, dtype=torch.int32), torch.tensor(last, dtype=torch.long))
        i = 0
        for r in range(len(slot)):
            if not samples[r]:
                continue
            s = slot[r]
            res = results[slots[s]["request"]]
            res["logits"].append(logits[i])
            res["tokens"].append(int(logits[i].argmax()))
            i += 1
            if len(res["tokens"]) >= requests[slots[s]["request"]].max_new:
                model.reset([s])
                slots[s] = None
                done += 1
        dt = time.perf_counter() - t0
        tokens_total += len(tok)
        seconds += dt
        if verbose:
            print(f"step {step:4d}  live {live_rows:3d}  rows {len(slot):3d}  tokens {len(tok):4d}  "
                  f"cache {model.cache_bytes() / 2**20:7.2f} MiB  {1e3 * dt:7.2f} ms")
        step += 1
    for res in results:
        res["logits"] = torch.stack(res["logits"])
    return results, tokens_total, seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mechanism", default="kvm", choices=["kvm", "ua", "dense"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", default="8:120", help="min:max prompt tokens")
    ap.add_argument("--generate", default="4:32", help="min:max generated tokens")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    p, g = tuple(map(int, a.prompt.split(":"))), tuple(map(int, a.generate.split(":")))
    cfg = Config(mechanism=a.mechanism, max_slots=a.slots, n_ctx=p[1] + g[1])
    model = Decoder(cfg, make_weights(cfg))
    _, tokens, seconds = serve(model, workload(a.requests, cfg.vocab, p, g), verbose=not a.quiet)
    print(f"{a.mechanism}: {tokens} tokens in {seconds:.3f} s = {tokens / seconds:.0f} tokens/s; "
          f"kvmem state {model.cache_bytes() / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
