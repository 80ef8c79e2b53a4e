"""verl's own configuration files load; verl's other key names are honoured; features we lack are refused by name."""

import logging
import os

import pytest

from rlhf_jax.config import load_config_from_argv, load_yaml

VERL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl")
GENERATED, LEGACY = os.path.join(VERL, "_generated_ppo_trainer.yaml"), os.path.join(VERL, "legacy_ppo_trainer.yaml")


def _ignored_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "are ignored:" in r.getMessage()]


@pytest.mark.parametrize("path", [GENERATED, LEGACY])
def test_verl_files_load_with_one_warning(path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        cfg = load_yaml(path)
    warnings = _ignored_warnings(caplog)
    assert len(warnings) == 1 and path in warnings[0]
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in warnings[0]
    assert cfg.trainer.logger == ("console", "wandb")
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq) == (-1, -1)
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.data.train_max_samples == -1 and cfg.actor_rollout_ref.actor.grad_clip == 1.0
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == cfg.actor_rollout_ref.actor.checkpoint.save_contents


def test_generated_file_references_resolve():
    cfg = load_yaml(GENERATED)
    # ${oc.select:data.max_response_length,512} and ${.ppo_max_token_len_per_gpu} (relative).
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "constant"  # from optim.lr_scheduler_type


def test_command_line_overrides_reach_the_files_references():
    argv = ["prog", f"--config={GENERATED}", "--config.actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "--config.data.max_response_length=8"]
    cfg = load_config_from_argv(argv)
    assert cfg.critic.ppo_mini_batch_size == 2  # ${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}
    assert cfg.actor_rollout_ref.rollout.response_length == 8


def test_fsdp_engine_dtype_is_the_compute_dtype():
    # verl's generated file: bfloat16 mixed precision over float32 parameters, for actor, reference and critic
    cfg = load_yaml(GENERATED)
    assert (cfg.actor_rollout_ref.model.compute_dtype, cfg.actor_rollout_ref.model.dtype) == ("bfloat16", "float32")
    text = "actor_rollout_ref:\n  actor:\n    fsdp_config: {dtype: float32}\n  ref:\n    fsdp_config: {dtype: %s}\n"
    assert load_yaml(text % "float32").actor_rollout_ref.model.compute_dtype == "float32"
    with pytest.raises(ValueError, match=r"ref\.fsdp_config\.dtype='bfloat16' differs from "
                                         r"actor_rollout_ref\.model\.compute_dtype='float32'"):
        load_yaml(text % "bfloat16")
    # the command line's compute dtype decides for every copy in the file
    argv = ["prog", f"--config={GENERATED}", "--config.actor_rollout_ref.model.compute_dtype=float32"]
    assert load_config_from_argv(argv).actor_rollout_ref.model.compute_dtype == "float32"
    with pytest.raises(ValueError, match=r"reward_model\.model\.fsdp_config\.dtype='bfloat16' is not supported"):
        load_yaml("reward_model:\n  model:\n    fsdp_config: {dtype: bfloat16}\n")


def test_other_names_set_schema_keys():
    cfg = load_yaml("actor_rollout_ref:\n  actor:\n    optim:\n      clip_grad: 0.5\n      lr_scheduler_type: cosine\n"
                    "reward_manager:\n  name: prime\n")
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine"
    assert cfg.reward_model.reward_manager == "prime"
    with pytest.raises(ValueError, match=r"optim\.clip_grad=0\.5 and actor_rollout_ref\.actor\.grad_clip=1\.0"):
        load_yaml("actor_rollout_ref:\n  actor:\n    grad_clip: 1.0\n    optim:\n      clip_grad: 0.5\n")


def test_dapo_overlong_buffer_cfg_is_honoured():
    dapo = """
data: {max_response_length: 20}
reward_model:
  reward_manager: naive
  reward_kwargs:
    overlong_buffer_cfg: {enable: True, len: 4, penalty_factor: 0.5, log: False}
    max_resp_len: ${data.max_response_length}
"""
    cfg = load_yaml(dapo)
    ob = cfg.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4, 0.5)
    with pytest.raises(ValueError, match=r"max_resp_len=16 differs from data\.max_response_length=20"):
        load_yaml(dapo.replace("${data.max_response_length}", "16"))
    with pytest.raises(ValueError, match=r"unknown config key 'reward_model\.reward_kwargs\.format_bonus'"):
        load_yaml("reward_model:\n  reward_kwargs:\n    format_bonus: 1.0\n")


