"""Advantage estimators and losses against direct, loop-based reference computations."""

import math

import pytest
import torch

from rl360.algos.advantages import get_advantage_estimator
from rl360.algos.losses import agg_loss, agg_normalizer, get_policy_loss, kl_penalty, ppo_clip_loss


def _reference_grpo(scores, index, norm_by_std, eps=1e-6):
    out = []
    for i, s in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        if len(group) == 1:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


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


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(norm_by_std):
    scores, index, mask, rewards = _inputs()
    adv, returns = get_advantage_estimator("grpo")(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    expected = torch.tensor(_reference_grpo(scores.tolist(), index, norm_by_std))
    torch.testing.assert_close(adv, expected[:, None] * mask)
    assert torch.equal(adv, returns)
    assert adv[8:12].abs().max() == 0  # equal rewards and a group of one: no signal


def test_rloo_matches_leave_one_out_mean():
    scores, index, mask, rewards = _inputs(1)
    adv, _ = get_advantage_estimator("rloo")(rewards, mask, index)
    for i in range(12):
        others = [scores[j].item() for j in range(12) if index[j] == index[i] and j != i]
        expected = scores[i].item() - sum(others) / len(others) if others else 0.0
        assert adv[i, 0].item() == pytest.approx(expected, abs=1e-6)


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


def _masked_whiten_reference(values, mask):
    flat = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1))
    return (values - mean) / math.sqrt(std**2 + 1e-8) * mask


def test_reinforce_plus_plus_returns_and_whitening():
    _, index, mask, _ = _inputs(2)
    rewards = torch.randn(12, 5, generator=torch.Generator().manual_seed(5)) * mask
    adv, returns = get_advantage_estimator("reinforce_plus_plus")(rewards, mask, index, gamma=0.9)
    for i in range(12):
        for t in range(5):
            terms = [0.9 ** (k - t) * rewards[i, k].item() for k in range(t, 5) if mask[i, k]]
            expected = sum(terms) if mask[i, t] else 0
            assert returns[i, t].item() == pytest.approx(expected, abs=1e-5)
    torch.testing.assert_close(adv, _masked_whiten_reference(returns, mask))


def test_reinforce_plus_plus_baseline_is_group_centred_then_whitened():
    scores, index, mask, rewards = _inputs(3)
    adv, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(rewards, mask, index)
    centred = torch.tensor(_reference_grpo(scores.tolist(), index, norm_by_std=False))[:, None] * mask
    torch.testing.assert_close(adv, _masked_whiten_reference(centred, mask))


def test_opo_uses_length_weighted_baseline():
    scores, index, mask, rewards = _inputs(4)
    adv, _ = get_advantage_estimator("opo")(rewards, mask, index)
    lengths = mask.sum(-1)
    for i in range(12):
        group = [j for j in range(12) if index[j] == index[i]]
        if len(group) == 1:
            assert adv[i].abs().sum() == 0
            continue
        base = sum(lengths[j] * scores[j] for j in group) / sum(lengths[j] for j in group)
        assert adv[i, 0].item() == pytest.approx((scores[i] - base).item(), abs=1e-6)


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


def test_gspo_sequence_ratio_and_token_variant_gradient():
    gen = torch.Generator().manual_seed(7)
    old = torch.randn(4, 6, generator=gen) - 2
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    adv = torch.randn(4, 1, generator=gen).expand(4, 6) * mask
    logprob = (old + 1e-4 * torch.randn(4, 6, generator=gen)).requires_grad_(True)
    loss, _ = get_policy_loss("gspo")(logprob, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    seq_ratio = torch.exp(((logprob - old) * mask).sum(-1) / mask.sum(-1)).detach()
    torch.testing.assert_close(loss.detach(), -adv * seq_ratio[:, None])
    grad_seq, = torch.autograd.grad(agg_loss(loss, mask, "seq-mean-token-mean", 4.0), logprob)
    token_loss, _ = get_policy_loss("gspo_token")(logprob, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    grad_tok, = torch.autograd.grad(agg_loss(token_loss, mask, "seq-mean-token-mean", 4.0), logprob)
    torch.testing.assert_close(grad_tok, grad_seq)  # equal advantages per sequence: identical gradients


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


def test_remax_subtracts_the_greedy_score_from_the_return_to_go():
    scores, index, mask, rewards = _inputs(3)
    mask[4] = 0  # a fully masked (empty) response
    rewards[4] = 0
    rewards[7, 1] = 0.5  # an intermediate token reward: returns-to-go differ along the response
    baselines = torch.linspace(-0.5, 1.0, 12)
    adv, returns = get_advantage_estimator("remax")(rewards, mask, index, reward_baselines=baselines)
    for i in range(12):
        for t in range(5):
            expected_return = sum(rewards[i, u].item() * mask[i, u].item() for u in range(t, 5))
            assert returns[i, t].item() == pytest.approx(expected_return, abs=1e-6)
            expected = (expected_return - baselines[i].item()) * mask[i, t].item()
            assert adv[i, t].item() == pytest.approx(expected, abs=1e-6)
    assert adv[4].abs().max() == 0
    with pytest.raises(ValueError, match="reward_baselines"):
        get_advantage_estimator("remax")(rewards, mask, index)


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


def _reference_gae(rewards, values, mask, gamma, lam):
    """Per row: the response positions in order, GAE over them alone, value 0 after the last."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        running, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_value = values[i, t].item()
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95)])
def test_gae_matches_reference_and_whitens(gamma, lam):
    from rl360.algos.advantages import masked_whiten

    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(6, 7, generator=gen)
    values = torch.randn(6, 7, generator=gen)
    mask = torch.ones(6, 7)
    mask[1, 4:] = 0  # a shorter response
    mask[2] = 0  # an empty response
    mask[3, 2] = 0  # a hole inside a response: skipped, the later positions pass through
    adv, returns = get_advantage_estimator("gae")(rewards * mask, mask, None, values=values, gamma=gamma, lam=lam)
    raw = _reference_gae(rewards * mask, values, mask, gamma, lam)
    torch.testing.assert_close(returns, (raw + values) * mask)
    torch.testing.assert_close(adv, masked_whiten(raw, mask))
    assert adv[2].abs().max() == 0
    with pytest.raises(ValueError, match="values"):
        get_advantage_estimator("gae")(rewards, mask, None)


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
