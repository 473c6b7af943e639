"""The 8B presets against the official MaskGRPO settings, value by value, with the source of each.

Sources (github.com/martian422/MaskGRPO): configs/rl.yaml (shared optimisation settings),
grpo/mask_grpo_train.py (LoRA targets), scripts/train/t2t_grpo_train.sh (text: LLaDA-8B-Instruct),
scripts/train/t2i_grpo_train.sh (images, preset mmada8b) and scripts/train/t2i_grpo_train_w_server.sh
(images, preset mmada8b_server); and d1's diffu-grpo/slurm_scripts/train.yaml (github.com/dllm-reasoning/d1,
preset d1_official). Their max_steps / save_steps count optimizer steps; a rollout batch here gives
mu optimizer steps, as in the official trainer, which draws a new batch every mu steps.

    python -m pytest tests/test_presets.py -q
"""
import train

OFFICIAL_MAX_STEPS = 8000    # configs/rl.yaml: max_steps
OFFICIAL_SAVE_STEPS = 500    # configs/rl.yaml: save_steps


def cfg(name):
    return train.Config(**train.PRESETS[name])


def test_shared_optimisation_settings():
    for name in ("llada8b", "mmada8b", "mmada8b_server", "d1_official"):
        c = cfg(name)
        assert c.lora_targets == "official"  # mask_grpo_train.py (and d1's diffu_grpo_train.py): Llama names;
                                             # only q/k/v/up_proj exist in LLaDA / MMaDA blocks
        assert c.lr == 3e-6              # configs/rl.yaml: learning_rate
    for name in ("llada8b", "mmada8b"):
        c = cfg(name)
        assert c.beta == 0.01            # configs/rl.yaml: beta
        assert c.clip_eps == 0.2         # configs/rl.yaml: epsilon
        assert c.lr == 3e-6              # configs/rl.yaml: learning_rate
        assert c.weight_decay == 0.1     # configs/rl.yaml: weight_decay (AdamW, betas 0.9 / 0.99)
        assert c.grad_clip == 0.2        # configs/rl.yaml: max_grad_norm
        assert (c.lora_rank, c.lora_alpha, c.lora_dropout) == (128, 64.0, 0.05)  # configs/rl.yaml: lora_r/alpha/dropout


def test_llada8b_text():
    c = cfg("llada8b")
    assert c.mu == 12                    # t2t_grpo_train.sh: --mu 12 (paper: mu = 12)
    assert c.gamma_text == 0.6                       # t2t_grpo_train.sh: --min_mask_rate 0.6
    assert c.text_reversing == "arlike"              # t2t_grpo_train.sh: --remasking arlike
    assert c.group_size == 6                         # t2t_grpo_train.sh: num_generations 6
    assert c.prompts_per_step * c.group_size == 96   # 8 GPUs x per-device 6 x gradient accumulation 2
    assert (c.gen_length, c.steps, c.block_length) == (256, 128, 16)  # t2t_grpo_train.sh: max_completion_length,
    assert c.temperature == 0.9                      # diffusion_steps, block_length; MaskGRPOConfig default temperature
    assert c.max_prompt_len == 256                   # configs/rl.yaml: max_prompt_length
    assert c.p_mask_prompt == 0.15                   # configs/rl.yaml: p_mask_prompt (d1 only)
    # Optimizer steps: within one rollout batch of the official 8000; checkpoints every ~500.
    assert abs(c.rl_steps * c.mu - OFFICIAL_MAX_STEPS) < c.mu
    assert abs(c.checkpoint_every * c.mu - OFFICIAL_SAVE_STEPS) < c.mu


def test_mmada8b_images():
    """mmada8b is scripts/train/t2i_grpo_train.sh with configs/rl.yaml, setting by setting."""
    c = cfg("mmada8b")
    assert c.mu == 6                     # t2i_grpo_train.sh: NUM_ITER=6
    assert c.gamma_image == 0.6                      # t2i_grpo_train.sh: --min_mask_rate 0.6
    assert c.group_size == 9                         # t2i_grpo_train.sh: ROLLOUTS = MULTI 3 x PER_DEVICE_BS 3
    assert c.prompts_per_step * c.group_size == 6 * 3 * 2  # NUM_PROCESS 6 x PER_DEVICE_BS 3 x ACCUMULATION 2
    assert c.cfg_scale == 3.0                        # t2i_grpo_train.sh: --cfg_scale 3.0
    assert c.clip_eps == 0.2 and c.beta == 0.01      # not overridden: configs/rl.yaml epsilon, beta
    assert (c.image_sampler, c.image_steps) == ("emerge", 12)  # MaskGRPO emerge sampler, 12 rollout steps
    assert c.image_width ** 2 == 1024                # 512 px images: 32 x 32 VQ tokens
    assert c.attend_padding == "auto"                # geneval: attention over [iPAD], as MMaDA's modelling code
    assert abs(c.rl_steps * c.mu - OFFICIAL_MAX_STEPS) < c.mu
    assert abs(c.checkpoint_every * c.mu - OFFICIAL_SAVE_STEPS) < c.mu


def test_mmada8b_server_images():
    """mmada8b_server is scripts/train/t2i_grpo_train_w_server.sh with configs/rl.yaml."""
    c = cfg("mmada8b_server")
    assert c.gamma_image == 0.8                      # w_server: MIN_MASK=0.8 (the paper's image gamma)
    assert c.group_size == 9                         # w_server: ROLLOUTS = MULTI 3 x PER_DEVICE_BS 3
    assert c.prompts_per_step * c.group_size == 6 * 3 * 4  # NUM_PROCESS 6 x PER_DEVICE_BS 3 x ACCUMULATION 4
    assert c.cfg_scale == 3.5                        # w_server: CFG=3.5
    assert c.clip_eps == 0.001                       # w_server: --epsilon 0.001
    assert c.beta == 0.01                            # configs/rl.yaml: beta
    assert c.mu == 12                    # NUM_ITER is commented out; configs/rl.yaml: mu 12
    assert abs(c.rl_steps * c.mu - OFFICIAL_MAX_STEPS) < c.mu
    assert abs(c.checkpoint_every * c.mu - OFFICIAL_SAVE_STEPS) < c.mu


def test_d1_official():
    """d1's own diffu-GRPO settings (dllm-reasoning/d1, diffu-grpo/slurm_scripts/train.yaml, gsm_base.sbatch)."""
    c = cfg("d1_official")
    assert c.estimator == "d1"
    assert c.beta == 0.04                            # train.yaml: beta
    assert c.clip_eps == 0.5                         # train.yaml: epsilon
    assert c.block_length == 32                      # train.yaml: block_length
    assert c.max_prompt_len == 200                   # train.yaml: max_prompt_length
    assert (c.gen_length, c.steps) == (256, 128)     # train.yaml: max_completion_length, diffusion_steps
    assert c.p_mask_prompt == 0.15                   # train.yaml: p_mask_prompt
    assert c.mu == 12                    # gsm_base.sbatch: NUM_ITER=12
    assert c.group_size == 6                         # train.yaml: num_generations
    assert c.prompts_per_step * c.group_size == 8 * 6 * 2  # accelerate_a100.yaml 8 processes x 6 x accumulation 2
    assert (c.lr, c.weight_decay, c.grad_clip) == (3e-6, 0.1, 0.2)  # train.yaml
