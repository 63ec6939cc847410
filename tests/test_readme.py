"""The README's snippets run as written, on the CPU.

A fenced block right after `<!-- test: cpu -->` is run as a script by a fresh plain `python` process, without the
launcher's variables (RANK, WORLD_SIZE, ...) that this test process has, in a temporary directory that holds the
block marked `<!-- test: ds.json -->` as `ds.json` (the README's minimal config, which the snippets load). The
package is imported from this checkout, as an installed one would be.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^<!-- test: (?P<tag>\S+) -->\n```(?P<lang>\w+)\n(?P<body>.*?)^```$", re.S | re.M)
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "CROSS_RANK", "CROSS_SIZE", "DS_ACCELERATOR", "TRITON_INTERPRET")
TIMEOUT_S = 600


def _blocks(tag: str) -> list[tuple[str, str]]:
    return [(m["lang"], m["body"]) for m in BLOCK.finditer(README.read_text()) if m["tag"] == tag]


CPU_BLOCKS = _blocks("cpu")


def test_the_readme_marks_its_snippets():
    """The marks are found (a README edit that drops or garbles them would turn the tests below into none)."""
    assert len(CPU_BLOCKS) >= 2 and all(lang == "python" for lang, _ in CPU_BLOCKS), CPU_BLOCKS
    assert [lang for lang, _ in _blocks("ds.json")] == ["json"]


def test_the_minimal_config_is_valid():
    from stronghold.config import parse_stronghold_section
    from stronghold.deepspeed_keys import check_deepspeed_keys

    (_, body), = _blocks("ds.json")
    config = json.loads(body)
    check_deepspeed_keys(config)
    parse_stronghold_section(config)


@pytest.mark.slow  # each snippet is a fresh Python process that imports DeepSpeed and trains
@pytest.mark.parametrize("index", range(len(CPU_BLOCKS)), ids=[f"snippet{i + 1}" for i in range(len(CPU_BLOCKS))])
def test_snippet_runs_as_written_with_plain_python(index, tmp_path):
    _, body = CPU_BLOCKS[index]
    (_, config), = _blocks("ds.json")
    (tmp_path / "ds.json").write_text(config)
    (tmp_path / "snippet.py").write_text(body)
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"README snippet {index + 1} failed:\n{body}\n--- output ---\n" + \
        (done.stdout + done.stderr)[-6000:]
