"""The plan of SFT and DPO runs: the trainers' programs compiled for TPU slices and GPU nodes without the hardware,
the plan's SFT step equal to the one the trainer compiles, and a run that cannot fit named by its keys."""

import json

import pytest

from rlhf_jax.plan import format_table, plan_run
from rlhf_jax.plan.report import memory_of
from rlhf_jax.train.sft import SFTTrainer
from tests.plan.test_plan import assert_stops_before_compiling
from tests.train.helpers import cpu_devices_flags, load_recipe, make_config, run_tool

PROGRAMS = {"sft": ["sft", "sft_apply", "validation"], "dpo": ["ref", "dpo_update", "val_policy", "val_ref"]}


@pytest.mark.parametrize("topology", ["v5e-8", "h100-8"])
@pytest.mark.parametrize("recipe", ["sft", "dpo"])
def test_every_program_of_the_default_recipe_compiles_for_the_target(recipe, topology):
    plan = plan_run(load_recipe(recipe), topology)
    assert [p.name for p in plan.programs] == PROGRAMS[recipe]
    for p in plan.programs:
        assert p.argument_bytes > 0 and p.output_bytes > 0 and p.peak_bytes > 0, p  # XLA's analysis for the target
    step = plan.programs[0 if recipe == "sft" else 1]  # the gradient step
    assert step.flops > 0 and step.roofline_s > 0, step
    assert step.source == ("xla" if topology == "v5e-8" else "model")  # GPU: no cost analysis
    assert plan.fits and plan.devices == 8 and plan.sampling_s is None
    in_step = [p for p in plan.programs if "not in the step" not in p.note]
    assert plan.step_s == pytest.approx(sum(p.roofline_s for p in in_step)) and plan.step_s > 0
    table = format_table(plan)
    assert f"plan for {topology}" in table and "all training, no sampler" in table and "fits" in table


def _padded_sft(tmp_path, **overrides):
    """The tiny SFT recipe, padded, with data.max_length=16: one prompt/response bucket (16, 16), so every batch has
    the widest shape the plan compiles for."""
    return make_config(str(tmp_path), recipe="sft", **{
        "algorithm.type": "sft", "data.max_length": 16, "data.train_batch_size": 8, "data.val_files": (),
        "data.train_files": ("builtin:arithmetic?max_value=4&train_size=32",), "custom_reward_function.path": None,
        "data.micro_batch_size_per_gpu": 1, "actor_rollout_ref.model.use_remove_padding": False, **overrides})


def test_local_plan_of_the_sft_step_is_the_program_the_trainer_runs(tmp_path):
    """8 CPU devices (data 2 x fsdp 2 x tensor 2): the plan over abstract parameters and the trainer's own step,
    compiled by the run for its first batch over the real weights, have the same XLA memory analysis."""
    cfg = _padded_sft(tmp_path)
    plan = plan_run(cfg, "local")
    step = next(p for p in plan.programs if p.name == "sft")
    trainer = SFTTrainer(cfg)
    try:
        trainer.step(0)  # the run compiles its step (jit on first call) and takes one optimizer step
        batch = trainer._device_batch(next(trainer.loader))  # every batch has this shape (one bucket)
        [jitted] = [fn for key, fn in trainer.actor._compiled.items() if key[0] == "train"]
        a = trainer.actor
        ran = memory_of(jitted.lower(a.params, a.frozen, a.opt_state, batch).compile())
    finally:
        trainer.close()
    assert batch.input_ids.shape == (8, 32) and batch.responses.shape == (8, 16)  # the plan's widest batch
    assert (step.argument_bytes, step.output_bytes, step.temp_bytes, step.alias_bytes) == ran, (step, ran)
    assert ran[0] > 0 and ran[2] > 0
    assert plan.micro_batches == {"sft": "1 sequences"} and plan.fits and plan.step_s is None  # CPU: no peak figures


