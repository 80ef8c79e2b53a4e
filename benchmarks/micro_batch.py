"""Where one packed training micro-batch's time goes: SmolLM2-135M-Instruct, float32, one device.

Times (best of ``--repeats``) the pieces of one actor-update micro-batch as the trainer runs it
(packed rows with segment ids and restarting positions; only ``--logits`` positions go through
the vocabulary projection), each as its own jitted program:

- forward: the log-probs of the logit positions (the reference / old-log-prob pass);
- body forward+backward: the decoder stack only (embedding to final norm);
- full forward+backward: body + the tied vocabulary projection and log-softmax;
- + accumulation: the same, added into a donated gradient buffer (what the trainer runs);
- attention forward+backward of one layer (dense, the CPU choice at these lengths), x layers;
- the MLP-shaped matmul (tokens x 576 @ 576 x 1536) for the machine's rate.

and prints each piece's share of the full step and the FLOP rate of the whole against the
matmul rate measured in the same run. Run it on a quiet machine:

    python benchmarks/micro_batch.py                      # 2 rows x 256 tokens, 256 logit positions
    python benchmarks/micro_batch.py --rows 4 --logits 512
    RLHF_JAX_HUGEPAGES=0 python benchmarks/micro_batch.py   # without huge-page malloc (rlhf_jax/hostmem.py)
    python benchmarks/micro_batch.py --profile              # also the update's heaviest ops (benchmarks/op_profile.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if __name__ == "__main__":  # as rlhf_jax.main does (RLHF_JAX_HUGEPAGES=0 to compare without)
    from rlhf_jax.hostmem import reexec_with_hugepages

    reexec_with_hugepages()


def best_time(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def packed_micro(rows: int, row_len: int, logits: int, segment: int, vocab: int, seed: int = 0) -> dict:
    """Random token rows cut into segments of ``segment`` tokens (restarting positions), and
    ``logits`` sorted distinct positions whose next token is scored."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(row_len)
    positions = np.broadcast_to(t % segment, (rows, row_len))
    segment_ids = np.broadcast_to(t // segment + 1, (rows, row_len))
    where = np.sort(rng.choice(rows * row_len - 1, logits, replace=False))
    ids = rng.integers(0, vocab, (rows, row_len)).astype(np.int32)
    return {"input_ids": ids, "positions": positions.astype(np.int32), "segment_ids": segment_ids.astype(np.int32),
            "logit_positions": where.astype(np.int32), "logit_token_ids": ids.reshape(-1)[where + 1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2, help="packed rows per micro-batch")
    ap.add_argument("--row-len", type=int, default=256, help="tokens per packed row")
    ap.add_argument("--logits", type=int, default=256, help="positions through the vocabulary projection")
    ap.add_argument("--segment", type=int, default=80, help="tokens per packed sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the actor update's op profile (with entropy)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.grpo_step import model_shaped_matmul_flops
    from rlhf_jax.models.attention import dense_attention
    from rlhf_jax.models.hf_import import from_pretrained
    from rlhf_jax.tools import smollm2
    from rlhf_jax.train.packed_steps import packed_log_probs

    model = from_pretrained(smollm2.ensure(verbose=True))
    cfg = model.config
    graphdef, params = nnx.split(model)
    micro = {k: jnp.asarray(v) for k, v in packed_micro(args.rows, args.row_len, args.logits, args.segment,
                                                           cfg.vocab_size).items()}
    tokens = args.rows * args.row_len

    def body_loss(p):
        m = nnx.merge(graphdef, p)
        hidden = m.hidden_states(micro["input_ids"], positions=micro["positions"], segment_ids=micro["segment_ids"])
        return jnp.sum(hidden * hidden) * 1e-6

    def full_loss(p):
        logp, _ = packed_log_probs(nnx.merge(graphdef, p), micro, 1.0, False, 1)
        return -jnp.sum(logp) * 1e-3

    def forward(p):
        return packed_log_probs(nnx.merge(graphdef, p), micro, 1.0, False, 1)[0]

    accumulate = jax.jit(lambda p, acc: jax.tree.map(jnp.add, acc, jax.grad(full_loss)(p)), donate_argnums=1)
    acc = [jax.tree.map(jnp.zeros_like, params)]

    def accumulate_step(p):
        acc[0] = accumulate(p, acc[0])
        return acc[0]

    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (args.rows, args.row_len, H, D))
    k = jax.random.normal(keys[1], (args.rows, args.row_len, K, D))
    v = jax.random.normal(keys[2], (args.rows, args.row_len, K, D))
    slots = jnp.broadcast_to(jnp.arange(args.row_len), (args.rows, args.row_len))
    valid = jnp.ones((args.rows, args.row_len), bool)

    def attention_loss(q, k, v):
        out = dense_attention(q, k, v, slots, valid, micro["segment_ids"], micro["segment_ids"],
                              window=None, scale=D ** -0.5)
        return jnp.sum(out * out)

    times = {
        "forward (log-probs)": best_time(jax.jit(forward), params, repeats=args.repeats),
        "body forward+backward": best_time(jax.jit(jax.grad(body_loss)), params, repeats=args.repeats),
        "full forward+backward": best_time(jax.jit(jax.grad(full_loss)), params, repeats=args.repeats),
        "full + accumulation": best_time(accumulate_step, params, repeats=args.repeats),
        f"attention fwd+bwd x {cfg.num_hidden_layers}": cfg.num_hidden_layers * best_time(
            jax.jit(jax.grad(attention_loss, argnums=(0, 1, 2))), q, k, v, repeats=args.repeats),
    }
    rate = model_shaped_matmul_flops(tokens)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    embed = cfg.vocab_size * cfg.hidden_size
    # Matmul FLOPs of forward+backward: 6 per weight per token in the body, 6 per embedding weight per logit position.
    flops = 6 * (n_params - embed) * tokens + 6 * embed * args.logits
    whole = times["full + accumulation"]
    print(f"\nSmolLM2-135M packed micro-batch: {args.rows} rows x {args.row_len} tokens, "
          f"{args.logits} logit positions, segments of {args.segment}")
    for name, t in times.items():
        print(f"  {name:28s} {t * 1e3:8.1f} ms  {t / whole:6.1%} of full + accumulation")
    print(f"  matmul rate (tokens x 576 @ 576 x 1536): {rate / 1e9:.1f} GFLOP/s; the step's matmul FLOPs "
          f"{flops / 1e9:.0f} G would take {flops / rate * 1e3:.0f} ms at that rate: the step runs at "
          f"{flops / whole / rate:.2f} of it")
    if args.profile:
        from benchmarks.op_profile import op_profile

        def update_loss(p):  # as the actor update: log-probs and entropies of the logit positions
            logp, ent = packed_log_probs(nnx.merge(graphdef, p), micro, 1.0, True, 1)
            return -jnp.sum(logp) * 1e-3 + 1e-6 * jnp.sum(jax.lax.stop_gradient(ent))

        print("\nactor update micro-batch, op by op (thread time):")
        print(op_profile(jax.jit(jax.grad(update_loss)), params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
