"""Running at scale: torchrun process groups, FSDP2 sharding, cross-rank reductions, and the dry-run budget.

    torchrun --nproc_per_node=8 train.py --preset llada8b --init_from=/models/LLaDA-8B-Instruct ...
    python train.py --preset llada8b --dry_run            # parameters, memory per GPU, FLOPs; no weights

A single process needs none of this: every function below is a no-op (or the identity) when WORLD_SIZE is
unset or 1, so train.py has one code path. With WORLD_SIZE > 1 the model is sharded with FSDP2, PyTorch's
own engine (`fully_shard` on each block, then on the root, as torchtitan does), on NCCL for CUDA and on
gloo for CPU, which is what the tests run. Multi-node is only torchrun's flags (README).

Results must not depend on the world size: train.py draws every random number from generators seeded by
(seed, step, global prompt index), builds the global batch on every rank and keeps its own rows, so a
sequence gets the same sample, mask and log-probability on any number of processes. The collectives here
only move rewards, token counts and statistics.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------------------------------
# process group


def init(device_name: str) -> torch.device:
    """Join torchrun's process group when WORLD_SIZE > 1 and return this rank's device. device_name is
    train.py's --device ("auto", "cpu", "cuda", "cuda:N"); under torchrun each rank takes cuda:LOCAL_RANK."""
    want_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return torch.device("cuda" if device_name == "auto" and want_cuda else
                            ("cpu" if device_name == "auto" else device_name))
    if not dist.is_initialized():
        if want_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if want_cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if want_cuda else torch.device("cpu")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print0(*args, **kwargs) -> None:
    """Print on rank 0 only: one log, not world-size copies of it."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def shard_rows(n: int) -> slice:
    """This rank's contiguous share of n global rows (n must divide evenly; train.py validates that)."""
    per = n // world()
    return slice(rank() * per, (rank() + 1) * per)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place, returned); the identity in one process."""
    if world() > 1:
        dist.all_reduce(t)
    return t


def all_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks (in place, returned); the identity in one process."""
    if world() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's equally sized t along dim 0, in rank order: the global tensor."""
    if world() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -----------------------------------------------------------------------------------------------------
# FSDP2


