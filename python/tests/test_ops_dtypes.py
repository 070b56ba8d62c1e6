# SPDX-License-Identifier: Apache-2.0
"""States that store bfloat16 (and, for Universal Attention, float16) on the CPU: steps against a plain
PyTorch float64 reference (dense causal attention where KV Means reduces to it, dense Universal
Attention at p = 0) and against the float32 ops, records that round-trip, sizes, Meta shapes, and the
dtype combinations the backends lack, refused with kvmem's message.

Tolerances. Every input is rounded to the state's dtype first and the reference reads the same
rounded values, so storing keys and values in that dtype loses nothing inside the window (KV Means)
or at p = 0 (Universal Attention); the sums are float32 (the float32 tests' 1e-5 and 1e-4). What is left
is the one rounding of ``out`` to the dtype: round to nearest moves a value by at most half a unit in
the last place: u = 2**-p relative for p significant bits, 2**-8 for bfloat16 and 2**-11 for float16.
Hence ``|out - ref| <= atol + u * |ref|`` with u that unit roundoff. ``lse`` is float32 and keeps the
float32 tolerance. Beyond the window KV Means rounds its memory slots' readout copies to bfloat16 as
well; there the bound is DESIGN.md's for bf16 paths, a relative Frobenius error of 1e-2 against float32
storage."""

import pytest
import torch

import kvmem
import helpers
from helpers import dense_attention, dense_ua, rows, serve

HQ, HK, D = 4, 2, 16
C, NB = 8, 2  # the KV Means window holds 16 keys
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

SCHEDULE_SHORT = [
    [(2, 5), (-1, 3), (0, 12)],
    [(2, 2), (3, 1), (0, 1)],
    [(0, 1), (3, 6), (2, 1)],
    [(3, 1), (2, 1), (-1, 0)],
]


def kvm_state(dtype, max_slots=4, n_ctx=64, **kw):
    return kvmem.kvm_create(max_slots, HQ, HK, D, D, n_ctx, chunk=C, window_chunks=NB, rope_dims=D // 2,
                            dtype=dtype, **kw)


def rounded(x, dtype):
    """The inputs rounded to `dtype`: what a model running in that dtype hands the op."""
    return {n: t.to(dtype) for n, t in x.items()}


def kvm_inputs(T, seed, dtype):
    return rounded(helpers.kvm_inputs(T, seed, HQ, HK, D), dtype)


def ua_inputs(T, seed, dtype):
    return rounded(helpers.ua_inputs(T, seed, HQ, HK, D), dtype)


