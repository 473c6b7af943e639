"""Loading under torchrun (infra/load.py load_sharded): 2 gloo ranks that build the model on the meta device
and fill only their own shards from the checkpoint hold, gathered, exactly the parameters one process
loads whole: the full fine-tuning policy and its reference, and a LoRA policy (bf16 base, adapters drawn
from the same seeded generator). Rows that do not split evenly over the ranks (vocabulary 101, MLP 75)
check the shard arithmetic; the logits of a forward pass check that FSDP2 computes from those values.
"""
import pytest
import torch

from tests.test_distributed import ROOT, launch

LOAD = """
import sys, torch
import tasks, train
from infra import hf, load, scale
from model import ModelConfig, Transformer

ckpt, out = sys.argv[1], sys.argv[2]
device = scale.init("cpu")
sft = None  # init_from is a checkpoint: nothing to train
x = torch.randint(0, 92, (2, 16), generator=torch.Generator().manual_seed(1))
result = {}
for name, dtype, extra in (("full", torch.float32, {}), ("lora", torch.bfloat16, dict(lora_rank=3, lora_alpha=6.0))):
    cfg = train.Config(init_from=ckpt, beta=0.01, seed=5, **extra)
    model, ref, tok, ids, _ = load.load_policy(cfg, device, dtype, sft)
    with torch.no_grad():
        logits = model(x[scale.shard_rows(2)])  # a sharded forward: FSDP2's lazy init re-pads the shards
    logits = scale.all_gather_rows(logits)
    result[name] = {
        "policy": scale.full_state_dict(model),
        "reference": "adapters off" if isinstance(ref, hf.AdaptersOff) and ref.policy is model else scale.full_state_dict(ref),
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "training": model.training, "logits": logits,
    }
if scale.rank() == 0:
    torch.save(result, out)
with scale.process_exit():  # leave the group and end the rank without interpreter teardown (gloo threads)
    pass
"""


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    import tasks
    from infra import toy
    from infra import hf
    from model import ModelConfig, Transformer

    tmp = tmp_path_factory.mktemp("sharded_load")
    tok = toy.build_tokenizer()
    vocab = tasks.model_config_overrides(tok) | {"vocab_size": 101}
    mc = ModelConfig(d_model=36, n_layers=2, n_heads=2, n_kv_heads=2, mlp_hidden_size=75, **vocab)
    ckpt = tmp / "ckpt"
    hf.save_pretrained(Transformer(mc).init_weights(torch.Generator().manual_seed(0)), ckpt, max_shard_bytes=20_000)
    tok.save(str(ckpt / "tokenizer.json"))
    script = tmp / "load.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + LOAD)
    results = []
    for nproc in (1, 2):
        out = tmp / f"{nproc}.pt"
        res = launch([str(ckpt), str(out)], nproc=nproc, script=str(script))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        results.append(torch.load(out))
    return results


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_sharded_full_fine_tuning_load_matches_one_process(loads):
    one, two = (r["full"] for r in loads)
    assert len(one["policy"]) == 2 + 9 * 2 + 1  # wte, ln_f, head; 9 tensors per block
    assert_same_tensors(one["policy"], two["policy"])
    assert_same_tensors(one["reference"], two["reference"])
    assert all(t.dtype == torch.float32 for t in two["policy"].values())  # float32 master weights
    assert one["requires_grad"] == two["requires_grad"] and all(two["requires_grad"].values())
    assert not one["training"] and not two["training"]
    assert torch.equal(one["logits"], two["logits"])


@pytest.mark.slow
def test_sharded_lora_load_matches_one_process(loads):
    one, two = (r["lora"] for r in loads)
    assert one["reference"] == two["reference"] == "adapters off"  # the policy with its adapters switched off
    assert_same_tensors(one["policy"], two["policy"])
    adapters = {k: v for k, v in two["policy"].items() if "lora_" in k}
    assert len(adapters) == 2 * 7 * 2 and all(v.dtype == torch.float32 for v in adapters.values())
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if k.endswith("lora_A"))  # drawn, not zeros
    assert two["policy"]["wte.weight"].dtype == torch.bfloat16
    assert one["requires_grad"] == two["requires_grad"]
    assert {k for k, g in two["requires_grad"].items() if g} == set(adapters)
    assert not two["training"]
    assert torch.equal(one["logits"], two["logits"])
