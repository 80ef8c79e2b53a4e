"""A dense reward for trainer tests: every response earns something, so advantages are never all zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / 4.0 + 0.1 * len(solution_str), "digits": float(digits)}
