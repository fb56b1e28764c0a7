"""Generated docs are fresh, shipped configs validate, no removed flag lingers, explain on three presets."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tidal.config import REMOVED, RULES, Environment, explain, explain_argv, parse, resolve
from tidal.config.args import PRESET_DIR, fields, preset_names
from tidal.config.docs import CLI_MD, CONFIGURATION_MD, cli_markdown, update_configuration

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3
CPU = Environment(cuda_available=False, host_memory=16 * GIB, cpu_count=2)
GPU8 = Environment(
    cuda_available=True, device_count=8, device_memory=80 * GIB, host_memory=1024 * GIB, tms_available=True
)


def test_cli_md_is_fresh():
    assert CLI_MD.read_text() == cli_markdown(), "docs/cli.md is stale: run `python -m tidal.config.docs --write`"


def test_cli_md_lists_every_flag_and_removed_flag():
    text = CLI_MD.read_text()
    for info in fields():
        assert f"`{info.flag}`" in text
    for entry in REMOVED:
        assert f"`{entry.flag}`" in text


def test_configuration_md_tables_are_fresh():
    text = CONFIGURATION_MD.read_text()
    assert text == update_configuration(text), (
        "docs/configuration.md is stale: run `python -m tidal.config.docs --write`"
    )
    for r in RULES:
        assert f"`{r.id}`" in text
    for entry in REMOVED:
        assert f"| `{entry.flag}` | {entry.version} |" in text


def _scanned_files() -> list[Path]:
    """Docs, examples, presets and scripts: where a stale flag would mislead users."""
    patterns = [
        "README.md",
        "docs/**/*.md",
        "examples/**/*",
        "tidal/presets/*.yaml",
        "scripts/**/*",
        "Makefile",
        ".ci/*",
    ]
    files = {p for pat in patterns for p in REPO.glob(pat) if p.is_file()}
    skip = {".venv", ".git", "runs", "node_modules", "__pycache__", ".pytest_cache"}
    for root, dirs, names in os.walk(REPO):  # shell scripts anywhere, without walking the venv
        dirs[:] = [d for d in dirs if d not in skip]
        files.update(Path(root) / n for n in names if n.endswith(".sh"))
    return sorted(files)


def _strip_registry_tables(path: Path, text: str) -> str:
    # The generated removed-flag tables are the registry's own documentation.
    if path == CONFIGURATION_MD:
        text = re.sub(r"<!-- begin generated: removed -->.*?<!-- end generated -->", "", text, flags=re.S)
    if path == CLI_MD:
        text = text.split("## Removed flags")[0]
    return text


@pytest.mark.parametrize("entry", REMOVED, ids=lambda e: e.flag)
def test_no_doc_example_preset_or_script_uses_a_removed_flag(entry):
    files = _scanned_files()
    assert CLI_MD in files and any(p.parent == PRESET_DIR for p in files)
    offenders = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        text = _strip_registry_tables(path, text)
        for n, line in enumerate(text.splitlines(), 1):
            # Prose that records the removal ("... was removed") is history, not a use.
            if (entry.flag in line or re.search(rf"\b{entry.key}\b", line)) and "removed" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert not offenders, f"{entry.flag} still used in {offenders}"


def _env_for(path: Path) -> Environment:
    text = path.read_text()
    return GPU8 if re.search(r"^device: cuda|qwen2.5-7b-8gpu|qwen2.5-0.5b-1gpu", text, re.M) else CPU


SHIPPED = sorted(PRESET_DIR.glob("*.yaml")) + sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_parses_and_validates(path):
    argv = ["--preset", path.stem] if path.parent == PRESET_DIR else ["--config", str(path)]
    cfg, prov = parse(argv)
    resolved = resolve(cfg, prov, _env_for(path))
    assert resolved.trainer.global_batch_size is not None
    assert resolved.weight_sync.update_weight_transport in ("tensor", "broadcast", "disk")


def test_examples_and_presets_exist():
    assert {"tiny-cpu", "qwen2.5-0.5b-1gpu", "qwen2.5-7b-8gpu"} <= set(preset_names())
    assert len(list((REPO / "examples").glob("*.yaml"))) >= 3


def test_tiny_cpu_preset_is_the_embedded_default():
    default, p1 = parse([])
    preset, p2 = parse(["--preset", "tiny-cpu"])
    a, b = resolve(default, p1, CPU), resolve(preset, p2, CPU)
    a.logging.output_dir = b.logging.output_dir = None  # time-stamped
    assert a == b


def _memory_lines(text: str) -> str:
    return text.split("memory plan")[1]


def test_explain_default_tiny_cpu():
    text = explain_argv([], CPU)
    assert "nothing is started" in text
    assert "  --device" in text and "derived (device: auto: no GPU visible)" in text
    assert re.search(r"--rollout-batch-size\s+32\s+default", text)
    assert re.search(r"--global-batch-size\s+256\s+derived \(batch:", text)
    assert re.search(r"optimizer steps per rollout\s+1\b", text)
    assert re.search(r"weight-sync buckets\s+1\b", text)
    plan = _memory_lines(text)
    assert "offload: NOT NEEDED for this model on this device" in plan
    assert "trainer rank (never paused)" in plan and "engine (never released)" in plan


def test_explain_shows_each_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: tiny-cpu\nn_samples_per_prompt: 4\n")
    text = explain_argv(["--config", str(path), "--lr", "0.01", "--offload-train"], CPU)
    assert re.search(r"--lr\s+0.01\s+flag \(--lr\)", text)
    assert re.search(rf"--n-samples-per-prompt\s+4\s+file \({re.escape(str(path))}\)", text)
    assert re.search(r"--model\s+tiny\s+preset \(tiny-cpu\)", text)
    plan = _memory_lines(text)
    assert "trainer rank (offload-train)" in plan
    assert re.search(r"grads\s+\S+ \S+\s+0 B\s+0 B", plan)  # grads discarded: nothing on device or host


def test_explain_qwen_05b_on_one_gpu_needs_no_offload():
    text = explain_argv(["--preset", "qwen2.5-0.5b-1gpu", "--assume-gpus", "1", "--assume-gpu-memory", "80GiB"], CPU)
    assert "assumed: 1 GPU(s) x 80 GiB" in text
    assert "qwen2.5-0.5b-shape (Qwen2ForCausalLM): 494M parameters" in text
    assert re.search(r"--memory-backend\s+tms\s+derived", text)
    assert re.search(r"--param-dtype\s+bf16", text)
    assert "offload: NOT NEEDED" in text
    assert re.search(r"weight-sync buckets\s+2\b", text)  # 942 MiB in bf16 / 512 MiB buckets


def test_explain_qwen_7b_on_eight_gpus_releases_engines_only():
    text = explain_argv(
        [
            "--preset",
            "qwen2.5-7b-8gpu",
            "--assume-gpus",
            "8",
            "--assume-gpu-memory",
            "80GiB",
            "--assume-host-memory",
            "1TiB",
        ],
        CPU,
    )
    assert "7.62B parameters" in text
    assert re.search(r"optimizer steps per rollout\s+4\b", text)
    assert re.search(r"samples per rank per step\s+32\b", text)
    assert re.search(r"rollout engines\s+8\b", text)
    assert re.search(r"--offload-rollout\s+True\s+derived \(offload-needed: needed", text)
    assert re.search(r"--offload-train\s+False\s+derived \(offload-needed: not needed", text)
    plan = _memory_lines(text)
    assert re.search(r"no offload .*: does not fit", plan)
    assert re.search(r"offload rollout .*: fits", plan)
    # Each rank holds 1/8 of the fp32 weights: 7.62e9 * 4 / 8 bytes = 3.55 GiB.
    assert re.search(r"weights\s+3.55 GiB", plan)


def test_explain_with_offload_shows_host_memory():
    cfg, prov = parse(["--preset", "qwen2.5-7b-8gpu", "--offload"])
    cfg = resolve(cfg, prov, GPU8)
    text = explain(cfg, prov, GPU8)
    # weights 3.55 + optimizer 7.09 GiB per rank on the host, 8 ranks: 85.1 GiB per node.
    assert "host memory while the trainer is paused: 85.1 GiB per node" in text
    assert re.search(r"optimizer\s+7.09 GiB\s+0 B\s+7.09 GiB", text)
