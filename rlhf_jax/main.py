"""Entry point: ``python -m rlhf_jax.main --config=configs/grpo.py [--config.a.b=value ...]``.

Parses the recipe and overrides, validates them (a bad key or impossible batch
size stops here, naming the key), then trains. With no ``--config`` the GRPO
recipe runs on the built-in tiny model and synthetic arithmetic data.
"""

from __future__ import annotations

import os
import sys

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "grpo.py")
_ABANDON_WRITERS = []  # set when a checkpoint save failed: see the end of this file


def main(argv: list[str] | None = None, *, restart: bool = False) -> int:
    """``restart``: this process is the command itself, which may restart once to apply ``trainer.env_vars``."""
    argv = list(sys.argv if argv is None else argv)
    from rlhf_jax import console

    console.configure()
    from rlhf_jax.config import load_config_from_argv
    from rlhf_jax.runtime import process_env

    try:
        cfg = load_config_from_argv(argv, default=DEFAULT_RECIPE if os.path.exists(DEFAULT_RECIPE) else None)
        # the config's environment variables, before JAX's backend, the distributed runtime or any data library
        # reads them (a restart where something has read them already)
        env_vars = cfg.trainer.env_vars
        from rlhf_jax.config.schema import get_key

        problem = get_key("trainer.env_vars").failure(env_vars)
        if problem:
            raise ValueError(problem)
        command = [sys.executable, "-m", "rlhf_jax.main", *argv[1:]] if restart else None
        process_env.apply(None if env_vars is None else dict(env_vars), command=command)
    except (KeyError, ValueError, FileNotFoundError, AttributeError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from rlhf_jax.runtime import cpu_collectives

    cpu_collectives.ensure()  # before JAX's backend starts: threads for a mesh simulated on CPU devices
    from rlhf_jax.parallel.distributed import maybe_initialize

    maybe_initialize()  # a no-op unless a launcher set up several processes (launch/)
    if cfg.mesh.rollout_processes:  # this process samples or trains, with its group (parallel/groups.py)
        return _split(cfg)
    return _train(cfg)


def _error(message: str) -> int:
    """Report a failure in one line. In a split run the whole run stops with it (parallel/watchdog.py): the
    other side may be waiting for this process, or blocked with it in a collective."""
    _abort_split(message)
    sys.stderr.write(f"error: {message}\n")  # one write: storage threads' noise cannot split the line
    sys.stderr.flush()
    return 2


def _abort_split(message: str) -> None:
    """In a split run, stop every process now, before closing anything (closing may wait for a peer that is
    gone; the checkpoints are safe, see parallel/watchdog.py). Nothing happens in an ordinary run."""
    from rlhf_jax.parallel import watchdog

    if watchdog.current() is not None:
        watchdog.current().abort(message)


def _split(cfg) -> int:
    """A process of a run with ``mesh.rollout_processes``: it samples or trains with its group, watched by the
    others and watching them, so that one that fails or goes silent stops every process with one line."""
    import traceback

    import jax

    from rlhf_jax.parallel import watchdog
    from rlhf_jax.parallel.distributed import heartbeat_timeout_s
    from rlhf_jax.train.split_run import join_split

    role = join_split(cfg)
    dog = watchdog.install(watchdog.Watchdog(range(jax.process_count()),
                                             watchdog.silence_limit_s(heartbeat_timeout_s())))
    try:
        code = _sample(cfg) if role == "sampling" else _train(cfg)
    except BaseException as e:  # a crash: the others must not wait for this process until their deadlines
        traceback.print_exc()
        if watchdog.lost_a_peer(e):  # a collective or transfer broke because a peer went: the watchdog names it
            dog.await_verdict()
        return _error(f"{role} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    dog.finish()
    return code


def _train(cfg) -> int:
    """Train (every process of an ordinary run; the training processes of a split run)."""
    if cfg.mesh.context == 0:  # automatic: the split is planned on abstract weights before anything is built
        from rlhf_jax.plan.context import choose_context

        try:
            cfg.mesh.context, _ = choose_context(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
        except (KeyError, ValueError, FileNotFoundError, MemoryError) as e:
            return _error(str(e).splitlines()[0])
    from rlhf_jax.parallel.handoff import HandoffError
    from rlhf_jax.rewards import RewardFunctionError, RewardLoadError
    from rlhf_jax.runtime.checkpoint import CheckpointError, CheckpointWriteError
    from rlhf_jax.runtime.storage_noise import quiet_storage_noise_until_exit
    from rlhf_jax.runtime.preemption import STOP
    from rlhf_jax.train.stages import StageRunner, StageSetupError
    from rlhf_jax.train.tasks import trainer_class

    with STOP.installed():  # from here SIGTERM/SIGINT stop the run cleanly (train/preemption.py)
        try:  # everything that checks the config, data and checkpoints runs here, before any compilation
            # a config listing stages runs them in order; otherwise algorithm.type names the trainer
            trainer = (StageRunner if cfg.stages else trainer_class(cfg.algorithm.type))(cfg, lock_dir=True)
        except (KeyError, ValueError, FileNotFoundError) as e:
            return _error(f"{e}")
        try:  # the memory plan compiles every training pass and stops before the first step if one cannot fit
            trainer.plan_memory()
        except MemoryError as e:
            _abort_split(f"{e}")
            trainer.close()
            return _error(f"{e}")
        try:
            trainer.fit()  # a signal received during the set-up stops it before the first step
        except (RewardLoadError, RewardFunctionError, CheckpointError, StageSetupError, HandoffError) as e:  # a
            # reward worker found the file broken, a reward call failed under fail_on_error=True, the checkpoint to
            # resume from cannot be read, a save failed (a full disk), a later stage cannot be built, or the other
            # side of a split run missed a hand-off
            if isinstance(e, CheckpointWriteError):  # its writer threads print until the process ends
                quiet_storage_noise_until_exit()
            _abort_split(f"{e}")
            trainer.close()
            if isinstance(e, CheckpointWriteError):
                _ABANDON_WRITERS.append(e)
            return _error(f"{e}")
        except Exception as e:  # an out-of-memory in a step, despite the memory plan
            message = trainer.out_of_memory(e)
            if message is None:
                raise
            _abort_split(message)
            trainer.close()
            return _error(message)
    return 0


def _sample(cfg) -> int:
    """A sampling process of a run with ``mesh.rollout_processes``: batches out until the training side stops."""
    from rlhf_jax.parallel.handoff import HandoffError
    from rlhf_jax.runtime.preemption import STOP
    from rlhf_jax.train.split_run import sampling_loop

    with STOP.installed():
        try:
            return sampling_loop(cfg).run()
        except (KeyError, ValueError, FileNotFoundError, HandoffError) as e:
            return _error(f"{e}")


if __name__ == "__main__":
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # once, before JAX is imported: huge pages for XLA:CPU's buffers (hostmem.py)
    code = main(restart=True)
    if _ABANDON_WRITERS:  # the storage library's threads still hold the failed write; the interpreter's teardown
        # would finalize them and print their tracebacks. Everything of ours is closed and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
