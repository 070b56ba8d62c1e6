# SPDX-License-Identifier: Apache-2.0
"""The PyTorch ops' refusals on CUDA tensors: every call here raises, with kvmem's message, the exception
the CPU op raises, and changes nothing. Uses the helpers and the skip of test_ops_cuda.py. Skipped,
saying why, without a CUDA device or without the CUDA kernels in the op library."""

import pytest
import torch

import kvmem
from helpers import rows
from test_ops_cuda import (CUDA, DEV, HK, HQ, KVM_CFG, UD, UG, UH, D, feed_kvm, feed_ua, graph_capture, kvm_inputs,
                           kvm_state, on, random_weights, ua_inputs, ua_step_on)


def test_refused_truncates_on_cuda_change_nothing():
    w = random_weights(20)
    state = kvm_state("cuda")
    feed_kvm(state, w, 1, kvm_inputs(70, 21), 0, 70)  # updates absorbed tokens into memory slots
    with pytest.raises(ValueError, match="cannot be undone"):
        kvmem.truncate(state, 1, 30)
    assert state.tokens(1) == 70
    cache = kvmem.ua_create(2, UH, UG, UD, 64, device="cuda")
    feed_ua(cache, 1, ua_inputs(12, 22), 0, 12)
    with pytest.raises(RuntimeError, match="unsupported"):
        kvmem.truncate(cache, 1, 2)
    assert cache.tokens(1) == 12


def test_placement_on_cuda_refuses_tensors_it_cannot_use():
    state_bytes, work_bytes = kvmem.kvm_layout(2, HQ, HK, D, D, 96, **KVM_CFG, device="cuda")
    with pytest.raises(ValueError, match="state memory: expected 256-byte alignment"):
        kvmem.kvm_place(torch.empty(state_bytes + 256, dtype=torch.uint8, device=CUDA)[1:],
                        torch.empty(work_bytes, dtype=torch.uint8, device=CUDA), 2, HQ, HK, D, D, 96, **KVM_CFG)
    with pytest.raises(ValueError, match=f"state memory bytes: expected >= {state_bytes}"):
        kvmem.kvm_place(torch.empty(state_bytes - 1, dtype=torch.uint8, device=CUDA),
                        torch.empty(work_bytes, dtype=torch.uint8, device=CUDA), 2, HQ, HK, D, D, 96, **KVM_CFG)


def test_bad_inputs_on_cuda_raise_with_kvmems_message_and_change_nothing():
    state = kvm_state("cuda", n_ctx=64)
    w = random_weights(26).to(CUDA)
    x = on(CUDA, kvm_inputs(6, 27))
    feed_kvm(state, w, 0, kvm_inputs(3, 28), 0, 3)
    before = kvmem.export_slot(state, 0)

    def step(slot, counts, **over):
        s, qs = rows(slot, counts)
        args = dict(x, **over)
        return kvmem.kvm_step(state, w, s.to(CUDA), qs.to(CUDA), args["q"], args["k"], args["v"], args["gate"])

    # the rows are checked on the device; the op reads the verdict back and raises
    with pytest.raises(IndexError, match=r"slot\[1\]: expected -1 \(padding\) or 0 <= slot < max_slots = 4, got 9"):
        step([0, 9], [3, 3])
    with pytest.raises(ValueError, match=r"slot\[\d\]: expected a slot used by no"):
        step([0, 0], [3, 3])
    with pytest.raises(ValueError, match=r"query_start\[3\]: expected the packed token count"):
        kvmem.kvm_step(state, w, torch.tensor([0, 1, 2], dtype=torch.int32, device=CUDA),
                       torch.tensor([0, 2, 4, 5], dtype=torch.int32, device=CUDA), x["q"], x["k"], x["v"], x["gate"])
    with pytest.raises(IndexError, match="exceed the state's n_ctx = 64"):
        step([0], [62], **{n: t.repeat(11, 1, 1)[:62] if t.dim() == 3 else t.repeat(11, 1)[:62]
                           for n, t in x.items()})
    # the rest on the host, before anything is enqueued
    with pytest.raises(ValueError, match=r"q \[tokens,Hq,D\]"):
        step([0], [6], q=torch.randn(6, HQ + 1, D, device=CUDA))
    with pytest.raises(ValueError, match="q: expected dtype Float, got Double"):
        step([0], [6], q=x["q"].double())
    with pytest.raises(ValueError, match=rf"ln_weight shape: expected \[{D}\], got \[{D + 1}\]"):
        s, qs = rows([0], [6])
        kvmem.kvm_step(state, kvmem.KvmWeights(torch.ones(D + 1, device=CUDA), *w[1:]), s.to(CUDA), qs.to(CUDA),
                       **x)
    with pytest.raises(ValueError, match="expected a KV Means state"):
        s, qs = rows([0], [6])
        kvmem.kvm_step(kvmem.ua_create(1, HQ, HK, D, 8, device="cuda"), w, s.to(CUDA), qs.to(CUDA), **x)
    with pytest.raises(ValueError, match="dst"):
        kvmem.copy_slots(state, [0, 1], [2, 2])
    with pytest.raises(IndexError, match="slots"):
        kvmem.reset_slots(state, [4])
    with pytest.raises(ValueError, match="slot record: expected bytes that start with \"KVMEMSLT\""):
        kvmem.import_slot(state, w, 1, torch.zeros(64, dtype=torch.uint8))
    kvmem.step_status(state)  # every refusal was read: nothing is pending
    assert state.tokens(0) == 3 and torch.equal(kvmem.export_slot(state, 0), before)
    feed_kvm(state, w, 0, kvm_inputs(2, 29), 0, 2)  # and the state steps on
    assert state.tokens(0) == 5


