# SPDX-License-Identifier: Apache-2.0
"""The PyTorch ops against independent results: plain PyTorch dense causal attention where KV Means
reduces to it (sequences within the window, spec KVM.md 4.8), dense Universal Attention written in
PyTorch (p = 0), and the host backend's C++ results for everything else (kvmem-torch-oracle)."""

import math

import pytest
import torch

import kvmem
import helpers
from helpers import dense_attention, dense_ua, oracle, rows, serve

HQ, HK, D = 4, 2, 16
C, NB = 8, 2  # KVM chunk and window chunks: the window holds 16 keys


def kvm_state(max_slots=4, n_ctx=64, **kw):
    return kvmem.kvm_create(max_slots, HQ, HK, D, D, n_ctx, chunk=C, window_chunks=NB, rope_dims=D // 2, **kw)


def kvm_inputs(T, seed):
    return helpers.kvm_inputs(T, seed, HQ, HK, D)


def ua_inputs(T, seed):
    return helpers.ua_inputs(T, seed, HQ, HK, D)


def random_weights(seed):
    return helpers.random_kvm_weights(seed, D, HQ)


# A ragged schedule: prefill chunks of different sizes, a padding row, decode tokens, slots joining late.
SCHEDULE_SHORT = [
    [(2, 5), (-1, 3), (0, 12)],
    [(2, 2), (3, 1), (0, 1)],
    [(0, 1), (3, 6), (2, 1)],
    [(3, 1), (2, 1), (-1, 0)],
]


def test_kvm_step_equals_dense_attention_within_the_window():
    seqs = {0: kvm_inputs(14, 1), 2: kvm_inputs(9, 2), 3: kvm_inputs(8, 3)}
    state = kvm_state()
    w = kvmem.KvmWeights.identity(D, HQ)
    out, lse, padding = serve(lambda s, qs, **x: kvmem.kvm_step(state, w, s, qs, **x), seqs, SCHEDULE_SHORT)
    for slot, x in seqs.items():
        ref_out, ref_lse = dense_attention(x["q"], x["k"], x["v"])
        torch.testing.assert_close(out[slot].double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[slot].double(), ref_lse, atol=1e-5, rtol=1e-5)
        assert state.tokens(slot) == x["q"].shape[0]
    assert state.tokens(1) == 0
    for o, l in padding:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


def kvm_oracle(x, weights, prefill):
    return oracle(dict(x, ln_weight=weights.ln_weight, ln_bias=weights.ln_bias, tau_state=weights.tau_state,
                       tau_bswa=weights.tau_bswa),
                  mechanism="kvm", prefill=prefill, chunk=C, window_chunks=NB, sink=1, rope_dims=D // 2,
                  budget_count=12)


SCHEDULE_LONG = [
    [(0, 13), (1, 20)],
    [(1, 17), (-1, 2), (0, 24)],
    [(0, 1), (1, 1)],
    [(1, 1), (0, 1)],
    [(0, 3), (1, 1)],
]


@pytest.mark.parametrize("exact", [True, False])
def test_kvm_step_equals_the_host_backend_beyond_the_window(exact):
    # 40 tokens with a 16-token window and 12 memory slots: state updates append and merge.
    seqs = {0: kvm_inputs(42, 4), 1: kvm_inputs(40, 5)}
    w = random_weights(6)
    state = kvm_state(max_slots=2, budget=kvmem.Fixed(12))
    out, _, _ = serve(lambda s, qs, **x: kvmem.kvm_step(state, w, s, qs, exact=exact, **x), seqs, SCHEDULE_LONG)
    for slot, x in seqs.items():
        ref = kvm_oracle(x, w, prefill=30)  # another split into calls: a row equals its sequence alone
        if exact:
            assert torch.equal(out[slot], ref)
        else:
            torch.testing.assert_close(out[slot], ref, atol=1e-5, rtol=1e-5)
        # far from dense attention: the memory slots summarise what left the window
        assert (out[slot][20:].double() - dense_attention(x["q"], x["k"], x["v"])[0][20:]).abs().max() > 1e-2


def test_ua_step_without_pruning_equals_dense_ua_in_pytorch():
    seqs = {0: ua_inputs(14, 7), 2: ua_inputs(9, 8), 3: ua_inputs(8, 9)}
    state = kvmem.ua_create(4, HQ, HK, D, 64)
    out, lse, padding = serve(lambda s, qs, **x: kvmem.ua_step(state, s, qs, **x, p=0.0), seqs, SCHEDULE_SHORT)
    for slot, x in seqs.items():
        ref_out, ref_lse = dense_ua(x["q"], x["k"], x["v"], x["z_k"], x["z_q"])
        torch.testing.assert_close(out[slot].double(), ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[slot].double(), ref_lse, atol=1e-4, rtol=1e-4)
    for o, l in padding:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


def test_ua_step_with_pruning_equals_the_host_backend():
    # Prompts in rows of whole prefill chunks (8) equal one prefill of the prompt (docs/slots-ua.md).
    seqs = {0: ua_inputs(36, 10), 1: ua_inputs(35, 11)}
    schedule = [[(0, 8), (1, 16)], [(0, 24), (1, 8)]] + [[(0, 1), (1, 1)]] * 4 + [[(1, 1)]] * 7
    state = kvmem.ua_create(2, HQ, HK, D, 64)
    step = lambda s, qs, **x: kvmem.ua_step(state, s, qs, **x, p=0.15, prefill_chunk=8)  # noqa: E731
    out, _, _ = serve(step, seqs, schedule)
    for slot, x in seqs.items():
        assert torch.equal(out[slot], oracle(x, mechanism="ua", prefill=32 if slot == 0 else 24, p=0.15,
                                             prefill_chunk=8))
        dense = dense_ua(x["q"], x["k"], x["v"], x["z_k"], x["z_q"])[0]
        assert (out[slot].double() - dense).abs().max() > 1e-3  # pruning evicted keys the output needed


# ---- slot operations -------------------------------------------------------------------------------

def feed_kvm(state, w, slot, x, lo, hi):
    s, qs = rows([slot], [hi - lo])
    return kvmem.kvm_step(state, w, s, qs, *(x[n][lo:hi] for n in ("q", "k", "v", "gate")), exact=True)[0]


def feed_ua(state, slot, x, lo, hi, p=0.15):
    s, qs = rows([slot], [hi - lo])
    return kvmem.ua_step(state, s, qs, *(x[n][lo:hi] for n in ("q", "k", "v", "z_k", "z_q")), p=p,
                         prefill_chunk=8)[0]


def test_copy_slots_forks_a_sequence_that_continues_like_its_source():
    x = kvm_inputs(34, 12)
    w = random_weights(13)
    state = kvm_state(budget=kvmem.Fixed(12))
    first = feed_kvm(state, w, 1, x, 0, 30)
    kvmem.copy_slots(state, [1], [3])
    assert state.tokens(3) == 30
    s, qs = rows([1, 3], [4, 4])
    both = kvmem.kvm_step(state, w, s, qs, *(torch.cat([x[n][30:], x[n][30:]]) for n in ("q", "k", "v", "gate")),
                          exact=True)[0]
    ref = kvm_oracle(x, w, prefill=34)
    assert torch.equal(torch.cat([first, both[:4]]), ref)
    assert torch.equal(both[4:], ref[30:])

    y = ua_inputs(30, 14)
    cache = kvmem.ua_create(4, HQ, HK, D, 64)
    feed_ua(cache, 0, y, 0, 24)
    kvmem.copy_slots(cache, torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    a, b = feed_ua(cache, 0, y, 24, 25), feed_ua(cache, 2, y, 24, 25)
    assert torch.equal(a, b)
    assert torch.equal(a, oracle({n: t[:25] for n, t in y.items()}, mechanism="ua", prefill=24,
                                 p=0.15, prefill_chunk=8)[24:])


def test_export_import_moves_a_sequence_between_states():
    x = kvm_inputs(36, 15)
    w = random_weights(16)
    src = kvm_state(budget=kvmem.Fixed(12))
    head = feed_kvm(src, w, 2, x, 0, 31)
    record = kvmem.export_slot(src, 2)
    assert record.dtype == torch.uint8 and bytes(record[:8].tolist()) == b"KVMEMSLT"
    assert record.numel() == src.export_bytes(2)
    dst = kvm_state(max_slots=2, budget=kvmem.Fixed(12))
    kvmem.import_slot(dst, w, 1, record)
    assert dst.tokens(1) == 31
    tail = feed_kvm(dst, w, 1, x, 31, 36)
    assert torch.equal(torch.cat([head, tail]), kvm_oracle(x, w, prefill=36))
    assert torch.equal(kvmem.export_slot(dst, 1)[:16], kvmem.export_slot(src, 2)[:16])  # header and version

    y = ua_inputs(28, 17)
    a = kvmem.ua_create(3, HQ, HK, D, 64)
    feed_ua(a, 0, y, 0, 24)
    b = kvmem.ua_create(1, HQ, HK, D, 40)
    kvmem.import_slot(b, None, 0, kvmem.export_slot(a, 0))
    assert b.tokens(0) == 24
    moved = torch.cat([feed_ua(b, 0, y, t, t + 1) for t in range(24, 28)])
    stayed = torch.cat([feed_ua(a, 0, y, t, t + 1) for t in range(24, 28)])
    assert torch.equal(moved, stayed)
    assert torch.equal(moved, oracle(y, mechanism="ua", prefill=24, p=0.15, prefill_chunk=8)[24:])


def test_truncate_is_exact_or_refused():
    x, y = kvm_inputs(10, 18), kvm_inputs(5, 19)
    state = kvm_state()
    w = kvmem.KvmWeights.identity(D, HQ)
    feed_kvm(state, w, 0, x, 0, 10)
    kvmem.truncate(state, 0, 3)
    assert state.tokens(0) == 7
    out = feed_kvm(state, w, 0, y, 0, 5)
    joined = {n: torch.cat([x[n][:7], y[n]]) for n in ("q", "k", "v")}
    torch.testing.assert_close(out.double(), dense_attention(**joined)[0][7:], atol=1e-5, rtol=1e-5)

    z = kvm_inputs(40, 20)
    feed_kvm(state, w, 1, z, 0, 40)  # updates absorbed tokens into memory slots
    with pytest.raises(ValueError, match="cannot be undone"):
        kvmem.truncate(state, 1, 20)
    assert state.tokens(1) == 40

    cache = kvmem.ua_create(2, HQ, HK, D, 64)
    feed_ua(cache, 1, ua_inputs(12, 21), 0, 12)
    with pytest.raises(RuntimeError, match="unsupported"):
        kvmem.truncate(cache, 1, 2)
    kvmem.truncate(cache, 1, 12)  # all of it: a reset
    assert cache.tokens(1) == 0


def test_reset_slots_starts_a_fresh_sequence():
    x, y = kvm_inputs(12, 22), kvm_inputs(6, 23)
    state = kvm_state()
    w = kvmem.KvmWeights.identity(D, HQ)
    feed_kvm(state, w, 3, x, 0, 12)
    kvmem.reset_slots(state, [3])
    assert state.tokens(3) == 0
    out = feed_kvm(state, w, 3, y, 0, 6)
    torch.testing.assert_close(out.double(), dense_attention(y["q"], y["k"], y["v"])[0], atol=1e-5, rtol=1e-5)


def test_state_bytes_and_accessors():
    state = kvm_state(max_slots=3, n_ctx=100, budget=kvmem.Power(4.0, 0.5, 8))
    assert state.mechanism() == "kvm" and state.max_slots() == 3
    assert state.allocated_bytes() == kvmem.kvm_state_bytes(3, HQ, HK, D, D, 100, chunk=C, window_chunks=NB,
                                                            rope_dims=D // 2, budget=kvmem.Power(4.0, 0.5, 8))
    assert kvmem.kvm_state_bytes(3, HQ, HK, D, D, 100, chunk=0) == 0
    cache = kvmem.ua_create(2, HQ, HK, D, 50)
    assert cache.mechanism() == "ua" and cache.max_slots() == 2
    assert cache.allocated_bytes() == 2 * HK * 50 * (2 * D * 4 + 16)


# ---- states placed over tensors the caller allocates ---------------------------------------------------

KVM_CFG = dict(chunk=C, window_chunks=NB, rope_dims=D // 2, budget=kvmem.Fixed(12))


def test_placed_states_live_in_caller_tensors_and_step_like_owning_ones():
    state_bytes, work_bytes = kvmem.kvm_layout(2, HQ, HK, D, D, 64, **KVM_CFG)
    assert state_bytes > 0 and work_bytes > 0
    assert state_bytes + work_bytes == kvmem.kvm_state_bytes(2, HQ, HK, D, D, 64, **KVM_CFG)
    assert kvmem.kvm_layout(2, HQ, HK, D, D, 64, chunk=0) == (0, 0)
    # Two layers' states in caller tensors sharing one workspace, stepped in turn, against owning states.
    memory = [torch.empty(state_bytes, dtype=torch.uint8) for _ in range(2)]
    shared = torch.empty(work_bytes, dtype=torch.uint8)
    placed = [kvmem.kvm_place(m, shared, 2, HQ, HK, D, D, 64, **KVM_CFG) for m in memory]
    owning = [kvm_state(max_slots=2, budget=kvmem.Fixed(12)) for _ in range(2)]
    del memory, shared  # the states keep their tensors alive
    w = random_weights(40)
    x = kvm_inputs(40, 41)
    for lo, hi in [(0, 23), (23, 24), (24, 40)]:
        for layer in range(2):
            a = feed_kvm(placed[layer], w, layer, x, lo, hi)
            b = feed_kvm(owning[layer], w, layer, x, lo, hi)
            assert torch.equal(a, b)
    assert placed[0].tokens(0) == 40 and placed[0].tokens(1) == 0 and placed[1].tokens(1) == 40
    assert torch.equal(kvmem.export_slot(placed[1], 1), kvmem.export_slot(owning[1], 1))
    assert placed[0].allocated_bytes() == state_bytes + work_bytes

    cache_bytes, ua_work = kvmem.ua_layout(2, HQ, HK, D, 48)
    cache = kvmem.ua_place(torch.empty(cache_bytes, dtype=torch.uint8), torch.empty(ua_work, dtype=torch.uint8), 2,
                           HQ, HK, D, 48)
    ref = kvmem.ua_create(2, HQ, HK, D, 48)
    u = ua_inputs(40, 42)
    assert torch.equal(feed_ua(cache, 1, u, 0, 40), feed_ua(ref, 1, u, 0, 40))
    assert torch.equal(kvmem.export_slot(cache, 1), kvmem.export_slot(ref, 1))


def test_placement_refuses_tensors_it_cannot_use():
    state_bytes, work_bytes = kvmem.kvm_layout(2, HQ, HK, D, D, 64, **KVM_CFG)
    work = torch.empty(work_bytes, dtype=torch.uint8)

    def place(memory, workspace=work):
        return kvmem.kvm_place(memory, workspace, 2, HQ, HK, D, D, 64, **KVM_CFG)

    with pytest.raises(ValueError, match=f"state memory bytes: expected >= {state_bytes}, got {state_bytes - 1}"):
        place(torch.empty(state_bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="state memory: expected 64-byte alignment"):
        place(torch.empty(state_bytes + 64, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="memory: expected dtype Byte, got Float"):
        place(torch.empty(state_bytes, dtype=torch.float32))
    with pytest.raises(ValueError, match="memory: expected a contiguous tensor"):
        place(torch.empty(2 * state_bytes, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match=f"workspace memory bytes: expected >= {work_bytes}"):
        place(torch.empty(state_bytes, dtype=torch.uint8), torch.empty(work_bytes - 1, dtype=torch.uint8))
    cache_bytes, ua_work = kvmem.ua_layout(1, HQ, HK, D, 16)
    assert kvmem.ua_layout(1, 3, 2, D, 16) == (0, 0)
    with pytest.raises(ValueError, match=f"cache memory bytes: expected >= {cache_bytes}"):
        kvmem.ua_place(torch.empty(cache_bytes - 1, dtype=torch.uint8), torch.empty(ua_work, dtype=torch.uint8), 1,
                       HQ, HK, D, 16)


# ---- bad inputs raise with kvmem's message and change nothing ------------------------------------------------

def test_bad_inputs_raise_with_kvmems_message():
    state = kvm_state()
    w = kvmem.KvmWeights.identity(D, HQ)
    x = kvm_inputs(6, 24)
    feed_kvm(state, w, 0, x, 0, 3)
    before = kvmem.export_slot(state, 0)

    def step(slot, counts, **over):
        s, qs = rows(slot, counts)
        args = dict(x, **over)
        return kvmem.kvm_step(state, w, s, qs, args["q"], args["k"], args["v"], args["gate"])

    with pytest.raises(IndexError, match=r"slot\[1\]: expected -1 \(padding\) or 0 <= slot < max_slots = 4, got 9"):
        step([0, 9], [3, 3])
    with pytest.raises(ValueError, match=r"slot\[1\]: expected a slot used by no earlier row"):
        step([0, 0], [3, 3])
    with pytest.raises(ValueError, match=r"slot\[1\]: expected a slot used by no earlier row"):
        s, qs = rows([0, 0], [3, 3])  # a CPU step is checked before it runs, whatever wait says
        kvmem.kvm_step(state, w, s, qs, x["q"], x["k"], x["v"], x["gate"], wait=False)
    with pytest.raises(IndexError, match=r"slot\[0\]: expected -1 \(padding\) or 0 <= slot < max_slots = 1"):
        s, qs = rows([3], [2])
        u = ua_inputs(2, 25)
        kvmem.ua_step(kvmem.ua_create(1, HQ, HK, D, 8), s, qs, u["q"], u["k"], u["v"], u["z_k"], u["z_q"], wait=False)
    with pytest.raises(ValueError, match=r"q \[tokens,Hq,D\]"):
        step([0], [6], q=torch.randn(6, HQ + 1, D))
    with pytest.raises(ValueError, match="q: expected dtype Float, got Double"):
        step([0], [6], q=x["q"].double())
    with pytest.raises(ValueError, match="gate"):
        step([0], [6], gate=-x["gate"])
    with pytest.raises(ValueError, match="q: expected finite values"):
        step([0], [6], q=x["q"].clone().fill_(float("nan")))
    with pytest.raises(ValueError, match=r"query_start\[3\]: expected the packed token count 6"):
        kvmem.kvm_step(state, w, torch.tensor([0, 1, 2], dtype=torch.int32),
                       torch.tensor([0, 2, 4, 5], dtype=torch.int32), x["q"], x["k"], x["v"], x["gate"])
    with pytest.raises(IndexError, match="exceed the state's n_ctx = 64"):
        step([0], [62], **{n: t.repeat(11, 1, 1)[:62] if t.dim() == 3 else t.repeat(11, 1)[:62]
                           for n, t in x.items()})
    with pytest.raises(ValueError, match="expected a KV Means state"):
        s, qs = rows([0], [6])
        kvmem.kvm_step(kvmem.ua_create(1, HQ, HK, D, 8), w, s, qs, x["q"], x["k"], x["v"], x["gate"])
    with pytest.raises(ValueError, match="dst"):
        kvmem.copy_slots(state, [0, 1], [2, 2])
    with pytest.raises(ValueError, match="slot record: expected bytes that start with \"KVMEMSLT\""):
        kvmem.import_slot(state, w, 1, torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"chunk: expected >= 1, got 0"):
        kvmem.kvm_create(1, HQ, HK, D, D, 64, chunk=0)
    with pytest.raises(ValueError, match="CacheShape query_heads % kv_heads"):
        kvmem.ua_create(1, 3, 2, D, 8)
    with pytest.raises(ValueError, match="budget: expected 'fixed', 'power' or 'saturating'"):
        torch.ops.kvmem.kvm_create(1, HQ, HK, D, D, 64, budget="linear")
    assert state.tokens(0) == 3 and torch.equal(kvmem.export_slot(state, 0), before)


def test_max_query_len_bounds_the_rows_of_a_step():
    """max_query_len (vLLM's max_query_len) bounds the tokens of every row that names a slot: a bound
    that holds, padding rows longer than it included, gives what the unbounded step gives; a row over
    it raises ValueError and changes nothing, on both mechanisms."""
    w = random_weights(30)
    x = kvm_inputs(14, 31)
    bounded, unbounded = kvm_state(), kvm_state()
    s, qs = rows([0, -1, 2], [5, 8, 1])  # 5 tokens, a padding row of 8, a decode token

    def kvm(state, **kw):
        return kvmem.kvm_step(state, w, s, qs, x["q"], x["k"], x["v"], x["gate"], exact=True, **kw)

    with pytest.raises(ValueError, match=r"max_query_len: expected at least the tokens of every row that names a "
                                         r"slot \(row 0: 5\), got 4"):
        kvm(bounded, max_query_len=4)
    with pytest.raises(ValueError, match=r"max_query_len: expected >= 0"):
        kvm(bounded, max_query_len=-1)
    assert bounded.tokens(0) == 0 and bounded.tokens(2) == 0
    for a, b in zip(kvm(bounded, max_query_len=5), kvm(unbounded)):
        assert torch.equal(a, b)
    assert torch.equal(kvmem.export_slot(bounded, 0), kvmem.export_slot(unbounded, 0))
    # positional, after wait: the op's schema appends it, so older positional calls still bind
    out, _ = torch.ops.kvmem.kvm_step(bounded, list(w), s, qs, x["q"], x["k"], x["v"], x["gate"], True, True, 5)
    assert bounded.tokens(0) == 10

    u = ua_inputs(14, 32)
    caches = kvmem.ua_create(4, HQ, HK, D, 32), kvmem.ua_create(4, HQ, HK, D, 32)

    def ua(cache, **kw):
        return kvmem.ua_step(cache, s, qs, u["q"], u["k"], u["v"], u["z_k"], u["z_q"], p=0.15, prefill_chunk=4, **kw)

    with pytest.raises(ValueError, match=r"\(row 0: 5\), got 1"):
        ua(caches[0], max_query_len=1)
    assert caches[0].tokens(0) == 0
    for a, b in zip(ua(caches[0], max_query_len=5), ua(caches[1])):
        assert torch.equal(a, b)
    assert torch.equal(kvmem.export_slot(caches[0], 0), kvmem.export_slot(caches[1], 0))


# ---- meta and fake tensors: shapes without running the backend -----------------------------------------

def test_meta_kernels_give_output_shapes_and_leave_the_state():
    state = kvm_state()
    w = kvmem.KvmWeights(*(t.to("meta") for t in kvmem.KvmWeights.identity(D, HQ)))
    s, qs = rows([0, -1], [5, 2])
    m = {n: t.to("meta") for n, t in kvm_inputs(7, 25).items()}
    out, lse = kvmem.kvm_step(state, w, s.to("meta"), qs.to("meta"), **m)
    assert out.device.type == "meta" and out.shape == (7, HQ, D) and lse.shape == (7, HQ)
    kvmem.reset_slots(state, torch.tensor([1], dtype=torch.int32, device="meta"))
    assert state.tokens(0) == 0

    cache = kvmem.ua_create(2, HQ, HK, D, 16)
    u = {n: t.to("meta") for n, t in ua_inputs(7, 26).items()}
    out, lse = kvmem.ua_step(cache, s.to("meta"), qs.to("meta"), **u, p=0.05, max_query_len=5)
    assert out.shape == (7, HQ, D) and lse.shape == (7, HQ)
    assert cache.tokens(0) == 0


def test_fake_tensor_mode_traces_through_a_step():
    from torch._subclasses.fake_tensor import FakeTensorMode
    state = kvm_state()
    real = dict(kvm_inputs(7, 27))
    s, qs = rows([2, 0], [3, 4])
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) for n, t in real.items()}
        w = kvmem.KvmWeights(*(mode.from_tensor(t) for t in kvmem.KvmWeights.identity(D, HQ)))
        out, lse = kvmem.kvm_step(state, w, mode.from_tensor(s), mode.from_tensor(qs), **fake)
        assert out.shape == (7, HQ, D) and lse.shape == (7, HQ)
    assert state.tokens(2) == 0 and state.tokens(0) == 0


def test_scale_of_the_logits_follows_head_dim():
    # kvm_create(scale=0) attends with 1/sqrt(D); an explicit scale is used as given.
    x = kvm_inputs(6, 28)
    w = kvmem.KvmWeights.identity(D, HQ)
    state = kvm_state(scale=0.5)
    out = feed_kvm(state, w, 0, x, 0, 6)
    torch.testing.assert_close(out.double(), dense_attention(x["q"], x["k"], x["v"], scale=0.5)[0],
                               atol=1e-5, rtol=1e-5)
    assert not math.isclose(0.5, 1 / math.sqrt(D))
