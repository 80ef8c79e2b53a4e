"""finalize(): derived values, batch arithmetic, and every rejection naming its key."""

from __future__ import annotations

import json
import logging

import pytest

from rlhf_jax.config import base_config, finalize, resolve_mesh


def grpo_like():
    cfg = base_config()
    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.rollout.n = 8
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 4
    return cfg


def model_dir(tmp_path, max_pos=256, vocab=1000):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": max_pos,
                                               "vocab_size": vocab}))
    (d / "tokenizer.json").write_text("{}")  # finalize checks that the files are there, not what they hold
    (d / "model.safetensors").write_bytes(b"")
    return str(d)


def test_base_defaults_finalize_with_derived_values():
    out = finalize(base_config(), num_devices=1)
    arr = out.actor_rollout_ref
    assert arr.rollout.response_length == 16  # from data.max_response_length
    assert arr.rollout.seed == out.trainer.seed
    assert (arr.actor.clip_ratio_low, arr.actor.clip_ratio_high) == (0.2, 0.2)
    assert out.critic.enable is True  # base estimator is gae
    assert out.critic.model.path == arr.model.path == "builtin:tiny"
    assert out.critic.ppo_mini_batch_size == arr.actor.ppo_mini_batch_size
    assert out.critic.forward_micro_batch_size_per_gpu == out.critic.ppo_micro_batch_size_per_gpu
    assert arr.actor.checkpoint.load_contents == arr.actor.checkpoint.save_contents
    assert out.trainer.default_local_dir == "checkpoints/rlhf_jax/default"
    assert out.trainer.log_dir == "checkpoints/rlhf_jax/default"  # logs live next to the checkpoints
    assert (out.mesh.data, out.mesh.fsdp, out.mesh.tensor) == (1, 1, 1)
    assert out.derived.model_max_position_embeddings == 512 and out.derived.model_vocab_size == 264
    with pytest.raises(AttributeError):
        out.derived.new_key = 1  # locked


def test_derived_batch_arithmetic_grpo_8_devices():
    cfg = grpo_like()
    cfg.mesh.data, cfg.mesh.fsdp = 2, -1
    out = finalize(cfg, num_devices=8, train_dataset_size=100)
    d = out.derived
    assert tuple(d.mesh_shape) == (2, 4, 1, 1, 1) and d.dp_size == 8
    assert d.rollout_batch_size == 16 * 8 and d.rollout_batch_size_per_shard == 16
    assert d.actor_mini_batch_size == 64 and d.actor_num_mini_batches == 2
    assert d.actor_mini_batch_size_per_shard == 8 and d.actor_grad_accum_steps == 2  # 64 / (4 x 8)
    assert d.actor_updates_per_step == 2 and d.recompute_old_log_prob is True
    assert d.log_prob_micro_batches == 8 and d.ref_micro_batches == 8  # 16 per shard / 2
    assert d.critic_mini_batch_size == 0  # grpo: no critic
    assert out.critic.enable is False
    assert d.steps_per_epoch == 100 // 16 and d.total_training_steps == 6  # 1 epoch
    assert d.need_ref is False


def test_derived_steps_warmup_and_single_minibatch():
    cfg = grpo_like()
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 16
    cfg.actor_rollout_ref.actor.use_kl_loss = True
    cfg.trainer.total_epochs = 3
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio = 0.1
    cfg.critic.optim.lr_warmup_steps = 5
    d = finalize(cfg, num_devices=1, train_dataset_size=50).derived
    assert d.steps_per_epoch == 3 and d.total_training_steps == 9
    assert d.actor_lr_warmup_steps == 0 and d.critic_lr_warmup_steps == 5  # int(0.1 * 9) = 0
    assert d.recompute_old_log_prob is False and d.need_ref is True
    assert d.actor_grad_accum_steps == 128 // 4
    cfg.trainer.total_training_steps = 40  # explicit steps win over epochs
    d = finalize(cfg, num_devices=1, train_dataset_size=50).derived
    assert d.total_training_steps == 40 and d.actor_lr_warmup_steps == 4
    d = finalize(cfg, num_devices=1).derived
    assert d.steps_per_epoch == -1 and d.total_training_steps == 40
    cfg.trainer.total_training_steps = None
    d = finalize(cfg, num_devices=1).derived
    assert d.total_training_steps == -1 and d.actor_lr_warmup_steps == -1  # unknown until the data is read


