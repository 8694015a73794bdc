"""Advantage estimators and losses against direct, loop-based reference computations.

The references (`_ref_*`) follow docs/algorithms.md formula by formula, in plain Python floats over rows,
groups and tokens, without calling the code under test. The random batches hold a group whose scores are
all equal, a group of one, a fully masked response, a response with a masked position inside it, and,
separately, zero-length responses (`[B, 0]` tensors).
"""

import math
from types import SimpleNamespace

import pytest
import torch

import rl360.algos
from rl360.algos import advantages, agg_loss, get_advantage_estimator, get_policy_loss, kl_penalty, losses
from rl360.algos.losses import AGG_MODES, KL_ESTIMATORS, agg_normalizer, ppo_clip_loss

# ---- advantage estimators: references ------------------------------------------------------------------


def _mean(values):
    return sum(values) / len(values)


def _std(values):
    """Unbiased sample standard deviation."""
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _group(index, i):
    """Rows of the responses to the same prompt as row i (itself included)."""
    return [j for j in range(len(index)) if index[j] == index[i]]


def _on_tokens(per_response, mask):
    """One value per response, on each of its response tokens (0 elsewhere)."""
    return [[value * m for m in row] for value, row in zip(per_response, mask)]


def _ref_grpo(scores, index, norm_by_std, eps=1e-6):
    out = []
    for i, score in enumerate(scores):
        group = [scores[j] for j in _group(index, i)]
        if len(group) == 1:
            out.append(0.0)
            continue
        centred = score - _mean(group)
        out.append(centred / (_std(group) + eps) if norm_by_std else centred)
    return out


def _ref_rloo(scores, index):
    out = []
    for i, score in enumerate(scores):
        others = [scores[j] for j in _group(index, i) if j != i]
        out.append(score - _mean(others) if others else 0.0)
    return out


def _ref_opo(scores, lengths, index):
    out = []
    for i, score in enumerate(scores):
        group = _group(index, i)
        total = sum(lengths[j] for j in group)
        baseline = sum(lengths[j] * scores[j] for j in group) / total if total else 0.0
        out.append(score - baseline)
    return out


def _ref_passk(scores, index, norm_by_std, eps=1e-6):
    out = [0.0] * len(scores)
    for key in set(index):
        group = [j for j in range(len(index)) if index[j] == key]
        if len(group) < 2:
            continue
        best, second = sorted(group, key=lambda j: scores[j], reverse=True)[:2]
        value = scores[best] - scores[second]
        out[best] = value / (_std([scores[j] for j in group]) + eps) if norm_by_std else value
    return out


def _ref_gpg(scores, index):
    count = len(scores)
    uniform = [i for i in range(count) if len({scores[j] for j in _group(index, i)}) == 1]
    if len(uniform) == count:
        return [0.0] * count
    alpha = count / (count - len(uniform))
    return [0.0 if i in uniform else alpha * (scores[i] - _mean([scores[j] for j in _group(index, i)]))
            for i in range(count)]


def _ref_return_to_go(rewards, mask, gamma):
    """R_t = sum_{k >= t} gamma^(k - t) r_k over the response tokens k, on each response token t."""
    return [[m[t] * sum(gamma ** (k - t) * r[k] * m[k] for k in range(t, len(m))) for t in range(len(m))]
            for r, m in zip(rewards, mask)]


def _ref_whiten(values, mask):
    """(v - mean) / sqrt(var + 1e-8) over the response tokens of the whole batch (unbiased var), 0 elsewhere."""
    tokens = [v for v_row, m_row in zip(values, mask) for v, m in zip(v_row, m_row) if m]
    if not tokens:
        return [[0.0] * len(row) for row in mask]
    mean = _mean(tokens)
    var = sum((v - mean) ** 2 for v in tokens) / max(len(tokens) - 1, 1)
    scale = 1 / math.sqrt(var + 1e-8)
    return [[(v - mean) * scale * m for v, m in zip(*rows)] for rows in zip(values, mask)]


def _ref_gae_raw(rewards, values, mask, gamma, lam):
    """Per row, GAE over its response positions alone (the others skipped), value 0 after the last one."""
    adv = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        running = next_value = 0.0
        for t in reversed([t for t, m in enumerate(row) if m]):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lam * running
            adv[i][t] = running
            next_value = values[i][t]
    return adv


def _outcome(per_response, mask):
    """An outcome estimator's (advantages, returns): one value per response on its tokens, twice."""
    adv = _on_tokens(per_response, mask)
    return adv, adv


def _ref_rpp(b, gamma):
    returns = _ref_return_to_go(b.rewards, b.mask, gamma)
    return _ref_whiten(returns, b.mask), returns


def _ref_rpp_baseline(b):
    centred = _on_tokens(_ref_grpo(b.scores, b.index, norm_by_std=False), b.mask)
    return _ref_whiten(centred, b.mask), centred


def _ref_remax(b):
    returns = _ref_return_to_go(b.rewards, b.mask, 1.0)
    adv = [[(r - greedy) * m for r, m in zip(r_row, m_row)]
           for r_row, m_row, greedy in zip(returns, b.mask, b.baselines)]
    return adv, returns


def _ref_gae(b, gamma, lam):
    raw = _ref_gae_raw(b.rewards, b.values, b.mask, gamma, lam)
    returns = [[(a + v) * m for a, v, m in zip(*rows)] for rows in zip(raw, b.values, b.mask)]
    return _ref_whiten(raw, b.mask), returns


