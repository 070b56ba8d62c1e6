# SPDX-License-Identifier: Apache-2.0
"""The Python examples: the decode loop agrees with a plain PyTorch dense KV cache where KV Means
must (requests shorter than the window), and the head-parallel loop on 2 gloo processes equals the
1-process loop."""

import math
import os
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import decode_loop  # noqa: E402
import head_parallel  # noqa: E402


def run_loop(mechanism, prompt, generate, requests=6, **kw):
    cfg = decode_loop.Config(mechanism=mechanism, n_ctx=prompt[1] + generate[1], **kw)
    model = decode_loop.Decoder(cfg, decode_loop.make_weights(cfg))
    results, tokens, _ = decode_loop.serve(model, decode_loop.workload(requests, cfg.vocab, prompt, generate))
    return results, tokens


def test_decode_loop_kvm_equals_a_dense_cache_within_the_window():
    # window = 16 * 2 tokens; every request stays inside it (prompt + generated <= 32)
    prompt, generate = (4, 16), (2, 16)
    kvm, _ = run_loop("kvm", prompt, generate)
    dense, _ = run_loop("dense", prompt, generate)
    for a, b in zip(kvm, dense):
        assert a["tokens"] == b["tokens"]
        torch.testing.assert_close(a["logits"], b["logits"], atol=1e-4, rtol=1e-4)


def test_decode_loop_serves_every_request_and_differs_from_dense_beyond_the_window():
    prompt, generate = (40, 80), (4, 12)
    requests = decode_loop.workload(6, decode_loop.Config.vocab, prompt, generate)
    for mechanism in ("kvm", "ua"):
        results, tokens = run_loop(mechanism, prompt, generate)
        assert [len(r["tokens"]) for r in results] == [r.max_new for r in requests]
        assert tokens == sum(len(r.prompt) + r.max_new - 1 for r in requests)
    kvm, _ = run_loop("kvm", prompt, generate)
    dense, _ = run_loop("dense", prompt, generate)
    assert max((a["logits"] - b["logits"]).abs().max().item() for a, b in zip(kvm, dense)) > 1e-3


@pytest.mark.parametrize("mechanism", ["kvm", "ua"])
def test_head_parallel_on_two_gloo_processes_equals_one_process(mechanism):
    args = SimpleNamespace(mechanism=mechanism, slots=4, requests=5, prompt=(8, 60), generate=(4, 12), n_ctx=72,
                           device="cpu")
    single, _ = run_loop(mechanism, args.prompt, args.generate, requests=args.requests, max_slots=args.slots)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.pt")
        head_parallel.run(2, args, out)
        sharded = torch.load(out)
    assert len(sharded) == len(single)
    for a, b in zip(sharded, single):
        assert a["tokens"] == b["tokens"]
        # the output projection sums two head shards instead of one product: rounding differs only
        torch.testing.assert_close(a["logits"], b["logits"], atol=1e-4, rtol=1e-4)


def test_decode_loop_in_bfloat16_kvm_equals_a_dense_cache_within_the_window():
    # The model and kvmem's states in bfloat16; the dense cache attends in float32 over the same bfloat16
    # keys and values. Within the window both attention outputs are one bfloat16 rounding of nearly equal
    # float32 values, so the logits agree to a bfloat16 unit in the last place of the largest logit
    # (2**-7 of its magnitude: 8 significant bits) and the same tokens are generated.
    prompt, generate = (4, 16), (2, 16)
    kvm, _ = run_loop("kvm", prompt, generate, dtype=torch.bfloat16)
    dense, _ = run_loop("dense", prompt, generate, dtype=torch.bfloat16)
    for a, b in zip(kvm, dense):
        assert a["tokens"] == b["tokens"]
        torch.testing.assert_close(a["logits"], b["logits"], atol=2 ** -7 * b["logits"].abs().max().item(), rtol=0)


TINY = dict(layers=2, q_heads=4, kv_heads=2, head_dim=16, rope_dims=8, mlp=64, vocab=64, kvm_chunk=16,
            kvm_window_chunks=2)


def test_bench_on_the_cpu_agrees_with_dense_within_the_window():
    # prompts + decode steps <= the 32-token window: KV Means attends exactly like the dense cache (its
    # 256 memory slots hold nothing yet), so the last decode step's logits agree to float32 rounding
    lines = []
    base = decode_loop.Config(**TINY)
    res = decode_loop.bench(base, [(2, 20), (3, 12)], list(decode_loop.BENCH_MECHANISMS), decode_steps=4, chunk=8,
                            step_tokens=16, dense_max_gib=1.0, ua_room=32, print_fn=lines.append)
    for n_seq, prompt in [(2, 20), (3, 12)]:
        dense = res[(n_seq, prompt, "dense")]
        for name in decode_loop.BENCH_MECHANISMS:
            r = res[(n_seq, prompt, name)]
            assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
            assert r["logits"].shape == (n_seq, base.vocab)
            assert r["cache_bytes"] > 0
            if name.startswith("kvm"):
                assert r["cache_bytes"] == r["allocated"]  # kvm_state_bytes: what the states allocate
                torch.testing.assert_close(r["logits"], dense["logits"], atol=1e-4, rtol=1e-4)
        rows = res[(n_seq, prompt, "dense")]["rows_per_prefill_step"]
        assert sum(rows) == n_seq * math.ceil(prompt / 8) and max(rows) <= n_seq  # a row per chunk of 8 tokens
        assert sum(1 for line in lines if line.split()[:2] == [str(n_seq), str(prompt)]) == 4
    # dense skipped where its cache would exceed the budget, the others still measured
    lines.clear()
    res = decode_loop.bench(base, [(2, 40)], ["dense", "kvm-256"], decode_steps=2, chunk=8, step_tokens=16,
                            dense_max_gib=1e-9, warmup=False, print_fn=lines.append)
    assert (2, 40, "dense") not in res and (2, 40, "kvm-256") in res
    assert any("skipped" in line for line in lines)


