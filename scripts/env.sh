# Sourced by scripts/test, scripts/demo and scripts/docs: creates .venv and installs the package
# with its dev and docs extras, again whenever pyproject.toml changes. Needs only Python >= 3.11
# on the PATH.
set -eu
PYTHON=${PYTHON:-python3}
stamp=.venv/.installed-$(cksum < pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev,docs]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
