"""Tiny, fast training configs for trainer tests (tiny model, 2-token-ish responses, small batches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# For subprocesses on several fake CPU devices: see tests/conftest.py on XLA:CPU's collective timeout.
PATIENT_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
# XLA:CPU compiles without LLVM's optimizations and with its classic fusion emitters in tests (see tests/conftest.py).
QUICK_COMPILES = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def cpu_devices_flags(devices: int) -> str:
    """XLA_FLAGS of a subprocess on ``devices`` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {PATIENT_COLLECTIVES} {QUICK_COMPILES}"

# Overrides that make any recipe run in seconds: 4 prompts x 2 samples, 4-token responses.
FAST = {
    "data.train_files": ("builtin:arithmetic?max_value=4&train_size=16",),
    "data.val_files": ("builtin:arithmetic?max_value=4&test_size=4",),
    "data.prompt_template": "raw",
    "data.max_prompt_length": 16,
    "data.max_response_length": 4,
    "data.train_batch_size": 4,
    "data.val_batch_size": 4,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.actor.optim.lr": 1e-3,
    "critic.ppo_mini_batch_size": 2,
    "critic.ppo_micro_batch_size_per_gpu": 1,
    "critic.forward_micro_batch_size_per_gpu": 1,
    "custom_reward_function.path": os.path.join(REPO, "tests", "train", "dense_reward.py"),
    "trainer.total_training_steps": 2,
    "trainer.test_freq": 0,
    "trainer.val_before_train": False,
    "trainer.save_hf_checkpoint": "never",
    "trainer.logger": ("jsonl",),
    # The test process has 8 fake CPU devices: 8 sequences per step = 2 per data-parallel shard.
    "mesh.data": 2,
    "mesh.fsdp": 2,
    "mesh.tensor": 2,
    # No sequence split, and none chosen: the automatic default reads the host's free memory, which moves with
    # whatever else the test run does (tests/plan/test_context_plan.py tests the choice).
    "mesh.context": 1,
}


