"""One RL step (train.rl_step) for every case of tests/test_distributed.py's world-size matrix, in one process
or under torchrun: `python tests/world_matrix.py CKPT OUT ROLLOUTS` (records the rollouts in ROLLOUTS), then
`torchrun --nproc_per_node=2 tests/world_matrix.py CKPT OUT2 ROLLOUTS` (replays them).

Each case loads the policy from CKPT as train.main does (infra/load.load_policy: FSDP2 under torchrun), takes
one rl_step at step 0 and writes on rank 0 OUT/<case>.pt: every parameter's change (the sum of the mu
updates, full tensors), and the step's log. The optimizer is plain SGD, so a parameter's change is linear in
the gradients (AdamW's first step is about lr * sign(g), blind to a gradient scaled by a constant), with
--grad_clip far above the norm except in one case.

Rollouts: ranks sample their own rows, and float32 kernels of other row counts round differently, which can
flip a near-tie and one token; the sampler's world-size independence is test_two_processes_match_one's. Here
the one-process run records its rollouts (ROLLOUTS) and the torchrun run replays them (its own samples
are replaced row by row, by global index, and the number of tokens that differed is logged), so the two runs
update on the same sequences and compare the update alone. Rewards are a fixed function of the tokens.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402
from infra import load, scale  # noqa: E402

# (name, flags): every estimator, both loss norms, LoRA on and off, device_batch_size splitting a rank's 4
# rows (3: chunks of 3 and 1), mu = 3 everywhere, --trajectory_states at K < T (text T = 12, image T = 4).
CASES = [
    ("maskgrpo", []),
    ("maskgrpo_seq_dbs", ["--loss_norm=sequence", "--device_batch_size=3"]),
    ("maskgrpo_lora", ["--lora_rank=4", "--lora_alpha=8"]),
    ("maskgrpo_clip", ["--grad_clip=0.05", "--device_batch_size=2"]),  # the clip binds: the global norm
    ("d1", ["--estimator=d1"]),
    ("d1_lora_seq", ["--estimator=d1", "--lora_rank=4", "--lora_alpha=8", "--loss_norm=sequence"]),
    ("unigrpo", ["--estimator=unigrpo", "--device_batch_size=3"]),
    ("trajectory", ["--estimator=trajectory"]),
    ("trajectory_k", ["--estimator=trajectory", "--trajectory_states=3"]),
    ("trajectory_k_dbs", ["--estimator=trajectory", "--trajectory_states=2",
                              "--device_batch_size=3"]),
    ("trajectory_k_lora", ["--estimator=trajectory", "--trajectory_states=3", "--lora_rank=4", "--lora_alpha=8",
                           "--device_batch_size=2"]),
]
BASE = ["--preset=smoke", "--threads=1", "--prompts_per_step=2", "--group_size=4", "--mu=3",
        "--lr=0.05", "--grad_clip=1e6", "--beta=0.05", "--cfg_scale=1.5"]


def score(b, verify, tok, ids, scorer=None):
    """A reward in {0, 0.5, 1} from the window's tokens: a random model's groups then carry signal."""
    return (b.x[:, b.window_slice].sum(1) % 3).float() / 2


def main(ckpt: str, out: str, rollouts: str, only: str = "") -> None:
    device = scale.init("cpu")
    torch.set_num_threads(1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = scale.world() == 1
    recorded = {} if record else torch.load(rollouts)
    real_rollout = train.rollout
    tasks.score = score
    for name, flags in CASES:
        if only and name != only:
            continue
        cfg = train.parse_args(BASE + [f"--init_from={ckpt}", f"--out_dir={out / name}", *flags])
        policy, ref, tok, ids, _ = load.load_policy(cfg, device, torch.float32, sft=None)
        params = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=cfg.lr)
        before = {k: v.clone() for k, v in scale.full_state_dict(policy).items()}
        differed = torch.zeros(())

        def rollout(model, prompts, ctx, gens, temperature, text_sampler=None):
            nonlocal differed
            b, order = real_rollout(model, prompts, ctx, gens, temperature, text_sampler)
            key = (name, b.task)
            if record:
                recorded[key] = (b.x.clone(), order.clone())
                return b, order
            x, o = (t[b.index] for t in recorded[key])
            differed = differed + (x != b.x).sum()
            b.x.copy_(x)
            return b, o.clone()

        train.rollout = rollout
        ctx = tasks.Ctx(cfg, tok, ids, device, {})
        log, _ = train.rl_step(policy, ref, opt, ctx, 0, tasks.step_prompts(ctx, 0))
        train.rollout = real_rollout
        after = scale.full_state_dict(policy)
        differed = scale.all_sum(differed)
        if scale.rank() == 0:
            delta = {k: after[k] - before[k] for k in after}
            log = {k: v for k, v in log.items() if not k.endswith("_s")}
            torch.save({"delta": delta, "log": log, "differed": int(differed)}, out / f"{name}.pt")
        del policy, ref, opt
    if record:
        torch.save(recorded, rollouts)


if __name__ == "__main__":
    with scale.process_exit():
        main(*sys.argv[1:])
