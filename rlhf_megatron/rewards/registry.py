"""Rule-based scorers by ``data_source`` and loading a user's reward function from a file.

`default_compute_score` is what the reward manager calls when no custom function is
configured; it dispatches on the row's ``data_source`` (verl's names). A user function
(``custom_reward_function.path`` / ``.name``) has the same signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

and returns a float, or a dict with a ``"score"`` key plus extra values to log (EasyR1's
``{"overall", "format", "accuracy"}`` also works: ``overall`` is the score).

`load_custom_reward_fn` returns a `CustomRewardFn`, which pickles as (path, name, kwargs) and
re-imports the file when unpickled, so it can be sent to a spawned scoring process even though
its module is not importable by name.

``reward.score_fn`` (EasyR1's ``worker.reward.compute_score``) names ONE scorer for every row,
whatever its data source: a built-in (`scorer_names`: EasyR1's ``math`` and ``r1v``, or any
data-source scorer) wrapped in a `NamedScoreFn`, or ``path.py:function``.
`resolve_compute_score` picks between it, ``custom_reward_function`` and the default dispatch.

Boundaries: pure Python; nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rlhf_megatron.rewards import arith, boxed_math, countdown, easyr1, gsm8k, tool_mult

__all__ = [
    "CustomRewardFn",
    "NamedScoreFn",
    "default_compute_score",
    "known_data_sources",
    "load_custom_reward_fn",
    "register_scorer",
    "resolve_compute_score",
    "scorer_names",
]

# data_source -> scorer(solution_str, ground_truth, **kwargs)
_SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": boxed_math.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": boxed_math.compute_score,
    "countdown": countdown.compute_score,
    "arith": arith.compute_score,
    "tool_mult": tool_mult.compute_score,
}

# Scorers chosen by name (reward.score_fn) rather than by a row's data source; they return
# EasyR1's {"overall", "format", "accuracy"}.
_NAMED_SCORERS: dict[str, Callable[..., Any]] = {
    "math": easyr1.math_compute_score,
    "r1v": easyr1.r1v_compute_score,
}


def known_data_sources() -> list[str]:
    return sorted(_SCORERS)


def scorer_names() -> list[str]:
    """Names ``reward.score_fn`` accepts besides ``path.py:function``."""
    return sorted({**_SCORERS, **_NAMED_SCORERS})


def register_scorer(data_source: str, scorer: Callable[..., float], overwrite: bool = False) -> None:
    """Add a rule-based scorer ``scorer(solution_str, ground_truth, **kwargs)`` for ``data_source``.

    Registration is per process: with ``num_workers > 0`` the scoring processes only see
    scorers registered at import time of a module they import; prefer a custom reward function.
    """
    if data_source in _SCORERS and not overwrite:
        raise ValueError(
            f"register_scorer: '{data_source}' already has a scorer; pass overwrite=True to replace it."
        )
    _SCORERS[data_source] = scorer


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None, **kwargs: Any
) -> float:
    """Score one response with the rule-based scorer for ``data_source``; ``kwargs`` go to the scorer."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(
            f"default_compute_score: no rule-based scorer for data_source {data_source!r}. "
            f"Known data sources: {known_data_sources()}. For another dataset, write a reward function and "
            "set custom_reward_function.path and custom_reward_function.name."
        )
    return scorer(solution_str, ground_truth, **kwargs)


