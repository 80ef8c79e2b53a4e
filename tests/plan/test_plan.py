"""The plan command: every program of a run compiled for TPU slices and GPU nodes without the hardware, its memory
against the chip, a run that cannot fit named by its keys, and the CPU prediction against a measured run.

Needs the compile dependencies of the ``accelerators`` extra (libtpu, the CUDA plugin, ptxas), which the ``test``
extra installs.
"""

import json
import os
import subprocess
import sys

import pytest

from rlhf_jax.plan import TARGETS, format_table, plan_run
from rlhf_jax.plan.targets import target
from tests.train.helpers import cpu_devices_flags, load_recipe, make_config, run_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("topology", ["v5e-8", "h100-8"])
def test_every_program_of_the_default_run_compiles_for_the_target(topology):
    plan = plan_run(load_recipe("grpo"), topology)
    names = [p.name for p in plan.programs]
    # configs/grpo.py: GRPO with a KL loss, one mini-batch (no old-log-prob pass), no critic
    assert names == ["sampler", "ref", "update_actor"], names
    for p in plan.programs:
        assert p.argument_bytes > 0 and p.output_bytes > 0, p  # XLA's memory analysis of the executable for the target
        assert p.flops and p.flops > 0 and p.roofline_s > 0, p
    assert plan.fits and plan.devices == 8
    assert plan.programs[1].source == ("xla" if topology == "v5e-8" else "model")  # GPU: no cost analysis
    table = format_table(plan)
    assert f"plan for {topology}" in table and "update_actor" in table and "fits" in table


def test_lora_ppo_with_rollout_devices_compiles_merge_copy_critic_and_values():
    cfg = load_recipe("grpo")
    cfg.algorithm.adv_estimator = "gae"
    cfg.critic.enable = True
    cfg.actor_rollout_ref.model.lora_rank = 4
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8  # two mini-batches: old log-probs are recomputed
    cfg.mesh.rollout_devices = 4
    plan = plan_run(cfg, "v6e-8")
    names = [p.name for p in plan.programs]
    assert names == ["lora_merge", "rollout_copy", "sampler", "old_log_prob", "ref", "values", "update_critic",
                     "update_actor"], names
    assert plan.devices == 8 and plan.fits
    copy = plan.programs[1]
    assert copy.argument_bytes == copy.peak_bytes > 0  # the sampler's weights on each rollout device


def test_two_host_slice_compiles():
    plan = plan_run(load_recipe("grpo"), "v5p-16")
    assert plan.devices == 8 and TARGETS["v5p-16"].hosts == 2 and plan.fits