def test_a_ua_row_without_room_is_refused_on_cuda_as_on_the_cpu():
    errors = []
    for device in ("cpu", "cuda"):
        cache = kvmem.ua_create(2, UH, UG, UD, 16, device=device)
        y = ua_inputs(20, 30)
        feed_ua(cache, 1, y, 0, 10, p=0.0)  # nothing evicted: 10 rows kept
        before = kvmem.export_slot(cache, 1)
        with pytest.raises(IndexError, match=r"cache capacity: row 1 \(slot 1, kv head 0\) needs room for 20") as e:
            s, qs = rows([0, 1], [2, 10])
            ua_step_on(cache, s, qs, 0.0, **{n: torch.cat([t[:2], t[10:20]]) for n, t in y.items()})
        errors.append(str(e.value))
        assert cache.tokens(0) == 0 and torch.equal(kvmem.export_slot(cache, 1), before)
    assert errors[0] == errors[1]


def test_a_state_and_tensors_on_different_devices_raise():
    gpu, cpu = kvm_state("cuda"), kvm_state("cpu")
    w = random_weights(31)
    x = kvm_inputs(3, 32)
    s, qs = rows([0], [3])
    with pytest.raises(ValueError, match=f"kvm_step: the state is on {DEV} but the tensors are on cpu"):
        kvmem.kvm_step(gpu, w, s, qs, **x)
    with pytest.raises(ValueError, match="kvm_step: the state is on cpu but the tensors are on cuda"):
        kvmem.kvm_step(cpu, w.to(CUDA), s.to(CUDA), qs.to(CUDA), **on(CUDA, x))
    with pytest.raises(ValueError, match=rf"gate: expected a tensor on {DEV} \(the state's device\), got device cpu"):
        kvmem.kvm_step(gpu, w.to(CUDA), s.to(CUDA), qs.to(CUDA), x["q"].to(CUDA), x["k"].to(CUDA),
                       x["v"].to(CUDA), x["gate"])
    with pytest.raises(ValueError, match=rf"ln_weight: expected a tensor on {DEV}"):
        kvmem.kvm_step(gpu, w, s.to(CUDA), qs.to(CUDA), **on(CUDA, x))
    with pytest.raises(ValueError, match=f"reset_slots: the state is on {DEV} but the tensors are on cpu"):
        kvmem.reset_slots(gpu, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="copy_slots: the state is on cpu but the tensors are on cuda"):
        kvmem.copy_slots(cpu, torch.tensor([0], dtype=torch.int32, device=CUDA),
                         torch.tensor([1], dtype=torch.int32, device=CUDA))
    with pytest.raises(ValueError, match=rf"import_slot: ln_weight: expected a tensor on {DEV}"):
        kvmem.import_slot(gpu, w, 0, kvmem.export_slot(cpu, 0))
    with pytest.raises(ValueError, match="import_slot: the state is on cpu but the tensors are on cuda"):
        kvmem.import_slot(cpu, w.to(CUDA), 0, kvmem.export_slot(cpu, 0))
    ua = kvmem.ua_create(2, UH, UG, UD, 16, device="cuda")
    u = ua_inputs(2, 33)
    s, qs = rows([0], [2])
    with pytest.raises(ValueError, match=f"ua_step: the state is on {DEV} but the tensors are on cpu"):
        kvmem.ua_step(ua, s, qs, **u)
    state_bytes, work_bytes = kvmem.kvm_layout(2, HQ, HK, D, D, 64, **KVM_CFG, device="cuda")
    with pytest.raises(ValueError, match=f"kvm_place: workspace: expected a CPU tensor, got device {DEV}"):
        kvmem.kvm_place(torch.empty(state_bytes, dtype=torch.uint8), torch.empty(work_bytes, dtype=torch.uint8,
                                                                                 device=CUDA),
                        2, HQ, HK, D, D, 64, **KVM_CFG)
    assert gpu.tokens(0) == 0 and cpu.tokens(0) == 0




