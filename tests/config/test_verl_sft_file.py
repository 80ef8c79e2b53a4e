"""verl's sft_trainer.yaml as the config file: its keys land on ours, a file of it trains on a Question/Answer JSON
(seed 003's data layout), and keys whose values cannot be honoured are refused by name."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_jax.config import load_yaml
from tests.train.helpers import read_metrics, run_main

# verl's sft_trainer.yaml (its sections and key names), pointed at the tiny model and a Q/A file.
SFT_YAML = """
defaults:
  - optim: fsdp
  - _self_
data:
  train_batch_size: 8
  micro_batch_size: null
  micro_batch_size_per_gpu: 1
  train_files: {data}
  val_files: {data}
  prompt_key: Question
  response_key: Answer
  prompt_dict_keys: null
  response_dict_keys: null
  multiturn:
    enable: false
    messages_key: messages
    tools_key: tools
  max_length: 64
  truncation: error
  balance_dp_token: False
  chat_template: null
  custom_cls:
    path: null
    name: null
  use_shm: False
  apply_chat_template_kwargs: {{}}
model:
  partial_pretrain: builtin:tiny
  fsdp_config:
    model_dtype: fp32
    wrap_policy:
      min_num_params: 0
    cpu_offload: False
    offload_params: False
  external_lib: null
  enable_gradient_checkpointing: True
  trust_remote_code: False
  lora_rank: 0
  lora_alpha: 16
  target_modules: all-linear
  use_liger: False
  strategy: fsdp2
optim:
  lr: 1e-3
  betas: [0.9, 0.95]
  weight_decay: 0.01
  lr_warmup_steps_ratio: 0.1
  clip_grad: 1.0
  lr_scheduler: wsd
ulysses_sequence_parallel_size: 1
use_remove_padding: False
trainer:
  default_local_dir: {out}
  default_hdfs_dir: null
  project_name: qa-sft
  experiment_name: test
  total_epochs: 1
  total_training_steps: 3
  logger: ['jsonl']
  seed: 1
  save_freq: -1
  test_freq: 2
  nnodes: 1
  n_gpus_per_node: 8
  max_ckpt_to_keep: null
  resume_mode: auto
  resume_from_path: null
  checkpoint:
    save_contents: ["model", "optimizer", "extra"]
    load_contents: ${{trainer.checkpoint.save_contents}}
  device: cuda
"""


def _qa_file(tmp_path) -> str:
    """Seed 003's data layout: a JSON with train / test lists of Question / Answer rows."""
    rows = [{"Question": f"What is {a} plus {b}?", "Answer": str(a + b)} for a in range(5) for b in range(5)]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps({"train": rows[:20], "test": rows[20:]}))
    return str(path)


def _yaml(tmp_path, **replace) -> str:
    text = SFT_YAML.format(data=_qa_file(tmp_path), out=tmp_path / "run")
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / "sft_trainer.yaml"
    path.write_text(text)
    return str(path)


def test_keys_land_on_the_schema(tmp_path):
    cfg = load_yaml(_yaml(tmp_path))
    a = cfg.actor_rollout_ref
    assert cfg.algorithm.type == "sft" and a.model.path == "builtin:tiny"
    assert cfg.data.prompt_key == "Question" and cfg.data.response_key == "Answer" and cfg.data.max_length == 64
    assert cfg.data.train_batch_size == 8 and cfg.data.micro_batch_size_per_gpu == 1
    assert a.actor.optim.lr == 1e-3 and a.actor.optim.betas == (0.9, 0.95) and a.actor.grad_clip == 1.0
    assert a.actor.optim.warmup_style == "wsd" and a.actor.optim.lr_warmup_steps_ratio == 0.1
    assert a.model.enable_gradient_checkpointing is True and a.model.dtype == "float32"
    assert a.model.use_remove_padding is False  # verl's padded rows (rlhf_jax packs by default; both are exact)
    # verl's SFT trainer saves and validates at the last step whatever -1 says, only the loss, not before step 1
    assert cfg.trainer.save_freq is None and cfg.trainer.test_freq == 2
    assert cfg.trainer.val_before_train is False and cfg.trainer.val_accuracy is False
    assert cfg.trainer.nnodes == 1 and cfg.trainer.n_gpus_per_node == 8


def test_silent_file_takes_verl_sft_defaults(tmp_path):
    cfg = load_yaml("model:\n  partial_pretrain: builtin:tiny\noptim:\n  lr: 2e-5\n")
    assert cfg.data.prompt_key == "question" and cfg.data.response_key == "answer" and cfg.data.max_length == 1024
    assert cfg.data.train_batch_size == 256 and cfg.data.micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine" and cfg.trainer.total_epochs == 4


