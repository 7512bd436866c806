"""``rlsup checkpoints list|latest|verify`` and restart selection on every trainer layout of issue 18.

Each layout's ``bench_tree`` (tests/*_builders.py, built from one real or source-derived save) makes a
few steps with the newest one broken the way a killed save leaves it; the CLI, auto-detection and
``choose_resume`` must all name the same older, complete step.
"""

from __future__ import annotations

from pathlib import Path


from supervisor import layouts

ROOT = Path(__file__).resolve().parents[2]
TREES = {
    "hf": ("hf_builders", "bench_tree"),
    "deepspeed": ("deepspeed_builders", "bench_tree"),
    "lightning": ("lightning_builders", "bench_tree"),
    "nemo": ("source_builders", "nemo_bench_tree"),
    "nemo-rl": ("source_builders", "nemo_rl_bench_tree"),
    "torchtitan": ("source_builders", "torchtitan_bench_tree"),
}


def test_readme_layout_table_lists_every_layout() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Trainer layouts rlsup understands"):]
    section = section[:section.index("\n## ")]
    rows = {line.split("|")[1].strip().split()[0].strip("`,") for line in section.splitlines()
            if line.startswith("| `")}
    assert set(layouts.LAYOUT_NAMES) <= rows, set(layouts.LAYOUT_NAMES) - rows
    docs = (ROOT / "docs" / "layouts.md").read_text()
    for name in TREES:
        assert f"(`{name}`)" in docs, f"docs/layouts.md has no section for {name}"
