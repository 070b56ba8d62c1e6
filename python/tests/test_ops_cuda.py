# SPDX-License-Identifier: Apache-2.0
"""The PyTorch ops on CUDA tensors (kvmem's CUDA backend) against the same ops on CPU tensors (the host
backend) with the same inputs. Tolerances are the CUDA backend's own tests' (tests/cuda): KV Means
outputs within fp32 rounding of the host's exact path (max |x - ref| <= 2e-5 max(1, max |ref|)) and the
slot records byte for byte (the CUDA update rounds like the host's exact path); Universal Attention
outputs within a relative Frobenius error of 1e-4 and the records' kept rows and positions exactly.
Also: forks, records moving between backends, bfloat16 and float16 states, and CUDA graphs of decode
steps replayed like eager steps. The ops' refusals on CUDA (calls that raise) are in
test_ops_cuda_raises.py. Skipped, saying why, without a CUDA device or without the CUDA kernels in the op
library.

bfloat16 and float16 states (test_ops_dtypes.py derives the bounds): inputs rounded to the dtype first,
so both backends store the same keys and values; within the KV Means window the two outputs are each one
rounding of nearly equal float32 values (|a - b| <= 2u |ref| + 2e-5, u = 2**-8 for bfloat16); beyond it,
and for Universal Attention, where the CUDA tensor-core kernels round the probabilities to bfloat16
before p.v as FlashAttention does, a relative Frobenius error of 1e-2 (DESIGN.md's bound for bf16
paths; float16 keeps fp32 probabilities: 2e-3, twice its output rounding's 2**-11 relative with margin
for a different summation order)."""

import re

import pytest
import torch

import kvmem
import helpers
from helpers import rows, serve


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    try:
        kvmem.ua_create(1, 2, 1, 16, 16, device="cuda")
    except RuntimeError as e:
        if "no CUDA backend" not in str(e):
            raise
        return "the op library has no CUDA kernels (built without KVMEM_CUDA or against a torch without CUDA)"
    return None


