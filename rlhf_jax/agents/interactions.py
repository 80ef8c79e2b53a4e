"""Interactions (verl's ``multi_turn.interaction_config_path``): a simulated user answers the assistant's turns.

After an assistant turn without tool calls, the row's interaction reads the conversation so far (chat messages:
the prompt's, then each turn's) and returns ``(should_terminate, user message, turn score, extra)``; the message is
appended as a user turn (untrained) and the assistant goes on, until the interaction ends the episode or a turn or
length limit does. Tool calls, when tools are configured, are answered by the tools first, as in verl's agent loop.
The reward stays the reward function's; the interaction's scores reach it as ``extra_info["turn_scores"]``.

The configuration file is verl's::

    interaction:
      - name: gsm8k                                                   # a row picks it by name
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

and each data row names its interaction in ``extra_info.interaction_kwargs`` (``{"name": "gsm8k", ...}``; the rest
are keyword arguments of ``start_interaction`` and ``generate_response``). ``class_name`` is verl's shipped
``Gsm8kInteraction`` (built in here), a dotted import path or ``path/to/file.py:Class``. A class is verl's
``BaseInteraction`` interface: ``start_interaction(instance_id, **kwargs)``, ``generate_response(instance_id,
messages, **kwargs)`` (async or not) on one instance per entry. A user's module that imports
``verl.interactions.base`` where verl is not installed gets this module's ``BaseInteraction`` in its place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import threading
import types
import uuid
from typing import Any, Callable

from rlhf_jax.agents.loading import load_from_file, read_yaml_file
from rlhf_jax.agents.turns import Reply, ReplyFn
from rlhf_jax.rewards import gsm8k

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


class BaseInteraction:
    """verl's interaction interface: one instance serves many episodes, told apart by ``instance_id``."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id if instance_id is not None else str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        """verl's default answer (a subclass answers for itself): go on, score 0.8."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, *args, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, *args, **kwargs) -> None:
        return None


class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K interaction: the last assistant message is graded against ``ground_truth`` (flexible: its last
    number); a right answer ends the episode with score 1, a wrong one asks the assistant to try again."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._answers: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs) -> str:
        instance_id = instance_id if instance_id is not None else str(uuid.uuid4())
        self._answers[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        content = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._answers[instance_id]["response"] = content if content.startswith("#### ") else "#### " + content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._answers[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible")

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._answers.pop(instance_id, None)


BUILTIN = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
           "gsm8k": Gsm8kInteraction}


@dataclasses.dataclass(frozen=True)
class InteractionEntry:
    name: str
    cls: type
    config: dict


def read_config(path: str) -> list[InteractionEntry]:
    """The entries of verl's interaction file, their classes imported (nothing instantiated)."""
    where = f"{KEY}={path}"
    doc = read_yaml_file(path, where)
    items = doc.get("interaction") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) and i.get("class_name") for i in items):
        raise ValueError(f"{where}: expected an 'interaction:' list of entries with a class_name")
    out: list[InteractionEntry] = []
    for item in items:
        class_name = str(item["class_name"])
        name = item.get("name") or _default_name(class_name)
        if any(e.name == name for e in out):
            raise ValueError(f"{where}: interaction {name!r} is listed twice")
        config = item.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}: interaction {name!r}: config must be a mapping")
        out.append(InteractionEntry(str(name), _load_class(class_name, f"{where}: interaction {name!r}"),
                                    {**config, "name": str(name)}))
    return out