def test_ppo_critic_batches_and_idempotent():
    cfg = base_config()
    cfg.data.train_batch_size = 32
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 16
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    cfg.critic.ppo_micro_batch_size_per_gpu = 4
    cfg.critic.ppo_epochs = 2
    out = finalize(cfg, num_devices=4)
    d = out.derived
    assert d.actor_grad_accum_steps == 16 // (2 * 4)
    assert d.critic_mini_batch_size == 16 and d.critic_grad_accum_steps == 1 and d.critic_updates_per_step == 4
    assert d.critic_forward_micro_batches == 8 // 4
    again = finalize(out, num_devices=4)
    assert again.derived.to_dict() == d.to_dict()


def test_model_config_read_and_length_limit(tmp_path):
    cfg = grpo_like()
    cfg.actor_rollout_ref.model.path = model_dir(tmp_path, max_pos=256, vocab=1000)
    cfg.data.max_prompt_length, cfg.data.max_response_length = 200, 56
    out = finalize(cfg, num_devices=1)
    assert out.derived.model_max_position_embeddings == 256 and out.derived.model_vocab_size == 1000
    cfg.data.max_response_length = 57
    with pytest.raises(ValueError, match=r"data\.max_prompt_length \(200\) \+ actor_rollout_ref\.rollout\."
                                         r"response_length \(57\) = 257 exceeds the model's max_position_embeddings"):
        finalize(cfg, num_devices=1)


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda c: setattr(c.actor_rollout_ref.actor, "ppo_mini_batch_size", 5),
         r"data\.train_batch_size \(16\) vs actor_rollout_ref\.actor\.ppo_mini_batch_size.*divisor"),
        (lambda c: setattr(c.actor_rollout_ref.actor, "ppo_micro_batch_size_per_gpu", 3),
         r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu \(3\) x data-parallel shards \(8\)"),
        (lambda c: setattr(c.actor_rollout_ref.rollout, "log_prob_micro_batch_size_per_gpu", 5),
         r"actor_rollout_ref\.rollout\.log_prob_micro_batch_size_per_gpu"),
        (lambda c: setattr(c.actor_rollout_ref.ref, "log_prob_micro_batch_size_per_gpu", 7),
         r"actor_rollout_ref\.ref\.log_prob_micro_batch_size_per_gpu"),
        (lambda c: setattr(c.algorithm, "adv_estimator", "grpoo"), r"algorithm\.adv_estimator='grpoo' is not valid"),
        (lambda c: setattr(c.algorithm, "type", "rlhf"), r"algorithm\.type='rlhf' is not valid: choose one of"),
        (lambda c: setattr(c.actor_rollout_ref.actor.policy_loss, "loss_mode", "ppo"),
         r"actor_rollout_ref\.actor\.policy_loss\.loss_mode='ppo' is not valid"),
        (lambda c: setattr(c.algorithm, "kl_penalty", "k4"), r"algorithm\.kl_penalty='k4' is not valid"),
        (lambda c: setattr(c.actor_rollout_ref.actor, "kl_loss_type", "kl2"),
         r"actor_rollout_ref\.actor\.kl_loss_type='kl2' is not valid"),
        (lambda c: setattr(c.actor_rollout_ref.actor, "loss_agg_mode", "token-sum"),
         r"actor_rollout_ref\.actor\.loss_agg_mode='token-sum' is not valid"),
        (lambda c: setattr(c.critic, "loss_agg_mode", "seq-sum"), r"critic\.loss_agg_mode='seq-sum' is not valid"),
        (lambda c: setattr(c.actor_rollout_ref.actor.optim, "warmup_style", "step"),
         r"actor_rollout_ref\.actor\.optim\.warmup_style='step' is not valid; choose from constant, cosine, linear, wsd"),
        (lambda c: setattr(c.trainer, "logger", ("console", "swanlab")), r"trainer\.logger='swanlab' is not valid"),
        (lambda c: setattr(c.data, "train_files", ("/nonexistent/train.parquet",)),
         r"data\.train_files: file '/nonexistent/train\.parquet' does not exist"),
        (lambda c: setattr(c.data, "val_files", ("builtin:nosuchset",)), r"data\.val_files: unknown builtin data set"),
        (lambda c: setattr(c.actor_rollout_ref.model, "path", "/nonexistent/model"),
         r"actor_rollout_ref\.model\.path: '/nonexistent/model' is not a Hugging Face model directory"),
        (lambda c: setattr(c.actor_rollout_ref.rollout, "n", 1),
         r"algorithm\.adv_estimator=grpo compares the samples.*actor_rollout_ref\.rollout\.n >= 2"),
        (lambda c: (setattr(c.algorithm, "adv_estimator", "gae"), setattr(c.critic, "enable", False)),
         r"algorithm\.adv_estimator=gae needs a value model but critic\.enable=False"),
        (lambda c: setattr(c.trainer, "critic_warmup", 3), r"trainer\.critic_warmup=3 needs a critic"),
        (lambda c: setattr(c.trainer, "resume_mode", "resume_path"), r"trainer\.resume_from_path"),
        (lambda c: setattr(c.mesh, "tensor", 3), r"mesh\.data=-1: 8 devices are not divisible by .* 3"),
        (lambda c: (setattr(c.mesh, "data", 2), setattr(c.mesh, "fsdp", 2)),
         r"mesh\.data x mesh\.fsdp x mesh\.tensor x mesh\.expert x mesh\.context = 2 x 2 x 1 x 1 x 1 = 4, but "
         r"there are 8 devices"),
        (lambda c: (setattr(c.mesh, "data", 1), setattr(c.mesh, "expert", 3)),
         r"mesh\.data x mesh\.fsdp x mesh\.tensor x mesh\.expert x mesh\.context = 1 x 1 x 1 x 3 x 1 = 3, but "
         r"there are 8 devices"),
        (lambda c: setattr(c.mesh, "expert", 3), r"mesh\.data=-1: 8 devices are not divisible by .* 3"),
        (lambda c: setattr(c.mesh, "context", 3), r"mesh\.data=-1: 8 devices are not divisible by .* 3"),
        (lambda c: (setattr(c.mesh, "fsdp", -1)), r"only one mesh axis may be -1"),
        (lambda c: setattr(c.mesh, "logical_axis_rules", (("batch", ("data", "model")),)),
         r"mesh\.logical_axis_rules: 'batch' -> 'model' is not a mesh axis"),
        (lambda c: (setattr(c.data, "train_batch_size", 12), setattr(c.actor_rollout_ref.rollout, "n", 3)),
         r"data\.train_batch_size x rollout\.n = 12 x 3 sequences vs 8 data-parallel shards"),
        (lambda c: setattr(c.actor_rollout_ref.actor, "clip_ratio_c", 1.0), r"actor_rollout_ref\.actor\.clip_ratio_c"),
        (lambda c: setattr(c.actor_rollout_ref.rollout.val_kwargs, "do_sample", True),
         r"actor_rollout_ref\.rollout\.val_kwargs\.temperature=0\.0 must be > 0 when .*do_sample=True"),
        (lambda c: setattr(c.actor_rollout_ref.rollout, "top_p", 0.0), r"actor_rollout_ref\.rollout\.top_p=0\.0"),
        (lambda c: setattr(c.algorithm, "lam", 1.5), r"algorithm\.lam=1\.5 must be in \[0, 1\]"),
        (lambda c: setattr(c.data, "max_prompt_length", 0), r"data\.max_prompt_length=0 must be >= 1"),
        (lambda c: setattr(c.data, "prompt_length_buckets", (64, 32)), r"data\.prompt_length_buckets=\(64, 32\)"),
        (lambda c: (setattr(c.reward_model.overlong_buffer, "enable", True),
                    setattr(c.reward_model.overlong_buffer, "len", 16)), r"reward_model\.overlong_buffer\.len=16"),
        (lambda c: setattr(c.reward_model, "enable", True), r"reward_model\.enable=True needs reward_model\.model\.path"),
        (lambda c: setattr(c.custom_reward_function, "path", "/nonexistent/score.py"),
         r"custom_reward_function\.path: file '/nonexistent/score\.py' does not exist"),
        (lambda c: setattr(c.trainer, "project_name", "${trainer.nope}"), r"trainer\.project_name: \$\{trainer\.nope\}"),
        (lambda c: (setattr(c.algorithm, "adv_estimator", "optimal_token_baseline"),
                    setattr(c.algorithm.rollout_correction, "bypass_mode", True)),
         r"^algorithm\.adv_estimator=optimal_token_baseline reads the old policy's sum_pi_squared, which algorithm\."
         r"rollout_correction\.bypass_mode=true does not compute"),
        (lambda c: (setattr(c.algorithm.rollout_correction, "bypass_mode", True),
                    setattr(c.actor_rollout_ref.actor.policy_loss, "loss_mode", "gspo")),
         r"^algorithm\.rollout_correction\.bypass_mode trains .* not actor_rollout_ref\.actor\.policy_loss\.loss_mode=gspo"),
        (lambda c: setattr(c.algorithm.rollout_correction, "loss_type", "reinforce"),
         r"^algorithm\.rollout_correction\.loss_type=reinforce is bypass mode's loss: set .*bypass_mode=true"),
        (lambda c: setattr(c.actor_rollout_ref.actor.policy_loss, "loss_mode", "bypass_mode"),
         r"^actor_rollout_ref\.actor\.policy_loss\.loss_mode=bypass_mode: set algorithm\.rollout_correction\.bypass_mode"),
        (lambda c: (setattr(c.actor_rollout_ref.actor.router_replay, "mode", "R2"),
                    setattr(c.algorithm.rollout_correction, "bypass_mode", True)),
         r"^actor_rollout_ref\.actor\.router_replay\.mode=R2 with algorithm\.rollout_correction\.bypass_mode"),
    ],
)
def test_rejections_name_the_key(mutate, pattern):
    cfg = grpo_like()
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 4
    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = 4
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    finalize(cfg, num_devices=8)  # valid before the change
    mutate(cfg)
    with pytest.raises(ValueError, match=pattern):
        finalize(cfg, num_devices=8)