_REASON = _skip_reason()
if _REASON:
    print(f"test_ops_cuda: skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

CUDA = torch.device("cuda", torch.cuda.current_device())
DEV = re.escape(str(CUDA))  # "cuda:0" as the ops print it

# KV Means: the CUDA slot tests' shape (two query heads per KV head); UA: theirs too (four per KV head).
HQ, HK, D = 4, 2, 32
C, NB = 16, 2  # the window holds 32 keys; state updates run at 49, 65, 81, ... tokens
UH, UG, UD = 8, 2, 64
KVM_CFG = dict(chunk=C, window_chunks=NB, rope_dims=8, budget=kvmem.Fixed(24))


def kvm_state(device, max_slots=4, n_ctx=160, **kw):
    return kvmem.kvm_create(max_slots, HQ, HK, D, D, n_ctx, **dict(KVM_CFG, **kw), device=device)


def kvm_inputs(T, seed):
    return helpers.kvm_inputs(T, seed, HQ, HK, D)


def ua_inputs(T, seed):
    return helpers.ua_inputs(T, seed, UH, UG, UD)


def random_weights(seed):
    return helpers.random_kvm_weights(seed, D, HQ)


def on(device, x):
    return {n: t.to(device) for n, t in x.items()}


def kvm_step_on(state, w, slot, qs, exact=True, **x):
    """kvm_step with every tensor moved to the state's device; results on the CPU."""
    dev = kvmem.state_device(state)
    out, lse = kvmem.kvm_step(state, w.to(dev), slot.to(dev), qs.to(dev), **on(dev, x), exact=exact)
    return out.cpu(), lse.cpu()


def ua_step_on(state, slot, qs, p, prefill_chunk=8, **x):
    dev = kvmem.state_device(state)
    out, lse = kvmem.ua_step(state, slot.to(dev), qs.to(dev), **on(dev, x), p=p, prefill_chunk=prefill_chunk)
    return out.cpu(), lse.cpu()


def scaled_error(x, ref):
    """max |x - ref| / max(1, max |ref|): the rule of tests/cuda for KV Means."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).abs().max() / max(1.0, ref.abs().max().item())).item()


def relative_frobenius(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).norm() / max(ref.norm().item(), 1e-30)).item()


def decode_record(record):
    """The fields of a slot record (core/slots.hpp: magic, u32 version, mechanism, field count, then per
    field u16 name length, name, u8 kind (1 i64, 2 f64, 3 f32), u64 count, data) as tensors."""
    b = bytes(record.cpu().tolist())
    assert b[:8] == b"KVMEMSLT"
    count = int.from_bytes(b[16:20], "little")
    at, fields = 20, {}
    for _ in range(count):
        n = int.from_bytes(b[at:at + 2], "little")
        name = b[at + 2:at + 2 + n].decode()
        kind = b[at + 2 + n]
        elems = int.from_bytes(b[at + 3 + n:at + 11 + n], "little")
        at += 11 + n
        dtype, size = {1: (torch.int64, 8), 2: (torch.float64, 8), 3: (torch.float32, 4)}[kind]
        fields[name] = torch.frombuffer(bytearray(b[at:at + elems * size]), dtype=dtype) if elems else \
            torch.empty(0, dtype=dtype)
        at += elems * size
    assert at == len(b)
    return fields


def assert_ua_records_match(cuda_record, cpu_record):
    """Kept rows, positions, keys, values and gate logits exactly; λ within fp32 accumulation order."""
    a, b = decode_record(cuda_record), decode_record(cpu_record)
    assert a.keys() == b.keys()
    for name in ("query_heads", "kv_heads", "head_dim", "storage", "position", "length", "pos", "key", "value",
                 "key_logit"):
        assert torch.equal(a[name], b[name]), name
    torch.testing.assert_close(a["lambda"], b["lambda"], rtol=1e-4, atol=1e-5)


def graph_capture(graph):
    """torch.cuda.graph, capturing only this thread's work where torch lets us say so."""
    try:
        return torch.cuda.graph(graph, capture_error_mode="thread_local")
    except TypeError:
        return torch.cuda.graph(graph)


# Ragged schedules: prefill chunks of different sizes, padding rows, decode tokens, slots joining late.
# At most max_slots rows a step: on CUDA a padding row takes a work item of the workspace too.
SCHEDULE_KVM = [
    [(0, 29), (1, 40)],
    [(1, 37), (-1, 2), (0, 44)],
    [(0, 1), (1, 1), (-1, 1)],
    [(1, 1), (0, 1)],
    [(0, 3), (-1, 0), (1, 1)],
]
SCHEDULE_UA = [
    [(2, 5), (-1, 3), (0, 12)],
    [(2, 2), (3, 1), (0, 1)],
    [(0, 1), (3, 6), (2, 1)],
    [(3, 1), (2, 1), (-1, 0)],
    [(0, 16), (2, 8), (3, 1)],
] + [[(0, 1), (2, 1), (3, 1), (-1, 1)]] * 6


# ---- steps: CUDA equals the CPU op ----------------------------------------------------------------------

def test_kvm_step_on_cuda_equals_the_cpu_op():
    # 78 and 80 tokens with a 32-token window and 24 memory slots: state updates append and merge.
    seqs = {0: kvm_inputs(78, 4), 1: kvm_inputs(80, 5)}
    w = random_weights(6)
    cpu, gpu = kvm_state("cpu"), kvm_state("cuda")
    out_c, lse_c, pad_c = serve(lambda s, qs, **x: kvm_step_on(cpu, w, s, qs, **x), seqs, SCHEDULE_KVM)
    out_g, lse_g, pad_g = serve(lambda s, qs, **x: kvm_step_on(gpu, w, s, qs, **x), seqs, SCHEDULE_KVM)
    for slot in seqs:
        assert scaled_error(out_g[slot], out_c[slot]) <= 2e-5, slot
        assert scaled_error(lse_g[slot], lse_c[slot]) <= 2e-5, slot
        assert gpu.tokens(slot) == cpu.tokens(slot) == seqs[slot]["q"].shape[0]
        # counters, memory slots (so every route) and window, byte for byte
        assert torch.equal(kvmem.export_slot(gpu, slot), kvmem.export_slot(cpu, slot)), slot
    for o, l in pad_g:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0
    assert gpu.tokens(2) == 0


@pytest.mark.parametrize("p", [0.0, 0.05])
def test_ua_step_on_cuda_equals_the_cpu_op(p):
    seqs = {0: ua_inputs(36, 7), 2: ua_inputs(23, 8), 3: ua_inputs(15, 9)}
    cpu, gpu = (kvmem.ua_create(4, UH, UG, UD, 64, device=d) for d in ("cpu", "cuda"))
    out_c, lse_c, _ = serve(lambda s, qs, **x: ua_step_on(cpu, s, qs, p, **x), seqs, SCHEDULE_UA)
    out_g, lse_g, pad_g = serve(lambda s, qs, **x: ua_step_on(gpu, s, qs, p, **x), seqs, SCHEDULE_UA)
    for slot in seqs:
        assert relative_frobenius(out_g[slot], out_c[slot]) <= 1e-4, slot
        assert relative_frobenius(lse_g[slot], lse_c[slot]) <= 1e-4, slot
        assert gpu.tokens(slot) == cpu.tokens(slot)
        assert_ua_records_match(kvmem.export_slot(gpu, slot), kvmem.export_slot(cpu, slot))
    for o, l in pad_g:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


# ---- slot operations ---------------------------------------------------------------------------------------

def feed_kvm(state, w, slot, x, lo, hi):
    s, qs = rows([slot], [hi - lo])
    return kvm_step_on(state, w, s, qs, **{n: t[lo:hi] for n, t in x.items()})[0]


def feed_ua(state, slot, x, lo, hi, p=0.05):
    s, qs = rows([slot], [hi - lo])
    return ua_step_on(state, s, qs, p, **{n: t[lo:hi] for n, t in x.items()})[0]


def test_copy_slots_fork_on_cuda_continues_like_its_source():
    x = kvm_inputs(64, 12)
    w = random_weights(13)
    cpu, gpu = kvm_state("cpu"), kvm_state("cuda")
    for state in (cpu, gpu):
        feed_kvm(state, w, 1, x, 0, 60)
        kvmem.copy_slots(state, [1], [3])  # a list becomes an int32 tensor on the state's device
        assert state.tokens(3) == 60
    s, qs = rows([1, 3], [4, 4])
    tail = {n: torch.cat([t[60:], t[60:]]) for n, t in x.items()}
    both_g = kvm_step_on(gpu, w, s, qs, **tail)[0]
    both_c = kvm_step_on(cpu, w, s, qs, **tail)[0]
    assert torch.equal(both_g[:4], both_g[4:])  # the fork computes what its source computes
    assert scaled_error(both_g, both_c) <= 2e-5
    assert torch.equal(kvmem.export_slot(gpu, 3), kvmem.export_slot(gpu, 1))
    assert torch.equal(kvmem.export_slot(gpu, 3), kvmem.export_slot(cpu, 3))

    y = ua_inputs(30, 14)
    cache = kvmem.ua_create(4, UH, UG, UD, 64, device="cuda")
    feed_ua(cache, 0, y, 0, 24)
    kvmem.copy_slots(cache, torch.tensor([0], dtype=torch.int32, device=CUDA),
                     torch.tensor([2], dtype=torch.int32, device=CUDA))
    a, b = feed_ua(cache, 0, y, 24, 25), feed_ua(cache, 2, y, 24, 25)
    assert torch.equal(a, b)
    assert torch.equal(kvmem.export_slot(cache, 0), kvmem.export_slot(cache, 2))


def test_records_move_between_cuda_and_cpu():
    x = kvm_inputs(66, 15)
    w = random_weights(16)
    gpu, ref = kvm_state("cuda"), kvm_state("cpu")
    feed_kvm(gpu, w, 2, x, 0, 61)
    feed_kvm(ref, w, 2, x, 0, 61)
    record = kvmem.export_slot(gpu, 2)
    assert record.device.type == "cpu" and record.dtype == torch.uint8
    assert record.numel() == gpu.export_bytes(2)
    assert torch.equal(record, kvmem.export_slot(ref, 2))
    # CUDA -> CPU: the CPU state continues like the CUDA one
    cpu = kvm_state("cpu", max_slots=2)
    kvmem.import_slot(cpu, w, 1, record)
    assert cpu.tokens(1) == 61
    tail_c, tail_g = feed_kvm(cpu, w, 1, x, 61, 66), feed_kvm(gpu, w, 2, x, 61, 66)
    assert scaled_error(tail_g, tail_c) <= 2e-5
    assert torch.equal(kvmem.export_slot(cpu, 1), kvmem.export_slot(gpu, 2))
    # CPU -> CUDA, the record given as a CUDA tensor this time
    back = kvm_state("cuda", max_slots=2)
    kvmem.import_slot(back, w.to(CUDA), 0, kvmem.export_slot(cpu, 1).to(CUDA))
    assert back.tokens(0) == 66 and torch.equal(kvmem.export_slot(back, 0), kvmem.export_slot(cpu, 1))

    y = ua_inputs(28, 17)
    a = kvmem.ua_create(3, UH, UG, UD, 64, device="cuda")
    feed_ua(a, 0, y, 0, 24)
    rec = kvmem.export_slot(a, 0)
    b = kvmem.ua_create(1, UH, UG, UD, 40)
    kvmem.import_slot(b, None, 0, rec)
    assert b.tokens(0) == 24 and torch.equal(kvmem.export_slot(b, 0), rec)
    moved = torch.cat([feed_ua(b, 0, y, t, t + 1) for t in range(24, 28)])
    stayed = torch.cat([feed_ua(a, 0, y, t, t + 1) for t in range(24, 28)])
    assert relative_frobenius(stayed, moved) <= 1e-4
    c = kvmem.ua_create(2, UH, UG, UD, 64, device="cuda")
    kvmem.import_slot(c, None, 1, kvmem.export_slot(b, 0))
    assert c.tokens(1) == 28 and torch.equal(kvmem.export_slot(c, 1), kvmem.export_slot(b, 0))


def test_truncate_and_reset_on_cuda_match_the_cpu_op():
    x, y = kvm_inputs(10, 18), kvm_inputs(5, 19)
    w = random_weights(20)
    outs = []
    for device in ("cpu", "cuda"):
        state = kvm_state(device)
        feed_kvm(state, w, 0, x, 0, 10)
        kvmem.truncate(state, 0, 3)
        assert state.tokens(0) == 7
        outs.append(feed_kvm(state, w, 0, y, 0, 5))
        z = kvm_inputs(70, 21)
        feed_kvm(state, w, 1, z, 0, 70)  # updates absorbed tokens into memory slots
        kvmem.reset_slots(state, [1])
        assert state.tokens(1) == 0
        outs.append(feed_kvm(state, w, 1, y, 0, 5))
    assert scaled_error(outs[2], outs[0]) <= 2e-5 and scaled_error(outs[3], outs[1]) <= 2e-5

    cache = kvmem.ua_create(2, UH, UG, UD, 64, device="cuda")
    feed_ua(cache, 1, ua_inputs(12, 22), 0, 12)
    kvmem.truncate(cache, 1, 12)  # all of it: a reset
    assert cache.tokens(1) == 0


def test_state_methods_and_sizes_on_cuda():
    state = kvm_state("cuda", max_slots=3, n_ctx=100)
    assert state.mechanism() == "kvm" and state.max_slots() == 3 and kvmem.state_device(state) == CUDA
    assert state.allocated_bytes() == kvmem.kvm_state_bytes(3, HQ, HK, D, D, 100, **KVM_CFG, device="cuda")
    assert kvmem.kvm_state_bytes(3, HQ, HK, D, D, 100, chunk=0, device="cuda") == 0
    cache = kvmem.ua_create(2, UH, UG, UD, 50, device=CUDA)
    assert cache.mechanism() == "ua" and cache.max_slots() == 2 and cache.device() == str(CUDA)
    assert cache.allocated_bytes() == sum(kvmem.ua_layout(2, UH, UG, UD, 50, device="cuda"))
    assert kvmem.ua_layout(2, 3, 2, UD, 50, device="cuda") == (0, 0)
    w = random_weights(23)
    feed_kvm(state, w, 1, kvm_inputs(5, 24), 0, 5)
    assert state.tokens(1) == 5 and state.tokens(7) == 0
    assert state.export_bytes(1) == kvmem.export_slot(state, 1).numel()
    kvmem.step_status(state)  # nothing refused


def test_meta_kernels_serve_cuda_states():
    state = kvm_state("cuda")
    s, qs = rows([2, 0], [3, 4])
    meta = {n: t.to("meta") for n, t in kvm_inputs(7, 25).items()}
    w = kvmem.KvmWeights.identity(D, HQ, device="meta")
    out, lse = kvmem.kvm_step(state, w, s.to("meta"), qs.to("meta"), **meta)
    assert out.device.type == "meta" and out.shape == (7, HQ, D) and lse.shape == (7, HQ)
    cache = kvmem.ua_create(2, UH, UG, UD, 16, device="cuda")
    u = {n: t.to("meta") for n, t in ua_inputs(7, 26).items()}
    out, lse = kvmem.ua_step(cache, s.to("meta"), qs.to("meta"), **u, p=0.05)
    assert out.shape == (7, UH, UD) and lse.shape == (7, UH)
    assert state.tokens(2) == 0 and cache.tokens(0) == 0


# ---- placed over CUDA tensors the caller allocates -------------------------------------------------------

def test_placed_states_on_cuda_step_like_owning_ones():
    state_bytes, work_bytes = kvmem.kvm_layout(2, HQ, HK, D, D, 96, **KVM_CFG, device="cuda")
    assert state_bytes > 0 and work_bytes > 0
    memory = torch.empty(state_bytes, dtype=torch.uint8, device=CUDA)
    work = torch.empty(work_bytes, dtype=torch.uint8, device=CUDA)
    placed = kvmem.kvm_place(memory, work, 2, HQ, HK, D, D, 96, **KVM_CFG)
    del memory, work  # the state keeps its tensors alive
    owning = kvm_state("cuda", max_slots=2, n_ctx=96)
    assert kvmem.state_device(placed) == CUDA and placed.allocated_bytes() == state_bytes + work_bytes
    w = random_weights(40)
    x = kvm_inputs(80, 41)
    for lo, hi in [(0, 23), (23, 24), (24, 80)]:
        assert torch.equal(feed_kvm(placed, w, 1, x, lo, hi), feed_kvm(owning, w, 1, x, lo, hi))
    assert torch.equal(kvmem.export_slot(placed, 1), kvmem.export_slot(owning, 1))

    cache_bytes, ua_work = kvmem.ua_layout(2, UH, UG, UD, 48, device="cuda")
    cache = kvmem.ua_place(torch.empty(cache_bytes, dtype=torch.uint8, device=CUDA),
                           torch.empty(ua_work, dtype=torch.uint8, device=CUDA), 2, UH, UG, UD, 48)
    ref = kvmem.ua_create(2, UH, UG, UD, 48, device="cuda")
    u = ua_inputs(40, 42)
    assert torch.equal(feed_ua(cache, 1, u, 0, 40), feed_ua(ref, 1, u, 0, 40))
    assert torch.equal(kvmem.export_slot(cache, 1), kvmem.export_slot(ref, 1))


# ---- refusals ------------------------------------------------------------------------------------------------

# ---- CUDA graphs ---------------------------------------------------------------------------------------------

def test_a_cuda_graph_of_a_kvm_decode_step_replays_like_eager_steps():
    """One graph of a padded decode batch, replayed 40 times (the replays cross state updates at 49, 65
    and 81 tokens), against the same steps run eagerly on a twin state: bitwise equal."""
    w = random_weights(34).to(CUDA)
    graphed, eager = kvm_state("cuda"), kvm_state("cuda")
    prompts = {0: kvm_inputs(30, 35), 1: kvm_inputs(45, 36), 3: kvm_inputs(5, 37)}
    for state in (graphed, eager):
        for slot, x in prompts.items():
            feed_kvm(state, w, slot, x, 0, x["q"].shape[0])
    slot = torch.tensor([0, -1, 1, 3], dtype=torch.int32, device=CUDA)
    qs = torch.arange(5, dtype=torch.int32, device=CUDA)
    static = on(CUDA, kvm_inputs(4, 38))
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out_g, lse_g = kvmem.kvm_step(graphed, w, slot, qs, **static)  # recorded, not run
    assert graphed.tokens(0) == 30
    for i in range(40):
        for name, t in kvm_inputs(4, 100 + i).items():
            static[name].copy_(t)
        graph.replay()
        out_e, lse_e = kvmem.kvm_step(eager, w, slot, qs, **static)
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e), i
        assert torch.count_nonzero(out_g[1]) == 0
    kvmem.step_status(graphed)
    for s, x in prompts.items():
        assert graphed.tokens(s) == x["q"].shape[0] + 40
        assert torch.equal(kvmem.export_slot(graphed, s), kvmem.export_slot(eager, s))
    assert graphed.tokens(2) == 0


