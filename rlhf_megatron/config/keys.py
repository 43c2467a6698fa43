"""The dotted key space of the schema, and the verl keys we accept without a schema field.

Role: answers "is ``a.b.c`` a key, what type does it take, what does it mean?" for the
loader's unknown-key errors (with difflib suggestions) and for the docs test. Also holds
the two tables that let verl configs load unchanged:

* ``IGNORED_KEYS``: keys meaningful only to verl's FSDP backend or to features we leave
  out. They are accepted and dropped, with one warning listing them. Some are accepted
  only at their harmless value (``inert``); any other value is an error, because dropping
  it would silently change the run.
* ``RENAMED_KEYS``: other spellings of one schema key (``grad_clip`` for
  ``optim.clip_grad``), so each setting has a single field.

Boundaries: reads dataclasses and their source; knows nothing about values or files.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rlhf_megatron.config.schema import RunConfig

__all__ = [
    "IGNORED_KEYS",
    "RENAMED_KEYS",
    "IgnoredKey",
    "KeyInfo",
    "field_docs",
    "find_ignored",
    "schema_dataclasses",
    "schema_keys",
]


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, including inherited fields: ``{field: doc}``.

    A field's doc is the string literal on the line(s) after its annotation, the
    convention megatron-core's configs use. Subclasses override their parents' docs.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclass(frozen=True)
class KeyInfo:
    """One schema key. ``section`` keys hold other keys; ``open_dict`` leaves take any subkeys."""

    key: str
    type_name: str
    doc: str
    section: bool = False
    open_dict: bool = False
    optional: bool = False
    section_type: type | None = None
    choices: tuple[str, ...] | None = None
    """A closed-choice key (an Enum field): the values it takes; for a list of choices, the
    values each entry takes (``list_of_choices``)."""
    list_of_choices: bool = False

    def choices_text(self) -> str:
        """The allowed values as a user types them, ``null`` first when the key is optional."""
        shown = ("null", *self.choices) if self.optional and not self.list_of_choices else self.choices
        return ", ".join(shown or ())


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _choices(tp: Any) -> tuple[tuple[str, ...] | None, bool]:
    """``(values, is_list)`` of an Enum type or a list of one; ``(None, False)`` for other types."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and isinstance(args[0], type) and issubclass(args[0], Enum):
        return tuple(m.value for m in args[0]), True
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tuple(m.value for m in tp), False
    return None, False


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any"
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__name__
    if typing.get_origin(tp) is list and typing.get_args(tp):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return str(tp).replace("typing.", "")


@functools.cache
def schema_keys(root: type = RunConfig) -> dict[str, KeyInfo]:
    """Every dotted key under ``root`` (sections included), in declaration order."""
    out: dict[str, KeyInfo] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            tp, optional = _strip_optional(hints[f.name])
            doc = docs.get(f.name, "")
            if dataclasses.is_dataclass(tp):
                out[key] = KeyInfo(key, tp.__name__, doc, section=True, optional=optional, section_type=tp)
                walk(tp, key + ".")
                continue
            open_dict = typing.get_origin(tp) is dict
            name = _type_name(tp) + (" | None" if optional else "")
            choices, is_list = _choices(tp)
            out[key] = KeyInfo(
                key,
                name,
                doc,
                open_dict=open_dict,
                optional=optional,
                choices=choices,
                list_of_choices=is_list,
            )

    walk(root, "")
    return out


def schema_dataclasses(root: type = RunConfig) -> list[type]:
    """The root and every dataclass reachable from it (for the every-field-has-a-doc test)."""
    seen = [root]
    seen += [info.section_type for info in schema_keys(root).values() if info.section_type is not None]
    return list(dict.fromkeys(seen))


@dataclass(frozen=True)
class IgnoredKey:
    """A verl key we accept and drop. ``pattern`` matches the key or a parent of it; ``*``
    matches one path component. With ``inert`` set, only those values are accepted."""

    pattern: str
    reason: str
    inert: tuple[Any, ...] | None = None

    def matches(self, key: str) -> bool:
        pat, parts = self.pattern.split("."), key.split(".")
        return len(parts) >= len(pat) and all(p in ("*", k) for p, k in zip(pat, parts))


_FSDP = "FSDP backend only"
_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")