def relative_frobenius(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def test_bf16_kvm_step_equals_dense_attention_within_the_window():
    dt = torch.bfloat16
    seqs = {0: kvm_inputs(14, 1, dt), 2: kvm_inputs(9, 2, dt), 3: kvm_inputs(8, 3, dt)}
    state = kvm_state(dt)
    assert kvmem.state_dtype(state) == dt and state.dtype() == "BFloat16"
    w = kvmem.KvmWeights.identity(D, HQ)
    out, lse, padding = serve(lambda s, qs, **x: kvmem.kvm_step(state, w, s, qs, **x), seqs, SCHEDULE_SHORT)
    for slot, x in seqs.items():
        assert out[slot].dtype == dt and lse[slot].dtype == torch.float32
        ref_out, ref_lse = dense_attention(x["q"], x["k"], x["v"])
        torch.testing.assert_close(out[slot].double(), ref_out, atol=2e-5, rtol=UNIT_ROUNDOFF[dt])
        torch.testing.assert_close(lse[slot].double(), ref_lse, atol=1e-5, rtol=1e-5)
        assert state.tokens(slot) == x["q"].shape[0]
    for o, l in padding:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


def test_bf16_kvm_step_against_the_float32_op():
    # 40 tokens through a 16-token window and 12 memory slots: within the window the bf16 state is the
    # float32 state's output rounded once; beyond it the readout copies are bf16 too.
    dt = torch.bfloat16
    seqs = {0: kvm_inputs(42, 4, dt), 1: kvm_inputs(40, 5, dt)}
    w = helpers.random_kvm_weights(6, D, HQ)
    schedule = [[(0, 13), (1, 20)], [(1, 17), (-1, 2), (0, 24)], [(0, 1), (1, 1)], [(1, 1), (0, 1)],
                [(0, 3), (1, 1)]]
    half, full = kvm_state(dt, max_slots=2, budget=kvmem.Fixed(12)), kvm_state(None, max_slots=2,
                                                                                budget=kvmem.Fixed(12))
    out_h, lse_h, _ = serve(lambda s, qs, **x: kvmem.kvm_step(half, w, s, qs, exact=True, **x), seqs, schedule)
    out_f, lse_f, _ = serve(lambda s, qs, **x: kvmem.kvm_step(full, w, s, qs, exact=True, **{
        n: t.float() for n, t in x.items()}), seqs, schedule)
    for slot in seqs:
        window = 2 * C  # tokens before the first state update
        torch.testing.assert_close(out_h[slot][:window].double(), out_f[slot][:window].double(), atol=2e-5,
                                   rtol=UNIT_ROUNDOFF[dt])
        assert relative_frobenius(out_h[slot], out_f[slot]) <= 1e-2
        assert relative_frobenius(lse_h[slot], lse_f[slot]) <= 1e-2
        assert half.tokens(slot) == full.tokens(slot)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_ua_step_without_pruning_equals_dense_ua_in_pytorch(dt):
    seqs = {0: ua_inputs(14, 7, dt), 2: ua_inputs(9, 8, dt), 3: ua_inputs(8, 9, dt)}
    cache = kvmem.ua_create(4, HQ, HK, D, 64, dtype=dt)
    assert kvmem.state_dtype(cache) == dt
    out, lse, padding = serve(lambda s, qs, **x: kvmem.ua_step(cache, s, qs, **x, p=0.0), seqs, SCHEDULE_SHORT)
    for slot, x in seqs.items():
        assert out[slot].dtype == dt and lse[slot].dtype == torch.float32
        ref_out, ref_lse = dense_ua(x["q"], x["k"], x["v"], x["z_k"], x["z_q"])
        torch.testing.assert_close(out[slot].double(), ref_out, atol=1e-4, rtol=1e-4 + UNIT_ROUNDOFF[dt])
        torch.testing.assert_close(lse[slot].double(), ref_lse, atol=1e-4, rtol=1e-4)
    for o, l in padding:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_ua_step_with_pruning_against_the_float32_op(dt):
    # Keys rounded to dt before both runs: the caches keep the same keys, so the evictions and the
    # kept rows agree, and out differs by its final rounding.
    seqs = {0: ua_inputs(36, 10, dt), 1: ua_inputs(35, 11, dt)}
    schedule = [[(0, 8), (1, 16)], [(0, 24), (1, 8)]] + [[(0, 1), (1, 1)]] * 4 + [[(1, 1)]] * 7
    half, full = kvmem.ua_create(2, HQ, HK, D, 64, dtype=dt), kvmem.ua_create(2, HQ, HK, D, 64)
    out_h, _, _ = serve(lambda s, qs, **x: kvmem.ua_step(half, s, qs, **x, p=0.15, prefill_chunk=8), seqs, schedule)
    out_f, _, _ = serve(lambda s, qs, **x: kvmem.ua_step(full, s, qs, **{n: t.float() for n, t in x.items()},
                                                         p=0.15, prefill_chunk=8), seqs, schedule)
    for slot in seqs:
        assert torch.equal(out_h[slot], out_f[slot].to(dt))


def test_bf16_records_round_trip():
    dt = torch.bfloat16
    x = kvm_inputs(36, 15, dt)
    w = helpers.random_kvm_weights(16, D, HQ)

    def feed(state, slot, lo, hi):
        s, qs = rows([slot], [hi - lo])
        return kvmem.kvm_step(state, w, s, qs, *(x[n][lo:hi] for n in ("q", "k", "v", "gate")), exact=True)[0]

    src = kvm_state(dt, budget=kvmem.Fixed(12))
    feed(src, 2, 0, 31)
    record = kvmem.export_slot(src, 2)
    assert record.dtype == torch.uint8 and bytes(record[:8].tolist()) == b"KVMEMSLT"
    dst = kvm_state(dt, max_slots=2, budget=kvmem.Fixed(12))
    kvmem.import_slot(dst, w, 1, record)
    assert dst.tokens(1) == 31 and torch.equal(kvmem.export_slot(dst, 1), record)
    assert torch.equal(feed(dst, 1, 31, 36), feed(src, 2, 31, 36))  # the import continues like its source
    assert torch.equal(kvmem.export_slot(dst, 1), kvmem.export_slot(src, 2))
    with pytest.raises(ValueError, match="storage"):  # a float32 state refuses a bf16 record
        kvmem.import_slot(kvm_state(None, budget=kvmem.Fixed(12)), w, 0, record)

    y = ua_inputs(28, 17, dt)
    a, b = kvmem.ua_create(3, HQ, HK, D, 64, dtype=dt), kvmem.ua_create(1, HQ, HK, D, 40, dtype=dt)

    def feed_ua(cache, slot, lo, hi):
        s, qs = rows([slot], [hi - lo])
        return kvmem.ua_step(cache, s, qs, *(y[n][lo:hi] for n in ("q", "k", "v", "z_k", "z_q")), p=0.15,
                             prefill_chunk=8)[0]

    feed_ua(a, 0, 0, 24)
    kvmem.import_slot(b, None, 0, kvmem.export_slot(a, 0))
    assert b.tokens(0) == 24 and torch.equal(kvmem.export_slot(b, 0), kvmem.export_slot(a, 0))
    assert torch.equal(feed_ua(b, 0, 24, 28), feed_ua(a, 0, 24, 28))
    with pytest.raises(ValueError, match="storage"):
        kvmem.import_slot(kvmem.ua_create(1, HQ, HK, D, 40, dtype=torch.float16), None, 0, kvmem.export_slot(a, 0))


def test_sizes_follow_the_storage_dtype():
    cfg = dict(chunk=C, window_chunks=NB, rope_dims=D // 2, budget=kvmem.Fixed(12))
    full = kvmem.kvm_state_bytes(2, HQ, HK, D, D, 64, **cfg)
    half = kvmem.kvm_state_bytes(2, HQ, HK, D, D, 64, **cfg, dtype=torch.bfloat16)
    assert 0 < half < full  # window and readout copies in 2 bytes, sums still in 4
    assert kvm_state(torch.bfloat16, max_slots=2, budget=kvmem.Fixed(12)).allocated_bytes() == half
    state_bytes, work_bytes = kvmem.kvm_layout(2, HQ, HK, D, D, 64, **cfg, dtype=torch.bfloat16)
    assert state_bytes + work_bytes == half
    placed = kvmem.kvm_place(torch.empty(state_bytes, dtype=torch.uint8), torch.empty(work_bytes, dtype=torch.uint8),
                             2, HQ, HK, D, D, 64, **cfg, dtype=torch.bfloat16)
    assert kvmem.state_dtype(placed) == torch.bfloat16
    for dt, size in ((None, 4), (torch.bfloat16, 2), (torch.float16, 2)):
        cache = kvmem.ua_create(2, HQ, HK, D, 50, dtype=dt)
        assert cache.allocated_bytes() == 2 * HK * 50 * (2 * D * size + 16)
        cache_bytes, ua_work = kvmem.ua_layout(2, HQ, HK, D, 48, dtype=dt)
        placed = kvmem.ua_place(torch.empty(cache_bytes, dtype=torch.uint8), torch.empty(ua_work, dtype=torch.uint8),
                                2, HQ, HK, D, 48, dtype=dt)
        assert kvmem.state_dtype(placed) == (dt or torch.float32)
    assert kvmem.ua_layout(2, HQ, HK, D, 48, dtype=torch.bfloat16)[0] < kvmem.ua_layout(2, HQ, HK, D, 48)[0]


def test_meta_kernels_follow_the_inputs_dtype():
    s, qs = rows([0, -1], [5, 2])
    state = kvm_state(torch.bfloat16)
    w = kvmem.KvmWeights(*(t.to("meta") for t in kvmem.KvmWeights.identity(D, HQ)))
    m = {n: t.to("meta") for n, t in kvm_inputs(7, 25, torch.bfloat16).items()}
    out, lse = kvmem.kvm_step(state, w, s.to("meta"), qs.to("meta"), **m)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (7, HQ, D)
    cache = kvmem.ua_create(2, HQ, HK, D, 16, dtype=torch.float16)
    u = {n: t.to("meta") for n, t in ua_inputs(7, 26, torch.float16).items()}
    out, lse = kvmem.ua_step(cache, s.to("meta"), qs.to("meta"), **u, p=0.05)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and out.shape == (7, HQ, D)


def test_dtype_combinations_the_backends_lack_raise():
    with pytest.raises(ValueError, match=r"kvm_create: dtype: expected Float or BFloat16 \(the storage types of a "
                                         r"KV Means state\), got Half"):
        kvm_state(torch.float16)
    with pytest.raises(ValueError, match="kvm_state_bytes: dtype: expected Float or BFloat16"):
        kvmem.kvm_state_bytes(2, HQ, HK, D, D, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="kvm_layout: dtype: expected Float or BFloat16"):
        kvmem.kvm_layout(2, HQ, HK, D, D, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"ua_create: dtype: expected Float, BFloat16 or Half \(the storage types "
                                         r"of a Universal Attention cache\), got Double"):
        kvmem.ua_create(2, HQ, HK, D, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="ua_layout: dtype: expected Float, BFloat16 or Half"):
        kvmem.ua_layout(2, HQ, HK, D, 16, dtype=torch.int8)

    state = kvm_state(torch.bfloat16)
    w = kvmem.KvmWeights.identity(D, HQ)
    x = kvm_inputs(6, 27, torch.bfloat16)
    s, qs = rows([0], [6])
    kvmem.kvm_step(state, w, s, qs, **x)
    before = kvmem.export_slot(state, 0)
    with pytest.raises(ValueError, match=r"kvm_step: q: expected dtype BFloat16, got Float \(a state of dtype "
                                         r"BFloat16 takes q, k, v and gate of its dtype\)"):
        kvmem.kvm_step(state, w, s, qs, **dict(x, q=x["q"].float()))
    with pytest.raises(ValueError, match="kvm_step: gate: expected dtype BFloat16, got Float"):
        kvmem.kvm_step(state, w, s, qs, **dict(x, gate=x["gate"].float()))
    with pytest.raises(ValueError, match="kvm_step: ln_weight: expected dtype Float, got BFloat16"):
        kvmem.kvm_step(state, kvmem.KvmWeights(*(t.bfloat16() for t in w)), s, qs, **x)
    assert state.tokens(0) == 6 and torch.equal(kvmem.export_slot(state, 0), before)
    with pytest.raises(ValueError, match=r"kvm_step: q: expected dtype Float, got BFloat16"):
        kvmem.kvm_step(kvm_state(None), w, s, qs, **x)

    cache = kvmem.ua_create(2, HQ, HK, D, 16, dtype=torch.float16)
    u = ua_inputs(4, 28, torch.bfloat16)
    s, qs = rows([0], [4])
    with pytest.raises(ValueError, match=r"ua_step: q: expected dtype Half, got BFloat16 \(a state of dtype Half "
                                         r"takes q, k, v, z_k, z_q and z_o of its dtype\)"):
        kvmem.ua_step(cache, s, qs, **u)
    with pytest.raises(ValueError, match="ua_step: z_k: expected dtype Half, got Float"):
        kvmem.ua_step(cache, s, qs, **dict(rounded(u, torch.float16), z_k=u["z_k"].float()))
    assert cache.tokens(0) == 0