def test_a_refused_replay_is_reported_by_step_status():
    w = random_weights(39).to(CUDA)
    state = kvm_state("cuda")
    slot = torch.tensor([0, 1], dtype=torch.int32, device=CUDA)
    qs = torch.arange(3, dtype=torch.int32, device=CUDA)
    static = on(CUDA, kvm_inputs(2, 40))
    kvmem.kvm_step(state, w, torch.full_like(slot, -1), qs, **static)  # warm-up: padding rows change nothing
    assert state.tokens(0) == 0
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        kvmem.kvm_step(state, w, slot, qs, **static)
    graph.replay()
    kvmem.step_status(state)
    slot.copy_(torch.tensor([1, 1], dtype=torch.int32))  # two rows of one slot: refused on the device
    graph.replay()
    with pytest.raises(ValueError, match=r"a step was refused on the device: .*slot\[\d\]: expected a slot used by"):
        kvmem.step_status(state)
    kvmem.step_status(state)  # read and cleared
    assert state.tokens(0) == 1 and state.tokens(1) == 1


def test_a_step_that_does_not_wait_is_reported_by_step_status():
    w = random_weights(41).to(CUDA)
    state = kvm_state("cuda")
    x = on(CUDA, kvm_inputs(2, 42))
    slot = torch.tensor([1, 1], dtype=torch.int32, device=CUDA)  # two rows of one slot: refused on the device
    qs = torch.arange(3, dtype=torch.int32, device=CUDA)
    kvmem.kvm_step(state, w, slot, qs, **x, wait=False)  # returns without reading the verdict
    with pytest.raises(ValueError, match=r"a step was refused on the device: .*slot\[\d\]: expected a slot used by"):
        kvmem.step_status(state)
    assert state.tokens(1) == 0
    kvmem.kvm_step(state, w, slot[:1].contiguous(), qs[:2].contiguous(), x["q"][:1], x["k"][:1], x["v"][:1],
                   x["gate"][:1], wait=False)
    kvmem.step_status(state)  # a good step leaves nothing to report
    assert state.tokens(1) == 1
    # a UA row without room: skipped (outputs zero) and its slot flagged, reported by step_status
    cache = kvmem.ua_create(2, UH, UG, UD, 4, device="cuda")
    u = on(CUDA, ua_inputs(6, 43))
    s, q6 = rows([0], [6])
    out, _ = kvmem.ua_step(cache, s.to(CUDA), q6.to(CUDA), **u, wait=False)
    with pytest.raises(IndexError, match=r"cache capacity: slots \[0\] had no room for a row of a step that did not wait"):
        kvmem.step_status(cache)
    assert cache.tokens(0) == 0 and bool((out == 0).all())


def test_dtype_combinations_on_cuda_raise_like_on_the_cpu():
    with pytest.raises(ValueError, match="kvm_create: dtype: expected Float or BFloat16"):
        kvm_state("cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="ua_layout: dtype: expected Float, BFloat16 or Half"):
        kvmem.ua_layout(2, UH, UG, UD, 16, device="cuda", dtype=torch.float64)
    state = kvm_state("cuda", dtype=torch.bfloat16)
    w = random_weights(45).to(CUDA)
    x = on(CUDA, kvm_inputs(4, 46))
    s, qs = rows([0], [4])
    with pytest.raises(ValueError, match=r"kvm_step: q: expected dtype BFloat16, got Float \(a state of dtype "
                                         r"BFloat16 takes q, k, v and gate of its dtype\)"):
        kvmem.kvm_step(state, w, s.to(CUDA), qs.to(CUDA), **x)
    cache = kvmem.ua_create(2, UH, UG, UD, 16, device="cuda", dtype=torch.float16)
    u = on(CUDA, {n: t.bfloat16() for n, t in ua_inputs(4, 47).items()})
    with pytest.raises(ValueError, match="ua_step: q: expected dtype Half, got BFloat16"):
        kvmem.ua_step(cache, s.to(CUDA), qs.to(CUDA), **u)
    assert state.tokens(0) == 0 and cache.tokens(0) == 0
