"""Teachers for on-policy distillation: vLLM engines that score the student's sampled sequences.

One ``VLLMEngine`` per teacher (``distillation.teacher_model`` or ``teacher_models.<name>``). The
teacher never generates: each row's prompt and response go in as one prompt with
``max_tokens=1`` and ``prompt_logprobs``, and vLLM returns, at every position, the teacher's
log-prob of the token actually there (and, with ``prompt_logprobs=k``, its ``k`` likeliest
tokens). The positions of the response are the student's sampled tokens, so the teacher's
log-probs line up with the actor's ``old_log_probs``: ``teacher_log_probs`` [B, R] and, for
``forward_kl_topk``, ``teacher_topk_ids`` / ``teacher_topk_log_probs`` [B, R, K] (zeros past a
row's response).

Placement is the caller's: colocated, ``ActorRolloutRefWorker`` builds a ``TeacherScorer`` in its
own processes after the rollout engine (vLLM's parallel groups are per process, so the teacher
takes the rollout's tensor-parallel size and its rows are dispatched like a generation's); on a
pool of their own, ``workers.teacher.TeacherWorker`` builds one per process.

Boundaries: engines and token ids only; the loss is ``algorithms/distillation.py``. Never Megatron.
"""

from __future__ import annotations

import os

import torch

from rlhf_megatron.config.schema_distill import DistillationConfig, TeacherModelConfig
from rlhf_megatron.data.batch import Batch

__all__ = [
    "TEACHER_COLUMNS",
    "TeacherScorer",
    "check_teacher_tokenizers",
    "rows_by_teacher",
    "sequence_log_probs",
]

TEACHER_COLUMNS = ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs")
"""The batch columns a teacher writes (the last two only with ``forward_kl_topk``)."""


def _tokenizer_signature(path: str, trust_remote_code: bool) -> tuple[dict, dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code)
    special = {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "special": sorted(tok.all_special_tokens),
    }
    return tok.get_vocab(), special


def check_teacher_tokenizers(
    student_path: str, distillation: DistillationConfig, trust_remote_code: bool = False
) -> None:
    """Refuse a teacher whose tokenizer differs from the student's (vocabulary or special tokens):
    it would score the student's token ids as other tokens. Raises ``ValueError`` naming both
    directories and the first difference."""
    vocab, special = _tokenizer_signature(student_path, trust_remote_code)
    for name, teacher in distillation.teachers().items():
        where = distillation.teacher_key(name)
        t_vocab, t_special = _tokenizer_signature(str(teacher.model_path), trust_remote_code)
        problem = None
        if t_vocab != vocab:
            differ = sorted(set(vocab.items()) ^ set(t_vocab.items()))[:3]
            problem = (
                f"the vocabularies differ ({len(vocab)} vs {len(t_vocab)} tokens; e.g. {differ})"
                if differ
                else "the vocabularies differ"
            )
        elif t_special != special:
            diff = {k: (special[k], t_special[k]) for k in special if special[k] != t_special[k]}
            problem = f"the special tokens differ (student, teacher): {diff}"
        if problem:
            raise ValueError(
                f"{where}.model_path={teacher.model_path}: the teacher's tokenizer is not the student's "
                f"(actor_rollout_ref.model.path={student_path}): {problem}. On-policy distillation scores "
                "the student's token ids with the teacher as they are; use a teacher of the same tokenizer"
            )


def build_teacher_engine(
    teacher: TeacherModelConfig, *, tensor_parallel_size: int, max_model_len: int, topk: int, seed: int = 0
):
    """The teacher's ``VLLMEngine`` (imports vLLM). ``topk``: top-k log-probs per position (0: none)."""
    from rlhf_megatron.config.schema_roles import RolloutConfig
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    inference = teacher.inference
    engine_kwargs = dict(inference.engine_kwargs)
    if topk:  # vLLM refuses more prompt log-probs per position than max_logprobs (20 by default)
        engine_kwargs["max_logprobs"] = max(int(engine_kwargs.get("max_logprobs", 20)), topk)
    rollout = RolloutConfig(
        dtype=inference.dtype,
        gpu_memory_utilization=inference.gpu_memory_utilization,
        tensor_model_parallel_size=tensor_parallel_size,
        max_num_seqs=inference.max_num_seqs,
        # A sequence is prefilled whole (its prompt log-probs come from one pass).
        max_num_batched_tokens=max(inference.max_num_batched_tokens, max_model_len),
        enforce_eager=inference.enforce_eager,
        enable_sleep_mode=False,
        engine_kwargs=engine_kwargs,
    )
    return VLLMEngine(
        os.path.expanduser(str(teacher.model_path)),
        rollout,
        max_model_len=max_model_len,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
    )


