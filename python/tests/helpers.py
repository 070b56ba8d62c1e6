# SPDX-License-Identifier: Apache-2.0
"""Independent references for the op tests: plain PyTorch dense causal attention and dense Universal
Attention (float64, formula by formula from the specs), and the host backend's C++ results through
kvmem-torch-oracle (one sequence through the batch-major C++ API); and the schedule runner the tests
share."""

import json
import math
import os
import struct
import subprocess
import tempfile
from typing import Dict, List, Sequence, Tuple

import pytest
import torch


def rows(slots: Sequence[int], counts: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """slot [rows] and query_start [rows + 1] (int32) for rows of `counts` tokens."""
    qs = [0]
    for c in counts:
        qs.append(qs[-1] + c)
    return torch.tensor(list(slots), dtype=torch.int32), torch.tensor(qs, dtype=torch.int32)


def serve(step, seqs, schedule):
    """Runs `schedule`, a list of steps, each a list of (slot, tokens) rows (slot -1: padding), where
    seqs[slot] holds the packed inputs of that slot's whole sequence. Returns every slot's outputs
    [T, Hq, D] and lse [T, Hq], assembled in token order, and the padding rows' outputs."""
    fed = {s: 0 for s in seqs}
    outs = {s: [] for s in seqs}
    lses = {s: [] for s in seqs}
    padding = []
    for rows_of_step in schedule:
        parts = {name: [] for name in next(iter(seqs.values()))}
        for slot, n in rows_of_step:
            src = seqs[slot] if slot >= 0 else next(iter(seqs.values()))
            lo = fed[slot] if slot >= 0 else 0
            for name, t in src.items():
                parts[name].append(t[lo:lo + n] + (0 if slot >= 0 else 7.0))
        slot_t, qs = rows([s for s, _ in rows_of_step], [n for _, n in rows_of_step])
        out, lse = step(slot_t, qs, **{name: torch.cat(p) for name, p in parts.items()})
        for r, (slot, n) in enumerate(rows_of_step):
            a, b = int(qs[r]), int(qs[r + 1])
            if slot < 0:
                padding.append((out[a:b], lse[a:b]))
                continue
            outs[slot].append(out[a:b])
            lses[slot].append(lse[a:b])
            fed[slot] += n
    return {s: torch.cat(o) for s, o in outs.items()}, {s: torch.cat(l) for s, l in lses.items()}, padding


def kvm_inputs(T: int, seed: int, hq: int, hk: int, d: int) -> Dict[str, torch.Tensor]:
    """Seeded packed KV Means inputs of T tokens: q [T, hq, d], k and v [T, hk, d], gate [T, hk] > 0."""
    g = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(T, hq, d, generator=g), k=torch.randn(T, hk, d, generator=g),
                v=torch.randn(T, hk, d, generator=g), gate=torch.rand(T, hk, generator=g) + 0.5)


def ua_inputs(T: int, seed: int, h: int, hk: int, d: int) -> Dict[str, torch.Tensor]:
    """Seeded packed Universal Attention inputs of T tokens (unit keys, gate logits around +1)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, hk, d, generator=g)
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
    return dict(q=2 * torch.randn(T, h, d, generator=g), k=k, v=torch.randn(T, hk, d, generator=g),
                z_k=torch.randn(T, hk, generator=g) + 1.0, z_q=torch.randn(T, hk, generator=g) + 1.0)


def random_kvm_weights(seed: int, d: int, hq: int):
    """Seeded KV Means weights near the identity LayerNorm and unit temperatures (kvmem.KvmWeights)."""
    import kvmem
    g = torch.Generator().manual_seed(seed)
    return kvmem.KvmWeights(1 + 0.2 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g),
                            1 + 0.3 * torch.rand(hq, generator=g), 0.8 + 0.3 * torch.rand(hq, generator=g))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 0.0):
    """Causal softmax attention of one sequence: q [T,Hq,D], k [T,Hk,D], v [T,Hk,Dv] -> out [T,Hq,Dv],
    lse [T,Hq]; query head h reads KV head h // (Hq / Hk)."""
    T, Hq, D = q.shape
    rep = Hq // k.shape[1]
    scale = scale or 1.0 / math.sqrt(D)
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    logits = torch.einsum("thd,shd->hts", qd, kd) * scale
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, T]
    out = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1), vd)
    return out, lse.transpose(0, 1)


def dense_ua(q, k, v, z_k, z_q):
    """Universal Attention without pruning (spec UA.md 4.1-4.3), float64: per KV head g and j < m,
    A_jm = log1p(-min(x_jm, 1 - 1e-6)) with x_jm = (sigmoid(z_k[j]) sigmoid(z_q[m]) relu(k_j.k_m)^2)^(1/3)
    (A = 0 where k_j.k_m <= 0), Λ_ij = Σ_{m=j+1..i} A_jm, s = q_i.k_j + Λ_ij, causal softmax, scale 1."""
    T, H, D = q.shape
    G = k.shape[1]
    rep = H // G
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for g in range(G):
        c = kd[:, g] @ kd[:, g].T  # [j, m]
        lg = torch.nn.functional.logsigmoid(z_k[:, g].double())[:, None] + \
            torch.nn.functional.logsigmoid(z_q[:, g].double())[None, :]
        logx = (lg + 2 * torch.log(c.clamp_min(1e-300))) / 3
        A = torch.log1p(-torch.minimum(torch.exp(logx), torch.tensor(1 - 1e-6, dtype=torch.float64)))
        A = torch.where(c > 0, A, torch.zeros_like(A))
        A = torch.triu(A, diagonal=1)  # only m > j
        lam = torch.cumsum(A, dim=1).T  # lam[i, j] = Σ_{m <= i} A_jm (m > j)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for h in range(g * rep, (g + 1) * rep):
            s = qd[:, h] @ kd[:, g].T + lam
            s = s.masked_fill(~mask, float("-inf"))
            lse[:, h] = torch.logsumexp(s, dim=-1)
            out[:, h] = torch.softmax(s, dim=-1) @ vd[:, g]
    return out, lse


# ---- the host backend's C++ results ----------------------------------------------------------------------

def _write_safetensors(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, object]) -> None:
    header: Dict[str, object] = {"__metadata__": {k: str(v) for k, v in meta.items()}}
    blobs: List[bytes] = []
    offset = 0
    for name, t in tensors.items():
        data = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F64"
        b, e = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(blob[base + b:base + e]), dtype=torch.float64).reshape(info["shape"])
    return out


def oracle(tensors: Dict[str, torch.Tensor], **meta) -> torch.Tensor:
    """out [T, Hq, Dv] (float32 values) of one sequence run by the host backend's batch-major API: a
    prefill of meta['prefill'] tokens, then one decode call per token."""
    exe = os.environ.get("KVMEM_ORACLE")
    if not exe:
        pytest.skip("KVMEM_ORACLE (the kvmem-torch-oracle program) is not set; ctest sets it")
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.safetensors"), os.path.join(d, "out.safetensors")
        _write_safetensors(src, tensors, meta)
        run = subprocess.run([exe, src, dst], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return _read_safetensors(dst)["out"].float()