# case -> (registered name, keyword arguments, reference (advantages, returns) of a batch of lists)
ESTIMATOR_CASES = {
    "grpo": ("grpo", {}, lambda b: _outcome(_ref_grpo(b.scores, b.index, True), b.mask)),
    "drgrpo": ("grpo", {"norm_adv_by_std_in_grpo": False},
               lambda b: _outcome(_ref_grpo(b.scores, b.index, False), b.mask)),
    "rloo": ("rloo", {}, lambda b: _outcome(_ref_rloo(b.scores, b.index), b.mask)),
    "reinforce_plus_plus": ("reinforce_plus_plus", {"gamma": 0.9}, lambda b: _ref_rpp(b, 0.9)),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", {}, _ref_rpp_baseline),
    "remax": ("remax", {}, _ref_remax),
    "opo": ("opo", {}, lambda b: _outcome(_ref_opo(b.scores, b.lengths, b.index), b.mask)),
    "gpg": ("gpg", {}, lambda b: _outcome(_ref_gpg(b.scores, b.index), b.mask)),
    "grpo_passk": ("grpo_passk", {}, lambda b: _outcome(_ref_passk(b.scores, b.index, True), b.mask)),
    "grpo_passk_drgrpo": ("grpo_passk", {"norm_adv_by_std_in_grpo": False},
                          lambda b: _outcome(_ref_passk(b.scores, b.index, False), b.mask)),
    "gae": ("gae", {"gamma": 0.9, "lam": 0.95}, lambda b: _ref_gae(b, 0.9, 0.95)),
    "gae_undiscounted": ("gae", {}, lambda b: _ref_gae(b, 1.0, 1.0)),
}
EQUAL_KEY, ONE_KEY = 3, 12  # the group whose scores are all equal; the group of one


def _estimator_batch(width, dtype):
    """Five groups of responses, rows shuffled, group keys out of order:

    7: random dense token rewards (as a KL penalty in the reward gives) plus a score on the last token; one
       response is fully masked, its score at position 0 outside the mask (where the trainer puts it);
    3: every score 0.9, on the last token (in float32, 0.9 + 0.9 + 0.9 over 3 is not 0.9);
    12: a group of one;
    5: a tie for the best score (pass@k's best minus second best is 0);
    0: random dense rewards and scores; one response has a masked position inside it.
    `width` 0 gives the same groups with zero-length responses."""
    gen = torch.Generator().manual_seed(11)
    groups = [(7, [6, 3, 0, 5], None), (EQUAL_KEY, [2, 6, 4], [0.9] * 3), (ONE_KEY, [4], None),
              (5, [6, 1, 3], [0.8, 0.8, -0.3]), (0, [5, 2, 6, 3, 4], None)]
    index, rewards, mask = [], [], []
    for key, lengths, scores in groups:
        dense = scores is None
        scores = scores or torch.randn(len(lengths), generator=gen).tolist()
        for length, score in zip(lengths, scores):
            row_mask = (torch.arange(width) < length).double()
            row = 0.3 * torch.randn(width, generator=gen, dtype=torch.float64) * row_mask if dense else \
                torch.zeros(width, dtype=torch.float64)
            if width:
                row[max(min(length, width) - 1, 0)] += score
            index.append(key)
            rewards.append(row)
            mask.append(row_mask)
    if width:
        hole = index.index(0)
        mask[hole][2] = rewards[hole][2] = 0.0
    order = torch.randperm(len(index), generator=gen).tolist()
    rows = len(index)
    return SimpleNamespace(
        index=[index[i] for i in order],
        rewards=torch.stack(rewards)[order].to(dtype).reshape(rows, width),
        mask=torch.stack(mask)[order].to(dtype).reshape(rows, width),
        values=torch.randn(rows, width, generator=gen, dtype=torch.float64).to(dtype),
        baselines=torch.randn(rows, generator=gen, dtype=torch.float64).to(dtype))


def _as_lists(batch):
    """The reference's view of a batch: Python floats; a score is the sum of a response's token rewards."""
    rewards, mask = batch.rewards.tolist(), batch.mask.tolist()
    return SimpleNamespace(rewards=rewards, mask=mask, index=batch.index, values=batch.values.tolist(),
                           baselines=batch.baselines.tolist(), scores=[sum(row) for row in rewards],
                           lengths=[sum(row) for row in mask])


def test_estimator_batch_has_the_edge_cases():
    batch = _estimator_batch(6, torch.float64)
    lengths = batch.mask.sum(-1)
    scores = batch.rewards.sum(-1)
    equal = [i for i, key in enumerate(batch.index) if key == EQUAL_KEY]
    assert len(equal) == 3 and len(set(scores[equal].tolist())) == 1
    assert batch.index.count(ONE_KEY) == 1
    empty = int((lengths == 0).nonzero())
    assert scores[empty] != 0 and sum(key == batch.index[empty] for key in batch.index) == 4
    assert any(0 < m.sum() < 6 and m[2] == 0 and m[3] == 1 for m in batch.mask)  # a masked position inside
    assert _estimator_batch(0, torch.float32).rewards.shape == (16, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("width", [6, 0])
@pytest.mark.parametrize("case", list(ESTIMATOR_CASES))
def test_estimator_matches_reference(case, width, dtype):
    name, kwargs, reference = ESTIMATOR_CASES[case]
    batch = _estimator_batch(width, dtype)
    adv, returns = get_advantage_estimator(name)(batch.rewards, batch.mask, batch.index, values=batch.values,
                                                 reward_baselines=batch.baselines, **kwargs)
    want_adv, want_returns = reference(_as_lists(batch))
    tolerance = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    assert adv.shape == returns.shape == batch.mask.shape and adv.dtype == returns.dtype == dtype
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=dtype).reshape(adv.shape), **tolerance)
    torch.testing.assert_close(returns, torch.tensor(want_returns, dtype=dtype).reshape(adv.shape), **tolerance)
    if want_returns is want_adv:  # an outcome estimator's returns are its advantages
        assert torch.equal(returns, adv)
    if name in ("grpo", "grpo_passk", "gpg"):  # equal scores and a group of one: exactly no signal
        assert not adv[[i for i, key in enumerate(batch.index) if key in (EQUAL_KEY, ONE_KEY)]].any()


