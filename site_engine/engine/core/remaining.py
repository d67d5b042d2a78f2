"""The answer tokens a running request is still expected to produce: what its site reports as
`predicted_remaining_tokens`, which the gateway reads as the time until the site's batch slots
free up and as the answers a new request would slow down (gateway/routing/completion_cost.py).

Before its predicted length a request has the prediction's remainder left. Past it, the
prediction says nothing more, and counting 1 token (the old rule) made a site full of requests
that had outrun weak predictions look about to empty, so the router queued new work behind
them. Answer lengths are heavy-tailed: the longer an answer has run, the longer it is likely to
go on. So a request past its prediction counts OUTRUN_SHARE x the tokens it has produced, within
max_tokens. The share is the one whose summed estimate over the states past the prediction is
unbiased on the served model's own answers (validation split of its labels: -0.114 at 1x, +0.004
at 2x, +0.035 at 3x; the old rule -0.997), and it held on their test split (+0.002):
`python -m bench.remaining_tokens`, bench/results/predictor/remaining_tokens.md. Those answers stop
at 1,024 tokens, and a small model's answer that outruns its prediction is often a loop to
max_tokens, so much of what it has left is the cap's; a deployment whose clients ask for far longer
answers has not been measured.
"""

from __future__ import annotations

import math

# A request past its prediction is expected to go on for this share of what it has produced.
OUTRUN_SHARE = 2.0


def remaining_tokens(predicted: int, produced: int, max_tokens: int) -> int:
    """Contract: tokens still expected of a running request that predicted `predicted` (already
    within [1, max_tokens]) and has produced `produced` of at most `max_tokens`: the prediction's
    remainder while there is one, else ceil(OUTRUN_SHARE x produced), at least 1; never more
    than max_tokens allows, 0 when max_tokens is reached."""
    allowed = max(max_tokens - produced, 0)
    ahead = predicted - produced
    expected = ahead if ahead >= 1 else max(math.ceil(OUTRUN_SHARE * produced), 1)
    return min(expected, allowed)