def shard(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 over the ranks: each block is one all-gather unit, then the root (embedding, final norm and
    head). The sharded parameters keep the dtype they were loaded in (float32 master weights for full
    fine-tuning, a bf16 base for LoRA); the all-gathered copies that compute are in compute_dtype (bf16
    on CUDA); gradients are reduce-scattered in float32 so that summing 8+ ranks does not lose the small
    ones. The identity in one process. Call after add_lora (FSDP2 shards frozen and trainable parameters
    alike) and before the optimizer."""
    if world() == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_weights(model):
    """Hold the unsharded weights for a stretch of forward passes whose count differs between ranks:
    rollouts (threshold decoding ends a block early, stop_at_eos drops rows) and evaluation. Sharded
    forwards all-gather every block on every pass, a collective all ranks must join, so they would
    deadlock; here one all-gather up front replaces the per-step ones (128 diffusion steps would gather
    the 16 GB of LLaDA-8B weights 128 times).
    The weights are resharded on exit. Re-entrant: a nested use (evaluate -> rollout) does nothing, so a
    rank with no rows of its own in some batch can skip the inner one without deadlocking the others."""
    outer = world() > 1 and not getattr(model, "_full_weights", False)
    mods = _fsdp_modules(model) if outer else []
    for m in mods:
        # The root keeps FSDP2's own setting (it never reshards after forward); the blocks stay gathered.
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    if outer:
        model._full_weights = True
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)
        if outer:
            model._full_weights = False


def full_state_dict(model) -> dict:
    """The whole model's state dict on CPU, on rank 0 (other ranks get an empty dict). A collective under
    FSDP2: every rank must call it."""
    if world() == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if rank() == 0 else {}


# -----------------------------------------------------------------------------------------------------
# dry-run budget


def budget(model_config, n_params: int, *, world_size: int, lora_params: int, seqs_per_rank: int,
           seq_len: int, steps: int, num_iterations: int, beta: float, activation_checkpointing: bool,
           bytes_per_param: int = 2) -> dict:
    """Back-of-the-envelope memory per GPU (GB) and FLOPs per RL step, for --dry_run. Estimates, not
    measurements: they leave out the CUDA context, allocator fragmentation and NCCL buffers (a few GB).

    Full fine-tuning: float32 master weights, float32 gradients and AdamW's two float32 moments (16 B per
    parameter) plus a float32 reference copy (4 B, when beta > 0), sharded over the ranks by FSDP2;
    compute uses bf16 copies gathered one block at a time.
    LoRA: the frozen bf16 base (2 B/param, sharded too) plus float32 adapters with gradients and moments
    (16 B/param); its reference policy is the base itself. An update chunk adds its activations (per token and
    layer, checkpointing keeps the block input, d_model values, and recomputes one block at a time;
    without it a LLaDA block keeps about 16 d_model + 3 mlp_hidden values) and its float32 logits with
    their log-softmax (seq x vocab, the largest tensor at a 126k vocabulary). A rollout holds the whole
    model unsharded (scale.full_weights) beside the sharded state, plus float64 Gumbel noise over the
    logits."""
    c = model_config
    gb = 1024 ** 3
    weights = n_params * bytes_per_param / world_size
    per_tok_layer = c.d_model if activation_checkpointing else 16 * c.d_model + 3 * c.mlp_hidden_size
    acts = seqs_per_rank * seq_len * c.n_layers * per_tok_layer * bytes_per_param
    if activation_checkpointing:  # one block is recomputed at a time, with its full activations
        acts += seqs_per_rank * seq_len * (16 * c.d_model + 3 * c.mlp_hidden_size) * bytes_per_param
    logits = seqs_per_rank * seq_len * c.vocab_size * 4 * 2  # float32 logits and their log-softmax
    # float32 weights, gradients and AdamW moments, and the frozen reference copy (float32) when beta > 0
    state_full = n_params * (16 + 4 * (beta > 0)) / world_size
    state_lora = weights + lora_params * 16 / world_size
    # Rollouts gather the whole model in bf16 (full_weights) beside the sharded state, and draw float64
    # Gumbel noise over the logits; they keep no activations for backward.
    gather = n_params * bytes_per_param * (world_size > 1) + seqs_per_rank * seq_len * c.vocab_size * 8
    # FLOPs: 2 N per token forward, 6 N forward+backward; attention adds 4 L d per layer per token.
    fwd_tok = 2 * n_params + 4 * seq_len * c.d_model * c.n_layers
    seqs = seqs_per_rank * world_size
    flops_rollout = seqs * steps * seq_len * fwd_tok  # no KV cache: every step re-runs the sequence
    flops_scoring = seqs * num_iterations * seq_len * fwd_tok * (1 + (beta > 0))  # old + ref passes
    flops_update = seqs * num_iterations * seq_len * 3 * fwd_tok
    return {"weights_gb": weights / gb, "full_ft_gb": (state_full + acts + logits) / gb,
            "full_ft_rollout_gb": (state_full + gather) / gb, "lora_gb": (state_lora + acts + logits) / gb,
            "lora_rollout_gb": (state_lora + gather) / gb, "activations_gb": acts / gb, "logits_gb": logits / gb,
            "flops_rollout": flops_rollout, "flops_scoring": flops_scoring, "flops_update": flops_update,
            "flops_total": flops_rollout + flops_scoring + flops_update}


def dry_run(mc, *, seqs: int, seq_len: int, steps: int, lora_rank: int, num_iterations: int, beta: float,
            device_batch_size: int, activation_checkpointing: bool, gpus: int) -> dict:
    """Build the model on the meta device (no memory), count its parameters and LoRA's, and print the
    budget table for 1, 8, 16 and `gpus` GPUs; returns the numbers (tests, README)."""
    from infra.lora import LORA_TARGETS
    from model import Transformer, num_params

    with torch.device("meta"):
        model = Transformer(mc)
    n = num_params(model)
    per_block = sum(m.in_features + m.out_features for name, m in model.blocks[0].named_children()
                    if name in LORA_TARGETS)
    n_lora = lora_rank * per_block * mc.n_layers
    cols = sorted({1, 8, 16, gpus})
    rows = [budget(mc, n, world_size=w, lora_params=n_lora, seqs_per_rank=device_batch_size or max(1, seqs // w),
                   seq_len=seq_len, steps=steps, num_iterations=num_iterations, beta=beta,
                   activation_checkpointing=activation_checkpointing) for w in cols]
    print(f"model: {n:,} parameters ({mc.n_layers} layers, d_model {mc.d_model}, vocab {mc.vocab_size}); "
          f"LoRA r={lora_rank}: {n_lora:,} adapter parameters")
    print(f"RL step: {seqs} sequences of {seq_len} tokens, {steps} denoising steps, mu={num_iterations}, "
          f"device_batch_size {device_batch_size or 'all'}, activation checkpointing "
          f"{'on' if activation_checkpointing else 'off'}")
    print("| GB per GPU (estimate) | " + " | ".join(f"{w} GPU{'s' * (w > 1)}" for w in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for key, label in (("weights_gb", "bf16 weights, sharded"), ("full_ft_gb", "full fine-tuning, update"),
                       ("full_ft_rollout_gb", "full fine-tuning, rollout"), ("lora_gb", f"LoRA r={lora_rank}, update"),
                       ("lora_rollout_gb", f"LoRA r={lora_rank}, rollout"),
                       ("activations_gb", "activations per update chunk"), ("logits_gb", "logits per log-prob chunk")):
        print(f"| {label} | " + " | ".join(f"{r[key]:.1f}" for r in rows) + " |")
    r = rows[0]
    print(f"FLOPs per RL step: rollouts {r['flops_rollout']:.2e}, old/ref scoring {r['flops_scoring']:.2e}, "
          f"updates {r['flops_update']:.2e}, total {r['flops_total']:.2e}")
    return {"params": n, "lora_params": n_lora, "budget": dict(zip(cols, rows))}
