"""The plan of a run with mesh.context reads the split: the sampler's per-device memory falls with it.

Two plans of the tiny GRPO recipe with 512-token sequences compiled for a v5e-8 slice, four data-parallel shards
each, one sequence per micro-batch: context 1 (four training devices; the sampler gets the other four) and context 2
(all eight). The sampler's temporaries per device (XLA's memory analysis of the compiled rollout) fall: its decode
cache is split along its length. mesh.context=0 chooses the split: 1 from the arithmetic bound alone where it fits,
else the smallest split whose plan fits.
"""

import json
import logging

import jax

from rlhf_jax.plan import plan_run
from rlhf_jax.plan.context import choose_context, parameter_share, unsplit_surely_fits, with_context
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


def test_automatic_context_is_one_without_compiling_where_the_bound_fits(caplog):
    said = []
    with caplog.at_level(logging.INFO, logger="rlhf_jax.plan.context"):
        context, plan = choose_context(_automatic("builtin:tiny", 112), progress=said.append)
    assert (context, plan) == (1, None)
    assert said == []  # nothing planned, nothing printed: the common case stays quiet
    assert "mesh.context=0 (automatic): 1 (one sequence's update surely fits a device unsplit)" in caplog.messages


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
    assert not unsplit_surely_fits(finalized(with_context(cfg, 1), 8, 1), usable, jax.devices())


# SmolLM2-135M's shape (no weights are read: the bound and the share come from config.json)
SMOLLM2_SHAPE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
                 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                 "tie_word_embeddings": True}


def test_the_bound_counts_each_devices_share_of_the_parameters(tmp_path):
    """Resident parameters and optimizer state count at the share the mesh gives a device: SmolLM2 over fsdp=8
    holds an eighth of each array (every dimension it shards divides by 8), data=8 a whole copy. With the memory
    set between the two needs, the sharded run is surely unsplit and the replicated one is not."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMOLLM2_SHAPE))
    cfg = _automatic(str(path), 112)
    by_mesh = {}
    for name, (data, fsdp) in {"replicated": (8, 1), "fsdp": (1, 8)}.items():
        cfg.mesh.data, cfg.mesh.fsdp = data, fsdp
        by_mesh[name] = finalized(with_context(cfg, 1), 8, 1)
    shares = {name: parameter_share(c, jax.devices()) for name, c in by_mesh.items()}
    assert shares["replicated"] == 1.0
    assert abs(shares["fsdp"] - 1 / 8) < 0.01, shares  # norms' vectors are whole: a little above an eighth
    params = 134_515_008  # SmolLM2-135M's count
    # resident float32 state (20 bytes a parameter) and the update's gradients (16): half of it unsharded
    usable = int(36 * params * 0.5 / HEADROOM)
    assert unsplit_surely_fits(by_mesh["fsdp"], usable, jax.devices())
    assert not unsplit_surely_fits(by_mesh["replicated"], usable, jax.devices())


def test_processes_that_choose_differently_all_stop_when_one_finds_no_split(tmp_path):
    """Two processes over gloo: the first has plenty of memory (the bound says 1), the second too little for any
    split (its unsplit plan stops at the resident arrays, which no split shrinks). Both stop with an error line instead of one of them building
    a run the other never joins."""
    import os

    from tests.cli_zygote import popen_module
    from tests.train.helpers import REPO, cpu_devices_flags
    from tests.parallel.rehearsal import free_port

    port = free_port()
    procs = [popen_module("tests.plan.agree_context", [str(usable)], cwd=REPO,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(4),
                                   RLHF_JAX_COORDINATOR=f"127.0.0.1:{port}", RLHF_JAX_NUM_PROCESSES="2",
                                   RLHF_JAX_PROCESS_ID=str(i)),
                          stdout=str(tmp_path / f"{i}.out"), stderr=str(tmp_path / f"{i}.err"))
             for i, usable in enumerate((0, 2**20))]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], [err[-2000:] for _, err in outs]
    # gloo's C++ code prints its "[Gloo] Rank ... connected" lines to the same stdout, unsynchronized with Python's
    errors = [[line[line.index("error:"):] for line in out.splitlines() if "error:" in line] for out, _ in outs]
    assert all(errors), outs
    first, second = (found[-1] for found in errors)
    assert first == ("error: mesh.context=0 (automatic): process 1 found no split that fits its host's free memory; "
                     "set mesh.context"), first
    # the resident arrays alone do not fit: no split shrinks them, so the unsplit plan's own line is passed on
    assert second.startswith("error: parameters and optimizer state alone need "), second