def load_recipe(name: str = "grpo"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(REPO, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def make_config(out_dir: str, recipe: str = "grpo", **overrides):
    """The recipe with FAST overrides, then ``overrides`` (dotted keys with '__' for '.')."""
    cfg = load_recipe(recipe)
    settings = {**FAST, "trainer.default_local_dir": out_dir}
    settings.update({k.replace("__", "."): v for k, v in overrides.items()})
    for path, value in settings.items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def cli_args(out_dir: str, recipe: str = "grpo", **overrides) -> list[str]:
    settings = {**FAST, "trainer.default_local_dir": out_dir}
    settings.update({k.replace("__", "."): v for k, v in overrides.items()})
    args = [f"--config={os.path.join(REPO, 'configs', recipe + '.py')}"]
    for path, value in settings.items():
        if isinstance(value, tuple):
            value = "(" + ",".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        args.append(f"--config.{path}={value}")
    return args


def run_main(args: list[str], *, devices: int = 8, timeout: float = 600, env: dict | None = None, fresh: bool = False,
             **popen) -> subprocess.CompletedProcess:
    """``python -m rlhf_jax.main args`` on ``devices`` CPU devices; ``env`` adds environment variables. Without
    ``popen`` arguments the run is a forked child of a pre-imported interpreter (tests/cli_zygote.py); ``fresh``
    starts a new interpreter instead, for a test of what a run prints until its interpreter has ended."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(devices),
               **(env or {}))
    if not popen and not fresh:
        from tests.cli_zygote import run_module

        return run_module("rlhf_jax.main", args, env=env, cwd=REPO, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "rlhf_jax.main", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, **popen)


class Processes:
    """The processes of one multi-process run as ``launch/local_multiprocess.sh`` starts them (rank i of ``n`` on
    127.0.0.1, each on its own fake CPU devices), forked from the pre-imported interpreter where the environment
    allows (tests/cli_zygote.py): each fresh interpreter would spend ~7 s of CPU importing the same libraries."""

    def __init__(self, num: int, devices_each: int, args: list[str], *, env: dict | None = None,
                 files: str | None = None, port: int | None = None):
        """``files``: each process's stdout and stderr go to ``<files>.<i>.out`` / ``.err`` (default: a temporary
        directory's)."""
        import tempfile

        from tests.cli_zygote import popen_module
        from tests.parallel.rehearsal import free_port

        self.files = files or os.path.join(tempfile.mkdtemp(prefix="rlhf_jax-test-processes-"), "p")
        port = port or free_port()
        self.procs = []
        for i in range(num):
            penv = dict(os.environ, **(env or {}), JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(devices_each),
                        RLHF_JAX_COORDINATOR=f"127.0.0.1:{port}", RLHF_JAX_NUM_PROCESSES=str(num),
                        RLHF_JAX_PROCESS_ID=str(i))
            self.procs.append(popen_module("rlhf_jax.main", args, env=penv, cwd=REPO, stdout=f"{self.files}.{i}.out",
                                           stderr=f"{self.files}.{i}.err"))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> int | None:
        """None while any process runs, then the launcher's status: the last failing process's code, else 0."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in reversed(codes) if c), 0)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def stderr(self, i: int) -> str:
        return open(f"{self.files}.{i}.err").read()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(every process's stdout, every process's stderr), in process order, once all have ended."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return ("".join(open(f"{self.files}.{i}.out").read() for i in range(len(self.procs))),
                "".join(self.stderr(i) for i in range(len(self.procs))))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc) -> None:
        """Whatever happened in the block, no process outlives it."""
        self.kill()


def run_tool(module: str, *args: str, env: dict | None = None, timeout: float = 600, cwd: str = REPO
             ) -> subprocess.CompletedProcess:
    """``python -m module args`` (the export, plot, plan, generate ... commands) with the tests' environment plus
    ``env``, forked from the pre-imported interpreter where the environment allows (tests/cli_zygote.py)."""
    from tests.cli_zygote import run_module

    return run_module(module, list(args), env=dict(os.environ, **(env or {})), cwd=cwd, timeout=timeout)


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tiny_hf_checkpoint(config_cls: str, model_cls: str, out: str, **config_kwargs) -> str:
    """A tiny random transformers checkpoint (2 layers, hidden 64) over the built-in tiny model's vocabulary, whose
    tokenizer files it borrows; ``config_kwargs`` add to or override the shared shape."""
    import shutil

    import torch
    import transformers

    from rlhf_jax.tools import tiny

    torch.manual_seed(0)
    shape = dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 tie_word_embeddings=True, bos_token_id=tiny.BOS_ID, eos_token_id=tiny.EOS_ID, pad_token_id=tiny.PAD_ID)
    config = getattr(transformers, config_cls)(**{**shape, **config_kwargs})
    getattr(transformers, model_cls)(config).eval().save_pretrained(out)
    source = tiny.ensure()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(source, name), out)
    return out


def loss_specs(**actor_changes):
    """(ActorLossSpec, CriticLossSpec) of the default config (the key table's defaults), the actor's with
    ``actor_changes``: tests state what they vary and take every other setting from the one source of defaults."""
    import dataclasses

    from rlhf_jax.config import base_config, finalize
    from rlhf_jax.train.steps import CriticLossSpec
    from rlhf_jax.train.trainer import actor_loss_spec

    cfg = finalize(base_config(), num_devices=1, check_paths=False)
    actor = actor_loss_spec(cfg, recompute_old=True, temperature=cfg.actor_rollout_ref.rollout.temperature)
    critic = CriticLossSpec(cfg.critic.cliprange_value, cfg.critic.loss_agg_mode,
                            cfg.actor_rollout_ref.actor.loss_scale_factor)
    return dataclasses.replace(actor, **actor_changes), critic
