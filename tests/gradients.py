"""The gradient comparison the layout-vs-one-rank tests report and bound."""


def gradient_error(pairs):
    """(worst, rel_norm) over (got, reference) gradient tensors: worst = the largest
    max|g - r| / max|r| of one tensor (max|r| floored at 1e-6); rel_norm = |g - r| / |r| over all
    tensors together."""
    worst, diff2, ref2 = 0.0, 0.0, 0.0
    for g, r in pairs:
        worst = max(worst, float((g - r).abs().max() / r.abs().max().clamp_min(1e-6)))
        diff2, ref2 = diff2 + float((g - r).pow(2).sum()), ref2 + float(r.pow(2).sum())
    return worst, (diff2 / ref2) ** 0.5