def _default_name(class_name: str) -> str:
    """verl's: the class's name without an ``Interaction`` suffix, lower-cased."""
    simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def _load_class(class_name: str, where: str) -> type:
    if class_name in BUILTIN:
        return BUILTIN[class_name]
    with _verl_base_shim():
        if ":" in class_name:
            cls = load_from_file(class_name, where)
        else:
            module_name, _, attr = class_name.rpartition(".")
            try:
                module = importlib.import_module(module_name) if module_name else None
            except Exception as e:  # noqa: BLE001 - the user's module: one line naming the key
                raise ValueError(f"{where}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
            if module is None or not hasattr(module, attr):
                raise ValueError(f"{where}: {class_name!r} names no class (give module.Class or path.py:Class)")
            cls = getattr(module, attr)
    if not (inspect.isclass(cls) and callable(getattr(cls, "generate_response", None))):
        raise ValueError(f"{where}: {class_name!r} is not an interaction class (it needs generate_response)")
    return cls


class _verl_base_shim:
    """While a user's interaction module is imported, ``verl.interactions.base`` is this module's BaseInteraction
    where verl itself is not installed (nothing else of verl is provided)."""

    NAMES = ("verl", "verl.interactions", "verl.interactions.base")

    def __enter__(self):
        self.added = []
        if importlib.util.find_spec("verl") is not None:
            return self
        for name in self.NAMES:
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__path__ = []  # a package, so that the submodule import resolves
                sys.modules[name] = module
                self.added.append(name)
        sys.modules["verl.interactions.base"].BaseInteraction = BaseInteraction
        return self

    def __exit__(self, *exc):
        for name in self.added:
            sys.modules.pop(name, None)
        return False


def check_rows(names: list[str], examples) -> None:
    """Every data row names one of the interactions (``extra_info.interaction_kwargs.name``), as verl requires:
    one line naming the first row that does not, before any model loads."""
    for e in examples:
        kwargs = (e.extra_info or {}).get("interaction_kwargs") if isinstance(e.extra_info, dict) else None
        name = kwargs.get("name") if isinstance(kwargs, dict) else None
        if name not in names:
            found = "has no extra_info.interaction_kwargs.name" if name is None else f"names interaction {name!r}"
            raise ValueError(f"{e.where}: {found}; {KEY} defines {sorted(names)}")


class Interactions:
    """The run's interactions (one instance per entry) and the thread their coroutines run on (one event loop for
    the run: an interaction's state may hold loop-bound objects)."""

    def __init__(self, entries: list[InteractionEntry]):
        self.by_name = {}
        for e in entries:
            try:
                self.by_name[e.name] = e.cls(config=dict(e.config))
            except Exception as err:  # noqa: BLE001 - the user's constructor
                raise ValueError(f"{KEY}: interaction {e.name!r} failed to start ({type(err).__name__}: {err})") from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="interactions", daemon=True)
        self._thread.start()

    def call(self, fn, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, awaited on the interactions' loop when it is a coroutine function."""
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.run_coroutine_threadsafe(_awaited(result), self._loop).result()
        return result

    def pick(self, extra_info: Any, row: int) -> tuple[Any, dict]:
        """The interaction a data row names (``extra_info.interaction_kwargs.name``) and its keyword arguments."""
        kwargs = (extra_info or {}).get("interaction_kwargs") if isinstance(extra_info, dict) else None
        if not isinstance(kwargs, dict) or "name" not in kwargs:
            raise ValueError(f"{KEY}: prompt {row} of the batch has no extra_info.interaction_kwargs with a 'name' "
                             f"(one of {sorted(self.by_name)})")
        if kwargs["name"] not in self.by_name:
            raise ValueError(f"{KEY}: prompt {row} names interaction {kwargs['name']!r}; the file defines "
                             f"{sorted(self.by_name)}")
        return self.by_name[kwargs["name"]], dict(kwargs)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


async def _awaited(awaitable):
    return await awaitable


def interaction_reply(interactions: Interactions, interaction: Any, kwargs: dict, messages: list[dict],
                      tools: ReplyFn | None, clean: Callable[[str], str], scores: list[float]) -> ReplyFn:
    """One episode's replies: ``tools`` answer a turn with tool calls, the interaction any other turn.
    ``messages``: the chat so far (the prompt's; each turn and answer is appended); ``clean``: a turn's text as the
    interaction reads it (special tokens removed); ``scores`` collects the interaction's turn scores."""
    request_id = uuid.uuid4().hex
    try:  # verl's start_interaction returns the instance id (the one it is given, unless it makes its own)
        instance_id = interactions.call(interaction.start_interaction, request_id, **kwargs) or request_id
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ValueError(f"{KEY}: interaction {kwargs.get('name')!r}: start_interaction raised {type(e).__name__}: "
                         f"{e}") from None

    def reply(text: str, last_turn: bool) -> Reply | None:
        messages.append({"role": "assistant", "content": clean(text)})
        if last_turn:  # nothing would read an answer
            return None
        answered = tools(text, last_turn) if tools is not None else None
        if answered is not None:
            messages.extend(answered.messages)
            return answered
        try:
            done, content, score, _ = interactions.call(interaction.generate_response, instance_id, messages,
                                                        **kwargs)
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming the key
            raise ValueError(f"{KEY}: interaction {kwargs.get('name')!r} raised {type(e).__name__}: {e}") from None
        if score is not None:
            scores.append(float(score))
        message = {"role": "user", "content": str(content)}
        messages.append(message)
        return Reply([message], done=bool(done), reward=float(score or 0.0))

    return reply