@pytest.mark.parametrize("cpu_offload, offload_params, offloaded", [(True, True, True), (True, False, False),
                                                                  (False, True, False)])
def test_cpu_offload_of_the_parameters_is_the_actors_host_offload(tmp_path, cpu_offload, offload_params, offloaded):
    # verl wraps with CPUOffload(offload_params=...) only under cpu_offload; parameters and their optimizer state
    cfg = load_yaml(_yaml(tmp_path, **{"cpu_offload: False": f"cpu_offload: {cpu_offload}",
                                       "offload_params: False": f"offload_params: {offload_params}"}))
    f = cfg.actor_rollout_ref.actor.fsdp_config
    assert (f.param_offload, f.optimizer_offload) == (offloaded, offloaded)


def test_optimizer_arguments_are_honoured_and_the_engine_trainers_scheduler_name_ignored(tmp_path, caplog):
    # verl's build_optimizer passes override_optimizer_config to the optimizer class; fsdp_sft_trainer reads
    # optim.lr_scheduler, so warmup_style (the engine trainer's name) changes nothing there either
    cfg = load_yaml(_yaml(tmp_path, **{"lr_scheduler: wsd": "lr_scheduler: wsd\n  warmup_style: constant\n"
                                                          "  override_optimizer_config:\n    amsgrad: true"}))
    assert cfg.actor_rollout_ref.actor.optim.override_optimizer_config == {"amsgrad": True}
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "wsd"
    assert "optim.warmup_style" in caplog.text


@pytest.mark.parametrize("old,new,key", [
    ("lr_scheduler: wsd", "lr_scheduler: linear", "optim.lr_scheduler='linear'"),
    ("    path: null\n    name: null", "    path: my.py\n    name: MyData", "data.custom_cls.path='my.py'"),
])
def test_unsupported_values_are_refused_by_name(tmp_path, old, new, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(").replace(".", r"\.")):
        load_yaml(_yaml(tmp_path, **{old: new}))


def test_file_trains_on_question_answer_json(tmp_path):
    """python -m rlhf_jax.main --config=sft_trainer.yaml (8 devices: 8 examples = 1 per shard and micro-batch)."""
    proc = run_main([f"--config={_yaml(tmp_path)}"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = str(tmp_path / "run")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("val/loss" in rows[i] for i in (1, 2)) and "val/loss" not in rows[0]
    assert not any(k.startswith("val-core") for r in rows for k in r)  # loss only, as verl's SFT trainer
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert os.listdir(os.path.join(out, "checkpoints")) == ["3"]  # save_freq -1: only the last step


def test_verl_sft_command_line_trains_on_keys_inside_a_dict_column(tmp_path):
    """The arguments of verl's SFT example scripts (``torchrun -m verl.trainer.fsdp_sft_trainer ARGS``) after
    ``python -m rlhf_jax.main --config_format=verl_sft``: ``prompt_dict_keys`` / ``response_dict_keys`` index into
    verl's ``extra_info`` column as verl does, and LoRA is on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "qa", "prompt": [{"role": "user", "content": "x"}],
             "extra_info": {"question": f"What is {a} plus {b}?", "answer": str(a + b)}}
            for a in range(5) for b in range(5)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "run"
    proc = run_main(["--config_format=verl_sft", f"data.train_files={data}", f"data.val_files={data}",
                     "data.prompt_key=extra_info", "data.response_key=extra_info", "optim.lr=1e-3",
                     "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']",
                     "data.micro_batch_size_per_gpu=4", "data.train_batch_size=8", "data.max_length=64",
                     "model.partial_pretrain=builtin:tiny", f"trainer.default_local_dir={out}",
                     "trainer.project_name=gsm8k-sft", "trainer.experiment_name=tiny", "trainer.logger=['jsonl']",
                     "trainer.total_epochs=1", "trainer.total_training_steps=3", "trainer.n_gpus_per_node=1",
                     "model.lora_rank=8", "model.lora_alpha=16", "model.target_modules=all-linear"], devices=1)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    metrics = read_metrics(str(out))
    assert [r["step"] for r in metrics] == [1, 2, 3] and metrics[-1]["train/loss"] < metrics[0]["train/loss"]
    from rlhf_jax.config import load_config_from_argv

    cfg = load_config_from_argv(["main", "--config_format=verl_sft", "model.partial_pretrain=builtin:tiny",
                                 "data.prompt_key=extra_info", "data.prompt_dict_keys=['question']",
                                 "+data.response_dict_keys=['answer']", "model.lora_rank=8"])
    assert cfg.algorithm.type == "sft" and cfg.actor_rollout_ref.model.lora_rank == 8
    # response_key left at verl's default ("answer"), indexed by the dict keys as verl does: row["answer"]["answer"]
    assert cfg.data.prompt_key == "extra_info.question" and cfg.data.response_key == "answer.answer"
