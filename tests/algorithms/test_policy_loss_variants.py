"""verl's further policy losses (cispo, sapo, gpg, dro, geo_mean, clip_cov, dppo_tv, dppo_kl):
value and gradient against each paper's formula, written here token by token in Python floats,
on random tensors with ragged masks and rollout-correction weights."""

import math

import pytest
import torch

from rlhf_megatron.algorithms import POLICY_LOSS_REGISTRY, get_policy_loss_fn

from . import reference as ref

F64 = torch.float64
NEW_LOSSES = ("cispo", "sapo", "gpg", "dro", "geo_mean", "clip_cov", "dppo_tv", "dppo_kl")


def _inputs(seed: int, batch: int = 4, steps: int = 6):
    g = torch.Generator().manual_seed(seed)
    # Log-probs of sampled tokens (< 0), with old and new apart by up to ~0.6 in log space so
    # that clipping, gating and trust regions all bind on some tokens.
    old = -torch.rand(batch, steps, generator=g, dtype=F64) * 2.0 - 0.05
    new = (old + (torch.rand(batch, steps, generator=g, dtype=F64) - 0.5) * 1.2).clamp(max=-1e-3)
    adv = torch.randn(batch, steps, generator=g, dtype=F64)
    mask = ref.ragged_mask(batch, steps, g, min_len=1).to(F64)
    weights = torch.rand(batch, steps, generator=g, dtype=F64) * 1.5 + 0.25
    return old, new.requires_grad_(), adv, mask, weights


def _aggregate(per_token, per_token_grad, mask, mode):
    """Python-float aggregation of per-token (loss, d loss / d lp) tables: (value, (B, T) grad)."""
    rows = len(mask)
    grad = [[0.0] * len(mask[0]) for _ in range(rows)]
    if mode == "token-mean":
        n = sum(sum(r) for r in mask)
        value = sum(per_token[i][t] for i in range(rows) for t in range(len(mask[i])) if mask[i][t]) / n
        for i in range(rows):
            for t in range(len(mask[i])):
                grad[i][t] = per_token_grad[i][t] / n if mask[i][t] else 0.0
        return value, grad
    assert mode == "seq-mean-token-mean"
    value = 0.0
    for i in range(rows):
        n_i = sum(mask[i])
        value += sum(per_token[i][t] for t in range(len(mask[i])) if mask[i][t]) / n_i / rows
        for t in range(len(mask[i])):
            grad[i][t] = per_token_grad[i][t] / n_i / rows if mask[i][t] else 0.0
    return value, grad


def _per_token(old, new, adv, mask, weights, token_fn):
    """Apply ``token_fn(old, new, adv) -> (loss, dloss/dnew)`` to every entry, times its weight."""
    o, n, a, w = old.tolist(), new.detach().tolist(), adv.tolist(), weights.tolist()
    losses, grads = [], []
    for i in range(len(o)):
        pairs = [token_fn(o[i][t], n[i][t], a[i][t]) for t in range(len(o[i]))]
        losses.append([lv * w[i][t] for t, (lv, _) in enumerate(pairs)])
        grads.append([gv * w[i][t] for t, (_, gv) in enumerate(pairs)])
    return losses, grads


def _check(name, seed, token_fn, mode="token-mean", **options):
    old, new, adv, mask, weights = _inputs(seed)
    loss, *_ = get_policy_loss_fn(name)(
        old, new, adv, mask, loss_agg_mode=mode, rollout_is_weights=weights, **options
    )
    loss.backward()
    losses, grads = _per_token(old, new, adv, mask, weights, token_fn)
    value, grad = _aggregate(losses, grads, mask.tolist(), mode)
    assert loss.item() == pytest.approx(value, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=F64), rtol=1e-9, atol=1e-12)
    return old, new, adv, mask


def test_every_new_loss_is_registered_under_verls_name():
    for name in NEW_LOSSES:
        assert get_policy_loss_fn(name) is POLICY_LOSS_REGISTRY[name]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_formula(seed, mode):
    lo, hi = 0.8, 1.28

    def token(o, n, a):
        c = min(max(math.exp(n - o), lo), hi)
        return -c * a * n, -c * a  # the clipped weight is a constant to the gradient

    _check("cispo", seed, token, mode, cliprange=0.2, cliprange_high=0.28)