def test_a_cuda_graph_of_a_ua_decode_step_replays_like_eager_steps():
    graphed, eager = (kvmem.ua_create(4, UH, UG, UD, 64, device="cuda") for _ in range(2))
    prompts = {0: ua_inputs(16, 41), 2: ua_inputs(9, 42)}
    for cache in (graphed, eager):
        for s, y in prompts.items():
            feed_ua(cache, s, y, 0, y["q"].shape[0])
    slot = torch.tensor([2, -1, 0], dtype=torch.int32, device=CUDA)
    qs = torch.arange(4, dtype=torch.int32, device=CUDA)
    static = on(CUDA, ua_inputs(3, 43))
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out_g, lse_g = kvmem.ua_step(graphed, slot, qs, **static, p=0.05, prefill_chunk=8)
    for i in range(20):
        for name, t in ua_inputs(3, 200 + i).items():
            static[name].copy_(t)
        graph.replay()
        out_e, lse_e = kvmem.ua_step(eager, slot, qs, **static, p=0.05, prefill_chunk=8)
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e), i
    kvmem.step_status(graphed)
    for s, y in prompts.items():
        assert graphed.tokens(s) == y["q"].shape[0] + 20
        assert torch.equal(kvmem.export_slot(graphed, s), kvmem.export_slot(eager, s))


