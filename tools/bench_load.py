"""Peak memory per rank of loading a full fine-tuning policy and its reference (beta > 0) under torchrun,
the old way against infra/load.py's load_sharded (a benchmark, not a test).

    python -m tools.bench_load                 # 2 gloo ranks on CPU, an 87M-parameter LLaDA-shaped model
    python -m tools.bench_load --nproc 4 --n_layers 8

The checkpoint is random, LLaDA-shaped (d 512, 8 heads, MLP 1536, vocab 32000, 16 layers), stored in bf16
as the released LLaDA weights are, in 6 files as LLaDA-8B is; the master weights are float32. Each way
runs in fresh processes (torchrun), since the peak resident set (getrusage ru_maxrss) only grows:
  old  every rank reads the whole model in float32, deep-copies it for the reference, then shards both;
  new  load.load_sharded twice: meta build, shard, then each rank fills its own rows, tensor by tensor.
On CPU the device memory is the resident set, which also counts the checkpoint's memory-mapped file pages
and the Python/torch baseline (reported separately); on GPUs the CPU side is not device memory.
"""
import shlex
import sys

if __name__ == "__main__" and not __package__:  # run as a file, tools/ would shadow the project's modules
    sys.exit("run it from the project's root as a module: "
             + shlex.join(["python", "-m", "tools.bench_load", *sys.argv[1:]]))

import argparse
import copy
import json
import os
import resource
import subprocess
import tempfile
from pathlib import Path

import torch

from model import ModelConfig, Transformer, num_params
from infra import hf


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rank_main(way: str, ckpt: str) -> None:
    from infra import load, scale

    device = scale.init("cpu")
    base = rss_mb()
    if way == "old":
        model = hf.from_pretrained(ckpt, device=device, dtype=torch.float32)
        ref = scale.shard(copy.deepcopy(model).eval().requires_grad_(False), compute_dtype=torch.bfloat16)
        model = scale.shard(model, compute_dtype=torch.bfloat16)
    else:
        model = load.load_sharded(ckpt, device, torch.float32, torch.bfloat16)
        ref = load.load_sharded(ckpt, device, torch.float32, torch.bfloat16, lambda m: m.requires_grad_(False))
    local = sum(p.to_local().numel() * p.element_size() for m in (model, ref) for p in m.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"rank": scale.rank(), "base": base, "peak": peak, "end": rss_mb(), "shards": local / 2**20}))
    scale.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Peak RSS per rank: old vs sharded loading of policy + reference")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n_layers", type=int, default=16)
    p.add_argument("--rank_main", nargs=2, metavar=("WAY", "CKPT"), help=argparse.SUPPRESS)
    o = p.parse_args(argv)
    if o.rank_main:
        return rank_main(*o.rank_main)
    with tempfile.TemporaryDirectory() as tmp:
        mc = ModelConfig(d_model=512, n_layers=o.n_layers, n_heads=8, n_kv_heads=8, mlp_hidden_size=1536,
                         vocab_size=32000, mask_token_id=31999)
        model = Transformer(mc).init_weights(torch.Generator().manual_seed(0)).to(torch.bfloat16)
        n, size = num_params(model), sum(t.numel() * 2 for t in model.state_dict().values())
        hf.save_pretrained(model, tmp, max_shard_bytes=size // 6 + 1)
        del model
        print(f"{n / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB bf16 on disk, float32 model "
              f"{2 * size / 2**20:.0f} MiB; {o.nproc} gloo ranks, policy + reference")
        print("| way | rank | baseline MiB | peak RSS MiB | peak - baseline | RSS after | own shards MiB |")
        print("|---|---|---|---|---|---|---|")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for way in ("old", "new"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={o.nproc}",
                   "-m", "tools.bench_load", "--rank_main", way, tmp]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if res.returncode:
                sys.exit(res.stdout[-2000:] + res.stderr[-2000:])
            rows = sorted((json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")), key=lambda r: r["rank"])
            for r in rows:
                print(f"| {way} | {r['rank']} | {r['base']:.0f} | {r['peak']:.0f} | {r['peak'] - r['base']:.0f} "
                      f"| {r['end']:.0f} | {r['shards']:.0f} |")


if __name__ == "__main__":
    main()