def test_estimators_without_their_extra_inputs_raise():
    batch = _estimator_batch(6, torch.float32)
    with pytest.raises(ValueError, match="reward_baselines"):
        get_advantage_estimator("remax")(batch.rewards, batch.mask, batch.index)
    with pytest.raises(ValueError, match="values"):
        get_advantage_estimator("gae")(batch.rewards, batch.mask, batch.index)


# ---- losses: references ----------------------------------------------------------------------------------


def _ref_clipped(ratio, adv, low, high, dual_clip=None):
    """One token of PPO's clipped surrogate: (loss, branch, d loss / d log ratio).

    max(-A r, -A clip(r, 1 - low, 1 + high)), then for A < 0 at most -A c (dual clip). The branch taken is
    "ratio" (unclipped), "high" or "low" (clipped at that end), or "dual"."""
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    if clipped > unclipped:
        loss, branch, grad = clipped, ("high" if ratio > 1 + high else "low"), 0.0
    else:
        loss, branch, grad = unclipped, "ratio", unclipped
    if dual_clip is not None and adv < 0 and loss > -adv * dual_clip:
        loss, branch, grad = -adv * dual_clip, "dual", 0.0
    return loss, branch, grad


def _ref_policy_tokens(mode, logprob, old, adv, mask, low, high, dual_clip=None):
    """Per token (loss, branch, d loss / d log ratio) of `mode` with docs/algorithms.md's ratio: vanilla,
    rho_t = pi / pi_old of the token; gspo and gspo_token, the sequence ratio
    s_i = exp((1 / |y_i|) sum_t log(pi / pi_old)) over the response's tokens (1 for an empty response)."""
    out = []
    for lp_row, old_row, adv_row, m_row in zip(logprob, old, adv, mask):
        length = sum(m_row)
        seq = sum((lp - o) * m for lp, o, m in zip(lp_row, old_row, m_row)) / length if length else 0.0
        out.append([_ref_clipped(math.exp(lp - o if mode == "vanilla" else seq), a, low, high, dual_clip)
                    for lp, o, a in zip(lp_row, old_row, adv_row)])
    return out


def _ref_agg(loss, mask, mode, max_len):
    """docs/algorithms.md's aggregation of a per-token loss over the whole batch."""
    masked = [[value * m for value, m in zip(l_row, m_row)] for l_row, m_row in zip(loss, mask)]
    if mode == "token-mean":
        return sum(map(sum, masked)) / max(sum(map(sum, mask)), 1)
    per_sequence = []
    for row, m_row in zip(masked, mask):
        divisor = {"seq-mean-token-sum": 1, "seq-mean-token-mean": max(sum(m_row), 1),
                   "seq-mean-token-sum-norm": max_len}[mode]
        per_sequence.append(sum(row) / divisor)
    return sum(per_sequence) / len(per_sequence)


def _ref_agg_weights(mask, mode, max_len):
    """d aggregate / d L_it: the aggregate is linear in L, so the aggregate of each unit loss."""
    rows, width = len(mask), len(mask[0])
    return [[_ref_agg([[float((i, t) == (r, u)) for u in range(width)] for r in range(rows)], mask, mode, max_len)
             for t in range(width)] for i in range(rows)]


def _ref_policy_grad(mode, tokens, weights, mask):
    """d aggregate / d logprob. vanilla: the token's own log ratio; gspo_token: its ratio is
    sg[s_i] pi_t / sg[pi_t], so again only its own log-prob; gspo: log s_i moves by m_u / |y_i| with
    each log-prob u of the response."""
    grad = []
    for token_row, w_row, m_row in zip(tokens, weights, mask):
        own = [w * g for (_, _, g), w in zip(token_row, w_row)]
        if mode == "gspo":
            length = sum(m_row)
            own = [sum(own) * m / length if length else 0.0 for m in m_row]
        grad.append(own)
    return grad


def _loss_batch(rows=12, width=8):
    """float64 log-probs whose ratios to the old ones reach both clip ends and the dual clip, per token and
    per sequence (a random offset per response); token-level advantages of both signs; a mask with a
    shorter response, a fully masked one and a masked position inside one."""
    gen = torch.Generator().manual_seed(0)
    old = -3 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    offsets = 0.4 * torch.randn(rows, 1, generator=gen, dtype=torch.float64)
    logprob = old + offsets + torch.randn(rows, width, generator=gen, dtype=torch.float64)
    adv = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows, 1), generator=gen)
    mask = (torch.arange(width) < lengths).double()
    mask[1] = 0
    mask[4, 2] = 0
    return SimpleNamespace(logprob=logprob, old=old, adv=adv, mask=mask)