# ---- bfloat16 and float16 states -------------------------------------------------------------------------

BF16_U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits)


def rounded(x, dtype):
    return {n: t.to(dtype) for n, t in x.items()}


def test_bf16_kvm_step_on_cuda_against_the_cpu_op():
    dt = torch.bfloat16
    seqs = {0: rounded(kvm_inputs(78, 4), dt), 1: rounded(kvm_inputs(80, 5), dt)}
    w = random_weights(6)
    cpu, gpu = kvm_state("cpu", dtype=dt), kvm_state("cuda", dtype=dt)
    assert kvmem.state_dtype(gpu) == dt and gpu.dtype() == "BFloat16"
    out_c, lse_c, _ = serve(lambda s, qs, **x: kvm_step_on(cpu, w, s, qs, **x), seqs, SCHEDULE_KVM)
    out_g, lse_g, pad_g = serve(lambda s, qs, **x: kvm_step_on(gpu, w, s, qs, **x), seqs, SCHEDULE_KVM)
    window = C * NB  # tokens before the first state update
    for slot in seqs:
        assert out_g[slot].dtype == dt and lse_g[slot].dtype == torch.float32
        torch.testing.assert_close(out_g[slot][:window].double(), out_c[slot][:window].double(), atol=2e-5,
                                   rtol=2 * BF16_U)
        assert relative_frobenius(out_g[slot], out_c[slot]) <= 1e-2, slot
        assert relative_frobenius(lse_g[slot], lse_c[slot]) <= 1e-2, slot
        assert gpu.tokens(slot) == cpu.tokens(slot) == seqs[slot]["q"].shape[0]
        assert decode_record(kvmem.export_slot(gpu, slot))["storage"].item() == 1  # bf16
    for o, l in pad_g:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


