#!/usr/bin/env bash
# The wheel is a real package: build it, install it (and only its own dependencies) into a fresh
# virtual environment, and from there, outside the repository, list the recipe catalog and run a
# 2-rank fit. .ci/run calls this before pytest so that a broken package fails fast.
#
#   .ci/wheel_check.sh          (from anywhere; 2-3 minutes on a 2-core machine: pip install ~1 min, 2-rank fit ~40 s)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/lnn-wheel-check.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
STARTED=$SECONDS
step() { echo "wheel check: $* (at $((SECONDS - STARTED)) s)"; }
fail() { echo "wheel check: FAILED: $*" >&2; exit 1; }

# 1. Build from a clean copy of the source tree (the files git tracks or would track), so that no
#    build/ or *.egg-info left in the working tree leaks stale files into the wheel.
step "copying the source tree"
mkdir -p "$TMP/src" "$TMP/dist" "$TMP/run"
(
    cd "$ROOT"
    git ls-files -z --cached --others --exclude-standard \
        | python -c 'import os, sys; sys.stdout.write("".join(p + "\0" for p in sys.stdin.read().split("\0") if p and os.path.lexists(p)))' \
        | tar --null -cf - -T - | tar -xf - -C "$TMP/src"
)
step "building the wheel"
python -m pip wheel -q --no-deps -w "$TMP/dist" "$TMP/src" >"$TMP/build.log" 2>&1 || { tail -40 "$TMP/build.log"; fail "pip wheel"; }
WHEEL="$(ls "$TMP"/dist/lightning_nnscaler-*.whl)"
echo "wheel check: built $(basename "$WHEEL")"

# 2. Every module and catalog file of the source package is in the wheel.
python - "$WHEEL" "$TMP/src" <<'EOF'
import sys, zipfile
from pathlib import Path

wheel, source = sys.argv[1], Path(sys.argv[2])
shipped = set(zipfile.ZipFile(wheel).namelist())
wanted = [p.relative_to(source).as_posix() for p in sorted((source / "lightning_nnscaler").rglob("*")) if p.suffix in {".py", ".yaml"}]
wanted.append("lightning_nnscaler_torchvision.py")  # the torch.backends entry point (pyproject.toml)
missing = [name for name in wanted if name not in shipped]
if missing:
    sys.exit("wheel check: FAILED: the wheel lacks " + ", ".join(missing) + " (pyproject.toml [tool.setuptools.*])")
print(f"wheel check: the wheel holds all {len(wanted)} .py/.yaml files of lightning_nnscaler/ and its entry point module")
EOF

# 3. A fresh virtual environment (no system site-packages): the wheel's own dependencies must do.
#    pip reads this machine's pip config there too; --no-compile skips byte-compiling all of torch.
step "installing the wheel into a fresh virtual environment"
python -m venv "$TMP/venv"
VENV_PYTHON="$TMP/venv/bin/python"
INSTALL_STARTED=$SECONDS
"$TMP/venv/bin/pip" install --no-compile -c "$ROOT/constraints.txt" "$WHEEL" >"$TMP/install.log" 2>&1 \
    || { grep -v "is ignored: it is neither a file nor a directory" "$TMP/install.log" | tail -40; fail "pip install of the wheel"; }
echo "wheel check: installed in $((SECONDS - INSTALL_STARTED)) s"
"$VENV_PYTHON" "$ROOT/.ci/check_torch_pin.py" "$ROOT/constraints.txt"

# 4. From a directory outside the repository, so that only the installed wheel is importable.
cd "$TMP/run"
step "lightning-nnscaler recipes"
env -u PYTHONPATH "$TMP/venv/bin/lightning-nnscaler" recipes >"$TMP/recipes.txt" || { cat "$TMP/recipes.txt"; fail "lightning-nnscaler recipes"; }
listed="$(awk '{print $1}' "$TMP/recipes.txt")"
# The 7 built-in recipes, and any catalog file added since.
expected="$(printf '%s\n' coshard dp hybrid sp tp zero1 zero3; sed -n 's/^name:[[:space:]]*//p' "$ROOT"/lightning_nnscaler/recipes/*.yaml)"
expected="$(sort -u <<<"$expected")"
for name in $expected; do
    grep -qx "$name" <<<"$listed" || { cat "$TMP/recipes.txt"; fail "lightning-nnscaler recipes does not list $name"; }
done
echo "wheel check: lightning-nnscaler recipes lists all $(wc -l <<<"$expected") recipes:" $expected

step "every recipe verified, then a 2-rank fit (strategy=nnscaler_tp), from the installed wheel"
cp "$ROOT/.ci/wheel_fit.py" "$TMP/run/wheel_fit.py"
env -u PYTHONPATH "$VENV_PYTHON" wheel_fit.py >"$TMP/fit.log" 2>&1 || { tail -60 "$TMP/fit.log"; fail "the 2-rank fit exited non-zero"; }
verified="$(grep -c "^wheel fit: recipe .* verified" "$TMP/fit.log" || true)"
[ "$verified" -eq "$(wc -l <<<"$expected")" ] || { tail -60 "$TMP/fit.log"; fail "$verified recipes verified, expected $(wc -l <<<"$expected")"; }
grep "^wheel fit: recipe" "$TMP/fit.log"
grep "^wheel fit: OK" "$TMP/fit.log" || { tail -60 "$TMP/fit.log"; fail "the 2-rank fit printed no loss"; }
step "passed"
