"""ATorch's RLHF config (a YAML with ``model``, ``tokenizer`` and ``train`` sections) onto the schema.

Its run is PPO as trlx runs it: one response per prompt, a critic, a KL penalty to the reference in the
reward when a ``ref_model`` is listed, GAE. ``model`` lists the models (actor, critic, ref_model,
reward_model), each a Hugging Face directory or Hub id with its optimizer (a PyTorch / transformers class
name and its keyword arguments; the class's own defaults apply to the arguments the file leaves out).
``train`` sizes the loop: ``experience_buffer_size`` experiences (= prompts) are generated, ``eg_batch_size``
at a time, then trained on for ``rl_epochs`` in mini-batches of ``rl_batch_size``. ``actor_critic`` (one model
for both roles) is a value head on the actor's trunk (``critic.shared_trunk``); the other weight-sharing entries
and models or strategies from Python files are refused by name.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.dialects.rules import Rule, get
from rlhf_jax.config.optimizers import optimizer_settings

MARKERS = ("tokenizer", "train")
MODELS = ("actor", "critic", "ref_model", "reward_model")
SHARED = ("actor_critic", "actor_critic_ref", "reward_critic", "actor_critic_ref_reward")
_REFUSED_SHARING = SHARED[1:]

_A = "actor_rollout_ref."
_NATIVE = "torch_native"
# Each optimizer class's own defaults (torch.optim, transformers' Adafactor, lion-pytorch's Lion): a file
# that leaves an argument out means these, not rlhf_jax's schema defaults.
_CLASS_DEFAULTS = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"lr": 1e-3, "weight_decay": 0.0},
    "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
    "adafactor": {"weight_decay": 0.0},
}
# The arguments that are the optim section's own keys; the rest go to optim.override_optimizer_config.
_OWN = {"adamw": ("lr", "betas", "eps", "weight_decay"), "adam": ("lr", "betas", "eps", "weight_decay"),
        "sgd": ("lr", "weight_decay"), "lion": ("lr", "betas", "weight_decay"), "adafactor": ("lr", "weight_decay")}
_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "lion": "Lion", "adafactor": "Adafactor"}


def looks_like(mapping: dict) -> bool:
    """A file whose ``model`` section lists ATorch's model names (and nothing else)."""
    model = mapping.get("model")
    return isinstance(model, dict) and bool(model) and set(model) <= set(MODELS + SHARED)


def _model_path(role: str):
    def convert(value: Any, full: dict) -> dict:
        path = str(value)
        if path.endswith(".py"):
            raise ValueError(f"model.{role}.model_path={path!r}: a model defined in a Python file cannot be "
                             "loaded; give a Hugging Face checkpoint directory or Hub id")
        if role == "actor":
            return {_A + "model.path": path}
        if role == "critic":
            return {"critic.model.path": path}
        if role == "reward_model":
            return {"reward_model.enable": True, "reward_model.model.path": path}
        actor = get(full, "model.actor.model_path")
        if actor is not None and str(actor) != path:
            raise ValueError(f"model.ref_model.model_path={path!r} differs from model.actor.model_path={actor!r}: "
                             "the reference here is the initial policy (actor_rollout_ref.model.path)")
        return {"algorithm.use_kl_in_reward": True}  # their reference's one use: the KL penalty in the reward
    convert.__doc__ = {"actor": "the policy", "critic": "the value model's initialisation",
                       "ref_model": "the initial policy (must be the actor's path); turns on the KL penalty in "
                                    "the reward (algorithm.use_kl_in_reward)",
                       "reward_model": "the reward model (reward_model.enable)"}[role]
    return convert


def _optimizer(role: str, prefix: str):
    def convert(value: Any, full: dict) -> dict:
        """name (a torch.optim / transformers class) -> optim.optimizer; kwargs lr, betas, eps, weight_decay ->
        optim.*, the others -> optim.override_optimizer_config; the class's own defaults for what kwargs omit"""
        where = f"model.{role}.optimizer"
        if role in ("actor", "critic") and get(full, "model.actor_critic") is not None:
            return {}  # ATorch's default optimizer for a role that model.actor_critic serves: it has its own
        value = value if isinstance(value, dict) else {}
        name = str(value.get("name") or "")
        key = name.rsplit(".", 1)[-1].lower()  # torch.optim.AdamW, transformers.optimization.Adafactor, adam
        if key not in _CLASS_DEFAULTS:
            raise ValueError(f"{where}.name={name!r}: choose one of AdamW, Adam, SGD, Lion, Adafactor (a "
                             "torch.optim or transformers class name)")
        kwargs = {**_CLASS_DEFAULTS[key], **dict(value.get("kwargs") or {})}
        own = {arg: kwargs.pop(arg) for arg in _OWN[key] if arg in kwargs}
        if key == "adafactor":
            if own.get("lr") is None:
                raise ValueError(f"{where}.kwargs: Adafactor without lr takes relative step sizes, which are not "
                                 "implemented; give kwargs.lr (and relative_step: false)")
            kwargs.setdefault("relative_step", False)  # transformers' default, refused there with a manual lr
        optimizer_settings(key, kwargs, f"{where}.kwargs")
        out = {prefix + "optim.optimizer": _NAMES[key], prefix + "optim.lr": float(own["lr"]),
               prefix + "optim.weight_decay": float(own["weight_decay"]),
               prefix + "optim.override_optimizer_config": kwargs or None}
        if "betas" in own:
            out[prefix + "optim.betas"] = tuple(float(b) for b in own["betas"])
        if "eps" in own:
            out[prefix + "optim.eps"] = float(own["eps"])
        return out
    return convert