@pytest.mark.parametrize("case", [(torch.bfloat16, 0.0), (torch.bfloat16, 0.05), (torch.float16, 0.0),
                                  (torch.float16, 0.05)])
def test_reduced_precision_ua_step_on_cuda_against_the_cpu_op(case):
    dt, p = case
    seqs = {n: rounded(x, dt) for n, x in {0: ua_inputs(36, 7), 2: ua_inputs(23, 8), 3: ua_inputs(15, 9)}.items()}
    cpu, gpu = (kvmem.ua_create(4, UH, UG, UD, 64, device=d, dtype=dt) for d in ("cpu", "cuda"))
    out_c, lse_c, _ = serve(lambda s, qs, **x: ua_step_on(cpu, s, qs, p, **x), seqs, SCHEDULE_UA)
    out_g, lse_g, pad_g = serve(lambda s, qs, **x: ua_step_on(gpu, s, qs, p, **x), seqs, SCHEDULE_UA)
    bound = 1e-2 if dt == torch.bfloat16 else 2e-3
    for slot in seqs:
        assert out_g[slot].dtype == dt and lse_g[slot].dtype == torch.float32
        assert relative_frobenius(out_g[slot], out_c[slot]) <= bound, slot
        assert relative_frobenius(lse_g[slot], lse_c[slot]) <= bound, slot
        assert gpu.tokens(slot) == cpu.tokens(slot)
        if p == 0.0:  # nothing evicted: the same rows kept, keys and values stored alike
            assert_ua_records_match(kvmem.export_slot(gpu, slot), kvmem.export_slot(cpu, slot))
    for o, l in pad_g:
        assert torch.count_nonzero(o) == 0 and torch.count_nonzero(l) == 0


