"""A run whose last ``mesh.rollout_processes`` processes sample while the others train (parallel/groups.py).

The schedule is the experience buffer's (train/experience.py), in rounds of ``experience.buffer_size`` batches.
With ``experience.overlap`` and one batch a round, batch 0 is sampled with the starting weights (version 0), batch
k >= 1 with version k - 1, and each training step waits at its end for the next batch, so a step boundary (a
checkpoint, a stop) holds it, as in one process. Without overlap a round is sampled when nothing is left to train
on, with the weights as they are, while the training processes wait.

- The training processes' experience buffer is a :class:`RemoteExperience`: when a round falls due at step s it
  sends its current weights "for batch b" for each batch b of the round (a version number alone when the
  sampling side has them already); with overlap it learns on batch s meanwhile, then receives the round.
- The sampling processes run :class:`SamplingLoop`: for each batch, receive the weights for it, draw the prompts,
  sample and score them (``trainer_rollout.Producer``), send the ``ScoredBatch`` (train/scored_handoff.py).

With ``experience.partial_rollout_tokens`` (partial rollouts, rollout/segments.py) the training side also offers
each update at once ("weights.update" for the batch being sampled): the sampling side takes it at the next segment
boundary (or, with ``experience.partial_rollout_wait``, waits for it at the first one), and in any case before it
sends the batch, so the weights for the next batch are a version number alone.

Weights travel as a flat {path: array} dict, with their layout sent first: the sampler's state (in
``rollout.weight_dtype`` when set), or under LoRA the adapters alone (the sampling side holds the base weights
and merges them in itself, as the training side would: ``Rollouts.sampler_weights``). Every wait is bounded by
``mesh.handoff_timeout_s`` (parallel/handoff.py).
"""

from __future__ import annotations

import functools
import pickle
import socket
import sys
import time
from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding

from rlhf_jax.parallel import groups, watchdog
from rlhf_jax.parallel.handoff import Channel
from rlhf_jax.train import experience as X
from rlhf_jax.train import metrics as M
from rlhf_jax.train.scored_handoff import receive_scored, send_scored
from rlhf_jax.types import ScoredBatch

WEIGHTS = "weights"
UPDATE = "weights.update"  # partial rollouts: an update offered while its successor batch is being sampled


def split_groups(cfg) -> tuple[groups.ProcessGroup, groups.ProcessGroup] | None:
    """(training, sampling) process groups of a split run, or None."""
    k = int(cfg.mesh.rollout_processes or 0)
    return groups.split(jax.process_count(), k) if k else None


def experience_buffer(cfg, c, total_steps: int, loader, produce, rollouts):
    """The RL trainer's experience buffer: batches produced in this process (``ExperienceBuffer``), or by the
    sampling processes of a split run (``RemoteExperience``, on a training process)."""
    from rlhf_jax.train.trainer_experience import ExperienceBuffer

    split, e = split_groups(cfg), cfg.experience
    if split is None:
        return ExperienceBuffer(e.buffer_size, e.overlap, total_steps, loader, produce)
    sampler_state = rollouts.adapters if rollouts.lora else rollouts.sampler_weights
    return RemoteExperience(Channel(deadline_s=cfg.mesh.handoff_timeout_s), *split, total_steps, loader,
                            sampler_state, c.rollout_mesh, c.mesh, c.rules, int(c.sampling.pad_token_id),
                            partial=bool(e.partial_rollout_tokens), buffer_size=int(e.buffer_size),
                            overlap=bool(e.overlap))


def join_split(cfg) -> str:
    """Join this process's group of a split run; "training" or "sampling"."""
    training, sampling = split_groups(cfg)
    mine = training if jax.process_index() in training.processes else sampling
    groups.join(mine)
    print(f"split run: process {jax.process_index()} on {socket.gethostname()} {_VERB[mine.name]} (training: "
          f"processes {_span(training.processes)}, sampling: {_span(sampling.processes)})", file=sys.stderr, flush=True)
    return mine.name


_VERB = {"training": "trains", "sampling": "samples"}


def _span(processes: tuple[int, ...]) -> str:
    return str(processes[0]) if len(processes) == 1 else f"{processes[0]}-{processes[-1]}"


def sampling_loop(cfg) -> "SamplingLoop":
    training, sampling = split_groups(cfg)
    return SamplingLoop(cfg, Channel(deadline_s=cfg.mesh.handoff_timeout_s), training, sampling)


def _key(path) -> str:
    return "/".join(map(str, path))


def _flat(state) -> dict[str, Any]:
    return {_key(path): v.get_value() for path, v in nnx.to_flat_state(state)}