def _wide_model(tmp_path) -> str:
    """config.json of a one-layer Llama with a wide MLP: its activations, not its weights, fill a device."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 16384,
        "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2}))
    return str(path)


def test_sft_step_too_large_for_v5e_8_stops_naming_the_keys(tmp_path):
    """128 packed rows of 512 tokens per device at once (micro_batch_size_per_gpu=-1): XLA's estimate for the step is
    beyond a v5e's 16 GiB; the trainers size no micro-batch automatically, so the plan names the keys."""
    cfg = load_recipe("sft")
    cfg.actor_rollout_ref.model.path = _wide_model(tmp_path)
    cfg.data.max_length, cfg.data.train_batch_size, cfg.data.val_files = 512, 1024, ()
    with pytest.raises(MemoryError) as e:
        plan_run(cfg, "v5e-8")
    line = str(e.value)
    assert "\n" not in line and line.startswith("the sft program needs about "), line
    assert "128 packed rows x 512 tokens" in line, line
    for key in ("data.micro_batch_size_per_gpu", "data.max_length", "mesh.fsdp"):
        assert key in line, line


def test_7b_full_fine_tuning_sft_on_v5e_8_stops_naming_the_keys():
    """Float32 weights and Adam moments of a 7B model on each of 8 x 16 GiB (data parallel): the plan stops before
    anything compiles."""
    proc = run_tool(
        "rlhf_jax.plan", "--config=configs/sft.py", "--topology=v5e-8",
        "--config.actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", "--config.mesh.data=-1",
        "--config.mesh.fsdp=1", "--config.data.train_batch_size=256", "--config.data.max_length=4096",
        "--config.data.micro_batch_size_per_gpu=32", timeout=300)
    assert_stops_before_compiling(proc)


def test_lora_dpo_reference_shares_the_base_and_is_not_counted_twice():
    """Under LoRA the reference is the base model over the actor's frozen arrays: the resident bytes are the actor's
    alone, and both the reference pass and the update compile for the target."""
    full, lora = load_recipe("dpo"), load_recipe("dpo")
    lora.actor_rollout_ref.model.lora_rank = 4
    full.data.val_files = lora.data.val_files = ()  # no validation passes: the step's programs only
    plans = {name: plan_run(cfg, "v5e-8") for name, cfg in (("full", full), ("lora", lora))}
    assert plans["lora"].resident_bytes < plans["full"].resident_bytes
    assert [p.name for p in plans["lora"].programs] == ["ref", "dpo_update"] and plans["lora"].fits


def test_padded_passes_for_a_tpu_slice_plan_from_a_one_device_process():
    """A plan run where JAX sees one device (the command on a laptop) compiles for the 8 devices of the target: the
    attention kernels, which run per device only inside a stated layout, are not chosen for DPO's padded passes over
    128 + 128 tokens (splash's shape) there either."""
    proc = run_tool("rlhf_jax.plan", "--config=configs/dpo.py", "--topology=v5e-8",
                    "--config.data.max_prompt_length=128", "--config.data.max_response_length=128",
                    "--config.data.val_files=()",
                    env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_devices_flags(1)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dpo_update" in proc.stdout and "fits" in proc.stdout, proc.stdout


@pytest.mark.parametrize("max_length", [16, 32, 100, 1024])
def test_widest_sft_batch_is_the_widest_any_prompt_and_response_give(max_length):
    """Against every split of data.max_length into a prompt and a response, each bucketed as the loader does."""
    from rlhf_jax.data.prompts import bucket_length, resolve_buckets
    from rlhf_jax.train.sft import widest_batch

    cfg = load_recipe("sft")
    cfg.data.max_length = max_length
    buckets = resolve_buckets(max_length, None)
    widths = {(bucket_length(p, buckets), bucket_length(r, buckets)) for p in range(1, max_length)
              for r in range(1, max_length - p + 1)}
    widest = max(p + r for p, r in widths)
    assert widest_batch(cfg) == max((w for w in widths if sum(w) == widest), key=lambda w: w[1])


@pytest.mark.parametrize("micro, per_shard", [(32, 4), (32, 5), (4, 32), (6, 7), (1, 8), (12, 12)])
def test_largest_packed_micro_batch_is_the_largest_the_packer_lays_out(micro, per_shard):
    from rlhf_jax.batch.packing import micro_layout
    from rlhf_jax.plan.supervised import largest_micro
    from rlhf_jax.train.passes import PassPlan

    plan = PassPlan("sft", True, 64, micro, per_shard, (), False)
    assert largest_micro(plan) == max(micro_layout(rows, micro)[1] for rows in range(1, per_shard + 1))
