#!/usr/bin/env bash
# kvtier as a user installs it: build the wheel and the sdist (the wheel from the sdist), check
# them with twine, run README's install blocks as they are in a new directory holding only
# the wheel, and run every `kvtier` subcommand in that environment (torch and the wheel, no
# extras): each one's --help, and those that need no engine for real. Then README's block
# that adds vLLM's CPU build (about 3 minutes and 3.4 GB; --no-vllm skips it).
#
#   scripts/check_install.sh [--no-vllm]        # PYTHON=python3.12 for another interpreter
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WITH_VLLM=1
for arg in "$@"; do
  case $arg in
    --no-vllm) WITH_VLLM=0 ;;
    *) echo "usage: scripts/check_install.sh [--no-vllm]" >&2; exit 2 ;;
  esac
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-check-install.XXXXXX")
LOG=$WORK/log
trap 'status=$?; [ $status = 0 ] || { echo "check_install: failed (exit $status) at: $STEP"; tail -n 60 "$LOG"; }; rm -rf "$WORK"' EXIT
unset $(env | grep -o '^KVTIER_[A-Z_]*' || true)  # the defaults, as a new user has them
export PIP_DISABLE_PIP_VERSION_CHECK=1
START=$SECONDS
STEP=start

step() { STEP=$1; echo "check_install: $1"; echo "== $1" >>"$LOG"; }
fail() { echo "check_install: $*" >&2; exit 1; }

readme_block() {  # the ```bash block that follows README's <!-- $1: ... --> line
  awk -v marker="<!-- $1:" '
    index($0, marker) == 1 { found = 1; next }
    found && /^```bash$/ { inside = 1; next }
    inside && /^```$/ { exit }
    inside { print }' "$ROOT/README.md"
}

run_readme_block() {  # run block $1 in $WORK/try, the environment's bin on PATH once it exists
  local block
  block=$(readme_block "$1")
  [ -n "$block" ] || fail "README.md has no \`\`\`bash block after a '<!-- $1:' line"
  (cd "$WORK/try" && PATH="$WORK/try/kvtier-env/bin:$PATH" bash -euxo pipefail -c "$block") >>"$LOG" 2>&1
}

step "copy the source (tracked and untracked files, not ignored ones)"
mkdir -p "$WORK/src" "$WORK/try/dist"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf -) \
  2>>"$LOG" | tar -xf - -C "$WORK/src"

