"""``python -m rlhf_jax.plan --config=configs/grpo.py --topology=v5p-8 [--config.key=value ...]``: the plan table of
the run on the target (see rlhf_jax/plan/__init__.py). Exit status 2 with a one-line message naming the keys to
change when the run cannot fit (at the first program that does not), or when the input is bad."""

from __future__ import annotations

import os
import sys

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                              "grpo.py")


def _topology(argv: list[str]) -> tuple[str, list[str]]:
    """The --topology=NAME argument (required) and the rest of argv."""
    rest, name = [], None
    it = iter(range(len(argv)))
    for i in it:
        arg = argv[i]
        if arg.startswith("--topology="):
            name = arg.split("=", 1)[1]
        elif arg == "--topology" and i + 1 < len(argv):
            name = argv[i + 1]
            next(it)
        else:
            rest.append(arg)
    if not name:
        from rlhf_jax.plan.targets import TARGETS

        raise ValueError(f"--topology=NAME is required; known: {', '.join(TARGETS)}, local")
    return name, rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    try:
        name, argv = _topology(argv)
        if name not in ("local",):
            from rlhf_jax.plan.targets import target

            target(name)  # an unknown name fails here, before anything is imported or compiled
            # Compiling needs no accelerator: without one, the CUDA plugin's version check (run when JAX starts,
            # whatever the target) would print a traceback of a missing driver.
            os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        from rlhf_jax.config import load_config_from_argv

        cfg = load_config_from_argv(argv, default=DEFAULT_RECIPE if os.path.exists(DEFAULT_RECIPE) else None)
    except (KeyError, ValueError, FileNotFoundError, AttributeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rlhf_jax.plan import format_table, plan_run

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        from rlhf_jax.plan.context import choose_context, with_context

        context, plan = choose_context(cfg, name, progress=progress)  # mesh.context=0: the smallest that fits
        if plan is None:
            plan = plan_run(with_context(cfg, context), name, progress=progress)
    except (KeyError, ValueError, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_table(plan), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