def test_processes_and_dataset_size_checks():
    cfg = grpo_like()
    with pytest.raises(ValueError, match=r"data\.train_batch_size \(16\) vs 3 processes"):
        finalize(cfg, num_devices=3, num_processes=3)
    with pytest.raises(ValueError, match=r"10 prompts, fewer than data\.train_batch_size=16"):
        finalize(cfg, num_devices=1, train_dataset_size=10)
    assert finalize(cfg, num_devices=2, num_processes=2).derived.prompts_per_process == 8


def test_check_paths_off_and_existing_files(tmp_path):
    cfg = grpo_like()
    cfg.data.train_files = ("/elsewhere/train.parquet",)
    finalize(cfg, num_devices=1, check_paths=False)
    f = tmp_path / "train.parquet"
    f.write_bytes(b"x")
    cfg.data.train_files = (str(f),)
    cfg.actor_rollout_ref.model.path = model_dir(tmp_path)
    out = finalize(cfg, num_devices=1)
    assert out.critic.model.path == out.actor_rollout_ref.model.path


def test_both_kl_terms_warn(caplog):
    cfg = grpo_like()
    cfg.actor_rollout_ref.actor.use_kl_loss = True
    cfg.algorithm.use_kl_in_reward = True
    with caplog.at_level(logging.WARNING, logger="rlhf_jax.config"):
        finalize(cfg, num_devices=1)
    assert any("penalised twice" in r.getMessage() for r in caplog.records)


