"""Lag-tolerant actor-critic for CartPole-v1 (no lightning_wsync imports).

The learner is off-policy by a few weight versions: rollout workers act with the
last weights they received, so every sample carries the behaviour log-prob and the
version that produced it. The loss is PPO's clipped surrogate taken against that
*behaviour* log-prob, with advantages and value targets recomputed at every step
from the current critic using V-trace-style truncated importance traces
(``c_t = lambda * min(1, pi/mu)``), so stale data is corrected rather than trusted.

Experience travels as ``dict[str, torch.Tensor]`` (no pickled objects):

==============  ==========  =======  =====================================================
key             shape       dtype    meaning
==============  ==========  =======  =====================================================
obs             [T, 4]      float32  observation the action was taken in
next_obs        [T, 4]      float32  observation after the step (for bootstrapping)
actions         [T]         int64    action taken
logp            [T]         float32  behaviour log-prob of ``actions``
rewards         [T]         float32  reward
dones           [T]         float32  1.0 where the step *terminated* (no bootstrap)
ends            [T]         float32  1.0 where an episode ends (terminated or truncated)
version         [T]         int64    weights version that produced the sample
ep_returns      [E]         float32  return of each episode in the batch
==============  ==========  =======  =====================================================

A batch is any concatenation of whole episodes (``concat_episodes``): every
per-step key is concatenated, ``ep_returns`` too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import IterableDataset

OBS_DIM = 4
N_ACTIONS = 2
STEP_KEYS = (
    "obs",
    "next_obs",
    "actions",
    "logp",
    "rewards",
    "dones",
    "ends",
    "version",
)


# --------------------------------------------------------------------------- model
def _layer(inp: int, out: int, gain: float) -> nn.Linear:
    lin = nn.Linear(inp, out)
    nn.init.orthogonal_(lin.weight, gain)
    nn.init.zeros_(lin.bias)
    return lin


class Policy(nn.Module):
    """Separate actor (4->h->h->2 logits) and critic (4->h->h->1) MLPs, tanh, float32.

    All parameters (both heads) are what gets pushed; rollouts only use the actor.
    """

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        g = math.sqrt(2.0)
        self.actor = nn.Sequential(
            _layer(OBS_DIM, hidden, g),
            nn.Tanh(),
            _layer(hidden, hidden, g),
            nn.Tanh(),
            _layer(hidden, N_ACTIONS, 0.01),
        )
        self.critic = nn.Sequential(
            _layer(OBS_DIM, hidden, g),
            nn.Tanh(),
            _layer(hidden, hidden, g),
            nn.Tanh(),
            _layer(hidden, 1, 1.0),
        )

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [B, 2], value [B])."""
        logits: torch.Tensor = self.actor(obs)
        return logits, self.value(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        v: torch.Tensor = self.critic(obs)
        return v.squeeze(-1)


# ------------------------------------------------------------------------- rollout
@torch.inference_mode()
def act(
    policy: Policy, obs: Any, generator: torch.Generator | None = None
) -> tuple[int, float]:
    """Sample one action for one observation. Returns (action, behaviour log-prob)."""
    x = torch.as_tensor(obs, dtype=torch.float32).reshape(1, OBS_DIM)
    logp_all = torch.log_softmax(policy.actor(x)[0], dim=-1)
    # Two actions: one uniform draw is enough (and cheaper than multinomial).
    u = torch.rand((), generator=generator).item()
    p1 = math.exp(logp_all[1].item())
    a = 1 if u < p1 else 0
    return a, float(logp_all[a].item())


def make_env(seed: int | None = None) -> Any:
    """A CartPole-v1 env, reset once with ``seed`` so later resets continue its RNG."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def run_episode(
    env: Any,
    policy: Policy,
    generator: torch.Generator | None = None,
    version: int = 0,
    max_steps: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run one episode (until terminated/truncated, or ``max_steps``) with ``policy``.

    Returns the episode as a dict of tensors (see module docstring). If
    ``max_steps`` cuts the episode, the last step is marked as an end with
    ``dones = 0`` (i.e. it is bootstrapped like a time-limit truncation).
    """
    obs, _ = env.reset()
    obs_l, next_l, act_l, logp_l, rew_l = [], [], [], [], []
    terminated = truncated = False
    t = 0
    while True:
        a, lp = act(policy, obs, generator)
        nobs, r, terminated, truncated, _ = env.step(a)
        obs_l.append(obs)
        next_l.append(nobs)
        act_l.append(a)
        logp_l.append(lp)
        rew_l.append(r)
        obs = nobs
        t += 1
        if terminated or truncated or (max_steps is not None and t >= max_steps):
            break
    T = len(act_l)
    dones = torch.zeros(T, dtype=torch.float32)
    ends = torch.zeros(T, dtype=torch.float32)
    ends[-1] = 1.0
    if terminated:
        dones[-1] = 1.0
    rewards = torch.tensor(rew_l, dtype=torch.float32)
    return {
        "obs": torch.from_numpy(np.asarray(obs_l, dtype=np.float32)),
        "next_obs": torch.from_numpy(np.asarray(next_l, dtype=np.float32)),
        "actions": torch.tensor(act_l, dtype=torch.int64),
        "logp": torch.tensor(logp_l, dtype=torch.float32),
        "rewards": rewards,
        "dones": dones,
        "ends": ends,
        "version": torch.full((T,), int(version), dtype=torch.int64),
        "ep_returns": rewards.sum().reshape(1),
    }


def concat_episodes(
    episodes: Sequence[dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Concatenate whole episodes (or batches) into one batch."""
    keys = STEP_KEYS + ("ep_returns",)
    return {k: torch.cat([e[k] for e in episodes]) for k in keys}


# ---------------------------------------------------------------------------- loss
def _vtrace_adv(
    values: np.ndarray,
    next_values: np.ndarray,
    rewards: np.ndarray,
    dones: np.ndarray,
    ends: np.ndarray,
    rhos: np.ndarray,
    cs: np.ndarray,
    gamma: float,
) -> tuple[np.ndarray, np.ndarray]:
    """V-trace(lambda) over concatenated episodes (recursion cut at ``ends``).

    ``rhos[t] = min(rho_bar, pi/mu)``, ``cs[t] = lam * min(c_bar, pi/mu)``.
    corr_t = rhos_t * delta_t + gamma * cs_t * corr_{t+1}   (value target V + corr)
    adv_t  =          delta_t + gamma * cs_t * corr_{t+1}   (policy advantage; the
    surrogate's own ratio supplies the importance weight of step t).
    With pi == mu both reduce to GAE(lambda).
    """
    deltas = rewards + gamma * (1.0 - dones) * next_values - values
    corr = np.empty_like(deltas)
    adv = np.empty_like(deltas)
    nxt = 0.0
    for t in range(len(deltas) - 1, -1, -1):
        if ends[t]:
            nxt = 0.0
        fut = gamma * cs[t] * nxt
        adv[t] = deltas[t] + fut
        nxt = rhos[t] * deltas[t] + fut
        corr[t] = nxt
    return adv, corr


def _f64(x: torch.Tensor) -> np.ndarray:
    return x.numpy().astype(np.float64)


def loss(
    policy: Policy,
    batch: dict[str, torch.Tensor],
    *,
    current_version: int | None = None,
    gamma: float = 0.99,
    lam: float = 0.95,
    clip: float = 0.2,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy-corrected PPO loss on a batch of whole episodes.

    * ratio ``rho = pi(a|s) / mu(a|s)`` against the behaviour log-prob in the batch;
    * advantages: V-trace(lambda) from the current critic (recomputed every call:
      traces ``lam * min(c_bar, rho)``), normalised over the batch;
    * policy: PPO clipped surrogate ``-min(rho A, clip(rho) A)``;
    * value: MSE to the V-trace targets (``rho_bar``-truncated TD errors).

    Returns (loss, metrics) with metrics as python floats; ``lag`` (mean
    ``current_version - version``) is included when ``current_version`` is given.
    """
    obs, actions, mu_logp = batch["obs"], batch["actions"], batch["logp"]
    logits, values = policy(obs)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, actions.unsqueeze(1)).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    log_ratio = logp - mu_logp
    ratio = log_ratio.exp()

    with torch.no_grad():
        next_values = policy.value(batch["next_obs"])
        rho_d = ratio.detach()
        adv_np, corr_np = _vtrace_adv(
            _f64(values.detach()),
            _f64(next_values),
            _f64(batch["rewards"]),
            _f64(batch["dones"]),
            batch["ends"].numpy(),
            _f64(torch.clamp(rho_d, max=rho_bar)),
            _f64(lam * torch.clamp(rho_d, max=c_bar)),
            gamma,
        )
        adv = torch.from_numpy(adv_np).to(torch.float32)
        targets = values.detach() + torch.from_numpy(corr_np).to(torch.float32)
        adv_n = (adv - adv.mean()) / (adv.std() + 1e-8)

    surr1 = ratio * adv_n
    surr2 = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv_n
    pg_loss = -torch.min(surr1, surr2).mean()
    v_loss = 0.5 * (values - targets).pow(2).mean()
    total = pg_loss + vf_coef * v_loss - ent_coef * entropy

    with torch.no_grad():
        clipfrac = ((ratio - 1.0).abs() > clip).float().mean()
        approx_kl = ((ratio - 1.0) - log_ratio).mean()
    metrics = {
        "loss": float(total.detach()),
        "pg_loss": float(pg_loss.detach()),
        "v_loss": float(v_loss.detach()),
        "entropy": float(entropy.detach()),
        "clipfrac": float(clipfrac),
        "approx_kl": float(approx_kl),
        "ratio_mean": float(rho_d.mean()),
        "n_steps": float(obs.shape[0]),
        "ep_return_mean": float(batch["ep_returns"].mean())
        if "ep_returns" in batch and batch["ep_returns"].numel()
        else float("nan"),
    }
    if current_version is not None and "version" in batch:
        lag = (current_version - batch["version"]).float()
        metrics["lag_mean"] = float(lag.mean())
        metrics["lag_max"] = float(lag.max())
    return total, metrics


# -------------------------------------------------------------------- data stream
class EpisodeStream(IterableDataset[dict[str, torch.Tensor]]):
    """Turns a source of episodes into training batches (use ``batch_size=None``).

    ``get_episode()`` returns one episode dict (blocking), or ``None`` to end the
    stream. Episodes are accumulated until at least ``min_transitions`` new steps
    are in hand; that batch is then yielded ``reuse`` times (``reuse`` optimizer
    steps = ``reuse`` weight versions on the same data, each recomputing the
    advantages with the current critic and importance ratios).
    """

    def __init__(
        self,
        get_episode: Callable[[], dict[str, torch.Tensor] | None],
        min_transitions: int = 1024,
        reuse: int = 4,
    ) -> None:
        super().__init__()
        self.get_episode = get_episode
        self.min_transitions = min_transitions
        self.reuse = reuse

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            eps, n = [], 0
            while n < self.min_transitions:
                ep = self.get_episode()
                if ep is None:
                    return
                eps.append(ep)
                n += int(ep["actions"].shape[0])
            batch = concat_episodes(eps)
            for _ in range(self.reuse):
                yield batch


# ------------------------------------------------------------------------ learner
class CartPoleLearner(L.LightningModule):
    """LightningModule around ``self.policy`` (the module the sync pushes).

    One optimizer step per batch. ``current_version`` used for the lag metric is
    ``self.version_fn()`` if set (e.g. the sync's published version), else
    ``self.global_step``. The last metrics dict is kept in ``self.last_metrics``.
    """

    def __init__(
        self,
        hidden: int = 64,
        lr: float = 2.5e-3,
        max_grad_norm: float = 0.5,
        gamma: float = 0.99,
        lam: float = 0.95,
        clip: float = 0.2,
        vf_coef: float = 0.5,
        ent_coef: float = 0.0,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.max_grad_norm, self.log_metrics = lr, max_grad_norm, log_metrics
        self.loss_kwargs: dict[str, float] = {
            "gamma": gamma,
            "lam": lam,
            "clip": clip,
            "vf_coef": vf_coef,
            "ent_coef": ent_coef,
        }
        self.policy = Policy(hidden)
        self.version_fn: Callable[[], int] | None = None
        self.last_metrics: dict[str, float] = {}

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy(obs)  # type: ignore[no-any-return]

    def training_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        cur = (
            self.version_fn() if self.version_fn is not None else int(self.global_step)
        )
        total, metrics = loss(
            self.policy, batch, current_version=cur, **self.loss_kwargs
        )
        self.last_metrics = metrics
        if self.log_metrics:
            self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=1)
        return total

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Clip actor and critic separately: the critic's gradients grow with the
        # return scale (up to ~100) and would otherwise throttle the actor's.
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(
                self.policy.actor.parameters(), self.max_grad_norm
            )
            torch.nn.utils.clip_grad_norm_(
                self.policy.critic.parameters(), self.max_grad_norm
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.lr, eps=1e-5)