@pytest.mark.parametrize("text,key", [
    ("data:\n  custom_cls:\n    path: my_dataset.py\n    name: MyDataset\n", r"data\.custom_cls"),
    ("data:\n  sampler:\n    class_path: my_sampler.py\n    class_name: S\n", r"data\.sampler"),
    ("reward_model:\n  sandbox_fusion:\n    url: http://localhost:8080/run\n", r"reward_model\.sandbox_fusion"),
    ("actor_rollout_ref:\n  actor:\n    router_replay: {mode: R2, record_file: routes.pt}\n", r"record_file"),
    ("trainer:\n  del_local_ckpt_after_load: True\n", r"trainer\.del_local_ckpt_after_load"),
    ("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      offload_policy: True\n",
     r"offload_policy=True is not supported by rlhf_jax \(FSDP2's CPU offload policy"),
    ("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      mixed_precision: {param_dtype: bf16}\n",
     r"mixed_precision.*compute_dtype"),
    ("actor_rollout_ref:\n  rollout:\n    agent:\n      agent_loop_config_path: loops.yaml\n", r"rollout\.agent"),
    ("reward_model:\n  launch_reward_fn_async: True\n", r"launch_reward_fn_async.*reward_manager=prime"),
    ("actor_rollout_ref:\n  actor:\n    profiler: {enable: True, tool: nsys}\n", r"profiler.*trainer\.profile_steps"),
    # a mapping of real settings without an enable switch is on, not off
    ("actor_rollout_ref:\n  model:\n    mtp: {num_layers: 2}\n", r"model\.mtp"),
    ("critic:\n  model:\n    tokenizer_path: /elsewhere/tok\n", r"critic\.model\.tokenizer_path='/elsewhere/tok' differs"),
    ("actor_rollout_ref:\n  model:\n    external_lib: my_models\n", r"external_lib"),
    ("actor_rollout_ref:\n  model:\n    override_config: {attention_dropout: 0.1}\n", r"model\.override_config="),
    ("data:\n  datagen:\n    path: gen.py\n    name: G\n", r"data\.datagen="),
    ("actor_rollout_ref:\n  model:\n    enable_activation_offload: true\n", r"enable_activation_offload=True"),
    ("actor_rollout_ref:\n  rollout:\n    mode: server\n", r"rollout\.mode='server'"),
    ("reward_model:\n  rollout:\n    name: vllm\n", r"reward_model\.rollout=.*generative reward models"),
    ("reward_model:\n  enable_resource_pool: true\n  nnodes: 1\n  n_gpus_per_node: 2\n",
     r"reward_model\.enable_resource_pool=True.*runs on the training mesh"),
    ("actor_rollout_ref:\n  rollout:\n    dtype: fp8\n", r"actor_rollout_ref\.rollout\.dtype='fp8' is not valid"),
])
def test_features_we_lack_are_refused_when_switched_on(text, key):
    from rlhf_jax.config import finalize

    with pytest.raises(ValueError, match=key + r".*not supported|" + key):
        finalize(load_yaml(text), num_devices=1, check_paths=False)  # the importer, or finalize for choices
    # The same sections switched off (verl's defaults) load.
    load_yaml("data:\n  custom_cls: {path: null, name: null}\n  sampler: {class_path: null, class_name: null}\n"
              "reward_model:\n  sandbox_fusion: {url: null, max_concurrent: 64}\n")


def test_apply_chat_template_kwargs_is_a_key():
    cfg = load_yaml("data:\n  apply_chat_template_kwargs:\n    enable_thinking: False\n")
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}


def test_profiler_and_checkpoint_keys_are_honoured():
    from rlhf_jax.config import finalize

    cfg = load_yaml("global_profiler:\n  tool: nsys\n  steps: [2, 4]\n  save_path: /tmp/prof\n"
                    "trainer:\n  remove_previous_ckpt_in_save: True\n")
    assert cfg.trainer.profile_steps == (2, 4) and cfg.trainer.profile_dir == "/tmp/prof"
    assert finalize(cfg, num_devices=1, check_paths=False).trainer.max_actor_ckpt_to_keep == 1
    cfg.trainer.max_actor_ckpt_to_keep = 3
    with pytest.raises(ValueError, match=r"remove_previous_ckpt_in_save keeps one checkpoint.*max_actor_ckpt_to_keep=3"):
        finalize(cfg, num_devices=1, check_paths=False)
    cfg = load_yaml("trainer:\n  profile_steps: [0]\n")
    with pytest.raises(ValueError, match=r"trainer\.profile_steps=\(0,\)"):
        finalize(cfg, num_devices=1, check_paths=False)


@pytest.mark.parametrize("path", [GENERATED, LEGACY])
def test_convert_output_of_a_verl_file_gives_the_same_finalized_config(path, tmp_path):
    from rlhf_jax.config import finalize
    from rlhf_jax.config.__main__ import convert

    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(path))
    a = finalize(load_yaml(path), num_devices=8, check_paths=False, train_dataset_size=1024)
    b = finalize(load_yaml(str(converted)), num_devices=8, check_paths=False, train_dataset_size=1024)
    assert a.to_dict() == b.to_dict()