MAX_RESPONSE_LENGTH = 12  # rollout.max_response_length, larger than the batch's width
LOSS_CASES = {  # case -> (loss_mode, clip arguments)
    "vanilla": ("vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
    "vanilla_dual_clip": ("vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}),
    "gspo": ("gspo", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15}),
    "gspo_token": ("gspo_token", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15}),
}


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_policy_loss_matches_reference(case, agg_mode):
    """Per-token loss and clipped flag, the aggregate and its gradient, against the references."""
    mode, clip = LOSS_CASES[case]
    b = _loss_batch()
    logprob = b.logprob.clone().requires_grad_(True)
    loss, clipped = get_policy_loss(mode)(logprob, b.old, b.adv, b.mask, **clip)
    mask = b.mask.tolist()
    tokens = _ref_policy_tokens(mode, b.logprob.tolist(), b.old.tolist(), b.adv.tolist(), mask,
                                clip["clip_ratio_low"], clip["clip_ratio_high"], clip.get("clip_ratio_c"))
    want_loss = [[value for value, _, _ in row] for row in tokens]
    want_clipped = [[float(branch != "ratio") for _, branch, _ in row] for row in tokens]
    torch.testing.assert_close(loss.detach() * b.mask, torch.tensor(want_loss, dtype=torch.float64) * b.mask)
    torch.testing.assert_close(clipped * b.mask, torch.tensor(want_clipped, dtype=torch.float64) * b.mask)
    branches = {branch for row, m_row in zip(tokens, mask) for (_, branch, _), m in zip(row, m_row) if m}
    assert branches == {"ratio", "high", "low"} | ({"dual"} if "clip_ratio_c" in clip else set())

    total = agg_loss(loss, b.mask, agg_mode, agg_normalizer(b.mask, agg_mode), MAX_RESPONSE_LENGTH)
    assert total.item() == pytest.approx(_ref_agg(want_loss, mask, agg_mode, MAX_RESPONSE_LENGTH), rel=1e-12)
    grad, = torch.autograd.grad(total, logprob)
    weights = _ref_agg_weights(mask, agg_mode, MAX_RESPONSE_LENGTH)
    want_grad = torch.tensor(_ref_policy_grad(mode, tokens, weights, mask), dtype=torch.float64)
    torch.testing.assert_close(grad, want_grad)
    assert grad[1].abs().max() == 0 and grad[4, 2] == 0  # masked tokens get no gradient


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gspo_token", "gpg"])
def test_policy_loss_of_zero_length_responses_is_zero(mode, agg_mode):
    logprob = torch.zeros(3, 0, requires_grad=True)
    empty = torch.zeros(3, 0)
    loss, clipped = get_policy_loss(mode)(logprob, empty, empty, empty)
    assert loss.shape == clipped.shape == (3, 0)
    total = agg_loss(loss, empty, agg_mode, agg_normalizer(empty, agg_mode), MAX_RESPONSE_LENGTH)
    assert total.item() == 0
    assert torch.autograd.grad(total, logprob)[0].shape == (3, 0)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gspo_token_equals_gspo_for_sequence_level_advantages(agg_mode):
    """With one advantage per response both have s_i's value, and both gradients are -A s_i times the
    aggregation weight of the response's tokens: identical, clipped responses included (no gradient)."""
    b = _loss_batch()
    adv = b.adv[:, :1].expand_as(b.adv)
    results = []
    for mode in ("gspo", "gspo_token"):
        logprob = b.logprob.clone().requires_grad_(True)
        loss, clipped = get_policy_loss(mode)(logprob, b.old, adv, b.mask, clip_ratio_low=0.1, clip_ratio_high=0.15)
        total = agg_loss(loss, b.mask, agg_mode, agg_normalizer(b.mask, agg_mode), MAX_RESPONSE_LENGTH)
        results.append((loss.detach(), clipped, torch.autograd.grad(total, logprob)[0]))
    (seq_loss, seq_clipped, seq_grad), (tok_loss, tok_clipped, tok_grad) = results
    torch.testing.assert_close(tok_loss, seq_loss)
    assert torch.equal(tok_clipped, seq_clipped)
    torch.testing.assert_close(tok_grad, seq_grad)
    clipped_rows = (seq_clipped * b.mask).amax(-1) > 0
    assert clipped_rows.any() and (~clipped_rows & (b.mask.sum(-1) > 0)).any()
    assert seq_grad[clipped_rows].abs().max() == 0


def _ref_kl(estimator, log_ratio):
    """(value, d value / d logprob) of one token, from docs/algorithms.md's KL table."""
    base = estimator.rstrip("+")
    if base == "k1":
        value, grad = log_ratio, 1.0
    elif base == "abs":
        value, grad = abs(log_ratio), math.copysign(1.0, log_ratio)
    elif base in ("k2", "mse"):
        value, grad = log_ratio**2 / 2, log_ratio
    else:  # k3, low_var_kl: clamped to [-10, 10] (it is never negative)
        raw = math.exp(-log_ratio) - 1 + log_ratio
        value, grad = (raw, 1 - math.exp(-log_ratio)) if raw < 10 else (10.0, 0.0)
    if estimator.endswith("+"):  # straight-through: the estimator's value, k2's gradient
        grad = log_ratio
    return value, grad


@pytest.mark.parametrize("estimator", [*KL_ESTIMATORS, *(f"{name}+" for name in KL_ESTIMATORS)])
def test_kl_estimator_matches_reference(estimator):
    gen = torch.Generator().manual_seed(9)
    ref = -3 * torch.rand(6, 8, generator=gen, dtype=torch.float64)
    logprob = (ref + 6 * torch.randn(6, 8, generator=gen, dtype=torch.float64)).requires_grad_(True)
    value = kl_penalty(logprob, ref, estimator)
    grad, = torch.autograd.grad(value.sum(), logprob)
    want = [[_ref_kl(estimator, lr) for lr in row] for row in (logprob - ref).tolist()]
    torch.testing.assert_close(value.detach(), torch.tensor([[v for v, _ in row] for row in want], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([[g for _, g in row] for row in want], dtype=torch.float64))
    k3 = [math.exp(-lr) - 1 + lr for lr in (logprob - ref).flatten().tolist()]
    assert min(k3) < 10 < max(k3)  # the k3 clamp is reached and not


@pytest.mark.parametrize("width", [7, 0])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_agg_loss_matches_reference(agg_mode, width):
    gen = torch.Generator().manual_seed(4)
    loss = torch.randn(6, width, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, width, generator=gen) > 0.3).double()
    if width:
        mask[2] = 0  # a fully masked response
    got = agg_loss(loss, mask, agg_mode, agg_normalizer(mask, agg_mode), MAX_RESPONSE_LENGTH)
    assert got.item() == pytest.approx(_ref_agg(loss.tolist(), mask.tolist(), agg_mode, MAX_RESPONSE_LENGTH), rel=1e-12)
    if width:  # without max_response_length, seq-mean-token-sum-norm divides by the batch's width
        got = agg_loss(loss, mask, agg_mode, agg_normalizer(mask, agg_mode))
        assert got.item() == pytest.approx(_ref_agg(loss.tolist(), mask.tolist(), agg_mode, width), rel=1e-12)