step "build the sdist and the wheel (python -m build), check them (twine check)"
"$PYTHON" -m venv "$WORK/tools" >>"$LOG" 2>&1
"$WORK/tools/bin/pip" install -q build twine >>"$LOG" 2>&1
(cd "$WORK/src" && "$WORK/tools/bin/python" -m build --outdir "$WORK/dist" .) >>"$LOG" 2>&1
ls "$WORK"/dist/kvtier-*.whl "$WORK"/dist/kvtier-*.tar.gz >/dev/null
"$WORK/tools/bin/twine" check --strict "$WORK"/dist/* >>"$LOG" 2>&1
cp "$WORK"/dist/kvtier-*.whl "$WORK/try/dist/"

step "README's table of extras has every extra"
"$PYTHON" - "$ROOT" <<'EOF' || fail "README.md's table of extras is not pyproject.toml's"
import pathlib, sys, tomllib
root = pathlib.Path(sys.argv[1])
extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
missing = [name for name in extras if f"| `{name}` |" not in (root / "README.md").read_text()]
sys.exit(f"extras without a row in README.md: {missing}" if missing else 0)
EOF

step "README's install block, in a new directory holding only the wheel"
run_readme_block readme-install
BIN=$WORK/try/kvtier-env/bin
KVTIER=$BIN/kvtier
"$BIN/python" - <<'EOF' || fail "the plain install has packages it should not"
import importlib.util, sys
extras = ("matplotlib", "tqdm", "aiofiles", "redis", "mooncake", "pynvml", "vllm", "pytest")
present = [name for name in extras if importlib.util.find_spec(name)]
sys.exit(f"extras installed without being asked for: {present}" if present else 0)
EOF

step "every subcommand's --help"
COMMANDS=$("$BIN/python" -c 'from kvtier.cli.main import app
print(" ".join(c.name or c.callback.__name__ for c in app.registered_commands))')
[ -n "$COMMANDS" ] || fail "kvtier has no commands"
HELP=$("$KVTIER" --help)
for command in $COMMANDS; do
  "$KVTIER" "$command" --help >>"$LOG" 2>&1 || fail "kvtier $command --help failed"
  grep -qE "[│ ]$command " <<<"$HELP" || fail "kvtier --help does not list $command"
done

step "kvtier version, config"
[ "$("$KVTIER" version)" = "$("$BIN/python" -c 'import importlib.metadata as m; print(m.version("kvtier"))')" ] \
  || fail "kvtier version is not the installed version"
"$KVTIER" config >>"$LOG"
"$KVTIER" config --json | "$BIN/python" -c 'import json, sys; assert json.load(sys.stdin)["config"]'
code=0
KVTIER_COMPRESSION=lz4 "$KVTIER" config >>"$LOG" 2>&1 || code=$?
[ "$code" = 2 ] || fail "kvtier config with a bad value exited $code, not 2"

step "kvtier bench (small sizes)"
"$KVTIER" bench --size 8MiB --depths 1,4 --disk-path "$WORK/bench-disk" --out "$WORK/bench-out" >>"$LOG" 2>&1
[ -s "$WORK/bench-out/bench.json" ] || fail "kvtier bench wrote no bench.json"
grep -q "matplotlib is not installed" "$LOG" || fail "kvtier bench did not say there is no plot"

step "a store serving metrics: kvtier stats, kvtier top"
mkdir -m 700 "$WORK/cache"
"$BIN/python" - "$WORK/cache" "$KVTIER" >>"$LOG" 2>&1 <<'EOF' || fail "kvtier stats or top failed"
import json, socket, subprocess, sys
import torch
from kvtier import KVLayout, KVStore
cache, kvtier = sys.argv[1], sys.argv[2]
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
layout = KVLayout(num_layers=2, kv_heads=2, head_size=16)
config = {"chunk_tokens": 16, "host_capacity": "64KiB", "disk_paths": [cache],
          "disk_capacity": "1MiB", "metrics_port": port}
with KVStore(layout, config, model="check-install") as store:
    kv = torch.randn(layout.shape(64)).to(torch.bfloat16)
    store.put(list(range(64)), kv)
    store.flush()
    assert store.get(list(range(64)), torch.empty_like(kv)) == 64
    url = f"127.0.0.1:{port}"
    for args in (["stats", url], ["top", url, "--once", "--interval", "0.2"]):
        subprocess.run([kvtier, *args], check=True, timeout=60)
    top = subprocess.run([kvtier, "top", url, "--json", "--interval", "0.2"], check=True,
                         timeout=60, capture_output=True, text=True)
    (view,) = json.loads(top.stdout)
    assert view["role"] == "store" and view["tiers"][0]["hits"] == 4, view
EOF

step "kvtier inspect, verify, gc, clear on that store's cache; kvtier gpu"
"$KVTIER" inspect "$WORK/cache" >>"$LOG"
"$KVTIER" inspect "$WORK/cache" --json | "$BIN/python" -c 'import json, sys
(ns,) = json.load(sys.stdin)["namespaces"]
assert ns["status"] == "ok" and ns["chunks"] == 4 and ns["model"] == "check-install", ns'
"$KVTIER" verify "$WORK/cache" --json | "$BIN/python" -c 'import json, sys
report = json.load(sys.stdin)
assert report["problems"] == 0 and report["namespaces"][0]["ok"] == 4, report'
"$KVTIER" gc "$WORK/cache" --older-than 1d --dry-run >>"$LOG"
"$KVTIER" clear "$WORK/cache" --yes >>"$LOG"
[ -z "$(ls -A "$WORK/cache")" ] || fail "kvtier clear left $(ls -A "$WORK/cache")"
code=0
"$KVTIER" gpu >"$WORK/gpu.out" 2>&1 || code=$?
cat "$WORK/gpu.out" >>"$LOG"
[ "$code" = 1 ] && grep -q "nvidia-ml-py is not installed" "$WORK/gpu.out" \
  || fail "kvtier gpu without the gpu extra exited $code: $(cat "$WORK/gpu.out")"

if [ "$WITH_VLLM" = 1 ]; then
  step "README's block adding vLLM's CPU build"
  run_readme_block readme-install-vllm
  "$KVTIER" --help >/dev/null
fi
echo "check_install: ok in $((SECONDS - START)) s"