def sequence_log_probs(
    engine, sequences: list[list[int]], starts: list[int], topk: int = 0
) -> list[tuple[list[float], list[list[int]], list[list[float]]]]:
    """The teacher's log-probs of ``sequences[i][starts[i]:]`` (each token given the ones before
    it), in one batched call: per sequence ``(log-probs, top-k ids, top-k log-probs)``, the last two
    one list of ``topk`` per position (empty lists when ``topk=0``). ``starts[i] >= 1``: vLLM has no
    log-prob for a sequence's first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not sequences:
        return []
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=topk, detokenize=False)
    outputs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=list(seq)) for seq in sequences], params, use_tqdm=False
    )
    results = []
    for row, (seq, start, out) in enumerate(zip(sequences, starts, outputs)):
        per_position = out.prompt_logprobs or []
        if len(per_position) != len(seq):
            raise RuntimeError(
                f"teacher scoring: vLLM returned {len(per_position)} prompt log-probs for row {row}'s "
                f"{len(seq)} tokens"
            )
        log_probs, top_ids, top_lps = [], [], []
        for pos in range(start, len(seq)):
            entries = per_position[pos]
            log_probs.append(entries[seq[pos]].logprob)
            if topk:
                ranked = sorted(
                    ((lp.rank, tok, lp.logprob) for tok, lp in entries.items() if lp.rank <= topk),
                    key=lambda e: e[0],
                )[:topk]
                if len(ranked) < topk:
                    raise ValueError(
                        f"teacher scoring: the teacher returned {len(ranked)} top tokens at a position, "
                        f"fewer than distillation.distillation_loss.topk={topk} (is topk above the vocabulary?)"
                    )
                top_ids.append([tok for _, tok, _ in ranked])
                top_lps.append([lp for _, _, lp in ranked])
        results.append((log_probs, top_ids, top_lps))
    return results


def rows_by_teacher(
    teachers: dict[str, TeacherModelConfig], batch: Batch, key_column: str
) -> dict[str, list[int]]:
    """Each teacher's rows of ``batch``: all of them for one teacher without a ``key``, else the rows
    whose ``key_column`` value is the teacher's ``key``. A row no teacher serves is an error naming
    its value and the keys."""
    if len(teachers) == 1 and next(iter(teachers.values())).key is None:
        return {next(iter(teachers)): list(range(len(batch)))}
    if key_column not in batch.non_tensor_keys:
        raise ValueError(
            f"distillation.teacher_models pick rows by data.reward_fn_key={key_column!r}, which the batch "
            f"does not have (its columns: {sorted(batch.keys())})"
        )
    by_key = {t.key: name for name, t in teachers.items()}
    rows: dict[str, list[int]] = {name: [] for name in teachers}
    for i, value in enumerate(batch[key_column]):
        name = by_key.get(str(value))
        if name is None:
            raise ValueError(
                f"row {i} has {key_column}={value!r}, which no teacher serves; the teachers' keys "
                f"(distillation.teacher_models.<name>.key) are {sorted(map(str, by_key))}"
            )
        rows[name].append(i)
    return rows


class TeacherScorer:
    """Every teacher of a run in this process: ``score(batch)`` writes the teacher columns."""

    def __init__(
        self,
        distillation: DistillationConfig,
        *,
        tensor_parallel_size: int,
        context_len: int,
        key_column: str = "data_source",
        seed: int = 0,
    ):
        """``context_len``: prompt + response length (the engines hold it plus one token);
        ``key_column``: the non-tensor column whose value picks a row's teacher."""
        self.topk = (
            int(distillation.distillation_loss.topk or 0)
            if distillation.distillation_loss.loss_mode == "forward_kl_topk"
            else 0
        )
        self.key_column = key_column
        self.teachers = distillation.teachers()
        self.engines = {}
        for name, teacher in self.teachers.items():
            self.engines[name] = build_teacher_engine(
                teacher,
                tensor_parallel_size=tensor_parallel_size,
                max_model_len=teacher.inference.max_model_len or context_len + 1,
                topk=self.topk,
                seed=seed,
            )

    def score(self, batch: Batch) -> Batch:
        """``teacher_log_probs`` [B, R] (and the top-k columns [B, R, K]) of ``batch``'s responses."""
        if "multi_modal_data" in batch.non_tensor_keys or "multi_modal_inputs" in batch.non_tensor_keys:
            raise ValueError("on-policy distillation scores text rows only; this batch carries images")
        width, room = batch["prompts"].shape[1], batch["responses"].shape[1]
        mask = batch["attention_mask"].bool()
        out = {"teacher_log_probs": torch.zeros(len(batch), room, dtype=torch.float32)}
        if self.topk:
            out["teacher_topk_ids"] = torch.zeros(len(batch), room, self.topk, dtype=torch.long)
            out["teacher_topk_log_probs"] = torch.zeros(len(batch), room, self.topk, dtype=torch.float32)
        for name, rows in rows_by_teacher(self.teachers, batch, self.key_column).items():
            # Each row under its attention mask: the prompt's tokens, then the response's (every
            # token the policy's forward pass sees, tool outputs of a multi-turn row included).
            sequences = [batch["input_ids"][i][mask[i]].tolist() for i in rows]
            starts = [int(mask[i, :width].sum()) for i in rows]
            if any(s < 1 for s in starts):
                raise ValueError(
                    "teacher scoring: a row has an empty prompt; the first token has no log-prob"
                )
            scored = sequence_log_probs(self.engines[name], sequences, starts, self.topk)
            for i, (lps, top_ids, top_lps) in zip(rows, scored):
                n = len(lps)
                out["teacher_log_probs"][i, :n] = torch.tensor(lps, dtype=torch.float32)
                if self.topk and n:
                    out["teacher_topk_ids"][i, :n] = torch.tensor(top_ids, dtype=torch.long)
                    out["teacher_topk_log_probs"][i, :n] = torch.tensor(top_lps, dtype=torch.float32)
        return Batch.from_dict(out)

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        self.engines = {}