class RemoteExperience:
    """The training processes' experience buffer in a split run (the ``ExperienceBuffer`` interface)."""

    def __init__(self, channel: Channel, training: groups.ProcessGroup, sampling: groups.ProcessGroup,
                 total_steps: int, loader, sampler_state: Callable[[], Any], sampling_mesh, train_mesh, rules,
                 pad_token_id: int, partial: bool = False, buffer_size: int = 1, overlap: bool = True):
        """``loader``: this process's prompt loader, drawn in step with the sampling side's (its rows of each batch,
        and the state a checkpoint keeps); ``sampler_state()``: the sampler's weights on the training mesh;
        ``partial``: offer each update to the batch being sampled (partial rollouts); ``buffer_size`` and
        ``overlap``: the schedule of rounds, as ``ExperienceBuffer``'s."""
        self.channel, self.training, self.sampling, self.partial = channel, training, sampling, partial
        self.buffer_size, self.overlap = buffer_size, overlap
        self.total_steps, self.loader, self.sampler_state = total_steps, loader, sampler_state
        self._started = False
        self.sampling_mesh, self.train_mesh, self.rules, self.pad = sampling_mesh, train_mesh, rules, pad_token_id
        self.pending: list[ScoredBatch] = []
        self.timeline: list[tuple[str, int, float, float]] = []
        self._sent: int | None = None  # the weight version the sampling side holds
        self._next_batch: int | None = None  # the batch the sampling side waits for weights for
        self._updated: int | None = None  # partial rollouts: the last batch offered its update

    def _send_weights(self, batch: int, version: int, name: str = WEIGHTS) -> int:
        """Send the weights for ``batch`` under ``name`` (a version number alone when the sampling side has them);
        the bytes of the arrays sent (their global size)."""
        message: dict[str, Any] = {"version": version, "arrays": version != self._sent}
        flat = None
        if message["arrays"]:
            flat = _flat(self.sampler_state())
            message["layout"] = {k: (tuple(v.shape), str(v.dtype), tuple(v.sharding.spec)) for k, v in flat.items()}
        receivers = self.sampling.processes
        if self.training.is_first:
            self.channel.send_bytes(f"{name}.version", batch, pickle.dumps(message), receivers)
        if flat is not None:
            dst = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(self.sampling_mesh, v.sharding.spec))
                   for k, v in flat.items()}
            self.channel.send(name, batch, flat, dst, receivers)
            self._sent = version
        if name == WEIGHTS:
            self._next_batch = batch + 1
        return 0 if flat is None else sum(int(v.nbytes) for v in flat.values())

    def _receive(self, batch: int) -> ScoredBatch:
        start = time.perf_counter()
        scored = receive_scored(self.channel, batch, self.sampling_mesh, self.train_mesh, self.rules,
                                self.sampling.processes, self.pad)
        state = self.loader.get_state()  # this process's rows of the batch's prompts: the sampling side drew them
        for _ in range(scored.draws):  # (dynamic sampling draws further batches for one)
            next(self.loader)
        self.timeline.append(("receive", batch + 1, start, time.perf_counter()))
        return scored.replace(data_state=state)

    def _start(self, step: int) -> None:
        """Tell the sampling side where the run starts: the first batch it samples (after a resume, the one
        after those pending here) and the loader's position before its prompts (this loader's: it stands after
        the pending batches' prompts, however many batches each drew)."""
        self._started = True
        if self.training.is_first:
            start = {"first": step + len(self.pending), "step": step, "loader": self.loader.get_state()}
            self.channel.send_bytes(f"{WEIGHTS}.start", 0, pickle.dumps(start), self.sampling.processes)

    def _round(self, first: int, version: int) -> tuple[range, int]:
        """Ask for the round of batches from ``first`` (``buffer_size`` of them, to the last step), all sampled with
        this step's weights (version ``version``); (the round's batches, the bytes sent)."""
        batches = range(first, min(first + self.buffer_size, self.total_steps))
        return batches, sum(self._send_weights(b, version) for b in batches)

    def train_next(self, step: int, weights: Callable[[], Any], learn: Callable[[ScoredBatch, M.Timer], dict]) -> dict:
        """Step ``step`` (updates so far) on batch ``step``, asking for rounds of batches as ``ExperienceBuffer``
        produces them: when nothing is pending, sampled before the step trains; with overlap, the next round
        asked for before the update and received at the step's end. ``weights`` is unused (the sampling side's
        copy comes from ``sampler_state``)."""
        timer = M.Timer()
        watchdog.set_doing(f"step {step}: training")
        if not self._started:
            self._start(step)
        sent, ahead = 0, range(0)
        with timer("step"):
            if not self.pending:  # a round sampled with the weights as they are (version ``step``)
                now, sent = self._round(step, step)
                with timer("wait_rollout"):
                    self.pending.extend(self._receive(b) for b in now)
            first = step + len(self.pending)
            if self.overlap and X.production_due(len(self.pending), self.buffer_size, True) and first < self.total_steps:
                ahead, more = self._round(first, step)  # sampled with this step's weights, before its update
                sent += more
        start = time.perf_counter()
        metrics = learn(self.pending[0], timer)
        self.timeline.append(("train", step + 1, start, time.perf_counter()))
        self.pending.pop(0)
        if self.partial and step + 1 < self.total_steps:  # to batch step + 1, in flight: its later segments
            with timer("step"):
                sent += self._send_weights(step + 1, step + 1, UPDATE)
            self._updated = step + 1
        if ahead:
            with timer("step"), timer("wait_rollout"):
                self.pending.extend(self._receive(b) for b in ahead)
        metrics["split/weight_bytes_sent"] = float(sent)  # the adapters alone under LoRA
        metrics["timing_s/step"] = timer.seconds["step"]
        metrics["timing_s/wait_rollout"] = timer.seconds.get("wait_rollout", 0.0)
        return metrics

    def checkpoint(self) -> tuple[dict, list[dict], Any]:
        """(arrays, description, this process's loader state before the pending batch's prompts)."""
        return X.checkpoint_pending(self.pending, self.loader)

    def restore(self, arrays: dict, described: list[dict]) -> None:
        """Take back the pending batches of a checkpoint; the loader already stands before their prompts."""
        self.pending = X.restore_pending(self.loader, arrays, described)

    def close(self) -> None:
        """Tell the sampling side to stop where it waits: for the weights of the next batch after an early stop,
        or, after the last batch, for this word that its offers were taken (its transfer server must outlive
        them)."""
        if self._next_batch is not None and self.training.is_first:
            stop = pickle.dumps({"stop": True})
            in_flight = self._next_batch - 1
            if self.partial and self._updated != in_flight:  # a step abandoned before its update: the sampling
                # side would wait for that update at the end of the batch in flight
                self.channel.send_bytes(f"{UPDATE}.version", in_flight, stop, self.sampling.processes)
            self.channel.send_bytes(f"{WEIGHTS}.version", self._next_batch, stop, self.sampling.processes)