def _ref_logprob_entropy(logits, mb, temperature):
    """log softmax(z / T) of each response token and the entropy of softmax(z / T), from the logits at the
    position before the token (torch scalars that keep the gradient; 0 off the response)."""
    logprob, entropy = [], []
    for i in range(len(mb)):
        lp_row, h_row = [], []
        for t in range(mb.response_ids.shape[1]):
            if not mb.response_mask[i, t]:
                lp_row.append(logits.new_zeros(()))
                h_row.append(logits.new_zeros(()))
                continue
            log_p = torch.log_softmax(logits[i, int(mb.response_start[i]) + t - 1] / temperature, dim=-1)
            lp_row.append(log_p[mb.response_ids[i, t]])
            h_row.append(-(log_p.exp() * log_p).sum())
        logprob.append(lp_row)
        entropy.append(h_row)
    return logprob, entropy


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_policy_step_loss_adds_the_kl_and_subtracts_the_entropy_bonus(megatron_single_rank, agg_mode):
    """The actor's micro-batch loss (`PolicyWorker._loss`, on a worker without a model): the aggregated PPO
    loss, + kl_coef x the aggregated k3 KL to the reference, - entropy_coeff x the aggregated entropy at the
    sampling temperature; values and gradients with respect to the logits against the references."""
    from rl360.actor.batch import build_batch
    from rl360.actor.policy import PolicyWorker
    from rl360.actor.settings import PolicySettings
    from rl360.config import RunConfig

    gen = torch.Generator().manual_seed(8)
    responses = [[9, 1, 4, 2], [], [5, 5], [3, 8, 1, 7, 2]]  # the second one is empty: fully masked
    mb = build_batch([[1, 2], [3], [4, 5, 6], [7]], responses, [[0.0] * len(r) for r in responses])
    logits = (2 * torch.randn(len(mb), mb.input_ids.shape[1], 11, generator=gen)).requires_grad_(True)
    temperature, beta, kl_coef = 0.7, 0.05, 0.2
    logprob, entropy = _ref_logprob_entropy(logits, mb, temperature)
    lp = [[float(x.detach()) for x in row] for row in logprob]
    shape = mb.response_mask.shape  # old and reference log-probs near the policy's, ratios both sides of 1
    mb.old_logprobs = torch.tensor(lp) + 0.4 * torch.randn(shape, generator=gen)
    mb.ref_logprobs = torch.tensor(lp) + 0.5 * torch.randn(shape, generator=gen)
    mb.advantages = torch.randn(shape, generator=gen)

    def step_loss(entropy_coeff, kl):
        worker = object.__new__(PolicyWorker)
        cfg = RunConfig()
        cfg.rollout.temperature, cfg.rollout.max_response_length = temperature, MAX_RESPONSE_LENGTH
        cfg.actor.loss_agg_mode, cfg.actor.entropy_coeff = agg_mode, entropy_coeff
        cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c = 0.2, 0.28, 3.0
        cfg.algorithm.kl_coef, cfg.algorithm.kl_estimator = kl, "k3"
        worker.settings = PolicySettings.of(cfg)
        worker.vocab_start, worker.dp_size, worker._tokens_in_mini = 0, 1, float(mb.response_mask.sum())
        worker.context = worker.sequence_multiple = 1  # one rank: no context or sequence parallelism
        loss, report = worker._loss(logits, mb, agg_normalizer(mb.response_mask, agg_mode), num_micro=1)
        return loss, torch.autograd.grad(loss, logits)[0], report

    mask = mb.response_mask.tolist()
    weights = _ref_agg_weights(mask, agg_mode, MAX_RESPONSE_LENGTH)
    tokens = _ref_policy_tokens("vanilla", lp, mb.old_logprobs.tolist(), mb.advantages.tolist(), mask, 0.2, 0.28, 3.0)

    def weighted(per_token):
        return sum(w * x for w_row, x_row in zip(weights, per_token) for w, x in zip(w_row, x_row))

    base, base_grad, _ = step_loss(0.0, 0.0)
    # PPO: the value of the clipped surrogate, the gradient of sum_t w_t (d L / d log ratio)_t log pi_t
    assert base.item() == pytest.approx(weighted([[value for value, _, _ in row] for row in tokens]), rel=1e-5)
    surrogate = weighted([[g * x for (_, _, g), x in zip(t_row, lp_row)] for t_row, lp_row in zip(tokens, logprob)])
    torch.testing.assert_close(base_grad, torch.autograd.grad(surrogate, logits, retain_graph=True)[0], rtol=1e-5,
                               atol=1e-6)

    with_entropy, entropy_grad, report = step_loss(beta, 0.0)
    bonus = -beta * weighted(entropy)
    assert (with_entropy - base).item() == pytest.approx(bonus.item(), rel=1e-4)
    bonus_grad, = torch.autograd.grad(bonus, logits, retain_graph=True)
    torch.testing.assert_close(entropy_grad - base_grad, bonus_grad, rtol=1e-4, atol=1e-6)
    token_mean = sum(float(h.detach()) for row in entropy for h in row) / sum(map(sum, mask))
    assert float(report["actor/entropy"]) == pytest.approx(token_mean, rel=1e-5)

    with_kl, kl_grad, _ = step_loss(0.0, kl_coef)
    ref = mb.ref_logprobs.tolist()
    kl_term = kl_coef * weighted([[(torch.exp(r - x) - 1 + x - r).clamp(max=10.0) for x, r in zip(lp_row, r_row)]
                                  for lp_row, r_row in zip(logprob, ref)])
    assert (with_kl - base).item() == pytest.approx(kl_term.item(), rel=1e-4)
    torch.testing.assert_close(kl_grad - base_grad, torch.autograd.grad(kl_term, logits)[0], rtol=1e-4, atol=1e-6)