def test_bf16_at_an_engine_shape_on_cuda_against_the_cpu_op():
    """Head dim 128, four query heads per KV head, chunk 64: the shapes the CUDA backend runs on its
    bf16 tensor-core paths (readout, routing, UA chunk kernel), with prompts past the window and decode
    steps after them."""
    dt, hq, hk, d = torch.bfloat16, 8, 2, 128
    cfg = dict(chunk=64, window_chunks=2, rope_dims=64, budget=kvmem.Fixed(64))
    w = helpers.random_kvm_weights(50, d, hq)
    prompts = {0: 300, 1: 170}
    x = {s: rounded(helpers.kvm_inputs(n + 6, 51 + s, hq, hk, d), dt) for s, n in prompts.items()}
    schedule = [[(0, 300), (1, 170)]] + [[(0, 1), (1, 1)]] * 6
    outs = []
    for device in ("cpu", "cuda"):
        state = kvmem.kvm_create(2, hq, hk, d, d, 512, **cfg, device=device, dtype=dt)
        outs.append(serve(lambda s, qs, **t: kvm_step_on(state, w, s, qs, **t), x, schedule)[0])
    for s in prompts:
        assert relative_frobenius(outs[1][s], outs[0][s]) <= 1e-2, s
    y = {s: rounded(helpers.ua_inputs(n + 6, 61 + s, hq, hk, d), dt) for s, n in prompts.items()}
    schedule = [[(0, 256), (1, 128)], [(0, 44), (1, 42)]] + [[(0, 1), (1, 1)]] * 6
    outs = []
    for device in ("cpu", "cuda"):
        cache = kvmem.ua_create(2, hq, hk, d, 512, device=device, dtype=dt)
        outs.append(serve(lambda s, qs, **t: ua_step_on(cache, s, qs, 0.05, prefill_chunk=128, **t), y, schedule)[0])
    for s in prompts:
        assert relative_frobenius(outs[1][s], outs[0][s]) <= 1e-2, s