class SamplingLoop:
    """The sampling processes' part of a split run: weights in, produced batches out."""

    def __init__(self, cfg, channel: Channel, training: groups.ProcessGroup, sampling: groups.ProcessGroup):
        from rlhf_jax import algos
        from rlhf_jax.agents.multi_turn import multi_turn_rollout
        from rlhf_jax.data import loader_from_config
        from rlhf_jax.rollout import Sampler
        from rlhf_jax.train.setup import load_actor, prepare, sampler_graphdef
        from rlhf_jax.train.trainer_rollout import Producer, Rollouts, scorers
        from rlhf_jax.runtime.preemption import STOP

        c = prepare(cfg)
        self.c, self.cfg, self.channel, self.training, self.sampling = c, c.cfg, channel, training, sampling
        cfg = self.cfg
        mesh = c.rollout_mesh  # the sampling group's own data-parallel mesh
        model = load_actor(cfg, c.model_path, mesh, c.rules)  # version 0, read as the training side reads it
        graphdef, state = nnx.split(model)
        # under LoRA the sampler runs the plain model on merged weights
        self.graphdef = sampler_graphdef(cfg, model.config, model.task, None if model.config.lora else graphdef)
        sampler = Sampler(self.graphdef, mesh=mesh, rules=c.rules, max_positions=model.config.max_position_embeddings)
        rewards, reward_model = scorers(cfg, mesh, c.rules)
        multi_turn = multi_turn_rollout(cfg, self.graphdef, model.config, c.tokenizer, mesh, c.rules)
        self.rollouts = Rollouts(None, sampler, c.tokenizer, rewards, mesh=mesh, rules=c.rules,
                                 dp_size=mesh.devices.size, weight_dtype=cfg.actor_rollout_ref.rollout.weight_dtype,
                                 compute_dtype=cfg.actor_rollout_ref.rollout.dtype, lora=model.config.lora,
                                 reward_model=reward_model, multi_turn=multi_turn)
        self.loader = loader_from_config(cfg.data, c.tokenizer, "train", num_epochs=None, dataset=c.train_dataset)
        self.producer = Producer(self.rollouts, c.sampling, cfg.algorithm.filter_groups,
                                 greedy_baseline=algos.estimator_info(cfg.algorithm.adv_estimator).needs_greedy_baseline,
                                 rollout_data_dir=cfg.trainer.rollout_data_dir, loader=self.loader, stop=STOP,
                                 partial_tokens=int(cfg.experience.partial_rollout_tokens or 0))
        # what the training side sends replaces its part of this state: all of it, or under LoRA the adapters
        self.state = state if model.config.lora else self.rollouts.sampler_weights(state)
        self.weights = self._sampler_weights()  # version 0
        self.version = 0
        self.partial_wait = bool(cfg.experience.partial_rollout_wait)
        self._updated: int | None = None  # the last batch whose update was taken
        self.stopped = False  # the training side said stop instead of sending an update
        self.receive_s = 0.0  # seconds spent taking weights in (pulls, LoRA merge) for the batch being made
        self.train_mesh = c.mesh  # the training processes' mesh (setup.run_devices), known to every process

    def _sampler_weights(self):
        """What the sampler runs on: the state as received, or under LoRA its adapters merged into the base."""
        return self.rollouts.sampler_weights(self.state) if self.rollouts.lora else self.state

    def _weights_for(self, batch: int) -> bool:
        """Take the weights for ``batch``; False when the training side says stop."""
        message = pickle.loads(self.channel.receive_bytes(f"{WEIGHTS}.version", batch, self.training.processes[0]))
        if message.get("stop"):
            return False
        self._take(message, WEIGHTS, batch)
        return True

    def _refresh(self, batch: int) -> tuple[Any, int] | None:
        """Between the segments of ``batch``: its update, once (see ``_update``)."""
        return None if self._updated == batch else self._update(batch, self.partial_wait)

    def _update(self, batch: int, wait: bool) -> tuple[Any, int] | None:
        """Partial rollouts: the update offered to ``batch`` in flight, taken if it has arrived (or waited for with
        ``wait``); (weights, version), or None."""
        sender = self.training.processes[0]
        if wait:
            data = self.channel.receive_bytes(f"{UPDATE}.version", batch, sender)
        else:
            data = self.channel.poll_bytes(f"{UPDATE}.version", batch, sender)
            if data is None:
                return None
        message = pickle.loads(data)
        self._updated = batch
        if message.get("stop"):  # the training side stopped before this update: the batch is not wanted
            self.stopped = True
            return None
        self._take(message, UPDATE, batch)
        return self.weights, self.version

    def _take(self, message: dict, name: str, batch: int) -> None:
        """Take the weights a version message announces (their arrays, when it says they come)."""
        start = time.perf_counter()
        if message["arrays"]:
            layout = message["layout"]
            src = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.train_mesh, jax.sharding.PartitionSpec(*spec)))
                   for k, (shape, dtype, spec) in layout.items()}
            dst = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.c.rollout_mesh, jax.sharding.PartitionSpec(*spec)))
                   for k, (shape, dtype, spec) in layout.items()}
            flat = self.channel.receive(name, batch, src, dst, self.training.processes)
            self.state = nnx.from_flat_state([(path, var.replace(value=flat[_key(path)]) if _key(path) in flat else var)
                                              for path, var in nnx.to_flat_state(self.state)])
            self.weights = jax.block_until_ready(self._sampler_weights())
            self.receive_s += time.perf_counter() - start
        self.version = int(message["version"])

    def run(self) -> int:
        """Sample from the batch the training side starts at (the loader takes the training side's position: the
        prompts are a pure function of the data, the seed and the position) until the last one, or until told to
        stop."""
        start = pickle.loads(self.channel.receive_bytes(f"{WEIGHTS}.start", 0, self.training.processes[0]))
        first, start_step = int(start["first"]), int(start["step"])
        self.loader.set_state(start["loader"])
        total = int(self.cfg.derived.total_training_steps)
        for batch in range(first, total):
            self.receive_s = 0.0
            if not self._weights_for(batch):
                return 0
            watchdog.set_doing(f"step {batch}: sampling")
            state = self.loader.get_state()
            pb = next(self.loader)
            # every batch sampled while the training side updates gets that update (not the first one of a run
            # that starts with nothing pending: the training side waits for it)
            updated = bool(self.producer.partial_tokens) and batch > start_step
            refresh = functools.partial(self._refresh, batch) if updated else None
            scored = self.producer.produce(pb, batch, state, False, weights=self.weights, version=self.version,
                                           refresh=refresh)
            if updated and self._updated != batch:  # finished before the update came: take it now, at no cost
                self._update(batch, wait=True)  # (the next batch's weights are its version number alone)
            if self.stopped:
                return 0
            scored.metrics["split/weight_receive_s"] = self.receive_s
            send_scored(self.channel, batch, scored, self.train_mesh, self.c.rules, self.training.processes)
        # the training side's last word: it has pulled the last batch (leaving earlier would end the transfer)
        self._weights_for(total)
        return 0