def test_public_names_at_package_level():
    assert rl360.algos.__doc__
    exported = {"get_advantage_estimator": advantages, "register_advantage_estimator": advantages,
                "get_policy_loss": losses, "register_policy_loss": losses, "kl_penalty": losses, "agg_loss": losses}
    assert sorted(rl360.algos.__all__) == sorted(exported)
    for name, module in exported.items():
        assert getattr(rl360.algos, name) is getattr(module, name)
    assert rl360.algos.get_advantage_estimator("grpo") is advantages.grpo_advantage
    assert rl360.algos.get_policy_loss("vanilla") is losses.ppo_clip_loss
    assert rl360.algos.kl_penalty(torch.tensor([0.5]), torch.tensor([0.0]), "k1").item() == 0.5
    assert rl360.algos.agg_loss(torch.ones(2, 3), torch.ones(2, 3), "token-mean", 6.0).item() == 1.0


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (12,), generator=gen).float()
    scores[8:11] = 1.0  # a group with equal rewards
    index = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3]  # group 3 has one member
    mask = torch.ones(12, 5)
    mask[0, 3:] = 0
    mask[5, 1:] = 0
    rewards = torch.zeros(12, 5)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(12), last] = scores
    return scores, index, mask, rewards


def test_unknown_estimator_lists_known():
    with pytest.raises(KeyError, match="grpo"):
        get_advantage_estimator("nope")


def test_ppo_clip_asymmetric_ranges():
    ratios = [0.5, 0.5, 0.9, 1.25, 1.5, 1.5]
    advantages = [1.0, -1.0, -1.0, 1.0, 1.0, -1.0]
    old = torch.zeros(1, len(ratios))
    logprob = torch.log(torch.tensor([ratios]))
    loss, clipped = ppo_clip_loss(logprob, old, torch.tensor([advantages]), clip_ratio_low=0.2, clip_ratio_high=0.28)
    for k, (r, a) in enumerate(zip(ratios, advantages)):
        expected = max(-a * r, -a * min(max(r, 0.8), 1.28))
        assert loss[0, k].item() == pytest.approx(expected, rel=1e-5)
    # clipped where the clipped surrogate is the larger loss: r=0.5 with A<0, r=1.5 with A>0
    assert clipped[0].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    # clip-higher: r=1.25 with A>0 is inside the range [0.8, 1.28]
    assert loss[0, 3].item() == pytest.approx(-1.25, rel=1e-5)


def test_kl_estimators():
    logprob = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    lr = logprob - ref
    torch.testing.assert_close(kl_penalty(logprob, ref, "k1"), lr)
    torch.testing.assert_close(kl_penalty(logprob, ref, "k2"), 0.5 * lr**2)
    torch.testing.assert_close(kl_penalty(logprob, ref, "k3"), torch.exp(-lr) - 1 + lr)
    assert kl_penalty(logprob, ref, "k3").min() >= 0
    with pytest.raises(KeyError):
        kl_penalty(logprob, ref, "k9")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregation_is_invariant_to_micro_batch_split(mode):
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(8, 6, generator=gen)
    mask = (torch.rand(8, 6, generator=gen) > 0.3).float()
    mask[2] = 0  # a fully masked response
    whole = agg_loss(loss, mask, mode, agg_normalizer(mask, mode))
    for parts in (2, 8):
        norm = agg_normalizer(mask, mode)
        split = sum(agg_loss(loss[i::parts], mask[i::parts], mode, norm) for i in range(parts))
        torch.testing.assert_close(split, whole)
    if mode == "token-mean":
        torch.testing.assert_close(whole, (loss * mask).sum() / mask.sum())
    elif mode == "seq-mean-token-mean":
        per_seq = [(loss[i] * mask[i]).sum() / max(mask[i].sum(), 1) for i in range(8)]
        torch.testing.assert_close(whole, torch.stack(per_seq).mean())


def test_grpo_passk_rewards_only_the_best_of_each_group():
    scores = torch.tensor([0.2, 0.9, 0.5, 0.9, 0.1, 0.4, 0.3])
    index = [0, 0, 0, 1, 1, 1, 2]
    mask = torch.ones(7, 2)
    rewards = torch.zeros(7, 2)
    rewards[:, -1] = scores
    adv, _ = get_advantage_estimator("grpo_passk")(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == pytest.approx([0, 0.4, 0, 0.5, 0, 0, 0], abs=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    ratio = torch.tensor([[5.0, 5.0, 0.5]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, clipped = ppo_clip_loss(ratio.log(), torch.zeros(1, 3), adv, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                  clip_ratio_c=3.0)
    assert loss[0].tolist() == pytest.approx([3.0, -1.2, 0.8])
    assert clipped[0].tolist() == [1.0, 1.0, 1.0]


def test_straight_through_kl_has_k2_gradient_and_estimator_value():
    logprob = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    value = kl_penalty(logprob, ref, "k3+")
    torch.testing.assert_close(value.detach(), kl_penalty(logprob, ref, "k3"))
    grad, = torch.autograd.grad(value.sum(), logprob)
    torch.testing.assert_close(grad, (logprob - ref).detach())
    torch.testing.assert_close(kl_penalty(logprob, ref, "abs"), (logprob - ref).abs())


def test_seq_mean_token_sum_norm_divides_by_max_length():
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", 2.0, max_response_length=8).item() == pytest.approx(
        (2 / 8 + 4 / 8) / 2)


def test_dynamic_sampling_keeps_groups_whose_scores_vary():
    from rl360.algos.dynamic_sampling import varied_groups

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    assert varied_groups(scores, 3).tolist() == [False, True, False]


def test_partial_dynamic_filtering_keeps_trajectories_one_by_one():
    """PyVision's rule: a uniform group goes (a group of one never is), then each trajectory whose ending is not
    kept; past the target, the trajectories of the groups whose scores vary most."""
    from rl360.algos.dynamic_sampling import group_std, most_varied, partial_keep

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    endings = torch.tensor([True, True, True, True, False, True, True, True, True, True, True, True])
    keep = partial_keep(scores, 3, endings)
    assert keep.tolist() == [False] * 3 + [True, False, True] + [True] * 3 + [False] * 3
    assert partial_keep(torch.tensor([1.0, 1.0]), 1, torch.tensor([True, False])).tolist() == [True, False]
    stds = group_std(scores, 3)
    torch.testing.assert_close(stds[3:9], torch.tensor([0.4082483, 0.4082483, 0.4082483, 0.4714045, 0.4714045,
                                                        0.4714045]))
    assert most_varied(keep, stds, 4).tolist() == [False] * 3 + [True, False, False] + [True] * 3 + [False] * 3
    assert most_varied(keep, stds, 10).tolist() == keep.tolist()
    assert most_varied(torch.tensor([True, True, True]), torch.zeros(3), 2).tolist() == [True, True, False]


def test_overlong_penalty_is_linear_in_the_buffer():
    from rl360.algos.dynamic_sampling import overlong_penalty

    lengths = torch.tensor([10, 16, 18, 20])
    penalty = overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=2.0)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -1.0, -2.0])


