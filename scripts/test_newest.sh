#!/usr/bin/env bash
# The tests marked `newest` (pytest.ini: all of tests/ops and tests/hf, and the engine tests that exercise the HF
# models' own code) on the newest Triton and transformers (requirements-newest.txt), run through Triton's CPU
# interpreter, after the main suite has covered the pinned versions. transformers 5.24 renamed the attention's
# KV-cache argument, which only a generate test caught, on the newest. The other engine tests use the models only
# as fixtures; they run once, on the pinned versions.
# They run in a venv over the environment that runs the main suite (PYTHON, e.g. the project's .venv: a .pth
# file puts its site-packages behind the venv's own, and the system's after both) that holds only the packages
# whose pinned-newest version differs, so the main environment is never touched. The venv is rebuilt whenever
# requirements-newest.txt or that environment's location changes. Fails on no tests, nothing passed, or a version
# that is not the one pinned (a run that silently tested the old versions would look green).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REQS=requirements-newest.txt
VENV=build/newest
VPY=$VENV/bin/python
# Where PYTHON is a venv, its site-packages (a venv made by a venv's Python sees only the base system's).
OUTER_SITE=$("$PY" -c "import sys, sysconfig; print(sysconfig.get_paths()['purelib'] if sys.prefix != sys.base_prefix else '')")
STAMP="$(cat "$REQS")
outer: $OUTER_SITE"

if [ "$(cat "$VENV/stamp" 2>/dev/null)" != "$STAMP" ]; then
  rm -rf "$VENV"
  # No pip in the venv (ensurepip is missing on some system Pythons): the outer pip installs into it.
  "$PY" -m venv --without-pip --system-site-packages "$VENV"
  if [ -n "$OUTER_SITE" ]; then
    SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "import site; site.addsitedir('$OUTER_SITE')" > "$SITE/outer-environment.pth"
  fi
  "$PY" -m pip --python "$VPY" install -q --disable-pip-version-check -r "$REQS"
  printf '%s' "$STAMP" > "$VENV/stamp"
fi

"$VPY" - "$REQS" <<'PYEOF'
import importlib.metadata, sys
pins = [line.split("#")[0].strip() for line in open(sys.argv[1])]
wrong = []
for name, version in (pin.split("==") for pin in pins if pin):
    found = importlib.metadata.version(name)
    print(f"newest: {name} {found}")
    if found != version:
        wrong.append(f"{name} {found} (pinned {version})")
if wrong:
    sys.exit("newest: not the pinned versions: " + ", ".join(wrong))
PYEOF

# The interpreter path on every machine: this run checks the newest versions' Python semantics; compiled
# GPU kernels are the main suite's job (and a GPU machine has the image's Triton).
TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= "$VPY" -m pytest -p no:cacheprovider -m "newest and not slow" tests \
  --junitxml="$VENV/junit.xml" "$@"
"$VPY" - "$VENV/junit.xml" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
passed = int(suite.get("tests")) - sum(int(suite.get(k, 0)) for k in ("skipped", "failures", "errors"))
if passed <= 0:
    sys.exit("newest: no test passed (all skipped?)")
PYEOF