def test_resolve_mesh():
    assert resolve_mesh(-1, 1, 1, 8) == (8, 1, 1, 1, 1)
    assert resolve_mesh(2, -1, 2, 8) == (2, 2, 2, 1, 1)
    assert resolve_mesh(1, 1, -1, 4) == (1, 1, 4, 1, 1)
    assert resolve_mesh(2, 1, 1, 8, expert=-1) == (2, 1, 1, 4, 1)
    assert resolve_mesh(-1, 1, 1, 8, context=4) == (2, 1, 1, 1, 4)
    with pytest.raises(ValueError, match=r"mesh\.fsdp=0"):
        resolve_mesh(1, 0, 1, 1)
    with pytest.raises(ValueError, match=r"mesh.data x mesh.fsdp x mesh.tensor x mesh.expert x mesh.context = "
                                         r"1 x 1 x 1 x 1 x 3 = 3, but there are 8 devices"):
        resolve_mesh(1, 1, 1, 8, context=3)


def test_nnodes_and_gpus_per_node_are_the_devices_used():
    cfg = grpo_like()  # 16 prompts x 8 samples
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 2, 4
    out = finalize(cfg, num_devices=16, num_processes=2)
    d = out.derived
    assert d.num_devices == 8 and d.mesh_shape == (8, 1, 1, 1, 1) and d.dp_size == 8
    single = grpo_like()
    single.trainer.n_gpus_per_node, single.mesh.rollout_devices = 6, 2  # of the 6 used (of 8): 4 train
    assert finalize(single, num_devices=8).derived.num_devices == 4
    single.mesh.rollout_devices = 6
    with pytest.raises(ValueError, match=r"mesh\.rollout_devices=6 must be 0 \(shared devices\) or in \[1, 5\]"):
        finalize(single, num_devices=8)
    cfg.mesh.data, cfg.mesh.fsdp = 4, 4  # 16 devices exist, 8 are used
    with pytest.raises(ValueError, match=r"= 16, but there are 8 devices"):
        finalize(cfg, num_devices=16, num_processes=2)
    cfg.mesh.data, cfg.mesh.fsdp = -1, 1
    cfg.trainer.n_gpus_per_node = 16
    with pytest.raises(ValueError, match=r"trainer\.n_gpus_per_node=16, but 8 device\(s\) were found per process"):
        finalize(cfg, num_devices=16, num_processes=2)
    cfg.trainer.n_gpus_per_node = 0
    with pytest.raises(ValueError, match=r"trainer\.n_gpus_per_node=0"):
        finalize(cfg, num_devices=16, num_processes=2)
    cfg.trainer.n_gpus_per_node = None
    with pytest.raises(ValueError, match=r"trainer\.nnodes=2, but this run has 1 JAX process"):
        finalize(cfg, num_devices=8, num_processes=1)
    cfg.trainer.nnodes = None  # absent: every device of every process
    assert finalize(cfg, num_devices=8, num_processes=1).derived.num_devices == 8


