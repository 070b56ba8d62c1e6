# SPDX-License-Identifier: Apache-2.0
"""The Python examples: the decode loop agrees with a plain PyTorch dense KV cache where KV Means
must (requests shorter than the window), and the head-parallel loop on 2 gloo processes equals the
1-process loop."""

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
    args = SimpleNamespace(mechanism=mechanism, slots=4, requests=5, prompt=(8, 60), generate=(4, 12), n_ctx=72)
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