def test_a_split_run_plans_sampling_on_the_last_host_and_moves_only_adapters_under_lora():
    """mesh.rollout_processes=1 on a two-host slice: the sampler's programs (the LoRA merge into the sampling
    side's own base weights, the weights it holds, the sampler) on the second host's devices, training on the
    first's."""
    from rlhf_jax.plan import programs
    from rlhf_jax.plan.run import finalized
    from rlhf_jax.plan.targets import target_devices

    cfg = load_recipe("grpo")
    cfg.mesh.rollout_processes = 1
    cfg.experience.overlap = True
    cfg.actor_rollout_ref.model.lora_rank = 4
    devices = target_devices(target("v5p-16"))
    train, sampling, _ = programs.meshes(finalized(cfg.copy_and_resolve_references(), 8, 2), devices)
    assert {d.process_index for d in train.devices.flat} == {0} and train.devices.size == 4
    assert {d.process_index for d in sampling.devices.flat} == {1} and sampling.devices.size == 4
    plan = plan_run(cfg, "v5p-16")
    names = [p.name for p in plan.programs]
    assert names[:3] == ["lora_merge", "rollout_copy", "sampler"] and plan.fits, names
    assert "adapters sent to the 4 devices of the sampling processes" in plan.programs[1].note


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown topology 'v9-8'; known: v5e-8, v5p-8"):
        target("v9-8")
    proc = run_tool("rlhf_jax.plan", "--topology=v9-8", timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: unknown topology 'v9-8'; known: ") and "h200-8" in lines[-1]


def test_7b_full_fine_tuning_on_v5e_8_stops_naming_the_keys():
    """Float32 weights and Adam moments of a 7B model over 8 x 16 GiB: the run stops before anything compiles."""
    proc = run_tool(
        "rlhf_jax.plan", "--config=configs/grpo.py", "--topology=v5e-8",
        "--config.actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", "--config.mesh.data=1",
        "--config.mesh.fsdp=-1", "--config.data.train_batch_size=64", "--config.actor_rollout_ref.rollout.n=8",
        "--config.actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "--config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", timeout=300)
    assert_stops_before_compiling(proc)


def assert_stops_before_compiling(proc) -> None:
    """The plan command stopped on the resident arrays alone, in one line naming the keys that shrink them."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: parameters and optimizer state alone need "), last
    for key in ("mesh.fsdp", "actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.dtype"):
        assert key in last, last
    assert proc.stdout == ""


def test_cpu_plan_of_the_smollm2_update_is_within_25_percent_of_a_measured_run(smollm2_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(1))
    proc = subprocess.run([sys.executable, "-m", "tests.plan.measure_update", smollm2_dir], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    predicted, measured = result["predicted"], result["measured"]
    assert measured > 2**28, result  # the pass really ran: parameters, optimizer state and activations
    assert abs(predicted - measured) <= 0.25 * measured, result


def test_a_compilers_out_of_memory_refusal_counts_as_not_fitting():
    from rlhf_jax.train.passes import compiled_need, refused_bytes

    refusal = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                           "temporaries (96.99G) exceeds available HBM (95.74G).")
    assert refused_bytes(refusal) == int(96.99 * 2**30)
    assert refused_bytes(RuntimeError("INTERNAL: something else")) is None

    def refuse():
        raise refusal

    assert compiled_need(refuse, lambda c: 0, free=2**30) == int(96.99 * 2**30)
    assert compiled_need(refuse, lambda c: 0, free=200 * 2**30) == 200 * 2**30 + 1  # always more than is free
    with pytest.raises(ValueError):
        compiled_need(lambda: (_ for _ in ()).throw(ValueError("bad")), lambda c: 0, free=1)


def test_gpu_usable_memory_is_jaxs_allocation_fraction(monkeypatch):
    h100 = TARGETS["h100-8"].chip
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert h100.usable_bytes("cuda") == int(0.75 * h100.hbm_bytes)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert h100.usable_bytes("cuda") == int(0.9 * h100.hbm_bytes)
    assert TARGETS["v5p-8"].chip.usable_bytes("tpu") == 95 * 2**30


def _offloaded(on: bool):
    cfg = load_recipe("grpo")
    for key in ("param_offload", "optimizer_offload"):
        cfg.actor_rollout_ref.actor.fsdp_config[key] = on
    cfg.actor_rollout_ref.ref.fsdp_config.param_offload = on
    return cfg


def test_offloaded_parameters_and_optimizer_state_are_planned_as_host_memory():
    """v5e-8: the actor's parameters and optimizer state and the reference's parameters leave the resident device
    bytes for host memory; the programs take them from host memory (XLA counts them as host arguments, not device
    ones) and hold a device copy only while they run."""
    on_device, offloaded = plan_run(_offloaded(False), "v5e-8"), plan_run(_offloaded(True), "v5e-8")
    assert on_device.host_bytes == 0 < on_device.resident_bytes
    assert offloaded.resident_bytes == 0 and offloaded.host_bytes == on_device.resident_bytes
    before, after = ({p.name: p for p in plan.programs} for plan in (on_device, offloaded))
    for name in ("ref", "update_actor"):
        assert after[name].argument_bytes < before[name].argument_bytes, name
    # the update's device arguments lose the parameters (its gradient accumulator stays on the devices)
    assert before["update_actor"].argument_bytes - after["update_actor"].argument_bytes >= offloaded.host_bytes // 3
    assert after["sampler"].peak_bytes > 0 and offloaded.fits
    assert "in host memory per device" in format_table(offloaded)
    assert "in host memory" not in format_table(on_device)


def test_offload_compiles_for_a_gpu_node():
    plan = plan_run(_offloaded(True), "h100-8")  # compile-only GPU devices have no host memory kind: planned as device
    assert [p.name for p in plan.programs] == ["sampler", "ref", "update_actor"] and plan.fits


def test_lora_on_a_moe_model_plans_locally(hf_checkpoint, tmp_path):
    """LoRA on a tiny Qwen3-MoE (8 CPU devices: fsdp 2 x tensor 2 x expert 2): the merge of the per-expert adapters,
    the sampler and the adapters' update compile."""
    path, _ = hf_checkpoint("qwen3_moe")
    cfg = make_config(str(tmp_path), "grpo", **{"actor_rollout_ref.model.path": path,
                                                "actor_rollout_ref.model.lora_rank": 4, "mesh.data": 1, "mesh.expert": 2})
    plan = plan_run(cfg, "local")
    names = [p.name for p in plan.programs]
    assert names[0] == "lora_merge" and "update_actor" in names, names
    assert plan.fits and all(p.argument_bytes > 0 for p in plan.programs)
