"""verl's command line in ``python -m rlhf_jax.main``: ``key=value``, ``+key=value``, ``~key``, Hydra's value
syntax, precedence (later wins, mixed with ``--config`` and ``--config.<key>=``) and errors before anything loads."""

from __future__ import annotations

import os

import pytest

from rlhf_jax.config import schema
from rlhf_jax.config.cli import load_config_from_argv, verl_base
from rlhf_jax.config.hydra_args import REMOVED, parse
from rlhf_jax.config.verl_defaults import DIFFERENCES
from tests.train.helpers import REPO, read_metrics, run_main

GRPO = os.path.join(REPO, "configs", "grpo.py")


def load(*args: str):
    return load_config_from_argv(["main", *args])


def test_value_syntax_is_hydras():
    got = parse(['trainer.logger=["console","wandb"]', "data.train_files=['a.parquet', 'b.parquet']",
                 "data.val_files=null", "trainer.val_before_train=True", "a.b=false", "x.lr=1e-6", "x.n=3",
                 "x.name=a=b", "+x.added=1.5", "++x.forced=text", "~x.gone", "x.empty="])
    assert got == {"trainer.logger": ["console", "wandb"], "data.train_files": ["a.parquet", "b.parquet"],
                   "data.val_files": None, "trainer.val_before_train": True, "a.b": False, "x.lr": 1e-6, "x.n": 3,
                   "x.name": "a=b", "x.added": 1.5, "x.forced": "text", "x.gone": REMOVED, "x.empty": None}


def test_a_verl_command_line_starts_from_verls_defaults():
    cfg = load("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 5
    for path, (value, _) in DIFFERENCES.items():  # every key where our default differs has verl's value
        if value is None:  # verl's null keeps our value, as loading verl's ppo_trainer.yaml does
            assert schema.get_path(cfg, path) == schema.get_key(path).default, path
            continue
        want = tuple(value) if isinstance(value, (list, tuple)) else value
        assert schema.get_path(cfg, path) == want, path
    assert schema.get_path(verl_base(), "data.train_batch_size") == 1024


def test_later_arguments_win_in_either_syntax():
    assert load("trainer.total_epochs=2", "trainer.total_epochs=3").trainer.total_epochs == 3
    assert load("trainer.total_epochs=2", "--config.trainer.total_epochs=4").trainer.total_epochs == 4
    assert load("--config.trainer.total_epochs=4", "trainer.total_epochs=2").trainer.total_epochs == 2
    # on a recipe: the recipe, then the overrides in order
    cfg = load(f"--config={GRPO}", "data.train_batch_size=8", "+actor_rollout_ref.actor.optim.lr=2e-6")
    assert cfg.data.train_batch_size == 8 and cfg.actor_rollout_ref.actor.optim.lr == 2e-6
    assert cfg.trainer.experiment_name == load(f"--config={GRPO}").trainer.experiment_name


def test_removing_a_key_restores_its_default():
    cfg = load(f"--config={GRPO}", "data.max_prompt_length=7", "~data.max_prompt_length")
    assert cfg.data.max_prompt_length == schema.get_key("data.max_prompt_length").default


def test_verls_moved_key_names_and_keys_without_meaning_here(caplog):
    cfg = load("reward.custom_reward_function.path=/tmp/score.py", "actor_rollout_ref.rollout.name=vllm",
               "actor_rollout_ref.rollout.gpu_memory_utilization=0.6")
    assert cfg.custom_reward_function.path == "/tmp/score.py"
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in warned


@pytest.mark.parametrize("arg, message", [
    ("algorithm.adv_estimater=grpo", "unknown config key 'algorithm.adv_estimater' (did you mean "
                                     "'algorithm.adv_estimator'?)"),
    ("data.train_files=[a.parquet", "data.train_files=[a.parquet: cannot read '[a.parquet' as a list"),
    ("trainer.total_epochs=x", "trainer.total_epochs: expected int, got 'x'"),
    ("~algorithm.adv_estimater", "~algorithm.adv_estimater: unknown config key"),
    ("=3", "=3: expected key=value"),
])
def test_errors_name_the_argument_or_key(arg, message):
    with pytest.raises(ValueError) as e:
        load(arg)
    assert message in str(e.value), str(e.value)


def test_a_verl_style_command_trains_two_steps(tmp_path):
    """A verl script's argument list, only the entry point replaced, shrunk with key=value overrides."""
    out = tmp_path / "run"
    args = ["algorithm.adv_estimator=grpo", "data.train_files=['builtin:arithmetic?max_value=4&train_size=16']",
            "data.val_files=['builtin:arithmetic?max_value=4&test_size=4']", "data.prompt_template=raw",
            "data.train_batch_size=4", "data.max_prompt_length=16", "data.max_response_length=4",
            "actor_rollout_ref.model.path=builtin:tiny", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "algorithm.use_kl_in_reward=False",
            "trainer.critic_warmup=0", "trainer.logger=['console','jsonl']", "trainer.project_name=verl_grpo_example",
            "trainer.experiment_name=tiny", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.val_before_train=False", "trainer.total_training_steps=2",
            f"trainer.default_local_dir={out}", "trainer.save_hf_checkpoint=never"]
    proc = run_main(args, devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(out))] == [1, 2]


def test_hydras_config_path_and_name_name_the_file_and_the_command_line_overrides_it(tmp_path):
    (tmp_path / "exp.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  train_batch_size: 12\n"
                                       "actor_rollout_ref:\n  actor:\n    fsdp_config:\n      model_dtype: bf16\n")
    for args in ([f"--config-path={tmp_path}", "--config-name=exp"], ["-cp", str(tmp_path), "-cn", "exp.yaml"]):
        cfg = load(*args, "actor_rollout_ref.actor.optim.lr=2e-6")
        assert cfg.data.train_batch_size == 12 and cfg.actor_rollout_ref.actor.optim.lr == 2e-6
        assert cfg.actor_rollout_ref.model.dtype == "bfloat16"  # verl's spelling of the actor's parameter dtype
    cfg = load(f"--config-path={tmp_path}", "--config-name=exp", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32")
    assert cfg.actor_rollout_ref.model.dtype == "float32"
    assert load("--config-name=ppo_trainer", "data.train_batch_size=6").data.train_batch_size == 6  # verl's own
    # verl 0.4-0.5's SGLang server settings (examples/sglang_multiturn/config/gsm8k_multiturn_grpo_server.yaml)
    (tmp_path / "server.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n"
                                          "    sglang_rollout_mode: server\n    server:\n      timeout: 60\n")
    assert load(f"--config-path={tmp_path}", "--config-name=server").actor_rollout_ref.rollout.n == 1


@pytest.mark.parametrize("args,message", [
    (["--config-name=ppo_megatron_trainer"], r"^--config-name=ppo_megatron_trainer without --config-path names a file "
                                              r"of verl's own checkout"),
    (["--config-path=/tmp"], r"^--config-path=/tmp needs --config-name"),
    (["--config-path=/nowhere", "--config-name=x"], r"^--config-path=/nowhere --config-name=x: no such file "
                                                    r"/nowhere/x\.yaml$"),
    (["--config-dir=/tmp", "--config-name=x"], r"^--config-dir=/tmp: name the file with --config-path"),
    ([f"--config={GRPO}", f"--config-path={REPO}/tests/config/verl_scripts/sglang_multiturn/config",
      "--config-name=gsm8k_multiturn_grpo_w_interaction"], r"^--config and --config-path/--config-name both name"),
])
def test_bad_hydra_file_flags_are_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message):
        load(*args)
