#!/usr/bin/env bash
# `--vllm-source` on a real vLLM source tree: the pinned release's sdist from PyPI (a real source
# tree of the same version as the CPU build), made a git checkout, given a Python-only change, then
# rehearsed. Its record must name the commit, the dirty flag and the one changed file.
# Usage: tools/vllm_source_check.sh WORK_DIR [extra rehearse options]   (needs PyPI and the engine
# environment: run it through `.nox/engine/bin/python`'s PATH, or after `nox -s rehearse_tp8`)
set -euo pipefail
work=$(realpath -m "$1"); shift
python=${KIT_PYTHON:-.nox/engine/bin/python}
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute, the venv's own
mkdir -p "$work"
# pip cannot download this sdist without building its metadata (it needs torch at build time), so
# the archive is taken from PyPI's simple index, checked against the sha256 the index gives.
"$python" - "$work" <<'PY'
import hashlib, re, ssl, sys, urllib.request
from pathlib import Path
work = Path(sys.argv[1]); name = "vllm-0.32.0.tar.gz"
if not (work / name).is_file():
    ctx = ssl.create_default_context(cafile="/etc/ssl/certs/ca-certificates.crt") \
        if Path("/etc/ssl/certs/ca-certificates.crt").is_file() else None
    req = urllib.request.Request("https://pypi.org/simple/vllm/", headers={"Accept": "text/html"})
    html = urllib.request.urlopen(req, context=ctx).read().decode()
    url, sha = re.search(r'href="([^"]*' + re.escape(name) + r'#sha256=([0-9a-f]{64}))"', html).groups()
    data = urllib.request.urlopen(url, context=ctx).read()
    assert hashlib.sha256(data).hexdigest() == sha, "the sdist's sha256 is not PyPI's"
    (work / name).write_bytes(data)
print(f"sdist {work / name}: {hashlib.sha256((work / name).read_bytes()).hexdigest()}")
PY
rm -rf "$work/vllm-0.32.0"
tar --no-same-owner -xzf "$work/vllm-0.32.0.tar.gz" -C "$work"
cd "$work/vllm-0.32.0"
git init -q && git add -A && git -c user.name=kit -c user.email=kit@example.invalid commit -qm sdist
echo "checkout $PWD at $(git rev-parse HEAD)"
# A Python-only change that keeps behaviour: the head's input named before its projection.
"$python" - <<'PY'
from pathlib import Path
p = Path("vllm/model_executor/models/llama4_eagle.py")
old = "        hidden_states = self.fc(torch.cat((inputs_embeds, hidden_states), dim=-1))\n"
new = ("        # EAGLE's input: the next token's embedding beside the target's feature\n"
       "        eagle_input = torch.cat((inputs_embeds, hidden_states), dim=-1)\n"
       "        hidden_states = self.fc(eagle_input)\n")
s = p.read_text(); assert old in s; p.write_text(s.replace(old, new))
PY
git diff --stat
cd "$OLDPWD"
"$python" -m validate rehearse --vllm-source "$work/vllm-0.32.0" --run-dir "$work/run" "$@"