def _shared(name: str):
    def convert(value: Any, _: dict) -> dict:
        roles = name.replace("actor_critic_ref_reward", "actor, critic, ref_model and reward_model").replace(
            "actor_critic_ref", "actor, critic and ref_model").replace("actor_critic", "actor and critic").replace(
            "reward_critic", "reward_model and critic")
        raise ValueError(f"model.{name}: one model sharing its weights between {roles} is not implemented (each "
                         "role is a model of its own here); list them as separate entries, e.g. model.actor and "
                         "model.critic with the same model_path")
    convert.__doc__ = "refused: weight sharing between roles is not implemented"
    return convert


def _actor_critic(value: Any, full: dict) -> dict:
    """one model as actor and critic: the policy with a value head on its trunk (critic.shared_trunk), trained by
    the actor's optimizer"""
    value = value if isinstance(value, dict) else {}
    if get(full, "model.actor.model_path") is not None or get(full, "model.critic.model_path") is not None:
        raise ValueError("list either model.actor_critic or model.actor / model.critic, not both")
    if value.get("model_path") is None:
        raise ValueError("give model.actor_critic.model_path")
    if value.get("model_cls") is not None:
        raise ValueError(f"model.actor_critic.model_cls={value['model_cls']!r}: a model class from a Python file "
                         "cannot be loaded; give a Hugging Face checkpoint directory")
    params = dict(value.get("model_params") or {})
    dtype = params.pop("torch_dtype", None)
    if params:
        raise ValueError(f"model.actor_critic.model_params.{next(iter(params))}: model loading arguments other than "
                         "torch_dtype: set actor_rollout_ref.model.*")
    for strategy in ("train_strategy", "inference_strategy"):
        if value.get(strategy) not in (None, _NATIVE):
            raise ValueError(f"model.actor_critic.{strategy}={value[strategy]!r}: {_STRATEGY}")
    out = {**_model_path("actor")(value["model_path"], full), "critic.enable": True, "critic.shared_trunk": True}
    if dtype is not None:
        out.update(_torch_dtype("actor_critic")(dtype, full))
    out.update(_optimizer("actor_critic", _A + "actor.")(value.get("optimizer") or DEFAULTS["model.actor.optimizer"],
                                                         full))
    return out


_TORCH_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "half": "float16", "fp16": "float16"}


def _dtype_name(value: Any, where: str) -> str:
    name = str(value).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise ValueError(f"{where}={value!r}: use float32, bfloat16 or float16 (auto, the checkpoint's own dtype, "
                         "is not read: name it)")
    return _TORCH_DTYPES[name]


def _torch_dtype(role: str):
    def convert(value: Any, full: dict) -> dict:
        where = f"model.{role}.model_params.torch_dtype"
        dtype = _dtype_name(value, where)
        if role in ("actor", "actor_critic"):
            return {_A + "model.dtype": dtype, _A + "model.compute_dtype": dtype}
        # every other role computes in the policy's dtype here (one compute dtype per run): it must agree
        actor = get(full, "model.actor.model_params.torch_dtype",
                    get(full, "model.actor_critic.model_params.torch_dtype"))
        own = _dtype_name(actor, "model.actor.model_params.torch_dtype") if actor is not None else "float32"
        if dtype != own:
            raise ValueError(f"{where}={value!r} differs from the actor's {own} (model.actor.model_params.torch_dtype): "
                             "the critic, reference and reward model compute in the policy's dtype here")
        return {}
    convert.__doc__ = ("parameters loaded (and trained) in this dtype: actor_rollout_ref.model.dtype and compute_dtype"
                       if role in ("actor", "actor_critic") else
                       "must equal the actor's torch_dtype (every role computes in the policy's dtype)")
    return convert


def _truncation(value: Any, _: dict) -> str:
    """the side overlong prompts are cut from (left keeps their end, right their start)"""
    if value not in ("left", "right"):
        raise ValueError("use left or right")
    return str(value)


