"""The plan of a run with mesh.context reads the split: the sampler's per-device memory falls with it.

Two plans of the tiny GRPO recipe with 512-token sequences compiled for a v5e-8 slice, four data-parallel shards
each, one sequence per micro-batch: context 1 (four training devices; the sampler gets the other four) and context 2
(all eight). The sampler's temporaries per device (XLA's memory analysis of the compiled rollout) fall: its decode
cache is split along its length. mesh.context=0 chooses the split: 1 from the arithmetic bound alone where it fits,
else the smallest split whose plan fits.
"""

import json

from rlhf_jax.plan import plan_run
from rlhf_jax.plan.context import choose_context, unsplit_surely_fits, with_context
from rlhf_jax.plan.run import finalized
from rlhf_jax.train.passes import HEADROOM
from tests.train.helpers import load_recipe


def _plan(context: int):
    cfg = load_recipe("grpo")
    cfg.data.max_prompt_length = 16
    cfg.data.max_response_length = 496
    cfg.data.train_batch_size = 4
    cfg.actor_rollout_ref.rollout.n = 2
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    cfg.actor_rollout_ref.actor.use_kl_loss = False  # no reference pass: the update alone
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context = 4, 1, context
    cfg.mesh.rollout_devices = 0 if context == 2 else 4
    plan = plan_run(cfg, "v5e-8")
    return {p.name: p for p in plan.programs}


def test_the_sampler_needs_less_per_device_with_context_2():
    whole, split = _plan(1), _plan(2)
    assert "update_actor" in whole and "update_actor" in split
    # 2 slots per shard x 2 layers x keys and values x 2 kv heads x 16 x 512 columns x 4 bytes: 0.5 MiB, halved
    cache = 2 * 2 * 2 * 2 * 16 * 512 * 4
    assert whole["sampler"].temp_bytes - split["sampler"].temp_bytes >= cache / 2 * 0.5, (whole["sampler"],
                                                                                        split["sampler"])


LONG_MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _automatic(model_path: str, response: int):
    cfg = load_recipe("grpo")
    cfg.actor_rollout_ref.model.path = model_path
    cfg.data.max_prompt_length = 16
    cfg.data.max_response_length = response
    cfg.data.train_batch_size = 8
    cfg.actor_rollout_ref.rollout.n = 2
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    cfg.actor_rollout_ref.actor.use_kl_loss = False
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context = -1, 1, 0
    return cfg


def test_automatic_context_is_one_without_compiling_where_the_bound_fits():
    said = []
    context, plan = choose_context(_automatic("builtin:tiny", 112), progress=said.append)
    assert (context, plan) == (1, None)
    assert said == ["mesh.context=0 (automatic): 1 (one sequence's update surely fits a device unsplit)"]


def test_automatic_context_takes_the_smallest_split_that_fits(tmp_path):
    """A 4096-token sequence on the 8 test devices, with each device's memory set between what the update needs at
    context 1 and at context 2: the choice is 2 (data-parallel 4), after context 1 was planned and refused."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LONG_MODEL))
    cfg = _automatic(str(path), 4080)
    peaks = {c: max(p.peak_bytes for p in plan_run(with_context(cfg, c), None, stop_at_first_problem=False).programs)
             for c in (1, 2)}
    assert peaks[2] < 0.8 * peaks[1], peaks  # the update's activations split along the sequence
    usable = int((peaks[1] + peaks[2] / HEADROOM) / 2)
    said = []
    context, plan = choose_context(cfg, usable_bytes=usable, progress=said.append)
    assert context == 2 and plan.fits and plan.usable_bytes == usable, said
    assert any(line.startswith("mesh.context=1 does not fit: the update_actor pass needs") for line in said), said
    assert not unsplit_surely_fits(finalized(with_context(cfg, 1), 8, 1), usable)