def test_cispo_clipfrac_counts_clipped_weights():
    old, new, adv, mask, _ = _inputs(3)
    _, clipfrac, ppo_kl, lower = get_policy_loss_fn("cispo")(old, new, adv, mask, cliprange=0.2)
    ratio = (new.detach() - old).exp()
    expected = (((ratio < 0.8) | (ratio > 1.2)).to(F64) * mask).sum() / mask.sum()
    assert clipfrac.item() == pytest.approx(expected.item())
    assert 0 < clipfrac.item() < 1  # the draw clips some tokens and not others
    assert ppo_kl.item() == pytest.approx((((old - new.detach()) * mask).sum() / mask.sum()).item())
    assert lower.item() == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_sapo_formula_and_forced_seq_mean_token_mean(seed):
    tau_pos, tau_neg = 1.0, 1.05

    def token(o, n, a):
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(n - o)
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        # d/dn of -a * (4/tau) * sigmoid(tau (r - 1)) = -a * 4 * s (1 - s) * r
        return -a * (4 / tau) * s, -a * 4 * s * (1 - s) * r

    # verl aggregates SAPO by seq-mean-token-mean whatever loss_agg_mode says.
    old, new, adv, mask, weights = _inputs(seed)
    loss_tm, *_ = get_policy_loss_fn("sapo")(
        old, new, adv, mask, loss_agg_mode="token-mean", rollout_is_weights=weights
    )
    _check("sapo", seed, token, "seq-mean-token-mean", tau_pos=tau_pos, tau_neg=tau_neg)
    losses, grads = _per_token(old, new, adv, mask, weights, token)
    assert loss_tm.item() == pytest.approx(_aggregate(losses, grads, mask.tolist(), "seq-mean-token-mean")[0])


def test_sapo_temperatures_are_read():
    old, new, adv, mask, _ = _inputs(5)
    a, *_ = get_policy_loss_fn("sapo")(old, new, adv, mask, tau_pos=1.0, tau_neg=1.05)
    b, *_ = get_policy_loss_fn("sapo")(old, new, adv, mask, tau_pos=2.0, tau_neg=3.0)
    assert abs(a.item() - b.item()) > 1e-6
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        get_policy_loss_fn("sapo")(old, new, adv, mask, tau_neg=0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_gpg_formula(seed):
    _check("gpg", seed, lambda o, n, a: (-a * n, -a))


@pytest.mark.parametrize("seed", [0, 1])
def test_dro_formula(seed):
    beta = 0.3
    _check(
        "dro",
        seed,
        lambda o, n, a: (-(a * n - 0.5 * beta * (n - o) ** 2), -a + beta * (n - o)),
        dro_beta=beta,
    )


def test_dro_needs_a_positive_beta():
    old, new, adv, mask, _ = _inputs(0)
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="dro_beta must be > 0"):
            get_policy_loss_fn("dro")(old, new, adv, mask, dro_beta=beta)


@pytest.mark.parametrize("seed", [0, 1])
def test_geo_mean_formula(seed):
    low, high = 0.2, 0.28
    old, new, adv, mask, weights = _inputs(seed)
    loss, clipfrac, _, lower = get_policy_loss_fn("geo_mean")(
        old, new, adv, mask, cliprange=0.2, cliprange_high=high, rollout_is_weights=weights
    )
    loss.backward()
    o, n, a, m, w = old.tolist(), new.detach().tolist(), adv.tolist(), mask.tolist(), weights.tolist()
    rows, value = len(o), 0.0
    grad = [[0.0] * len(o[0]) for _ in range(rows)]
    clipped_pos = clipped_neg = 0
    for i in range(rows):
        idx = [t for t in range(len(o[i])) if m[i][t]]
        # Each token's log-ratio, clipped only on the side its advantage's sign points to.
        kept = []
        for t in idx:
            d = n[i][t] - o[i][t]
            dc = min(max(d, -low), high)
            clipped_pos += d != dc and a[i][t] > 0
            clipped_neg += d != dc and a[i][t] < 0
            sign = (a[i][t] > 0) - (a[i][t] < 0)
            kept.append((sign * min(sign * d, sign * dc), d == sign * min(sign * d, sign * dc)))
        ratio = math.exp(sum(k for k, _ in kept) / len(idx))
        mean_adv = sum(a[i][t] for t in idx) / len(idx)
        seq_w = math.exp(sum(math.log(w[i][t] + 1e-10) for t in idx) / len(idx))
        value += -mean_adv * ratio * seq_w / rows
        for t, (_, free) in zip(idx, kept):
            # a token on its bound is constant in lp; a free one moves the mean by 1 / len
            grad[i][t] = -mean_adv * ratio * seq_w / len(idx) / rows if free else 0.0
    assert loss.item() == pytest.approx(value, rel=1e-7)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=F64), rtol=1e-6, atol=1e-10)
    n_valid = mask.sum().item()
    assert clipfrac.item() == pytest.approx(clipped_pos / n_valid)
    assert lower.item() == pytest.approx(clipped_neg / n_valid)


