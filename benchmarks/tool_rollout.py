"""Multi-turn rollout throughput with a slow tool: how much of the tool latency the rollout hides.

Three runs over the same prompts, each compiled first and then timed (best of ``--repeats``):

- ``sleep``: every turn calls a tool that sleeps ``--sleep`` seconds (``--turns`` assistant turns of
  ``--turn-tokens`` tokens, EOS ignored so every run decodes the same tokens);
- ``instant``: the same turns and tool responses, the tool returns at once;
- ``single``: one single-turn ``generate`` of the same number of new tokens (no tools, no turns).

Hidden latency = 1 - (sleep wall - instant wall) / (the tool calls' summed latency), and the same with the
device's measured wait for tools in place of the wall-time difference (robust to load changes between runs): the
loop is turn-synchronous, so all trajectories' calls of a turn run at once and the device waits about one sleep
per turn, not one per call.
Prints one table and writes JSON.

    python benchmarks/tool_rollout.py                      # tiny model, 16 trajectories, 4 turns, 0.5 s tool
    python benchmarks/tool_rollout.py --model ~/.cache/rlhf_jax/smollm2-135m-instruct --turn-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlhf_jax.agents import Tool  # noqa: E402
from rlhf_jax.agents.tool_calls import ParsedCalls, ToolCall, register_parser  # noqa: E402
from rlhf_jax.agents.turns import TurnSettings, run_turns  # noqa: E402
from rlhf_jax.models.hub import resolve_model_path  # noqa: E402
from rlhf_jax.models import from_pretrained  # noqa: E402
from rlhf_jax.rollout import SamplingParams, generate, rollout_key  # noqa: E402
from rlhf_jax.rollout.conversation_sampler import ConversationSampler  # noqa: E402


@register_parser("bench_every_turn")
def _every_turn(text: str) -> ParsedCalls:
    return ParsedCalls((ToolCall("bench_tool", {}),), ())


def _tool(seconds: float) -> Tool:
    def fn() -> str:
        time.sleep(seconds)
        return "42"
    return Tool("bench_tool", "returns 42", {"type": "object"}, fn)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "tool_rollout.json"))
    args = ap.parse_args(argv)

    path = resolve_model_path(args.model)
    model = from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    state = nnx.split(model)[1]
    questions = [f"Question {i}: what is {i} times {i + 3}? Use the tool." for i in range(args.trajectories)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    T, K = args.turn_tokens, args.turns
    params = SamplingParams(max_new_tokens=T, temperature=1.0, ignore_eos=True, pad_token_id=tok.pad_token_id)
    suffix_room = 64  # tokens of one rendered tool response, generously
    budget = K * T + (K - 1) * suffix_room
    sampler = ConversationSampler.for_model(model, capacity=max(map(len, prompts)) + budget, params=params,
                                            turn_len=T, stage=64)
    key = rollout_key(0)

    def multi_turn(seconds: float):
        settings = TurnSettings(response_length=budget, max_assistant_turns=K, max_tokens_per_turn=T,
                                format="bench_every_turn", tools=(_tool(seconds),))
        return run_turns(sampler, state, tok, prompts, settings, key, ())

    def timed(fn):
        fn()  # compile
        best, result = float("inf"), None
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = fn()
            elapsed = time.perf_counter() - start
            if elapsed < best:
                best, result = elapsed, out
        return best, result

    sleep_s, (trajs, timings) = timed(lambda: multi_turn(args.sleep))
    instant_s, (trajs0, timings0) = timed(lambda: multi_turn(0.0))
    sampled = sum(sum(t.loss_mask) for t in trajs)
    calls = sum(t.stats.calls for t in trajs)
    single_s, _ = timed(lambda: jax.block_until_ready(generate(
        model, prompts, max_new_tokens=K * T, temperature=1.0, ignore_eos=True, eos_token_ids=(),
        pad_token_id=tok.pad_token_id).batch))
    summed_latency = calls * args.sleep
    hidden = 1.0 - (sleep_s - instant_s) / summed_latency if summed_latency else float("nan")
    # the device's measured wait for tools, against the calls' summed latency (robust to load changes between runs)
    hidden_wait = 1.0 - timings.tool_wait_s / summed_latency if summed_latency else float("nan")
    rows = [("sleep", sleep_s, timings.tool_wait_s), ("instant", instant_s, timings0.tool_wait_s),
            ("single", single_s, 0.0)]
    print(f"{args.trajectories} trajectories x {K} turns x {T} tokens ({sampled} sampled tokens, {calls} tool calls of "
          f"{args.sleep} s), {jax.devices()[0].platform}")
    print(f"{'run':<10}{'wall s':>10}{'tokens/s':>12}{'tool wait s':>14}")
    for name, wall, wait in rows:
        print(f"{name:<10}{wall:>10.2f}{sampled / wall:>12.1f}{wait:>14.2f}")
    print(f"tool latency summed over calls {summed_latency:.1f} s; added wall time {sleep_s - instant_s:.2f} s; "
          f"hidden {hidden:.1%} (by wall times), {hidden_wait:.1%} (by the device's measured wait); device idle "
          f"during the sleep run {timings.tool_wait_s / sleep_s:.1%}")
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "sampled_tokens": sampled, "tool_calls": calls,
                       "wall_s": {name: wall for name, wall, _ in rows},
                       "tool_wait_s": {name: wait for name, _, wait in rows},
                       "summed_tool_latency_s": summed_latency, "hidden_fraction": hidden,
                       "hidden_fraction_by_wait": hidden_wait}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