def test_rollout_correction_weights():
    from rl360.algos.losses import rollout_correction

    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    engine = torch.log(torch.tensor([[0.5, 0.1, 0.9, 0.2]]))  # rho = 1, 5, 0.556, 2.5
    torch.testing.assert_close(rollout_correction(old, engine, "tis", 2.0), torch.tensor([[1.0, 2.0, 5 / 9, 2.0]]))
    assert rollout_correction(old, engine, "mask", 3.0).tolist() == [[1.0, 0.0, 1.0, 1.0]]
    assert rollout_correction(old, engine, "mask", 3.0, lower=0.6).tolist() == [[1.0, 0.0, 0.0, 1.0]]
    assert rollout_correction(old, engine, "none", 2.0).tolist() == [[1.0] * 4]


def test_rollout_correction_sequence_levels_and_veto():
    """Sequence and geometric ratios against a per-response loop; masked tokens never count."""
    from rl360.algos.losses import rollout_correction

    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 7, generator=generator) * 3
    engine = old + torch.randn(5, 7, generator=generator) * 0.3
    mask = torch.ones(5, 7)
    mask[1, 4:] = 0
    mask[2] = 0  # a fully masked (empty) response
    engine[1, 5] = old[1, 5] + 50.0  # a huge mismatch under the mask changes nothing
    for level in ("sequence", "geometric"):
        for mode, upper in (("tis", 1.5), ("mask", 1.2)):
            got = rollout_correction(old, engine, mode, upper, 0.0, mask, level)
            for row in range(5):
                diffs = [(old[row, t] - engine[row, t]).item() for t in range(7) if mask[row, t]]
                log_rho = sum(diffs) / (max(len(diffs), 1) if level == "geometric" else 1)
                rho = math.exp(log_rho)
                want = min(rho, upper) if mode == "tis" else float(1 / upper <= rho <= upper)
                assert got[row].tolist() == pytest.approx([want] * 7, rel=1e-5), (level, mode, row)
    assert rollout_correction(old, engine, "tis", 2.0, 0.0, mask, "sequence")[2].tolist() == [1.0] * 7

    # veto: one token far less likely under the trainer zeroes its whole response, at any level
    engine[3, 2] = old[3, 2] + 8.0  # rho_t = e^-8
    for level in ("token", "sequence", "geometric"):
        vetoed = rollout_correction(old, engine, "tis", 2.0, 0.0, mask, level, veto=1e-3)
        assert vetoed[3].tolist() == [0.0] * 7
        kept = rollout_correction(old, engine, "tis", 2.0, 0.0, mask, level)
        assert torch.equal(vetoed[[0, 1, 2, 4]], kept[[0, 1, 2, 4]])
    with pytest.raises(KeyError, match="rollout_is_level"):
        rollout_correction(old, engine, "tis", 2.0, 0.0, mask, "segment")


def test_kl_controller_fixed_and_adaptive():
    from rl360.algos.kl_control import KLController

    fixed = KLController(0.1)
    fixed.update(kl=5.0, n=1000)
    assert fixed.coef == 0.1
    adaptive = KLController(0.1, target=1.0, horizon=1000)
    adaptive.update(kl=5.0, n=100)  # far above target: error clipped at +0.2
    assert adaptive.coef == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    adaptive.update(kl=0.5, n=100)  # below target: error -0.5 clipped at -0.2
    assert adaptive.coef == pytest.approx(0.1 * (1 + 0.2 * 0.1) * (1 - 0.2 * 0.1))


def test_kl_in_reward_subtracts_the_penalty_at_the_coefficient_used_then_adapts():
    from rl360.algos.kl_control import KLController, kl_in_reward

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = SimpleNamespace(old_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]]),
                            ref_logprobs=torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -1.5, -0.25]]), response_mask=mask)
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    controller = KLController(0.5, target=0.1, horizon=100)
    penalized, metrics = kl_in_reward(rewards, batch, controller, "k1")
    token_kl = (batch.old_logprobs - batch.ref_logprobs) * mask  # k1; the masked-out token gets none
    torch.testing.assert_close(penalized, rewards - 0.5 * token_kl)
    assert metrics == {"reward/kl": pytest.approx(token_kl.sum(-1).mean().item()), "reward/kl_coef": 0.5}
    assert controller.coef == pytest.approx(0.5 * (1 + 0.2 * 2 / 100))  # KL far above the target, 2 samples