# Order matters: the first match wins, so specific (inert) patterns come before subtrees.
IGNORED_KEYS: tuple[IgnoredKey, ...] = (
    IgnoredKey("actor_rollout_ref.rollout.chat_scheduler", "async chat scheduling is not supported", (None,)),
    IgnoredKey("actor_rollout_ref.rollout.use_fire_sampling", "FIRE sampling is not supported", (False,)),
    IgnoredKey("reward_model.launch_reward_fn_async", "async reward functions are not supported", (False,)),
    *(IgnoredKey(f"{r}.load_weight", "weights are always loaded from model.path", (True,)) for r in _ROLES),
    *(
        IgnoredKey(
            f"{r}.megatron.use_dist_checkpointing", "initial weights come from the HF model.path", (False,)
        )
        for r in _ROLES
    ),
    *(
        IgnoredKey(
            f"{r}.megatron.dist_checkpointing_path", "initial weights come from the HF model.path", (None,)
        )
        for r in _ROLES
    ),
    IgnoredKey("actor_rollout_ref.actor.fsdp_config", _FSDP),
    IgnoredKey("actor_rollout_ref.ref.fsdp_config", _FSDP),
    IgnoredKey("critic.model.fsdp_config", _FSDP),
    IgnoredKey("reward_model.model.fsdp_config", _FSDP),
    IgnoredKey("actor_rollout_ref.model.enable_activation_offload", _FSDP),
    IgnoredKey("critic.model.enable_activation_offload", _FSDP),
    *(
        IgnoredKey(
            f"{r}.ulysses_sequence_parallel_size",
            "Ulysses SP is FSDP-only; use megatron.context_parallel_size",
        )
        for r in _ROLES
    ),
    IgnoredKey("actor_rollout_ref.actor.use_torch_compile", "torch.compile applies to the FSDP model"),
    IgnoredKey("actor_rollout_ref.ref.use_torch_compile", "torch.compile applies to the FSDP model"),
    IgnoredKey("actor_rollout_ref.model.use_liger", "Liger kernels patch HF models, not megatron-core"),
    IgnoredKey(
        "actor_rollout_ref.model.use_fused_kernels", "fused kernels patch HF models, not megatron-core"
    ),
    IgnoredKey(
        "actor_rollout_ref.model.gradient_checkpointing_kwargs",
        "use actor_rollout_ref.actor.megatron.recompute_*",
    ),
    IgnoredKey("critic.model.gradient_checkpointing_kwargs", "use critic.megatron.recompute_*"),
    IgnoredKey(
        "actor_rollout_ref.rollout.layer_name_map", "the weight converter derives vLLM names per architecture"
    ),
    IgnoredKey("actor_rollout_ref.actor.profile", "verl's profiler hooks"),
    IgnoredKey("actor_rollout_ref.ref.profile", "verl's profiler hooks"),
    IgnoredKey("critic.rollout_n", "derived from actor_rollout_ref.rollout.n"),
    IgnoredKey("critic.kl_ctrl", "unused in verl as well; algorithm.kl_ctrl is the controller"),
    IgnoredKey(
        "trainer.default_hdfs_dir", "HDFS upload is not supported; checkpoints stay in default_local_dir"
    ),
    IgnoredKey("trainer.del_local_ckpt_after_load", "HDFS upload is not supported"),
    IgnoredKey("trainer.ray_wait_register_center_timeout", "verl's register center is not used"),
)


# verl's SFT trainer keys (sft_trainer.yaml) that mean nothing on the Megatron engine.
STAGE_IGNORED_KEYS: tuple[IgnoredKey, ...] = (
    IgnoredKey("model.strategy", "every stage trains with Megatron here"),
    IgnoredKey(
        "model.fsdp_config", f"{_FSDP}; Megatron's offload is megatron.param_offload / optimizer_offload"
    ),
    IgnoredKey("model.use_liger", f"{_FSDP}; the Megatron engine has its own fused loss", (False,)),
    IgnoredKey("model.external_lib", "custom model classes are not supported here", (None,)),
    IgnoredKey("model.lora_rank", "LoRA in the SFT stage is not supported yet", (0,)),
    IgnoredKey("model.lora_alpha", "LoRA in the SFT stage is not supported yet"),
    IgnoredKey("model.target_modules", "LoRA in the SFT stage is not supported yet"),
    IgnoredKey("ulysses_sequence_parallel_size", f"{_FSDP}; Megatron's is megatron.context_parallel_size"),
    IgnoredKey("use_remove_padding", "rows are packed with data.packing"),
    IgnoredKey("data.micro_batch_size", "use data.micro_batch_size_per_gpu", (None,)),
    IgnoredKey("data.balance_dp_token", "rows are packed with data.packing"),
    IgnoredKey("data.chat_template", "the tokenizer's own chat template is used", (None,)),
    IgnoredKey("data.custom_cls", "custom dataset classes are not supported", (None,)),
    IgnoredKey("data.use_shm", "files are read from their paths", (False,)),
    IgnoredKey("trainer.default_hdfs_dir", "checkpoints stay in trainer.default_local_dir", (None,)),
    IgnoredKey("trainer.checkpoint", "a stage checkpoint holds the model and its optimizer state"),
    IgnoredKey("trainer.resume_path", "resume_mode=auto continues from default_local_dir", (None,)),
    IgnoredKey("model.use_shm", "the model is read from its path", (False,)),
    IgnoredKey("data.prompt_dict_keys", "prompt_key names a string column", (None,)),
    IgnoredKey("data.response_dict_keys", "response_key names a string column", (None,)),
    IgnoredKey("data.multiturn.enable_thinking_key", "rendered as the chat template renders it"),
)

# verl's SFT spellings of a stage key (``sft_trainer.yaml``) -> the key; RL's table does not apply.
STAGE_RENAMED_KEYS: dict[str, str] = {
    "optim.warmup_steps_ratio": "optim.lr_warmup_steps_ratio",
    "optim.lr_scheduler": "optim.warmup_style",
    "optim.grad_clip": "optim.clip_grad",
    "trainer.save_limit": "trainer.max_ckpt_to_keep",
}


def find_ignored(key: str, table: tuple[IgnoredKey, ...] = IGNORED_KEYS) -> IgnoredKey | None:
    """The first entry of ``table`` (RL's ``IGNORED_KEYS`` by default) matching ``key``, or None."""
    return next((entry for entry in table if entry.matches(key)), None)


# Other spellings of a schema key -> the key. Setting both spellings to different values
# is an error (see loader).
RENAMED_KEYS: dict[str, str] = {
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",
    "critic.grad_clip": "critic.optim.clip_grad",
    "actor_rollout_ref.actor.optim.lr_decay_style": "actor_rollout_ref.actor.optim.warmup_style",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor_rollout_ref.actor.optim.warmup_style",
    "critic.optim.lr_decay_style": "critic.optim.warmup_style",
    "critic.optim.lr_scheduler_type": "critic.optim.warmup_style",
    "trainer.val_generations_to_log_to_wandb": "trainer.log_val_generations",
    "trainer.val_generations_to_log": "trainer.log_val_generations",
    "trainer.save_limit": "trainer.max_actor_ckpt_to_keep",
}
