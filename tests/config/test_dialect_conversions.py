"""`python -m rlhf_jax.config convert` of the ATorch and TRL-based fixtures prints a file in our keys that reads, with
the same shrinking overrides, to every setting of the original, whose run trains two steps."""

import json
import os

import pytest

from rlhf_jax.config.__main__ import convert
from tests.config import trinity_runs as R
from tests.train.helpers import tiny_hf_checkpoint

HERE = os.path.join(os.path.dirname(__file__), "dialects")
_COMMON = {"actor_rollout_ref.model.path": "builtin:tiny", "data.max_prompt_length": 48,
           "data.max_response_length": 4, "data.train_batch_size": 4, "data.val_batch_size": 4,
           "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "reward_model.micro_batch_size_per_gpu": 2,
           "trainer.total_training_steps": 2}


def _atorch(tmp_path, rm):
    return {**_COMMON, "critic.model.path": "builtin:tiny", "data.tokenizer": "builtin:tiny",
            "reward_model.model.path": rm, "data.train_files": "builtin:arithmetic?max_value=4&train_size=16",
            "data.val_files": "builtin:arithmetic?max_value=4&test_size=4", "data.prompt_key": "prompt",
            "actor_rollout_ref.rollout.max_num_seqs": 4}


def _trainer_config(tmp_path, rm):
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps({"train": [{"Question": f"{i}+1=", "Answer": str(i + 1)} for i in range(16)],
                              "test": [{"Question": f"{i}+2=", "Answer": str(i + 2)} for i in range(4)]}))
    # log_with: wandb writes no metrics.jsonl: the jsonl sink is added to compare the two runs' metrics
    return {**_COMMON, "reward_model.model.path": rm, "data.train_files": str(qa), "data.val_files": str(qa),
            "trainer.logger": "('console','wandb','jsonl')"}


@pytest.mark.parametrize("fixture,setup,fmt", [("atorch_ppo.yaml", _atorch, "atorch"),
                                               ("Trainer_config.yaml", _trainer_config, "trainer_config")])
def test_the_file_trains_and_its_conversion_reads_the_same(tmp_path, fixture, setup, fmt):
    rm = tiny_hf_checkpoint("LlamaConfig", "LlamaForSequenceClassification", str(tmp_path / "rm"), num_labels=1)
    overrides = setup(tmp_path, rm)
    path = os.path.join(HERE, fixture)
    out = str(tmp_path / "run")
    overrides["trainer.default_local_dir"] = out
    R.ran_two_steps(R.run_file(path, overrides, env={"WANDB_MODE": "offline"}), out, fmt)
    converted = tmp_path / "converted.yaml"
    converted.write_text(convert(path))
    R.assert_same_settings(path, str(converted), overrides)