def test_advantages_of_kept_trajectories_are_their_whole_groups_from_one_estimator_call():
    """Partial dynamic filtering: a group's advantages come from all its responses, trained on or not; the
    estimator runs once, with the algorithm's settings and the step's baselines and values."""
    from rl360.algos.advantages import compute_advantages, grpo_advantage, token_rewards

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = token_rewards(torch.tensor([1.0, 0.0, 0.5, 0.0]), mask)
    assert rewards.nonzero().tolist() == [[0, 1], [2, 2]]  # the score on each response's last token
    calls = []

    def estimator(token_level_rewards, response_mask, index, **kwargs):
        calls.append((index, kwargs))
        return grpo_advantage(token_level_rewards, response_mask, index, **kwargs)

    algorithm = SimpleNamespace(norm_adv_by_std_in_grpo=True, gamma=0.9, lam=0.8)
    values = torch.ones(4, 3)
    keep = torch.tensor([True, False, False, True])
    advantages, returns = compute_advantages(estimator, rewards, mask, 2, algorithm, None, values, keep=keep)
    assert calls == [([0, 0, 1, 1], {"norm_adv_by_std_in_grpo": True, "gamma": 0.9, "lam": 0.8,
                                     "reward_baselines": None, "values": values})]
    whole, _ = grpo_advantage(rewards, mask, [0, 0, 1, 1])
    torch.testing.assert_close(advantages, whole[keep])
    torch.testing.assert_close(returns, whole[keep])
    assert advantages[1].abs().sum() > 0  # a kept row alone in its group would get 0
    every, _ = compute_advantages(estimator, rewards, mask, 2, algorithm)
    torch.testing.assert_close(every, whole)


def test_trained_rows_are_the_kept_ones_or_all():
    from rl360.actor.batch import build_batch
    from rl360.algos.dynamic_sampling import trained_rows

    batch = build_batch([[1], [2], [3]], [[4], [5, 6], [7]], [[0.0], [0.0, 0.0], [0.0]])
    scores = torch.tensor([0.1, 0.2, 0.3])
    every, every_score = trained_rows(batch, scores, None)
    assert every is batch and every_score is scores
    kept, kept_scores = trained_rows(batch, scores, torch.tensor([False, True, True]))
    assert kept.input_ids.tolist() == batch.input_ids[1:].tolist() and kept_scores.tolist() == scores[1:].tolist()


def test_gpg_scales_group_centred_scores_by_the_share_of_informative_responses():
    scores, index, mask, _ = _inputs(4)
    scores[:4] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # group 0 varies; group 2 is uniform; group 3 is one
    scores[4:8] = torch.tensor([0.0, 1.0, 1.0, 0.0])  # group 1 varies too ...
    mask[6] = 0  # ... and has an empty response: its score counts in the group mean, its advantage is 0
    rewards = torch.zeros(12, 5)
    rewards[torch.arange(12), (mask.sum(-1).long() - 1).clamp(min=0)] = scores
    adv, returns = get_advantage_estimator("gpg")(rewards, mask, index)
    informative = [i for i in range(12) if len({scores[j].item() for j in range(12) if index[j] == index[i]}) > 1]
    alpha = 12 / len(informative)  # B / (B - M), M responses in uniform groups (and groups of one)
    assert alpha == 1.5
    for i in range(12):
        group = [scores[j].item() for j in range(12) if index[j] == index[i]]
        expected = alpha * (scores[i].item() - sum(group) / len(group)) if i in informative else 0.0
        torch.testing.assert_close(adv[i], expected * mask[i])
    assert adv[6].abs().max() == 0 and adv[5, 0].item() == pytest.approx(1.5 * 0.5)
    assert torch.equal(adv, returns)
    uniform = torch.zeros(4, 2)  # every group uniform: no signal, and no division by zero
    adv, _ = get_advantage_estimator("gpg")(uniform, torch.ones(4, 2), [0, 0, 1, 1])
    assert adv.abs().max() == 0


def test_gpg_loss_is_the_plain_policy_gradient():
    logprob = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0, 0.5]])
    loss, clipped = get_policy_loss("gpg")(logprob, logprob.detach() + 3.0, advantages, torch.ones(1, 3))
    torch.testing.assert_close(loss, -advantages * logprob.detach())
    loss.sum().backward()
    torch.testing.assert_close(logprob.grad, -advantages)  # no ratio, no clipping, whatever old_logprob is
    assert clipped.sum() == 0


def test_value_loss_clips_the_move_away_from_the_old_value():
    from rl360.algos.losses import value_loss

    old = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    new = torch.tensor([[0.2, 1.5, 0.1, 1.1]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.4, 0.0, 3.0]])
    loss, clipped = value_loss(new, old, returns, cliprange_value=0.5)
    for k in range(4):
        v, o, r = new[0, k].item(), old[0, k].item(), returns[0, k].item()
        v_clip = o + max(-0.5, min(0.5, v - o))
        assert loss[0, k].item() == pytest.approx(0.5 * max((v - r) ** 2, (v_clip - r) ** 2), abs=1e-6)
    # position 1 moved 1.5 past the old value: its clipped value (0.5) is further from the return -> clipped
    assert clipped[0].tolist() == [0.0, 1.0, 1.0, 0.0]
    loss.sum().backward()
    assert new.grad[0, 1] == 0 and new.grad[0, 0] != 0  # no gradient through the clipped branch


@pytest.mark.parametrize("key", ["algorithm.gamma", "algorithm.lam"])
def test_discount_and_lambda_outside_the_unit_interval_are_config_errors(key):
    from rl360.config import ConfigError, load_config

    base = ["model.path=m", "data.train_files=[t.parquet]"]
    load_config(None, [*base, f"{key}=0.95"])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + "=1.5 must be in"):
        load_config(None, [*base, f"{key}=1.5"])


def test_sum_norm_of_zero_length_responses_without_a_max_length_is_zero():
    loss = agg_loss(torch.zeros(3, 0), torch.zeros(3, 0), "seq-mean-token-sum-norm", 3.0)
    assert loss.item() == 0.0
