"""The documentation cannot rot: the site builds strictly, the config reference pages match the
schemas, every runnable shell block is either run by a test or marked cluster-only, and the README stays a
front page that reaches every guide in one click.

The conventions these tests hold the pages to are written down in docs/contributing.md.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
REFERENCE_DIR = DOCS / "reference"
REFERENCE = REFERENCE_DIR / "config.md"
CLUSTER_ONLY = "# cluster only:"
SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell)\s*$")

README_OPENING = """\
# rlhf_megatron

```bash
bash scripts/quickstart.sh   # (a) set up .venv, build the tiny policy, train it with GRPO on this CPU
bash scripts/test.sh         # (b) set up .venv and run the whole test suite (what CI runs)
```
"""


@dataclass(frozen=True)
class Exercised:
    """A command shown in a runnable block, and where the test suite runs it.

    ``runs``: (file, text) pairs; each file must exist and contain its text, the line that makes
    it run the command (a config name, a flag), so an entry cannot point at a test that doesn't.
    ``how``: what the tests change or leave out (paths, sizes, steps), stated plainly."""

    command: str
    runs: tuple[tuple[str, str], ...]
    how: str


# The quickstart script's steps, shared by every `CONFIG=... bash scripts/quickstart.sh` entry: no
# test runs the script itself (it takes minutes and writes into outputs/); its setup is
# scripts/setup_env.sh, which scripts/test.sh runs before every test run.
_QUICKSTART_HOW = (
    "the script itself is not run by a test; its setup runs in scripts/test.sh and its training "
    "config runs through the training CLI with a few CPU-sized steps"
)

TESTED_COMMANDS: tuple[Exercised, ...] = (
    # scripts/quickstart.sh (the default config): tests/trainer/test_e2e.py trains
    # configs/quickstart_cpu.yaml through the CLI (3 steps, a random model of the quickstart's
    # architecture); tests/tools/test_make_tiny_model.py runs tools/make_tiny_model.py; the export
    # at the end is tests/models/test_convert_ckpt.py's mcore-to-hf.
    Exercised(
        "bash scripts/quickstart.sh",
        (
            ("tests/trainer/test_e2e.py", '"quickstart_cpu"'),
            ("tests/tools/test_make_tiny_model.py", "make_tiny_model.py"),
            ("tests/models/test_convert_ckpt.py", '"mcore-to-hf"'),
        ),
        _QUICKSTART_HOW,
    ),
    # scripts/test.sh: the command that collects this file; it runs whenever this check does.
    Exercised(
        "bash scripts/test.sh",
        (("scripts/test.sh", "python -m pytest"),),
        "it is the test command itself",
    ),
    # TinyZero's verl command line: tests/trainer/test_seed_command.py runs it through the CLI
    # (and tests/config/test_config_seed_command.py parses it) with local countdown data, a tiny
    # Qwen2 model, two CPU processes for $N_GPUS/$ROLLOUT_TP_SIZE and one training step.
    Exercised(
        "python -m rlhf_megatron.train "
        "data.train_files=$DATA_DIR/train.parquet data.val_files=$DATA_DIR/test.parquet "
        "data.train_batch_size=256 data.val_batch_size=1312 data.max_prompt_length=256 "
        "data.max_response_length=1024 actor_rollout_ref.model.path=$BASE_MODEL "
        "actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=128 "
        "actor_rollout_ref.actor.ppo_micro_batch_size=8 "
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=8 "
        "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP_SIZE "
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4 "
        "actor_rollout_ref.ref.log_prob_micro_batch_size=4 critic.optim.lr=1e-5 "
        "critic.model.path=$BASE_MODEL critic.ppo_micro_batch_size=8 algorithm.kl_ctrl.kl_coef=0.001 "
        "trainer.logger=['wandb'] trainer.val_before_train=False trainer.default_hdfs_dir=null "
        "trainer.n_gpus_per_node=$N_GPUS trainer.nnodes=1 trainer.save_freq=100 trainer.test_freq=100 "
        "trainer.project_name=TinyZero trainer.experiment_name=$EXPERIMENT_NAME trainer.total_epochs=15",
        (
            ("tests/trainer/test_seed_command.py", "trainer.project_name=TinyZero"),
            ("tests/config/test_config_seed_command.py", '"trainer.project_name=TinyZero"'),
        ),
        "local paths, a tiny model, 2 CPU processes, 1 step",
    ),
    # The PPO quickstart: tests/trainer/test_e2e.py trains configs/quickstart_cpu_ppo.yaml (critic).
    Exercised(
        "CONFIG=configs/quickstart_cpu_ppo.yaml bash scripts/quickstart.sh",
        (
            ("tests/trainer/test_e2e.py", '"quickstart_cpu_ppo"'),
            ("tests/tools/test_make_tiny_model.py", "make_tiny_model.py"),
        ),
        _QUICKSTART_HOW,
    ),
    # The image quickstart: tests/workers/test_vl_workers_ray.py builds the actor workers from
    # configs/quickstart_vl_cpu.yaml (generation from images, an update, a weight sync) on a tiny
    # random Qwen2.5-VL, and tests/trainer/test_seed003_e2e.py runs the vision-language path through
    # the training CLI. tools/make_tiny_vl_model.py itself has no test.
    Exercised(
        "CONFIG=configs/quickstart_vl_cpu.yaml bash scripts/quickstart.sh",
        (
            ("tests/workers/test_vl_workers_ray.py", '"quickstart_vl_cpu"'),
            ("tests/trainer/test_seed003_e2e.py", '"rlhf_megatron.train"'),
        ),
        _QUICKSTART_HOW + "; the VL config runs through the workers, not the CLI",
    ),
    # The video quickstart: tests/workers/test_vl_workers_ray.py builds the actor workers from
    # configs/quickstart_video_cpu.yaml (generation from image and video prompts, an update, a
    # weight sync) and tests/data/test_tools_data.py runs tools/data/shapes_video.py.
    Exercised(
        "CONFIG=configs/quickstart_video_cpu.yaml bash scripts/quickstart.sh",
        (
            ("tests/workers/test_vl_workers_ray.py", '"quickstart_video_cpu"'),
            ("tests/data/test_tools_data.py", 'load_tool("shapes_video")'),
        ),
        _QUICKSTART_HOW + "; the video config runs through the workers, not the CLI",
    ),
    # The MoE quickstart: tests/trainer/test_moe_e2e.py trains configs/quickstart_moe_cpu.yaml
    # through the CLI (random weights of the preset's architecture; the pre-trained tiny MoE that
    # tools/make_tiny_model.py --arch qwen3_moe builds is not).
    Exercised(
        "CONFIG=configs/quickstart_moe_cpu.yaml bash scripts/quickstart.sh",
        (("tests/trainer/test_moe_e2e.py", 'run_train("quickstart_moe_cpu"'),),
        _QUICKSTART_HOW,
    ),
    Exercised(
        "python -m rlhf_megatron.train --config quickstart_moe_cpu",
        (("tests/trainer/test_moe_e2e.py", 'run_train("quickstart_moe_cpu"'),),
        "a random tiny model of the preset's architecture, CPU-sized steps",
    ),
    # The MLA quickstart: tests/workers/test_workers_ray.py builds DeepSeek-V3 actor workers from
    # configs/quickstart_mla_cpu.yaml (generation, log-probs against transformers and vLLM, an
    # update, a weight sync) on a random tiny DeepSeek-V3. tools/make_tiny_model.py is tested for its
    # default (llama) build; --arch deepseek_v3 shares that code and ran in the guide's measured run.
    Exercised(
        "CONFIG=configs/quickstart_mla_cpu.yaml bash scripts/quickstart.sh",
        (
            ("tests/workers/test_workers_ray.py", '"quickstart_mla_cpu"'),
            ("tests/tools/test_make_tiny_model.py", "make_tiny_model.py"),
        ),
        _QUICKSTART_HOW + "; the MLA config runs through the workers, not the CLI",
    ),
    # The one-step-off quickstart: tests/trainer/test_async_e2e.py trains configs/quickstart_cpu.yaml
    # with the keys configs/quickstart_cpu_one_step_off.yaml sets (hybrid_engine false, rollout TP 1,
    # rollout_mode one_step_off), through the CLI.
    Exercised(
        "CONFIG=configs/quickstart_cpu_one_step_off.yaml bash scripts/quickstart.sh",
        (("tests/trainer/test_async_e2e.py", '"trainer.rollout_mode": "one_step_off"'),),
        _QUICKSTART_HOW + "; the preset's keys are given as overrides of quickstart_cpu",
    ),
    # The tool quickstart: tests/trainer_helpers.py's tool_run_inputs builds the policy with
    # tools/make_tiny_tool_model.py and tests/agent/test_multi_turn_e2e.py trains
    # configs/quickstart_tool_cpu.yaml through the CLI.
    Exercised(
        "CONFIG=configs/quickstart_tool_cpu.yaml bash scripts/quickstart.sh",
        (
            ("tests/trainer_helpers.py", "tools/make_tiny_tool_model.py"),
            ("tests/agent/test_multi_turn_e2e.py", '"quickstart_tool_cpu"'),
        ),
        _QUICKSTART_HOW,
    ),
    Exercised(
        "python -m rlhf_megatron.train --config quickstart_tool_cpu",
        (("tests/agent/test_multi_turn_e2e.py", '"quickstart_tool_cpu"'),),
        "a briefly pre-trained tool policy, CPU-sized steps",
    ),
    # The agent quickstart: the tool quickstart's policy (tools/make_tiny_tool_model.py, the
    # session's tool_run_inputs) trained through configs/quickstart_agent_cpu.yaml by
    # tests/agent/test_agent_e2e.py, its agent the example's file copied outside the project.
    Exercised(
        "CONFIG=configs/quickstart_agent_cpu.yaml bash scripts/quickstart.sh",
        (
            ("tests/trainer_helpers.py", "tools/make_tiny_tool_model.py"),
            ("tests/agent/test_agent_e2e.py", '"quickstart_agent_cpu"'),
        ),
        _QUICKSTART_HOW
        + "; the agent is examples/agents/calculator_agent.py with a subclass that fails on odd rows",
    ),
    # The LoRA quickstart: tests/trainer/test_lora_e2e.py trains configs/quickstart_lora_cpu.yaml
    # through the CLI; tests/models/test_convert_lora.py runs the two exports the script ends with.
    Exercised(
        "CONFIG=configs/quickstart_lora_cpu.yaml bash scripts/quickstart.sh",
        (
            ("tests/trainer/test_lora_e2e.py", 'CONFIG = "quickstart_lora_cpu"'),
            ("tests/models/test_convert_lora.py", '"lora-to-peft"'),
        ),
        _QUICKSTART_HOW,
    ),
    Exercised(
        "python -m rlhf_megatron.train --config quickstart_lora_cpu",
        (("tests/trainer/test_lora_e2e.py", 'CONFIG = "quickstart_lora_cpu"'),),
        "the shared tiny model, three steps",
    ),
    # The DAPO quickstart: tests/trainer/test_dapo_e2e.py trains configs/quickstart_cpu_dapo.yaml
    # through the CLI, colocated and one step off.
    Exercised(
        "python -m rlhf_megatron.train --config quickstart_cpu_dapo",
        (("tests/trainer/test_dapo_e2e.py", 'run_train("quickstart_cpu_dapo"'),),
        "the shared random tiny model with a reward of the test's own, CPU-sized steps, two steps",
    ),
    # The distillation quickstart: tests/trainer/test_distillation_e2e.py trains
    # configs/quickstart_opd_cpu.yaml through the CLI (its teacher replaced by the test's).
    Exercised(
        "python -m rlhf_megatron.train --config quickstart_opd_cpu",
        (("tests/trainer/test_distillation_e2e.py", 'run_train("quickstart_opd_cpu"'),),
        "the shared random tiny model as both student and teacher, one step",
    ),
    # `rlhf-megatron plan` on the presets: tests/config/test_config_planner.py runs the CLI's plan on
    # every model preset (spelled with .yaml there; both spellings name the same file).
    Exercised(
        "rlhf-megatron plan models/llama3.1_70b",
        (
            ("tests/config/test_config_planner.py", 'cli.main(["plan", preset])'),
            ("tests/config/test_config_planner.py", '"models/llama3.1_70b.yaml"'),
        ),
        "the same preset; the CLI's entry point called in process",
    ),
    # `parallelism: auto`'s ranking: tests/config/test_auto_layout.py calls the CLI's plan with --auto.
    Exercised(
        "rlhf-megatron plan quickstart_cpu --auto",
        (("tests/config/test_auto_layout.py", 'plan_main(["quickstart_cpu", "--auto"])'),),
        "the same command; the CLI's plan called in process",
    ),
    Exercised(
        "rlhf-megatron plan models/llama3.1_70b_lora",
        (
            ("tests/config/test_config_planner.py", 'cli.main(["plan", preset])'),
            ("tests/config/test_config_planner.py", '"models/llama3.1_70b_lora.yaml"'),
        ),
        "the same preset; the CLI's entry point called in process",
    ),
    # tools/gpu/measure.py --tiny: tests/tools/test_gpu_measure.py runs it on CPU with these flags.
    Exercised(
        ".venv/bin/python tools/gpu/measure.py --tiny --skip-tests --steps 1 --out /tmp/measure.json",
        (("tests/tools/test_gpu_measure.py", '"--tiny", "--skip-tests", "--steps", "1"'),),
        "the output goes to a temporary directory",
    ),
    # The stages before RL (docs/guides/stages.md): scripts/pipeline_cpu.sh runs the three configs
    # of configs/pipeline_cpu/ one after another (with the data tools and the exports between
    # them); tests/stages/test_stages_e2e.py builds the data with the same two tools, runs the SFT
    # and reward-model CLIs with those configs, exports both checkpoints and runs one step of the
    # pipeline's RL config with them.
    Exercised(
        "bash scripts/pipeline_cpu.sh",
        (
            ("tests/stages/test_stages_e2e.py", '("arith_sft.py", "sft"), ("arith_prefs.py", "prefs")'),
            ("tests/stages/test_stages_e2e.py", 'run_train(f"pipeline_cpu/{kind}"'),
            ("tests/stages/test_stages_e2e.py", 'run_train("pipeline_cpu/ppo"'),
            ("tests/stages/test_stages_e2e.py", '"global_step_3/reward_model"'),
        ),
        "a random tiny Llama, 128 rows and 3 steps a stage at lr 1e-3, one PPO step, temporary "
        "directories; the script's own shell lines are not run by a test",
    ),
    # The docs' own commands: this file runs both (the build into a temporary directory, the
    # generator into a temporary directory compared with the committed pages).
    Exercised(
        ".venv/bin/mkdocs build --strict --site-dir /tmp/rlhf-megatron-site",
        (("tests/test_docs.py", '"build", "--strict"'),),
        "a temporary site directory",
    ),
    Exercised(
        ".venv/bin/python tools/gen_config_reference.py",
        (("tests/test_docs.py", 'generator.main(["--out"'),),
        "written to a temporary directory and compared with the committed pages",
    ),
)


# ------------------------------------------------------------------------------------- helpers
def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """``(line number of the fence, lines)`` of every bash/sh/shell fenced block in ``path``."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if current is None:
            if SHELL_FENCE.match(line.strip()):
                current, start = [], number
        elif line.strip().startswith("```"):
            blocks.append((start, current))
            current = None
        else:
            current.append(line)
    assert current is None, f"{path}:{start}: a code block is never closed"
    return blocks


