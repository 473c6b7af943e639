"""LoRA adapters for the LLaDA Transformer: add, switch off for the reference policy, save, load, merge.

LoRA (Hu et al., arXiv:2106.09685) freezes a pretrained weight W (out, in) and learns a low-rank update,
y = W x + (alpha / r) * B A x, with A (r, in) random and B (out, r) zero, so training starts exactly at the
base model. MaskGRPO trains LLaDA-8B this way (r 128, alpha 64, dropout 0.05 in its released config), and
its reference policy is the same network with the adapters switched off, so no second 8B copy is held.
TARGET_SETS below names the two choices (Config.lora_targets): "all", the seven block projections with
LLaDA's own names, or "official", the four that the official recipe's Llama-named list actually matched in
LLaDA and MMaDA (docs/differences.md, "LoRA targets").

    model = add_lora(hf.from_pretrained(path), rank=128, alpha=64)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=3e-6)
    with adapters_disabled(model): ref_logits = model(x)   # pi_ref; AdaptersOff(model)(x) is the same
    save_adapters(model, "out/adapters"); hf.save_pretrained(merge_lora(model), "out/merged")
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# The seven nn.Linear of a LLaDA "llama" block. The top-level LM head is also
# called `ff_out`; add_lora only looks inside `model.blocks`, so the head is never matched by this name.
# At LLaDA-8B and r = 128 all seven give 335,544,320 adapter parameters (4.2%), ~5.4 GB as float32 with
# grads and AdamW state.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
# The official run (martian422/MaskGRPO, grpo/mask_grpo_train.py) lists Llama names, q/k/v/o/up/down/gate_proj;
# peft matches module names, so in a LLaDA/MMaDA block (attn_out, ff_proj, ff_out) only these four exist:
# 167,772,160 adapter parameters at LLaDA-8B and r = 128, half of the seven.
OFFICIAL_TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj")
TARGET_SETS = {"all": LORA_TARGETS, "official": OFFICIAL_TARGETS}
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapters.safetensors", "adapters.json"


def _check_hparams(rank, alpha, dropout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank ({rank!r}) must be an integer >= 1; the official recipe uses rank=128")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha ({alpha!r}) must be > 0: it sets the update scale alpha / rank; "
                         "the official recipe uses alpha=64")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout ({dropout!r}) must be in [0, 1); use 0.0 to switch it off")


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank adapter. It adopts the base layer's own `weight` Parameter (no copy), so
    base state-dict keys stay `blocks.N.q_proj.weight`; the adapter adds `lora_A` (r, in), `lora_B` (out, r).

    The adapter parameters are float32 even when the base is bf16: AdamW's small steps (lr 3e-6) would be
    lost to bf16's 2^-8 spacing. The forward casts them to the input dtype, the same
    "weight follows the activation" rule as the rest of the model , so one code path runs
    float32 on CPU and bf16 on CUDA, and the gradient still lands in the float32 parameters.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None):
        _check_hparams(rank, alpha, dropout)
        # nn.Linear.__init__ would allocate and initialise a second weight (50M floats for an 8B ff_out);
        # on the meta device that costs nothing, and the base Parameters replace it just below.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.lora_dropout = rank, alpha, dropout
        self.scaling = alpha / rank  # LoRA arXiv:2106.09685 §4.1: dividing by r keeps the update size stable across ranks
        self.disabled = False        # True: behave exactly as the base layer (the reference policy)
        self.train(base.training)    # a new module starts in train mode; follow the layer it replaces
        # A is drawn on the CPU in float32 and then moved, so a CPU and a CUDA run get the same A. The
        # distribution is kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(in)), which is what the official run got
        # from peft. The paper uses a Gaussian; what matters is A's scale, which with Adam sets how far
        # the first updates of B move the output, so we keep the one the published hyperparameters used.
        bound = 1.0 / math.sqrt(base.in_features)
        a = torch.rand(rank, base.in_features, generator=generator, dtype=torch.float32) * 2 - 1  # (r, in)
        dev = base.weight.device
        self.lora_A = nn.Parameter((a * bound).to(dev))
        # B = 0 makes the update exactly zero, so the adapted model starts equal to the base (LoRA §4.1).
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32, device=dev))

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)                                  # (..., out)
        if self.disabled:
            return y
        # Dropout on the adapter input only (LoRA as in peft), from the global RNG on purpose: activation
        # checkpointing replays only the default CPU/CUDA generators, so a private generator would draw a
        # different mask in the recompute and give wrong gradients. train.py seeds the global RNG.
        h = F.dropout(x, self.lora_dropout, self.training)
        h = F.linear(h, self.lora_A.to(x.dtype)) * self.scaling                  # (..., r)
        return y + F.linear(h, self.lora_B.to(x.dtype))                          # (..., out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, dropout={self.lora_dropout}"


def _adapted(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets=LORA_TARGETS,
             generator: torch.Generator | None = None) -> nn.Module:
    """Replace the nn.Linear children of `model.blocks[i]` named in `targets` by LoRALinear, freeze every
    other parameter, and return the model (modified in place). Call before any FSDP wrap or optimizer.
    `generator` draws every lora_A (default: a fresh generator seeded 0, never the global RNG)."""
    _check_hparams(rank, alpha, dropout)
    # A lone string is one name, not a list of characters; duplicates would wrap a layer twice.
    targets = tuple(dict.fromkeys((targets,) if isinstance(targets, str) else targets))
    if _adapted(model):
        raise ValueError("model already has LoRA adapters; merge_lora(model) first to stack a new set")
    available = sorted({n for b in model.blocks for n, m in b.named_children() if isinstance(m, nn.Linear)})
    unknown = [t for t in targets if t not in available]
    if unknown or not targets:
        raise ValueError(f"LoRA targets {unknown or targets} match no nn.Linear in model.blocks; "
                         f"available names are {available}")
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.requires_grad_(False)
    # Fixed order (block, then target) so a given seed always gives the same A to the same layer.
    for block in model.blocks:
        for name in targets:
            setattr(block, name, LoRALinear(getattr(block, name), rank, alpha, dropout, generator))
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters to hand to the optimizer (after add_lora: only lora_A and lora_B)."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_stats(model: nn.Module) -> dict:
    """Counts for a startup log line: adapted modules, adapter and total parameters, adapter fraction."""
    n_lora = sum(m.lora_A.numel() + m.lora_B.numel() for _, m in _adapted(model))
    n_total = sum(p.numel() for p in model.parameters())
    return {"modules": len(_adapted(model)), "lora_params": n_lora, "total_params": n_total,
            "lora_fraction": n_lora / n_total}


@contextmanager
def adapters_disabled(model: nn.Module):
    """Run the base model (the GRPO reference policy) inside the block; each adapter's
    previous on/off state comes back afterwards, also when the block raises."""
    modules = [m for _, m in _adapted(model)]
    before = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield model
    finally:
        for m, state in zip(modules, before):
            m.disabled = state


class AdaptersOff(nn.Module):
    """The reference policy of a LoRA run: the policy itself, called with its adapters switched off, so no
    second copy of the base model is held (MaskGRPO's setup). Other attributes are the policy's."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.policy, name)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed like the model's state dict (`blocks.0.q_proj.lora_A`)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def save_adapters(model: nn.Module, path) -> None:
    """Write `path/adapters.safetensors` (the lora tensors) and `path/adapters.json` (rank, alpha, ...)."""
    from safetensors.torch import save_file

    mods = _adapted(model)
    if not mods:
        raise ValueError("model has no LoRA adapters to save; call add_lora(model, ...) first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in lora_state_dict(model).items()},
              str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    m = mods[0][1]
    config = {"rank": m.rank, "alpha": m.alpha, "dropout": m.lora_dropout,
              "targets": sorted({n.rsplit(".", 1)[-1] for n, _ in mods})}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    from infra.hf import same_mode

    same_mode(path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG)  # safetensors writes 0600; the rest is umask


def load_adapters(model: nn.Module, path) -> nn.Module:
    """Load adapters written by save_adapters. A model without adapters gets them first (add_lora with the
    saved rank/alpha/dropout/targets); an adapted model must match the saved names, shapes and alpha."""
    from safetensors.torch import load_file

    path = Path(path)
    for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path / f} not found; pass the directory written by save_adapters")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if not _adapted(model):
        add_lora(model, config["rank"], config["alpha"], config["dropout"], config["targets"])
    saved, ours = load_file(str(path / ADAPTER_WEIGHTS)), lora_state_dict(model)
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing or unexpected:
        raise ValueError(f"adapters in {path} do not fit this model: {len(missing)} missing {missing[:6]}, "
                         f"{len(unexpected)} unexpected {unexpected[:6]}; were they trained with other targets "
                         "or another n_layers?")
    bad = [f"{k}: saved {tuple(saved[k].shape)} vs model {tuple(v.shape)}" for k, v in ours.items()
           if saved[k].shape != v.shape]
    if bad:
        raise ValueError(f"adapter shapes in {path} differ (another rank?): {bad[:4]}")
    alphas = {m.alpha for _, m in _adapted(model)}
    if alphas != {config["alpha"]}:
        raise ValueError(f"saved alpha {config['alpha']} differs from the model's {sorted(alphas)}; the "
                         "update would be rescaled, so rebuild the adapters with the saved alpha")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, t in saved.items():
            params[k].copy_(t)  # keeps each parameter's own dtype (float32) and device
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, W <- W + (alpha / r) B A, and swap each LoRALinear back
    to a plain nn.Linear, so `hf.save_pretrained(model, dir)` writes exactly the original LLaDA key set.

    The product is formed in float32 and rounded once to the weight dtype. With bf16 weights, update
    entries below half of W's bf16 spacing vanish in the rounding, so keep save_adapters' output as the
    exact record of the trained policy. Adapters are folded even if switched off; the result stays frozen."""
    for name, m in _adapted(model):
        parent, child = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        delta = m.scaling * (m.lora_B.float() @ m.lora_A.float())                 # (out, in)
        m.weight.copy_((m.weight.float() + delta).to(m.weight.dtype))
        with torch.device("meta"):  # as in LoRALinear.__init__: adopt the Parameters, allocate nothing
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        plain.weight, plain.bias = m.weight, m.bias
        plain.train(m.training)
        setattr(parent, child, plain)
    return model
