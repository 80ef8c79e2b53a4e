"""A model learns to call the calculator for products it cannot compute in its head: an SFT warm-up on tool-call
demonstrations, then GRPO with multi-turn rollouts that run the calculator, on the built-in tiny model.

    python -m rlhf_jax.main --config=configs/grpo_tool.py

Problems: ``964*63=`` (a 3-digit times a 2-digit number; held-out validation problems from another seed). The
tiny model cannot multiply; with the ``calculator`` tool it can write a Hermes call
``<tool_call>{"name": "calculator", "arguments": {"expression": "964*63"}}</tool_call>``, read the ``tool``
message with the value and answer ``#### 60732``, scored by the arithmetic scorer (the text after the last
``####``: 1 when right, 0.1 for a wrong integer, 0 otherwise).

Stage 1 (``sft_warmup``, an SFT warm-up): ``builtin:calculator_demos`` conversations (user, assistant call, tool
result, assistant answer); only the assistant messages are trained, the tool result is not. Stage 2 (``grpo``):
GRPO from the SFT weights with ``multi_turn.enable``; the policy loss covers the assistant tokens only (the tool
responses are loss-mask holes). Validation (greedy, 100 held-out problems) runs before GRPO and every 25 steps.

Measured on a 2-core CPU (about 10 min for the command): greedy exact accuracy with the calculator 0 untrained,
0.24 after the 500-step warm-up (every problem calls the calculator; most answers miscopy its result), 0.82 after
200 GRPO steps (0.33 at step 50, 0.73 at step 100); 0 for every one of these weights with the tool switched off.

Accuracy without tools: validate a stage's export with the tool switched off,
``--config.actor_rollout_ref.rollout.multi_turn.enable=False --config.trainer.val_only=True`` and
``--config.actor_rollout_ref.model.path=<stage dir>/hf/global_step_<N>`` (see docs/multi_turn.md).
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config
from rlhf_jax.config.recipes import tiny_arithmetic

DEMOS = "builtin:calculator_demos"


def get_config() -> ConfigDict:
    cfg = tiny_arithmetic(base_config(), experiment="grpo_tool_tiny_calculator", n=8, steps=200, lr=5e-4)
    cfg.data.train_files = (f"{DEMOS}?train_size=4096",)
    cfg.data.val_files = (DEMOS,)
    cfg.data.prompt_template = "native"  # the chat template renders the tool messages
    cfg.data.max_prompt_length = 32
    cfg.data.max_response_length = 128  # call (~85 tokens) + tool response + answer
    cfg.data.train_batch_size = 16

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    mt.enable = True
    mt.tools = ("calculator",)
    mt.max_assistant_turns = 2
    mt.max_tokens_per_turn = 96

    actor = cfg.actor_rollout_ref.actor
    actor.use_kl_loss = True
    actor.kl_loss_coef = 0.001
    actor.kl_loss_type = "low_var_kl"
    actor.loss_agg_mode = "token-mean"
    cfg.algorithm.adv_estimator = "grpo"
    cfg.trainer.test_freq = 25
    cfg.trainer.save_freq = 50

    cfg.stages = (
        {"stage_name": "sft_warmup",
         "algorithm": {"type": "sft"},
         "data": {"multiturn": {"enable": True}, "max_length": 160, "train_batch_size": 32,
                  "micro_batch_size_per_gpu": -1},
         # A short warm-up on purpose: the model learns the call's format, and to copy the tool's result only
         # partly (greedy accuracy ~0.24), so the GRPO stage has something to learn from its rewards.
         "actor_rollout_ref.actor.optim": {"lr": 5e-3, "warmup_style": "constant", "lr_warmup_steps": 40},
         "trainer": {"total_training_steps": 500, "test_freq": 250, "save_freq": 250}},
        {"stage_name": "grpo",
         "algorithm": {"type": "rl", "adv_estimator": "grpo"},
         "trainer": {"total_training_steps": 200}},
    )
    return cfg