def _mode(value: Any, _: dict) -> dict:
    """sequential: generation and training take turns on every device; concurrent: experience.overlap (the next
    experiences are generated on mesh.rollout_devices while training; the file does not size it: set it)"""
    mode = str(value).lower()
    if mode not in ("sequential", "concurrent"):
        raise ValueError("use sequential or concurrent")
    return {"experience.overlap": mode == "concurrent"}


def _trainer(value: Any, _: dict) -> dict:
    """PPOTrainer: PPO with GAE, one response per prompt, no dual clip"""
    if value not in ("PPOTrainer", None):
        raise ValueError("only PPOTrainer (PPO with a critic) is read")
    return {"algorithm.adv_estimator": "gae", _A + "rollout.n": 1, _A + "actor.clip_ratio_c": 1e30}


def _buffer(value: Any, _: dict) -> dict:
    """experiences per training step: data.train_batch_size (one response per prompt)"""
    return {"data.train_batch_size": int(value)}


def _generation_batch(value: Any, full: dict) -> dict:
    """prompts decoded at once (rollout.max_num_seqs); without experience_buffer_size also data.train_batch_size"""
    out = {_A + "rollout.max_num_seqs": int(value)}
    if get(full, "train.experience_buffer_size") is None:
        out["data.train_batch_size"] = int(value)
    return out


_STRATEGY = "optimization strategies (train.strategy_file functions or torch_native): one JAX program, sharded by "\
            "the mesh section"

RULES: tuple[Rule, ...] = (
    *(Rule(f"model.{role}.model_path", convert=_model_path(role)) for role in MODELS),
    Rule("model.actor.optimizer", convert=_optimizer("actor", _A + "actor.")),
    Rule("model.critic.optimizer", convert=_optimizer("critic", "critic.")),
    Rule("model.*.optimizer.*", reason="ref_model and reward_model are not trained: remove their optimizer",
         accept=lambda v: False),
    Rule("model.*.model_cls", reason="a model class from a Python file: give a Hugging Face checkpoint directory",
         accept=lambda v: v is None),
    *(Rule(f"model.{role}.model_params.torch_dtype", convert=_torch_dtype(role)) for role in MODELS),
    Rule("model.*.model_params.*", reason="model loading arguments other than torch_dtype: set "
         "actor_rollout_ref.model.* keys", accept=lambda v: False),
    Rule("model.*.model_params", reason="model loading arguments: set actor_rollout_ref.model.* (dtype, ...)",
         accept=lambda v: not v),
    Rule("model.*.train_strategy", reason=_STRATEGY, accept=lambda v: v in (None, _NATIVE)),
    Rule("model.*.inference_strategy", reason=_STRATEGY, accept=lambda v: v in (None, _NATIVE)),
    Rule("model.actor_critic", convert=_actor_critic),
    *(Rule(f"model.{name}", convert=_shared(name)) for name in _REFUSED_SHARING),
    Rule("tokenizer.tokenizer_path", "data.tokenizer"),
    Rule("tokenizer.params.truncation_side", "data.truncation", _truncation),
    Rule("tokenizer.params.padding_side", reason="the sampler left-pads prompts to static shapes itself; the "
         "padding side does not change what is computed"),
    Rule("tokenizer.params.*", reason="tokenizer arguments other than truncation_side and padding_side: set "
         "data.tokenizer to a tokenizer directory saved with them", accept=lambda v: False),
    Rule("train.epochs", "trainer.total_epochs", lambda v, _: int(v)),
    Rule("train.eg_batch_size", convert=_generation_batch),
    Rule("train.experience_buffer_size", convert=_buffer),
    Rule("train.rl_epochs", _A + "actor.ppo_epochs", lambda v, _: int(v)),
    Rule("train.rl_batch_size", _A + "actor.ppo_mini_batch_size", lambda v, _: int(v)),
    Rule("train.mode", convert=_mode),
    Rule("train.trainer", convert=_trainer),
    Rule("train.strategy_file", reason="optimization strategies from a Python file: shard with the mesh section",
         accept=lambda v: v is None),
)

# ATorch's defaults (and its optimizer default, Adam) where the file is silent.
DEFAULTS: dict[str, Any] = {
    "train.epochs": 1,
    "train.rl_epochs": 1,
    "train.mode": "sequential",
    "train.trainer": "PPOTrainer",
    "model.actor.optimizer": {"name": "torch.optim.Adam"},
    "model.critic.optimizer": {"name": "torch.optim.Adam"},
}


def finish(full: dict, values: dict[str, Any]) -> None:
    """Checks between keys once every rule has run."""
    size, mini = values.get("data.train_batch_size"), values.get(_A + "actor.ppo_mini_batch_size")
    if size is not None and mini is not None and size % mini:
        raise ValueError(f"train.rl_batch_size={mini} does not divide the experiences per step ({size}: "
                         "train.experience_buffer_size, else eg_batch_size)")