def test_clip_cov_cuts_exactly_the_candidates_when_the_budget_covers_them():
    """With ``clip_cov_ratio=1`` every candidate is cut (no random draw): the result is the PPO
    surrogate (no dual clip) times 0 on tokens whose covariance lies in (lb, ub) and that PPO
    did not clip already."""
    old, new, adv, mask, weights = _inputs(7)
    lb, ub = -0.05, 0.3
    loss, clipfrac, _, _ = get_policy_loss_fn("clip_cov")(
        old,
        new,
        adv,
        mask,
        cliprange=0.2,
        rollout_is_weights=weights,
        clip_cov_ratio=1.0,
        clip_cov_lb=lb,
        clip_cov_ub=ub,
    )
    loss.backward()
    o, n, a, m = old.tolist(), new.detach().tolist(), adv.tolist(), mask.tolist()
    valid = [(i, t) for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
    mean_a = sum(a[i][t] for i, t in valid) / len(valid)
    mean_n = sum(n[i][t] for i, t in valid) / len(valid)
    cut = set()

    def token(i, t):
        r = math.exp(n[i][t] - o[i][t])
        rc = min(max(r, 0.8), 1.2)
        unclipped, clipped = -a[i][t] * r, -a[i][t] * rc
        cov = (a[i][t] - mean_a) * (n[i][t] - mean_n)
        if clipped <= unclipped and lb < cov < ub:
            cut.add((i, t))
            return 0.0, 0.0
        return (unclipped, -a[i][t] * r) if unclipped >= clipped else (clipped, 0.0)

    losses = [[0.0] * len(m[0]) for _ in m]
    grads = [[0.0] * len(m[0]) for _ in m]
    for i, t in valid:
        lv, gv = token(i, t)
        losses[i][t], grads[i][t] = lv * weights[i, t].item(), gv * weights[i, t].item()
    value, grad = _aggregate(losses, grads, m, "token-mean")
    assert 0 < len(cut) < len(valid)  # the window selects some tokens, not all
    assert loss.item() == pytest.approx(value, rel=1e-10)
    torch.testing.assert_close(new.grad, torch.tensor(grad, dtype=F64), rtol=1e-9, atol=1e-12)
    assert clipfrac.item() == pytest.approx(len(cut) / len(valid))


def test_clip_cov_budget_limits_the_cut():
    old, new, adv, mask, _ = _inputs(7)
    n_valid = int(mask.sum())
    _, clipfrac, _, _ = get_policy_loss_fn("clip_cov")(
        old,
        new,
        adv,
        mask,
        clip_cov_ratio=1e-6,
        clip_cov_lb=-1e9,
        clip_cov_ub=1e9,
        generator=torch.Generator().manual_seed(0),
    )
    assert clipfrac.item() == pytest.approx(1 / n_valid)  # max(1, int(ratio * n)) = 1 token
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        get_policy_loss_fn("clip_cov")(old, new, adv, mask, clip_cov_ratio=0.0)


def _dppo_token(inside_fn, c):
    def token(o, n, a):
        if not inside_fn(o, n, a):
            return 0.0, 0.0
        r = min(math.exp(n - o), c)
        return -a * r * n, -a * r

    return token


@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_tv_formula(seed):
    low, high, c = 0.1, 0.15, 1.3

    def inside(o, n, a):
        diff = math.exp(n) - math.exp(o)
        return diff <= high if a > 0 else diff >= -low

    old, new, adv, mask = _check(
        "dppo_tv",
        seed,
        _dppo_token(inside, c),
        cliprange_low=low,
        cliprange_high=high,
        cliprange=0.5,
        clip_ratio_c=c,
    )
    _, clipfrac, _, lower = get_policy_loss_fn("dppo_tv")(
        old, new.detach(), adv, mask, cliprange_low=low, cliprange_high=high, clip_ratio_c=c
    )
    flags = [
        (inside(o, n, a), math.exp(n - o) > c)
        for ro, rn, ra, rm in zip(old.tolist(), new.tolist(), adv.tolist(), mask.tolist())
        for o, n, a, mm in zip(ro, rn, ra, rm)
        if mm
    ]
    assert clipfrac.item() == pytest.approx(sum(not f for f, _ in flags) / len(flags))
    assert lower.item() == pytest.approx(sum(f and t for f, t in flags) / len(flags))


@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_kl_formula(seed):
    low, high, c = 0.02, 0.05, 1.3

    def inside(o, n, a):
        p, q = math.exp(n), math.exp(o)
        kl = q * (o - n) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
        return (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)

    _check("dppo_kl", seed, _dppo_token(inside, c), cliprange_low=low, cliprange_high=high, clip_ratio_c=c)


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_padding_cannot_reach_the_loss(name):
    """Garbage on masked entries changes neither the loss nor the valid tokens' gradient."""
    old, new, adv, mask, weights = _inputs(11)
    opts = {"dro_beta": 0.1, "clip_cov_ratio": 1.0}
    loss, *_ = get_policy_loss_fn(name)(old, new, adv, mask, rollout_is_weights=weights, **opts)
    loss.backward()
    pad = mask == 0
    old2 = torch.where(pad, torch.full_like(old, -7.0), old)
    adv2 = torch.where(pad, torch.full_like(adv, 50.0), adv)
    new2 = torch.where(pad, torch.full_like(old, -0.01), new.detach()).requires_grad_()
    loss2, *_ = get_policy_loss_fn(name)(old2, new2, adv2, mask, rollout_is_weights=weights, **opts)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-9)
    torch.testing.assert_close(new2.grad[~pad], new.grad[~pad])
