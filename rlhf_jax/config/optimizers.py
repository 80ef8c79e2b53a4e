"""The optimizers a config may name and the further arguments each accepts (``*.optim.override_optimizer_config``).

``optim.optimizer`` names the update rule as PyTorch (or transformers, for Adafactor) defines it; the
further keyword arguments of that class are checked here, by name, before anything is built: the ones with a
meaning in rlhf_jax are kept (Adafactor's, with its defaults filled in), the rest are refused naming the key.
The optimizers themselves are built from these settings in ``train/optim.py``.
"""

from __future__ import annotations

from typing import Any

from rlhf_jax.config.names import OPTIMIZER_NAMES

# transformers' Adafactor arguments with a meaning here, and their defaults (lr comes from optim.lr and its
# schedule, so relative_step is off: transformers refuses a manual lr with relative_step=True).
ADAFACTOR_DEFAULTS = {"eps": (1e-30, 1e-3), "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": None,
                      "scale_parameter": True, "relative_step": False, "warmup_init": False}
ADAFACTOR_MEANING = {"eps": "(squared-gradient epsilon, parameter-scale floor)",
                     "clip_threshold": "RMS bound of the normalised update (> 0)",
                     "decay_rate": "second-moment average coefficient 1 - t^decay_rate at step t (< 0)",
                     "beta1": "first-moment coefficient (no bias correction); None: no first moment",
                     "scale_parameter": "multiply the step size by max(eps[1], RMS(parameter))",
                     "relative_step": "False only: the lr is optim.lr and its schedule",
                     "warmup_init": "False only (a relative-step option)"}
# PyTorch arguments that pick an implementation of the same arithmetic: accepted, nothing to do in XLA.
IMPLEMENTATION_ONLY = ("foreach", "fused", "capturable", "differentiable")
# PyTorch arguments accepted at the one value whose update rule is the one built here.
ONLY_AT = {"adamw": {"amsgrad": False, "maximize": False}, "adam": {"amsgrad": False, "maximize": False},
         "sgd": {"momentum": 0, "dampening": 0, "nesterov": False, "maximize": False}, "lion": {},
         "adafactor": {"relative_step": False, "warmup_init": False}}
_OWN_KEYS = ("lr", "betas", "eps", "weight_decay")  # the optim section's own keys (Adafactor's eps is its pair)


def optimizer_settings(name: str, overrides: Any, where: str = "optim.override_optimizer_config") -> dict:
    """The further arguments of optimizer ``name`` given in ``overrides`` (keyword -> value), checked:
    Adafactor's settings with its defaults filled in (``{}`` for the others); ValueError naming ``where.<arg>``
    for an argument with no meaning here or a value that cannot be honoured."""
    key = name.lower()
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"optim.optimizer={name!r}: choose one of {', '.join(OPTIMIZER_NAMES.values())}")
    given = dict(overrides or {})
    out = dict(ADAFACTOR_DEFAULTS) if key == "adafactor" else {}
    for arg, value in given.items():
        if arg in IMPLEMENTATION_ONLY:
            continue
        if arg in ONLY_AT[key]:
            if value != ONLY_AT[key][arg]:
                raise ValueError(f"{where}.{arg}={value!r} is not supported for {OPTIMIZER_NAMES[key]} "
                                 f"(only {ONLY_AT[key][arg]!r})" + (": set optim.lr and its schedule instead of "
                                                                  "relative steps" if key == "adafactor" else ""))
        elif key == "adafactor" and arg in ADAFACTOR_DEFAULTS:
            out[arg] = value
        elif arg in _OWN_KEYS:
            raise ValueError(f"{where}.{arg}: set optim.{arg} instead")
        else:
            raise ValueError(f"{where}.{arg}: {OPTIMIZER_NAMES[key]} has no argument {arg!r} rlhf_jax can honour"
                             + (f" (it reads {', '.join(sorted(ADAFACTOR_DEFAULTS))})" if key == "adafactor" else ""))
    if key == "adafactor":
        eps = out["eps"]
        if not (isinstance(eps, (list, tuple)) and len(eps) == 2 and all(float(e) >= 0 for e in eps)):
            raise ValueError(f"{where}.eps={eps!r}: Adafactor's eps is a pair (squared-gradient epsilon, "
                             "parameter-scale floor), e.g. [1e-30, 1e-3]")
        if not float(out["clip_threshold"]) > 0 or not float(out["decay_rate"]) < 0:
            raise ValueError(f"{where}: Adafactor needs clip_threshold > 0 and decay_rate < 0 "
                             f"(got {out['clip_threshold']!r}, {out['decay_rate']!r})")
        if out["beta1"] is not None and not 0 <= float(out["beta1"]) < 1:
            raise ValueError(f"{where}.beta1={out['beta1']!r} must be in [0, 1) or null (no first moment)")
    return out
