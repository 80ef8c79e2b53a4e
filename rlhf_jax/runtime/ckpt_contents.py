"""What a checkpoint holds and what a resume restores, from the roles' ``checkpoint.save_contents`` /
``load_contents`` (verl's names: model, optimizer, extra, hf_model).

A checkpoint always records its step and the model's description (what export needs); the rest follows
the contents: ``model`` -> the role's parameters, ``optimizer`` -> its optimizer state, the actor's
``extra`` -> the data loader's position and the KL controller's coefficient (the trainer's state beyond
the weights; the learning-rate schedule and the sampling keys follow the step). The critic has no extra
state of its own, and only the actor is exported (``hf_model``).
"""

from __future__ import annotations

# (role, content) -> the checkpoint item holding it
ARRAY_ITEMS = {
    ("actor", "model"): "actor_params",
    ("actor", "optimizer"): "actor_opt",
    ("critic", "model"): "critic_params",
    ("critic", "optimizer"): "critic_opt",
}
EXTRA_FIELDS = ("data_state", "kl_coef")  # written only with the actor's "extra"


def array_items(actor: tuple[str, ...], critic: tuple[str, ...] | None) -> list[str]:
    """Checkpoint items for the given contents (``critic`` None: no critic in this run)."""
    roles = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    return [item for (role, what), item in ARRAY_ITEMS.items() if role in roles and what in roles[role]]


def saved_items(extra: dict) -> set[str]:
    """The array items a checkpoint holds, from its extra record (older checkpoints: the actor's only)."""
    return set(extra.get("items", ["actor_params", "actor_opt"]))


def items_to_restore(actor_load: tuple[str, ...], critic_load: tuple[str, ...] | None,
                     saved: set[str]) -> tuple[list[str], list[str]]:
    """(items to restore, items asked for that the checkpoint lacks because it was saved without them)."""
    wanted = array_items(actor_load, critic_load)
    return [i for i in wanted if i in saved], [i for i in wanted if i not in saved]


def restores_extra(actor_load: tuple[str, ...], extra: dict, required: tuple[str, ...] = EXTRA_FIELDS) -> bool:
    """True when the resume restores the trainer's state beyond the weights (asked for, and its ``required``
    fields saved: the RL trainer's data position and KL coefficient by default)."""
    return "extra" in actor_load and all(field in extra for field in required)