def _normalize(command: str) -> str:
    """One command as the shell splits it, comments dropped, words joined by single spaces."""
    return " ".join(shlex.split(command, comments=True))


def _commands(lines: list[str]) -> list[str]:
    """The commands of a block: a trailing backslash continues a line; comment-only lines and
    trailing comments are not commands."""
    out, pending = [], ""
    for line in lines:
        text = f"{pending} {line.strip()}" if pending else line.strip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        pending = ""
        command = _normalize(text)
        if command:
            out.append(command)
    return out


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "tools" / "gen_config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav) -> list[str]:
    """Every page path in mkdocs.yml's nav, depth first."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def _mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


# --------------------------------------------------------------------------------------- tests
def test_config_reference_is_up_to_date(tmp_path):
    """Every generated page (the RL config, the SFT and reward-model stages) equals what the
    generator writes now."""
    generator = _load_generator()
    assert generator.main(["--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == set(generator.PAGES)
    stale = [
        name
        for name in generator.PAGES
        if (REFERENCE_DIR / name).read_text() != (tmp_path / name).read_text()
    ]
    assert not stale, (
        f"docs/reference/{stale} out of date with the schema: "
        "run .venv/bin/python tools/gen_config_reference.py and commit the result"
    )


def _assert_page_lists_keys(text: str, keys: dict, patterns: list[str], page: str) -> None:
    """Every key of ``keys`` (``schema_keys``) in its section's table of ``text``, every pattern
    as a table row."""
    for key, info in keys.items():
        section, _, leaf = key.rpartition(".")
        if info.section:
            assert f"## `{key}`" in text, (page, key)
        else:
            heading = f"## `{section}`" if section else "## Top-level keys"
            table = text[text.index(heading) :]
            assert f"| `{leaf}` |" in table.split("\n## ", 1)[0], (page, key)
    for pattern in patterns:
        assert f"| `{pattern}` |" in text, (page, pattern)


def test_config_reference_covers_every_schema_key_and_ignored_key():
    from rlhf_megatron.config import easyr1
    from rlhf_megatron.config.keys import IGNORED_KEYS, RENAMED_KEYS, schema_keys

    patterns = [e.pattern for e in IGNORED_KEYS] + list(RENAMED_KEYS) + list(easyr1.RULES)
    patterns += [e.pattern for e in easyr1.IGNORED]
    _assert_page_lists_keys(REFERENCE.read_text(), schema_keys(), patterns, "config.md")


def test_stage_references_cover_every_stage_key_and_ignored_verl_key():
    from rlhf_megatron.config.keys import STAGE_IGNORED_KEYS, schema_keys
    from rlhf_megatron.config.schema_stages import RMConfig, SFTConfig

    patterns = [e.pattern for e in STAGE_IGNORED_KEYS]
    for page, schema in (("sft.md", SFTConfig), ("rm.md", RMConfig)):
        _assert_page_lists_keys((REFERENCE_DIR / page).read_text(), schema_keys(schema), patterns, page)


def test_site_builds_in_strict_mode(tmp_path):
    """Broken links and anchors, missing pages and pages left out of the nav fail the build
    (mkdocs.yml's `validation` turns each into a warning, and --strict into an error)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a problem here
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("config", "sft", "rm"):
        assert (tmp_path / "site" / "reference" / page / "index.html").is_file(), page


def test_every_shell_block_is_cluster_only_or_run_by_a_test():
    tested = {_normalize(e.command) for e in TESTED_COMMANDS}
    problems = []
    for page in _pages():
        for start, lines in _shell_blocks(page):
            where = f"{page.relative_to(ROOT)}:{start}"
            first = lines[0].strip() if lines else ""
            if first.startswith("# cluster only"):
                if not first.startswith(CLUSTER_ONLY) or not first[len(CLUSTER_ONLY) :].strip():
                    problems.append(f"{where}: write `{CLUSTER_ONLY} <what it needs>`")
                continue
            problems += [
                f"{where}: `{command}` is neither in a `{CLUSTER_ONLY} ...` block nor in TESTED_COMMANDS"
                for command in _commands(lines)
                if command not in tested
            ]
    assert not problems, "\n".join(problems) + "\n(the convention: docs/contributing.md)"


def test_tested_commands_are_shown_and_really_run_by_their_tests():
    shown = {
        command
        for page in _pages()
        for _, lines in _shell_blocks(page)
        if not (lines and lines[0].strip().startswith(CLUSTER_ONLY))
        for command in _commands(lines)
    }
    problems = []
    for entry in TESTED_COMMANDS:
        if _normalize(entry.command) not in shown:
            problems.append(f"`{entry.command}` is in TESTED_COMMANDS but no page shows it: remove it")
        for file, text in entry.runs:
            path = ROOT / file
            if not path.is_file():
                problems.append(f"`{entry.command}`: {file} does not exist")
            elif text not in path.read_text():
                problems.append(f"`{entry.command}`: {file} no longer contains {text!r}")
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page_that_reaches_every_page_in_one_click():
    text = README.read_text()
    assert text.startswith(README_OPENING), "README.md must open with the two commands, as they were"
    lines = text.count("\n")
    assert lines <= 150, f"README.md has {lines} lines; move detail into docs/ (under ~150)"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text)
    local = {link for link in links if not re.match(r"[a-z]+://", link)}
    missing = sorted(link for link in local if not (ROOT / link).exists())
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # docs/index.md is the site's own front page, which the README stands in for on GitHub.
    pages = [p for p in _nav_pages(_mkdocs_config()["nav"]) if p != "index.md"]
    unlinked = [p for p in pages if f"docs/{p}" not in local]
    assert not unlinked, f"README.md does not link to these pages of the site: {unlinked}"


def test_every_page_is_in_the_nav():
    nav = set(_nav_pages(_mkdocs_config()["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav, (
        f"in docs/ but not the nav: {sorted(pages - nav)}; in the nav only: {sorted(nav - pages)}"
    )


def test_user_facing_text_names_tasks_not_internal_labels():
    """Pages say "EasyR1's Qwen2.5-VL GRPO on geometry3k", not the label a task had while it
    was built ("seed 003", "issue #38"). File names and flags of the code are left alone."""
    label = re.compile(r"\b(?:[Ss]eed \d{3}|[Ii]ssue #\d+)")
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in _pages()
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if label.search(line)
    ]
    assert not found, "\n".join(found)
