# SPDX-License-Identifier: Apache-2.0
"""The decode loop of decode_loop.py with the KV heads sharded over processes (torch.distributed).

Rank r of W owns KV heads [r·Hk/W, (r+1)·Hk/W) and their query heads: it projects q, k, v for those
heads only, keeps kvmem state for them only (a KV Means or Universal Attention state is independent
per KV head, so a shard is exact), and multiplies its heads' outputs by its columns of the output
projection. One all-reduce of those partial sums per layer is the only exchange: no keys, values,
states or log-sum-exps cross ranks. Every rank then holds the same hidden states, runs the (replicated)
MLP and samples the same tokens, so the scheduler needs no messages either.

    PYTHONPATH=build/release/python python3 examples/python/head_parallel.py --world 2

``--device cpu`` (the default) runs gloo on CPUs; ``--device cuda`` runs NCCL with rank r on GPU r
(the ops take CUDA tensors there), which needs ``--world`` GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_loop  # noqa: E402


def worker(rank: int, world: int, init_file: str, args, out_path: str) -> None:
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = decode_loop.Config(mechanism=args.mechanism, max_slots=args.slots, n_ctx=args.n_ctx, device=device)
    if cfg.kv_heads % world:
        raise SystemExit(f"--world {world} must divide the {cfg.kv_heads} KV heads")
    per = cfg.kv_heads // world
    model = decode_loop.Decoder(cfg, decode_loop.make_weights(cfg), kv_range=(rank * per, (rank + 1) * per),
                                group=dist.group.WORLD)
    requests = decode_loop.workload(args.requests, cfg.vocab, args.prompt, args.generate)
    results, tokens, seconds = decode_loop.serve(model, requests)
    if rank == 0:
        torch.save(results, out_path)
        print(f"{world} ranks, {args.mechanism}: {tokens} tokens in {seconds:.3f} s; "
              f"kvmem state per rank {model.cache_bytes() / 2**20:.2f} MiB")
    dist.destroy_process_group()


def run(world: int, args, out_path: str) -> None:
    """Runs the loop on `world` processes; rank 0 saves the per-request results to out_path."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, os.path.join(d, "init"), args, out_path), nprocs=world, join=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mechanism", default="kvm", choices=["kvm", "ua"])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt", default="8:60")
    ap.add_argument("--generate", default="4:16")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: gloo; cuda: NCCL, rank r on GPU r")
    ap.add_argument("--out", default=None, help="where rank 0 saves the results (torch.save)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        ap.error(f"--device cuda --world {a.world}: needs {a.world} GPUs, this machine has "
                 f"{torch.cuda.device_count()}")
    a.prompt, a.generate = tuple(map(int, a.prompt.split(":"))), tuple(map(int, a.generate.split(":")))
    a.n_ctx = a.prompt[1] + a.generate[1]
    return a


if __name__ == "__main__":
    args = parse()
    with tempfile.TemporaryDirectory() as d:
        run(args.world, args, args.out or os.path.join(d, "results.pt"))