def _load_function(path: str, name: str, key: str = "custom_reward_function") -> Callable[..., Any]:
    """Import function ``name`` from file ``path``; errors name the config ``key`` it came from."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}.path: reward function file {path} does not exist.")
    # A name derived from the path: loading the same file twice reuses one module name, and two
    # files never collide.
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    module_name = f"_rlhf_megatron_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}.path: cannot import {path} as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets pickle and dataclasses resolve names defined in the file
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise ImportError(f"{key}.path: importing {path} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"{key}.name: {path} has no function '{name}'; it defines {defined}. "
            f"Set {key}.name to one of them."
        )
    if not callable(fn):
        raise TypeError(f"{key}.name: '{name}' in {path} is a {type(fn).__name__}, not a function.")
    return fn


class CustomRewardFn:
    """A reward function loaded from a file; calls pass ``reward_kwargs`` as extra keywords."""

    def __init__(
        self,
        path: str | os.PathLike,
        name: str = "compute_score",
        reward_kwargs: Mapping | None = None,
        key: str = "custom_reward_function",
    ):
        self.path = os.path.abspath(os.fspath(path))
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        self.key = key
        self._fn = _load_function(self.path, name, key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **{**self.reward_kwargs, **kwargs})

    def __repr__(self) -> str:
        return f"{self.name} (from {self.path})"

    def __getstate__(self) -> dict:
        # The function itself may not be importable by name in another process; its file is.
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs, "key": self.key}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["name"], state["reward_kwargs"], state["key"])


def load_custom_reward_fn(
    path: str | os.PathLike,
    name: str = "compute_score",
    reward_kwargs: Mapping | None = None,
    key: str = "custom_reward_function",
) -> CustomRewardFn:
    """Load function ``name`` from the Python file ``path`` (``custom_reward_function.path/.name``;
    ``key`` names the config section in errors)."""
    return CustomRewardFn(path, name, reward_kwargs, key)


class NamedScoreFn:
    """A built-in scorer applied to every row, ignoring its data source (``reward.score_fn=math``).

    Called like any reward function (``data_source, solution_str, ground_truth, extra_info``);
    ``reward_kwargs`` (e.g. ``format_weight``) go to the scorer. Pickles by name.
    """

    def __init__(self, name: str, reward_kwargs: Mapping | None = None):
        scorer = _NAMED_SCORERS.get(name) or _SCORERS.get(name)
        if scorer is None:
            raise ValueError(
                f"reward.score_fn: unknown scorer {name!r}. Built-in scorers: {scorer_names()}; or give a file "
                "as path/to/reward.py:function_name."
            )
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        self._scorer = scorer

    def __call__(
        self,
        data_source: Any,
        solution_str: str,
        ground_truth: Any,
        extra_info: Mapping | None = None,
        **kwargs,
    ) -> Any:
        return self._scorer(solution_str, ground_truth, **{**self.reward_kwargs, **kwargs})

    def __repr__(self) -> str:
        return f"{self.name} (reward.score_fn)"

    def __getstate__(self) -> dict:
        return {"name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"], state["reward_kwargs"])


def _score_fn(spec: str, reward_kwargs: Mapping | None) -> Callable[..., Any]:
    """``reward.score_fn``: ``path.py[:function]`` loads a file, anything else is a built-in name."""
    path, _, name = spec.partition(":") if ".py:" in spec else (spec, "", "")
    if path.endswith(".py"):
        return load_custom_reward_fn(
            os.path.expanduser(path), name or "compute_score", reward_kwargs, "reward.score_fn"
        )
    return NamedScoreFn(spec, reward_kwargs)


def resolve_compute_score(
    path: str | None = None,
    name: str | None = None,
    reward_kwargs: Mapping | None = None,
    score_fn: str | None = None,
) -> Callable[..., Any]:
    """The reward function of a run.

    ``score_fn`` (``reward.score_fn``) when set: one scorer for every row; else the custom
    function when ``path`` (``custom_reward_function.path``) is set; else `default_compute_score`,
    which dispatches on each row's data source. ``reward_kwargs`` go to the scorer in the first
    two cases. Setting both ``score_fn`` and ``path`` is an error (which would win is a guess).
    """
    if score_fn:
        if path:
            raise ValueError(
                f"reward.score_fn={score_fn!r} and custom_reward_function.path={path!r} are both set; they both "
                "choose the reward function. Keep one (reward.score_fn also takes path.py:function)."
            )
        return _score_fn(str(score_fn), reward_kwargs)
    if not path:
        return default_compute_score
    return load_custom_reward_fn(path, name or "compute_score", reward_kwargs)