def test_bench_flags_on_the_cpu(capsys):
    decode_loop.main(["--bench", "--device", "cpu", "--dtype", "bfloat16", "--sweep", "2x24", "--layers", "1",
                      "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--mlp", "32", "--vocab", "32",
                      "--chunk", "8", "--prefill-chunk", "8", "--step-tokens", "16", "--decode-steps", "2",
                      "--ua-room", "32", "--no-warmup"])
    out = capsys.readouterr().out
    assert "cpu, bfloat16" in out
    for name in decode_loop.BENCH_MECHANISMS:
        assert any(line.split()[:3] == ["2", "24", name] for line in out.splitlines()), name


def test_python_ops_against_the_cpp_engine_per_step():
    engine = os.environ.get("KVMEM_ENGINE")
    if not engine or not os.path.exists(engine):
        reason = "KVMEM_ENGINE (the kvmem-engine program) is not set; ctest sets it"
        print(f"test_python_ops_against_the_cpp_engine_per_step: skipped: {reason}")
        pytest.skip(reason)
    lines = []
    base = decode_loop.Config(**dict(TINY, max_slots=4, prefill_chunk=16))
    for mechanism in ("kvm", "ua"):
        times = decode_loop.compare_engine(engine, base, mechanism, requests=4, prompt=24, generate=4, threads=1,
                                           print_fn=lines.append)
        for who in ("cpp", "python"):
            assert all(t > 0 for t in times[who]), (mechanism, who, times)
    assert sum("Python / C++" in line for line in lines) == 2


def _plain_sdpa(q, k, v, attn_mask=None, is_causal=False):
    """softmax(q k^T / sqrt(D)) v with a boolean mask or a top-left causal one: what
    torch.nn.functional.scaled_dot_product_attention computes (torch 1.13 has none)."""
    logits = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        logits = logits + attn_mask.float()
    return (logits.softmax(-1) @ v.float()).to(q.dtype)


def test_the_sdpa_cache_attends_like_the_plain_dense_cache(monkeypatch):
    # The CUDA baseline's grouping of rows, chunked prefill masks and grouped-query decode, run on the CPU
    # against DenseCache; torch's SDPA where it has one, else a plain stand-in of it.
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _plain_sdpa, raising=False)
    hq, hk, d, slots = 4, 2, 8, 4
    sdpa = decode_loop.SdpaCache(slots, hk, 64, d, "cpu", torch.float32, backend="auto")
    plain = decode_loop.DenseCache(slots)
    g = torch.Generator().manual_seed(3)
    schedule = [[(0, 5), (1, 5), (2, 5), (-1, 0)],   # one group: first chunks of three slots
                [(0, 3), (1, 3), (3, 7)],            # chunks after cached tokens (masked), a new slot
                [(0, 1), (1, 1), (2, 1), (3, 1)],    # a decode group at mixed lengths
                [(0, 1), (1, 1)],                    # a decode group of slots 0..1 at one length
                [(2, 4), (0, 1)]]
    for step in schedule:
        slot, qs = [], [0]
        for s, n in step:
            slot.append(s)
            qs.append(qs[-1] + n)
        n = qs[-1]
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hk, hk))
        rows = [(slot[r], qs[r], qs[r + 1]) for r in range(len(slot))]
        got = sdpa.step(rows, q, k, v)
        want = plain.step(torch.tensor(slot), torch.tensor(qs), q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sdpa.length == [11, 10, 10, 8]
    # the graph-capturable decode: slots 0..3 at one length, no host-side lengths, masked to n_ctx
    sdpa = decode_loop.SdpaCache(slots, hk, 16, d, "cpu", torch.float32, backend="auto")
    plain = decode_loop.DenseCache(slots)
    for n in (6, 1, 1):
        q, k, v = (torch.randn(slots * n, h, d, generator=g) for h in (hq, hk, hk))
        qs = [r * n for r in range(slots + 1)]
        if n > 1:  # the prompts, through step()
            sdpa.step([(s, qs[s], qs[s + 1]) for s in range(slots)], q, k, v)
            got = None
        else:
            pos = torch.full((slots,), plain_len, dtype=torch.long)
            got = sdpa.decode_at(pos, q, k, v)
        want = plain.step(torch.arange(slots), torch.tensor(qs), q, k, v)
        plain_len = 6 if n > 1 else plain_len + 1
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dense backend: expected one of flash, cudnn, efficient, auto, got x"):
        decode_loop.SdpaCache(slots, hk, 16, d, "cpu", torch.float32, backend="x")
