"""Responses for a data set: ``python -m rlhf_jax.generate data.path=test.parquet model.path=DIR data.output_path=out.parquet``.

verl's ``main_generation`` in keys and layout (``generation.yaml``, whose defaults these are):
``data.path`` (parquet/json/jsonl/csv or builtin:<name>), ``data.prompt_key``, ``data.n_samples``
(responses per prompt), ``data.batch_size``, ``data.output_path``, ``model.path``, ``rollout.temperature``
/ ``top_k`` / ``top_p`` / ``do_sample`` / ``prompt_length`` / ``response_length`` / ``dtype``; any rlhf_jax key too
(``data.prompt_template=raw``, ``trainer.seed=7``). The output parquet has one row per prompt with
``data_source``, ``prompt``, ``reward_model.ground_truth``, ``extra_info`` and ``responses`` (a list of
``n_samples`` strings): what ``python -m rlhf_jax.evaluate`` reads.

The prompts are sampled exactly as the trainer's validation samples them (same batches, same key,
``trainer.seed``), so with the same settings the responses are the ones validation would score. With
``actor_rollout_ref.rollout.multi_turn.enable=True`` each response is a whole multi-turn trajectory (tool calls,
tool responses, environment turns), as validation samples and scores it.
"""

from __future__ import annotations

import os
import sys

# verl's generation.yaml keys -> schema keys (the sampling settings are validation's: rollout.val_kwargs)
_V = "actor_rollout_ref.rollout.val_kwargs."
MAPPING = {
    "data.path": "data.val_files",
    "data.prompt_key": "data.prompt_key",
    "data.n_samples": _V + "n",
    "data.batch_size": "data.val_batch_size",
    "model.path": "actor_rollout_ref.model.path",
    "rollout.temperature": _V + "temperature",
    "rollout.top_k": _V + "top_k",
    "rollout.top_p": _V + "top_p",
    "rollout.do_sample": _V + "do_sample",
    "rollout.prompt_length": "data.max_prompt_length",
    "rollout.response_length": "data.max_response_length",
    "rollout.dtype": "actor_rollout_ref.rollout.dtype",
}
# generation.yaml's defaults
DEFAULTS = {"data.n_samples": 5, "data.batch_size": 128, "rollout.temperature": 1.0, "rollout.top_k": 50,
            "rollout.top_p": 0.7, "rollout.do_sample": True, "rollout.prompt_length": 1536,
            "rollout.response_length": 512}
OWN = {"data.output_path": None, "rollout.n": 1, "rollout.ignore_eos": False}
IGNORED = ("trainer.*", "ray_kwargs.*", "actor.*", "model.external_lib", "data.trust_remote_code", "rollout._target_",
           "rollout.name", "rollout.mode", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
           "rollout.free_cache_engine", "rollout.load_format", "rollout.tensor_model_parallel_size",
           "rollout.data_parallel_size", "rollout.max_num_batched_tokens", "rollout.max_model_len",
           "rollout.max_num_seqs", "rollout.log_prob_micro_batch_size*", "rollout.disable_log_stats",
           "rollout.enable_chunked_prefill", "rollout.calculate_log_probs")


def config_from_args(argv: list[str]):
    """(finalizable schema config, output path) from verl-style arguments."""
    from rlhf_jax import verl_cli

    settings = {**DEFAULTS, **verl_cli.parse_args(argv)}
    cfg, own = verl_cli.apply(settings, MAPPING, IGNORED, OWN, "generate")
    if not own["data.output_path"]:
        raise ValueError("generate: data.output_path=<file.parquet> is required")
    if own["rollout.n"] != 1 or own["rollout.ignore_eos"]:
        raise ValueError("generate: rollout.n must be 1 (data.n_samples sets the responses per prompt) and "
                         "rollout.ignore_eos False (responses end at the end-of-sequence token)")
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    if val.temperature == 0 and val.n > 1:  # as verl: greedy decoding gives n identical responses
        raise ValueError("generate: rollout.temperature=0 needs data.n_samples=1")
    return cfg, os.path.expanduser(own["data.output_path"])


def generate(cfg, output_path: str) -> list[dict]:
    """Sample ``val_kwargs.n`` responses for every prompt of ``data.val_files`` and write them to a parquet."""
    import jax
    import pandas as pd

    from rlhf_jax.agents.multi_turn import multi_turn_rollout
    from rlhf_jax.config import finalize
    from rlhf_jax.models.hub import resolve_model_path
    from rlhf_jax.data import dataset_from_config, loader_from_config
    from rlhf_jax.rewards.reward_model import decode_responses
    from rlhf_jax.rollout import Sampler
    from rlhf_jax.parallel.hosts import to_local
    from rlhf_jax.train.engine import Role
    from rlhf_jax.rollout.generation import generate_batch, key_function
    from rlhf_jax.train.setup import (load_policy, load_tokenizer, mesh_and_rules, sampler_graphdef, sampling_params,
                                      tool_schemas)

    if jax.process_count() > 1:
        raise ValueError("generate runs in one process (it writes one file)")
    cfg = finalize(cfg, num_devices=jax.device_count())
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.revision)
    tok = load_tokenizer(resolve_model_path(cfg.data.tokenizer) if cfg.data.tokenizer else model_path,
                         cfg.data.chat_template)
    dataset = dataset_from_config(cfg.data, tok, "val", tool_schemas(cfg))
    mesh, rules = mesh_and_rules(cfg)
    sampling = sampling_params(cfg, model_path, tok, validation=True)
    policy = Role(load_policy(cfg, model_path, mesh, rules), mesh)
    sampler = Sampler(sampler_graphdef(cfg, policy.config, policy.task, policy.graphdef), mesh=mesh, rules=rules, max_positions=policy.config.max_position_embeddings)
    key = key_function(mesh)(sampling.seed, 0)  # the key of the trainer's validation
    multi_turn = multi_turn_rollout(cfg, sampler.graphdef, policy.config, tok, mesh, rules)
    rows = []
    for pb in loader_from_config(cfg.data, tok, "val", dataset=dataset):
        if multi_turn is None:
            out, keep = generate_batch(sampler, policy.params, mesh, cfg.derived.dp_size, pb, sampling, key)
            mask = out.response_mask
        else:  # the trajectory's text: assistant turns and the tool / environment turns between them
            out, _ = multi_turn.rollout(policy.params, pb, sampling, key)
            keep, mask = len(pb) * sampling.n, out.valid_mask()
        texts = decode_responses(tok, to_local(out.responses)[:keep], to_local(mask)[:keep])
        n = sampling.n
        for i in range(len(pb)):
            row = {"data_source": pb.data_source[i], "prompt": pb.raw_prompt[i],
                   "reward_model": {"ground_truth": pb.ground_truth[i]}, "responses": texts[i * n:(i + 1) * n]}
            if pb.extra_info[i]:
                row["extra_info"] = pb.extra_info[i]
            rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    pd.DataFrame(rows).to_parquet(output_path)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from rlhf_jax import console

    console.configure()
    try:
        cfg, output_path = config_from_args(argv)
        rows = generate(cfg, output_path)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} prompts x {len(rows[0]['responses']) if rows else 0} responses to {output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
