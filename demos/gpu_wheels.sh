#!/usr/bin/env bash
# The media and web packages `diffcast serve --no-playground` and demos/bench_live.py need on a GPU
# machine, as wheels for its Python (3.12, x86-64) under .whl/ (ignored by git), the versions this
# project's venv runs. The GPU machines' image has torch, numpy, opencv, tqdm, rich, safetensors,
# scikit-image, h11, httpx, prometheus-client, uvloop and the like, but none of these.
#
# A run carries at most 64 MiB with the working tree (~21 MB), so the wheels come in two parts, each
# installed by its own call on the same warm machine (/tmp/site stays between calls):
#   call 1, carry [".whl/av"]:   PyAV alone (~35 MB)
#   call 2, carry [".whl/rest"]: the rest (~11 MB), then the run itself
# each starting with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# Gradio (the playground) is left out: its wheel alone would fill a run; serve with --no-playground.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rest=(
  aiortc==1.16.0 aioice==0.13.0 pyee==13.0.1 pylibsrtp==1.0.0 google-crc32c==1.9.0 dnspython==2.9.2
  ifaddr==0.2.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pyOpenSSL==26.4.0
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 uvicorn==0.54.0 websockets==17.4 httptools==0.9.0 python-multipart==0.0.34
  python-osc==1.10.2
)
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
download() {  # folder, packages...
  local into=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 "${platforms[@]}" -d "$into" "$@"
}
download .whl/av av==18.1.0
download .whl/rest "${rest[@]}"
du -sh .whl/av .whl/rest
