"""The config's shape: it imports nothing of rlhf_jax but algos, every rule names schema keys, every default has one
home, the estimator registry answers what a config needs, and a run finalizes its config once."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import rlhf_jax
from rlhf_jax import algos
from rlhf_jax.config import base_config, finalize, schema, with_dataset_size
from rlhf_jax.config.defaults import COMPUTED
from rlhf_jax.config.docs import render_markdown
from rlhf_jax.config.rule import GIVEN_RULES, RULES

CONFIG_DIR = pathlib.Path(rlhf_jax.__file__).parent / "config"


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at module level and inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                                                   if node.module == "rlhf_jax"]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append((node.lineno, "rlhf_jax.config (relative)"))
    return out


def test_config_imports_nothing_of_the_package_but_algos():
    files = sorted(CONFIG_DIR.rglob("*.py"))
    assert len(files) > 20
    upward = []
    for path in files:
        for line, module in _imported_modules(path):
            if module == "rlhf_jax" or not module.startswith("rlhf_jax"):
                continue
            if not module.startswith(("rlhf_jax.config", "rlhf_jax.algos")):
                upward.append(f"{path.relative_to(CONFIG_DIR.parent)}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_the_import_walk_sees_in_function_imports(tmp_path):
    scratch = tmp_path / "scratch.py"
    scratch.write_text("def f():\n    from rlhf_jax.train import optim\n    import rlhf_jax.models.hub\n")
    assert [m for _, m in _imported_modules(scratch)] == ["rlhf_jax.train", "rlhf_jax.models.hub"]


def test_rules_and_defaults_name_schema_keys():
    paths = set(schema.key_paths())
    for r in GIVEN_RULES + RULES:
        assert r.keys and set(r.keys) <= paths, (r.name, set(r.keys) - paths)
        assert r.doc and "\n" not in r.doc
    assert len({r.name for r in GIVEN_RULES + RULES}) == len(GIVEN_RULES + RULES)
    for key in schema.KEYS:
        if key.same_as is not None:
            assert key.default is None and key.same_as in paths and key.path not in COMPUTED, key.path
        if key.check_if is not None:
            assert schema.get_key(key.check_if).value_type is bool, key.path
    for path in COMPUTED:
        assert schema.get_key(path).default is None, path


def test_docs_list_each_keys_default_source_and_rules():
    text = render_markdown()
    row = ("| `actor_rollout_ref.actor.clip_ratio_low` | `actor_rollout_ref.actor.clip_ratio` | must be > 0 | "
           "`rules.dpo_settings` |")  # default from, its own rule, the rules between keys that read it
    assert row in text
    assert "| `critic.enable` | the estimator needs a value model and algorithm.type=rl |" in text
    lora_alpha = next(line for line in text.splitlines() if line.startswith("| `actor_rollout_ref.model.lora_alpha` |")
                      and "rules." in line)
    assert "`rules.lora`" in lora_alpha


def test_a_default_is_filled_once_from_its_source():
    cfg = base_config()
    cfg.actor_rollout_ref.actor.clip_ratio = 0.3
    cfg.actor_rollout_ref.actor.clip_ratio_high = 0.28
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    out = finalize(cfg, num_devices=1, check_paths=False)
    actor, critic = out.actor_rollout_ref.actor, out.critic
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.28)
    # a chain: critic.forward_micro_batch_size_per_gpu = critic.ppo_micro... = the actor's
    assert critic.forward_micro_batch_size_per_gpu == critic.ppo_micro_batch_size_per_gpu == 2
    assert critic.forward_max_token_len_per_gpu == critic.ppo_max_token_len_per_gpu == 2 * 16384
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.clip_ratio_low=-0\.1 must be > 0$"):
        cfg.actor_rollout_ref.actor.clip_ratio_low = -0.1
        finalize(cfg, num_devices=1, check_paths=False)


def test_the_dataset_size_adds_steps_without_checking_again():
    cfg = base_config()
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio = 0.1
    whole = finalize(cfg, num_devices=2, train_dataset_size=160, check_paths=False)
    later = with_dataset_size(finalize(cfg, num_devices=2, check_paths=False), 160)
    assert later.to_dict() == whole.to_dict()
    assert later.derived.total_training_steps == 10 and later.derived.actor_lr_warmup_steps == 1
    with pytest.raises(ValueError, match="fewer than data.train_batch_size"):
        with_dataset_size(later, 3)


def test_what_an_estimator_needs_comes_from_its_registration():
    @algos.register_adv_estimator("test_valued_baseline", overwrite=True, needs_critic=True, grouped=True)
    def valued(*, token_level_rewards, response_mask, values=None, **_):
        return token_level_rewards - values, token_level_rewards

    assert algos.estimator_info("test_valued_baseline") == algos.EstimatorInfo(grouped=True, needs_critic=True)
    assert algos.estimator_info("remax").needs_greedy_baseline and algos.estimator_info("grpo").grouped
    cfg = base_config()
    cfg.algorithm.adv_estimator = "test_valued_baseline"
    with pytest.raises(ValueError, match=r"test_valued_baseline compares the samples of one prompt"):
        finalize(cfg, num_devices=1, check_paths=False)
    cfg.actor_rollout_ref.rollout.n = 2
    assert finalize(cfg, num_devices=1, check_paths=False).critic.enable  # defaulted from needs_critic
    cfg.critic.enable = False
    with pytest.raises(ValueError, match=r"adv_estimator=test_valued_baseline needs a value model"):
        finalize(cfg, num_devices=1, check_paths=False)


def test_a_run_finalizes_its_config_once(tmp_path, monkeypatch):
    """Preparing a run checks the config once, before reading data, and adds the data's size after."""
    from rlhf_jax.train import setup

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return finalize(*args, **kwargs)

    monkeypatch.setattr(setup, "finalize", counted)
    cfg = base_config()
    cfg.trainer.default_local_dir = str(tmp_path)
    c = setup.prepare(cfg)
    assert len(calls) == 1 and "train_dataset_size" not in calls[0]
    assert c.cfg.derived.steps_per_epoch == len(c.train_dataset) // cfg.data.train_batch_size > 0
    assert dataclasses.is_dataclass(c.sampling) and c.sampling.max_new_tokens == cfg.data.max_response_length