def test_rollout_dtype_defaults_to_the_compute_dtype_and_is_checked():
    cfg = base_config()
    assert finalize(cfg, num_devices=1).actor_rollout_ref.rollout.dtype == "float32"
    cfg.actor_rollout_ref.model.compute_dtype = "bfloat16"
    assert finalize(cfg, num_devices=1).actor_rollout_ref.rollout.dtype == "bfloat16"
    cfg.actor_rollout_ref.rollout.dtype = "float16"
    assert finalize(cfg, num_devices=1).actor_rollout_ref.rollout.dtype == "float16"
    cfg.actor_rollout_ref.rollout.dtype = "fp8"
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.dtype='fp8' is not valid"):
        finalize(cfg, num_devices=1)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_routing_replay_is_accepted_with_packed_passes(mode):
    cfg = grpo_like()
    cfg.actor_rollout_ref.actor.router_replay.mode = mode
    assert cfg.actor_rollout_ref.model.use_remove_padding  # the default layout
    finalize(cfg, num_devices=8)


def test_multi_turn_and_workflows_run_on_any_processes_but_partial_rollouts_do_not():
    def multi_turn(processes: int, rollout_processes: int, partial: int = 0, workflow: str | None = None):
        cfg = grpo_like()
        cfg.actor_rollout_ref.rollout.multi_turn.enable = True
        cfg.actor_rollout_ref.rollout.multi_turn.tools = ("calculator",)
        cfg.actor_rollout_ref.rollout.multi_turn.workflow = workflow
        cfg.experience.overlap, cfg.experience.partial_rollout_tokens = bool(rollout_processes), partial
        cfg.mesh.rollout_processes = rollout_processes
        return finalize(cfg, num_devices=8, num_processes=processes, check_paths=False)

    for processes, rollout_processes in ((2, 1), (4, 2), (2, 0), (4, 0)):
        multi_turn(processes, rollout_processes)
        multi_turn(processes, rollout_processes, workflow="agent.py:solve")
    with pytest.raises(ValueError, match=r"partial_rollout_tokens=2 with actor_rollout_ref\.rollout\.multi_turn\.enable "
                                         r"is not supported"):
        multi_turn(2, 1, partial=2)


def test_a_split_run_takes_any_experience_schedule_but_partial_rollouts_need_one_overlapped_batch():
    def split(overlap: bool, buffer_size: int, partial: int = 0):
        cfg = grpo_like()
        cfg.mesh.rollout_processes = 1
        cfg.experience.overlap, cfg.experience.buffer_size = overlap, buffer_size
        cfg.experience.partial_rollout_tokens = partial
        return finalize(cfg, num_devices=8, num_processes=2, check_paths=False)

    for overlap, buffer_size in ((False, 1), (False, 3), (True, 2)):
        assert split(overlap, buffer_size).experience.buffer_size == buffer_size
    split(True, 1, partial=2)
    for overlap, buffer_size in ((False, 1), (True, 2)):
        with pytest.raises(ValueError, match=r"experience\.partial_rollout_tokens=2 hands each update to the batch "
                                             r"sampled while it trains: set experience\.overlap=True and "
                                             r"experience\.buffer_size=1"):
            split(overlap, buffer_size, partial=2)