def test_bf16_records_move_between_cuda_and_cpu():
    dt = torch.bfloat16
    x = rounded(kvm_inputs(66, 15), dt)
    w = random_weights(16)
    gpu = kvm_state("cuda", dtype=dt)
    feed_kvm(gpu, w, 2, x, 0, 61)
    record = kvmem.export_slot(gpu, 2)
    cpu = kvm_state("cpu", max_slots=2, dtype=dt)
    kvmem.import_slot(cpu, w, 1, record)
    assert cpu.tokens(1) == 61 and torch.equal(kvmem.export_slot(cpu, 1), record)
    tail_c, tail_g = feed_kvm(cpu, w, 1, x, 61, 66), feed_kvm(gpu, w, 2, x, 61, 66)
    assert relative_frobenius(tail_g, tail_c) <= 1e-2
    back = kvm_state("cuda", max_slots=2, dtype=dt)
    kvmem.import_slot(back, w.to(CUDA), 0, kvmem.export_slot(cpu, 1))
    assert back.tokens(0) == 66

    y = rounded(ua_inputs(28, 17), dt)
    a = kvmem.ua_create(3, UH, UG, UD, 64, device="cuda", dtype=dt)
    feed_ua(a, 0, y, 0, 24)
    b = kvmem.ua_create(1, UH, UG, UD, 40, dtype=dt)
    kvmem.import_slot(b, None, 0, kvmem.export_slot(a, 0))
    assert b.tokens(0) == 24 and torch.equal(kvmem.export_slot(b, 0), kvmem.export_slot(a, 0))
    moved = torch.cat([feed_ua(b, 0, y, t, t + 1) for t in range(24, 28)])
    stayed = torch.cat([feed_ua(a, 0, y, t, t + 1) for t in range(24, 28)])
    assert relative_frobenius(stayed, moved) <= 1e-2


def test_a_cuda_graph_of_a_bf16_kvm_decode_step_replays_like_eager_steps():
    dt = torch.bfloat16
    w = random_weights(34).to(CUDA)
    graphed, eager = kvm_state("cuda", dtype=dt), kvm_state("cuda", dtype=dt)
    prompts = {0: rounded(kvm_inputs(30, 35), dt), 1: rounded(kvm_inputs(45, 36), dt)}
    for state in (graphed, eager):
        for slot, x in prompts.items():
            feed_kvm(state, w, slot, x, 0, x["q"].shape[0])
    slot = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=CUDA)
    qs = torch.arange(5, dtype=torch.int32, device=CUDA)
    static = on(CUDA, rounded(kvm_inputs(4, 38), dt))
    kvmem.kvm_step(graphed, w, torch.full_like(slot, -1), qs, **static)  # warm-up: changes nothing
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out_g, lse_g = kvmem.kvm_step(graphed, w, slot, qs, **static)
    for i in range(40):
        for name, t in rounded(kvm_inputs(4, 100 + i), dt).items():
            static[name].copy_(t)
        graph.replay()
        out_e, lse_e = kvmem.kvm_step(eager, w, slot, qs, **static)
        assert out_g.dtype == dt and torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e), i
    kvmem.step_status(graphed)
    for s, x in prompts.items():
        assert graphed.tokens(s) == x["q"].shape[0] + 40
        assert torch.equal(kvmem.export_slot(graphed, s), kvmem.export_slot(eager, s))


def test_sizes_of_reduced_precision_states_on_cuda():
    dt = torch.bfloat16
    state = kvm_state("cuda", max_slots=3, n_ctx=100, dtype=dt)
    assert state.allocated_bytes() == kvmem.kvm_state_bytes(3, HQ, HK, D, D, 100, **KVM_CFG, device="cuda", dtype=dt)
    assert 0 < state.allocated_bytes() < kvmem.kvm_state_bytes(3, HQ, HK, D, D, 100, **KVM_CFG, device="cuda")
    sb, wb = kvmem.kvm_layout(2, HQ, HK, D, D, 96, **KVM_CFG, device="cuda", dtype=dt)
    placed = kvmem.kvm_place(torch.empty(sb, dtype=torch.uint8, device=CUDA),
                             torch.empty(wb, dtype=torch.uint8, device=CUDA), 2, HQ, HK, D, D, 96, **KVM_CFG, dtype=dt)
    assert kvmem.state_dtype(placed) == dt and placed.allocated_bytes() == sb + wb
    for dt in (torch.bfloat16, torch.float16):
        cache = kvmem.ua_create(2, UH, UG, UD, 50, device="cuda", dtype=dt)
        assert kvmem.state_dtype(cache) == dt
        assert cache.allocated_bytes() == sum(kvmem.ua_layout(2, UH, UG, UD, 50, device="cuda", dtype=dt))
        cb, uw = kvmem.ua_layout(2, UH, UG, UD, 48, device="cuda", dtype=dt)
        placed = kvmem.ua_place(torch.empty(cb, dtype=torch.uint8, device=CUDA),
                                torch.empty(uw, dtype=torch.uint8, device=CUDA), 2, UH, UG, UD, 48, dtype=dt)
        assert kvmem.state_dtype(placed) == dt
